"""bench/host_cost.py: the per-bucket arithmetic of its profile, and a tiny run's table and result files."""

from __future__ import annotations

import csv
import glob
import importlib
import json
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
host_cost = importlib.import_module("host_cost")

MACHINE_COLUMNS = {"machine", "cpus", "torch", "revision", "world_size", "backend", "load_start", "load_end"}


def test_profile_is_summarized_per_bucket_with_waits_apart():
    get = ("~", 0, host_cost.WAITS[0])
    hook = (os.path.join(ROOT, "gradcomp", "ddp.py"), 961, "hook")
    stats = {get: (8, 8, 0.004, 0.004, {}), hook: (4, 4, 0.002, 0.006, {})}
    summary = host_cost.summarize(stats, buckets=4, top=1)
    assert summary["busy_us_per_bucket"] == pytest.approx(500.0)  # the hook's own 2 ms over 4 buckets
    assert summary["waiting_us_per_bucket"] == pytest.approx(1000.0)
    assert summary["calls_per_bucket"] == 3.0
    [first] = summary["by_own"]
    assert first["function"] == host_cost.WAITS[0] and first["waits"] and first["calls_per_bucket"] == 2.0
    [first] = summary["by_cumulative"]
    assert first["function"] == "gradcomp/ddp.py:961(hook)" and not first["waits"]
    assert first["cumulative_us_per_bucket"] == pytest.approx(1500.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal where no GPU is visible")
def test_device_cuda_without_a_gpu_is_refused(capsys):
    with pytest.raises(SystemExit) as stopped:
        host_cost.main(["--device", "cuda"])
    assert stopped.value.code == 2 and "--device cuda needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.slow
def test_host_cost_smoke(tmp_path, capsys):
    args = ["--buckets", "4", "--steps", "2", "--rounds", "2", "--warmup-steps", "3", "--profile-steps", "1"]
    assert host_cost.main([*args, "--top", "5", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "DDP all-reduce (no hook)" in out and "extra us/bucket" in out
    [csv_path] = glob.glob(str(tmp_path / "host_cost-*.csv"))
    stem = csv_path.removesuffix(".csv")
    assert os.path.getsize(stem + ".png") > 1000
    with open(csv_path) as file:
        rows = list(csv.DictReader(file))
    with open(stem + ".json") as file:
        document = json.load(file)
    assert MACHINE_COLUMNS <= set(rows[0]) and document["machine"]["cpus"] == os.cpu_count()
    assert document["settings"]["device"] == "cpu" and "cpu tensors" in out
    assert [r["config"] for r in rows] == ["ddp", "torch_allreduce", "torch_fp16", "int8", "topk"]
    by_config = {r["config"]: r for r in document["records"]}
    assert by_config["int8"]["how"] == "int8 allgather" and by_config["topk"]["how"] == "topk allgather"
    assert by_config["torch_fp16"]["how"] == "torch fp16_compress_hook"
    for record in document["records"]:
        assert record["buckets"] == 4 and record["bucket_numel"] == 1024 and record["timed_steps"] == 4
        assert record["device"] == "cpu"
        assert record["step_ms"] > 0 and len(record["step_ms_rounds"]) == 2 and record["cpu_ms"] > 0
        expected = 1e3 * (record["step_ms"] - by_config["ddp"]["step_ms"]) / 4
        assert record["extra_us_per_bucket"] == pytest.approx(expected)
        assert record["goal_us_per_bucket"] == host_cost.GOAL_US
        over = 1e3 * (record["step_ms"] - by_config["torch_fp16"]["step_ms"]) / 4
        assert record["over_torch_fp16_us_per_bucket"] == pytest.approx(over)
    assert by_config["ddp"]["x_ddp"] == 1.0
    # The worker thread runs gradcomp's jobs: next to nothing while DDP reduces on its own.
    assert by_config["ddp"]["worker_cpu_ms"] < 0.1 * by_config["int8"]["worker_cpu_ms"]
    # Of the worker's time, the codec ops' (timed inside the CPU backend) and the rest.
    assert by_config["ddp"]["codec_cpu_ms"] == 0
    for name in ("int8", "topk"):
        record = by_config[name]
        assert 0 < record["codec_cpu_ms"] < record["worker_cpu_ms"]
        assert record["path_cpu_ms"] == pytest.approx(record["worker_cpu_ms"] - record["codec_cpu_ms"])
    if not host_cost.can_profile_threads():
        assert document["profile"] is None and "profile: skipped" in out
        return
    for name in ("int8", "topk"):
        profile = document["profile"][name]
        assert profile["hook_calls"] == profile["buckets_profiled"] == 4
        assert by_config[name]["hook_us_per_call"] > 0
        for thread in host_cost.THREADS:
            assert len(profile[thread]["by_own"]) == len(profile[thread]["by_cumulative"]) == 5
            assert profile[thread]["busy_us_per_bucket"] > 0
        functions = [r["function"] for r in profile["main"]["by_cumulative"]]
        assert any(f.startswith("bench/host_cost.py:") for f in functions)  # the step, relative to the repo
