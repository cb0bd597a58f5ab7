"""DiLoCo's saved state: its schema, the settings a checkpoint must share with the run
that loads it, and the exchanges in flight as saved.
"""

from __future__ import annotations

import torch

from gradcomp.diloco.fragments import Exchange, by_dtype

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
