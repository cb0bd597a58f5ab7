"""The planner: its cost model and decisions on injected measurements, agreement across ranks,
and the probe and plan commands on tiny sizes."""

import dataclasses
import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp import cli, planner, spawn
from gradcomp.collectives import cost_model, two_phase
from gradcomp.compressors import BF16, Int8


def profile(bandwidth: float, latency: float = 20e-6, rate: float = 1e9, overhead: float = 50e-6):
    """A profile of every safe compressor, each encoding and decoding at ``rate`` elements a second."""
    line = planner.Linear(overhead, rate)
    codecs = {name: planner.Codec(line, line) for name in ("bf16", "int8", "int4", "topk", "sign")}
    return planner.Profile("test device", cost_model.Link(bandwidth, latency), codecs, 2, "injected")


GBIT = 1e9 / 8
BUCKET = 25 * 2**20 // 4  # a 25 MB DDP bucket of fp32


def test_linear_fit_recovers_a_line_and_stays_finite():
    line = planner.Linear.fit([1000, 2000, 4000], [0.003, 0.005, 0.009])
    assert line.overhead == pytest.approx(1e-3) and line.rate == pytest.approx(5e5)
    assert line.seconds(3000) == pytest.approx(0.007) and line.seconds(0) == 0.0
    # Noise that tilts the line below the origin: fitted through the origin instead.
    through = planner.Linear.fit([1000, 2000], [0.001, 0.0030])
    assert through.overhead == 0.0 and through.seconds(2000) == pytest.approx(0.0028)
    # Flat or falling times: all overhead, a finite rate (the profile stays plain JSON).
    flat = planner.Linear.fit([1000, 2000], [0.002, 0.001])
    assert flat.overhead == 0.002 and flat.rate == planner.profiles._FASTEST


def test_a_prediction_is_the_scale_models_exchange_plus_the_algorithms_codec_passes():
    p = profile(GBIT)
    for name, algorithm, (encode, encode_calls, decode, decode_calls) in (
        ("int8", "two_phase", (1 + 1 / 4, 2, 2 - 1 / 4, 7)),
        ("int8", "allgather", (1, 1, 4, 4)),
        ("bf16", "dense", (1, 1, 1, 1)),
    ):
        got = planner.predict(name, BUCKET, 4, p, algorithm)
        cost = cost_model.cost(name, BUCKET, 4, algorithm)
        assert got.bytes_sent == cost.bytes_sent and got.exchange_seconds == cost.seconds(p.link)
        codec = p.codecs[name]
        expected = encode_calls * codec.encode.overhead + encode * BUCKET / codec.encode.rate
        expected += decode_calls * codec.decode.overhead + decode * BUCKET / codec.decode.rate
        assert got.codec_seconds == pytest.approx(expected) and got.seconds > got.exchange_seconds
    dense = planner.predict("none", BUCKET, 4, p)
    assert dense.codec_seconds == 0 and dense.bytes_sent == cost_model.cost("none", BUCKET, 4).bytes_sent


def test_a_slow_link_picks_a_low_bit_quantizer_and_a_fast_one_sends_dense_or_bf16():
    slow = planner.best_plan([BUCKET], 8, profile(GBIT))
    assert [(c.compressor, c.algorithm) for c in slow] == [("int4", "two_phase")]
    # At 400 Gbit/s with codecs of 1G elements a second, compressing costs more than it saves.
    fast = planner.best_plan([BUCKET], 8, profile(400 * GBIT))
    assert fast[0].compressor in ("none", "bf16")
    # Without a fast codec even 10 Gbit/s stays dense.
    assert planner.best_plan([BUCKET], 8, profile(10 * GBIT, rate=1e8))[0].compressor == "none"


def test_half_precision_buckets_are_weighed_by_their_own_bytes():
    n, fast_codecs = 6_553_600, profile(25 * GBIT, rate=1e11)
    # fp32 gradients: casting to bf16 halves the bytes and pays at 25 Gbit/s.
    assert planner.best_plan([n], 2, fast_codecs, ("none", "bf16"))[0].compressor == "bf16"
    for dtype in (torch.bfloat16, torch.float16):
        dense = planner.predict("none", n, 2, fast_codecs, dtype=dtype)
        assert dense.bytes_sent == planner.predict("none", n, 2, fast_codecs).bytes_sent // 2
        # Gradients already of 2 bytes: the cast saves nothing, dense it is.
        plan = planner.best_plan([n], 2, fast_codecs, ("none", "bf16"), dtypes=[dtype])
        assert plan[0].compressor == "none" and plan[0].bytes_sent == dense.bytes_sent
        assert planner.runner_up([n], 2, fast_codecs, plan, ("none", "bf16"), dtypes=[dtype]) is None
    # Where int8 pays for fp32 gradients but not for bf16 ones (dense sends half as much):
    # per bucket, each by its own type.
    fastest = profile(100 * GBIT, rate=1e11)
    plan = planner.best_plan([n, n], 2, fastest, ("none", "int8"), dtypes=[torch.float32, torch.bfloat16])
    assert [p.compressor for p in plan] == ["int8", "none"]
    with pytest.raises(ValueError, match="dtypes has 1 types for 2 buckets"):
        planner.best_plan([n, n], 2, fastest, dtypes=[torch.float32])
    # Hierarchical: the node's stages send the gradients' own bytes too.
    nodes = dataclasses.replace(profile(GBIT), world_size=8, nodes=_two_nodes(GBIT))
    between = dataclasses.replace(nodes, link=nodes.nodes.link, nodes=None)
    shard = -(-n // 4)
    for dtype in (torch.float32, torch.bfloat16):
        got = planner.predict("int8", n, 8, nodes, "hierarchical", dtype=dtype)
        inner = planner.predict("int8", shard, 2, between, dtype=dtype)
        assert got.bytes_sent == 2 * 3 * shard * dtype.itemsize + inner.bytes_sent


def test_buckets_below_the_break_even_size_stay_dense():
    p = profile(GBIT, latency=20e-6, overhead=2e-3)  # 2 ms to start a codec
    plan = planner.best_plan([256, 4096, 65536, BUCKET], 2, p)
    assert [c.compressor for c in plan][:2] == ["none", "none"] and plan[-1].compressor != "none"


def test_a_bucket_reduced_while_the_backward_pass_runs_stays_dense():
    p, numels = profile(GBIT), [BUCKET, BUCKET]
    flat = planner.best_plan(numels, 8, p)
    assert all(c.compressor == "int4" for c in flat)  # the premise: each pays on its own
    dense = planner.predict("none", BUCKET, 8, p).seconds
    # The first bucket ready long before the backward pass ends: reduced dense, it is done by
    # then, and compressing it gains nothing.
    hidden = planner.best_plan(numels, 8, p, ready=[-3 * dense, 0.0])
    assert [c.compressor for c in hidden] == ["none", "int4"]
    # Ready just before the end: what it saves shortens what is left: compressed.
    assert planner.best_plan(numels, 8, p, ready=[-0.1 * dense, 0.0]) == flat
    assert planner.exposed_seconds([-1.0, 0.0], [0.5, 0.2]) == pytest.approx(0.2)
    assert planner.exposed_seconds([-1.0, 0.0], [2.0, 0.2]) == pytest.approx(1.2)
    with pytest.raises(ValueError, match="ready has 1 times for 2 buckets"):
        planner.best_plan(numels, 8, p, ready=[0.0])


def test_only_allowed_candidates_are_chosen():
    plan = planner.best_plan([BUCKET], 8, profile(0.1 * GBIT), candidates=("int8",))
    assert plan[0].compressor == "int8"
    allowed = planner.best_plan([BUCKET], 8, profile(0.1 * GBIT), candidates=(*planner.SAFE, "topk@0.01"))
    assert allowed[0].compressor == "topk"
    with pytest.raises(KeyError, match="no measurement of 'ternary'"):
        planner.best_plan([BUCKET], 8, profile(GBIT), candidates=("ternary",))
    with pytest.raises(ValueError, match="low-rank"):
        planner.best_plan([BUCKET], 8, profile(GBIT), candidates=("powersgd",))


def test_candidates_parse_short_and_long_options():
    assert planner.from_spec("topk@0.05").ratio == 0.05
    assert planner.label(planner.from_spec("int4:block=128")) == "int4:block=128"
    assert planner.label(planner.from_spec("topk@0.05")) == "topk:ratio=0.05"
    assert planner.from_spec("int8:stochastic=true").stochastic is True
    # String options round-trip through the label (the hook rebuilds its plan's compressors from them).
    topk = planner.from_spec("topk:index_dtype=int32")
    assert planner.label(planner.from_spec(planner.label(topk))) == planner.label(topk)
    assert planner.label(planner.from_spec("int8")) == "int8"
    for spec, message in (
        ("sign@3", "take name@value"),
        ("int8:block", "key=value"),
        ("int8:block=x", "block must be an integer"),
    ):
        with pytest.raises(ValueError, match=message):
            planner.from_spec(spec)


def test_a_pipelined_two_phase_on_cpus_overlaps_its_codec_with_its_exchange():
    from gradcomp.collectives import allgather_segments, two_phase_segments

    on_cpu = dataclasses.replace(profile(GBIT / 10, rate=1e8), device="2 CPUs (test)")
    on_gpu = dataclasses.replace(on_cpu, device="NVIDIA H200")
    assert on_cpu.on_cpu and not on_gpu.on_cpu and not profile(GBIT).on_cpu
    long, short = 12 * 2**20, 2**20
    segments = len(two_phase_segments(long, 2, 32, torch.device("cpu")))
    assert segments == 6
    cpu, gpu = (planner.predict("int8", long, 2, p, "two_phase") for p in (on_cpu, on_gpu))
    exchange, codec = cpu.exchange_seconds, cpu.codec_seconds
    assert (exchange, codec) == (gpu.exchange_seconds, gpu.codec_seconds) and gpu.overlap_seconds == 0
    assert cpu.seconds == pytest.approx(max(exchange, codec) + min(exchange, codec) / segments)
    # An all-gather of a dense payload too, in its own segments (whole ones: twice two_phase's).
    gathered = planner.predict("int8", long, 2, on_cpu, "allgather")
    whole = len(allgather_segments(gradcomp.get_compressor("int8"), long, torch.device("cpu")))
    assert whole == 12 and gathered.overlap_seconds == pytest.approx(
        min(gathered.exchange_seconds, gathered.codec_seconds) * (1 - 1 / whole)
    )
    # One segment, a sparse all-gather or two-phase: nothing overlaps.
    for compressor, numel, algorithm in (("int8", short, "two_phase"), ("topk", long, "allgather")):
        assert planner.predict(compressor, numel, 2, on_cpu, algorithm).overlap_seconds == 0
    assert planner.predict("topk", long, 4, on_cpu, "two_phase").overlap_seconds == 0


def test_the_transports_cpu_time_overlaps_no_codec():
    # On CPUs a collective's transport copies the bytes on the cores the codec runs on: only
    # its wait on the wire overlaps a pipeline's codec work.
    on_cpu = dataclasses.replace(profile(GBIT, rate=1e8), device="2 CPUs (test)")
    numel = 12 * 2**20
    free = planner.predict("int8", numel, 2, on_cpu, "allgather")
    segments = round(1 / (1 - free.overlap_seconds / min(free.exchange_seconds, free.codec_seconds)))
    assert segments == 12  # the whole exchange waits on the wire: the overlap as before
    cost = cost_model.cost("int8", numel, 2, "allgather")
    for share in (0.25, 0.5, 1.0, 2.0):  # the CPU time a byte: that share of the wire's
        busy = dataclasses.replace(on_cpu.link, cpu_seconds_per_byte=share / GBIT)
        on = dataclasses.replace(on_cpu, link=busy)
        p = planner.predict("int8", numel, 2, on, "allgather")
        assert (p.exchange_seconds, p.codec_seconds) == (free.exchange_seconds, free.codec_seconds)
        transport = min(share * cost.bytes_sent / GBIT, p.exchange_seconds)  # at most the exchange
        assert cost.cpu_seconds(busy) == pytest.approx(transport)
        waiting = p.exchange_seconds - transport
        assert p.overlap_seconds == pytest.approx(min(waiting, p.codec_seconds) * (1 - 1 / segments))
        assert p.overlap_seconds < free.overlap_seconds or waiting >= p.codec_seconds
    assert on.link.cpu_seconds_per_byte and p.overlap_seconds == 0  # all CPU: nothing overlaps
    # Each collective on its own fit's CPU time; a link without one (a GPU's, a typed link) has none.
    gather = cost_model.Link(GBIT, 0.0, 1 / GBIT)
    assert cost_model.cost("int8", numel, 2, "allgather").cpu_seconds(
        on_cpu.link, {"all_gather": gather}
    ) == (pytest.approx(cost.bytes_sent / GBIT))
    assert cost.cpu_seconds(on_cpu.link) == 0
    # Another wire keeps the host's CPU time a byte.
    assert on.with_link(GBIT / 10).link == cost_model.Link(GBIT / 10, on.link.latency, 2 / GBIT)


def test_the_transports_cpu_time_is_the_processs_less_its_other_python_threads():
    stop = threading.Event()

    def compute():  # another Python thread (the backward pass, say) computes throughout
        while not stop.is_set():
            pass

    other, started = (threading.Thread(target=compute, daemon=True) for _ in range(2))
    other.start()
    try:
        wall, cpu = planner.measure._transport_cpu(lambda: time.sleep(0.2))  # waits: no CPU of its own
        assert wall >= 0.2 and cpu < 0.05

        def spin():
            began = time.thread_time()
            while time.thread_time() - began < 0.1:
                pass

        wall, cpu = planner.measure._transport_cpu(spin)  # this thread's own CPU time counts
        assert 0.08 <= cpu <= wall

        def start_another():  # a Python thread started meanwhile: none of its CPU time counts
            started.start()
            time.sleep(0.2)

        wall, cpu = planner.measure._transport_cpu(start_another)
        assert wall >= 0.2 and cpu < 0.05
    finally:
        stop.set()
        other.join()
        if started.is_alive():
            started.join()


def test_the_transports_cpu_time_is_fitted_per_byte_sent():
    rows = [dict(bytes_sent=n, cpu_seconds=1e-4 + 2e-9 * n) for n in (2**16, 2**20, 2**24)]
    assert planner.measure._cpu_per_byte(rows) == pytest.approx(2e-9)  # the slope: a call's 0.1 ms left out
    unmeasured = [dict(bytes_sent=n, seconds=1.0) for n in (1, 2)]
    assert planner.measure._cpu_per_byte(unmeasured) == 0


def test_each_collective_of_an_algorithm_goes_on_its_own_fit():
    numel = 2**20
    pairs = ("int8", "two_phase"), ("int8", "allgather"), ("topk", "two_phase"), ("none", "dense")
    for name, algorithm in pairs:
        cost = cost_model.cost(name, numel, 4, algorithm)
        assert sum(p[1] for p in cost.phases) == cost.bytes_sent
        assert sum(p[2] for p in cost.phases) == cost.steps
    on_ring = profile(GBIT)
    # An all-gather ten times slower than the all-reduce's fit; all-to-all without a fit of its own.
    slow_gather = dataclasses.replace(on_ring, links={"all_gather": cost_model.Link(GBIT / 10, 20e-6)})
    for name, algorithm in (("int8", "allgather"), ("int8", "two_phase"), ("bf16", "dense")):
        fast, slow = (planner.predict(name, numel, 4, p, algorithm) for p in (on_ring, slow_gather))
        cost = cost_model.cost(name, numel, 4, algorithm)
        gathered = sum(b for c, b, _ in cost.phases if c == "all_gather")
        assert slow.exchange_seconds == pytest.approx(fast.exchange_seconds + 9 * gathered / GBIT)
        assert slow.codec_seconds == fast.codec_seconds
    # On another link every collective goes on it.
    assert slow_gather.with_link(GBIT).links == {}


def test_profiles_combine_to_the_slowest_and_round_trip_through_json(tmp_path):
    fast, slow = profile(10 * GBIT, 10e-6, rate=2e9), profile(GBIT, 30e-6, rate=1e9, overhead=1e-4)
    fast = dataclasses.replace(
        fast, links={"all_gather": cost_model.Link(GBIT, 5e-6, 1e-9), "all_to_all": fast.link}
    )
    slow = dataclasses.replace(slow, links={"all_gather": cost_model.Link(2 * GBIT, 50e-6, 1e-10)})
    both = planner.combine([fast, slow])
    assert both.link == cost_model.Link(GBIT, 30e-6)
    # Per collective too, where every rank has a fit of it; the most CPU time a byte.
    assert both.links == {"all_gather": cost_model.Link(GBIT, 50e-6, 1e-9)}
    assert both.codecs["int8"].encode == planner.Linear(1e-4, 1e9)
    path = tmp_path / "profile.json"
    both.save(path)
    assert planner.Profile.load(path) == both
    assert json.loads(path.read_text())["link"]["bandwidth"] == GBIT
    # A profile saved before links had a CPU time loads with none.
    data = json.loads(path.read_text())
    for link in (data["link"], *data["links"].values()):
        del link["cpu_seconds_per_byte"]
    path.write_text(json.dumps(data))
    assert planner.Profile.load(path).links["all_gather"] == cost_model.Link(GBIT, 50e-6)


STAGES = planner.Linear(1e-4, 1e9)  # a node's dense stages: 0.1 ms, then 1G elements a second
FREE = planner.Linear(0.0, 1e12)  # stages that take no time


def _two_nodes(between: float, stages: planner.Linear = STAGES) -> planner.Nodes:
    """Two nodes of four ranks, ``between`` bytes a second from node to node."""
    return planner.Nodes(4, 2, stages, cost_model.Link(between, 20e-6))


def test_hierarchical_is_the_nodes_stages_plus_a_shards_reduction_between_nodes():
    p = dataclasses.replace(profile(10 * GBIT), world_size=8, nodes=_two_nodes(GBIT))
    got = planner.predict("int8", BUCKET, 8, p, "hierarchical", "allgather")
    between = dataclasses.replace(p, link=p.nodes.link, nodes=None)
    inner = planner.predict("int8", BUCKET // 4, 2, between, "allgather")
    assert got.how == "hierarchical(allgather)" and got.inter_algorithm == "allgather"
    assert got.exchange_seconds == pytest.approx(p.nodes.stages.seconds(BUCKET) + inner.exchange_seconds)
    assert got.codec_seconds == inner.codec_seconds
    assert got.bytes_sent == 2 * 3 * (BUCKET // 4) * 4 + inner.bytes_sent
    # Without an algorithm between nodes, the compressor's default there (2 nodes: allgather).
    assert planner.predict("int8", BUCKET, 8, p, "hierarchical").inter_algorithm == "allgather"
    for bad in (profile(GBIT), dataclasses.replace(p, nodes=planner.Nodes(2, 2, p.nodes.stages, p.link))):
        with pytest.raises(ValueError, match="hierarchical over 8 ranks"):
            planner.predict("int8", BUCKET, 8, bad, "hierarchical")


def test_a_slow_link_between_fast_nodes_picks_hierarchical_and_one_node_never_does():
    # 10 Gbit/s measured over the whole group, 1 Gbit/s between nodes: the flat ring's
    # fit hides the slow hop, which the nodes' measurement shows.
    flat = dataclasses.replace(profile(GBIT), world_size=8)
    nodes = dataclasses.replace(flat, nodes=_two_nodes(GBIT))
    chosen = planner.best_plan([BUCKET], 8, nodes)[0]
    assert (chosen.compressor, chosen.algorithm) == ("int4", "hierarchical")
    assert chosen.seconds < planner.best_plan([BUCKET], 8, flat)[0].seconds
    # Slow stages inside the node (a second each): flat again.
    slow_stages = dataclasses.replace(flat, nodes=_two_nodes(GBIT, planner.Linear(1.0, 1e9)))
    assert planner.best_plan([BUCKET], 8, slow_stages)[0].algorithm != "hierarchical"
    # One node, or nodes of one rank: nothing to choose between.
    for size, count in ((8, 1), (1, 8)):
        one = dataclasses.replace(flat, nodes=planner.Nodes(size, count, FREE, flat.link))
        assert planner.best_plan([BUCKET], 8, one)[0].algorithm != "hierarchical"
    # fp32 dense goes flat: "none" is never hierarchical.
    assert all(p.algorithm == "dense" for p in planner.best_plan([BUCKET], 8, nodes, candidates=("none",)))


def test_nodes_combine_to_the_slowest_and_round_trip_through_json(tmp_path):
    first = dataclasses.replace(profile(GBIT), nodes=_two_nodes(GBIT))
    # Slower between nodes, faster stages (overhead aside); a fit of one collective only.
    nodes = _two_nodes(GBIT / 2, planner.Linear(2e-4, 2e9))
    nodes = dataclasses.replace(nodes, links={"all_gather": cost_model.Link(GBIT, 1e-5)})
    second = dataclasses.replace(profile(GBIT), nodes=nodes)
    both = planner.combine([first, second])
    assert both.nodes == planner.Nodes(4, 2, planner.Linear(2e-4, 1e9), cost_model.Link(GBIT / 2, 20e-6), {})
    assert both.with_link(GBIT).nodes is None  # measured on the old link
    path = tmp_path / "profile.json"
    both.save(path)
    assert planner.Profile.load(path) == both
    # A rank without nodes (or with another layout): no hierarchical for anyone.
    assert planner.combine([first, profile(GBIT)]).nodes is None
    other = dataclasses.replace(profile(GBIT), nodes=planner.Nodes(2, 4, planner.Linear(0, 1e9), first.link))
    assert planner.combine([first, other]).nodes is None


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


@pytest.mark.slow
def test_probe_command_writes_a_profile_that_plan_uses(tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = [
        "probe",
        "--sizes",
        "64K,4M",
        "--codec-sizes",
        "1K,16K",
        "--compressors",
        "none,int8,int4",
        "--repeat",
        "3",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "us per ring step" in text and "wrote" in text
    assert "fit, pingpong: " in text and " us one way" in text
    assert "transport CPU ms" in text and "ms of the host's CPU a MB sent" in text
    measured = planner.Profile.load(out)
    # The pingpong is kept where its fit holds (one slow round trip on loopback can flatten it).
    assert set(measured.links) - {"pingpong"} == {"all_gather", "all_to_all"}
    assert set(measured.codecs) == {"int8", "int4"} and measured.link.bandwidth > 0
    argv = ["plan", "--params", "100M", "--world", "16", "--bandwidth", "1gbit", "--profile", str(out)]
    assert cli.main([*argv, "--compute-ms", "300", "--allow", "none,int8,int4"]) == 0
    text = capsys.readouterr().out
    assert f"100,000,000 fp32 parameters in {-(-100_000_000 // BUCKET)} buckets of 25 MB, 16 ranks" in text
    assert "auto picks:" in text and "Amdahl" in text


def _rows(collective: str, points: list[tuple[int, float]]) -> list[dict]:
    return [dict(collective=collective, numel=n, bytes_sent=4 * n, seconds=t) for n, t in points]


def test_a_fit_the_sizes_cannot_support_is_named():
    # 1 ms a message and 1 GB/s: 4M elements take 17 ms, most of it the transfer.
    good = _rows("all_reduce", [(n, 1e-3 + 4 * n / 1e9) for n in (4096, 65536, 1 << 20, 4 << 20)])
    flat = _rows("all_gather", [(4096, 2e-4), (65536, 1.9e-4)])  # jitter: no growth
    small = _rows("all_to_all", [(4096, 1e-3), (65536, 1.03e-3)])  # latency hides the transfer
    rows = good + flat + small
    links = {name: planner.measure.fit_link([r for r in rows if r["collective"] == name], 2) for name in
             ("all_reduce", "all_gather", "all_to_all")}  # fmt: skip
    reasons = planner.unsupported_fits(rows, links)
    assert len(reasons) == 2, reasons
    assert reasons[0].startswith("all_gather: its time did not grow with the size (4,096 to 65,536 elements)")
    assert reasons[1].startswith("all_to_all: at 65,536 elements the transfer is ")
    assert planner.unsupported_fits(good, {"all_reduce": links["all_reduce"]}) == []


def test_probe_leaves_out_a_pingpong_its_sizes_cannot_support(tmp_path, capsys, monkeypatch):
    rows = _rows("all_reduce", [(65536, 1e-3 + 4 * 65536 / 1e9), (4 << 20, 1e-3 + 16 * (1 << 20) / 1e9)])
    rows += _rows("pingpong", [(65536, 3.9e-3), (4 << 20, 3.7e-3)])  # one slow round trip: no growth
    fit = planner.measure.fit_link
    pingpong = {"pingpong": fit(rows[2:], 2)}
    profile = planner.Profile("cpu", fit(rows[:2], 2), {}, 2, "gloo, 2 ranks", pingpong, None)
    monkeypatch.setattr(spawn, "run_ranks", lambda *args, **kwargs: (profile, rows))
    out = tmp_path / "profile.json"
    assert cli.main(["probe", "--sizes", "64K,4M", "--compressors", "int8", "--out", str(out)]) == 0
    assert "not kept: pingpong: its time did not grow" in capsys.readouterr().out
    assert planner.Profile.load(out).links == {}


def test_probe_refuses_to_write_a_fit_its_sizes_cannot_support(tmp_path, capsys, monkeypatch):
    rows = _rows("all_reduce", [(4096, 1e-4), (65536, 0.9e-4)])
    profile = planner.Profile("cpu", planner.measure.fit_link(rows, 2), {}, 2, "gloo, 2 ranks", {}, None)
    monkeypatch.setattr(spawn, "run_ranks", lambda *args, **kwargs: (profile, rows))
    out = tmp_path / "profile.json"
    argv = ["probe", "--sizes", "4K,64K", "--codec-sizes", "64K", "--compressors", "int8", "--out", str(out)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"not writing {out}" in err and "all_reduce: its time did not grow with the size" in err
    assert not out.exists()


def test_plan_with_params_prints_every_candidate_and_the_choice(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(GBIT).save(path)
    argv = ["plan", "--params", "350M", "--world", "16", "--profile", str(path), "--compute-ms", "500"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    buckets = 350_000_000 // BUCKET + 1
    assert f"350,000,000 fp32 parameters in {buckets} buckets of 25 MB, 16 ranks; link 1 Gbit/s" in text
    rows = {tuple(line.split()[:2]) for line in text.splitlines()}
    assert {("none", "dense"), ("bf16", "dense"), ("int8", "two_phase"), ("int4", "allgather")} <= rows
    assert f"auto picks: int4 (two_phase) for {buckets} buckets" in text
    # A faster link given on the command line replaces the profile's.
    assert cli.main([*argv, "--bandwidth", "400gbit", "--latency", "5us"]) == 0
    assert "link 400 Gbit/s per rank, 5 us a ring step" in capsys.readouterr().out
    # bf16 gradients: twice the elements a bucket, half the bytes dense, and no cast to bf16.
    assert cli.main([*argv, "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    buckets = -(-350_000_000 // (2 * BUCKET))
    assert f"350,000,000 bf16 parameters in {buckets} buckets of 25 MB, 16 ranks" in text
    rows = {tuple(line.split()[:3]) for line in text.splitlines()}
    assert ("none", "dense", f"{2 * 350_000_000 * 15 / 16 * 2 / 1e6:.4g}") in rows  # a ring's bytes
    assert not any(row[0] == "bf16" for row in rows) and "auto picks: int4" in text
    assert cli.main(["plan", "--dtype", "bf16"]) == 2 and "--dtype needs --params" in capsys.readouterr().err


def test_plan_on_nodes_weighs_hierarchical_with_the_link_inside_a_node(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(GBIT).save(path)
    argv = ["plan", "--params", "350M", "--world", "16", "--profile", str(path), "--node-size", "8"]
    # 1 Gbit/s between nodes, NVLink-like inside: the shard's int4 between nodes wins.
    assert cli.main([*argv, "--intra-bandwidth", "7200gbit", "--intra-latency", "5us"]) == 0
    text = capsys.readouterr().out
    assert "nodes of 8 ranks: inside one 7.2e+03 Gbit/s per rank, 5 us a ring step" in text
    rows = {tuple(line.split()[:2]) for line in text.splitlines()}
    expected = {("int8", "two_phase"), ("int4", "hierarchical(two_phase)"), ("bf16", "hierarchical(dense)")}
    assert expected <= rows
    assert ("none", "hierarchical(dense)") not in rows
    buckets = 350_000_000 // BUCKET + 1
    assert f"auto picks: int4 (hierarchical(allgather)) for {buckets} buckets" in text
    # Inside a node no faster than between nodes (the profile's own 1 Gbit/s): flat.
    assert cli.main(argv) == 0
    assert f"auto picks: int4 (two_phase) for {buckets} buckets" in capsys.readouterr().out
    assert cli.main([*argv[:-1], "5"]) == 2
    assert "--node-size 5 does not divide 16 ranks" in capsys.readouterr().err
    assert cli.main([*argv[:-2], "--intra-bandwidth", "1gbit"]) == 2
    assert "need --node-size" in capsys.readouterr().err
    assert cli.main(["plan", "--node-size", "2"]) == 2 and "needs --params" in capsys.readouterr().err
    # A profile probed on nodes plans flat unless --node-size says where they are.
    dataclasses.replace(profile(GBIT), nodes=_two_nodes(GBIT)).save(path)
    assert cli.main(argv[:-2]) == 0 and "hierarchical" not in capsys.readouterr().out


def test_plan_refuses_what_it_cannot_model(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(GBIT).save(path)
    argv = ["plan", "--params", "1M", "--world", "4", "--profile", str(path)]
    assert cli.main([*argv, "--allow", "ternary"]) == 2
    assert "no measurement of 'ternary'" in capsys.readouterr().err
    assert cli.main([*argv, "--allow", "powersgd"]) == 2
    assert "low-rank" in capsys.readouterr().err
    assert cli.main([*argv[:-1], str(tmp_path / "missing.json")]) == 2
    # Files that are not profiles: refused, naming the file and what is wrong.
    good = profile(GBIT).to_json()
    no_rate = json.loads(json.dumps(good))
    del no_rate["codecs"]["int8"]["encode"]["rate"]
    bad = {
        "{}": "not a gradcomp profile: no 'codecs'",
        "[1, 2]": "not a gradcomp profile: a JSON list, not an object",
        "{bad": "not JSON (Expecting property name",
        json.dumps(
            no_rate
        ): "not a gradcomp profile: Linear.__init__() missing 1 required positional argument: 'rate'",
    }
    for where, value, said in (
        (("codecs", "int8", "encode", "rate"), 0, "codecs.int8.encode.rate must be positive, got 0"),
        (("link", "bandwidth"), -5, "link.bandwidth must be positive, got -5"),
        (("link", "latency"), "fast", "not a gradcomp profile: link.latency is 'fast', not a finite number"),
        (("world_size",), 0, "not a gradcomp profile: world_size is 0, not a positive integer"),
    ):
        changed = json.loads(json.dumps(good))
        inner = changed
        for key in where[:-1]:
            inner = inner[key]
        inner[where[-1]] = value
        bad[json.dumps(changed)] = said
    for text, said in bad.items():
        (tmp_path / "bad.json").write_text(text)
        assert cli.main([*argv[:-1], str(tmp_path / "bad.json")]) == 2
        assert f"gradcomp plan: {tmp_path / 'bad.json'}: {said}" in capsys.readouterr().err
    # Options that are not numbers the model can use, and empty lists.
    for option, value in (
        ("--bucket-mb", "nan"),
        ("--bucket-mb", "inf"),
        ("--bucket-mb", "0"),
        ("--compute-ms", "0"),
    ):
        with pytest.raises(SystemExit):
            cli.main([*argv, option, value])
        assert "must be a positive finite number" in capsys.readouterr().err
    assert cli.main([*argv, "--allow", ""]) == 2 and "allow names no candidate" in capsys.readouterr().err
    assert cli.main(["plan", "--compressors", "bogus"]) == 2
    assert "unknown compressor 'bogus'" in capsys.readouterr().err
    assert cli.main(["plan", "--compressors", ","]) == 2
    assert "--compressors names no compressor" in capsys.readouterr().err
    assert cli.main(["plan", "--params", "0.4", "--profile", str(path)]) == 2
    assert "--params must be at least 1" in capsys.readouterr().err
    assert cli.main(["plan", "--world", "8"]) == 2 and "--world needs --params" in capsys.readouterr().err
    assert (
        cli.main(["probe", "--compressors", "int8,powersgd"]) == 2 and "low-rank" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        cli.main(["plan", "--params", "-3"])


def test_the_stored_cpu_profile_loads_and_plans():
    stored = planner.Profile.load(planner.STORED / "cpu.json")
    if not torch.cuda.is_available():  # the default on a machine without a GPU
        assert planner.Profile.load() == stored
    assert set(planner.SAFE) - {"none"} <= set(stored.codecs)
    # Measured with the transport's CPU time (not a pingpong's: no algorithm runs on it).
    fits = (stored.link, stored.links["all_gather"], stored.links["all_to_all"])
    assert all(link.cpu_seconds_per_byte > 1e-12 for link in fits)
    plan = planner.best_plan([BUCKET, 1024], 16, stored.with_link(GBIT))
    assert plan[0].compressor in ("int8", "int4") and plan[1].compressor in ("none", "bf16")


# ----------------------------------------------------------------------------- "auto" in the DDP hook


def _auto_body(rank, world_size, bandwidths, steps, resume_at):
    import io

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp
    from gradcomp.collectives import ring_all_reduce_bytes

    def build():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 4096))
        net.append(torch.nn.Linear(4096, 4))
        return net, DistributedDataParallel(net, bucket_cap_mb=4)

    net, model = build()
    # Each rank's injected profile differs: the plan must come from their combination.
    state = ddp.register(model, "auto", warmup_steps=3, profile=profile(bandwidths[rank], overhead=20e-3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    batches = [torch.randn(8, 64, generator=generator) for _ in range(steps)]
    saved = None
    for step, x in enumerate(batches):
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save(
                {"model": net.state_dict(), "optim": optimizer.state_dict(), "hook": state.state_dict()},
                buffer,
            )
            saved = buffer.getvalue()
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    state.flush()
    final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    finals = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(finals, final)
    numel = sum(p.numel() for p in net.parameters())
    result = dict(
        plan=[(p.numel, p.compressor, p.algorithm) for p in state.plan],
        stats=[(s.step, dict(s.compressors), s.bytes_sent) for s in state.stats],
        dense_bytes=ring_all_reduce_bytes(numel * 4, world_size),
        replicas_equal=all(torch.equal(finals[0], f) for f in finals),
        final=final,
        offsets=state.ready_offsets,
    )
    # Resume from the checkpoint taken after the plan: the same steps, bit for bit.
    net, model = build()
    state = ddp.register(model, "auto", warmup_steps=3, profile=profile(bandwidths[rank], overhead=20e-3))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    checkpoint = torch.load(io.BytesIO(saved), weights_only=False)
    net.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optim"])
    state.load_state_dict(checkpoint["hook"])
    for x in batches[resume_at:]:
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    result["resumed_equal"] = torch.equal(
        torch.cat([p.detach().reshape(-1) for p in net.parameters()]), final
    )
    result["resumed_offsets"] = state.ready_offsets
    return result


@pytest.mark.slow
def test_auto_plans_once_from_every_ranks_figures_and_compresses_the_large_buckets():
    # Rank 0 sees 10 Gbit/s, rank 1 a 0.1 Gbit/s link: the slower decides, and low bits pay.
    result = spawn.run_ranks(_auto_body, 2, [10 * GBIT, 0.1 * GBIT], 8, 5, timeout=240)
    plan = result["plan"]
    slowest = planner.combine([profile(10 * GBIT, overhead=20e-3), profile(0.1 * GBIT, overhead=20e-3)])
    expected = planner.best_plan([n for n, _, _ in plan], 2, slowest)
    assert plan == [(p.numel, p.compressor, p.algorithm) for p in expected]
    # Two buckets: the large one in 4 bits, the small one (20 ms to start a codec) dense.
    assert [p[1] for p in plan] == ["int4", "none"] and plan[0][0] > 2**20 > plan[1][0]
    # Every step's statistics, each with every bucket: dense for the 3 warm-up
    # steps, then each bucket through its plan.
    assert [s[0] for s in result["stats"]] == list(range(8))
    for step, compressors, sent in result["stats"]:
        if step < 3:
            assert set(compressors.values()) == {"none dense"} and sent == result["dense_bytes"]
        else:
            assert [compressors[i] for i in range(len(plan))] == [" ".join(p[1:]) for p in plan]
            assert sent < result["dense_bytes"] / 4
    assert result["replicas_equal"] and result["resumed_equal"]
    # When each bucket was handed over in the step before the plan, before the backward
    # pass ended (the last one: 0), kept with the plan for re-plans, and in the checkpoint.
    offsets = result["offsets"]
    assert len(offsets) == len(plan) and max(offsets) == 0.0 and min(offsets) < 0
    assert result["resumed_offsets"] == offsets


def _ready_body(rank, world_size, replan_from=None):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(64, 1024), torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 1024)
    )
    model = DistributedDataParallel(net, bucket_cap_mb=4)
    slow = profile(0.1 * GBIT)
    state = ddp.register(model, "auto", warmup_steps=3, profile=slow, check_every=2, trial_steps=0)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    for step in range(5 if replan_from is None else 8):
        if step == 5 and replan_from is not None:
            # Offsets as a checkpoint of each rank's own would hold them; a re-plan at step 6.
            state.flush()
            state.auto.offsets = list(replan_from[rank])
            state.replan()
        if step == 3:  # the step before's marks, as if the ranks' backward passes had differed:
            # rank 0 hands every bucket but the last over 10 s before the end, rank 1 1 ms before.
            count = len(state.auto.sizes.numels)
            early = 0.0 if rank == 0 else 9.999
            marks = {**{i: early for i in range(count - 1)}, count - 1: 10.0}
            state.auto.ready = ddp.auto.ReadyMarks(2, 0.0, marks)
        optimizer.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        optimizer.step()
    state.flush()
    sizes = [p.numel for p in state.plan]
    alone = [-10.0 if rank == 0 else -0.001] * (len(sizes) - 1) + [0.0]
    mine = planner.best_plan(sizes, world_size, slow, ready=alone)
    plans, offsets = [None] * world_size, [None] * world_size
    dist.all_gather_object(plans, [(p.compressor, p.algorithm) for p in state.plan])
    dist.all_gather_object(offsets, state.ready_offsets)
    return plans, offsets, [(p.compressor, p.algorithm) for p in mine], sizes


@pytest.mark.slow
def test_ranks_whose_buckets_were_ready_at_different_times_agree_on_the_plan():
    plans, offsets, rank0_alone, sizes = spawn.run_ranks(_ready_body, 2, timeout=120)
    assert len(sizes) >= 3
    # Per bucket the latest rank's offset (its reduction starts when the last rank hands it
    # over), on both ranks; so one plan, every bucket compressed (none fits in 1 ms).
    assert offsets[0] == offsets[1] == pytest.approx([-0.001] * (len(sizes) - 1) + [0.0])
    assert plans[0] == plans[1] and all(c != "none" for c, _ in plans[0])
    # From its own marks, rank 0 would have kept the early buckets dense: a different plan.
    assert rank0_alone != plans[0] and rank0_alone[0] == ("none", "dense")


@pytest.mark.slow
def test_a_re_plan_agrees_the_offsets_it_was_given():
    # Each rank's own offsets (as a checkpoint from before the ranks agreed them would hold).
    own = [[-10.0, -10.0, 0.0], [-0.001, -0.001, 0.0]]
    plans, offsets, _, sizes = spawn.run_ranks(_ready_body, 2, own, timeout=120)
    assert len(sizes) == 3 and offsets[0] == offsets[1] == own[1]
    assert plans[0] == plans[1]


def test_auto_options_are_checked():
    from gradcomp import ddp

    with pytest.raises(ValueError, match="unknown compressor"):
        ddp.HookState("auto", allow=("int3",))
    with pytest.raises(ValueError, match="low-rank"):
        ddp.HookState("auto", allow=("int8", "powersgd"))
    for bad in ({"algorithm": "allgather"}, {"inter_algorithm": "allgather"}):
        with pytest.raises(ValueError, match="chooses the algorithm"):
            ddp.HookState("auto", **bad)
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        ddp.HookState("auto", node_size=0)
    assert ddp.HookState("auto", node_size=2).options.node_size == 2  # says where the nodes are
    with pytest.raises(ValueError, match="options of compressor='auto'"):
        ddp.HookState("int8", allow=("int8",))
    with pytest.raises(TypeError, match="Profile"):
        ddp.HookState("auto", profile={"link": 1})
    with pytest.raises(TypeError, match="allow holds compressors' names or Compressors, got 5"):
        ddp.HookState("auto", allow=[5])
    # A profile without a candidate's measurement is refused at once, not after the warm-up.
    partial = dataclasses.replace(profile(GBIT), codecs={"int8": profile(GBIT).codecs["int8"]})
    for make in (lambda: ddp.HookState("auto", profile=partial), lambda: planner.Auto(profile=partial)):
        with pytest.raises(ValueError, match="no measurement of 'bf16', 'int4' \\(it has \\['int8'\\]\\)"):
            make()
    allowed = ddp.HookState("auto", allow=("none", "int8"), profile=partial).auto.options.allow
    assert allowed == ("none", "int8")
    # planner.Auto, the chooser all_reduce takes, is "auto" with its candidates and profile.
    chooser = ddp.HookState(planner.Auto(allow=("none", "int8"), profile=partial)).auto.options
    assert (chooser.allow, chooser.profile) == (allowed, partial)
    with pytest.raises(ValueError, match="given by the planner.Auto"):
        ddp.HookState(planner.Auto(), allow=("int8",))
    for only_auto in ({"replan_every": 100}, {"check_every": 5}, {"drift": 0.2}, {"drift": None}):
        with pytest.raises(ValueError, match="options of compressor='auto'"):
            ddp.HookState("int8", **only_auto)
    bad_options = [{"check_every": 0}, {"check_every": None}, {"replan_every": 1.5}]
    bad_options += [{"drift": 0}, {"drift": "x"}, {"drift": float("nan")}, {"drift": float("inf")}]
    bad_options += [{"warmup_steps": -5}, {"warmup_steps": True}, {"warmup_steps": 2.5}]
    for bad in bad_options:
        with pytest.raises(ValueError, match=next(iter(bad))):
            ddp.HookState("auto", **bad)
    with pytest.raises(RuntimeError, match="auto"):
        ddp.HookState("int8").replan()
    state = ddp.HookState("auto")
    assert (
        state.auto
        and state.options.warmup_steps == ddp.AUTO_MIN_WARMUP
        and state.auto.options.allow == planner.SAFE
    )
    assert state.state_dict()["settings"] == {"name": "auto", "allow": list(planner.SAFE)}
    with pytest.raises(ValueError, match="settings"):
        state.load_state_dict(ddp.HookState("int8").state_dict())


def test_a_checkpoint_of_the_unversioned_schema_loads_as_it_was_saved():
    from gradcomp import ddp

    state = ddp.HookState("auto", allow=("int8", "int4"), profile=profile(GBIT))
    fresh = state.state_dict()
    # What the unversioned schema saved: auto's fields flat beside the others, a "step" key
    # among the bucket indices, plans of 3 (before predictions were kept) and 7 fields.
    v1 = {k: v for k, v in fresh.items() if k not in ("version", "auto")} | {
        "step": 9,
        "auto_sizes": {"step": 1, 0: 4096, 1: 512},
        "auto_ready": [-0.5, 0.0],
        "plan": [(4096, "int8", "allgather"), (512, "none", "dense", 0, 0.1, 0.0, 0.0)],
        "auto_adopted_at": 7,
        "auto_last": {0: ("int8", "allgather", None), 1: ("none", "dense")},
        "next_plan": [(4096, "int4", "allgather", 1, 0.1, 0.1, 0.0, None), (512, "none", "dense")],
        "auto_remeasure": "requested",
        "auto_trials": [{"kept": 0}],
    }
    state.load_state_dict(v1)
    auto = state.auto
    assert auto.phase is ddp.Phase.RUNNING and auto.adopted_at == 7 and state.step == 9
    assert [(p.numel, p.compressor, p.algorithm) for p in state.plan] == [
        (4096, "int8", "allgather"),
        (512, "none", "dense"),
    ]
    assert state.plan[1].exchange_seconds == 0.1 and state.plan[0].inter_algorithm is None
    assert [p.compressor for p in auto.next_plan] == [
        "int4",
        "none",
    ] and auto.remeasure_due.why == "requested"
    assert (auto.sizes.step, auto.sizes.numels) == (1, {0: 4096, 1: 512}) and state.ready_offsets == [
        -0.5,
        0.0,
    ]
    assert state.sent_as(1)[1:] == ("dense", None) and state.trials == [{"kept": 0}]
    again = state.state_dict()
    assert again["version"] == ddp.SCHEMA_VERSION and again["auto"]["plan"][0][:3] == (
        4096,
        "int8",
        "allgather",
    )
    with pytest.raises(ValueError, match="schema 3"):
        state.load_state_dict(again | {"version": 3})


def test_loading_a_checkpoint_from_before_the_plan_forgets_the_plan():
    from gradcomp import ddp

    before = ddp.HookState("auto").state_dict()
    state = ddp.HookState("auto", profile=profile(GBIT))
    auto = state.auto
    auto.plan, auto.phase = [planner.Prediction("int8", "allgather", 4096, 1, 0.1, 0.1)], ddp.Phase.RUNNING
    auto.planned_at, auto.adopted_at, auto.hooked_step, auto.replan_requested = 4, 5, 7, True
    state.load_state_dict(before)
    auto = state.auto
    assert state.plan is None and auto.phase is ddp.Phase.WARMUP and auto.compressors == []
    assert auto.planned_at is None and auto.adopted_at is None and auto.hooked_step == -1
    assert not auto.replan_requested


def _auto_edge_body(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    model = DistributedDataParallel(net)
    state = ddp.register(model, "auto", allow="int8,int4", profile=profile(0.01 * GBIT))
    # A checkpoint taken after the warm-up without the bucket sizes (what
    # Checkpointable(mismatch="drop") leaves): one more dense step, then the plan.
    saved = state.state_dict()
    saved["step"] = 5
    saved["auto"]["sizes"] = None
    state.load_state_dict(saved)
    for _ in range(3):
        model(torch.randn(4, 64)).sum().backward()
    state.flush()
    return (
        state.auto.options.allow,
        [(p.numel, p.compressor) for p in state.plan],
        [dict(s.compressors) for s in state.stats],
    )


@pytest.mark.slow
def test_auto_without_the_bucket_sizes_plans_a_step_later_and_one_rank_stays_dense():
    allow, plan, stats = spawn.run_ranks(_auto_edge_body, 2, timeout=120)
    assert allow == ("int8", "int4") and plan == [(64 * 64 + 64, "int4")]
    assert [set(s.values()) for s in stats] == [{"none dense"}, {"int4 allgather"}, {"int4 allgather"}]
    one, plan, stats = spawn.run_ranks(_auto_edge_body, 1, timeout=120)
    assert plan == [(64 * 64 + 64, "none")] and stats[-1] == {0: "none dense"}


# ----------------------------------------------------------------------------- re-planning


def _codecs(**rates):
    """A profile's codecs: each named compressor at its rate (elements a second), 50 us a call."""
    return {name: planner.Codec(*[planner.Linear(50e-6, rate)] * 2) for name, rate in rates.items()}


# Three links and codec sets: int4 pays on the first, Top-K on the second (int4 and int8
# slow to encode there), dense on the third (fast, every codec costly to start).
REPLAN_PROFILES = [
    planner.Profile("a", cost_model.Link(0.01 * GBIT, 20e-6), _codecs(int8=1e9, int4=1e9, topk=1e5), 3),
    planner.Profile("b", cost_model.Link(0.01 * GBIT, 20e-6), _codecs(int8=1e6, int4=1e6, topk=1e9), 3),
    planner.Profile("c", cost_model.Link(100 * GBIT, 1e-6), _codecs(int8=1e6, int4=1e6, topk=1e6), 3),
]


# Steps at which the next profile comes in and one rank asks for a re-plan.
REQUESTS = (4, 6, 9)


def _replan_body(rank, world_size, steps, periodic, profiles=REPLAN_PROFILES, node_size=None, outputs=512):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp
    from gradcomp.collectives import two_phase

    two_phase.SEGMENT_ELEMENTS = 2**12  # several segments: the owner's chunks lie apart
    torch.manual_seed(0)
    net = torch.nn.Linear(128, outputs)
    model = DistributedDataParallel(net)
    allow = ("int8", "int4", "topk")
    every = 2 if periodic else None
    state = ddp.register(
        model,
        "auto",
        allow=allow,
        profile=profiles[0],
        warmup_steps=2,
        check_every=2,
        replan_every=every,
        node_size=node_size,
        trial_steps=0,  # re-plans only: trials have their own tests
    )
    # A linear loss: every step's gradient is the same, so error feedback must deliver
    # steps * lr * (their mean) in all, whatever the compressors did on the way.
    generator = torch.Generator().manual_seed(rank)
    x, c = torch.randn(16, 128, generator=generator), torch.randn(16, outputs, generator=generator)
    start = torch.cat([p.detach().reshape(-1).clone() for p in net.parameters()])
    mean_grad = torch.cat([(c.T @ x).reshape(-1), c.sum(0)]).double()
    dist.all_reduce(mean_grad)
    mean_grad /= world_size
    optimizer = torch.optim.SGD(net.parameters(), lr=0.5)
    plans, gaps = {}, {}
    for step in range(steps):
        # Requests from one rank at a time (0, the last, 1): every rank re-plans at
        # the next check (periodic: every check re-plans).
        if step in REQUESTS[: len(profiles) - 1]:
            i = REQUESTS.index(step)
            state.auto.options = dataclasses.replace(state.auto.options, profile=profiles[i + 1])
            if rank == (0, world_size - 1, 1)[i] and not periodic:
                state.replan()
        optimizer.zero_grad()
        (model(x) * c).sum().backward()
        optimizer.step()
        now = torch.cat([p.detach().reshape(-1) for p in net.parameters()]).double()
        gaps[step] = (now - (start.double() - 0.5 * (step + 1) * mean_grad)).norm().item()
        plans[step] = [(p.compressor, p.algorithm) for p in state.plan] if state.plan else None
    state.flush()
    final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    finals = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(finals, final)
    return dict(
        stats=[(s.step, s.compressors[0]) for s in state.stats],
        gaps=gaps,
        scale=(0.5 * steps * mean_grad).norm().item(),
        residuals=list(state.feedback.keys()),
        replicas_equal=all(torch.equal(finals[0], f) for f in finals),
        observed=[p.observed_seconds for p in state.plan],
    )


@pytest.mark.slow
@pytest.mark.parametrize("periodic", [False, True], ids=["requested", "replan_every"])
def test_a_plan_change_mid_run_carries_the_residuals_and_loses_nothing(periodic):
    result = spawn.run_ranks(_replan_body, 3, 12, periodic, timeout=240)
    # Planned at step 2 (its buckets on the worker already go through the plan);
    # rank 0's request at step 4 (or replan_every=2) re-plans at the check of
    # step 5, the new plan applies from step 6; rank 2's at step 6 re-plans at
    # step 8 (checks come every 2 steps after a plan), from step 9.
    expected = ["none dense"] * 2 + ["int4 two_phase"] * 4 + ["topk allgather"] * 3 + ["none dense"] * 3
    assert [how for _, how in result["stats"]] == expected
    # While compressed, what error feedback holds back is far from zero;
    # int4's residuals carried into Top-K's feedback,
    # and the first dense step sends them all: the run has moved exactly as
    # many gradients as it took (up to fp32 rounding), and no residual is left.
    gaps, scale_ = result["gaps"], result["scale"]
    assert gaps[1] < 1e-7 * scale_ and min(gaps[s] for s in range(2, 9)) > 0.01 * scale_
    assert max(gaps[s] for s in range(9, 12)) < 1e-6 * scale_
    assert result["residuals"] == [] and result["replicas_equal"]
    assert all(0 < t < 5 for t in result["observed"])


def _nodes(stages: planner.Linear = FREE) -> planner.Nodes:
    """Two nodes of two ranks: a slow link between them (its all-to-all faster: two_phase pays)."""
    slow, fast = cost_model.Link(0.01 * GBIT, 20e-6), cost_model.Link(GBIT, 20e-6)
    return planner.Nodes(2, 2, stages, slow, {"all_gather": slow, "all_to_all": fast})


# On 2 nodes of 2 ranks: int4 hierarchical, Top-K flat (the node's stages slow), int8
# hierarchical, then dense (every link fast); each compressed one two_phase (owners' residuals).
NODE_PROFILES = [
    planner.Profile("a", _nodes().link, _codecs(int8=1e9, int4=1e9, topk=1e5), 4, nodes=_nodes()),
    planner.Profile(
        "b", _nodes().link, _codecs(int8=1e6, int4=1e6, topk=1e9), 4, nodes=_nodes(planner.Linear(1.0, 1e3))
    ),
    planner.Profile("c", _nodes().link, _codecs(int8=1e9, int4=1e6, topk=1e5), 4, nodes=_nodes()),
    planner.Profile(
        "d",
        cost_model.Link(100 * GBIT, 1e-6),
        _codecs(int8=1e6, int4=1e6, topk=1e6),
        4,
        nodes=planner.Nodes(2, 2, FREE, cost_model.Link(100 * GBIT, 1e-6)),
    ),
]


@pytest.mark.slow
def test_a_plan_moving_between_hierarchical_and_flat_carries_the_residuals():
    # 513 outputs: 66,177 elements, so the last node shard holds a padding element.
    result = spawn.run_ranks(_replan_body, 4, 15, False, NODE_PROFILES, 2, 513, timeout=300)
    expected = ["none dense"] * 2 + ["int4 hierarchical(two_phase)"] * 4 + ["topk two_phase"] * 3
    expected += ["int8 hierarchical(two_phase)"] * 3 + ["none dense"] * 3
    assert [how for _, how in result["stats"]] == expected
    # Shards' residuals (sender's and owner's between nodes) went into the flat Top-K's
    # input, its residuals into int8's shards, and the first dense step sent the rest.
    gaps, scale_ = result["gaps"], result["scale"]
    assert gaps[1] < 1e-7 * scale_ and min(gaps[s] for s in range(2, 9)) > 0.01 * scale_
    assert min(gaps[s] for s in range(9, 12)) > 1e-4 * scale_  # int8 holds back less
    assert max(gaps[s] for s in range(12, 15)) < 1e-6 * scale_
    assert result["residuals"] == [] and result["replicas_equal"]


# int8 predicted a little faster than int4 on this link (within the margin): a trial.
NEAR = planner.Profile("near", cost_model.Link(0.1 * GBIT, 20e-6), _codecs(int8=1e8, int4=4e7), 2)


def test_the_runner_up_is_a_choice_the_model_cannot_tell_from_the_plans():
    numel = 128 * 512 + 512
    allow = ("int8", "int4")
    plan = planner.best_plan([numel], 2, NEAR, allow)
    assert [(p.compressor, p.algorithm) for p in plan] == [("int8", "allgather")]
    (other,) = planner.runner_up([numel], 2, NEAR, plan, allow)
    # Another compressor first (int8's two_phase is closer still), within the margin.
    assert (other.compressor, other.algorithm) == ("int4", "allgather")
    assert abs(other.seconds - plan[0].seconds) <= planner.MARGIN * plan[0].seconds
    # int4 far slower: int8's other algorithm is the one left within the margin.
    slow4 = planner.Profile("s", NEAR.link, _codecs(int8=1e8, int4=1e7), 2)
    (other,) = planner.runner_up([numel], 2, slow4, planner.best_plan([numel], 2, slow4, allow), allow)
    assert (other.compressor, other.algorithm) == ("int8", "two_phase")
    # Dense kept though int8 is predicted far faster (as the overlap with the backward
    # pass may decide): no runner-up, nor where nothing comes within the margin.
    dense = [planner.predict("none", numel, 2, NEAR)]
    assert planner.runner_up([numel], 2, NEAR, dense, allow) is None
    assert planner.runner_up([numel], 2, NEAR, plan, ("int8",), within=0.001) is None
    # Buckets without one keep the plan's choice in the runner-up plan.
    two = planner.best_plan([numel, 100], 2, NEAR, allow)
    assert two[1].compressor == "none"
    assert planner.runner_up([numel, 100], 2, NEAR, two, allow, within=0.1)[1] is two[1]


def _trial_body(rank, world_size, steps, slow, stall=None):
    import time

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Linear(128, 512)
    model = DistributedDataParallel(net)
    state = ddp.register(model, "auto", allow=("int8", "int4"), profile=NEAR, warmup_steps=2, check_every=2)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(rank))
    saved = None
    for step in range(steps):
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
        if rank == 1 and state.plan and state.plan[0].compressor == slow:
            time.sleep(0.25)  # one rank's steps slower with this compressor: every rank's are
        if rank == 1 and step == stall:
            time.sleep(1.5)  # the loop's own business (an evaluation, a checkpoint): one step
        if step == 10:  # in the runner-up's turn: a checkpoint keeps the trial
            state.flush()
            saved = state.state_dict()
    state.flush()
    resumed = ddp.HookState("auto", allow=("int8", "int4"), profile=NEAR)
    resumed.load_state_dict(saved)
    saved_trial = [[p.compressor for p in plan] for plan in resumed.auto.trial.plans]
    saved_seconds = list(resumed.auto.trial.seconds)
    # Resumed from step 11 in a fresh model: the trial goes on from the steps it runs.
    again = DistributedDataParallel(torch.nn.Linear(128, 512))
    again.register_comm_hook(resumed, ddp.hook)
    for _ in range(11, steps):
        again(x).square().mean().backward()
        if rank == 1 and resumed.plan[0].compressor == slow:
            time.sleep(0.25)
    resumed.flush()
    final = torch.cat([p.detach().reshape(-1) for p in net.parameters()])
    finals = [torch.empty_like(final) for _ in range(world_size)]
    dist.all_gather(finals, final)
    trials = [None] * world_size
    dist.all_gather_object(trials, state.trials)
    return dict(
        hows=[s.compressors[0] for s in state.stats],
        trials=trials,
        plan=[(p.compressor, p.algorithm) for p in state.plan],
        saved_trial=saved_trial,
        saved_seconds=saved_seconds,
        resumed=([s.compressors[0] for s in resumed.stats], [t["kept"] for t in resumed.trials]),
        replicas_equal=all(torch.equal(finals[0], f) for f in finals),
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("slow", "stall"), [("int8", None), ("int4", None), ("int8", 9)], ids=["int8", "int4", "int8-stall"]
)
def test_auto_tries_a_close_runner_up_and_keeps_the_faster(slow, stall):
    result = spawn.run_ranks(_trial_body, 2, 20, slow, stall, timeout=240)
    # Planned at step 2 (int8); it runs to step 7, whose check times steps 4-6; int4
    # runs steps 8-12 (timed 9-11), int8 again steps 13-17 (timed 14-16), and the faster
    # plan applies from step 18. A stall of 1.5 s in int4's step 9 (6x what int8 loses
    # a step) is one step of three: the median passes over it.
    kept = "int4" if slow == "int8" else "int8"
    turns = ["int8 allgather"] * 6 + ["int4 allgather"] * 5 + ["int8 allgather"] * 5
    assert result["hows"] == ["none dense"] * 2 + turns + [f"{kept} allgather"] * 2
    (trial,) = result["trials"][0]
    assert trial["plans"] == [["int8 allgather"], ["int4 allgather"]]
    assert trial["kept"] == ("int8", "int4").index(kept)
    # The slow plan's steps took the 0.25 s sleep more (the slowest rank's, every rank's);
    # int8's time is the mean of its two turns'.
    assert trial["step_ms"][1 - trial["kept"]] > trial["step_ms"][trial["kept"]] + 150
    first, second, third = trial["turns_ms"]
    assert trial["step_ms"] == [pytest.approx((first + third) / 2), second]
    assert result["plan"] == [(kept, "allgather")] and result["replicas_equal"]
    # A checkpoint in int4's turn holds the trial: int8's time, int4's still to come.
    assert result["saved_trial"] == [["int8"], ["int4"]] and len(result["saved_seconds"]) == 1
    # Resumed at step 11 (DDP's first iteration there, untimed), it judged int4's turn a
    # step later, from step 12's time, ran int8's second turn (steps 14-18) and kept the same.
    resumed = ["int4 allgather"] * 3 + ["int8 allgather"] * 5 + [f"{kept} allgather"]
    assert result["resumed"] == (resumed, [trial["kept"]])
    assert result["trials"][0] == result["trials"][1]  # every rank kept the same


def _no_trial_below_min_numel(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    torch.manual_seed(0)
    net = torch.nn.Linear(128, 512)
    model = DistributedDataParallel(net)
    # Every bucket below min_numel goes dense whatever the plan: nothing to try.
    state = ddp.register(model, "auto", allow=("int8", "int4"), profile=NEAR, min_numel=10**9)
    for _ in range(8):
        model(torch.randn(4, 128)).sum().backward()
    state.flush()
    return state.plan[0].compressor, state.trials, state.auto.trial, {s.compressors[0] for s in state.stats}


@pytest.mark.slow
def test_no_trial_where_the_plans_differ_only_in_buckets_reduced_dense():
    planned, trials, under_way, hows = spawn.run_ranks(_no_trial_below_min_numel, 2, timeout=120)
    # The plan says what is sent: dense, under min_numel.
    assert planned == "none" and trials == [] and under_way is None and hows == {"none dense"}


def _half_precision_auto_body(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    plans = {}
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        net = torch.nn.Linear(128, 512).to(dtype)
        model = DistributedDataParallel(net)
        # Fast codecs on a 5 Gbit/s link: a cast to bf16 pays for fp32 gradients.
        fast = profile(5 * GBIT, rate=1e11, overhead=1e-6)
        state = ddp.register(model, "auto", allow=("none", "bf16"), profile=fast, min_numel=0, trial_steps=0)
        for _ in range(5):
            model(torch.randn(4, 128, dtype=dtype)).sum().backward()
        state.flush()
        plans[str(dtype)] = [(p.compressor, p.bytes_sent) for p in state.plan]
    return plans


@pytest.mark.slow
def test_auto_plans_half_precision_buckets_by_their_own_bytes():
    plans = spawn.run_ranks(_half_precision_auto_body, 2, timeout=120)
    numel = 128 * 512 + 512
    assert plans["torch.float32"] == [("bf16", numel * 2)]
    assert plans["torch.bfloat16"] == [("none", numel * 2)]  # already 2 bytes: nothing to save


def test_trial_steps_is_checked():
    from gradcomp import ddp

    for bad in (1, -1, True, 2.0, ddp.MAX_TRIAL_STEPS + 1):
        with pytest.raises(ValueError, match="trial_steps"):
            ddp.HookState("auto", trial_steps=bad)
    assert ddp.HookState("auto", trial_steps=0).auto.options.trial_steps == 0
    assert ddp.HookState("auto").auto.options.trial_steps == ddp.DEFAULT_TRIAL_STEPS
    with pytest.raises(ValueError, match="options of compressor='auto'"):
        ddp.HookState("int8", trial_steps=4)


def _drift_body(rank, world_size, steps, slow_from):
    import logging
    import time

    from torch.nn.parallel import DistributedDataParallel

    from gradcomp import ddp

    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logger = logging.getLogger("gradcomp.ddp")  # every module of the hook logs there
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    torch.manual_seed(0)
    net = torch.nn.Linear(512, 2048)
    model = DistributedDataParallel(net)
    # Planned on a claimed 100 Gbit/s link: dense.
    fast = profile(100 * GBIT, overhead=20e-3)
    state = ddp.register(model, "auto", profile=fast, warmup_steps=2, check_every=3)
    all_reduce = dist.all_reduce

    def slow_all_reduce(tensor, *args, **kwargs):  # all-reduces at 20 MB/s from now on
        time.sleep(tensor.numel() * tensor.element_size() / 20e6)
        return all_reduce(tensor, *args, **kwargs)

    for step in range(steps):
        if step == slow_from:
            dist.all_reduce = slow_all_reduce
            state.auto.options = dataclasses.replace(
                state.auto.options, profile=None
            )  # the next plan measures
        model(torch.randn(4, 512)).sum().backward()
        if step == 9:
            observed = [p.observed_seconds for p in state.plan]  # of the old plan, at the check of step 9
    state.flush()
    dist.all_reduce = all_reduce
    return [s.compressors[0] for s in state.stats], said, observed


@pytest.mark.slow
def test_auto_notices_a_slower_link_and_re_plans_from_new_measurements():
    hows, said, observed = spawn.run_ranks(_drift_body, 2, 12, 6, timeout=240)
    # Checks at steps 6 (the first window after the plan: calibrates) and 9
    # (steps 6-8, on the slower link: drift), the new plan from step 10.
    assert hows[:10] == ["none dense"] * 10
    # Only the all-reduce got slower: the new plan gathers or scatters instead.
    assert all(how.split()[1] in ("allgather", "two_phase") for how in hows[10:]), hows
    assert any("re-plans (drift" in line for line in said) and not any("requested" in line for line in said)
    assert any("plan changes from step 10" in line for line in said)
    # What the plan says it observed on the slower link: at least the 0.2 s its 4 MB take.
    assert observed[0] >= 0.2


# ----------------------------------------------------------------------------- all_reduce(t, "auto")


def _all_reduce_auto_body(rank, world_size):
    import gradcomp
    from gradcomp.collectives import shared_chooser

    generator = torch.Generator().manual_seed(rank)
    big, small = torch.randn(2**18, generator=generator), torch.randn(1000, generator=generator)
    # Injected: a slow link (every rank's differs; the slowest decides), codecs slow to start.
    auto = planner.Auto(allow=("int8", "int4"), profile=profile((0.01 + rank) * GBIT, overhead=20e-3))
    memory = gradcomp.ErrorFeedback()
    results = {}
    for name, x in (("big", big), ("small", small), ("big again", big)):
        out = x.clone()
        stats = gradcomp.all_reduce(out, auto, feedback=memory, name=name.split()[0])
        mean = x.clone()
        dist.all_reduce(mean)
        mean /= world_size
        everyone = [torch.empty_like(out) for _ in range(world_size)]
        dist.all_gather(everyone, out)
        static = x.clone()
        gradcomp.all_reduce(static, stats.compressor, algorithm=stats.algorithm, feedback=False)
        results[name] = dict(
            how=(stats.compressor, stats.algorithm),
            as_static=torch.equal(out, static),
            error=((out - mean).norm() / mean.norm()).item(),
            same=all(torch.equal(everyone[0], e) for e in everyone),
            sent=stats.bytes_sent,
            dense=stats.dense_bytes,
        )
    # Measured: the shared planner of "auto" probes the group once, then plans each size
    # (an empty tensor first: sent dense, nothing measured for it).
    measured = [gradcomp.all_reduce(x.clone(), "auto") for x in (torch.empty(0), small, big, small)]
    shared = shared_chooser("auto")
    return dict(
        results=results,
        plans={key: (p.compressor, p.algorithm) for key, p in auto.plans[next(iter(auto.plans))].items()},
        residuals=sorted(map(str, memory.keys())),
        measured=[(s.compressor, s.algorithm) for s in measured],
        probed=len(shared.profiles),
        shared_sizes=sorted(n for n, _ in next(iter(shared.plans.values()))),
    )


@pytest.mark.slow
def test_all_reduce_auto_chooses_per_size_and_every_rank_agrees():
    result = spawn.run_ranks(_all_reduce_auto_body, 2, timeout=180)
    slowest = planner.combine([profile(0.01 * GBIT, overhead=20e-3), profile(1.01 * GBIT, overhead=20e-3)])
    big, small = (planner.best_plan([n], 2, slowest, ("int8", "int4"))[0] for n in (2**18, 1000))
    assert big.compressor == "int4" and small.compressor == "none"  # the premise
    f32 = torch.float32
    assert result["plans"] == {(2**18, f32): ("int4", big.algorithm), (1000, f32): ("none", "dense")}
    runs = result["results"]
    assert runs["big"]["how"] == runs["big again"]["how"] == ("int4", big.algorithm)
    assert runs["small"]["how"] == ("none", "dense") and runs["small"]["error"] < 1e-6
    # The first calls are what the chosen compressor and algorithm give (bit for bit);
    # the second big one adds the first's residuals.
    assert runs["big"]["as_static"] and runs["small"]["as_static"] and not runs["big again"]["as_static"]
    for run in runs.values():  # int4 two-phase quantizes twice
        assert run["same"] and run["error"] < 0.3
    assert runs["big"]["sent"] < runs["big"]["dense"] / 6
    # Error feedback under the call's name: int4 keeps the big tensor's residuals, dense none.
    from gradcomp.collectives import key_of

    assert str(key_of("big")) in result["residuals"]
    assert not any(str(key_of("small")) in key for key in result["residuals"])
    assert result["probed"] == 1 and result["shared_sizes"] == [0, 1000, 2**18]
    assert result["measured"][0] == ("none", "dense")
    assert all(c in planner.SAFE and a for c, a in result["measured"])
    assert result["measured"][1] == result["measured"][3]


def _all_reduce_auto_disagreeing_body(rank, world_size):
    x = torch.ones(4096)
    # Ranks that allow other candidates, or of which one plans from a profile and the other
    # measures, would issue other collectives: every rank raises instead, naming each rank's.
    for auto, named in (
        (planner.Auto(allow=("int8",) if rank else ("int4",), profile=profile(GBIT)), "allow"),
        (planner.Auto(profile=profile(GBIT) if rank else None), "profile='measured'"),
    ):
        with pytest.raises(
            ValueError,
            match=f"ranks disagree on the all-reduce's compressor='auto' settings:\\n  rank 0: .*{named}",
        ):
            gradcomp.all_reduce(x.clone(), auto)
        gradcomp.collectives.release_queues()
    # The same settings agree (and the shared "auto" is one instance, found by its name).
    same = planner.Auto(allow=("int8",), profile=profile(GBIT))
    gradcomp.all_reduce(x.clone(), same)
    gradcomp.all_reduce(x.clone(), "auto")
    from gradcomp.collectives import chooser

    shared = chooser.shared_chooser("auto")
    gradcomp.all_reduce(x.clone(), "auto")
    return shared is chooser.shared_chooser("auto") and list(chooser._SHARED) == ["auto"]


@pytest.mark.slow
def test_all_reduce_auto_ranks_with_other_settings_raise():
    assert spawn.run_ranks(_all_reduce_auto_disagreeing_body, 2, timeout=120) is True


def _all_reduce_auto_nodes_body(rank, world_size):
    import gradcomp

    x = torch.randn(2**16, generator=torch.Generator().manual_seed(rank))
    # Injected: a slow link between nodes that take no time inside.
    slow = cost_model.Link(0.01 * GBIT, 20e-6)
    nodes = dataclasses.replace(profile(0.01 * GBIT), world_size=4, nodes=planner.Nodes(2, 2, FREE, slow))
    auto = planner.Auto(allow=("int8",), profile=nodes)
    out = x.clone()
    stats = gradcomp.all_reduce(out, auto, node_size=2, feedback=False)
    plan = next(iter(auto.plans.values()))[(2**16, torch.float32, 2)]  # planned for nodes of 2
    static = x.clone()
    inter = plan.inter_algorithm
    gradcomp.all_reduce(
        static, "int8", algorithm="hierarchical", node_size=2, inter_algorithm=inter, feedback=False
    )
    everyone = [torch.empty_like(out) for _ in range(world_size)]
    dist.all_gather(everyone, out)
    # Measured: the first call times the nodes' levels too.
    measured = planner.Auto(allow=("int8",))
    gradcomp.all_reduce(x.clone(), measured, node_size=2)
    # An injected profile of other nodes than the group's is refused on every rank.
    other = planner.Auto(
        allow=("int8",), profile=dataclasses.replace(nodes, nodes=planner.Nodes(4, 1, FREE, slow))
    )
    with pytest.raises(ValueError, match="nodes hold 1 x 4 ranks, the group holds 2 x 2"):
        gradcomp.all_reduce(x.clone(), other, node_size=2)
    # Nodes of 3 and 1 ranks by LOCAL_WORLD_SIZE: hierarchical cannot run there, auto plans flat.
    gradcomp.collectives.release_queues()  # after the refusal above
    os.environ["LOCAL_WORLD_SIZE"] = "3"
    flat = gradcomp.all_reduce(x.clone(), planner.Auto(allow=("int8",), profile=profile(0.01 * GBIT)))
    return dict(
        how=(stats.compressor, stats.algorithm, stats.inter_algorithm, plan.how),
        as_static=torch.equal(out, static),
        same=all(torch.equal(everyone[0], e) for e in everyone),
        nodes=next(iter(measured.profiles.values())).nodes,
        flat=(flat.compressor, flat.algorithm),
    )


@pytest.mark.slow
def test_all_reduce_auto_weighs_hierarchical_on_several_nodes():
    result = spawn.run_ranks(_all_reduce_auto_nodes_body, 4, timeout=180)
    compressor, algorithm, inter, how = result["how"]
    assert (compressor, algorithm) == ("int8", "hierarchical") and how == f"hierarchical({inter})"
    assert result["as_static"] and result["same"]
    nodes = result["nodes"]
    assert (nodes.size, nodes.count) == (2, 2) and nodes.stages.rate > 0 and nodes.link.bandwidth > 0
    assert result["flat"][0] == "int8" and result["flat"][1] != "hierarchical"


def test_all_reduce_auto_refuses_what_it_chooses_itself():
    import gradcomp

    for bad in ({"algorithm": "allgather"}, {"inter_algorithm": "allgather"}):
        with pytest.raises(ValueError, match="chooses the algorithm"):
            gradcomp.all_reduce(torch.ones(4), "auto", **bad)
    with pytest.raises(ValueError, match="node_size must be a positive integer"):
        gradcomp.all_reduce(torch.ones(4), "auto", node_size=0)
    with pytest.raises(ValueError, match="unknown compressor"):
        planner.Auto(allow=("int3",))
    with pytest.raises(TypeError, match="Profile"):
        planner.Auto(profile="fast")
