"""Which parameters each DDP bucket holds, across re-bucketing and resume.

A bucket's layout is ``((parameter number, numel), ...)`` in bucket order.
Parameters are numbered in the order the first iteration's buckets present
them, which depends only on the model and DDP's bucket caps: the same in a
resumed process as in the run that saved the checkpoint.

* Residuals are kept per bucket index. When DDP rebuilds its buckets after
  the first iteration, :meth:`BucketLayouts.adopt` cuts them per parameter
  and reassembles them for the new buckets: no sender's feedback is lost.
  The residuals of a bucket's shards follow no parameter and are reset: the
  owners' of ``two_phase`` (1/W of a bucket) and, for ``hierarchical``,
  all of its feedback (it keeps only the shards').
* A resumed process starts with DDP's initial buckets, not the rebuilt ones
  the checkpoint saw. For that first iteration the hook holds every bucket
  (:meth:`BucketLayouts.holds`), and :meth:`BucketLayouts.reduce_held`
  regroups the gradients into the saved layout and reduces them exactly as
  the uninterrupted run would have.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from gradcomp.feedback import ErrorFeedback

BucketLayout = tuple[tuple[int, int], ...]


class BucketLayouts:
    """The bucket layouts of one DDP model and the residuals that follow them.

    Args:
        feedback: the residuals, keyed by bucket index (and other keys for
            the residuals of shards, which a re-bucketing drops).
    """

    def __init__(self, feedback: ErrorFeedback):
        self.feedback = feedback
        self._numbers: dict[int, int] = {}  # id(parameter) -> number
        self._shapes: dict[int, tuple[int, ...]] = {}  # parameter number -> its shape
        self._layouts: dict[int, BucketLayout] = {}  # bucket index -> layout
        self._pieces: dict[int, torch.Tensor] = {}  # parameter number -> its cut residual
        self._restored: dict[int, BucketLayout] | None = None  # the checkpoint's, until first used
        self._held: list[tuple[torch.Tensor, BucketLayout, torch.futures.Future]] = []

    def layout_of(self, bucket: dist.GradBucket) -> BucketLayout:
        """``bucket``'s layout, numbering parameters seen for the first time."""
        layout = []
        numbers = self._numbers
        for parameter in bucket.parameters():
            number = numbers.get(id(parameter))
            if number is None:
                number = numbers[id(parameter)] = len(numbers)
            self._shapes[number] = tuple(parameter.shape)  # what a low-rank compressor factorises
            layout.append((number, parameter.numel()))
        return tuple(layout)

    def shapes_of(self, layout: BucketLayout) -> tuple[tuple[int, ...], ...]:
        """The shapes of the parameters of ``layout``, in bucket order (what a
        low-rank compressor factorises)."""
        return tuple(self._shapes[number] for number, _ in layout)

    def adopt(self, index: int, layout: BucketLayout, like: torch.Tensor) -> None:
        """Make ``layout`` bucket ``index``'s, assembling its residual from pieces.

        Call it on the collective worker, in bucket order, so that no bucket
        still in flight loses its residual.
        """
        if self._layouts.get(index) == layout:
            return
        owned = {number for other in self._layouts.values() for number, _ in other}
        if index in self._layouts or any(number in owned for number, _ in layout):
            self._cut_residuals()
        self._layouts[index] = layout
        if any(number in self._pieces for number, _ in layout):
            dtype = torch.float32 if self.feedback.dtype == "fp32" else like.dtype
            parts = [
                self._pieces.pop(number).to(like.device, dtype)
                if number in self._pieces
                else torch.zeros(numel, dtype=dtype, device=like.device)
                for number, numel in layout
            ]
            self.feedback.set(index, torch.cat(parts))

    def _cut_residuals(self) -> None:
        """Cut every bucket residual into per-parameter pieces (buckets are
        changing); drop the residuals of shards, which follow no parameter."""
        for key in self.feedback.keys():
            if key not in self._layouts:
                self.feedback.pop(key)
        for index, layout in self._layouts.items():
            residual = self.feedback.pop(index)
            if residual is None:
                continue
            for (number, _), piece in zip(layout, residual.split([n for _, n in layout]), strict=True):
                self._pieces[number] = piece.clone()
        self._layouts = {}

    # ------------------------------------------------------------------ resume
    def holds(self, index: int, layout: BucketLayout) -> bool:
        """Whether bucket ``index`` of this layout must be held to be regrouped
        into the restored layout; False once the buckets are the restored ones
        (or nothing was restored)."""
        if self._restored is None:
            return False
        if index == 0 and self._restored.get(0) == layout:
            self._restored = None  # DDP's buckets are already the saved ones
            return False
        return True

    def hold(self, buffer: torch.Tensor, layout: BucketLayout, future: torch.futures.Future) -> None:
        """Keep ``buffer`` for :meth:`reduce_held`; ``future`` is set to it then."""
        self._held.append((buffer, layout, future))

    def reduce_held(self, reduce: Callable[[torch.Tensor, int, BucketLayout, bool], None]) -> None:
        """Regroup the held buffers into the restored buckets, ``reduce(flat,
        index, layout, last)`` each in place in index order, write the results
        back and complete the held futures (with the error, if one is raised)."""
        held, self._held = self._held, []
        restored, self._restored = self._restored, None
        try:
            views = {}
            for buffer, layout, _ in held:
                for (number, numel), view in zip(
                    layout, buffer.view(-1).split([n for _, n in layout]), strict=True
                ):
                    views[number] = (numel, view)
            wanted = {number: numel for layout in restored.values() for number, numel in layout}
            if {n: numel for n, (numel, _) in views.items()} != wanted:
                raise ValueError(
                    "the restored hook state's buckets do not hold this model's parameters "
                    "(was it saved for another model or another bucket_cap_mb?)"
                )
            indices = sorted(restored)
            for position, index in enumerate(indices):
                layout = restored[index]
                flat = torch.cat([views[number][1] for number, _ in layout])
                reduce(flat, index, layout, position == len(indices) - 1)
                for (number, _), piece in zip(layout, flat.split([n for _, n in layout]), strict=True):
                    views[number][1].copy_(piece)
        except BaseException as error:
            for _, _, future in held:
                future.set_exception(error)
            raise
        for buffer, _, future in held:
            future.set_result(buffer)

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict:
        return {"layouts": dict(self._layouts), "pieces": {k: v.clone() for k, v in self._pieces.items()}}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output: the next iteration's buckets are
        regrouped into the saved layouts."""
        self._pieces = {k: v.clone() for k, v in state["pieces"].items()}
        self._layouts = {int(k): tuple(v) for k, v in state["layouts"].items()}
        self._restored = dict(self._layouts) if self._layouts else None
        self._numbers = {}
