"""Smoke test of bench/diloco_train.py: a tiny GPT on 2 Gloo ranks without a cluster, every
run, the bytes each sends, and the verdict of its target."""

from __future__ import annotations

import importlib

import pytest

from tests.bench.smoke import TINY_GPT, run_smoke

diloco_train = importlib.import_module("diloco_train")  # bench/ is on sys.path through tests.bench.smoke


@pytest.mark.slow
def test_diloco_train_smoke(tmp_path):
    args = [*TINY_GPT, "--spawn", "2", "--sync-every", "4", "--periods", "1", "--ddp-steps", "2"]
    target = "DiLoCo int4, H=4, 4 fragments, overlap 2 within 1.1x of compute only"
    rows, document = run_smoke("diloco_train.py", args, tmp_path, target)
    labels = [label for label, _ in diloco_train.runs(document["settings"])]
    assert [r["run"] for r in rows] == labels
    compute, ddp, blocking, streamed = document["records"]
    assert compute["bytes_per_step"] == 0 and compute["x_compute"] == 1
    # One exchange of every parameter in 4 steps, int4 (about 7.8x fewer bytes than fp32): over
    # 30x fewer than DDP's fp32 ring a step; the fragments together send what the whole model does.
    assert 25 < ddp["bytes_per_step"] / blocking["bytes_per_step"] < 33
    assert streamed["bytes_per_step"] == pytest.approx(blocking["bytes_per_step"], rel=0.02)
    for record in document["records"]:
        assert record["step_ms"] > 0 and len(record["step_ms_rounds"]) == record["rounds"] == 2


def test_the_target_judges_the_streamed_run_against_compute_only():
    records = [
        dict(run="compute only", x_compute=1.0),
        dict(run="DDP fp32", x_compute=4.0),
        dict(run="DiLoCo int4, H=25", x_compute=1.3),
        dict(run="DiLoCo int4, H=25, 4 fragments, overlap 2", x_compute=1.05),
    ]
    assert diloco_train.verdict(records) == (
        "target: DiLoCo int4, H=25, 4 fragments, overlap 2 within 1.1x of compute only: 1.05x, met "
        "(DDP fp32: 4.00x)"
    )
