"""CompressedAdam's saved state: each group's compressors saved as their settings
(``torch.load`` reads them with ``weights_only``)."""

from __future__ import annotations

from gradcomp.collectives import settings_key

COMPRESSOR_KEYS = ("compressor", "gradient_compressor")


def saved_settings(compressor) -> str | None:
    """A group's compressor as saved: its settings (None for none)."""
    if compressor is None or isinstance(compressor, str):
        return compressor
    return settings_key(compressor)
