"""Triton kernels of gradcomp, installed as ``gradcomp.kernels`` (imports triton and torch only).

Each launcher checks its inputs, allocates, picks the grid and runs one or
two kernels; :mod:`gradcomp.ops.triton_backend` turns them into the ops of
:mod:`gradcomp.ops.reference`, against which they are tested. They run on
CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1`` (Triton's
interpreter: slow, for testing).

The folder is ``kernels/`` at the repository's top level, installed as
``gradcomp.kernels`` by ``[tool.setuptools.package-dir]``. A process started at
the root (``sys.path[0]`` is the working directory) also finds it under the
top-level name ``kernels``, which is Hugging Face's package (transformers
imports it). Under that name this file loads none of gradcomp: it hands the
name over to the ``kernels`` the rest of ``sys.path`` holds or, where there is
none, to an empty namespace package, as the folder would be without this file.
It does not raise ``ModuleNotFoundError`` there: transformers imports what
``importlib.util.find_spec`` finds under a name no distribution provides, and
finds this folder; an empty namespace package is what it reads as "not
installed".
"""

if __name__ == "kernels":
    import importlib.machinery
    import importlib.util
    import os
    import sys

    def _hand_over(name: str) -> None:
        """Put in ``sys.modules[name]`` the module ``name`` is without this folder."""
        folder = os.path.dirname(os.path.realpath(__file__))
        root = os.path.dirname(folder)
        elsewhere = [entry for entry in sys.path if os.path.realpath(entry or ".") != root]

        def in_folder(place: str | None) -> bool:
            return bool(place) and os.path.commonpath([os.path.realpath(place), folder]) == folder

        for finder in sys.meta_path:
            spec = finder.find_spec(name, elsewhere) if hasattr(finder, "find_spec") else None
            places = [spec.origin, *(spec.submodule_search_locations or [])] if spec else []
            if spec is not None and not any(map(in_folder, places)):
                break
        else:
            spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
            spec.submodule_search_locations = []
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # the import statement returns this entry once this file has run
        if spec.loader is not None:
            spec.loader.exec_module(module)

    _hand_over(__name__)

else:
    import os

    import torch

    from .bits import pack_bits, unpack_bits
    from .microscaling import (
        mx_dequantize,
        mx_dequantize_sum,
        mx_quantize,
        nvfp4_dequantize,
        nvfp4_dequantize_sum,
        nvfp4_quantize,
    )
    from .quantize import (
        dequantize_blockwise,
        dequantize_rows,
        dequantize_sum,
        quantize_blockwise,
        quantize_rows,
    )
    from .sign import (
        sign_compress,
        sign_compress_rows,
        sign_decompress,
        sign_decompress_rows,
        sign_decompress_sum,
    )
    from .sparse import fold_into_residual, gather_compensated, randk_indices, scatter_add
    from .topk import keep_largest, select_candidates, write_back

    def interpreting() -> bool:
        """Whether Triton runs kernels in its CPU interpreter (``TRITON_INTERPRET=1``)."""
        return os.environ.get("TRITON_INTERPRET", "0") == "1"

    def is_available(device: torch.device) -> bool:
        """CUDA tensors always; CPU tensors only in the interpreter."""
        return device.type == "cuda" or (device.type == "cpu" and interpreting())

    __all__ = [
        "dequantize_blockwise",
        "dequantize_rows",
        "dequantize_sum",
        "fold_into_residual",
        "gather_compensated",
        "interpreting",
        "is_available",
        "keep_largest",
        "mx_dequantize",
        "mx_dequantize_sum",
        "mx_quantize",
        "nvfp4_dequantize",
        "nvfp4_dequantize_sum",
        "nvfp4_quantize",
        "pack_bits",
        "quantize_blockwise",
        "quantize_rows",
        "randk_indices",
        "scatter_add",
        "select_candidates",
        "sign_compress",
        "sign_compress_rows",
        "sign_decompress",
        "sign_decompress_rows",
        "sign_decompress_sum",
        "unpack_bits",
        "write_back",
    ]
