"""Measuring a machine: the link (an alpha-beta fit of collective times over sizes, and on
CPUs the transport's CPU time a byte), each compressor's encode and decode on the
buckets' device, and a hierarchy's levels; :func:`probe` does all of it on every rank and
combines the ranks' figures."""

from __future__ import annotations

import contextlib
import functools
import statistics
import threading
import time
import typing

import torch
import torch.distributed as dist

from gradcomp.collectives import (
    HIERARCHICAL,
    Job,
    ReduceStats,
    allgather_segments,
    c10d,
    cost_model,
    default_algorithm,
    drive,
    ring_all_reduce_bytes,
)
from gradcomp.collectives.hierarchical import hierarchical, node_stages_only
from gradcomp.compressors import Compressor, Context, get_compressor
from gradcomp.planner.profiles import _FASTEST, Codec, Linear, Nodes, Profile, combine
from gradcomp.planner.specs import from_spec, label

LINK_MAX = 2**22  # the largest all-reduce (fp32 elements) the link is timed at when planning
# A probe times each codec this many times as often as the link: on the 2-core machine
# two ranks' probes of int8 and int4 at the 25 MB buckets spread 65-103 and 94-132 ms
# over 4 probes of 5 repeats, 73-83 and 90-97 ms over 4 of 15.
CODEC_REPEATS = 3


def _synchronize(tensor: torch.Tensor) -> None:
    if tensor.is_cuda:
        torch.cuda.synchronize(tensor.device)


def _median_seconds(fn, repeat: int, clock=time.perf_counter) -> float:
    fn()  # warm
    times = []
    for _ in range(repeat):
        began = clock()
        fn()
        times.append(clock() - began)
    return statistics.median(times)


def _other_threads_cpu() -> dict[int, float]:
    """The CPU seconds of this process's other Python threads (the backward pass's, a busy
    thread's), by thread; empty where the platform cannot tell."""
    me, seconds = threading.get_ident(), {}
    for thread in threading.enumerate():
        if thread.ident is None or thread.ident == me:
            continue
        try:
            seconds[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
        except (AttributeError, OSError):  # no per-thread clocks here, or the thread has ended
            continue
    return seconds


def _transport_cpu(fn) -> tuple[float, float]:
    """Wall and CPU seconds of ``fn()``: the process's CPU time (the transport's own threads
    and this one), less what its other Python threads computed meanwhile (one that started
    meanwhile: all it computed). Threads that are not Python threads count as the
    transport's: with several torch threads a rank, a backward pass's share of an op on
    them too (an error towards less overlap credited)."""
    cpu = time.process_time()
    others, began = _other_threads_cpu(), time.perf_counter()  # inside the process's bracket:
    fn()  # what the other threads compute between the readings is never subtracted unseen
    wall, after = time.perf_counter() - began, _other_threads_cpu()
    cpu = time.process_time() - cpu
    cpu -= sum(seconds - others.get(ident, 0.0) for ident, seconds in after.items())
    return wall, min(max(cpu, 0.0), wall)


def _timed_collective(fn, repeat: int, device: torch.device) -> tuple[float, float]:
    """Median wall seconds of ``fn()`` and, on a CPU device, the median CPU seconds of its
    transport (:func:`_transport_cpu`; elsewhere 0: a GPU's collectives leave the host free)."""
    if device.type != "cpu":
        return _median_seconds(fn, repeat), 0.0
    fn()  # warm
    walls, cpus = zip(*(_transport_cpu(fn) for _ in range(repeat)), strict=True)
    return statistics.median(walls), statistics.median(cpus)


def _cpu_per_byte(rows: list[dict]) -> float:
    """The transport's CPU seconds a byte sent, fitted over ``rows`` (0 where none measured it).
    The fit's CPU time a call is left out: what overlaps is a long tensor's pipeline, whose
    segments are large."""
    if not any(r.get("cpu_seconds") for r in rows):
        return 0.0
    line = Linear.fit([r["bytes_sent"] for r in rows], [r["cpu_seconds"] for r in rows])
    return 1.0 / line.rate


# What a CPU codec competes with while it runs in training: a layer's forward and
# weight-gradient matmuls (batch x width @ width x width, and back), streaming a
# width x width fp32 weight through memory as a backward pass of a wide layer does.
BUSY_SHAPE = (64, 4096)


_busy_here = threading.local()  # whether this thread already has a busy thread running


@contextlib.contextmanager
def busy(device: torch.device) -> typing.Iterator[None]:
    """On a CPU, another thread of this process computes until the block ends (a stand-in
    for the backward pass a codec competes with in training); elsewhere, nothing. Nested
    blocks of one thread share the outer block's thread.

    Raises:
        RuntimeError: at the end of the block, if the busy thread failed (the codecs
            were then timed without it).
    """
    if torch.device(device).type != "cpu" or getattr(_busy_here, "active", False):
        yield
        return
    batch, width = BUSY_SHAPE
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(batch, width, generator=generator)
    weight = torch.randn(width, width, generator=generator)
    outputs, gradient = torch.empty(batch, width), torch.empty(width, width)
    stop, started, failed = threading.Event(), threading.Event(), []

    def work() -> None:
        started.set()
        try:
            while not stop.is_set():
                torch.mm(inputs, weight, out=outputs)
                torch.mm(inputs.t(), outputs, out=gradient)
        except Exception as error:  # noqa: BLE001 - reported on the probing thread
            failed.append(error)

    thread = threading.Thread(target=work, name="gradcomp-probe-busy", daemon=True)
    _busy_here.active = True
    try:
        thread.start()
        started.wait()
        yield
    finally:
        stop.set()
        thread.join()
        _busy_here.active = False
    if failed:
        raise RuntimeError(f"the probe's busy thread failed: {failed[0]!r}") from failed[0]


def measure_link(
    sizes: list[int], group=None, repeat: int = 5, device=None
) -> tuple[cost_model.Link, list[dict]]:
    """Time dense fp32 all-reduces of ``sizes`` elements on ``device`` (default: CUDA for an NCCL
    group, else CPU) over ``group`` and fit ``steps * latency + bytes / bandwidth`` (the cost
    model's ring). Every rank must call it; every rank gets the slowest rank's times. On a CPU,
    also the transport's CPU time (``cpu_seconds`` in each row, :func:`_transport_cpu`),
    fitted per byte sent: the part of a collective that takes the host's cores."""
    world = dist.get_world_size(group)
    device = torch.device(device or default_device(group))
    rows = []
    for numel in sorted(set(sizes)):
        tensor = torch.ones(numel, device=device)
        once = functools.partial(_all_reduce_once, tensor, group)
        dist.barrier(group=group)
        seconds = _slowest_rank(_timed_collective(once, repeat, device), group, device)
        rows.append(dict(numel=numel, bytes_sent=ring_all_reduce_bytes(numel * 4, world), **seconds))
    return fit_link(rows, world), rows


def _slowest_rank(timed: tuple[float, float], group, device: torch.device) -> dict:
    """The most of every rank's (wall, CPU) seconds, as a row's ``seconds`` and ``cpu_seconds``."""
    seconds = torch.tensor(timed, dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX, group=group)
    wall, cpu = seconds.tolist()
    return dict(seconds=wall, cpu_seconds=cpu) if device.type == "cpu" else dict(seconds=wall)


def measure_collectives(
    sizes: list[int], group=None, repeat: int = 5, device=None
) -> tuple[dict[str, cost_model.Link], list[dict]]:
    """Like :func:`measure_link`, for the collectives the compressed algorithms use: an
    all-gather whose output holds ``n`` fp32 elements (``n / W`` from each rank) and an
    all-to-all of ``n`` elements a rank; each fitted as ``(W-1) latency + bytes / bandwidth``
    (bytes one rank sends, ring schedules), and on a CPU the transport's CPU time per byte
    (as :func:`measure_link`). Every rank must call it."""
    world = dist.get_world_size(group)
    device = torch.device(device or default_device(group))
    links, rows = {}, []
    for name in ("all_gather", "all_to_all"):
        mine = []
        for numel in sorted(set(sizes)):
            part = max(1, numel // world)
            source = torch.ones(part * world if name == "all_to_all" else part, device=device)
            output = torch.empty(part * world, device=device)
            once = functools.partial(_collective_once, name, output, source, group)
            dist.barrier(group=group)
            seconds = _slowest_rank(_timed_collective(once, repeat, device), group, device)
            mine.append(
                dict(collective=name, numel=part * world, bytes_sent=part * 4 * (world - 1), **seconds)
            )
        line = Linear.fit([r["bytes_sent"] for r in mine], [r["seconds"] for r in mine])
        links[name] = cost_model.Link(line.rate, line.overhead / max(world - 1, 1), _cpu_per_byte(mine))
        rows += mine
    return links, rows


def measure_pingpong(
    sizes: list[int], group=None, repeat: int = 5, device=None
) -> tuple[cost_model.Link, list[dict]]:
    """A pingpong, as the usual point-to-point latency and bandwidth tests run it: the group's
    first two ranks send messages of ``sizes`` fp32 elements back and forth; half a round
    trip is one message's time, fitted as ``latency + bytes / bandwidth``. Every rank of the
    group must call it (the others wait); every rank gets the first rank's figures."""
    if dist.get_world_size(group) < 2:
        raise ValueError("a pingpong needs two ranks")
    device = torch.device(device or default_device(group))
    rank = dist.get_rank(group)
    peers = [dist.get_global_rank(group or dist.group.WORLD, r) for r in (0, 1)]
    rows = []
    for numel in sorted(set(sizes)):
        message = torch.ones(numel, device=device)
        dist.barrier(group=group)
        seconds = 0.0
        if rank < 2:
            seconds = _median_seconds(functools.partial(_round_trip, message, rank, peers, group), repeat) / 2
        seconds = torch.tensor([seconds], dtype=torch.float64, device=device)
        dist.broadcast(seconds, src=peers[0], group=group)
        rows.append(dict(collective="pingpong", numel=numel, bytes_sent=numel * 4, seconds=seconds.item()))
    line = Linear.fit([r["bytes_sent"] for r in rows], [r["seconds"] for r in rows])
    return cost_model.Link(line.rate, line.overhead), rows


def _round_trip(message: torch.Tensor, rank: int, peers: list[int], group) -> None:
    if rank == 0:
        dist.send(message, peers[1], group=group)
        dist.recv(message, peers[1], group=group)
    else:
        dist.recv(message, peers[0], group=group)
        dist.send(message, peers[0], group=group)
    _synchronize(message)


def _collective_once(name: str, output: torch.Tensor, source: torch.Tensor, group) -> None:
    if name == "all_gather":
        c10d.all_gather_single(output, source, group=group)
    else:
        dist.all_to_all_single(output, source, group=group)
    _synchronize(output)


def default_device(group=None) -> torch.device:
    """Where a group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend(group)):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce_once(tensor: torch.Tensor, group) -> None:
    dist.all_reduce(tensor, group=group)
    _synchronize(tensor)


def _encode_once(compressor: Compressor, x: torch.Tensor, residual, segments, buffered: bool) -> None:
    for start, end in segments:
        part = None if residual is None else residual[start:end]
        payload = compressor.compress(x[start:end], Context(residual=part))
        if buffered:
            payload.to_buffer()
    _synchronize(x)


def _decode_once(compressor: Compressor, payloads, out: torch.Tensor) -> None:
    for payload, rows, (start, end) in payloads:
        if rows is None:
            compressor.decompress(payload, out=out[start:end])
        else:
            compressor.decompress_sum(rows, out.dtype, out[start:end], meta=payload.meta, divisor=len(rows))
    _synchronize(out)


def fit_link(rows: list[dict], world_size: int) -> cost_model.Link:
    """Least squares of ``seconds = 2 (W-1) latency + bytes_sent / bandwidth`` over the rows."""
    steps = 2 * (world_size - 1)
    if steps == 0:  # one rank sends nothing: any link will do
        return cost_model.Link(_FASTEST, 0.0)
    line = Linear.fit([r["bytes_sent"] for r in rows], [r["seconds"] for r in rows])
    return cost_model.Link(line.rate, line.overhead / steps, _cpu_per_byte(rows))


# The least share of the largest size's time that the transfer (bytes / bandwidth) must
# take for a fit to tell the bandwidth apart from the per-message latency.
MIN_TRANSFER_SHARE = 0.2


def unsupported_fits(rows: list[dict], links: dict[str, cost_model.Link]) -> list[str]:
    """Why the fitted ``links`` (per collective, as in ``rows``' ``collective``) say more
    than ``rows`` measured, one reason a collective; empty where every fit holds.

    A fit holds where the time grew with the size (else its bandwidth is the bound
    :class:`Linear` puts on a flat line) and where, at the largest size, the transfer
    takes at least ``MIN_TRANSFER_SHARE`` of the time (else latency and jitter hide it)."""
    reasons = []
    for name, link in links.items():
        mine = [r for r in rows if r.get("collective", "all_reduce") == name]
        if not mine:
            continue
        largest = max(mine, key=lambda r: r["bytes_sent"])
        sizes = f"{min(r['numel'] for r in mine):,} to {largest['numel']:,} elements"
        if link.bandwidth >= _FASTEST or len({r["numel"] for r in mine}) < 2:
            reasons.append(
                f"{name}: its time did not grow with the size ({sizes}), so no bandwidth can be fitted"
            )
            continue
        share = largest["bytes_sent"] / link.bandwidth / largest["seconds"] if largest["seconds"] > 0 else 0
        if share < MIN_TRANSFER_SHARE:
            reasons.append(
                f"{name}: at {largest['numel']:,} elements the transfer is {share:.0%} of the time, the rest "
                f"latency and jitter, so the fitted {link.bandwidth * 8 / 1e9:.3g} Gbit/s is not measured"
            )
    return reasons


def measure_codec(compressor: Compressor | str, sizes: list[int], device="cpu", repeat: int = 5) -> Codec:
    """Time the encode and decode of ``sizes`` random fp32 elements on ``device`` as the
    algorithms run them; fit each.

    Encode: ``compress`` (with a residual when the compressor keeps one by default); of
    a summable payload (casts) the whole tensor's, which an all-reduce sums as it is; of
    others each pipeline segment's (:func:`gradcomp.collectives.allgather_segments`),
    written into its send buffer. Decode: of a summable payload, ``decompress`` of the
    one summed; of others, ``decompress_sum`` of two ranks' rows a segment (zeroing,
    two accumulating decodes and the division: what every reduction of received rows
    runs), counted as one row's, half of it.

    On a CPU the codec is timed while another thread computes (:func:`busy`), by the CPU
    time of the thread that runs it: in training it shares the cores, caches and memory
    with the backward pass, and what it adds to a step is the work it does there, not its
    waits for a turn on a core. Where torch runs an op on
    several threads, the thread that calls it does its share: what the op adds to a step
    whose cores are all busy; work it does alone (Python, serial ops) counts in full."""
    compressor = from_spec(compressor)
    device = torch.device(device)
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    summed = default_algorithm(compressor, 2) == "dense"
    encode, decode = [], []
    with busy(device):
        for numel in sizes:
            x = torch.randn(numel, generator=torch.Generator().manual_seed(numel)).to(device)
            out = torch.empty_like(x)
            # With error feedback where the compressor has it by default: the fused pass training runs.
            residual = torch.zeros_like(x) if compressor.needs_feedback else None
            segments = [(0, numel)] if summed else allgather_segments(compressor, numel, device)
            payloads = []
            for start, end in segments:
                payload = compressor.compress(x[start:end])
                rows = None if summed else torch.stack([payload.to_buffer()] * 2)
                payloads.append((payload, rows, (start, end)))
            encoding = functools.partial(_encode_once, compressor, x, residual, segments, not summed)
            decoding = functools.partial(_decode_once, compressor, payloads, out)
            encode.append(_median_seconds(encoding, repeat, clock))
            decode.append(_median_seconds(decoding, repeat, clock) / (1 if summed else 2))
    return Codec(Linear.fit(sizes, encode), Linear.fit(sizes, decode))


def measure_nodes(hierarchy, sizes: list[int], repeat: int = 5, device=None) -> tuple[Nodes, list[dict]]:
    """Time ``hierarchy``'s levels (a :class:`gradcomp.collectives.hierarchical.Hierarchy`
    of several nodes): the node's dense stages of ``sizes`` elements, fitted as
    ``overhead + n / rate``, and between nodes the all-reduce, all-gather and all-to-all
    of every local rank's group at once. Every rank of the hierarchy's group must call it."""
    device = torch.device(device or default_device(hierarchy.intra.group))
    stages_only, seconds, numels = node_stages_only(hierarchy), [], sorted(set(sizes))
    for numel in numels:
        flat = torch.ones(numel, device=device)
        job = Job(flat, get_compressor("none"), "avg", HIERARCHICAL, None, key=0, step=0)

        def stages(job=job, flat=flat) -> None:
            drive(hierarchical(job, flat, stages_only, ReduceStats()))
            _synchronize(flat)

        dist.barrier(group=hierarchy.intra.group)
        seconds.append(_median_seconds(stages, repeat))
        stages_only.areas.clear()  # one size's shared memory at a time
    rows = [dict(collective="node stages", numel=n, seconds=t) for n, t in zip(numels, seconds, strict=True)]
    # Between nodes: every local rank's group at once, as in training (they share the NICs).
    shards = sorted({max(1, -(-n // hierarchy.node_size)) for n in sizes})
    dist.barrier(group=hierarchy.intra.group)
    link, more = measure_link(shards, hierarchy.inter.group, repeat, device)
    links, collectives = measure_collectives(shards, hierarchy.inter.group, repeat, device)
    for row in more:
        row["collective"] = "all_reduce"
    for row in [*more, *collectives]:
        row["collective"] = "between nodes: " + row["collective"]
    stages = Linear.fit(numels, seconds)
    nodes = Nodes(hierarchy.node_size, len(hierarchy.nodes), stages, link, links)
    return nodes, rows + more + collectives


def probe(
    sizes: list[int],
    compressors,
    codec_sizes: list[int] | None = None,
    group=None,
    repeat: int = 5,
    device=None,
    hierarchy=None,
    pingpong: bool = False,
    codec_repeat: int | None = None,
):
    """Measure this group's link and, on every rank, each compressor's codec on ``device``
    (default: CUDA for an NCCL group, else CPU); every rank returns the same
    :class:`Profile` (the slowest of each measurement) and the timings of each
    collective (all-reduce, all-gather, all-to-all; ``collective`` in each row).
    With a ``hierarchy`` of several nodes of several ranks, its levels too
    (:func:`measure_nodes`; the codecs also at the shards' sizes). With ``pingpong``,
    a :func:`measure_pingpong` too, kept as ``links["pingpong"]`` (for people: no
    algorithm is predicted on it). Each codec is timed ``codec_repeat`` times (default
    ``CODEC_REPEATS`` times ``repeat``): on a shared CPU a codec's time varies more than
    the link's, and its median settles only over more runs."""
    device = torch.device(device or default_device(group))
    link, rows = measure_link(sizes, group, repeat, device)
    for row in rows:
        row["collective"] = "all_reduce"
    links, more = (
        measure_collectives(sizes, group, repeat, device) if dist.get_world_size(group) > 1 else ({}, [])
    )
    rows += more
    if pingpong and dist.get_world_size(group) > 1:
        links["pingpong"], more = measure_pingpong(sizes, group, repeat, device)
        rows += more
    codec_sizes = set(codec_sizes or sizes)
    nodes = None
    if hierarchy is not None and hierarchy.node_size > 1 and len(hierarchy.nodes) > 1:
        nodes, more = measure_nodes(hierarchy, sizes, repeat, device)
        rows += more
        codec_sizes |= {max(1, -(-n // hierarchy.node_size)) for n in codec_sizes}
    codecs = {}
    with busy(device):  # one busy thread for every codec (measure_codec's own nest in it)
        for spec in compressors:
            compressor = from_spec(spec)
            if compressor.name != "none":
                times = CODEC_REPEATS * repeat if codec_repeat is None else codec_repeat
                codecs[label(compressor)] = measure_codec(compressor, sorted(codec_sizes), device, times)
    world = dist.get_world_size(group)
    mine = Profile(
        device_name(device), link, codecs, world, f"{dist.get_backend(group)}, {world} ranks", links, nodes
    )
    everyone = [None] * world
    dist.all_gather_object(everyone, mine, group=group)
    return combine(everyone), rows


def device_name(device: torch.device) -> str:
    """The device a profile was measured on, in words."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import os
    import platform

    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as info:
            model = next(line.split(":", 1)[1].strip() for line in info if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} CPUs ({model})"
