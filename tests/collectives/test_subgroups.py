"""gradcomp's private groups on NCCL with a device-bound default group.

gradcomp creates groups of its own: a clone of every group it runs
collectives on, and the node and cross-node groups of the hierarchical
all-reduce. With ``init_process_group(device_id=...)`` torch creates an NCCL
group's communicator by splitting the default group's when the group's
options name a split source, a collective of every rank of the job. A group
that only its members create (``use_local_synchronization``, as gradcomp's
are) must therefore carry no split source that torch itself did not set for
it: its members alone would wait in the split.

These ranks run Gloo (a CPU machine has no NCCL), so the NCCL side is a
model of what torch 2.13 does with a new group's options:

* ``torch/distributed/distributed_c10d.py``, ``_new_group_with_tag``: only
  the members create a group made with ``use_local_synchronization``;
  ``_new_process_group_helper``: when the default group is bound to a device,
  its NCCL backend (``_get_split_source``) becomes the options'
  ``split_from`` and ``_process_group_color(ranks)`` their ``split_color``;
  otherwise both keep what the options held. ``global_ranks_in_group`` and
  ``group_name`` are always the new group's; ``_timeout`` is the ``timeout``;
  without options it makes ``ProcessGroupNCCL.Options()``.
* ``torch/csrc/distributed/c10d/init.cpp``, the ``ProcessGroupNCCL.Options``
  binding: attributes ``is_high_priority_stream``, ``config``
  (``ncclConfig_t``), ``split_from``, ``split_color``,
  ``global_ranks_in_group``, ``group_name``; ``copy.deepcopy`` copies every
  member (the split source is the same backend), as ``split_group`` in
  distributed_c10d.py relies on.
* ``torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp``, ``initNCCLComm``:
  with ``split_from`` set the communicator is ``ncclCommSplit`` of the split
  source's with ``split_color``; without, ``ncclCommInitRankConfig`` among
  the group's ranks.

Where torch has NCCL (the GPU machine) the last test holds the model's
attributes and its deep copy against the real binding.
"""

from __future__ import annotations

import copy
import datetime

import pytest
import torch
import torch.distributed as dist

import gradcomp
from gradcomp.collectives import group_timeout, groups, queue_for
from tests.utils import gather, run_ranks, seeded_randn

NCCL_CONFIG_UNDEF_INT = -(2**31)  # nccl.h: a config field left to NCCL's default


class NCCLConfig:
    """``ProcessGroupNCCL.NCCLConfig`` (``ncclConfig_t``) as torch binds it."""

    def __init__(self):
        self.blocking = self.cga_cluster_size = self.min_ctas = self.max_ctas = NCCL_CONFIG_UNDEF_INT
        self.split_share = NCCL_CONFIG_UNDEF_INT
        self.net_name = None  # NCCL_CONFIG_UNDEF_PTR


class ProcessGroupNCCL:
    """What gradcomp may read of torch's NCCL backend: its type's name, its
    ``options`` and the ``Options`` class; ``ranks``: the group's (global)."""

    class Options:
        def __init__(self, is_high_priority_stream: bool = False):
            self.backend = "nccl"
            self._timeout = datetime.timedelta(minutes=10)  # kProcessGroupNCCLDefaultTimeout
            self.is_high_priority_stream = is_high_priority_stream
            self.config = NCCLConfig()
            self.split_from = None
            self.split_color = 0
            self.global_ranks_in_group: list[int] = []
            self.group_name = ""

        def __deepcopy__(self, memo):
            # The binding's copy constructor: members copied, split_from the same backend.
            twin = copy.copy(self)
            twin.config = copy.copy(self.config)
            twin.global_ranks_in_group = list(self.global_ranks_in_group)
            return twin

    supports_splitting = True

    def __init__(self, options: Options, ranks: list[int]):
        self.options, self.ranks = options, ranks


class NCCLModel:
    """``dist.new_group`` and gradcomp's backend lookup as they would be on
    NCCL (see the module's description); the groups themselves are Gloo's.
    ``made``: one ``(ranks, local, options, communicator)`` per group this
    rank joined, ``communicator`` ``("split", parent ranks, colour)`` or
    ``("init", ranks)``."""

    def __init__(self, world_options: ProcessGroupNCCL.Options):
        self.real_new_group, self.real_backend_of = dist.new_group, groups._backend_of
        world = dist.group.WORLD
        world_options._timeout = group_timeout(world)
        world_options.group_name = world.group_name  # the default group's ranks stay []
        self.backends = {world: ProcessGroupNCCL(world_options, list(range(dist.get_world_size())))}
        self.made: list[tuple] = []

    def __enter__(self):
        dist.new_group, groups._backend_of = self.new_group, self.backend_of
        return self

    def __exit__(self, *exc):
        dist.new_group, groups._backend_of = self.real_new_group, self.real_backend_of

    def backend_of(self, group, device_type: str):
        return self.backends.get(group) if device_type == "cuda" else self.real_backend_of(group, device_type)

    def new_group(
        self, ranks=None, timeout=None, backend=None, pg_options=None, use_local_synchronization=False
    ):
        default = dist.distributed_c10d._get_default_group()
        bound = default.bound_device_id
        ranks = sorted(ranks) if ranks is not None else list(range(dist.get_world_size()))
        split_source = self.backends[default] if bound is not None else None
        default.bound_device_id = None  # Gloo groups cannot be bound to a device
        try:
            group = self.real_new_group(
                ranks, timeout=timeout, backend=backend, use_local_synchronization=use_local_synchronization
            )
        finally:
            default.bound_device_id = bound
        if dist.get_rank() not in ranks:
            return group
        options = pg_options if pg_options is not None else ProcessGroupNCCL.Options()
        options._timeout = timeout if timeout is not None else dist.constants.default_pg_timeout
        if split_source is not None:
            options.split_from = split_source
            options.split_color = dist.distributed_c10d._process_group_color(ranks)
        options.global_ranks_in_group, options.group_name = ranks, group.group_name
        self.backends[group] = ProcessGroupNCCL(options, ranks)
        if options.split_from is not None:
            communicator = ("split", options.split_from.ranks, options.split_color)
        else:
            communicator = ("init", ranks)
        self.made.append((ranks, use_local_synchronization, options, communicator))
        return group


def _options(high_priority: bool, min_ctas: int) -> ProcessGroupNCCL.Options:
    """Options a user passes to ``init_process_group`` or ``new_group`` (``pg_options``)."""
    options = ProcessGroupNCCL.Options(is_high_priority_stream=high_priority)
    options.config.blocking, options.config.cga_cluster_size = 0, 2
    options.config.min_ctas, options.config.max_ctas = min_ctas, 16
    options.config.split_share, options.config.net_name = 1, "IB"
    return options


def _private_groups_on_nccl(rank: int, world_size: int) -> None:
    world, node = list(range(world_size)), [rank - rank % 2, rank - rank % 2 + 1]
    default = dist.distributed_c10d._get_default_group()
    pair_timeout = datetime.timedelta(seconds=20)
    with NCCLModel(_options(True, 4)) as model:
        default.bound_device_id = torch.device("cpu", 0)  # as init_process_group(device_id=...) leaves it
        try:
            # The user's groups, split from the default group's communicator, with settings of their own.
            pairs = [dist.new_group(p, pair_timeout, pg_options=_options(False, 8)) for p in ([0, 1], [2, 3])]
            users = len(model.made)
            x = seeded_randn(3000, 7919 * rank)
            exact = torch.stack(gather(x)).mean(0)
            result = x.clone()
            gradcomp.all_reduce(result, "none", algorithm="hierarchical", node_size=2)
            torch.testing.assert_close(result, exact, rtol=1e-6, atol=1e-6)
            result = x.clone()
            gradcomp.all_reduce(result, "none", group=pairs[rank // 2])
            torch.testing.assert_close(result, torch.stack(gather(x)).view(2, 2, -1)[rank // 2].mean(0))
        finally:
            default.bound_device_id = None
    colour = dist.distributed_c10d._process_group_color
    for ranks, local, _, communicator in model.made:
        where = f"group of {ranks} (local={local}): {communicator}"
        if communicator[0] == "split":
            # A split is a collective of every rank of the split source, with the group's own colour.
            assert communicator[1:] == (world, colour(ranks)), where
            assert not local or ranks == world, f"{where}: its members alone would wait in the split"
        else:
            assert communicator == ("init", ranks), where
    # gradcomp's: the clone of the world, the node's and the cross-node group (made
    # from the clone), the clone of the pair; each with the settings of its source.
    clone = queue_for(None).group
    made = [(ranks, local) for ranks, local, _, _ in model.made[users:]]
    assert made == [(world, True), (node, True), ([rank % 2, rank % 2 + 2], True), (node, True)], made
    sources = [dist.group.WORLD, clone, clone, pairs[rank // 2]]
    for (ranks, _, options, _), source in zip(model.made[users:], sources, strict=True):
        where, expected = f"options of gradcomp's group of {ranks}", model.backends[source].options
        assert options.is_high_priority_stream == expected.is_high_priority_stream, where
        assert options._timeout == expected._timeout, where
        for field in ("blocking", "cga_cluster_size", "min_ctas", "max_ctas", "net_name"):
            assert getattr(options.config, field) == getattr(expected.config, field), f"{where}: {field}"
        assert options.config.split_share == NCCL_CONFIG_UNDEF_INT, where
        assert options.global_ranks_in_group == ranks, where


@pytest.mark.slow
def test_private_groups_on_a_device_bound_nccl_job_connect_among_their_members():
    run_ranks(_private_groups_on_nccl, 4, timeout=120, group_timeout=30)


def test_the_model_has_the_attributes_of_torchs_nccl_options():
    # Where torch has NCCL (the GPU machine): the model above reads and
    # writes what the real binding has, and the real copy keeps the split fields.
    if not dist.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    real = dist.ProcessGroupNCCL.Options(is_high_priority_stream=True)
    model = ProcessGroupNCCL.Options(is_high_priority_stream=True)
    for name in vars(model):
        assert hasattr(real, name), name
    real.split_color, real.global_ranks_in_group, real.group_name = 5, [0, 1], "g"
    twin = copy.deepcopy(real)
    assert (twin.split_color, twin.global_ranks_in_group, twin.group_name) == (5, [0, 1], "g")
    assert twin.is_high_priority_stream
    if hasattr(real, "config"):
        for name in vars(model.config):
            assert hasattr(real.config, name) or name == "split_share", name
