"""What the sections of ``bench/gpu_check.sh`` share: the device, a one-rank group, a report.

Each section runs for real on one CUDA GPU and, with ``--dry-run``, on a CPU
machine: CPU tensors, Gloo instead of NCCL, tiny sizes, the same Python
otherwise. The test suite runs the dry run (tests/bench/test_gpu_check.py), so that
on the GPU machine, lent once and briefly, nothing but the device itself can
fail: not an import, a signature or a file name.

Results go to ``<out>/gpu_check.json``, one entry per section, rewritten
after every check (whole or not at all): a section killed at its time limit
keeps what finished. Checks that run on spawned ranks save each item (a path,
a backend) as it ends, and a rank that dies costs only its item
(:func:`run_items`).

Example:
    >>> args = parser(__doc__).parse_args()
    >>> report = Report(args.out, "worker", device_for(args.dry_run), {"numel": numel})
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

import gradcomp
from gradcomp.spawn import RanksFailed, free_port, run_ranks
from lib.machine import cpu_model
from lib.results import RESULTS

REPORT = "gpu_check.json"

# The sections compare runs bit for bit; on CPUs torch's MKL math (AdamW's sqrt, for
# one) differs from run to run without conditional numerical reproducibility, now
# and then, in a fresh process on a busy machine (tests/conftest.py says more). MKL
# reads it at its first call, which no import here makes.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")
GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def parser(doc: str) -> argparse.ArgumentParser:
    """A section's parser, described by the first line of ``doc``, with the options every
    section takes: ``--dry-run`` and ``--out``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="run the section's logic on CPU tensors with Gloo and tiny sizes (no GPU needed)",
    )
    parser.add_argument("--out", default=RESULTS, help=f"folder of {REPORT} (default {RESULTS})")
    return parser


def device_for(dry_run: bool) -> torch.device:
    """The GPU, or the CPU in a dry run; exits with a message where no GPU is present."""
    if dry_run:
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: needs a CUDA GPU (--dry-run runs it on CPU)")
    return torch.device("cuda", 0)


def rank_device(device_type: str) -> torch.device:
    """A spawned rank's device: the one GPU every rank shares (made current), or the CPU."""
    if device_type != "cuda":
        return torch.device("cpu")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    return device


@contextlib.contextmanager
def forced_backend(backend: str | None):
    """Within: ``GRADCOMP_BACKEND=backend`` (None: none forced, dispatch chooses); on
    leaving, none forced and gradcomp's queues released (a failed job fails its queue)."""
    if backend is None:
        os.environ.pop("GRADCOMP_BACKEND", None)
    else:
        os.environ["GRADCOMP_BACKEND"] = backend
    try:
        yield
    finally:
        os.environ.pop("GRADCOMP_BACKEND", None)
        gradcomp.collectives.release_queues()


def seeded(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` with normal weights over the square root of their last dimension, drawn
    from a generator seeded 0 (the global RNG untouched): the same on every rank."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)
    return model


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


def write_json(path: str, document: dict) -> None:
    """``document`` to ``path`` whole or not at all: a temporary file beside it, flushed
    and fsynced, renamed over it (a kill at any point leaves the last whole file)."""
    partial = f"{path}.partial"
    with open(partial, "w") as handle:
        json.dump(document, handle, indent=1, default=str)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(partial, path)


def read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path) as handle:
        return json.load(handle)


def saved_items(path: str, section: str, check: str) -> dict:
    """What the report at ``path`` holds of ``check``: item -> result."""
    return read_json(path).get(section, {}).get("checks", {}).get(check, {})


def save_item(path: str, section: str, check: str, item: str, result: dict) -> None:
    """``result`` as ``item`` of ``check`` in the report at ``path``, at once (from a
    spawned rank while the section's own process waits for the ranks)."""
    document = read_json(path)
    checks = document.setdefault(section, {}).setdefault("checks", {})
    checks.setdefault(check, {})[item] = result
    write_json(path, document)


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
        document = read_json(self.path)
        document[self.section] = self.data
        write_json(self.path, document)

    def saved(self, name: str) -> dict:
        """What the file holds of check ``name`` (items spawned ranks saved)."""
        return saved_items(self.path, self.section, name)

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
            for item, result in self.saved(name).items():
                entry.setdefault(item, result)  # what ranks saved, where the check kept less
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


# What a check's item holds while the ranks run it: left there, the ranks ended in it.
RUNNING = "running when the ranks ended"
# How long an item begun just before the check's deadline may still run.
ITEM_SECONDS = 30


class Progress:
    """A check whose items spawned ranks run in turn: an item is begun only while the
    check's time lasts (rank 0's clock decides, every rank follows it), and rank 0 saves
    it to the report as it begins and as it ends. Handed to the ranks (picklable)."""

    def __init__(self, report: Report, check: str, deadline: float):
        self.path, self.section, self.check = report.path, report.section, check
        self.deadline = deadline  # time.time(): one clock for every process of the machine

    def begin(self, item: str) -> bool:
        """Whether to run ``item`` (on every rank alike); if so, marked as running."""
        go = torch.tensor([float(time.time() < self.deadline)])
        dist.broadcast(go, 0)
        if go.item():
            self.end(item, {"ok": False, RUNNING: True})
        return bool(go.item())

    def end(self, item: str, result: dict) -> None:
        if not dist.is_initialized() or dist.get_rank() == 0:
            save_item(self.path, self.section, self.check, item, result)

    def saved(self) -> dict:
        """The check's items in the report: item -> result."""
        return saved_items(self.path, self.section, self.check)


def items_on_ranks(
    report: Report, check: str, deadline: float, body, world_size: int, items: list[str], *args
):
    """:func:`run_items` for ``check`` of ``report``, begun until ``deadline`` (``time.time()``);
    what the report then holds of it: item -> result."""
    progress = Progress(report, check, deadline)
    run_items(body, world_size, items, progress, *args)
    return progress.saved()


def run_items(body, world_size: int, items: list[str], progress: Progress, *args, group_timeout: float = 60):
    """Run ``body(rank, world_size, items, progress, *args)`` on ``world_size`` spawned
    ranks, which run ``items`` in turn through ``progress``, until each item has its
    result in the report. Where a rank raises or dies (a crash in torch's C++ included),
    the item it was running is saved as failed with the error, and new ranks go on with
    the next; items the time left no room for are saved as not run."""
    left = list(items)
    while left and time.time() < progress.deadline:
        timeout = progress.deadline - time.time() + ITEM_SECONDS
        try:  # ranks that return have begun every item the time left room for
            run_ranks(body, world_size, left, progress, *args, timeout=timeout, group_timeout=group_timeout)
        except RanksFailed as error:
            running = [item for item in left if progress.saved().get(item, {}).get(RUNNING)]
            if not running:
                raise  # before the first item: nothing to go on past
            progress.end(running[0], {"ok": False, "error": str(error)[-3000:]})
            print(f"{running[0]}: the ranks failed in it; going on with the next\n{error}", flush=True)
        left = [item for item in left if item not in progress.saved()]
    for item in left:
        progress.end(item, {"ok": False, "not run": "no time was left for it"})
