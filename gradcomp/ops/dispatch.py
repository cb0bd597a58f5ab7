"""Backend dispatch of the kernel ops: the registry of backends, which one runs an op
for a device (``BACKEND_PREFERENCE``, ``OP_PREFERENCE``, ``GRADCOMP_BACKEND``), and
the dispatching function of each op (:mod:`gradcomp.ops` binds them)."""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import threading
from collections.abc import Callable

import torch

from gradcomp.ops import checks, cpu_backend, reference

BACKENDS = ("torch", "cpu", "triton", "cuda")
# Fastest first; torch, the reference, is the fallback that always exists.
BACKEND_PREFERENCE = ("cuda", "triton", "cpu", "torch")
# Ops whose fastest backend is another: Top-K's Triton sampling path passes once over
# the tensor (12 bytes an fp32 element with its residual, kernels/topk.py), the CUDA
# radix select four times (36: three histogram passes and a compaction, csrc/topk.cu);
# the radix select stays one GRADCOMP_BACKEND=cuda away, and bench/kernel_speed.py times both.
OP_PREFERENCE = {"topk_select": ("triton", "cuda", "cpu", "torch")}

OP_NAMES = (
    "quantize_blockwise",
    "dequantize_blockwise",
    "quantize_rows",
    "dequantize_rows",
    "dequantize_sum",
    "sign_compress",
    "sign_decompress",
    "sign_compress_rows",
    "sign_decompress_rows",
    "sign_decompress_sum",
    "topk_select",
    "randk_select",
    "randk_indices",
    "scatter_add",
    "pack_bits",
    "unpack_bits",
    "mx_quantize",
    "mx_dequantize",
    "mx_dequantize_sum",
    "nvfp4_quantize",
    "nvfp4_dequantize",
    "nvfp4_dequantize_sum",
)

# backend -> (is_available(device) -> bool, {op name: function})
_REGISTRY: dict[str, tuple[Callable[[torch.device], bool], dict[str, Callable]]] = {
    "torch": (lambda device: True, {name: getattr(reference, name) for name in OP_NAMES}),
    "cpu": (cpu_backend.is_available, dict(cpu_backend.FUNCTIONS)),
}
# Optional backends, imported on first use so that `import gradcomp` stays light
# and never fails for lack of them: backend -> (module with FUNCTIONS and
# is_available, the package it needs).
_OPTIONAL = {
    "triton": ("gradcomp.ops.triton_backend", "triton"),
    "cuda": ("gradcomp.ops.cuda_backend", "cupy"),
}
# Backends used when nothing is forced. The Triton interpreter runs on CPU
# tensors too, but only for testing: it is used there only when forced.
_AUTOMATIC_DEVICES = {"triton": ("cuda",), "cuda": ("cuda",), "cpu": ("cpu",), "torch": ("cpu", "cuda")}


# (op, device, the registry's entries) -> the function implementation() chose when
# no backend is forced: an op runs per bucket, and choosing costs more than some
# ops on small tensors.
_CHOSEN: dict[tuple, tuple] = {}
# Optional backends looked for once: those whose package is absent, and the error each
# one whose import failed raised (raised again at every use, never a fallback).
_ABSENT: set[str] = set()
_FAILED: dict[str, BaseException] = {}
_OPTIONAL_LOCK = threading.Lock()


def _load_optional(name: str) -> None:
    if name in _REGISTRY or name not in _OPTIONAL or name in _ABSENT:
        return
    with _OPTIONAL_LOCK:  # one thread imports; the others wait for what it found
        if name in _REGISTRY or name in _ABSENT:
            return
        if name in _FAILED:
            raise _FAILED[name]
        module_name, package = _OPTIONAL[name]
        if importlib.util.find_spec(package) is None:
            _ABSENT.add(name)
            return
        try:
            module = importlib.import_module(module_name)
        except Exception as error:
            _FAILED[name] = error
            raise
        _REGISTRY[name] = (module.is_available, dict(module.FUNCTIONS))


def _unavailable_reason(name: str, device: torch.device) -> str | None:
    """What an optional backend says about why it cannot run on a CUDA ``device``, if it says."""
    module = importlib.import_module(_OPTIONAL[name][0]) if name in _OPTIONAL else None
    explain = getattr(module, "unavailable_reason", None)
    if explain is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    return explain(torch.cuda.current_device() if device.index is None else device.index)


def register_backend(
    name: str, is_available: Callable[[torch.device], bool], functions: dict[str, Callable]
) -> None:
    """Make ``functions`` (op name -> implementation) a backend called ``name``.

    ``is_available(device)`` tells whether the backend can run on tensors of
    that device (for example: a GPU is present and the toolchain imports).
    """
    if name not in BACKENDS:
        raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
    unknown = set(functions) - set(OP_NAMES)
    if unknown:
        raise ValueError(f"backend {name!r} registers unknown ops {sorted(unknown)}")
    _REGISTRY[name] = (is_available, dict(functions))


def forced_backend() -> str | None:
    """The backend named by ``GRADCOMP_BACKEND``, or None when unset."""
    return _forced(os.environ.get("GRADCOMP_BACKEND", ""))


def _forced(setting: str) -> str | None:
    name = setting.strip().lower()
    if not name:
        return None
    if name not in BACKENDS:
        raise ValueError(f"GRADCOMP_BACKEND={name!r} is not one of {BACKENDS}")
    return name


def check_forced_backend() -> None:
    """Raise now, not at the first op, if ``GRADCOMP_BACKEND`` names a backend
    that is unknown or not installed."""
    forced = forced_backend()
    if forced is not None:
        _load_optional(forced)
    if forced is not None and forced not in _REGISTRY:
        raise RuntimeError(
            f"GRADCOMP_BACKEND={forced} requested but that backend is not installed "
            "(its package or toolchain is missing)"
        )


def implementation(op: str, device: torch.device) -> Callable:
    """The function that runs ``op`` for tensors on ``device``."""
    # The registry's entries are in the key: a test may swap one in place.
    setting = os.environ.get("GRADCOMP_BACKEND", "")
    if setting:  # forced: checked at every call (whether it can run may depend on more settings)
        return _resolve(op, device, _forced(setting))
    key = (op, device, *map(id, _REGISTRY.values()))
    chosen = _CHOSEN.get(key)
    if chosen is None:
        # The entries are kept with the choice: their ids cannot be reused meanwhile.
        chosen = _CHOSEN[key] = (_resolve(op, device, None), tuple(_REGISTRY.values()))
    return chosen[0]


def _resolve(op: str, device: torch.device, forced: str | None) -> Callable:
    check_forced_backend()
    if forced is not None:
        is_available, functions = _REGISTRY[forced]
        if op not in functions:
            raise RuntimeError(f"GRADCOMP_BACKEND={forced} requested but it has no {op!r} op")
        if not is_available(device):
            reason = _unavailable_reason(forced, device)
            raise RuntimeError(
                f"GRADCOMP_BACKEND={forced} requested but it cannot run on {device}"
                + (f": {reason}" if reason else "")
            )
        return functions[op]
    for name in preference(op):
        if device.type not in _AUTOMATIC_DEVICES.get(name, ()):
            continue
        _load_optional(name)
        entry = _REGISTRY.get(name)
        if entry is not None and op in entry[1] and entry[0](device):
            return entry[1][op]
    raise AssertionError("unreachable: the torch backend provides every op")


def preference(op: str) -> tuple[str, ...]:
    """The backends ``op`` runs on when none is forced, the first available first."""
    return OP_PREFERENCE.get(op, BACKEND_PREFERENCE)


def functions(backend: str) -> dict[str, Callable]:
    """``op -> function`` of ``backend`` as it is, without the op boundary's checks and
    dispatch (its functions take complete, valid arguments: :func:`run_on` makes them);
    an optional backend is loaded first; empty where it is not installed.

    Example:
        >>> "topk_select" in ops.functions("cpu")
        True
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _load_optional(backend)
    entry = _REGISTRY.get(backend)
    return {} if entry is None else dict(entry[1])


def availability(backend: str) -> Callable[[torch.device], bool]:
    """``backend``'s own test of whether it runs on a device (what :func:`register_backend`
    took): to register its functions again, wrapped, under the same test. An optional
    backend is loaded first.

    Raises:
        ValueError: an unknown backend.
        RuntimeError: an optional backend that is not installed.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _load_optional(backend)
    if backend not in _REGISTRY:
        raise RuntimeError(f"backend {backend!r} is not installed (its package or toolchain is missing)")
    return _REGISTRY[backend][0]


def runs_on(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` is installed and runs on tensors of ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {BACKENDS}")
    _load_optional(backend)
    entry = _REGISTRY.get(backend)
    return entry is not None and entry[0](torch.device(device))


def run_on(backend: str | None, op: str, *args, **kwargs):
    """``op`` with these arguments, checked and completed, on ``backend`` (None:
    the one :func:`implementation` picks for the tensors' device)."""
    bound = checks.checked(op, args, kwargs)
    if backend is None:
        function = implementation(op, checks.device_of(bound.arguments))
    else:
        _load_optional(backend)
        function = _REGISTRY[backend][1][op]
    return function(*bound.args, **bound.kwargs)


class Backend:
    """The ops of one backend, each called with its arguments checked and
    completed as the dispatching ops check them: ``ops.backend("cpu").pack_bits(codes, 2)``."""

    def __init__(self, name: str):
        if name not in BACKENDS:
            raise ValueError(f"unknown backend {name!r}; expected one of {BACKENDS}")
        self.name = name

    def __getattr__(self, op: str) -> Callable:
        if op not in OP_NAMES:
            raise AttributeError(op)
        return functools.partial(run_on, self.name, op)

    def __repr__(self) -> str:
        return f"ops.backend({self.name!r})"


def backend(name: str) -> Backend:
    """The ops of backend ``name`` (``torch``: the reference), arguments checked."""
    return Backend(name)


def _dispatching(op: str) -> Callable:
    def run(*args, **kwargs):
        return run_on(None, op, *args, **kwargs)

    run.__name__ = op
    run.__doc__ = getattr(reference, op).__doc__
    return run
