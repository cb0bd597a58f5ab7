"""The DDP hook end to end on one GPU: results against the torch backend, and overlap from a profile.

Run by ``bench/gpu_check.sh`` (it needs a CUDA GPU):

* one rank over NCCL: a small MLP trains a few steps with gradcomp's hook
  (int8, Top-K) once per backend (the GPU one, then ``GRADCOMP_BACKEND=torch``);
  the parameters must agree bit for bit (a few ulp for sign); and the same
  for ``gradcomp.optim.CompressedAdam`` (int8 momentum after 3 AdamW steps);
* two ranks over Gloo on CUDA tensors, the same GPU, if Gloo takes the
  collectives used: the same comparison, then one step profiled with
  ``torch.profiler`` on rank 0. From the trace: the streams gradcomp's
  kernels ran on (they must not be the backward stream) and how much of
  their time overlapped the backward pass's kernels.

Prints one line per check and writes ``gpu_ddp-<gpu>.json`` (and the
trace) under ``--out``. Exits non-zero if a result differs.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

STEPS = 4
BUCKET_MB = 0.25
GPU_NAMES = (
    "quantize",
    "dequantize",
    "sign",
    "compact",
    "count",
    "scatter",
    "topk",
    "pack",
    "gather",
    "compensate",
)


def make_model() -> torch.nn.Module:
    generator_state = torch.random.get_rng_state()
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 1024), torch.nn.ReLU()]
    for _ in range(6):
        layers += [torch.nn.Linear(1024, 1024), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(1024, 10))
    torch.random.set_rng_state(generator_state)
    return model


def hooked_model(compressor: str) -> torch.nn.Module:
    import gradcomp

    model = torch.nn.parallel.DistributedDataParallel(make_model().cuda(), bucket_cap_mb=BUCKET_MB)
    gradcomp.ddp.register(model, compressor, min_numel=0)
    return model


def train(rank: int, world_size: int, compressor: str, backend: str | None, steps: int = STEPS):
    """Parameters after ``steps`` of SGD with the hook on ``backend`` (None: the default);
    compressor ``adam:NAME``: CompressedAdam exchanging momentum through NAME, no hook."""
    import gradcomp

    if backend is None:
        os.environ.pop("GRADCOMP_BACKEND", None)
    else:
        os.environ["GRADCOMP_BACKEND"] = backend
    device = torch.device("cuda", 0)
    if compressor.startswith("adam:"):
        model = make_model().cuda()
        optimizer = gradcomp.optim.CompressedAdam(
            model.parameters(), lr=1e-3, compressor=compressor[5:], warmup_steps=3
        )
    else:
        model = hooked_model(compressor)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        inputs = torch.randn(64, 256, generator=generator).to(device)
        labels = torch.randint(0, 10, (64,), generator=generator).to(device)
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        optimizer.step()
    torch.cuda.synchronize()
    gradcomp.collectives.release_queues()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def compare(rank: int, world_size: int, report: dict) -> bool:
    """The hook on the GPU backends against the torch backend; True if all agree."""
    ok = True
    for compressor, tolerance in (("int8", 0.0), ("topk", 0.0), ("sign", 1e-5), ("adam:int8", 0.0)):
        try:
            gpu = train(rank, world_size, compressor, None)
            reference = train(rank, world_size, compressor, "torch")
            difference = (gpu - reference).abs().max().item()
            same = difference <= tolerance * max(1.0, reference.abs().max().item())
            report[f"{compressor} vs torch backend, max |difference|"] = difference
            ok &= same
            print(
                f"  {compressor}: {'same' if same else 'DIFFERENT'} (max |difference| {difference:.3g})",
                flush=True,
            )
        except Exception:  # noqa: BLE001 - reported, the run goes on
            report[f"{compressor} error"] = traceback.format_exc(limit=3)
            print(f"  {compressor}: ERROR\n{traceback.format_exc(limit=3)}", flush=True)
            ok = False
    return ok


def profile_overlap(rank: int, world_size: int, out: str, report: dict) -> None:
    """One profiled step: gradcomp's kernels' streams and their overlap with backward kernels."""
    from torch.profiler import ProfilerActivity, profile

    import gradcomp

    os.environ.pop("GRADCOMP_BACKEND", None)
    model = hooked_model("int8")
    device = torch.device("cuda", 0)
    inputs, labels = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
    for _ in range(2):  # agreement checks, bucket rebuild
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
    torch.cuda.synchronize()
    backward_stream = torch.cuda.current_stream().cuda_stream
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as trace:
        start = time.perf_counter()
        torch.nn.functional.cross_entropy(model(inputs), labels).backward()
        torch.cuda.synchronize()
        report["profiled step ms"] = 1e3 * (time.perf_counter() - start)
    gradcomp.collectives.release_queues()
    if rank != 0:
        return
    path = os.path.join(out, "gpu_ddp-trace.json")
    trace.export_chrome_trace(path)
    with open(path) as handle:
        events = json.load(handle)["traceEvents"]
    kernels = [e for e in events if e.get("cat") == "kernel" and "dur" in e]
    ours = [e for e in kernels if any(name in e["name"] for name in GPU_NAMES)]
    theirs = [e for e in kernels if e not in ours]
    streams = sorted({e["args"].get("stream") for e in ours})
    report["gradcomp kernels"] = len(ours)
    report["gradcomp kernel streams"] = streams
    report["backward kernel streams"] = sorted({e["args"].get("stream") for e in theirs})
    report["backward stream handle"] = backward_stream
    overlap = 0.0
    for a in ours:
        for b in theirs:
            overlap += max(0.0, min(a["ts"] + a["dur"], b["ts"] + b["dur"]) - max(a["ts"], b["ts"]))
    busy = sum(e["dur"] for e in ours)
    report["gradcomp kernel us"] = busy
    report["overlapped with other kernels us"] = overlap
    print(
        f"  {len(ours)} gradcomp kernels on streams {streams} (other kernels on "
        f"{report['backward kernel streams']}); {busy:.0f} us of them, {overlap:.0f} us overlapped "
        "other kernels",
        flush=True,
    )


def _rank(rank: int, world_size: int, port: int, out: str, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=120))
    report: dict = {}
    try:
        ok = compare(rank, world_size, report)
        profile_overlap(rank, world_size, out, report)
        report["ok"] = ok
    except Exception:  # noqa: BLE001 - reported to the parent
        report["error"] = traceback.format_exc(limit=4)
        report["ok"] = False
    finally:
        dist.destroy_process_group()
    results[rank] = report


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    arguments = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu_ddp: needs a CUDA GPU", file=sys.stderr)
        return 2
    os.makedirs(arguments.out, exist_ok=True)
    name = torch.cuda.get_device_name(0)
    record: dict = {"gpu": name, "torch": torch.__version__}
    print(f"gpu_ddp on {name}", flush=True)

    print("one rank, NCCL:", flush=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29571")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    single: dict = {}
    ok = compare(0, 1, single)
    dist.destroy_process_group()
    record["one rank NCCL"] = single

    print("two ranks, Gloo on CUDA tensors:", flush=True)
    from gradcomp.demo import free_port

    with mp.Manager() as manager:
        results = manager.dict()
        context = mp.start_processes(
            _rank, args=(2, free_port(), arguments.out, results), nprocs=2, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + 240
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                results[0] = {"error": "timed out after 240 s", "ok": False}
                break
        record["two ranks Gloo"] = dict(results)
    for rank, report in sorted(record["two ranks Gloo"].items()):
        if "error" in report:
            print(f"  rank {rank}: {report['error']}", flush=True)
        ok &= bool(report.get("ok"))
    path = os.path.join(arguments.out, f"gpu_ddp-{name.replace(' ', '_')}.json")
    with open(path, "w") as handle:
        json.dump(record, handle, indent=1, default=str)
    print(f"gpu_ddp: {'all agree' if ok else 'DIFFERENCES'}; {path}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
