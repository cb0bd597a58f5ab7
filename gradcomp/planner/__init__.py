"""The planner: the predicted time of a compressed all-reduce on a measured
link and device, and the compressor and algorithm it picks per bucket.

A :class:`Profile` holds what a machine measured: the link as an
alpha-beta fit of all-reduce times (latency per ring step, bytes per second
per rank), and per compressor the seconds to encode and to decode ``n``
elements as ``overhead + n / rate``. :func:`predict` adds the exchange time
of the cost model (:mod:`gradcomp.collectives.cost_model`: the bytes one rank
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

from gradcomp.planner.auto import Auto, is_auto
from gradcomp.planner.auto import agreed_profile as agreed_profile
from gradcomp.planner.auto import checked_candidates as checked_candidates
from gradcomp.planner.auto import link_sizes as link_sizes
from gradcomp.planner.measure import (
    BUSY_SHAPE as BUSY_SHAPE,
)
from gradcomp.planner.measure import (
    CODEC_REPEATS as CODEC_REPEATS,
)
from gradcomp.planner.measure import (
    LINK_MAX as LINK_MAX,
)
from gradcomp.planner.measure import (
    busy as busy,
)
from gradcomp.planner.measure import (
    default_device as default_device,
)
from gradcomp.planner.measure import (
    device_name as device_name,
)
from gradcomp.planner.measure import (
    fit_link as fit_link,
)
from gradcomp.planner.measure import (
    measure_codec as measure_codec,
)
from gradcomp.planner.measure import (
    measure_collectives as measure_collectives,
)
from gradcomp.planner.measure import (
    measure_link as measure_link,
)
from gradcomp.planner.measure import (
    measure_nodes as measure_nodes,
)
from gradcomp.planner.measure import (
    measure_pingpong as measure_pingpong,
)
from gradcomp.planner.measure import (
    probe,
)
from gradcomp.planner.measure import (
    unsupported_fits as unsupported_fits,
)
from gradcomp.planner.model import (
    MARGIN as MARGIN,
)
from gradcomp.planner.model import (
    Prediction,
    best_plan,
    predict,
)
from gradcomp.planner.model import (
    dense_plan as dense_plan,
)
from gradcomp.planner.model import (
    exposed_seconds as exposed_seconds,
)
from gradcomp.planner.model import (
    flat_routes as flat_routes,
)
from gradcomp.planner.model import (
    passes as passes,
)
from gradcomp.planner.model import (
    routes as routes,
)
from gradcomp.planner.model import (
    runner_up as runner_up,
)
from gradcomp.planner.model import (
    saves as saves,
)
from gradcomp.planner.profiles import STORED as STORED
from gradcomp.planner.profiles import Codec as Codec
from gradcomp.planner.profiles import Linear as Linear
from gradcomp.planner.profiles import Nodes as Nodes
from gradcomp.planner.profiles import Profile
from gradcomp.planner.profiles import combine as combine
from gradcomp.planner.specs import SAFE, from_spec, label

__all__ = [
    "SAFE",
    "Auto",
    "Prediction",
    "Profile",
    "best_plan",
    "from_spec",
    "is_auto",
    "label",
    "predict",
    "probe",
]
