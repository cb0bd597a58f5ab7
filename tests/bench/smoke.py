"""What the bench scripts' smoke tests share: the scripts' folder on sys.path (and
bench/lib's modules), running a script, reading its result files."""

from __future__ import annotations

import csv
import importlib
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)
cluster = importlib.import_module("lib.cluster")
link = importlib.import_module("lib.link")
machine = importlib.import_module("lib.machine")
spawning = importlib.import_module("lib.spawning")
specs = importlib.import_module("lib.specs")

MACHINE_COLUMNS = {"machine", "cpus", "cpu_model", "gpu", "torch", "world_size", "backend", "link"}
LOAD_COLUMNS = {"load_start", "load_end"}
TINY_MODEL = ["--features", "32", "--width", "64", "--steps", "3", "--warmup-steps", "2"]
# The GPT of the scripts that time its training steps (fsdp_train.py, diloco_train.py), tiny.
TINY_GPT = ["--layers", "1", "--width", "64", "--heads", "2", "--context", "32", "--corpus-bytes", "256K"]


def run_script(
    name: str, *args: str, timeout: float = 300, check: bool = True
) -> subprocess.CompletedProcess:
    # The timeout catches a hang: the smoke runs take up to about a minute on 2 idle cores,
    # twice that and more when the machine is busy.
    result = subprocess.run(
        [sys.executable, os.path.join(BENCH, name), *args], capture_output=True, timeout=timeout, cwd=ROOT
    )
    # Decoded by hand: text mode would turn the progress line's carriage returns into newlines.
    result.stdout, result.stderr = result.stdout.decode(), result.stderr.decode()
    if check:
        assert result.returncode == 0, f"{name} failed:\n{result.stdout}\n{result.stderr}"
    return result


def read_results(directory, stem: str) -> tuple[list[dict], dict]:
    with open(os.path.join(directory, f"{stem}.csv")) as file:
        rows = list(csv.DictReader(file))
    with open(os.path.join(directory, f"{stem}.json")) as file:
        document = json.load(file)
    assert os.path.getsize(os.path.join(directory, f"{stem}.png")) > 1000
    assert MACHINE_COLUMNS | LOAD_COLUMNS <= set(rows[0])
    assert document["machine"]["cpus"] == os.cpu_count()
    assert len(document["load_start"]) == len(document["load_end"]) == 3
    return rows, document


def stem(benchmark: str, world_size: int = 2) -> str:
    return f"{benchmark}-{machine.machine_kind()}-w{world_size}"


def run_smoke(script: str, args: list[str], out, target: str) -> tuple[list[dict], dict]:
    """Run bench ``script`` on 2 ranks writing into ``out``: it prints ``target`` as a
    target line; its results."""
    result = run_script(script, *args, "--out", str(out))
    assert f"target: {target}" in result.stdout
    return read_results(out, stem(script.removesuffix(".py")))
