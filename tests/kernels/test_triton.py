"""The Triton backend beyond parity (``test_parity.py``): how its ops run in the
library, and the results of collectives and the DDP hook on it.

Without a GPU, Triton runs in its interpreter on CPU tensors (``conftest.py``).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.utils import assert_same, backend_device, seeded_randn

pytest.importorskip("triton")

import gradcomp  # noqa: E402
from gradcomp.compressors import Context  # noqa: E402
from gradcomp.ops import index_cache  # noqa: E402
from gradcomp.ops import triton_backend as triton_ops  # noqa: E402

DEVICE = backend_device("triton")


def randn(numel: int, seed: int) -> torch.Tensor:
    return seeded_randn(numel, seed, device=DEVICE)


def test_randk_decodes_with_the_index_kernel_it_encoded_with(monkeypatch):
    """On a GPU random-K's decode takes its indices from the Triton kernel, not
    from the reference's walk (a loop of small ops with a host sync per
    round), and reuses the ones its encode computed."""
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    monkeypatch.setattr(index_cache, "_recent", {})
    kernel, launches = gradcomp.kernels.randk_indices, []
    monkeypatch.setattr(gradcomp.kernels, "randk_indices", lambda *a: launches.append(a) or kernel(*a))

    def no_walk(*args):
        raise AssertionError("the reference walked")

    monkeypatch.setattr(gradcomp.ops.reference_sparse, "feistel_permute", no_walk)
    compressor = gradcomp.get_compressor("randk", ratio=0.02)
    x = randn(3000, seed=22)
    payload = compressor.compress(x, Context(residual=torch.zeros(3000, device=DEVICE), step=5, key=2))
    decoded = compressor.decompress(payload)
    assert len(launches) == 1
    picked = triton_ops.randk_indices(3000, 60, payload.meta["seed"], DEVICE)
    assert len(launches) == 1
    expected = torch.zeros(3000, device=DEVICE)
    expected[picked] = x[picked]
    assert_same(expected, decoded)


def test_forcing_triton_on_a_device_it_cannot_run_on_raises(monkeypatch):
    monkeypatch.setenv("GRADCOMP_BACKEND", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: Triton runs on CUDA tensors")
    with pytest.raises(RuntimeError, match="cannot run on cpu"):
        gradcomp.get_compressor("int8").compress(torch.randn(10))


def _backends_agree_on_ranks(rank: int, world_size: int) -> None:
    import os

    from gradcomp.ddp import register
    from tests.ddp.models import DDP, flat_parameters, make_model, train
    from tests.utils import same_on_all_ranks

    results = {}
    for backend in ("torch", "cpu", "triton"):
        os.environ["GRADCOMP_BACKEND"] = backend
        for name in ("int8", "int4", "topk", "randk", "sign", "mxfp8", "mxfp4", "nvfp4"):
            for algorithm in ("allgather", "two_phase", "dense"):
                compressor = gradcomp.get_compressor(name)
                try:
                    gradcomp.collectives.check_algorithm(compressor, algorithm)
                except ValueError:
                    continue
                x = randn(3000, seed=rank)
                memory = gradcomp.ErrorFeedback()
                for step in range(2):
                    gradcomp.all_reduce(
                        x, compressor, algorithm=algorithm, feedback=memory, name="t", step=step
                    )
                results[backend, name, algorithm] = x
        for name in ("int8", "topk", "mxfp8", "mxfp4", "nvfp4"):
            model = DDP(make_model(), bucket_cap_mb=0.02)
            register(model, name, min_numel=0)
            train(model, rank, world_size, 3)
            results[backend, name, "ddp"] = flat_parameters(model)
    del os.environ["GRADCOMP_BACKEND"]
    for (backend, name, algorithm), value in results.items():
        if backend != "torch":
            reference = results["torch", name, algorithm]
            assert same_on_all_ranks(value), (backend, name, algorithm)
            if backend == "triton" and name == "sign":  # block sums in another order: a few ulp a step
                torch.testing.assert_close(value, reference, rtol=1e-5, atol=1e-6)
            else:
                assert torch.equal(value, reference), (backend, name, algorithm)


@pytest.mark.slow
def test_collectives_and_ddp_hook_on_the_cpu_and_triton_backends_agree_with_the_reference():
    from tests.utils import run_ranks

    run_ranks(_backends_agree_on_ranks, 2, timeout=600)


class _FullSizeOps(TorchDispatchMode):
    """Records the aten ops (not views) that take a tensor of at least ``numel`` elements,
    outside the kernels (Triton's interpreter copies their arguments)."""

    def __init__(self, numel: int, counts):
        super().__init__()
        self.numel, self.counts, self.ops = numel, counts, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [a for a in (*args, *(kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        outside = self.counts.counting()
        if outside and not func.is_view and any(t.numel() >= self.numel for t in tensors):
            self.ops.append(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@pytest.mark.slow
def test_topk_passes_once_over_the_tensor_and_launches_as_many_kernels_at_any_size():
    """The sampling Top-K (kernels/topk.py): of its kernels only the mark kernel reads the
    whole tensor (the gather reads the candidates' lanes), every aten op that takes a
    tensor of its size gathers the sample or adds back at the candidates, nothing
    waits on the device, and the launches do not grow with the size."""
    from tests.counting import counted

    launches = []
    for numel in (200_000, 300_001):  # past the sample (80 k elements at k = 1%)
        k = numel // 100
        x, residual = randn(numel, seed=30), randn(numel, seed=31) * 0.1
        with counted() as counts, _FullSizeOps(numel, counts) as full:
            counts.active = True
            triton_ops.topk_select(x, k, residual, seed=3)
        assert not counts.syncs, counts.summary()
        kernels = {name: n for name, n in counts.launches.items() if name.startswith("triton ")}
        assert kernels == {
            "triton _mark_candidates_kernel": 1,
            "triton _gather_candidates_kernel": 1,
            "triton _key_histogram_kernel": 3,
            "triton _choose_digit_kernel": 3,
            "triton _write_back_kernel": 1,
        }, counts.summary()
        assert set(full.ops) <= {"aten.index_select", "aten.index_add_"}, full.ops
        launches.append(counts.total_launches)
    assert launches[0] == launches[1], launches
