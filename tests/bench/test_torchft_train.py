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


@pytest.mark.slow
def test_torchft_train_diloco_smoke(tmp_path):
    args = ["--steps", "6", "--compressors", "--kill", "", "--quantize-attempts", "0", "--init-steps", "2"]
    args += ["--sync-every", "2", "--kill-at", "0.5", "--rejoin-after", "1", "--corpus-bytes", "256000"]
    run_script("torchft_train.py", *args, "--suffix=-diloco", "--out", str(tmp_path))
    with open(os.path.join(tmp_path, f"{stem('torchft_train')}-diloco.json")) as file:
        document = json.load(file)
    dense, torchft, gradcomp, torchft_step, killed = document["records"]
    assert document["start"]["curve"][-1][0] == 2  # every run from 2 dense steps
    # 3 exchanges of the fp32 parameters: half the bytes of 6 dense steps; int4 about 8x fewer.
    assert [r["committed"] for r in (torchft, gradcomp, torchft_step)] == [[3, 3]] * 3
    assert torchft["ratio"] == 2.0 and 12 < gradcomp["ratio"] < 16
    assert gradcomp["loss_vs_torchft_diloco"] is not None and "loss_vs_torchft_diloco" not in dense
    # Killed inside the exchange at step 4: the survivor discards it; the restarted replica
    # heals into the last exchange.
    assert killed["killed"]["survivor_discarded"] == [4] and killed["killed"]["restarted_healed"]
    assert killed["committed"] == [2, 2] and killed["discarded"] == [1, 0]
    assert all(r["weights_equal"] for r in document["records"])
