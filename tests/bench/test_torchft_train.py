"""Smoke test of bench/torchft_train.py: a few steps of every run on 2 torchft replica groups,
one of them killed and restarted, and torchft's quantized all-reduce refused on a CPU."""

from __future__ import annotations

import json
import os

import pytest

from tests.bench.smoke import run_script, stem

pytest.importorskip("torchft", reason="torchft has wheels for Linux x86-64 only")


@pytest.mark.slow
def test_torchft_train_smoke(tmp_path):
    args = ["--steps", "6", "--compressors", "int8", "--kill", "int8", "--kill-at", "0.5"]
    args += ["--rejoin-after", "1", "--quantize-attempts", "1", "--corpus-bytes", "256000"]
    result = run_script("torchft_train.py", *args, "--out", str(tmp_path))
    assert "target: gradcomp int8, replica 1 killed at step 3" in result.stdout
    with open(os.path.join(tmp_path, f"{stem('torchft_train')}.json")) as file:
        document = json.load(file)
    dense, int8, killed, quantized = document["records"]
    assert [r["committed"] for r in (dense, int8)] == [[6, 6], [6, 6]]
    assert dense["ratio"] == 1.0 and 3.5 < int8["ratio"] < 4.1
    assert dense["bytes_per_step"] == 4 * dense["parameters"]  # the ring's 2 (W-1)/W at W = 2
    # The survivor discards the step its peer died in, commits the next one alone, then both go on.
    assert killed["committed"][0] == 6 and killed["killed"]["survivor_discarded"] == [3]
    assert killed["killed"]["alone"] == [3] and killed["killed"]["restarted_healed"]
    assert all(r["weights_equal"] for r in (dense, int8, killed))
    assert quantized["committed"] == [0, 0] and quantized["discarded"] == [1, 1]
    assert "accelerator" in quantized["errors"][0]
