"""``gradcomp.all_reduce(tensor, "auto")``: :class:`Auto` chooses per tensor size from a
profile every rank agrees on (measured on the group's worker, or injected)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from gradcomp.compressors import Compressor
from gradcomp.planner.measure import LINK_MAX, probe
from gradcomp.planner.model import Prediction, best_plan, dense_plan, flat_routes
from gradcomp.planner.profiles import Profile, combine
from gradcomp.planner.specs import SAFE, from_spec, label


class Auto:
    """``gradcomp.all_reduce(tensor, Auto(...))``: the compressor and algorithm chosen per tensor size.

    The first call on a group compares the ranks' settings (``allow``,
    ``profile`` given or not: ``ValueError`` on every rank where they differ),
    then measures its link and the candidates' codecs on the tensor's device
    (every rank, on the group's worker, in call order: like any collective,
    every rank must make the same calls), at the tensor's size (the link up
    to 4M elements, :data:`LINK_MAX`) and a grid from 4K to 1M elements
    (:func:`link_sizes`), or takes ``profile``; every rank's figures combine,
    so every rank chooses alike. Each new size is then planned from those
    lines (:func:`best_plan`, in the tensor's own dtype: bf16 gradients send half
    the bytes, and a cast to bf16 saves them nothing) and keeps its choice;
    :attr:`plans` holds them per group, keyed by (elements, dtype). An empty
    tensor is sent dense without measuring. Where the group spans several
    nodes of several ranks (``all_reduce``'s ``node_size``, else
    ``LOCAL_WORLD_SIZE``, else host names), the first call also measures
    the nodes' levels and each size may go ``hierarchical`` (profiles and
    plans made for nodes are keyed by the node size too).
    ``gradcomp.all_reduce(t, "auto")`` uses one shared instance with the
    :data:`SAFE` candidates.

    Args:
        allow: the candidates (default :data:`SAFE`; ``"topk@0.01"``-style or objects).
        profile: a :class:`Profile` to plan from instead of measuring.

    Example:
        >>> auto = planner.Auto(allow=("bf16", "int8", "int4", "topk@0.01"))
        >>> stats = gradcomp.all_reduce(grad, auto)
        >>> auto.plans  # {group: {numel: Prediction}}
    """

    def __init__(self, allow=SAFE, profile: Profile | None = None):
        self.allow, self.profile = checked_candidates(allow, profile), profile
        self.profiles: dict = {}  # group -> the combined profile
        self.plans: dict = {}  # group -> numel -> Prediction
        self._compressors: dict = {}  # label -> Compressor

    def settings(self) -> dict:
        return {
            "name": "auto",
            "allow": [label(from_spec(c)) for c in self.allow],
            "profile": "given" if self.profile is not None else "measured",
        }

    def choice(self, q, tensor: torch.Tensor, hierarchy=None) -> tuple[Compressor, Prediction]:
        """(on ``q``'s worker) The compressor and the plan for ``tensor`` on ``q``'s group
        (``hierarchy``: its nodes, where the hierarchical algorithm may be weighed)."""
        plans = self.plans.setdefault(q.group, {})
        key = (tensor.numel(), tensor.dtype)
        if hierarchy is not None and len(hierarchy.nodes) > 1:
            key += (hierarchy.node_size,)  # planned for these nodes
        plan = plans.get(key)
        if plan is None:
            if q.world_size == 1 or tensor.numel() == 0:  # nothing to send
                plan = dense_plan([tensor.numel()])[0]
            else:
                profile = self._profile(q, tensor, hierarchy)
                plan = best_plan([tensor.numel()], q.world_size, profile, self.allow, dtypes=[tensor.dtype])[
                    0
                ]
            plans[key] = plan
        compressor = self._compressors.get(plan.compressor)
        if compressor is None:
            compressor = self._compressors[plan.compressor] = from_spec(plan.compressor)
        return compressor, plan

    def _profile(self, q, tensor: torch.Tensor, hierarchy) -> Profile:
        key = q.group if hierarchy is None or len(hierarchy.nodes) == 1 else (q.group, hierarchy.node_size)
        found = self.profiles.get(key)
        if found is None:
            # Later calls of other sizes plan from these lines: a grid up to 1M elements at least.
            grid = link_sizes([tensor.numel(), 2**20])
            found = self.profiles[key] = agreed_profile(
                self.profile, self.allow, grid, grid, q.group, tensor.device, hierarchy
            )
        return found


def checked_candidates(allow, profile: Profile | None = None) -> tuple:
    """``allow`` as a tuple (a string splits at commas), checked; ``profile`` checked too."""
    allow = SAFE if allow is None else allow
    if isinstance(allow, str):
        allow = [c.strip() for c in allow.split(",") if c.strip()]
    allow = tuple(allow)
    for spec in allow:
        if not isinstance(spec, (str, Compressor)):
            raise TypeError(f"allow holds compressors' names or Compressors, got {spec!r}")
    if not allow:
        raise ValueError("allow names no candidate")
    flat_routes(allow, None)  # unknown names and low-rank ones raise here
    if profile is not None and not isinstance(profile, Profile):
        raise TypeError(f"profile must be a gradcomp.planner.Profile, got {type(profile).__name__}")
    if profile is not None:  # found now, not after the warm-up
        missing = [key for key in (label(from_spec(c)) for c in allow) if key != "none"]
        missing = [key for key in dict.fromkeys(missing) if key not in profile.codecs]
        if missing:
            raise ValueError(
                f"the profile of {profile.device} has no measurement of {', '.join(map(repr, missing))} "
                f"(it has {sorted(profile.codecs)}); measure them: python -m gradcomp probe --compressors ..."
            )
    return allow


def agreed_profile(
    injected: Profile | None, allow, sizes: list[int], codec_sizes: list[int], group, device, hierarchy=None
):
    """Every rank's profile combined (the slowest of each): ``injected`` where given, else
    measured by :func:`probe` on ``device`` (the link at ``sizes``, the codecs at
    ``codec_sizes``; the levels of ``hierarchy`` where it has several nodes of several
    ranks). A collective: every rank calls it at the same point.

    Raises:
        ValueError: the profile's nodes are not ``hierarchy``'s (an injected profile's).
    """
    if injected is None:
        return probe(sizes, allow, codec_sizes, group=group, device=device, hierarchy=hierarchy)[0]
    everyone = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, injected, group=group)
    profile = combine(everyone)
    nodes = profile.nodes
    if nodes is not None and (hierarchy is None or (nodes.size, nodes.count) != _layout(hierarchy)):
        group = "has no usable node layout"
        if hierarchy is not None:
            size, count = _layout(hierarchy)
            group = f"holds {count} x {size} ({hierarchy.source})"
        raise ValueError(
            f"gradcomp auto: the profile's nodes hold {nodes.count} x {nodes.size} ranks, the group {group}"
        )
    return profile


def _layout(hierarchy) -> tuple[int, int]:
    return hierarchy.node_size, len(hierarchy.nodes)


def link_sizes(sizes: list[int]) -> list[int]:
    """Where to time the link for buckets of ``sizes``: their sizes and a grid below, up to
    16 MB of fp32 (the line through them extrapolates; a slow link takes seconds beyond)."""
    top = min(max(sizes), LINK_MAX)
    grid = {*(min(n, LINK_MAX) for n in sizes if n > 0), *(2**k for k in (12, 16, 20) if 2**k < top)}
    return sorted(grid) or [2**12]


def is_auto(compressor) -> bool:
    """Whether ``compressor`` asks gradcomp to choose (``"auto"`` or an :class:`Auto`)."""
    return isinstance(compressor, Auto) or (isinstance(compressor, str) and compressor.lower() == "auto")
