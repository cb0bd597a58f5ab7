"""Test session setup.

Without a GPU, Triton kernels run in Triton's interpreter on CPU tensors; the
interpreter is chosen when a kernel is defined, so it is switched on here,
before anything imports ``gradcomp.kernels``.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
