"""The planner: the predicted time of a compressed all-reduce on a measured
link and device, and the compressor and algorithm it picks per bucket.

A :class:`Profile` holds what a machine measured: the link as an
alpha-beta fit of all-reduce times (latency per ring step, bytes per second
per rank), and per compressor the seconds to encode and to decode ``n``
elements as ``overhead + n / rate``. :func:`predict` adds the exchange time
of the scale model (:mod:`gradcomp.collectives.scale`: the bytes one rank
sends, the ring steps) and the encode and decode passes each algorithm
makes; :func:`best_plan` takes, per bucket, the candidate with the least
predicted time, so a bucket below the break-even size stays dense.
:func:`measure_link` and :func:`measure_codec` make a profile on this
machine (``python -m gradcomp probe``); :func:`combine` makes every rank's
measurements one profile (the slowest of each), so every rank chooses alike.
:class:`Auto` is ``gradcomp.all_reduce(tensor, "auto")``'s planner.

The package, one concern a module: :mod:`~gradcomp.planner.specs` (candidates
by name), :mod:`~gradcomp.planner.profiles` (what a machine measured, its
JSON), :mod:`~gradcomp.planner.model` (predictions and plans),
:mod:`~gradcomp.planner.measure` (measuring, :func:`probe`) and
:mod:`~gradcomp.planner.auto` (:class:`Auto`).

Example:
    >>> profile = planner.Profile.load()  # the stored 2-core CPU profile (on a CPU machine)
    >>> plan = planner.best_plan([6_553_600, 4096], 16, profile.with_link(1e9 / 8))  # 1 Gbit/s
    >>> [(p.compressor, p.algorithm) for p in plan]
    [('int4', 'two_phase'), ('int8', 'allgather')]
"""

from gradcomp.planner.auto import Auto, agreed_profile, checked_candidates, is_auto, link_sizes
from gradcomp.planner.measure import (
    BUSY_SHAPE,
    CODEC_REPEATS,
    LINK_MAX,
    busy,
    default_device,
    device_name,
    fit_link,
    measure_codec,
    measure_collectives,
    measure_link,
    measure_nodes,
    measure_pingpong,
    probe,
    unsupported_fits,
)
from gradcomp.planner.model import (
    MARGIN,
    Prediction,
    best_plan,
    dense_plan,
    exposed_seconds,
    flat_routes,
    passes,
    predict,
    routes,
    runner_up,
    saves,
)
from gradcomp.planner.profiles import STORED, Codec, Linear, Nodes, Profile, combine
from gradcomp.planner.specs import SAFE, from_spec, label

__all__ = [
    "BUSY_SHAPE",
    "CODEC_REPEATS",
    "LINK_MAX",
    "MARGIN",
    "SAFE",
    "STORED",
    "Auto",
    "Codec",
    "Linear",
    "Nodes",
    "Prediction",
    "Profile",
    "agreed_profile",
    "busy",
    "from_spec",
    "checked_candidates",
    "routes",
    "best_plan",
    "combine",
    "runner_up",
    "default_device",
    "dense_plan",
    "device_name",
    "exposed_seconds",
    "fit_link",
    "is_auto",
    "label",
    "link_sizes",
    "measure_codec",
    "measure_collectives",
    "measure_link",
    "measure_nodes",
    "measure_pingpong",
    "flat_routes",
    "passes",
    "predict",
    "probe",
    "unsupported_fits",
    "saves",
]
