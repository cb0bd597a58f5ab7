"""gradcomp on torchft: compressed DDP across replica groups that die, rejoin and heal.

The real torchft (its lighthouse in this process, one Manager a replica process) on Gloo:
three replica groups train; one is killed at a step's start, after the quorum and before
its all-reduces, and restarted three steps later. The survivors discard the failed step
with its residuals, go on as two, and take the restarted replica back; it heals from a
peer with no residuals of its own, and from then on every replica holds the same weights,
bit for bit."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

torchft = pytest.importorskip("torchft", reason="torchft has wheels for Linux x86-64 only")

from tests.integrations.torchft_setup import one_replica_group  # noqa: E402

REPLICA = Path(__file__).with_name("torchft_replica.py")
STEPS, DIE_AT = 12, 4


class _Replica:
    """A replica process and the JSON lines it printed."""

    def __init__(
        self, lighthouse: str, index: int, compressor: str, out: Path, *options: str, steps: int = STEPS
    ):
        command = [
            sys.executable,
            str(REPLICA),
            lighthouse,
            str(index),
            str(steps),
            compressor,
            str(out),
            *options,
        ]
        self.log = out.with_suffix(f".{time.monotonic_ns()}.log")
        self.process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=self.log.open("w"), text=True)
        self.records: list[dict] = []
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.records.append(json.loads(line))

    def wait(self, seconds: float = 120) -> int:
        code = self.process.wait(seconds)
        self.reader.join(seconds)
        return code

    def steps(self) -> list[dict]:
        return [r for r in self.records if "step" in r]


def _until(condition, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "the replicas did not get there in time"
        time.sleep(0.02)


def _run(
    tmp_path: Path,
    compressor: str,
    *options: str,
    die_at: int = DIE_AT,
    hold_at: int = DIE_AT + 3,
    steps: int = STEPS,
) -> tuple[list[_Replica], list[dict], list[dict]]:
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0", min_replicas=2, join_timeout_ms=5000, heartbeat_timeout_ms=500
    )
    try:
        go, rejoined = tmp_path / "go", tmp_path / "rejoined"
        hold = ("--hold-at", str(hold_at), "--hold-gate", str(rejoined))
        replicas = [
            _Replica(
                lighthouse.address(),
                i,
                compressor,
                tmp_path / f"weights{i}.pt",
                "--gate",
                str(go),
                *(("--die-at", str(die_at)) if i == 2 else hold),
                *options,
                steps=steps,
            )
            for i in range(3)
        ]
        _until(lambda: all(any("ready" in r for r in replica.records) for replica in replicas))
        go.touch()
        assert replicas[2].wait() == 1
        killed = replicas[2].steps()
        replicas[2] = _Replica(
            lighthouse.address(), 2, compressor, tmp_path / "weights2.pt", *options, steps=steps
        )
        _until(lambda: any("ready" in r for r in replicas[2].records))
        rejoined.touch()
        codes = [replica.wait() for replica in replicas]
        logs = "\n".join(
            replica.log.read_text()[-3000:] for replica in replicas if replica.process.returncode
        )
        assert codes == [0, 0, 0], logs
        return replicas, killed, replicas[2].steps()
    finally:
        lighthouse.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(
    "compressor, options",
    [("int8", ()), ("topk:ratio=0.1", ("--async-quorum",))],
    ids=["int8-sync-quorum", "topk-async-quorum"],
)
def test_a_killed_replica_group_heals_and_every_replica_ends_bitwise_equal(tmp_path, compressor, options):
    replicas, killed, healed = _run(tmp_path, compressor, *options)
    survivors = [replica.steps() for replica in replicas[:2]]
    for records in survivors:
        committed = [r["step"] for r in records if r["committed"]]
        assert committed == list(range(STEPS)), "a survivor committed every step once, in order"
        discarded = [r for r in records if not r["committed"]]
        assert len(discarded) <= 1
        for r in discarded:  # the failed step's residuals were put back
            assert r["residual_sq"] == r["residual_sq_before"] and r["step"] == DIE_AT
        sizes = [r["participants"] for r in records if r["committed"]]
        assert sizes[0] == 3 and 2 in sizes and sizes[-1] == 3, sizes
        assert records[-1]["bytes_sent"] < records[-1]["dense_bytes"] / 2
    assert [r["step"] for r in killed] == list(range(DIE_AT))
    assert healed[0]["healed"] and healed[0]["residual_sq_before"] == 0, "healed with no residuals of its own"
    assert [r["step"] for r in healed[1:]] == list(range(DIE_AT + 4, STEPS))
    # Every committed step: the same weights on every replica that committed it.
    by_step: dict[int, set[str]] = {}
    for records in (*survivors, killed, healed[1:]):
        for r in records:
            if r["committed"]:
                by_step.setdefault(r["step"], set()).add(r["weights"])
    assert all(len(hashes) == 1 for hashes in by_step.values()), by_step
    weights = [torch.load(tmp_path / f"weights{i}.pt", weights_only=True) for i in range(3)]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][name], other[name]) for name in weights[0])


@pytest.mark.slow
def test_diloco_across_replica_groups_discards_a_failed_exchange_and_heals_a_restarted_group(tmp_path):
    """gradcomp's DiLoCo with manager=: H = 4 over 24 inner steps, int4. Replica group 2 dies
    inside the exchange at step 8 and restarts; it joins its peers' exchange at 16."""
    replicas, killed, healed = _run(tmp_path, "int4", "--diloco", "4", die_at=8, hold_at=13, steps=24)
    survivors = [[r for r in replica.records if "step" in r] for replica in replicas[:2]]
    for records in survivors:
        assert [r["step"] for r in records] == [4, 8, 12, 16, 20, 24]
        failed = records[1]
        assert not failed["committed"] and all(r["committed"] for r in records[2:])
        # Discarded: the weights back at the anchor the exchange started from, the residuals as before.
        assert failed["weights"] == failed["anchor"] == records[0]["anchor"]
        assert failed["residual_sq"] == failed["residual_sq_before"]
        assert records[2]["participants"] == 2 and records[-1]["participants"] == 3
        assert records[-1]["bytes_sent"] < records[-1]["dense_bytes"] / 4
    assert [r["step"] for r in killed] == [4]
    joined = next(r for r in replicas[2].records if "joined" in r)
    assert joined["joined"] == 16 and joined["healed"]
    assert [r["step"] for r in healed] == [20, 24]
    # Every exchange: one anchor on every replica group that committed it (the healed one's
    # join included), and the weights equal to it.
    by_step: dict[int, set[str]] = {16: {joined["anchor"]}}
    for records in (*survivors, killed, healed):
        for r in records:
            if r["committed"]:
                by_step.setdefault(r["step"], set()).add(r["anchor"])
                assert r["weights"] == r["anchor"]
    assert all(len(anchors) == 1 for anchors in by_step.values()), by_step
    weights = [torch.load(tmp_path / f"weights{i}.pt", weights_only=True) for i in range(3)]
    for other in weights[1:]:
        assert all(torch.equal(weights[0][name], other[name]) for name in weights[0])


@pytest.fixture(scope="module")
def manager():
    with one_replica_group(lambda state: None, dict, "unit") as made:
        yield made


def test_settings_torchft_cannot_run_raise(manager):
    from gradcomp.integrations.torchft import Compression

    with pytest.raises(ValueError, match="fixed compressor"):
        Compression(manager, "auto", key="auto")
    with pytest.raises(ValueError, match="flat algorithms"):
        Compression(manager, "int8", algorithm="hierarchical", key="hierarchical")
    with pytest.raises(ValueError, match="takes algorithm 'dense'"):
        Compression(manager, "powersgd", algorithm="allgather", key="powersgd")


def test_an_all_reduce_before_the_quorum_raises(manager):
    from gradcomp.integrations.torchft import Compression

    compression = Compression(manager, "int8", key="early")
    with pytest.raises(RuntimeError, match="start_quorum"):
        compression.all_reduce(torch.ones(4), "w")
    with pytest.raises(TypeError, match="float32, float16"):
        compression.all_reduce(torch.ones(4, dtype=torch.int64), "w")


def test_a_peer_with_another_compressor_is_refused_at_the_heal(manager):
    from gradcomp.integrations.torchft import Compression

    mine, peer = Compression(manager, "int8", key="mine"), Compression(manager, "int4", key="peer")
    with pytest.raises(ValueError, match="same compressor"):
        mine._load_heal_state(peer._heal_state())


def test_a_heal_keeps_the_replicated_state_and_no_residuals(manager):
    from gradcomp.collectives.low_rank import warm_start_key
    from gradcomp.integrations.torchft import Compression

    peer, healing = Compression(manager, "powersgd", key="p1"), Compression(manager, "powersgd", key="p2")
    q = torch.randn(8, 2)
    peer.feedback.set(warm_start_key(3), q)
    peer.feedback.residual(3, torch.zeros(40)).fill_(1.0)
    peer.load_state_dict(peer.state_dict())  # a commit's snapshot, as should_commit takes it
    healing.feedback.residual(3, torch.zeros(40)).fill_(5.0)
    healing._load_heal_state(peer._heal_state())
    assert healing.feedback.keys() == [warm_start_key(3)]
    assert torch.equal(healing.feedback.get(warm_start_key(3)), q.reshape(-1))


def test_the_communicator_is_the_configured_group_and_an_unconfigured_one_is_named():
    from torchft import ProcessGroupGloo

    from gradcomp.integrations.torchft import communicator_of

    with pytest.raises(RuntimeError, match="start_quorum"):
        communicator_of(ProcessGroupGloo())
    with pytest.raises(TypeError, match="ProcessGroupGloo and ProcessGroupNCCL"):
        communicator_of(object())


def test_diloco_settings_torchft_cannot_take_raise(manager):
    import gradcomp

    model = torch.nn.Linear(4, 2)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="overlap_steps=0"):
        gradcomp.DiLoCo(model, inner, 4, manager=manager, overlap_steps=1)
    with pytest.raises(ValueError, match="no group or node_size"):
        gradcomp.DiLoCo(model, inner, 4, manager=manager, group=object())
    with pytest.raises(ValueError, match="fixed compressor"):
        gradcomp.DiLoCo(model, inner, 4, compressor="auto", manager=manager)
    manager._use_async_quorum = True  # as Manager(use_async_quorum=True) sets it
    try:
        with pytest.raises(ValueError, match="use_async_quorum=False"):
            gradcomp.DiLoCo(model, inner, 4, manager=manager)
    finally:
        manager._use_async_quorum = False


def test_a_step_left_unsettled_raises_at_the_next_and_misuse_raises_at_once(manager):
    from gradcomp.integrations.torchft import Compression

    compression = Compression(manager, "int8", key="unsettled")
    with pytest.raises(ValueError, match="contiguous"):
        compression.all_reduce(torch.ones(4, 4).t(), "w")
    manager.start_quorum()
    assert compression.all_reduce(torch.ones(300), "w") is not None  # one replica group: kept locally
    manager.start_quorum()  # as torchft's own optimizer wrapper would, without gradcomp's commit
    with pytest.raises(RuntimeError, match="Compression.should_commit"):
        compression.all_reduce(torch.ones(300), "w")
    assert compression.should_commit()
    manager.start_quorum()
    assert compression.all_reduce(torch.ones(300), "w") is not None
    assert compression.should_commit() and compression.commits == 2


def test_a_checkpoint_keeps_where_each_tensor_was_reduced(manager):
    from gradcomp.collectives.replica_groups import _Route
    from gradcomp.integrations.torchft import Compression

    saved, restored = Compression(manager, "int8", key="saved"), Compression(manager, "int8", key="restored")
    saved._routes[7] = _Route(3, 1, "two_phase")
    saved.feedback.residual(7, torch.zeros(10)).fill_(2.0)
    restored.load_state_dict(saved.state_dict())
    assert restored._routes == {7: _Route(3, 1, "two_phase")}
    assert torch.equal(restored.feedback.get(7), saved.feedback.get(7))
