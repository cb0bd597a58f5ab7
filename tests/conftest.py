"""Test session setup.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the
interpreter is chosen when a kernel is defined, so it is switched on here,
before anything imports ``gradcomp.kernels``.
"""

import os

import pytest
import torch

# torch's CPU math through MKL (sqrt in AdamW's denominator, for one) is not the
# same from run to run without conditional numerical reproducibility: a fresh
# process on a busy machine now and then takes a path with about 12 correct bits
# (seen in plain torch, without gradcomp). The suite compares runs bit for bit,
# across processes too (spawned ranks inherit this). MKL reads it at its first
# call: importing torch makes none, torch.set_num_threads below makes one.
os.environ.setdefault("MKL_CBWR", "COMPATIBLE")

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One torch thread, as each spawned rank has (gradcomp.spawn): the tests' tensors are
# small, and on a machine that other processes keep busy, OpenMP's threads wait for
# cores at every op; the tests' results do not depend on the number of threads.
torch.set_num_threads(1)


@pytest.fixture
def misjudge_threshold(monkeypatch):
    """``misjudge_threshold(change)``: Top-K's sampled threshold ``t`` comes out as ``change(t)``."""
    from gradcomp.ops import reference_sparse

    original = reference_sparse.threshold_from_sample

    def misjudge(change) -> None:
        patched = lambda *args: change(original(*args))  # noqa: E731
        monkeypatch.setattr(reference_sparse, "threshold_from_sample", patched)

    return misjudge
