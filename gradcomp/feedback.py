"""Error feedback: the residual memory of what compression dropped.

A residual is kept per key (a bucket index, a parameter name) and added to
the next tensor compressed under that key. The compressors' fused ops read
and update it in place: ``y = x + residual; c = C(y); residual <- y - D(c)``.
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

RESIDUAL_DTYPES = ("fp32", "grad")


class ErrorFeedback:
    """Residuals keyed by name.

    Args:
        dtype: ``"fp32"`` (default; exact bookkeeping for fp16/bf16
            gradients) or ``"grad"`` (the gradient's own dtype: half the
            memory for fp16/bf16).

    Example:
        >>> memory = ErrorFeedback()
        >>> r = memory.residual("layer1", grad)   # zeros the first time
        >>> payload = compressor.compress(grad, Context(residual=r))
    """

    __slots__ = ("dtype", "_residuals", "__weakref__")

    def __init__(self, dtype: str = "fp32"):
        if dtype not in RESIDUAL_DTYPES:
            raise ValueError(f"residual dtype must be one of {RESIDUAL_DTYPES}, got {dtype!r}")
        self.dtype = dtype
        self._residuals: dict[Hashable, torch.Tensor] = {}

    def residual(self, key: Hashable, like: torch.Tensor) -> torch.Tensor:
        """The flat residual for ``key``; created as zeros shaped like ``like`` the first time."""
        dtype = torch.float32 if self.dtype == "fp32" else like.dtype
        existing = self._residuals.get(key)
        if existing is None:
            existing = torch.zeros(like.numel(), dtype=dtype, device=like.device)
            self._residuals[key] = existing
        elif existing.device != like.device:  # restored from a checkpoint on another device
            existing = self._residuals[key] = existing.to(like.device)
        elif existing.numel() != like.numel():
            raise ValueError(
                f"residual {key!r} holds {existing.numel()} elements but the tensor has "
                f"{like.numel()}; give each tensor its own key"
            )
        return existing

    def get(self, key: Hashable) -> torch.Tensor | None:
        return self._residuals.get(key)

    def set(self, key: Hashable, residual: torch.Tensor) -> None:
        self._residuals[key] = residual.reshape(-1)

    def pop(self, key: Hashable) -> torch.Tensor | None:
        return self._residuals.pop(key, None)

    def keys(self) -> list[Hashable]:
        return list(self._residuals)

    def clear(self) -> None:
        self._residuals.clear()

    def __len__(self) -> int:
        return len(self._residuals)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._residuals

    def state_dict(self) -> dict:
        """Residuals (cloned, on their devices) and the dtype policy."""
        return {"dtype": self.dtype, "residuals": {k: v.clone() for k, v in self._residuals.items()}}

    def load_state_dict(self, state: dict) -> None:
        if state["dtype"] != self.dtype:
            raise ValueError(f"saved residual dtype {state['dtype']!r} differs from {self.dtype!r}")
        self._residuals = {k: v.clone() for k, v in state["residuals"].items()}
