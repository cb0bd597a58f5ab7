"""What the sections of ``bench/gpu_check.sh`` share: the device, a one-rank group, a report.

Each section runs for real on one CUDA GPU and, with ``--dry-run``, on a CPU
machine: CPU tensors, Gloo instead of NCCL, tiny sizes, the same Python
otherwise. The test suite runs the dry run (tests/bench/test_gpu_check.py), so that
on the GPU machine, lent once and briefly, nothing but the device itself can
fail: not an import, a signature or a file name.

Results go to ``<out>/gpu_check.json``, one entry per section, rewritten
after every check: a section killed at its time limit keeps what finished.

Example:
    >>> report = Report(out, "worker", device, {"numel": numel})
    >>> with report.check("ordering: sync") as entry:
    ...     entry.update(ok=at_once == after)
    >>> sys.exit(report.finish())
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys
import tempfile
import time
import traceback

import torch
import torch.distributed as dist
from lib.machine import cpu_model
from lib.results import RESULTS

import gradcomp
from gradcomp.spawn import free_port

REPORT = "gpu_check.json"

# The sections compare runs bit for bit; on CPUs torch's MKL math (AdamW's sqrt, for
# one) differs from run to run without conditional numerical reproducibility, now
# and then, in a fresh process on a busy machine (tests/conftest.py says more). MKL
# reads it at its first call, which no import here makes.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def add_options(parser: argparse.ArgumentParser) -> None:
    """``--dry-run`` and ``--out``, the options every section takes."""
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the section's logic on CPU tensors with Gloo and tiny sizes (no GPU needed)",
    )
    parser.add_argument("--out", default=RESULTS, help=f"folder of {REPORT} (default {RESULTS})")


def device_for(dry_run: bool) -> torch.device:
    """The GPU, or the CPU in a dry run; exits with a message where no GPU is present."""
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: needs a CUDA GPU (--dry-run runs it on CPU)")
    return torch.device("cuda", 0)


def machine_name(device: torch.device) -> str:
    """The GPU's name, or the CPU's with its core count: every result names its machine."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{os.cpu_count()} CPUs ({cpu_model()})"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def stream_handle(device: torch.device) -> int | None:
    """The current CUDA stream's handle on ``device`` (None on CPU, which has no streams)."""
    return torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else None


@contextlib.contextmanager
def one_rank_group(device: torch.device):
    """Within: a default group of one rank, NCCL bound to the GPU (Gloo on CPU); on
    leaving, gradcomp's queues and the group are released."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device, timeout=GROUP_TIMEOUT)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1, timeout=GROUP_TIMEOUT)
    try:
        yield
    finally:
        gradcomp.collectives.release_queues()
        dist.destroy_process_group()


@contextlib.contextmanager
def sync_debug_errors(device: torch.device):
    """Within: on a GPU, every call that synchronizes the host with the device raises
    (``torch.cuda.set_sync_debug_mode("error")``, a setting of the whole process, its
    threads included); on CPU nothing changes."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def profiler_activities(device: torch.device) -> list:
    from torch.profiler import ProfilerActivity

    return [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])


def trace_events(trace, path: str | None = None) -> list[dict]:
    """The events of a finished ``torch.profiler.profile``, through its Chrome trace
    (kept at ``path`` if given)."""
    if path is None:
        with tempfile.TemporaryDirectory() as folder:
            return trace_events(trace, os.path.join(folder, "trace.json"))
    trace.export_chrome_trace(path)
    with open(path) as handle:
        return json.load(handle)["traceEvents"]


class Report:
    """One section's checks in ``<out>/gpu_check.json`` under ``section``.

    The file is rewritten after every check; entries of other sections in
    it are kept. ``finish()`` gives the exit status: 1 if a check failed.
    """

    def __init__(self, out: str, section: str, device: torch.device, settings: dict):
        os.makedirs(out, exist_ok=True)
        self.path = os.path.join(out, REPORT)
        self.section = section
        self.ok = True
        self.data = {
            "machine": machine_name(device),
            "device": str(device),
            "torch": torch.__version__,
            "gradcomp": gradcomp.__version__,
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "settings": settings,
            "checks": {},
        }
        print(f"# {section} on {self.data['machine']}, torch {torch.__version__}", flush=True)
        self.save()

    def save(self) -> None:
        document = {}
        if os.path.exists(self.path):
            with open(self.path) as handle:
                document = json.load(handle)
        document[self.section] = self.data
        partial = f"{self.path}.partial"
        with open(partial, "w") as handle:
            json.dump(document, handle, indent=1, default=str)
        os.replace(partial, self.path)  # a kill mid-write leaves the last whole file

    @contextlib.contextmanager
    def check(self, name: str):
        """Within: fill the yielded dict; ``ok=False`` in it marks a failure. An
        exception is recorded as the check's error and the section goes on."""
        entry = self.data["checks"][name] = {}
        began = time.perf_counter()
        try:
            yield entry
        except Exception:  # noqa: BLE001 - recorded; the next check still runs
            entry["error"] = traceback.format_exc(limit=8)
            entry["ok"] = False
        finally:
            entry["seconds"] = round(time.perf_counter() - began, 3)
            self.ok &= bool(entry.get("ok", True))
            self.save()
            shown = {key: value for key, value in entry.items() if key != "error"}
            print(f"{name}: {'ok' if entry.get('ok', True) else 'FAILED'} {shown}", flush=True)
            if "error" in entry:
                print(entry["error"], flush=True)

    def finish(self) -> int:
        self.data["ok"] = self.ok
        self.save()
        print(f"# {self.section}: {'every check passed' if self.ok else 'a check FAILED'}", flush=True)
        return 0 if self.ok else 1
