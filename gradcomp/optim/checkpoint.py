"""CompressedAdam's saved state: torch's optimizer state with each group's compressors as
their settings (``torch.load`` reads it with ``weights_only``), and a ``gradcomp`` entry
(the step, the warm-up, the bucket sizes, this rank's residuals) checked against the
optimizer that loads it."""

from __future__ import annotations

from gradcomp.collectives import settings_key

COMPRESSOR_KEYS = ("compressor", "gradient_compressor")


def saved_settings(compressor) -> str | None:
    """A group's compressor as saved: its settings (None for none)."""
    if compressor is None or isinstance(compressor, str):
        return compressor
    return settings_key(compressor)


def save_compressors(param_groups: list[dict]) -> None:
    """Replace each saved group's compressors by their settings."""
    for saved in param_groups:
        for name in COMPRESSOR_KEYS:
            saved[name] = saved_settings(saved[name])


def check_loadable(state_dict: dict, buckets: list[int], warmup_steps: int, param_groups: list[dict]) -> dict:
    """The ``gradcomp`` entry of ``state_dict``, refused where it was saved by an optimizer
    of other bucket sizes, warm-up or compressors than this one's."""
    extra = state_dict.get("gradcomp")
    if extra is None:
        raise ValueError("not a CompressedAdam state (no 'gradcomp' entry)")
    if extra["buckets"] != buckets:
        raise ValueError(
            f"saved buckets of {extra['buckets']} elements differ from this optimizer's {buckets}: "
            "the parameters or bucket_mb changed"
        )
    if extra["warmup_steps"] != warmup_steps:
        raise ValueError(f"saved warmup_steps {extra['warmup_steps']} differs from {warmup_steps}")
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) == len(param_groups):
        for index, (saved, g) in enumerate(zip(saved_groups, param_groups, strict=True)):
            for name in COMPRESSOR_KEYS:
                if saved_settings(saved[name]) != saved_settings(g[name]):
                    raise ValueError(
                        f"group {index}: saved {name} {saved_settings(saved[name])} differs from "
                        f"{saved_settings(g[name])}"
                    )
    return extra
