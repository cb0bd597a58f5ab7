"""gradcomp.all_reduce against dense all-reduce and against local decoding, on Gloo ranks."""

from __future__ import annotations

import dataclasses
import math
import threading

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.collectives import ALGORITHMS, chunk_bounds, cost_model, default_algorithm
from gradcomp.collectives.worker import IN_FLIGHT
from gradcomp.compressors import Context
from tests.collectives.bounds import DTYPE_SLACK, ERROR_BOUND
from tests.utils import gather, run_ranks, same_on_all_ranks

EPS32 = torch.finfo(torch.float32).eps

SIZES = (1, 1000, 4097)
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def valid_algorithms(compressor) -> list[str]:
    out = []
    for algorithm in ALGORITHMS:
        try:
            gradcomp.collectives.check_algorithm(compressor, algorithm)
        except ValueError:
            continue
        out.append(algorithm)
    return out


def _input(rank: int, numel: int, dtype, salt: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + numel + salt)
    return torch.randn(numel, generator=generator).to(dtype)


def _every_compressor_and_algorithm(rank: int, world_size: int) -> None:
    # The statistics name the compressor as a spec that makes it again, given by name too,
    # dense ("none"), asynchronously, and its options aside from the defaults.
    x = _input(rank, 1000, torch.float32)
    for given, named in (("none", "none"), ("int8", "int8"), ("topk@0.05", "topk:ratio=0.05")):
        assert gradcomp.all_reduce(x.clone(), given).compressor == named
    work = gradcomp.all_reduce(x.clone(), "int4", async_op=True, block=128)
    assert work.get_future().wait().compressor == "int4:block=128"
    for name in gradcomp.COMPRESSORS:
        compressor = gradcomp.get_compressor(name)
        for algorithm in valid_algorithms(compressor):
            for numel in SIZES:
                for dtype in DTYPES:
                    x = _input(rank, numel, dtype)
                    exact = torch.stack([t.double() for t in gather(x)]).mean(0)
                    result = x.clone()
                    stats = gradcomp.all_reduce(result, compressor, algorithm=algorithm, feedback=False)
                    where = f"{name}/{algorithm}/{numel}/{dtype}"
                    assert result.dtype == dtype and result.shape == x.shape, where
                    assert same_on_all_ranks(result), f"ranks differ: {where}"
                    error = (result.double() - exact).norm() / exact.norm().clamp_min(1e-12)
                    bound = ERROR_BOUND[name] + DTYPE_SLACK[dtype]
                    if numel > 1 or name in ("none", "fp16", "bf16", "int8"):
                        assert error <= bound, f"{where}: relative error {error:.4f} > {bound}"
                    dense_bytes = 2 * (world_size - 1) * numel * x.element_size() // world_size
                    assert stats.algorithm == algorithm and stats.dense_bytes == dense_bytes
                    assert stats.compressor == name, where  # a Compressor object: its name
                    assert stats.bytes_sent > 0, where
                    if rank == 0:  # the cost model counts rank 0's bytes
                        model = cost_model.cost(compressor, numel, world_size, algorithm, dtype)
                        assert stats.bytes_sent == model.bytes_sent, where


@pytest.mark.parametrize("world_size", [2, pytest.param(4, marks=pytest.mark.slow)])
def test_every_compressor_and_algorithm_matches_dense_average(world_size):
    run_ranks(_every_compressor_and_algorithm, world_size)


def _none_is_dense_all_reduce(rank: int, world_size: int) -> None:
    for algorithm in ALGORITHMS:
        x = _input(rank, 5000, torch.float32)
        expected = x / world_size
        dist.all_reduce(expected)
        result = x.clone()
        gradcomp.all_reduce(result, "none", algorithm=algorithm)
        torch.testing.assert_close(result, expected, rtol=1e-6, atol=1e-6)
        summed = x.clone()
        gradcomp.all_reduce(summed, "none", op="sum", algorithm=algorithm)
        torch.testing.assert_close(summed, expected * world_size, rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_none_equals_torch_all_reduce():
    run_ranks(_none_is_dense_all_reduce, 3)


def _allgather_equals_local_decoding(rank: int, world_size: int) -> None:
    # The allgather result is, bit for bit, the rank-ordered sum of every
    # rank's own decoded payload (each rank compresses with its own Context).
    for name in ("int8", "int4", "sign", "topk", "qsgd", "topk:ratio=0.05,value_bits=2"):
        compressor = gradcomp.get_compressor(name)
        x = _input(rank, 3001, torch.float32, salt=7)
        everyone = gather(x)
        expected = torch.zeros(3001)
        # Sparse payloads are averaged by dividing their values, others by dividing the sum.
        divisor = world_size if compressor.sparse else 1
        for r, tensor in enumerate(everyone):
            payload = compressor.compress(tensor, Context(step=0, key=99, rank=r))
            compressor.decompress(payload, out=expected, accumulate=True, divisor=divisor)
        expected /= world_size // divisor
        result = x.clone()
        gradcomp.all_reduce(result, compressor, algorithm="allgather", feedback=False, name=99, step=0)
        assert torch.equal(result, expected), name


@pytest.mark.slow
def test_allgather_is_bit_exact_sum_of_local_decodings():
    run_ranks(_allgather_equals_local_decoding, 3)


def _sparse_payloads(world_size: int, numel: int = 5000):
    """Exact Top-K payloads of ``world_size`` ranks: 40 indices large (10 to 14)
    on every rank, and index 17 where the first two ranks send +50 and -50."""
    compressor = gradcomp.get_compressor("topk", k=50, exact=True)
    shared = torch.arange(0, 1000, 25)
    payloads = []
    for rank in range(world_size):
        x = _input(rank, numel, torch.float32, salt=11)
        x[shared] = 10.0 + x[shared].abs()
        x[17] = (1 - 2 * (rank % 2)) * 50.0 if rank < 2 else 0.0
        payload = compressor.compress(x, Context(step=0, key=1, rank=rank))
        assert {17, *shared.tolist()} <= set(payload.tensors["indices"].tolist()) or rank >= 2
        payloads.append(payload)
    return compressor, payloads, torch.stack([payload.to_buffer() for payload in payloads])


def _decoded_sum(compressor, rows: torch.Tensor, numel: int, divisor: int) -> torch.Tensor:
    total = torch.empty(numel)
    compressor.decompress_sum(rows, torch.float32, total, meta={"k": 50}, divisor=divisor)
    return total


def test_sparse_average_divides_each_payloads_values():
    """Averaging gathered sparse payloads (overlapping, one overlap cancelling to
    zero, world size not a power of two) adds each rank's values divided by the
    world size, in rank order; within an ulp of dividing the sum."""
    numel, world_size = 5000, 3
    compressor, payloads, rows = _sparse_payloads(world_size, numel)
    got = _decoded_sum(compressor, rows, numel, world_size)
    expected, summed = torch.zeros(numel), torch.zeros(numel)
    for payload in payloads:
        indices, values = payload.tensors["indices"].long(), payload.tensors["values"]
        expected.index_add_(0, indices, values / world_size)
        summed.index_add_(0, indices, values)
    assert torch.equal(got.view(torch.int32), expected.view(torch.int32))
    assert (got != 0).sum() >= 60 and got[17].item() == 0.0
    assert not torch.equal(got, summed / world_size)  # the rounding differs somewhere
    torch.testing.assert_close(got, summed / world_size, rtol=EPS32, atol=0.0)
    assert torch.equal(_decoded_sum(compressor, rows, numel, 1), summed)


@pytest.mark.parametrize("world_size", [2, 4])
def test_sparse_average_on_a_power_of_two_is_the_sum_divided(world_size):
    # Dividing by a power of two is exact, so the values' division gives the
    # same bits as dividing the sum.
    numel = 5000
    compressor, payloads, rows = _sparse_payloads(world_size, numel)
    got = _decoded_sum(compressor, rows, numel, world_size)
    summed = torch.zeros(numel)
    for payload in payloads:
        summed.index_add_(0, payload.tensors["indices"].long(), payload.tensors["values"])
    assert torch.equal(got.view(torch.int32), (summed / world_size).view(torch.int32))


def _randk_dense_mean(rank: int, world_size: int) -> None:
    # fp32: the k summed values are divided when decoded, and the residual is
    # y = x + old residual off the picks, 0 on them, bit for bit (no divide
    # and multiply round trip). fp16 inputs still divide before the sum.
    numel, k = 5000, 60
    compressor = gradcomp.get_compressor("randk", k=k)
    for dtype in (torch.float32, torch.float16):
        memory = gradcomp.ErrorFeedback()
        key = gradcomp.collectives.key_of("g")
        for step in range(2):
            x = _input(rank, numel, dtype, salt=31 + step)
            before = memory.get(key).clone() if key in memory.keys() else torch.zeros(numel)
            result = x.clone()
            gradcomp.all_reduce(result, compressor, feedback=memory, name="g", step=step)
            seed = compressor._shared_seed(Context(step=step, key=key))
            picks = gradcomp.ops.backend("torch").randk_indices(numel, k, seed)
            off = torch.ones(numel, dtype=torch.bool)
            off[picks] = False
            if dtype == torch.float32:
                y = x + before
                summed = _summed_as_sent(y[picks])
                expected = torch.zeros(numel)
                expected[picks] = summed / world_size
                assert torch.equal(result, expected)
                kept = memory.get(key)
                assert torch.equal(kept[off], y[off]) and not kept[picks].any()
            else:
                summed = _summed_as_sent(((x / world_size).float() + before / world_size)[picks].half())
                assert torch.equal(result[picks], summed) and not result[off].any()


def _summed_as_sent(values: torch.Tensor) -> torch.Tensor:
    """``values`` summed over ranks as a dense payload is: in one all-reduce with the 64
    lanes of its fingerprint after them (Gloo's ring cuts the buffer by its length, so
    the lanes decide which rank's values are added first)."""
    wire = torch.cat([values, torch.zeros(64, dtype=values.dtype)])
    dist.all_reduce(wire)
    return wire[: values.numel()]


@pytest.mark.slow
def test_randk_dense_mean_divides_summed_values_and_keeps_an_exact_residual():
    run_ranks(_randk_dense_mean, 3)


def _feedback_loses_nothing(rank: int, world_size: int) -> None:
    # Sum over ranks of what went in (input + old residuals) equals what came
    # out (W * average) plus what stayed behind (new residuals), for every
    # biased compressor and algorithm, over several steps.
    for name in ("int8", "int2", "sign", "topk", "randk", "topk:value_bits=2"):
        compressor = gradcomp.get_compressor(name)
        for algorithm in valid_algorithms(compressor):
            memory = gradcomp.ErrorFeedback()
            for step in range(3):
                x = _input(rank, 2049, torch.float32, salt=step)
                before = {k: memory.get(k).clone() for k in memory.keys()}
                result = x.clone()
                gradcomp.all_reduce(result, compressor, algorithm=algorithm, feedback=memory, name="g")
                worker_in = x + before.get(gradcomp.collectives.key_of("g"), torch.zeros(2049))
                worker_kept = memory.get(gradcomp.collectives.key_of("g"))
                sent = torch.stack(gather(worker_in - worker_kept)).double().sum(0)
                if algorithm == "two_phase":
                    # The chunk owner's server residual took part of the sum too.
                    key = ("two_phase", gradcomp.collectives.key_of("g"))
                    old = before.get(key, torch.zeros_like(memory.get(key)))
                    kept_here, at = torch.zeros(2049, dtype=torch.float64), 0
                    owned = gradcomp.collectives.owner_ranges(
                        compressor, algorithm, 2049, world_size, rank, result.device
                    )
                    for start, end in owned:
                        kept_here[start:end] = (memory.get(key) - old)[at : at + end - start].double()
                        at += end - start
                    assert at == memory.get(key).numel() and (owned or at == 0)
                    sent -= world_size * torch.stack(gather(kept_here)).sum(0)
                torch.testing.assert_close(
                    result.double() * world_size, sent, rtol=1e-5, atol=1e-4, msg=f"{name}/{algorithm}"
                )


@pytest.mark.slow
def test_error_feedback_conservation_across_ranks():
    run_ranks(_feedback_loses_nothing, 2)


def _async_returns_before_done(rank: int, world_size: int) -> None:
    x = _input(rank, 10_000, torch.float32)
    synchronous = x.clone()
    gradcomp.all_reduce(synchronous, "int8", feedback=False, name="a", step=0)
    handles = []
    tensors = [x.clone() for _ in range(4)]
    for tensor in tensors:
        handles.append(gradcomp.all_reduce(tensor, "int8", async_op=True, feedback=False, name="a", step=0))
    assert all(isinstance(h, gradcomp.collectives.Work) for h in handles)
    for handle, tensor in zip(handles, tensors, strict=True):
        handle.wait()
        assert handle.is_completed()
        assert torch.equal(tensor, synchronous)
    stats = handles[0].get_future().value()
    assert stats.bytes_sent > 0


@pytest.mark.slow
def test_async_op():
    run_ranks(_async_returns_before_done, 2)


def _paused_job(name: str, events: list, fail: bool = False):
    def steps():
        events.append(f"{name} start")
        yield
        events.append(f"{name} finish")
        if fail:
            raise ValueError(f"{name} failed")
        return name

    return steps


def _worker_overlaps_in_order(rank: int, world_size: int) -> None:
    cpu = torch.device("cpu")
    q = gradcomp.collectives.queue_for(None)
    gate, events, completed = threading.Event(), [], []

    def submit(fn, writes=None):
        return q.submit(fn, cpu, writes=torch.empty(1) if writes is None else writes)

    submit(lambda: gate.wait(30))  # holds the worker while the next jobs queue up
    futures = [
        submit(_paused_job("A", events)),
        submit(_paused_job("B", events)),
        submit(lambda: events.append("C") or "C"),
    ]
    # Callbacks run as each future completes; waiting on their own futures
    # (not on the jobs') makes sure every one has run before the check.
    noted = [future.then(lambda done: completed.append(done.value())) for future in futures]
    gate.set()
    assert [future.wait() for future in futures] == ["A", "B", "C"]
    for future in noted:
        future.wait()
    # Paused jobs stay in flight while more are queued; a job that does not pause runs,
    # then they finish before its future completes: futures complete in order.
    assert events == ["A start", "B start", "C", "A finish", "B finish"]
    assert completed == ["A", "B", "C"]
    # At most IN_FLIGHT paused at once: the oldest finishes before one more starts.
    events.clear()
    gate.clear()
    submit(lambda: gate.wait(30))
    many = [submit(_paused_job(str(i), events)) for i in range(IN_FLIGHT + 2)]
    gate.set()
    assert [future.wait() for future in many] == [str(i) for i in range(IN_FLIGHT + 2)]
    starts = [f"{i} start" for i in range(IN_FLIGHT + 2)]
    assert events[: IN_FLIGHT + 1] == starts[:IN_FLIGHT] + ["0 finish"]
    assert events.index(f"{IN_FLIGHT} start") == IN_FLIGHT + 1
    assert [e for e in events if e.endswith("finish")] == [f"{i} finish" for i in range(IN_FLIGHT + 2)]
    # With nothing queued behind it, a paused job finishes at once.
    assert submit(_paused_job("D", events)).wait() == "D"
    # A job writing into the same storage, sharing a state token (a residual's key), or
    # not saying where it writes, waits for the paused one: it must see what it leaves.
    # Another state token and other storage: it overlaps.
    shared, other = torch.zeros(10), torch.zeros(10)
    for second, state, waits in (
        (shared[5:], (), True),
        (None, (), True),
        (other, ("key", 1), True),
        (other, ("key", 2), False),
    ):
        events.clear()
        gate.clear()
        submit(lambda: gate.wait(30))
        first = q.submit(_paused_job("H", events), cpu, writes=shared[:5], state=(("key", 1),))
        then = q.submit(_paused_job("I", events), cpu, writes=second, state=(state,) if state else ())
        gate.set()
        assert (first.wait(), then.wait()) == ("H", "I")
        order = ["H start", "H finish", "I start"] if waits else ["H start", "I start", "H finish"]
        assert events == [*order, "I finish"], (second, state)
    # A job failing after its pause fails with its error; the one started
    # meanwhile (on another rank it might not have started yet) and every
    # later one fail at once, until the queues are released.
    gate.clear()
    submit(lambda: gate.wait(30))
    failing = submit(_paused_job("E", events, fail=True))
    meanwhile = submit(_paused_job("F", events))
    gate.set()
    with pytest.raises(ValueError, match="E failed"):
        failing.wait()
    for later in (meanwhile, submit(lambda: "G")):
        with pytest.raises(RuntimeError, match="earlier gradcomp collective"):
            later.wait()
    gradcomp.collectives.release_queues()


@pytest.mark.slow
def test_worker_overlaps_a_paused_job_with_the_next_in_order():
    run_ranks(_worker_overlaps_in_order, 1, timeout=120)


def _nonfinite_is_never_hidden(rank: int, world_size: int) -> None:
    for name in gradcomp.COMPRESSORS:
        compressor = gradcomp.get_compressor(name)
        for algorithm in valid_algorithms(compressor):
            for bad in (math.nan, math.inf):
                x = _input(rank, 3000, torch.float32)
                if rank == 1:
                    x[1234] = bad
                gradcomp.all_reduce(x, compressor, algorithm=algorithm, feedback=False)
                assert not torch.isfinite(x).all(), f"{name}/{algorithm} hid {bad}"


@pytest.mark.slow
def test_nonfinite_input_on_one_rank_reaches_every_rank():
    run_ranks(_nonfinite_is_never_hidden, 2)


def _mismatched_settings_raise(rank: int, world_size: int) -> None:
    block = 256 if rank == 0 else 128
    with pytest.raises(ValueError, match="disagree"):
        gradcomp.all_reduce(torch.ones(1000), gradcomp.get_compressor("int8", block=block))
    # After a failure the group's queue refuses work at once (no collective, no hang)...
    with pytest.raises(RuntimeError, match="earlier gradcomp collective"):
        gradcomp.all_reduce(torch.ones(10), "none")
    # ...until every rank starts afresh.
    gradcomp.collectives.release_queues()
    numel = 1000 + rank
    with pytest.raises(ValueError, match="disagree"):
        gradcomp.all_reduce(torch.ones(numel), "sign")
    gradcomp.collectives.release_queues()
    x = torch.ones(10)
    gradcomp.all_reduce(x, "none")
    assert torch.equal(x, torch.ones(10))


@pytest.mark.slow
def test_ranks_with_different_settings_get_an_error_not_a_hang():
    run_ranks(_mismatched_settings_raise, 2, timeout=120)


def _bad_arguments(rank: int, world_size: int) -> None:
    with pytest.raises(ValueError, match="op"):
        gradcomp.all_reduce(torch.ones(4), "int8", op="max")
    with pytest.raises(ValueError, match="summable"):
        gradcomp.all_reduce(torch.ones(4), "int8", algorithm="dense")
    with pytest.raises(ValueError, match="two_phase"):
        gradcomp.all_reduce(torch.ones(4), "randk", algorithm="two_phase")
    with pytest.raises(ValueError, match="algorithm"):
        gradcomp.all_reduce(torch.ones(4), "int8", algorithm="ring")
    with pytest.raises(TypeError):
        gradcomp.all_reduce(torch.ones(4, dtype=torch.int64), "int8")
    with pytest.raises(ValueError, match="unknown compressor"):
        gradcomp.all_reduce(torch.ones(4), "int3")
    # Non-contiguous input is reduced in place like any other.
    x = torch.arange(20, dtype=torch.float32).view(4, 5).t()
    gradcomp.all_reduce(x, "none")
    assert torch.equal(x, torch.arange(20, dtype=torch.float32).view(4, 5).t())


@pytest.mark.slow
def test_bad_arguments_raise_clear_errors():
    run_ranks(_bad_arguments, 2)


def test_default_algorithms():
    assert default_algorithm(gradcomp.get_compressor("fp16")) == "dense"
    assert default_algorithm(gradcomp.get_compressor("randk")) == "dense"
    topk = gradcomp.get_compressor("topk")
    assert default_algorithm(topk) == default_algorithm(topk, 4) == default_algorithm(topk, 7) == "allgather"
    assert default_algorithm(topk, 8) == default_algorithm(topk, 1024) == "two_phase"
    assert default_algorithm(gradcomp.get_compressor("randk"), 1024) == "dense"
    assert default_algorithm(gradcomp.get_compressor("int8")) == "two_phase"
    assert default_algorithm(gradcomp.get_compressor("sign")) == "two_phase"
    # Dense payloads on 2 ranks: as many bytes either way, one quantization gathered.
    for name in ("int8", "int4", "sign"):
        compressor = gradcomp.get_compressor(name)
        assert default_algorithm(compressor, 2) == "allgather"
        assert default_algorithm(compressor, 3) == default_algorithm(compressor, 64) == "two_phase"


@pytest.mark.parametrize("numel,parts,align", [(1, 4, 256), (1000, 3, 256), (4097, 4, 1), (0, 2, 8)])
def test_chunk_bounds_cover_and_align(numel, parts, align):
    bounds = chunk_bounds(numel, parts, align)
    assert len(bounds) == parts and bounds[0][0] == 0 and bounds[-1][1] == numel
    for (s0, e0), (s1, _) in zip(bounds[:-1], bounds[1:], strict=True):
        assert e0 == s1 and (s0 % align == 0 or s0 == numel)


def test_all_reduce_without_process_group_raises():
    with pytest.raises(RuntimeError, match="not initialized"):
        gradcomp.all_reduce(torch.ones(3), "int8")


def _named_compressor_keeps_its_residual(rank: int, world_size: int) -> None:
    from gradcomp.collectives.reduce import _DEFAULT_FEEDBACK

    for _ in range(5):
        gradcomp.all_reduce(_input(rank, 4097, torch.float32), "int8", name="g")
    # One memory, one residual: feedback carries over and nothing piles up.
    assert len(_DEFAULT_FEEDBACK) == 1
    ((memory, counters),) = _DEFAULT_FEEDBACK.values()
    key = gradcomp.collectives.key_of("g")
    # On 2 ranks int8 is gathered (no owner's residual), on more it goes two_phase.
    owners = {("two_phase", key)} if world_size > 2 else set()
    assert set(memory.keys()) == {key} | owners and counters["g"] == 5
    assert memory.get(key).abs().sum() > 0


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_compressor_by_name_reuses_its_residual(world_size):
    run_ranks(_named_compressor_keeps_its_residual, world_size)


def _segmented_two_phase_matches_one_segment(rank: int, world_size: int) -> None:
    # Long CPU tensors run two_phase and allgather as a pipeline of segments.
    # Cutting a tensor into many segments must give the bits of one segment:
    # results and the senders' residuals (two_phase owners' hold other elements
    # per segmentation), over steps with error feedback, odd sizes and blocks.
    from gradcomp.collectives import allgather_segments, two_phase

    numel = 10_007
    for algorithm, name, options in (
        ("two_phase", "int8", {}),
        ("two_phase", "int4", {"block": 100}),
        ("two_phase", "sign", {}),
        ("two_phase", "int8", {"stochastic": True}),
        ("allgather", "int8", {}),
        ("allgather", "int4", {"block": 100}),
        ("allgather", "ternary", {}),  # five codes a byte: segments end inside a byte
        ("allgather", "bf16", {}),
        ("allgather", "int8", {"stochastic": True}),
    ):
        compressor = gradcomp.get_compressor(name, **options)
        runs = {}
        for segment in (numel, 300):
            two_phase.SEGMENT_ELEMENTS = segment
            if algorithm == "allgather":
                cut = allgather_segments(compressor, numel, torch.device("cpu"))
                assert (len(cut) > 1) == (segment < numel)
            memory, results = gradcomp.ErrorFeedback(), []
            for step in range(3):
                result = _input(rank, numel, torch.float32, salt=step)
                gradcomp.all_reduce(
                    result, compressor, feedback=memory, name="g", step=step, algorithm=algorithm
                )
                results.append(result)
            senders = [memory.get(key) for key in memory.keys() if not isinstance(key, tuple)]
            assert len(senders) == int(compressor.needs_feedback)
            runs[segment] = (results, senders)
        where = f"{algorithm} {name} {options}"
        if options.get("stochastic"):
            # Other random streams per segment; still unbiased, so only check agreement.
            assert same_on_all_ranks(runs[300][0][-1]), where
            continue
        for got, expected in zip(runs[300][0] + runs[300][1], runs[numel][0] + runs[numel][1], strict=True):
            assert torch.equal(got, expected), where


def test_allgather_pipelines_dense_cpu_payloads_only():
    from gradcomp.collectives import allgather_segments, two_phase

    cpu, long = torch.device("cpu"), 5 * two_phase.SEGMENT_ELEMENTS + 3
    segments = allgather_segments(gradcomp.get_compressor("int8", block=96), long, cpu)
    assert len(segments) == 5 and segments[0][0] == 0 and segments[-1][1] == long
    assert all(a[1] == b[0] and (a[1] - a[0]) % 96 == 0 for a, b in zip(segments, segments[1:], strict=False))
    # A selection over the whole tensor cannot be cut; nor does a GPU's queued work gain by it.
    assert allgather_segments(gradcomp.get_compressor("topk"), long, cpu) == [(0, long)]
    assert allgather_segments(gradcomp.get_compressor("int8"), long, torch.device("cuda")) == [(0, long)]


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 3])
def test_segmented_two_phase_and_allgather_are_bit_exact(world_size):
    run_ranks(_segmented_two_phase_matches_one_segment, world_size)


def _measured_error_is_the_compression_error(rank: int, world_size: int) -> None:
    from gradcomp.collectives import key_of

    x = _input(rank, 5_000, torch.float32, salt=3)
    compressor = gradcomp.get_compressor("int8")
    # Without feedback: ||decode(compress(x)) - x||^2 against ||x||^2.
    stats = gradcomp.all_reduce(
        x.clone(), compressor, algorithm="allgather", feedback=False, name="m", step=0, measure_error=True
    )
    decoded = compressor.decompress(compressor.compress(x, Context(step=0, key=key_of("m"), rank=rank)))
    torch.testing.assert_close(
        stats.error_sq, float((decoded - x).double().square().sum()), rtol=1e-4, atol=0
    )
    torch.testing.assert_close(stats.input_sq, float(x.double().square().sum()), rtol=1e-4, atol=0)
    # With feedback: the error is what the residual keeps.
    memory = gradcomp.ErrorFeedback()
    stats = gradcomp.all_reduce(
        x.clone(), compressor, algorithm="allgather", feedback=memory, name="m", step=0, measure_error=True
    )
    kept = memory.get(key_of("m"))
    torch.testing.assert_close(stats.error_sq, float(kept.double().square().sum()), rtol=1e-4, atol=0)
    assert 0 < stats.relative_error < 0.02
    # Off by default.
    assert math.isnan(gradcomp.all_reduce(x.clone(), compressor, feedback=False).error_sq)


@pytest.mark.slow
def test_measured_error_is_the_compression_error():
    run_ranks(_measured_error_is_the_compression_error, 2)


GROUP_TIMEOUT = 5.0


def _stalled_peer_raises_within_the_timeout(rank: int, world_size: int, through: str) -> None:
    import time

    from tests.ddp.models import DDP, make_model, train

    if through == "ddp":
        model = DDP(make_model(), bucket_cap_mb=0.02)
        gradcomp.ddp.register(model, "int8", min_numel=0)
        train(model, rank, world_size, 1)
    else:
        gradcomp.all_reduce(torch.ones(4096), "int8")
    if rank == world_size - 1:
        time.sleep(3 * GROUP_TIMEOUT)  # stalled: never joins the next collective
        return
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        if through == "ddp":
            train(model, rank, world_size, 1)
        else:
            gradcomp.all_reduce(torch.ones(4096), "int8")
    waited = time.monotonic() - start
    assert waited < GROUP_TIMEOUT + 5.0, (
        f"raised after {waited:.1f} s, the group's timeout is {GROUP_TIMEOUT} s"
    )


@pytest.mark.slow
@pytest.mark.parametrize("through", ["all_reduce", "ddp"])
def test_a_stalled_peer_makes_the_others_raise_within_the_groups_timeout(through):
    run_ranks(_stalled_peer_raises_within_the_timeout, 3, through, group_timeout=GROUP_TIMEOUT)


def _subgroup_with_a_device_bound_default_group(rank: int, world_size: int) -> None:
    # Subgroups first (every rank), then the default group is marked as bound to
    # a device, as init_process_group(device_id=...) leaves it. torch then
    # creates new groups by splitting the default group's communicator, a
    # collective over every rank: the members alone could not clone their group.
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    default = dist.distributed_c10d._get_default_group()
    bound = torch.device("cpu", 0)
    default.bound_device_id = bound
    try:
        x = _input(rank, 3000, torch.float32)
        expected = x.clone()
        dist.all_reduce(expected, group=mine)
        result = x.clone()
        gradcomp.all_reduce(result, "none", group=mine, op="sum")
        assert torch.equal(result, expected)
        assert default.bound_device_id == bound
    finally:
        default.bound_device_id = None


@pytest.mark.slow
def test_subgroups_work_with_a_device_bound_default_group():
    run_ranks(_subgroup_with_a_device_bound_default_group, 4)


def _after_subgroups_of_some_ranks(rank: int, world_size: int) -> None:
    # The user's subgroups leave the ranks with different numbers of groups
    # (rank 0 is in two, rank 3 in none): gradcomp's private groups must still
    # meet, on the whole group and on a subgroup.
    pair, trio = dist.new_group([0, 1]), dist.new_group([0, 1, 2])
    x = _input(rank, 3000, torch.float32)
    expected = x.clone()
    dist.all_reduce(expected)
    result = x.clone()
    gradcomp.all_reduce(result, "none", op="sum")
    assert torch.equal(result, expected)
    if rank < 3:
        expected = x.clone()
        dist.all_reduce(expected, group=trio)
        result = x.clone()
        gradcomp.all_reduce(result, "none", group=trio, op="sum")
        assert torch.equal(result, expected)
    del pair


@pytest.mark.slow
def test_private_groups_meet_whatever_groups_the_ranks_made_before():
    run_ranks(_after_subgroups_of_some_ranks, 4, timeout=60, group_timeout=15)


class _BySize:
    """A chooser (the protocol of gradcomp.collectives.Chooser): int8 gathered for
    tensors of 1000 elements or more, dense below; it notes where it ran."""

    def __init__(self, name: str = "by size"):
        self.name, self.threads = name, []

    def settings(self) -> dict:
        return {"name": self.name}

    def choice(self, q, tensor, hierarchy):
        self.threads.append(threading.current_thread())
        big = tensor.numel() >= 1000
        plan = _Plan("int8" if big else "none", "allgather" if big else "dense")
        return gradcomp.get_compressor(plan.compressor), plan


@dataclasses.dataclass
class _Plan:
    compressor: str
    algorithm: str
    inter_algorithm: str | None = None


def _any_chooser_and_registered_names(rank: int, world_size: int) -> None:
    from gradcomp.collectives import register_chooser, shared_chooser

    chooser = _BySize()
    for numel, how in ((4097, ("int8", "allgather")), (10, ("none", "dense"))):
        x = _input(rank, numel, torch.float32)
        chosen, static = x.clone(), x.clone()
        stats = gradcomp.all_reduce(chosen, chooser, feedback=False)
        gradcomp.all_reduce(static, how[0], algorithm=how[1], feedback=False)
        assert (stats.compressor, stats.algorithm) == how and torch.equal(chosen, static)
    # It chose on the worker, in call order, not on the caller's thread.
    assert len(chooser.threads) == 2 and threading.current_thread() not in chooser.threads
    # A registered name (any case) stands for one shared instance, made at its first use.
    register_chooser("by-size", _BySize)
    gradcomp.all_reduce(torch.ones(4097), "by-size")
    gradcomp.all_reduce(torch.ones(4097), "BY-SIZE")
    shared = shared_chooser("by-size")
    assert shared is shared_chooser("By-Size") and len(shared.threads) == 2
    with pytest.raises(ValueError, match="names a compressor"):
        register_chooser("Int8", _BySize)
    with pytest.raises(ValueError, match="chooses the algorithm"):
        gradcomp.all_reduce(torch.ones(4), "by-size", algorithm="dense")
    # Ranks whose choosers' settings differ would choose apart: every rank raises.
    named = f"compressor='by size {rank}'"
    with pytest.raises(ValueError, match=f"ranks disagree on the all-reduce's {named} settings"):
        gradcomp.all_reduce(torch.ones(4), _BySize(f"by size {rank}"))


@pytest.mark.slow
def test_all_reduce_takes_any_chooser_and_the_names_registered_for_one():
    run_ranks(_any_chooser_and_registered_names, 2)
