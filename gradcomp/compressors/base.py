"""Compressor base class and the per-call context."""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import ClassVar

import torch

from gradcomp import ops
from gradcomp.ops.reference import write_out
from gradcomp.payload import Layout, Maker, Payload, buffer_size

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_MASK64 = 2**64 - 1


def mix_seed(*parts: int) -> int:
    """Combine integers into one 63-bit seed (splitmix64 rounds): equal parts,
    equal seed on every rank and every run."""
    state = 0x9E3779B97F4A7C15
    for part in parts:
        state = (state ^ (int(part) & _MASK64)) & _MASK64
        state = (state * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
        state ^= state >> 31
    return state & (2**63 - 1)


@functools.cache
def _option_names(kind: type) -> tuple[str, ...]:
    # A class's constructor options, read once (inspect.signature costs tens of
    # microseconds, and the settings are read at every all-reduce).
    parameters = inspect.signature(kind.__init__).parameters
    return tuple(name for name in parameters if name not in ("self", "feedback"))


def without_grad(method):
    """``torch.no_grad()`` as a decorator, free where grad mode is already off (the
    collective worker turns it off for its thread: it runs every bucket's codec)."""

    @functools.wraps(method)
    def run(*args, **kwargs):
        if not torch.is_grad_enabled():
            return method(*args, **kwargs)
        with torch.no_grad():
            return method(*args, **kwargs)

    return run


@dataclasses.dataclass
class Context:
    """What one ``compress`` call needs besides the tensor.

    Attributes:
        residual: error-feedback memory for this tensor (flat, same numel),
            updated in place; None for no feedback.
        step: training step; varies the random streams from step to step.
        key: integer naming the tensor (bucket index, chunk); varies streams
            between tensors of one step.
        rank: this process's rank; stochastic rounding differs per rank,
            while shared-seed selections (random-K) ignore it.
    """

    residual: torch.Tensor | None = None
    step: int = 0
    key: int = 0
    rank: int = 0


class Compressor:
    """Base class: ``compress(tensor, ctx) -> Payload``, ``decompress(payload) -> Tensor``.

    Class facts the collectives read:
        summable: payloads of all ranks add up without decoding (dense all-reduce).
        sparse: payload is much smaller than dense; gathering is best.
        low_rank: factors of the tensor's matrices, summed in two dense
            all-reduces (the bucket's tensor shapes decide what is a matrix).

    A payload's size depends only on numel, dtype and settings
    (:meth:`payload_layout`): collectives never exchange sizes, which on a
    GPU would cost a host sync.

    Args (common to every compressor):
        feedback: error feedback on or off; None picks the compressor's
            default (on for biased compressors).
        seed: base seed of every random stream the compressor uses.
    """

    name: ClassVar[str] = ""
    summable: ClassVar[bool] = False
    sparse: ClassVar[bool] = False
    low_rank: ClassVar[bool] = False

    def __init__(self, *, feedback: bool | None = None, seed: int = 0):
        if feedback is not None and not isinstance(feedback, bool):
            raise TypeError(f"feedback must be True, False or None, got {feedback!r}")
        self.feedback = feedback
        self.seed = int(seed)

    # ------------------------------------------------------------------ facts
    @property
    def unbiased(self) -> bool:
        """E[decompress(compress(x))] == x."""
        return False

    @property
    def default_feedback(self) -> bool:
        return not self.unbiased

    @property
    def needs_feedback(self) -> bool:
        """Whether callers should keep a residual for this compressor."""
        return self.default_feedback if self.feedback is None else self.feedback

    @property
    def keeps_state(self) -> bool:
        """Whether a call reads and writes what is kept under its tensor's key between
        calls (a residual; PowerSGD's warm start): two calls under one key must then run
        as if one after the other. Random streams keep nothing: they follow from the
        seed, the key and the step."""
        return self.needs_feedback

    def settings(self) -> dict:
        """Every option that changes the bytes on the wire; ranks must agree on it."""
        options = {name: getattr(self, name) for name in _option_names(type(self))}
        return {"name": self.name, "feedback": self.needs_feedback, **options}

    def settings_key(self) -> str:
        """:meth:`settings` as one stable string (equal settings, equal key); kept until
        an attribute is set (every bucket's job reads it)."""
        key = self.__dict__.get("_settings_key")
        if key is None:
            key = self.__dict__["_settings_key"] = repr(sorted(self.settings().items()))
        return key

    def decoding_key(self) -> str:
        """The settings that decide how a payload decodes, readable (``Int8(block=256,
        stochastic=False)``): :meth:`settings` but ``feedback`` and ``seed``, which
        change only how a payload is made. A payload remembers its maker's; kept until
        an attribute is set."""
        key = self.__dict__.get("_decoding_key")
        if key is None:
            options = {k: v for k, v in self.settings().items() if k not in ("name", "feedback", "seed")}
            described = ", ".join(f"{k}={v!r}" for k, v in options.items())
            key = self.__dict__["_decoding_key"] = f"{type(self).__name__}({described})"
        return key

    def __setattr__(self, name: str, value) -> None:
        self.__dict__.pop("_settings_key", None)
        self.__dict__.pop("_decoding_key", None)
        super().__setattr__(name, value)

    def __repr__(self) -> str:
        options = ", ".join(f"{k}={v!r}" for k, v in self.settings().items() if k != "name")
        return f"{type(self).__name__}({options})"

    # ------------------------------------------------------------------ API
    @without_grad
    def compress(self, tensor: torch.Tensor, ctx: Context | None = None) -> Payload:
        """Encode ``tensor`` (any shape; fp32, fp16, bf16 or fp64). Not differentiable:
        a tensor that requires grad is read as its value.

        With ``ctx.residual`` the residual is added first and replaced by what
        this payload does not carry.
        """
        check_tensor(tensor)
        ctx = ctx or Context()
        if ctx.residual is not None:
            _check_companion("residual", ctx.residual, tensor.numel(), tensor.device)
        tensors, meta = self._encode_shaped(tensor.detach().reshape(-1), tensor.shape, ctx)
        maker = Maker(self.decoding_key(), tensor.shape, tensor.dtype)
        return Payload(tensors, tensor.shape, tensor.dtype, meta, maker)

    @without_grad
    def decompress(
        self,
        payload: Payload,
        out: torch.Tensor | None = None,
        accumulate: bool = False,
        *,
        divisor: int = 1,
    ) -> torch.Tensor:
        """Decode ``payload`` into a tensor of its shape and dtype.

        Args:
            out: write into this tensor (same numel) instead of a new one.
            accumulate: add into ``out`` instead of overwriting it.
            divisor: decode ``payload / divisor``, divided before it is
                rounded to the output's dtype or added into ``out``. Sparse
                compressors divide only the values they carry, so averaging
                gathered payloads costs no pass over the whole output.

        Raises:
            ValueError: a payload another compressor made (or one of other settings),
                one whose shape or dtype changed since it was made, or one whose
                tensors are not what this compressor makes for its shape.
        """
        self._check_payload(payload)
        if accumulate and out is None:
            raise ValueError("accumulate=True needs out=")
        if out is not None:
            device = next(iter(payload.tensors.values())).device if payload.tensors else out.device
            _check_companion("out", out, payload.numel, device)
        if isinstance(divisor, bool) or not isinstance(divisor, int) or divisor < 1:
            raise ValueError(f"divisor must be a positive integer, got {divisor!r}")
        flat = None if out is None else out.view(-1)
        if divisor == 1:
            decoded = self._decode(payload, flat, accumulate)
        else:
            decoded = self._decode_divided(payload, flat, accumulate, divisor)
        return decoded.to(payload.dtype).view(payload.shape) if out is None else out

    def payload_layout(self, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Layout:
        """The layout of a payload for ``numel`` elements (``meta`` as the payload's)."""
        raise NotImplementedError

    def _check_payload(self, payload: Payload) -> None:
        """``ValueError`` unless this compressor can decode ``payload`` as it stands: made
        by one of these settings for its shape and dtype, or, where its maker is not
        known, holding the tensors this compressor makes for its shape."""
        maker, mine = payload.maker, self.decoding_key()
        if maker is not None and maker.compressor != mine:
            raise ValueError(
                f"this payload was made by {maker.compressor}, not {mine}: decode it with the compressor "
                "(and settings) that made it"
            )
        if maker is not None and (maker.shape, maker.dtype) != (payload.shape, payload.dtype):
            raise ValueError(
                f"this {mine} payload was made for a tensor of shape {tuple(maker.shape)} and "
                f"{maker.dtype}, not {tuple(payload.shape)} and {payload.dtype}"
            )
        try:
            expected = self.payload_layout(payload.numel, payload.dtype, payload.meta)
            same = _by_name(payload.layout()) == _by_name(expected)
            wanted = None if same else f"makes {_described(expected)}"
        except KeyError as missing:
            wanted = f"needs meta {missing}"
        if wanted is not None:
            raise ValueError(
                f"{mine} cannot decode this payload of shape {tuple(payload.shape)} and {payload.dtype}: it "
                f"holds {_described(payload.layout())} and meta {sorted(payload.meta)}, where {mine} {wanted}"
            )

    # ------------------------------------------------------------------ payload rows
    # What the collectives exchange: many payloads, one a row of a 2-D uint8
    # tensor, each row at least as long as its payload. The defaults below make
    # one call per row; compressors with row ops (quantizers, sign) override
    # them with one kernel launch whatever the number of rows.
    @without_grad
    def compress_rows(self, flat: torch.Tensor, chunk: int, rows: torch.Tensor, ctx: Context) -> None:
        """Encode consecutive chunks of ``chunk`` elements of the 1-D ``flat``,
        chunk ``j`` into row ``j`` of ``rows``, each with its own slice of
        ``ctx.residual`` (over the whole of ``flat``)."""
        for j, (start, end) in enumerate(ops.row_bounds(flat.numel(), chunk)):
            residual = None if ctx.residual is None else ctx.residual.view(-1)[start:end]
            part = Context(residual, ctx.step, mix_seed(ctx.key, j), ctx.rank)
            payload = self.compress(flat[start:end], part)
            payload.to_buffer(out=rows[j, : buffer_size(payload.layout())])

    @without_grad
    def decompress_rows(self, rows: torch.Tensor, dtype: torch.dtype, chunk: int, out: torch.Tensor) -> None:
        """Decode :meth:`compress_rows`' rows into ``out`` (1-D), chunk ``j`` from
        row ``j``; ``dtype`` is that of the tensor they encoded."""
        for row, (start, end) in zip(rows, ops.row_bounds(out.numel(), chunk), strict=False):
            self.decompress(self._from_row(row, end - start, dtype, {}), out=out[start:end])

    @without_grad
    def decompress_sum(
        self, rows: torch.Tensor, dtype: torch.dtype, out: torch.Tensor, *, meta=None, divisor: int = 1
    ) -> None:
        """``out`` (1-D, any float dtype) = the sum of the payloads of ``out.numel()``
        elements in ``rows`` (every rank's, in rank order: the same bits on every
        rank), added in fp32, divided by ``divisor`` and rounded once to
        ``out``'s dtype. ``meta``: the payloads' (the same for all)."""
        total = out if out.dtype == torch.float32 else torch.empty(out.numel(), device=out.device)
        total.zero_()
        for row in rows:
            self.decompress(self._from_row(row, out.numel(), dtype, meta or {}), out=total, accumulate=True)
        if divisor != 1:
            total /= divisor
        if total is not out:
            out.copy_(total)

    # The collectives' one-row lane (collectives.allgather): the whole tensor as one row.
    # For valid inputs that the caller made (no checks beyond compress's); compressors
    # with a row op override them with that op, called without the op boundary.
    @without_grad
    def encode_row(self, flat: torch.Tensor, row: torch.Tensor, ctx: Context) -> dict[str, int]:
        """Write ``compress(flat, ctx)`` into the flat uint8 ``row`` (``to_buffer``'s
        bytes, zero-padded to its end: exactly its :func:`buffer_size` wide) and
        return the payload's meta."""
        payload = self.compress(flat, ctx)
        payload.to_buffer(out=row)
        return payload.meta

    @without_grad
    def decode_rows(self, rows: torch.Tensor, out: torch.Tensor, meta: dict[str, int], divisor: int) -> None:
        """:meth:`decompress_sum` of ``rows``, :meth:`encode_row`'s rows of tensors of
        ``out``'s dtype, into ``out`` (1-D, contiguous)."""
        self.decompress_sum(rows, out.dtype, out, meta=meta, divisor=divisor)

    def _from_row(self, row: torch.Tensor, numel: int, dtype: torch.dtype, meta: dict[str, int]) -> Payload:
        layout, shape = self.payload_layout(numel, dtype, meta), torch.Size([numel])
        return Payload.from_buffer(row, layout, shape, dtype, meta, Maker(self.decoding_key(), shape, dtype))

    # ------------------------------------------------------------------ subclasses
    def _encode(self, flat: torch.Tensor, ctx: Context) -> tuple[dict[str, torch.Tensor], dict[str, int]]:
        raise NotImplementedError

    def _encode_shaped(self, flat: torch.Tensor, shape: torch.Size, ctx: Context):
        """``_encode`` of ``flat``, the tensor of ``shape`` flattened; compressors
        that see matrices in a tensor (low rank) override this one."""
        return self._encode(flat, ctx)

    def _decode(self, payload: Payload, out: torch.Tensor | None, accumulate: bool) -> torch.Tensor:
        raise NotImplementedError

    def _decode_divided(
        self, payload: Payload, out: torch.Tensor | None, accumulate: bool, divisor: int
    ) -> torch.Tensor:
        """``_decode`` of ``payload / divisor``; by default through a whole
        decoded temporary (sparse compressors divide their values instead)."""
        decoded = self._decode(payload, None, False)
        decoded = decoded.to(torch.promote_types(decoded.dtype, torch.float32)).div_(divisor)
        return write_out(decoded, out, accumulate)

    def _private_seed(self, ctx: Context) -> int:
        return mix_seed(self.seed, ctx.step, ctx.key, ctx.rank + 1)

    def _shared_seed(self, ctx: Context) -> int:
        return mix_seed(self.seed, ctx.step, ctx.key)


def _by_name(layout: Layout) -> dict:
    return {name: (dtype, numel) for name, dtype, numel in layout}


def _described(layout: Layout) -> str:
    """A layout, readable: ``scales float32[4], codes uint8[1000]``."""
    return ", ".join(f"{name} {str(dtype).removeprefix('torch.')}[{numel}]" for name, dtype, numel in layout)


def check_tensor(tensor: torch.Tensor, name: str = "tensor") -> None:
    """A dense tensor of a floating dtype gradcomp works in; ``name`` says
    which argument in the messages. An integer residual or output would
    silently truncate what it holds."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float16, bfloat16 or float64, got {tensor.dtype}")
    if tensor.is_sparse:
        raise TypeError(f"{name} is a sparse tensor; gradcomp works on dense ones")


def _check_companion(name: str, tensor, numel: int, device: torch.device) -> None:
    """A residual or output: as :func:`check_tensor`, of ``numel`` elements on ``device``."""
    check_tensor(tensor, name)
    if tensor.numel() != numel:
        raise ValueError(f"{name} has {tensor.numel()} elements, expected {numel}")
    if tensor.device != device:
        raise ValueError(f"{name} is on {tensor.device}, expected {device}")


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


def resolve_k(numel: int, ratio: float | None, k: int | None) -> int:
    """The number of elements to keep of ``numel``: ``k`` or ``max(1, round(ratio * numel))``."""
    if numel == 0:
        raise ValueError("cannot select elements of an empty tensor")
    if k is not None:
        if k > numel:
            raise ValueError(f"k={k} is larger than the tensor's {numel} elements")
        return k
    return max(1, min(numel, round(ratio * numel)))
