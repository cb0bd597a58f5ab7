"""Test session setup.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the
interpreter is chosen when a kernel is defined, so it is switched on here,
before anything imports ``gradcomp.kernels``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture
def misjudge_threshold(monkeypatch):
    """``misjudge_threshold(k, factor)``: the sampled Top-K threshold for ``k``
    comes out ``factor`` times too high; a second pass's (another reach) does not."""
    from gradcomp.ops import reference

    original = reference.threshold_from_sample

    def misjudge(k: int, factor: float) -> None:
        def misjudged(sample, wanted, numel):
            return original(sample, wanted, numel) * (factor if wanted == k else 1.0)

        monkeypatch.setattr(reference, "threshold_from_sample", misjudged)

    return misjudge
