"""Smoke test of bench/kernels.py: tiny sizes, every op, the copy baseline first."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_kernels_bench_writes_every_op(tmp_path):
    script = f"""
import sys
sys.path.insert(0, {str(ROOT / "bench")!r})
import kernels
kernels.main(["--sizes", "4096", "--iters", "2", "--warmup", "1", "--out", {str(tmp_path)!r}])
"""
    output = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True
    )
    assert "quantize_int8_ef" in output.stdout and "copy" in output.stdout
    (result,) = tmp_path.glob("kernels-*.json")
    document = json.loads(result.read_text())
    ops = {record["op"] for record in document["records"]}
    assert {"copy", "quantize_int8_ef", "sign_ef", "topk_1pct_ef", "randk_1pct_ef"} <= ops
    for record in document["records"]:
        assert record["median_ms"] > 0 and record["gb_per_s"] > 0
        assert record["cpus"] >= 1 and record["torch"]
    assert (tmp_path / result.name.replace(".json", ".csv")).exists()
