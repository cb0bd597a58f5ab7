"""The machine a result was measured on: CPUs, GPU, torch, gradcomp's revision, the load.

Example:
    >>> facts = machine(2, "gloo")
    >>> facts["kind"], facts["world_size"]
    ('cpu2', 2)
"""

from __future__ import annotations

import os
import re
import subprocess

import torch

import gradcomp
from lib import link

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo (``"unknown"`` elsewhere)."""
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def gpu_name() -> str | None:
    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine_kind() -> str:
    """A short name for file names: ``cpu2`` (2 CPUs, no GPU) or ``8xnvidia-h200``."""
    if torch.cuda.is_available():
        slug = re.sub(r"[^a-z0-9]+", "-", gpu_name().lower()).strip("-")
        return f"{torch.cuda.device_count()}x{slug}"
    return f"cpu{os.cpu_count()}"


def machine(world_size: int, backend: str) -> dict:
    """The facts every result record carries."""
    limit = link.link_info()
    gpu = gpu_name()
    summary = (
        f"{os.cpu_count()} CPUs ({cpu_model()}), {gpu or 'no GPU'}, torch {torch.__version__}, "
        f"{world_size} {backend} ranks" + (f", link {limit['rate']} a rank" if limit else "")
    )
    return {
        "machine": summary,
        "kind": machine_kind(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu_model(),
        "gpu": gpu or "",
        "torch": torch.__version__,
        "gradcomp": gradcomp.__version__,
        "revision": source_revision(),
        "world_size": world_size,
        "backend": backend,
        "link": link.describe(limit) if limit else "unlimited",
    }


def source_revision() -> str:
    """The git commit of the checkout the bench runs from (``-dirty`` with local changes), or ``""``."""
    try:
        commit = subprocess.run(
            ["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", ROOT, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""
    return f"{commit}-dirty" if commit and dirty else commit


def loadavg() -> list[float]:
    """The load average over 1, 5 and 15 minutes."""
    return [round(value, 2) for value in os.getloadavg()]
