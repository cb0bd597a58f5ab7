"""Every Triton kernel compiles for sm_80 and sm_90 with Triton's own compiler.

The interpreter (what the parity tests use on CPU) accepts code the compiler
refuses, so this runs :mod:`kernel_compile` in fresh processes, without
``TRITON_INTERPRET``, one per architecture, each with an empty kernel cache.
Kernels that must match torch bit for bit (launched with
``enable_fp_fusion=False``) must also contain no instruction that rounds
otherwise: no fused multiply-add, no flushed subnormals, no approximations.
No kernel multiplies a row stride in 32 bits: a row index times a stride
that fits 32 bits passes 2**31 in a gathered buffer of 2 GiB.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("kernel_compile.py")


def compile_records(
    arches: tuple[int, ...], every: int = 1, only: tuple[str, ...] = ()
) -> tuple[list[str], list[dict]]:
    """(kernels defined, one record per compiled specialization), one process per arch;
    ``only``: these launchers' cases alone (and the controls)."""
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    environment.pop("TRITON_CACHE_DIR", None)

    def run(arch: int) -> list[dict]:
        command = [sys.executable, str(SCRIPT), "--arch", str(arch), "--every", str(every)]
        command += ["--only", *only] if only else []
        result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=900)
        lines = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
        assert lines, f"no output (exit {result.returncode}):\n{result.stderr[-3000:]}"
        return lines

    with ThreadPoolExecutor(len(arches)) as pool:
        outputs = list(pool.map(run, arches))
    defined = outputs[0][0]["defined_kernels"]
    return defined, [record for lines in outputs for record in lines[1:]]


def check(defined: list[str], records: list[dict]) -> None:
    compiled = {r["kernel"] for r in records}
    assert set(defined) <= compiled, f"kernels no case compiles: {sorted(set(defined) - compiled)}"
    check_compiled(records)


def check_compiled(records: list[dict]) -> None:
    """Every record compiled, exact kernels round as torch does, no 32-bit row offsets,
    one specialization for every seed; the controls show that each check can fail."""
    failed = [
        f"{r['case']} / {r['kernel']} (sm_{r['target']}):\n{r['error']}" for r in records if "error" in r
    ]
    assert not failed, f"{len(failed)} specializations failed to compile; the first:\n" + failed[0]
    control = {r["case"]: r for r in records if r["case"].startswith("control") and not r["wide"]}
    assert control["control fused"]["fma"] > 0, "the PTX check cannot see a fused multiply-add"
    assert control["control exact"]["fma"] == 0
    assert control["control divide"]["approximate"] > 0, "the PTX check cannot see div.full.f32"
    assert control["control divide rounded"]["approximate"] == 0
    assert control["control narrow rows"]["narrow_row_offsets"] > 0, "the IR check cannot see a 32-bit offset"
    assert control["control wide rows"]["narrow_row_offsets"] == 0
    narrow = [
        f"{r['case']} / {r['kernel']} (row_stride {r['signature']['row_stride']}): {r['narrow_row_offsets']}"
        for r in records
        if r.get("narrow_row_offsets") and not r["case"].startswith("control")
    ]
    assert not narrow, "kernels that multiply row_stride in 32 bits:\n" + "\n".join(narrow[:10])
    inexact = [
        f"{r['case']} / {r['kernel']}: fma {r['fma']}, ftz {r['ftz']}, approx {r['approximate']}"
        for r in records
        if not r["fp_fusion"]
        and not r["case"].startswith("control")
        and r["fma"] + r["ftz"] + r["approximate"]
    ]
    assert not inexact, "exact kernels with instructions that round otherwise:\n" + "\n".join(inexact[:10])
    seeded: dict[tuple, set] = {}
    for r in records:
        if " seeded " in r["case"]:
            group = (r["case"].split(" seeded ")[0], r["kernel"], r["wide"], r["target"])
            seeded.setdefault(group, set()).add(json.dumps([r["signature"], r["constants"], r["attrs"]]))
    again = [f"{group}: {len(kinds)} specializations" for group, kinds in seeded.items() if len(kinds) > 1]
    assert not again, "kernels compiled again for another seed (a step in training):\n" + "\n".join(again)


@pytest.mark.slow
def test_every_specialization_compiles_for_sm80_and_sm90():
    defined, records = compile_records((80, 90))
    check(defined, records)
    assert {r["target"] for r in records} == {80, 90}
    assert any(r["wide"] for r in records), "no 64-bit size was compiled"
    seeded = {r["kernel"] for r in records if " seeded " in r["case"]}
    assert seeded >= {"_quantize_kernel", "_randk_indices_kernel"}, seeded


@pytest.mark.slow
def test_first_case_of_each_launcher_compiles_with_64_bit_row_offsets():
    # One process, sm_90, the first case of every launcher: the decode-sum
    # loops (dequantize_sum, sign_decompress_sum) among them, with a 32-bit row_stride.
    defined, records = compile_records((90,), every=10**6)
    check(defined, records)
    launchers = ("dequantize_rows", "sign_rows")
    summed = {
        r["kernel"]
        for r in records
        if r["case"].split()[0] in launchers and r["signature"].get("row_stride") == "i32"
    }
    assert {"_dequantize_kernel", "_sign_decode_kernel"} <= summed, summed


@pytest.mark.slow
def test_sign_kernels_divide_as_the_reference_does_on_sm90():
    # The block's mean magnitude: Triton compiled `sum / count` to div.full.f32, an
    # approximation within 2 ulp of the reference's correctly rounded division.
    _, records = compile_records((90,), every=8, only=("sign", "sign_rows", "sign_decompress"))
    check_compiled(records)
    kernels = {r["kernel"] for r in records if not r["case"].startswith("control")}
    assert {"_sign_kernel", "_sign_decode_kernel"} <= kernels, kernels


@pytest.mark.slow
def test_block_scaled_kernels_compile_for_sm80_and_sm90_and_round_as_the_reference():
    # Their bits equal the reference's only without fused multiply-adds, flushed subnormals
    # (an E8M0 scale of 2**-127 is one) or approximate divisions (NVFP4's scales).
    launchers = ("block_scaled", "block_scaled_nvfp4", "block_scaled_decode", "block_scaled_rows")
    _, records = compile_records((80, 90), only=launchers)
    check_compiled(records)
    kernels = {r["kernel"] for r in records if not r["case"].startswith("control")}
    assert kernels == {
        "_mx_quantize_kernel",
        "_finite_peak_kernel",
        "_nvfp4_tensor_scale_kernel",
        "_nvfp4_quantize_kernel",
        "_decode_kernel",
    }, kernels
    assert {r["target"] for r in records} == {80, 90}
