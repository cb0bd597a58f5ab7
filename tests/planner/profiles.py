"""Injected measurements the planner's tests plan from: a profile of every safe
compressor at a given link, and two nodes of four ranks."""

from gradcomp import planner
from gradcomp.collectives import cost_model


def profile(bandwidth: float, latency: float = 20e-6, rate: float = 1e9, overhead: float = 50e-6):
    """A profile of every safe compressor, each encoding and decoding at ``rate`` elements a second."""
    line = planner.Linear(overhead, rate)
    codecs = {name: planner.Codec(line, line) for name in ("bf16", "int8", "int4", "topk", "sign")}
    return planner.Profile("test device", cost_model.Link(bandwidth, latency), codecs, 2, "injected")


GBIT = 1e9 / 8
BUCKET = 25 * 2**20 // 4  # a 25 MB DDP bucket of fp32


STAGES = planner.Linear(1e-4, 1e9)  # a node's dense stages: 0.1 ms, then 1G elements a second
FREE = planner.Linear(0.0, 1e12)  # stages that take no time


def two_nodes(between: float, stages: planner.Linear = STAGES) -> planner.Nodes:
    """Two nodes of four ranks, ``between`` bytes a second from node to node."""
    return planner.Nodes(4, 2, stages, cost_model.Link(between, 20e-6))
