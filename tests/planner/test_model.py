"""The planner's cost model and decisions on injected measurements, its profiles and nodes."""

import dataclasses
import json
import threading
import time

import pytest
import torch

import gradcomp
from gradcomp import planner
from gradcomp.collectives import cost_model
from tests.planner.profiles import BUCKET, FREE, GBIT, profile, two_nodes


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
    nodes = dataclasses.replace(profile(GBIT), world_size=8, nodes=two_nodes(GBIT))
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


def test_hierarchical_is_the_nodes_stages_plus_a_shards_reduction_between_nodes():
    p = dataclasses.replace(profile(10 * GBIT), world_size=8, nodes=two_nodes(GBIT))
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
    nodes = dataclasses.replace(flat, nodes=two_nodes(GBIT))
    chosen = planner.best_plan([BUCKET], 8, nodes)[0]
    assert (chosen.compressor, chosen.algorithm) == ("int4", "hierarchical")
    assert chosen.seconds < planner.best_plan([BUCKET], 8, flat)[0].seconds
    # Slow stages inside the node (a second each): flat again.
    slow_stages = dataclasses.replace(flat, nodes=two_nodes(GBIT, planner.Linear(1.0, 1e9)))
    assert planner.best_plan([BUCKET], 8, slow_stages)[0].algorithm != "hierarchical"
    # One node, or nodes of one rank: nothing to choose between.
    for size, count in ((8, 1), (1, 8)):
        one = dataclasses.replace(flat, nodes=planner.Nodes(size, count, FREE, flat.link))
        assert planner.best_plan([BUCKET], 8, one)[0].algorithm != "hierarchical"
    # fp32 dense goes flat: "none" is never hierarchical.
    assert all(p.algorithm == "dense" for p in planner.best_plan([BUCKET], 8, nodes, candidates=("none",)))


def test_nodes_combine_to_the_slowest_and_round_trip_through_json(tmp_path):
    first = dataclasses.replace(profile(GBIT), nodes=two_nodes(GBIT))
    # Slower between nodes, faster stages (overhead aside); a fit of one collective only.
    nodes = two_nodes(GBIT / 2, planner.Linear(2e-4, 2e9))
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
