"""DiLoCo's saved state: what it holds, its schema, the settings a checkpoint must share
with the run that loads it, and a restart on another world size.

A DiLoCo's state (:func:`state_of`) holds the anchor, the outer momentum, the residuals,
the steps, the inner learning rates summed per fragment, this rank's weights and inner
optimizer state, and every exchange in flight, waited for: its average is kept, to land
at its step. :class:`~gradcomp.diloco.DiLoCo`'s ``state_dict``, ``load_state_dict`` and
``restart`` are these functions.
"""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from gradcomp.ddp import records
from gradcomp.diloco.fragments import Exchange, by_dtype
from gradcomp.feedback import ErrorFeedback

# 2: per-fragment outer steps and exchanges in flight (1 read with one fragment);
# 3: the inner learning rates summed per fragment, for follow_inner_lr (1 and 2 read without it)
SCHEMA_VERSION = 3


def upgrade(saved: dict, settings: dict) -> dict:
    """``saved`` in this version's schema; refused where its settings differ from ``settings``
    (the loading DiLoCo's)."""
    version = saved.get("version")
    if version == 1:
        if settings["fragments"] != 1 or settings["overlap_steps"]:
            raise ValueError(
                "a DiLoCo state of schema 1 (one fragment, no overlap) loads only into one fragment "
                "without overlap"
            )
        saved = {**saved, "outer_steps": [saved["outer_step"]], "in_flight": [], "bytes_sent": 0}
        saved["settings"] = {**saved["settings"], "fragments": 1, "overlap_steps": 0}
    elif version not in (2, SCHEMA_VERSION):
        raise ValueError(f"DiLoCo state of schema {version!r}; this version reads 1 to {SCHEMA_VERSION}")
    if version in (1, 2):  # before follow_inner_lr: DiLoCo's outer step
        saved = {**saved, "settings": {**saved["settings"], "follow_inner_lr": False}}
    saved = {**saved, "settings": {"node_size": None, **saved["settings"]}}  # saved before node_size
    if saved["settings"] != settings:
        differ = sorted(k for k, v in settings.items() if saved["settings"].get(k) != v)
        hint = ""
        if version in (1, 2) and "follow_inner_lr" in differ:
            hint = " (saved before follow_inner_lr: make DiLoCo with follow_inner_lr=False to resume it)"
        raise ValueError(f"the checkpoint's DiLoCo settings differ in {differ}{hint}")
    return saved


def saved_exchange(exchange: Exchange) -> dict:
    """An exchange in flight as a checkpoint holds it (waited for: its average)."""
    return {
        "fragment": exchange.fragment,
        "lands": exchange.lands,
        "deltas": [delta.clone() for delta in exchange.deltas()],
        "snapshot": None if exchange.snapshot is None else [t.clone() for t in exchange.snapshot],
        "bytes_sent": exchange.bytes_sent,
        "lr_sums": list(exchange.lr_sums),
    }


def restored_exchange(entry: dict, fragments: list[list[int]], params: list[torch.Tensor]) -> Exchange:
    """The exchange a :func:`saved_exchange` entry holds, on the parameters' device, to land
    at its step."""
    device = params[0].device
    exchange = Exchange(int(entry["fragment"]), int(entry["lands"]))
    parts = by_dtype(fragments[exchange.fragment], params)
    for typed, delta in zip(parts, entry["deltas"], strict=True):
        exchange.parts.append((typed, delta.to(device), None))
    if entry["snapshot"] is not None:
        exchange.snapshot = [t.to(device) for t in entry["snapshot"]]
    exchange.bytes_sent = int(entry["bytes_sent"])
    exchange.lr_sums = [float(x) for x in entry.get("lr_sums", [])]
    return exchange


def state_of(outer) -> dict:
    """``outer``'s (a :class:`~gradcomp.diloco.DiLoCo`'s) state as saved, its exchanges in
    flight waited for."""
    for exchange in outer.in_flight:
        exchange.wait()
    return {
        "version": SCHEMA_VERSION,
        "settings": outer.settings(),
        "local_step": outer.local_step,
        "outer_steps": list(outer.outer_steps),
        "bytes_sent": outer.bytes_sent,
        "anchor": [t.clone() for t in outer.anchor],
        "momentum": [t.clone() for t in outer.momentum],
        "lr_sums": outer.lr_sums.read(),
        "feedback": outer.feedback.state_dict(),
        "weights": [p.detach().clone() for p in outer.params],
        "inner": copy.deepcopy(outer.inner.state_dict()),
        "in_flight": [saved_exchange(exchange) for exchange in outer.in_flight],
    }


def load(outer, saved: dict) -> None:
    """Put :func:`state_of`'s ``saved`` (of this schema or an earlier one) into ``outer``."""
    saved = upgrade(saved, outer.settings())
    for exchange in outer.in_flight:  # nothing of this run may still write a residual
        exchange.wait()
    outer.local_step = int(saved["local_step"])
    outer.outer_steps = [int(n) for n in saved["outer_steps"]]
    if "lr_sums" in saved:
        outer.lr_sums.load(saved["lr_sums"])
    outer.bytes_sent = int(saved["bytes_sent"])
    own = saved.get("weights", [])  # schema 1 held neither: the caller loaded them
    with torch.no_grad():
        for mine, theirs in zip(
            [*outer.anchor, *outer.momentum, *(outer.params if own else [])],
            [*saved["anchor"], *saved["momentum"], *own],
            strict=True,
        ):
            mine.copy_(theirs)
    if "inner" in saved:
        outer.inner.load_state_dict(saved["inner"])
    outer.feedback.load_state_dict(saved["feedback"])
    outer.in_flight = [
        restored_exchange(entry, outer.fragments, outer.params) for entry in saved["in_flight"]
    ]


@torch.no_grad()
def restart(outer, saved: dict | None) -> None:
    """``outer`` goes on from a checkpoint of another world size: this rank's ``saved`` state
    where it has one, without its residuals or exchanges in flight; then group rank 0's
    weights, anchor, momentum, steps and learning rate sums on every rank."""
    for exchange in outer.in_flight:
        exchange.wait()

    def restore_own() -> None:
        if saved is not None:
            outer.load_state_dict({**saved, "feedback": ErrorFeedback().state_dict(), "in_flight": []})

    # Before the broadcasts: a saved state refused on the ranks that have one (other
    # settings) must fail the ranks that have none too, not leave them in a broadcast.
    records.on_every_rank(outer.group, lambda: (restore_own(), None))
    outer.feedback, outer.in_flight = ErrorFeedback(), []
    device = outer.params[0].device
    counters = torch.tensor([outer.local_step, *outer.outer_steps], dtype=torch.int64, device=device)
    source = dist.get_global_rank(outer.group, 0) if outer.group is not None else 0
    lr_sums = torch.tensor(outer.lr_sums.read(), dtype=torch.float64, device=device)
    for tensor in [*outer.params, *outer.anchor, *outer.momentum, counters, lr_sums]:
        dist.broadcast(tensor, src=source, group=outer.group)
    outer.local_step, *outer.outer_steps = (int(n) for n in counters.tolist())
    outer.lr_sums.load(lr_sums.tolist())
