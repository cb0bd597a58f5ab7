"""The fault matrix (bench/faults.py): its cases keep their promises, and the script reports them."""

from __future__ import annotations

import importlib
import json

import pytest

from tests.bench.smoke import run_script, stem

files = importlib.import_module("lib.fault_files")  # bench/ is on sys.path (tests.bench.smoke)
ranks = importlib.import_module("lib.fault_ranks")


def test_wrong_decodes_are_refused():
    for row in (files.other_compressor(), files.other_shape()):
        assert row.outcome == ranks.RAISED_EVERYWHERE, row


@pytest.mark.slow
def test_a_crafted_checkpoint_runs_no_code():
    row = files.bad_file("crafted (runs code)")
    assert row.outcome == ranks.REFUSED, row


@pytest.mark.slow
def test_every_promise_holds(tmp_path):
    # The whole matrix: dead and stalled peers, killed saves, disagreeing ranks, bad
    # files and payloads, DCP across world sizes, uneven DiLoCo, NaN gradients, shared memory.
    result = run_script("faults.py", "--out", str(tmp_path), timeout=1200, check=False)
    with open(tmp_path / f"{stem('faults', 4)}.json") as file:
        document = json.load(file)
    broken = [r for r in document["records"] if r["outcome"] not in ranks.SAFE]
    assert not broken, result.stdout
    assert result.returncode == 0
    assert set(document["broken"]) == set(ranks.BROKEN) and not any(document["broken"].values())
