"""Smoke test of bench/kernel_speed.py: tiny sizes, every op, the copy baseline first; backends
called directly must be given the arguments the op boundary completes."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))  # for the script's own imports (common)
_spec = importlib.util.spec_from_file_location("bench_kernel_speed", ROOT / "bench" / "kernel_speed.py")
kernel_speed = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(kernel_speed)


def test_a_backend_called_directly_refuses_arguments_the_op_boundary_would_complete():
    # The CUDA backend's topk_select fails on index_dtype=None (a KeyError on the GPU
    # alone); the cpu one would accept it: the check makes a CPU run fail alike.
    x = torch.randn(1000)
    select = kernel_speed.lookup("cpu")("topk_select")
    with pytest.raises(TypeError, match="index_dtype"):
        select(x, 10, None, True)
    with pytest.raises(TypeError, match="levels"):
        kernel_speed.lookup("torch")("quantize_blockwise")(x, 8, 256)
    values, indices = select(x, 10, None, True, index_dtype=torch.int32)
    assert indices.dtype == torch.int32 and values.numel() == 10


def test_the_topk_section_times_every_fast_backend_dispatchs_choice_first(monkeypatch):
    args = kernel_speed.parser().parse_args(["--iters", "1", "--warmup", "0"])
    assert kernel_speed.topk_backends(kernel_speed.backends_for(torch.device("cpu"))) == ["cpu"]
    with monkeypatch.context() as patched:  # a GPU's backends, each with the op
        patched.setattr(kernel_speed, "provides", lambda backend, op: True)
        assert kernel_speed.topk_backends(["torch", "cuda", "triton"]) == ["triton", "cuda"]
    records = kernel_speed.measure_topk(4096, torch.device("cpu"), ["cpu"], [0.01], args)
    assert [r["backend"] for r in records] == ["torch.topk", "cpu"]
    assert all(r["k"] == 41 and r["median_ms"] > 0 for r in records)


def test_the_topk_target_reads_dispatchs_choice_at_both_sizes():
    def fused(backend, n, fraction):
        return {
            "op": "topk_1pct_ef",
            "backend": backend,
            "elements": n,
            "gb_per_s": 1.0,
            "fraction_of_copy": fraction,
        }

    def alone(backend, n, speedup):
        return {"op": "topk_1pct", "backend": backend, "elements": n, "speedup_vs_torch_topk": speedup}

    m64, m256 = kernel_speed.TOPK_TARGET["sizes"]
    records = [
        fused("triton", m64, 0.45),
        fused("cuda", m64, 0.2),
        alone("torch.topk", m64, 1.0),
        alone("triton", m64, 3.5),
        alone("cuda", m64, 1.2),
        fused("triton", m256, 0.3),
        alone("torch.topk", m256, 1.0),
        alone("triton", m256, 4.0),
    ]
    lines = [line for line in kernel_speed.check_targets(records) if "Top-K" in line]
    assert lines[0].startswith("triton fused Top-K at 1% of 64M: 45% of copy") and lines[0].endswith("met")
    assert lines[1].startswith("triton fused Top-K at 1% of 256M: 30% of copy") and lines[1].endswith(
        "MISSED"
    )


@pytest.mark.slow
def test_kernels_bench_writes_every_op(tmp_path):
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import kernel_speed
kernel_speed.main(["--sizes", "4096,8192", "--topk-sizes", "4096", "--iters", "2", "--warmup", "1",
              "--out", {str(tmp_path)!r}])
"""
    output = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "quantize_int8_ef" in output.stdout and "copy" in output.stdout
    (result,) = tmp_path.glob("kernel_speed-*.json")
    document = json.loads(result.read_text())
    ops = {record["op"] for record in document["records"]}
    assert {"copy", "quantize_int8_ef", "sign_ef", "topk_1pct_ef", "randk_1pct_ef", "topk_1pct"} <= ops
    assert {record["elements"] for record in document["records"]} == {4096, 8192}
    for record in document["records"]:
        assert record["median_ms"] > 0 and record.get("gb_per_s", 1) > 0
        assert record["cpus"] >= 1 and record["torch"]
    assert (tmp_path / result.name.replace(".json", ".csv")).exists()


def test_a_run_stopped_midway_keeps_the_sizes_it_finished(tmp_path, monkeypatch):
    measure = kernel_speed.measure_size

    def measure_then_stop(n, *args):
        if n == 8192:
            raise KeyboardInterrupt  # killed at its time limit, say
        return measure(n, *args)

    monkeypatch.setattr(kernel_speed, "measure_size", measure_then_stop)
    arguments = ["--sizes", "4096,8192", "--topk-sizes", "", "--iters", "1", "--warmup", "0"]
    with pytest.raises(KeyboardInterrupt):
        kernel_speed.main([*arguments, "--ops", "quantize_int8_ef", "--out", str(tmp_path)])
    (result,) = tmp_path.glob("kernel_speed-*.json")
    records = json.loads(result.read_text())["records"]
    assert {record["elements"] for record in records} == {4096}
    assert {record["op"] for record in records} == {"copy", "quantize_int8_ef"}
