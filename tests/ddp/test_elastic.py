"""Elastic restart: a rank killed mid-run, torchrun restarts the job, and the
compressed run resumes from its checkpoint and ends where an uninterrupted one ends."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    "examples",
    "elastic_train.py",
)


def _torchrun(directory, *args: str) -> str:
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    command += ["--max-restarts", "2", SCRIPT, "--dir", str(directory), "--steps", "30", *args]
    done = subprocess.run(command, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done.stdout + done.stderr


@pytest.mark.slow
def test_a_killed_rank_restarts_and_the_run_ends_as_an_uninterrupted_one(tmp_path):
    _torchrun(tmp_path / "straight")
    output = _torchrun(tmp_path / "killed", "--kill-rank", "1", "--kill-at-step", "15")
    assert "resumed from step 10" in output
    with open(tmp_path / "straight" / "result.json") as file:
        straight = json.load(file)
    with open(tmp_path / "killed" / "result.json") as file:
        killed = json.load(file)
    assert killed == straight and straight["step"] == 30
