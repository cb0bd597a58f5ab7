"""The cost model and ``python -m gradcomp plan``."""

from __future__ import annotations

import torch

import gradcomp
from gradcomp import cli
from gradcomp.collectives import cost_model
from gradcomp.collectives.agreement import HEADER_BYTES


def test_allgather_grows_with_the_world_and_two_phase_does_not():
    numel = 2**20
    topk = gradcomp.get_compressor("topk")
    gathered = [cost_model.cost(topk, numel, w, "allgather").bytes_sent for w in (2, 8, 1024)]
    payload = gradcomp.get_compressor("topk").compress(torch.randn(numel)).nbytes
    # Each rank's row: its payload, then its fingerprint.
    assert gathered == [(payload + HEADER_BYTES) * (w - 1) for w in (2, 8, 1024)]
    reduced = [cost_model.cost(topk, numel, w, "two_phase").bytes_sent for w in (2, 8, 1024)]
    assert max(reduced) < 3.3 * payload and reduced[2] < gathered[2] / 300
    # Dense fp32 all-reduce: 2 (W-1)/W of the tensor and of the fingerprint's 64 lanes.
    assert cost_model.cost("none", numel, 8).bytes_sent == 2 * 7 * 4 * (numel + 64) // 8


def test_predicted_time_adds_a_latency_per_collective_step():
    link = cost_model.Link(bandwidth=1e9, latency=1e-5)
    cost = cost_model.cost("int8", 2**20, 4)
    assert cost.steps == 6  # all-to-all and all-gather, 3 steps each
    assert cost.seconds(link) == 6e-5 + cost.bytes_sent / 1e9


def test_plan_prints_every_algorithm_and_marks_the_defaults(tmp_path, capsys):
    png = tmp_path / "plan.png"
    argv = ["plan", "--numel", "1M", "--world-sizes", "2,8,64", "--bandwidth", "1gbit", "--png", str(png)]
    assert cli.main([*argv, "--compressors", "int8,topk"]) == 0
    out = capsys.readouterr().out
    rows = {tuple(line.split()[:2]): line for line in out.splitlines()[3:] if not line.startswith("wrote")}
    assert set(rows) == {
        ("int8", "allgather"),
        ("int8", "two_phase"),
        ("topk", "allgather"),
        ("topk", "two_phase"),
    }
    # Top-K's default is the all-gather on 2 ranks, two_phase on 8 and 64.
    # A cell is "<MB> MB <ms> ms", starred where the algorithm is the default.
    assert rows["topk", "allgather"].split()[5] == "ms*" and rows["topk", "two_phase"].split()[5] == "ms"
    assert rows["topk", "two_phase"].endswith("ms*") and rows["int8", "two_phase"].endswith("ms*")
    assert png.stat().st_size > 0
