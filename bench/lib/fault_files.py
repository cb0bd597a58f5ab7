"""The fault matrix's cases on files and payloads: a save killed while it writes,
crafted, truncated, NaN-holding and another rank's checkpoint files, a DCP checkpoint
loaded on another world size, payloads decoded by another compressor or shape.
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import shutil
import signal
import tempfile
import time
import warnings

import torch
import torch.distributed as dist

import gradcomp
from lib import fault_ranks
from lib.fault_ranks import (
    CODE_RAN,
    DROPPED,
    KEPT,
    LOST,
    RAISED_EVERYWHERE,
    REFUSED,
    RETURNED,
    SILENT,
    UNCLEAR,
    Row,
    every_rank_raises,
    logged_warnings,
    mark,
)

# ----------------------------------------------------------------------------- checkpoint files


def _hook_state(numel: int, steps: int, seed: int = 0):
    """A DDP model under the int8 hook (one rank's view), trained ``steps`` steps: residuals of ``numel``."""
    torch.manual_seed(seed)
    net = torch.nn.Linear(numel // 16, 16, bias=False)
    model = torch.nn.parallel.DistributedDataParallel(net)
    state = gradcomp.ddp.register(model, "int8")
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(steps):
        model(torch.randn(4, numel // 16, generator=generator)).square().mean().backward()
    return state


def _save(rank, world_size, directory, numel, steps, timed):
    state = _hook_state(numel, steps)
    if timed:  # the kill's delay counts from here
        mark(directory, rank)
    gradcomp.ddp.save_rank_file(state, directory)
    return state.step


def _load(rank, world_size, directory, numel):
    state = _hook_state(numel, 0)
    gradcomp.ddp.load_rank_file(state, directory)
    return state.step


def _load_ending(directory: str, numel: int, world_size: int = 1, timeout: float = 30.0):
    return fault_ranks.run(_load, world_size, (directory, numel), timeout, timeout)


# Where a save is killed: as it starts (before any byte is written), then at delays
# after the folder first changes (the write has begun), the first ones inside the write.
KILL_POINTS = ("at start", 0.0, 0.001, 0.003, 0.01, 0.03, 0.1, 1.0)


def _folder(directory: str) -> set:
    """What the folder holds (names, sizes, times), the run's own marks left out."""
    found = set()
    for entry in os.scandir(directory):
        if not entry.name.startswith(("t0-", "rank")):
            with contextlib.suppress(FileNotFoundError):
                info = entry.stat()
                found.add((entry.name, info.st_size, info.st_mtime_ns))
    return found


def killed_save(numel: int = 1 << 22) -> Row:
    """A save killed at several points while it writes over a previous checkpoint."""
    lost, kept = [], []
    with tempfile.TemporaryDirectory() as directory:
        fault_ranks.run(_save, 1, (directory, numel, 1, False), 120)
        for point in KILL_POINTS:
            for leftover in glob.glob(os.path.join(directory, "t0-*")):
                os.remove(leftover)
            before = _folder(directory)
            process = fault_ranks.mp.get_context("spawn").Process(
                target=fault_ranks._entry,
                args=(0, 1, fault_ranks.free_port(), 30, directory, _save, (directory, numel, 2, True)),
            )
            process.start()
            while not glob.glob(os.path.join(directory, "t0-*")) and process.is_alive():
                time.sleep(0.0005)
            if point != "at start":
                while _folder(directory) == before and process.is_alive():
                    pass  # polled without sleeping: the write lasts milliseconds
                time.sleep(point)
            label = point if point == "at start" else f"{point * 1000:g} ms into the write"
            if process.is_alive():  # else the save ended before this delay: the new one is whole
                os.kill(process.pid, signal.SIGKILL)
            process.join()
            ended = fault_ranks.ending_in(directory, 0)
            if ended is not None and ended.status != RETURNED:  # the save itself failed: no kill tested
                lost.append(f"{label}: the save failed: {ended.error}")
                continue
            (ending,) = _load_ending(directory, numel)
            if ending.status == RETURNED and ending.value in (1, 2):
                kept.append(f"{label}: {'previous' if ending.value == 1 else 'new'}")
            else:
                lost.append(f"{label}: {ending.error or ending.status}")
    outcome = KEPT if not lost else LOST
    detail = "; ".join(lost[:2] or kept)
    return Row(
        "save killed while writing",
        f"SIGKILL at {len(KILL_POINTS)} points of a {numel * 4 >> 20} MB save",
        KEPT,
        outcome,
        None,
        detail,
    )


class _Crafted:
    """A pickle that creates ``marker`` when unpickled (any code could run there)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _expect_refusal(directory: str, numel: int, path: str, world_size: int = 1, marker: str | None = None):
    endings = _load_ending(directory, numel, world_size)[:1]  # rank 0's file is the bad one
    if marker is not None and os.path.exists(marker):
        return CODE_RAN, endings[0].error or "the crafted object was built"
    outcome, _, detail = every_rank_raises(endings, time.time())
    if outcome == SILENT:
        return SILENT, "loaded"
    if outcome == RAISED_EVERYWHERE:
        named = all(os.path.basename(path) in e.error for e in endings)
        return (REFUSED if named else UNCLEAR), detail
    return outcome, detail


def bad_file(kind: str, numel: int = 4096) -> Row:
    with tempfile.TemporaryDirectory() as directory:
        world_size = 2 if kind == "another rank's file" else 1
        fault_ranks.run(_save, world_size, (directory, numel, 2, False), 120)
        path = os.path.join(directory, "gradcomp_rank0.pt")
        marker = None
        if kind == "crafted (runs code)":
            marker = os.path.join(directory, "code-ran")
            torch.save({"world_size": 1, "state": _Crafted(marker)}, path)
        elif kind == "truncated":
            with open(path, "r+b") as file:
                file.truncate(os.path.getsize(path) // 2)
        elif kind == "residuals hold NaN":
            saved = torch.load(path, weights_only=False)  # the attacker's side, not gradcomp's
            _fill(saved, float("nan"))
            torch.save(saved, path)
        elif kind == "another rank's file":
            shutil.copy(os.path.join(directory, "gradcomp_rank1.pt"), path)
        outcome, detail = _expect_refusal(directory, numel, path, world_size, marker)
    promise = "refused, no code run" if marker else f"{REFUSED}"
    if outcome == RAISED_EVERYWHERE:
        outcome = REFUSED
    return Row(f"checkpoint file: {kind}", f"gradcomp_rank0.pt {kind}", promise, outcome, None, detail[:160])


def _fill(value, number: float) -> None:
    """Every floating tensor in a saved state set to ``number``."""
    if isinstance(value, torch.Tensor) and value.is_floating_point():
        value.fill_(number)
    elif isinstance(value, dict):
        for item in value.values():
            _fill(item, number)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _fill(item, number)


def _dcp(rank, world_size, directory, numel, save, mismatch):
    import torch.distributed.checkpoint as dcp

    state = _hook_state(numel, 2 if save else 0)
    everything = {"gradcomp": gradcomp.ddp.Checkpointable(state, mismatch=mismatch)}
    if save:
        dcp.save(everything, checkpoint_id=directory)
        return state.step
    with warnings.catch_warnings(record=True) as caught, logged_warnings() as logged:
        warnings.simplefilter("always")
        dcp.load(everything, checkpoint_id=directory)
    return {"step": state.step, "warned": bool(caught or logged)}


def dcp_world_change(mismatch: str, numel: int = 4096) -> Row:
    with tempfile.TemporaryDirectory() as directory:
        fault_ranks.run(_dcp, 2, (directory, numel, True, mismatch), 120)
        endings = fault_ranks.run(_dcp, 3, (directory, numel, False, mismatch), 120)
    if mismatch == "raise":
        outcome, _, detail = every_rank_raises(endings, time.time())
        promise = RAISED_EVERYWHERE
    else:
        promise = DROPPED
        done = [e.value for e in endings if e.status == RETURNED]
        outcome, _, detail = every_rank_raises(endings, time.time())
        if len(done) == len(endings):
            good = all(v["warned"] and v["step"] == 2 for v in done)
            outcome, detail = (DROPPED, "") if good else (SILENT, f"{done}")
        elif outcome == RAISED_EVERYWHERE:
            outcome = UNCLEAR  # raised where the user asked for a drop
    return Row(
        f"DCP checkpoint of 2 ranks loaded on 3, mismatch={mismatch!r}",
        "world size changed",
        promise,
        outcome,
        None,
        detail[:160],
    )


# ----------------------------------------------------------------------------- payloads decoded wrongly


def _decoding(make, decode) -> str:
    """How one wrong decode ends: ``refused`` (a ValueError), ``silent`` or ``unclear`` (another error)."""
    try:
        decode(make())
    except ValueError:
        return "refused"
    except Exception as error:  # noqa: BLE001 - the kind of error is what is measured
        return f"unclear ({type(error).__name__})"
    return "silent"


def _decode_row(case: str, fault: str, results: dict[str, str]) -> Row:
    counts: dict[str, int] = {}
    for verdict in results.values():
        kind = verdict.split(" ")[0]
        counts[kind] = counts.get(kind, 0) + 1
    outcome = SILENT if counts.get("silent") else UNCLEAR if counts.get("unclear") else REFUSED
    if outcome == REFUSED:
        outcome = RAISED_EVERYWHERE
    examples = [f"{k}: {v}" for k, v in results.items() if v != "refused"][:3]
    detail = ", ".join(f"{n} {kind}" for kind, n in sorted(counts.items())) + (
        f" ({'; '.join(examples)})" if examples else ""
    )
    return Row(case, fault, RAISED_EVERYWHERE, outcome, None, detail)


def other_compressor() -> Row:
    names = [n for n in gradcomp.COMPRESSORS if n not in ("none", "powersgd")]
    specs = [*names, "topk@0.05", "randk@0.05", "int4:block=64"]
    x = torch.arange(4096, dtype=torch.float32).cos()
    results = {}
    for made in specs:
        for decoder in specs:
            if made.split("@")[0] == decoder.split("@")[0] and made == decoder:
                continue
            a, b = gradcomp.get_compressor(made), gradcomp.get_compressor(decoder)
            results[f"{made}->{decoder}"] = _decoding(lambda a=a: a.compress(x.clone()), b.decompress)
    return _decode_row("payload decoded by another compressor", f"{len(results)} pairs", results)


def other_shape() -> Row:
    results = {}
    for name in ("int8", "int4", "qsgd", "sign", "topk@0.05", "randk@0.05", "bf16", "ternary"):
        c = gradcomp.get_compressor(name)
        x = torch.arange(4096, dtype=torch.float32).sin().view(64, 64)
        for shape in ((4095,), (8192,)):
            made = c.compress(x.clone())
            results[f"{name} into {shape}"] = _decoding(
                lambda made=made: made, lambda p, c=c, s=shape: c.decompress(p, out=torch.empty(s))
            )
            results[f"{name} as {shape}"] = _decoding(
                lambda made=made, s=shape: dataclasses.replace(made, shape=torch.Size(s)), c.decompress
            )
    return _decode_row("payload decoded with another shape", f"{len(results)} decodes", results)
