"""What the tests share: inputs, bit-exact comparisons, backends and devices, ranks.

Tolerances used by the tests:

* Deterministic maps (packing, round-to-nearest quantization and decoding,
  selections) are compared bit for bit, NaN equal to NaN, the sign of zero
  included (:func:`assert_same`).
* Block sums in another order than torch's (sign scales, QSGD norms on a
  GPU backend) are within a few ulp.
* Error-feedback conservation ``decoded + residual_new == x + residual_old``
  is exact for the selection ops (values are copied, never recomputed) and
  holds within fp32 rounding for the quantizers: with ``y = x + residual_old``
  and ``d`` the decoded value, the residual is ``fl(y - d)`` and the sum
  ``fl(d + fl(y - d))`` differs from ``y`` by at most ``u (|y| + |y - d|)``,
  ``u = 2**-24``; we allow ``eps32 * (|y| + |d|)`` with ``eps32 = 2**-23``.
* Unbiasedness is checked against the exact per-element variance of the
  estimator: every element's mean over ``T`` independent seeds must lie within
  5 standard errors of the input, and the mean squared z-score must be close
  to 1 (a chi-square check that also catches a too-small spread).
* Triton's CPU interpreter converts fp32 to bfloat16 by truncation, where a
  GPU rounds to nearest even like torch: under the interpreter, values a
  kernel stores as bfloat16 may differ by one bfloat16 step.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.distributed as dist

from gradcomp import ops, spawn

EPS32 = torch.finfo(torch.float32).eps
DTYPES = (torch.float32, torch.float16, torch.bfloat16)
HAS_GPU = torch.cuda.is_available()
HAS_TRITON = importlib.util.find_spec("triton") is not None
HAS_CUPY = importlib.util.find_spec("cupy") is not None
INTERPRETED = not HAS_GPU
REFERENCE = ops.backend("torch")  # the reference, arguments checked


# ----------------------------------------------------------------------------- inputs


def seeded_randn(shape, seed: int, dtype: torch.dtype = torch.float32, device="cpu") -> torch.Tensor:
    """Standard normal values from their own generator (the global RNG is untouched)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (shape,) if isinstance(shape, int) else shape
    return torch.randn(shape, generator=generator).to(dtype).to(device)


def block_view(flat: torch.Tensor, block: int) -> torch.Tensor:
    """``flat`` zero-padded to whole blocks, shaped ``(blocks, block)``."""
    pad = (-flat.numel()) % block
    return torch.nn.functional.pad(flat, (0, pad)).view(-1, block)


# ----------------------------------------------------------------------------- comparisons


def mismatch(expected: torch.Tensor, actual: torch.Tensor) -> str:
    """Where two tensors differ: how many, and the first few pairs."""
    expected, actual = expected.cpu(), actual.cpu()
    differ = (expected != actual) & ~(expected.isnan() & actual.isnan())
    where = torch.nonzero(differ).reshape(-1)[:5].tolist()
    return f"{int(differ.sum())} of {expected.numel()} differ, first at {where}: " + ", ".join(
        f"{expected[i].item()} vs {actual[i].item()}" for i in where
    )


def assert_same(
    expected: torch.Tensor,
    actual: torch.Tensor,
    bf16_stored: bool = False,
    magnitude: torch.Tensor | None = None,
) -> None:
    """Same dtype, shape and values bit for bit, NaN equal to NaN, the sign of zero
    included. ``bf16_stored``: values a Triton kernel stored as bfloat16; under the
    interpreter within two bfloat16 steps of ``magnitude`` (default: the values')."""
    assert expected.dtype == actual.dtype, (expected.dtype, actual.dtype)
    assert expected.shape == actual.shape, (expected.shape, actual.shape)
    expected, actual = expected.cpu(), actual.cpu()
    if bf16_stored and INTERPRETED:
        magnitude = expected.abs() if magnitude is None else magnitude.cpu()
        step = magnitude.float() * 2**-6 + 1e-30
        assert ((expected.float() - actual.float()).abs() <= step).all(), mismatch(expected, actual)
        return
    if expected.is_floating_point():
        same = torch.equal(expected.isnan(), actual.isnan()) and torch.equal(
            expected.nan_to_num(), actual.nan_to_num()
        )
        same = same and torch.equal(torch.signbit(expected.nan_to_num()), torch.signbit(actual.nan_to_num()))
    else:
        same = torch.equal(expected, actual)
    assert same, mismatch(expected, actual)


def assert_conserved(decoded: torch.Tensor, new_residual: torch.Tensor, y: torch.Tensor, exact: bool) -> None:
    """``decoded + new_residual == y`` (flattened; exactly, or within the fp32 bound above)."""
    decoded, new_residual, y = decoded.float().reshape(-1), new_residual.float().reshape(-1), y.reshape(-1)
    total = decoded + new_residual
    if exact:
        assert torch.equal(total, y), f"max |error| {(total - y).abs().max().item():.3e}"
        return
    bound = EPS32 * (y.abs() + decoded.abs())
    excess = (total - y).abs() - bound
    assert (excess <= 0).all(), f"worst excess over the fp32 bound: {excess.max().item():.3e}"


def assert_unbiased(mean: torch.Tensor, target: torch.Tensor, variance: torch.Tensor, trials: int) -> None:
    """Per-element 5-sigma bound plus a chi-square check on the z-scores."""
    standard_error = torch.sqrt(variance / trials)
    # Elements with (nearly) zero variance must be (nearly) exact; the slack
    # covers fp32 rounding of level * scale.
    slack = 8 * EPS32 * target.abs().clamp_min(1e-30)
    error = (mean - target).abs()
    assert (error <= 5 * standard_error + slack).all(), (
        f"max |mean - x| / SE = {(error / (standard_error + slack)).max().item():.2f}"
    )
    varying = standard_error > 1e-6
    assert varying.sum() >= 50, "too few random elements for the chi-square check"
    mean_square_z = ((mean - target)[varying] / standard_error[varying]).pow(2).mean().item()
    count = int(varying.sum())
    # chi-square with `count` degrees of freedom, divided by count: mean 1, sd sqrt(2 / count).
    assert abs(mean_square_z - 1) < 6 * math.sqrt(2 / count), mean_square_z


# ----------------------------------------------------------------------------- backends


def backend_device(backend: str) -> torch.device:
    """Where a backend's tensors live in the tests: Triton on the GPU, or on CPU
    tensors in its interpreter without one; the CUDA backend on the GPU."""
    if backend == "cpu" or (backend == "triton" and not HAS_GPU):
        return torch.device("cpu")
    return torch.device("cuda")


def backend_params() -> list:
    """``cpu``, ``triton`` and ``cuda`` as pytest params, each skipped, saying why,
    where it cannot run; the GPU ones marked ``gpu``, Triton in its interpreter ``slow``."""
    return [
        pytest.param("cpu", id="cpu"),
        pytest.param(
            "triton",
            id="triton",
            # Its interpreter takes seconds a kernel: outside the fast tier there.
            marks=[
                pytest.mark.skipif(not HAS_TRITON, reason="needs triton"),
                *([pytest.mark.slow] * INTERPRETED),
            ],
        ),
        pytest.param(
            "cuda",
            id="cuda",
            marks=[
                pytest.mark.gpu,
                pytest.mark.skipif(not HAS_GPU, reason="needs a CUDA GPU"),
                pytest.mark.skipif(not HAS_CUPY, reason="needs CuPy (pip install 'gradcomp[cuda]')"),
            ],
        ),
    ]


def provides(backend: str, op: str) -> bool:
    """Whether ``backend`` implements ``op`` itself."""
    return op in ops.functions(backend)


# ----------------------------------------------------------------------------- ranks


def run_ranks(body, world_size: int, *args, timeout: float = 240.0, group_timeout: float = 60.0):
    """``body(rank, world_size, *args)`` on ``world_size`` Gloo ranks; a rank that
    fails fails the test with its traceback, a hang fails it after ``timeout``."""
    return spawn.run_ranks(body, world_size, *args, timeout=timeout, group_timeout=group_timeout)


def same_on_all_ranks(tensor: torch.Tensor) -> bool:
    """Whether every rank holds exactly these bits."""
    reference = tensor.detach().clone()
    dist.broadcast(reference, 0)
    mine = torch.tensor([int(torch.equal(reference, tensor))])
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    return bool(mine.item())


def gather(tensor: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's copy of ``tensor`` (same shape on all ranks), in rank order."""
    pieces = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, tensor.contiguous())
    return pieces


def trained_diloco(rank: int, steps: int, compressor: str = "int4", fragments: int = 1):
    """A small MLP under DiLoCo (AdamW inside, H = 2) trained ``steps`` steps on this rank's batches."""
    import gradcomp  # the package imports nothing of the tests

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 2))
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = gradcomp.DiLoCo(model, inner, sync_every=2, compressor=compressor, fragments=fragments)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(16, 8, generator=generator), torch.randn(16, 2, generator=generator)
        torch.nn.functional.mse_loss(model(x), y).backward()
        inner.step()
        inner.zero_grad()
        outer.step()
    return outer
