"""gradcomp's checkpoint files on Gloo ranks: every state loads with weights_only, a file
records what it belongs to and a load refuses another's on every rank, the distributed
checkpoint goes on at another world size as ``mismatch`` says, and a save killed while it
writes leaves the previous checkpoint or the new one whole."""

from __future__ import annotations

import io
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import gradcomp
from gradcomp import files
from gradcomp.ddp import Checkpointable, HookState, load_rank_file, register, save_rank_file
from gradcomp.ddp.records import RESIDUAL_ENTRIES
from tests.ddp.models import BUCKET_MB, make_model, train
from tests.planner.profiles import GBIT, profile
from tests.test_files import RunsCode
from tests.utils import run_ranks, trained_diloco


def _same(a, b) -> bool:
    """Equal state dicts: the same keys and values, tensors bit for bit in the same dtype."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return a == b


class _Warnings(logging.Handler):
    def __init__(self):
        super().__init__(logging.WARNING)
        self.messages: list[str] = []
        logging.getLogger("gradcomp.ddp").addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


# ----------------------------------------------------------------------------- every state, weights_only


def _ddp(compressor: str, rank: int, world: int, steps: int, **options):
    model = DDP(make_model(), bucket_cap_mb=BUCKET_MB)
    state = register(model, compressor, min_numel=0, **options)
    if steps:
        train(model, rank, world, steps)
        state.flush()
    return state


def _fsdp(rank: int, world: int, steps: int):
    from tests.fsdp import models

    mesh, _ = models.meshes(world, hsdp=False)
    model = models.sharded(mesh)
    state = gradcomp.fsdp.register(model, "int8", residual="fp32")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        x, y = models.batches(step, world)[rank]
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
    return state


def _diloco(rank: int, world: int, steps: int):
    return trained_diloco(rank, steps, fragments=2)


AUTO = {"warmup_steps": 3, "profile": profile(0.1 * GBIT)}
STATES = {
    "int8": lambda rank, world, steps: _ddp("int8", rank, world, steps),
    "topk": lambda rank, world, steps: _ddp("topk", rank, world, steps, ratio=0.1),
    "auto": lambda rank, world, steps: _ddp("auto", rank, world, steps, **AUTO),
    "fsdp": _fsdp,
    "diloco": _diloco,
}


def _every_state_round_trips(rank: int, world: int, folder: str, names: list[str]) -> None:
    for name in names:
        made = STATES[name]
        state = made(rank, world, 6)
        saved = state.state_dict()
        if name == "auto":
            assert state.plan is not None, "auto has not settled a plan"
        assert any(saved.get(entry, {}).get("residuals") for entry in RESIDUAL_ENTRIES), name
        path = save_rank_file(state, os.path.join(folder, name))
        record = torch.load(path, weights_only=True)
        assert (record["rank"], record["world_size"], record["kind"]) == (rank, world, type(state).__name__)
        again = made(rank, world, 0)
        load_rank_file(again, os.path.join(folder, name))
        assert _same(again.state_dict(), saved), f"{name}: the rank file's state differs"
        entries = Checkpointable(state).state_dict()  # what torch.distributed.checkpoint saves
        third = made(rank, world, 0)
        Checkpointable(third).load_state_dict(entries)
        assert _same(third.state_dict(), saved), f"{name}: the checkpoint entry's state differs"


@pytest.mark.slow
def test_the_hook_fsdp_and_diloco_states_load_with_weights_only(tmp_path):
    run_ranks(_every_state_round_trips, 2, str(tmp_path), ["int8", "fsdp", "diloco"], timeout=300)


@pytest.mark.slow
def test_topk_and_a_settled_auto_plan_load_with_weights_only(tmp_path):
    run_ranks(_every_state_round_trips, 2, str(tmp_path), ["topk", "auto"], timeout=300)


# ----------------------------------------------------------------------------- refusals, on every rank


def _refusals(rank: int, world: int, folder: str) -> None:
    state = _ddp("int8", rank, world, 3)
    save_rank_file(state, folder)
    dist.barrier()  # rank 0 copies rank 1's file below: it must be written
    first = os.path.join(folder, "gradcomp_rank0.pt")
    whole = open(first, "rb").read()
    record = torch.load(first, weights_only=True)
    dist.barrier()  # every rank has read rank 0's file before rank 0 changes it below
    marker = os.path.join(folder, "code_ran")

    def damaged(change) -> bytes:
        saved = torch.load(io.BytesIO(whole), weights_only=True)
        change(saved)
        buffer = io.BytesIO()
        torch.save(saved, buffer)
        return buffer.getvalue()

    def nan(saved):
        saved["state"]["feedback"]["residuals"][1][5] = float("nan")

    def crafted() -> bytes:
        buffer = io.BytesIO()
        torch.save({"world_size": world, "state": RunsCode(marker)}, buffer)
        return buffer.getvalue()

    def changed(**entries) -> bytes:
        return damaged(lambda saved: saved.update(entries))

    # What rank 0's file becomes (None: rank 1's file), and what every rank's load then says.
    cases = [
        (None, "holds rank 1's state and this is rank 0"),
        (whole[: len(whole) // 2], re.escape(first) + " is truncated or corrupt"),
        (damaged(nan), re.escape(first) + r": the residual feedback\[1\] holds NaN or Inf"),
        (crafted(), "needs more than tensors and plain containers"),
        (changed(world_size=3), "holds the hook state of 3 ranks and this run has 2"),
        (changed(kind="DiLoCo"), "holds a DiLoCo's state, not a HookState's"),
        (changed(format=3), "format 3; this gradcomp reads up to 2"),
    ]
    for content, match in cases:
        if rank == 0 and content is None:
            shutil.copyfile(os.path.join(folder, "gradcomp_rank1.pt"), first)
        elif rank == 0:
            open(first, "wb").write(content)
        dist.barrier()
        with pytest.raises(ValueError, match=match):  # rank 1 too: rank 0's refusal is named there
            load_rank_file(HookState("int8", min_numel=0), folder)
        dist.barrier()
        if rank == 0:
            files.atomic_write(first, lambda file: file.write(whole))
    assert not os.path.exists(marker), "loading ran the crafted file's code"
    with pytest.raises(ValueError, match="compressor settings"):
        load_rank_file(HookState("int4", min_numel=0), folder)

    # A file of the current release (no record of its rank) loads, with a warning.
    if rank == 0:
        torch.save({"world_size": world, "state": record["state"]}, first)
    dist.barrier()
    warnings, again = _Warnings(), HookState("int8", min_numel=0)
    load_rank_file(again, folder)
    assert again.step == 3 and len(again.feedback) == len(state.feedback)
    assert any("older gradcomp" in m for m in warnings.messages) == (rank == 0), warnings.messages

    # The same refusals of a torch.distributed.checkpoint entry: as handed over by a direct
    # call (the buffer) and by a load (what it unpickled).
    mine = Checkpointable(state).state_dict()[f"rank{rank}"].getvalue()
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    nan_record = torch.load(io.BytesIO(everyone[0]), weights_only=True)
    nan(nan_record)
    entry_cases = [
        ("holds rank 1's state and this is rank 0", io.BytesIO(everyone[1])),
        ("entry rank0 is truncated or corrupt", io.BytesIO(everyone[0][:1000])),
        (r"entry rank0: the residual feedback\[1\] holds NaN", nan_record),
    ]
    for match, entry in entry_cases:
        entries = {"world_size": world, f"rank{rank}": entry if rank == 0 else io.BytesIO(mine)}
        with pytest.raises(ValueError, match=match):
            Checkpointable(HookState("int8", min_numel=0)).load_state_dict(entries)
    restored = HookState("int8", min_numel=0)
    Checkpointable(restored).load_state_dict({"world_size": world, f"rank{rank}": io.BytesIO(mine)})
    assert restored.step == 3


def test_a_load_refuses_what_is_not_this_ranks_state_on_every_rank(tmp_path):
    run_ranks(_refusals, 2, str(tmp_path), timeout=300)


# ----------------------------------------------------------------------------- another world size


def _save_distributed(rank: int, world: int, folder: str, kind: str) -> dict:
    import torch.distributed.checkpoint as dcp

    state = _ddp("int8", rank, world, 3) if kind == "ddp" else _diloco(rank, world, 5)
    dcp.save({"gradcomp": Checkpointable(state)}, checkpoint_id=folder)
    if kind == "ddp":
        return {"step": state.step}
    return {"local_step": state.local_step, "outer_steps": state.outer_steps}


def _load_distributed(rank: int, world: int, folder: str, kind: str, saved_world: int, steps: dict) -> None:
    import torch.distributed.checkpoint as dcp

    made = (lambda: _ddp("int8", rank, world, 0)) if kind == "ddp" else (lambda: _diloco(rank, world, 0))
    with pytest.raises(ValueError, match=f"hook state of {saved_world} ranks and this run has {world}"):
        dcp.load({"gradcomp": Checkpointable(made())}, checkpoint_id=folder)
    warnings, dropped = _Warnings(), made()
    dcp.load({"gradcomp": Checkpointable(dropped, mismatch="drop")}, checkpoint_id=folder)
    assert any("start afresh" in m for m in warnings.messages), warnings.messages
    assert len(dropped.feedback) == 0 and {k: getattr(dropped, k) for k in steps} == steps
    if kind == "diloco":  # rank 0's weights on every rank
        flat = torch.cat([p.detach().reshape(-1) for p in dropped.model.parameters()])
        first = flat.clone()
        dist.broadcast(first, 0)
        assert torch.equal(first, flat)


@pytest.mark.slow
def test_a_distributed_checkpoint_of_2_ranks_on_3_raises_or_drops_on_every_rank(tmp_path):
    steps = run_ranks(_save_distributed, 2, str(tmp_path), "ddp")
    run_ranks(_load_distributed, 3, str(tmp_path), "ddp", 2, steps)


@pytest.mark.slow
@pytest.mark.parametrize("saved, loaded", [(2, 3), (3, 2)])
def test_a_diloco_distributed_checkpoint_on_another_world_size(tmp_path, saved, loaded):
    steps = run_ranks(_save_distributed, saved, str(tmp_path), "diloco")
    run_ranks(_load_distributed, loaded, str(tmp_path), "diloco", saved, steps)


# ----------------------------------------------------------------------------- saves killed midway

# A process that saves a rank file of 32 MB of residuals at step FIRST, then at step THEN
# REPEATS times, saying "saved <step>" after each.
_SAVER = """
import sys, torch, torch.distributed as dist
from gradcomp.ddp import HookState, save_rank_file
folder, store, first, then, repeats = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:])
dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
state = HookState("int8")
for step in [first] + [then] * repeats:
    for key in range(8):
        state.feedback.set(key, torch.full((1 << 20,), float(step)))
    state.step = step
    save_rank_file(state, folder)
    print("saved", step, flush=True)
"""


def _saver(root, first: int, then: int, repeats: int) -> subprocess.Popen:
    store = root / f"store-{time.monotonic_ns()}"
    arguments = [root / "checkpoint", store, first, then, repeats]
    return subprocess.Popen(
        [sys.executable, "-c", _SAVER, *map(str, arguments)], stdout=subprocess.PIPE, text=True
    )


def _whole_step(path) -> int:
    """The step of the whole checkpoint at ``path`` (every residual as saved at that step)."""
    state = files.load_file(path)["state"]
    residuals = state["feedback"]["residuals"]
    assert sorted(residuals) == list(range(8))
    assert all(torch.equal(r, torch.full((1 << 20,), float(state["step"]))) for r in residuals.values())
    return state["step"]


def _checkpoints(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if not name.startswith("."))


def _size(path) -> int | None:
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None


def _kill_while_writing(root, when: str) -> tuple[int, bool]:
    """Start a save of step 2 over the whole checkpoint of step 1 and kill it ``when``; the
    step the folder's checkpoint then holds, and whether a partial write was left behind."""
    path = root / "checkpoint" / "gradcomp_rank0.pt"
    saver = _saver(root, 1, 2, 1000)
    try:
        assert saver.stdout.readline().split() == ["saved", "1"]
        whole, temporary = os.stat(path).st_size, files.temporary_path(path, saver.pid)
        if when == "between saves":
            assert saver.stdout.readline().split() == ["saved", "2"]
        deadline = time.monotonic() + 60
        while when in ("writing", "past half") and time.monotonic() < deadline:
            # Writing: the temporary file has grown, or the file itself is shorter than whole
            # (where a save writes in place).
            if (_size(temporary) or 0) > (whole // 2 if when == "past half" else 0) or _size(path) < whole:
                break
            time.sleep(0.0005)
        os.kill(saver.pid, signal.SIGKILL)
    finally:
        saver.kill()
        saver.wait()
    assert _checkpoints(path.parent) == ["gradcomp_rank0.pt"]
    return _whole_step(path), os.path.exists(temporary)


def test_a_save_killed_while_it_writes_leaves_a_whole_checkpoint(tmp_path):
    for _ in range(3):  # until a kill lands before the rename (nearly always the first)
        step, left = _kill_while_writing(tmp_path, "writing")
        assert step in (1, 2)
        if left:
            break
    assert left, "no kill landed while a save was writing"
    # A later save removes what the killed one left behind.
    later = _saver(tmp_path, 3, 3, 0)
    assert later.communicate(timeout=120)[0].split() == ["saved", "3"]
    assert os.listdir(tmp_path / "checkpoint") == ["gradcomp_rank0.pt"]
    assert _whole_step(tmp_path / "checkpoint" / "gradcomp_rank0.pt") == 3


@pytest.mark.slow
@pytest.mark.parametrize("when", ["at once", "writing", "past half", "between saves"])
def test_a_save_killed_at_any_point_leaves_a_whole_checkpoint(tmp_path, when):
    for _ in range(3):
        step, _ = _kill_while_writing(tmp_path, when)
        assert step in (1, 2)
