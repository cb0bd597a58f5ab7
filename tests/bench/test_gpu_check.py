"""bench/gpu_check.sh on CPU: its dry run, its sections' imports, the overlap read from a trace.

The GPU machine is lent rarely and briefly: a section that fails there for a
reason a CPU could have shown (an import, a signature, a file name) costs
the run. Two such defects reached the script before: bench/gpu_ddp.py
imported ``free_port`` from ``gradcomp.demo`` (it lives in
``gradcomp.spawn``) inside its main, after its first section, and
bench/kernel_speed.py called the CUDA backend's ``topk_select`` with
``index_dtype=None``, which only the op boundary completes. The dry run
runs every section's code on CPU and would have failed on both: the
two-rank comparison imports at the top of gpu_ddp.py now, and the Top-K
section runs on the cpu backend, whose direct calls are checked for
arguments the boundary would complete (tests/bench/test_kernel_speed.py).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from gradcomp.spawn import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
SCRIPT = os.path.join(BENCH, "gpu_check.sh")
SECTIONS = (
    "versions",
    "kernels",
    "worker",
    "identity",
    "overlap",
    "compare",
    "ranks",
    "parity",
    "host cost",
    "memcheck",
)
# What the device runner brings back of the output folder.
MOST_FILES = 8
sys.path.insert(0, BENCH)


@pytest.mark.parametrize(
    "module", ["lib.gpu_setup", "gpu_worker", "gpu_identity", "gpu_ddp", "gpu_ranks", "gpu_memcheck"]
)
def test_every_section_script_imports(module):
    # Imports sit at the top of each script: a name that moved fails here, not on the GPU
    # (kernel_speed.py: tests/bench/test_kernel_speed.py).
    importlib.import_module(module)


def test_memcheck_of_a_backend_that_cannot_run_fails():
    """No call checks nothing: the cuda backend off on the GPU must fail its section."""
    import gpu_memcheck

    assert gpu_memcheck.main(["--dry-run", "--backend", "cuda"]) == 1
    assert gpu_memcheck.main(["--dry-run", "--backend", "cpu"]) == 0


def test_the_script_parses():
    result = subprocess.run(["bash", "-n", SCRIPT], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr


def test_help_prints_the_usage_and_runs_nothing(tmp_path):
    for flag in ("--help", "-h"):
        result = subprocess.run(
            ["bash", SCRIPT, flag], capture_output=True, text=True, timeout=30, cwd=tmp_path
        )
        assert result.returncode == 0, result.stderr
        assert "Usage: bash bench/gpu_check.sh [OUTPUT_DIR]" in result.stdout
        assert "--dry-run" in result.stdout and not list(tmp_path.iterdir())
    result = subprocess.run(["bash", SCRIPT, "--dryrun"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 2 and "unknown option --dryrun" in result.stderr


def _kernel(ts: float, dur: float, stream: int, correlation: int, name: str = "ampere_sgemm") -> dict:
    args = {"stream": stream, "correlation": correlation}
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": args}


def _launch(tid: int, correlation: int) -> dict:
    return {
        "cat": "cuda_runtime",
        "name": "cudaLaunchKernel",
        "tid": tid,
        "ts": 0,
        "args": {"correlation": correlation},
    }


def test_overlap_counts_the_worker_threads_kernels_against_the_rest():
    gpu_ddp = importlib.import_module("gpu_ddp")
    events = [
        _launch(1, 10),
        _kernel(0, 100, stream=7, correlation=10),  # backward, 0..100
        _launch(1, 11),
        _kernel(150, 100, stream=7, correlation=11),  # backward, 150..250
        _launch(2, 20),
        _kernel(50, 100, stream=13, correlation=20, name="_quantize_kernel"),  # 50..150: half overlapped
        _launch(2, 21),
        _kernel(60, 20, stream=13, correlation=21, name="elementwise"),  # nested in the one above
    ]
    found = gpu_ddp.overlap_from_trace(events, {2}, "cuda")
    assert found["gradcomp found by"] == "launching thread"
    assert found["gradcomp events"] == 2 and found["gradcomp kernels by name"] == 1
    assert found["gradcomp streams"] == [13] and found["backward streams"] == [7]
    assert found["shared streams"] == []
    assert found["gradcomp busy us"] == 100 and found["overlapped us"] == 50
    assert found["overlapped fraction"] == 0.5


def test_overlap_finds_gradcomps_kernels_by_name_where_no_launch_is_the_workers():
    gpu_ddp = importlib.import_module("gpu_ddp")
    # By exact name (torch's "unsigned" reduction is not gradcomp's sign kernel), and then
    # everything on the streams gradcomp's kernels ran on (a fill the worker queued there).
    events = [
        _kernel(0, 100, stream=7, correlation=1, name="reduce_kernel<512, 1, unsigned int>"),
        _kernel(20, 10, stream=13, correlation=2, name="_sign_kernel"),
        _kernel(40, 10, stream=13, correlation=3, name="elementwise_kernel"),
        _kernel(60, 10, stream=13, correlation=4, name="sign_compress_f32_f32"),
    ]
    found = gpu_ddp.overlap_from_trace(events, {99}, "cuda")
    assert found["gradcomp found by"] == "kernel name" and found["gradcomp events"] == 3
    assert found["gradcomp streams"] == [13] and found["backward streams"] == [7]
    assert found["shared streams"] == [] and found["overlapped fraction"] == 1.0


@pytest.mark.slow
def test_dry_run_runs_every_section_on_cpu(tmp_path):
    began = time.monotonic()
    result = subprocess.run(
        ["bash", SCRIPT, "--dry-run", str(tmp_path)], capture_output=True, text=True, timeout=400
    )
    seconds = time.monotonic() - began
    summary = (tmp_path / "gpu_check.txt").read_text()
    assert result.returncode == 0, f"{summary}\n{result.stdout[-4000:]}\n{result.stderr[-2000:]}"
    lines = summary.splitlines()
    for section in SECTIONS:
        assert any(line.startswith(section) and ": ok," in line for line in lines), (section, summary)
    files = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert len(files) <= MOST_FILES, sorted(path.name for path in files)
    assert {"gpu_check.log", "gpu_check.json", "parity.xml", "gpu_check-files.tar.gz"} <= {
        p.name for p in files
    }
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    for section in ("worker", "identity", "ddp overlap", "ddp compare", "ranks"):
        assert report[section]["ok"] and report[section]["checks"], section
        assert "CPUs" in report[section]["machine"]
    # On CPU Gloo runs every collective: every path between ranks is covered, none skipped.
    ranks = report["ranks"]["checks"]
    assert len(ranks) == 2 and all(check["not covered"] == [] for check in ranks.values()), ranks
    assert {
        "FSDP2 keeps the hook's input across streams",
        "no host syncs in steady state",
        "Work.is_completed() follows the GPU",
    } <= set(report["worker"]["checks"])
    # Every backend of the dry run ran every case at 4 ranks, and the ranks agreed.
    (identity,) = report["identity"]["checks"].values()
    backends = [identity[backend] for backend in ("default", "torch")]
    assert identity["differ"] == [] and all(len(b) == 9 and b["ok"] for b in backends), identity
    (kernels,) = tmp_path.glob("kernel_speed-*.json")
    ops = {record["op"] for record in json.loads(kernels.read_text())["records"]}
    assert {"copy", "quantize_int8_ef", "topk_1pct_ef", "topk_1pct"} <= ops
    # The host cost's files travel in the archive (the folder keeps its 8).
    with tarfile.open(tmp_path / "gpu_check-files.tar.gz") as archive:
        (name,) = [n for n in archive.getnames() if n.startswith("./host_cost-") and n.endswith(".json")]
        host = json.load(archive.extractfile(name))
    assert host["settings"]["device"] == "cpu"
    assert [r["config"] for r in host["records"]] == ["ddp", "torch_allreduce", "torch_fp16", "int8", "topk"]
    # The suite's budget for it, with room for a busy machine (about 75 s on 2 idle cores).
    assert seconds < 180, seconds


# ----------------------------------------------------------------------------- items on ranks


def _dies_in_the_second_item(rank: int, world_size: int, items: list[str], progress) -> None:
    for item in items:
        if not progress.begin(item):
            return
        if item == "b" and rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)  # as a crash in torch's C++ ends a process
        dist.barrier()
        progress.end(item, {"ok": True})


@pytest.mark.slow
def test_a_rank_that_dies_costs_its_item_alone(tmp_path):
    from lib import gpu_setup

    report = gpu_setup.Report(str(tmp_path), "items", torch.device("cpu"), {})
    progress = gpu_setup.Progress(report, "two ranks", time.time() + 200)
    gpu_setup.run_items(_dies_in_the_second_item, 2, ["a", "b", "c"], progress)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())["items"]["checks"]["two ranks"]
    assert saved["a"] == saved["c"] == {"ok": True}, saved
    assert saved["b"]["ok"] is False and "SIGKILL" in saved["b"]["error"], saved
    # An item the time left no room for is saved as not run; no rank starts for it.
    late = gpu_setup.Progress(report, "late", time.time() - 1)
    gpu_setup.run_items(_dies_in_the_second_item, 2, ["a"], late)
    assert late.saved() == {"a": {"ok": False, "not run": "no time was left for it"}}


def _gathered_without_a_coalesced_all_gather(rank: int, world_size: int) -> bool:
    import gpu_ranks
    from torch.distributed import _functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    # Rows that 3 ranks shard unevenly (3, 3, 1) and one that leaves a rank nothing (1, 1, 0).
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 2))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator))
    whole = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mesh = init_device_mesh("cpu", (world_size,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # full_tensor()'s all-gather: a coalesced one in torch's C++, which Gloo has for CPU tensors only.
    refused = AssertionError("funcol's all-gather: Gloo's coalesced all-gather crashes on CUDA tensors")
    with mock.patch.object(funcol, "all_gather_single", side_effect=refused):
        return torch.equal(gpu_ranks.flat_parameters(model), whole)


@pytest.mark.slow
def test_fsdp2_parameters_are_gathered_on_the_host_without_full_tensor():
    assert run_ranks(_gathered_without_a_coalesced_all_gather, 3, timeout=120)


def _one_rank_one_ulp_off(rank: int, world_size: int) -> list[dict]:
    import gpu_identity

    device = torch.device("cpu")
    found = [gpu_identity.run_case("topk@0.01", "allgather", rank, device)]
    original = gpu_identity.gradcomp.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        stats = original(tensor, *args, **kwargs)
        if rank == 2:
            tensor[7] = torch.nextafter(tensor[7], torch.tensor(math.inf))
        return stats

    with mock.patch.object(gpu_identity.gradcomp, "all_reduce", all_reduce):
        found.append(gpu_identity.run_case("topk@0.01", "allgather", rank, device))
    return found


@pytest.mark.slow
def test_the_identity_check_finds_one_element_one_rank_holds_otherwise():
    same, off = run_ranks(_one_rank_one_ulp_off, 4, timeout=180)
    assert same == {"identical": True, "elements differing from rank 0, a step": [0, 0, 0]}
    assert off == {"identical": False, "elements differing from rank 0, a step": [1, 1, 1]}
