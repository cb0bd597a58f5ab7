"""Kernel-level ops and backend dispatch.

Each op has one torch reference (:mod:`gradcomp.ops.reference`, backend
``torch``: plain, runs anywhere) and faster implementations: ``cpu``
(:mod:`gradcomp.ops.cpu_backend`), ``triton`` and ``cuda`` (GPU). Calling an
op here checks its arguments once (:mod:`gradcomp.ops.checks`), then runs the
first available backend in ``BACKEND_PREFERENCE`` (or the op's own order in
``OP_PREFERENCE``) that provides it for the tensors' device.
``GRADCOMP_BACKEND=torch|cpu|triton|cuda`` forces one backend; forcing a backend
that is not available, or that lacks the op, raises instead of silently falling
back.

Example:
    >>> from gradcomp import ops
    >>> q, scales = ops.quantize_blockwise(torch.randn(4096), bits=8, block=256)
"""

from __future__ import annotations

from gradcomp.ops import reference
from gradcomp.ops.dispatch import (
    BACKEND_PREFERENCE as BACKEND_PREFERENCE,  # for bench scripts and tests
)
from gradcomp.ops.dispatch import (
    BACKENDS as BACKENDS,  # for bench scripts and tests
)
from gradcomp.ops.dispatch import (
    OP_NAMES,
    Backend,
    _dispatching,
    backend,
    check_forced_backend,
    functions,
    implementation,
    register_backend,
    run_on,
    runs_on,
)
from gradcomp.ops.dispatch import (
    OP_PREFERENCE as OP_PREFERENCE,  # for bench scripts and tests
)
from gradcomp.ops.dispatch import (
    availability as availability,  # for bench scripts and tests
)
from gradcomp.ops.dispatch import (
    forced_backend as forced_backend,  # for bench scripts and tests
)
from gradcomp.ops.dispatch import (
    preference as preference,  # for bench scripts and tests
)

quantize_blockwise = _dispatching("quantize_blockwise")
dequantize_blockwise = _dispatching("dequantize_blockwise")
quantize_rows = _dispatching("quantize_rows")
dequantize_rows = _dispatching("dequantize_rows")
dequantize_sum = _dispatching("dequantize_sum")
sign_compress = _dispatching("sign_compress")
sign_decompress = _dispatching("sign_decompress")
sign_compress_rows = _dispatching("sign_compress_rows")
sign_decompress_rows = _dispatching("sign_decompress_rows")
sign_decompress_sum = _dispatching("sign_decompress_sum")
topk_select = _dispatching("topk_select")
randk_select = _dispatching("randk_select")
randk_indices = _dispatching("randk_indices")
scatter_add = _dispatching("scatter_add")
pack_bits = _dispatching("pack_bits")
unpack_bits = _dispatching("unpack_bits")
mx_quantize = _dispatching("mx_quantize")
mx_dequantize = _dispatching("mx_dequantize")
mx_dequantize_sum = _dispatching("mx_dequantize_sum")
nvfp4_quantize = _dispatching("nvfp4_quantize")
nvfp4_dequantize = _dispatching("nvfp4_dequantize")
nvfp4_dequantize_sum = _dispatching("nvfp4_dequantize_sum")


index_dtype_for = reference.index_dtype_for
row_bounds = reference.row_bounds
code_bits = reference.code_bits

__all__ = [
    *OP_NAMES,
    "Backend",
    "backend",
    "run_on",
    "check_forced_backend",
    "code_bits",
    "functions",
    "implementation",
    "index_dtype_for",
    "register_backend",
    "runs_on",
]
