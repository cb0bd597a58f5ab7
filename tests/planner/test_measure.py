"""The planner's measurements: probes over ranks and nodes, the pingpong, codecs timed
beside a busy thread."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from gradcomp import planner, spawn
from gradcomp.collectives import two_phase
from gradcomp.compressors import BF16, Int8
from tests.planner.profiles import GBIT


def _probe_nodes_body(rank, world_size):
    from gradcomp.collectives import hierarchy_for, queue_for

    hierarchy = hierarchy_for(queue_for(None), 2)
    found, rows = planner.probe([256, 4096], ["int8"], [4096], repeat=1, hierarchy=hierarchy)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, found)
    return everyone, rows


@pytest.mark.slow
def test_a_probe_over_two_nodes_measures_both_levels_and_every_rank_agrees():
    everyone, rows = spawn.run_ranks(_probe_nodes_body, 4, timeout=180)
    assert all(p == everyone[0] for p in everyone)
    nodes = everyone[0].nodes
    assert (nodes.size, nodes.count) == (2, 2) and set(nodes.links) == {"all_gather", "all_to_all"}
    assert nodes.stages.rate > 0 and nodes.link.bandwidth > 0
    # The node's stages at the sizes given; between nodes, at the shards' (half of them).
    assert [r["numel"] for r in rows if r["collective"] == "node stages"] == [256, 4096]
    assert [r["numel"] for r in rows if r["collective"] == "between nodes: all_reduce"] == [128, 2048]
    assert all(r["seconds"] > 0 for r in rows)


def _pingpong_body(rank, world_size):
    measured = planner.measure_pingpong([1024, 2**22], repeat=3)
    everyone = [None] * world_size
    dist.all_gather_object(everyone, measured)
    pair = dist.new_group([1, 2])  # its first two ranks are global ranks 1 and 2
    inner = planner.measure_pingpong([1024], pair, repeat=1) if rank else None
    inners = [None] * world_size
    dist.all_gather_object(inners, inner)
    alone = dist.new_group([0])
    refused = None
    if rank == 0:
        with pytest.raises(ValueError, match="two ranks"):
            planner.measure_pingpong([1024], alone)
        refused = True
    return everyone, inners, refused


@pytest.mark.slow
def test_a_pingpong_times_messages_between_two_ranks_and_every_rank_gets_the_fit():
    everyone, inners, refused = spawn.run_ranks(_pingpong_body, 3, timeout=120)
    assert everyone[0] == everyone[1] == everyone[2]  # rank 2 waited and got rank 0's figures
    link, rows = everyone[0]
    assert [(r["collective"], r["numel"], r["bytes_sent"]) for r in rows] == [
        ("pingpong", 1024, 4096),
        ("pingpong", 2**22, 2**24),
    ]
    assert 0 < rows[0]["seconds"] < rows[1]["seconds"]  # 16 MB takes longer than 4 KB
    assert link.bandwidth > 0 and link.latency >= 0
    # The line through the two points (through the origin where that would cross below it).
    assert link.latency + 2**24 / link.bandwidth == pytest.approx(rows[1]["seconds"], rel=0.01)
    assert inners[0] is None and inners[1] == inners[2] and inners[1][1][0]["seconds"] > 0
    assert refused


def _probe_body(rank, world_size):
    # Each rank measures its own codecs; the profiles must come back identical.
    timed, measure = [], planner.measure.measure_codec
    planner.measure.measure_codec = lambda *args: timed.append(args[-1]) or measure(*args)
    try:
        found, rows = planner.probe([256, 4096], ["none", "int8"], repeat=1)
    finally:
        planner.measure.measure_codec = measure
    assert timed == [planner.CODEC_REPEATS]  # int8's, more often than the link's
    everyone = [None] * world_size
    dist.all_gather_object(everyone, found)
    plan = planner.best_plan([4096, 2**20], world_size, found.with_link(GBIT), candidates=("int8",))
    plans = [None] * world_size
    dist.all_gather_object(plans, plan)
    return everyone, plans, rows


@pytest.mark.slow
def test_every_rank_gets_the_same_profile_and_plan_from_a_probe():
    everyone, plans, rows = spawn.run_ranks(_probe_body, 3, timeout=120)
    assert everyone[0] == everyone[1] == everyone[2] and plans[0] == plans[1] == plans[2]
    assert set(everyone[0].codecs) == {"int8"} and everyone[0].world_size == 3
    assert set(everyone[0].links) == {"all_gather", "all_to_all"}
    assert all(link.bandwidth > 0 for link in everyone[0].links.values())
    # The all-gather and all-to-all take n // W elements from each rank.
    assert [(r["collective"], r["numel"]) for r in rows] == [
        ("all_reduce", 256),
        ("all_reduce", 4096),
        *((name, n) for name in ("all_gather", "all_to_all") for n in (255, 4095)),
    ]
    assert all(r["seconds"] > 0 for r in rows)
    # On CPUs, the transport's CPU time too: some, never more than the wall time.
    assert all(0 <= r["cpu_seconds"] <= r["seconds"] for r in rows)
    assert sum(r["cpu_seconds"] for r in rows) > 0
    fits = [("all_reduce", everyone[0].link), *everyone[0].links.items()]
    assert all(
        f.cpu_seconds_per_byte == planner.measure._cpu_per_byte([r for r in rows if r["collective"] == c])
        for c, f in fits
    )
    # Bytes one rank sends: ring all-reduce 2 (W-1)/W n, all-gather and all-to-all (W-1) n/W.
    assert [r["bytes_sent"] for r in rows if r["numel"] in (4095, 4096)] == [
        2 * 2 * 4096 * 4 // 3,
        2 * 1365 * 4,
        2 * 1365 * 4,
    ]


class _Timed(BF16):
    """bf16 whose encode waits 30 ms (no CPU) and whose decode computes for 20 ms, noting
    each time whether the probe's busy thread was running."""

    def __init__(self):
        super().__init__()
        self.beside_busy = []

    def _busy_running(self) -> bool:
        return any(t.name == "gradcomp-probe-busy" and t.is_alive() for t in threading.enumerate())

    def compress(self, tensor, ctx=None):
        self.beside_busy.append(self._busy_running())
        time.sleep(0.03)
        return super().compress(tensor, ctx)

    def decompress(self, payload, out=None, accumulate=False, *, divisor=1):
        self.beside_busy.append(self._busy_running())
        began = time.thread_time()
        while time.thread_time() - began < 0.02:
            pass
        return super().decompress(payload, out, accumulate, divisor=divisor)


def test_cpu_codecs_are_timed_beside_a_busy_thread_by_the_cpu_time_they_take():
    # In training a CPU codec shares the cores with the backward pass: what it adds to a
    # step is the work it does, not its waits for a core (nor any other wait).
    timed = _Timed()
    codec = planner.measure_codec(timed, [1000, 2000], "cpu", repeat=1)
    assert timed.beside_busy and all(timed.beside_busy)
    assert codec.encode.seconds(1000) < 0.01  # 30 ms asleep, not counted
    assert 0.015 < codec.decode.seconds(1000) < 0.1  # 20 ms of CPU, counted
    assert not any(t.name == "gradcomp-probe-busy" for t in threading.enumerate())


class _Noting:
    """A compressor mixin that notes each encode's and decode's size in ``calls``."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def compress(self, tensor, ctx=None):
        self.calls.append(("compress", tensor.numel()))
        return super().compress(tensor, ctx)

    def decompress(self, payload, out=None, accumulate=False, *, divisor=1):
        self.calls.append(("decompress", payload.numel))
        return super().decompress(payload, out, accumulate, divisor=divisor)


class _Recorded(_Noting, Int8):
    """Noted int8 whose ``decompress_sum`` computes for 40 ms."""

    def decompress_sum(self, rows, dtype, out, *, meta=None, divisor=1):
        self.calls.append(("decompress_sum", tuple(rows.shape[:1]), out.numel(), divisor))
        began = time.thread_time()
        while time.thread_time() - began < 0.04:
            pass
        for row in rows:
            assert row.dtype == torch.uint8  # what the exchange delivers: send buffers
        return super().decompress_sum(rows, dtype, out, meta=meta, divisor=divisor)


class _NotedCast(_Noting, BF16):
    pass


def test_codecs_are_timed_as_the_algorithms_run_them(monkeypatch):
    # A CPU all-gather encodes a long tensor segment by segment into send buffers and
    # decodes two ranks' rows a segment by decompress_sum; a cast's payload is summed by
    # the all-reduce itself and decoded once, whole.
    monkeypatch.setattr(two_phase, "SEGMENT_ELEMENTS", 1024)
    recorded = _Recorded()
    codec = planner.measure_codec(recorded, [4096], "cpu", repeat=1)
    encodes = [c for c in recorded.calls if c[0] == "compress"]
    decodes = [c for c in recorded.calls if c[0] != "compress"]
    assert encodes == [("compress", 1024)] * 4 * 3  # the rows' payloads, a warm-up, one timing
    assert decodes == [("decompress_sum", (2,), 1024, 2)] * 4 * 2
    # Two ranks' rows a segment, 40 ms of CPU each: one row's decode of the whole is 80 ms.
    assert 0.07 < codec.decode.seconds(4096) < 0.2

    cast = _NotedCast()
    planner.measure_codec(cast, [4096], "cpu", repeat=1)
    assert set(cast.calls) == {("compress", 4096), ("decompress", 4096)}


def _busy_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gradcomp-probe-busy"]


def test_the_busy_thread_computes_on_cpus_only():
    with planner.busy(torch.device("cpu")):
        (thread,) = _busy_threads()
        began, process = time.thread_time(), time.process_time()
        deadline = time.monotonic() + 10
        while time.process_time() - process < 0.05 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert time.process_time() - process >= 0.05  # the busy thread computed,
        assert time.thread_time() - began < 0.05 and thread.is_alive()  # this one mostly waited
        with planner.busy(torch.device("cpu")):  # nested: the same busy thread
            assert _busy_threads() == [thread]
        assert thread.is_alive()
    assert not thread.is_alive()
    with planner.busy(torch.device("meta")):  # a GPU's codecs are timed as they are
        assert not _busy_threads()


def test_a_busy_thread_that_fails_is_reported(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("out of memory")

    with pytest.raises(RuntimeError, match="busy thread failed.*out of memory"):
        with planner.busy(torch.device("cpu")):
            monkeypatch.setattr(torch, "mm", broken)
            deadline = time.monotonic() + 10
            while _busy_threads() and _busy_threads()[0].is_alive() and time.monotonic() < deadline:
                time.sleep(0.01)
    monkeypatch.undo()
    assert not _busy_threads()
