"""Process groups gradcomp creates: a private clone of a group for its worker, and
subgroups (a node's ranks, one rank a node) with the group's backends, timeout and
options, named alike on every member."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import logging
import threading

import torch
import torch.distributed as dist

from gradcomp.collectives.waiting import TimedOut, seconds, wait_for_ranks

logger = logging.getLogger(__name__)

# The most jobs paused at once, their exchanges in flight (each holds its gathered
# payloads until it finishes). On Gloo a collective's latency is several times a
# small bucket's codec time: one job in flight left the worker waiting on it.


def clone_group(group: dist.ProcessGroup, what: str | None = None) -> dist.ProcessGroup:
    """A private group of ``group``'s ranks with its backends, timeout and options;
    ``what``: the call it is made for, as waits name it (:func:`new_group_like`)."""
    return new_group_like(group, dist.get_process_group_ranks(group), what)


def new_group_like(group: dist.ProcessGroup, ranks: list[int], what: str | None = None) -> dist.ProcessGroup:
    """A group of ``ranks`` (global ranks, a subset of ``group``'s) with
    ``group``'s backends, timeout and options.

    Its ranks first meet in the store (:func:`~gradcomp.collectives.waiting.wait_for_ranks`),
    which warns while some have not come, naming them and ``what`` the group is made for
    (the call that makes it); at the group's timeout, ``RuntimeError`` naming them. Only
    then do they connect: a backend's own rendezvous waits the whole timeout in silence
    and fails with its store key.

    Created by the given ranks only (``use_local_synchronization``): every
    rank must create the groups it belongs to in the same order. torch names
    such a group after its ranks and how many groups this process already
    holds, which differs between ranks that joined different subgroups
    before (they would wait for each other under different names until the
    timeout): the name here counts only gradcomp's groups of these ranks. With a
    device-bound default group (``init_process_group(device_id=...)``),
    torch would create it by splitting the default group's communicator, a
    collective over every rank of the job, which the ranks outside ``ranks``
    never join: for a group smaller than the job the binding is lifted for
    the call, and the group connects on its own, among its ranks. NCCL
    groups get fresh options with ``group``'s settings
    (:func:`_nccl_options_like`), never its communicator's split source.
    """
    timeout = group_timeout(group)
    options = {"timeout": timeout, "backend": dist.get_backend_config(group)}
    nccl = _backend_of(group, "cuda")
    if nccl is not None and type(nccl).__name__ == "ProcessGroupNCCL":
        options["pg_options"] = _nccl_options_like(nccl, timeout)
    default = dist.distributed_c10d._get_default_group()
    bound = getattr(default, "bound_device_id", None)
    lift = bound is not None and len(ranks) < dist.get_world_size()
    call = what or "its first call on them"
    making = f"the creation of gradcomp's process group of ranks {ranks} for {call}"
    with _GROUPS_LOCK:
        name = _next_name(ranks)
        _meet(name, ranks, making, timeout or dist.constants.default_pg_timeout)
        with _named(ranks, name):
            if lift:
                default.bound_device_id = None
            try:
                return dist.new_group(ranks=ranks, use_local_synchronization=True, **options)
            except dist.DistError as error:  # a rank left between meeting and connecting
                raise RuntimeError(f"gradcomp: {making} failed: {error}") from error
            finally:
                if lift:
                    default.bound_device_id = bound


def _meet(name: str, ranks: list[int], making: str, timeout: datetime.timedelta) -> None:
    """Every rank of ``ranks`` at the creation of group ``name``, or ``RuntimeError``
    naming those that did not come within ``timeout``."""
    store = dist.distributed_c10d._get_default_store()
    prefix = f"gradcomp/groups/{name}"
    store.set(f"{prefix}/{dist.get_rank()}", b"1")
    missing = wait_for_ranks(store, {rank: f"{prefix}/{rank}" for rank in ranks}, making, timeout)
    if missing:
        raise TimedOut(
            f"gradcomp: {making}: ranks {missing} did not come within the group's timeout "
            f"({seconds(timeout.total_seconds())}): every rank of a group makes gradcomp's calls on it, "
            "in the same order (a call under `if rank == 0:` leaves the others out)"
        )


# ncclConfig_t fields (as torch binds them) a new communicator takes from its
# group's: the job's tuning (blocking calls, CTA counts, cluster size, network
# plugin), nothing that names a communicator. Not split_share: it makes a split
# child share its parent's internal resources, and the worker's group must
# progress on its own beside the model's (a clone of the whole job is split).
_NCCL_CONFIG_FIELDS = ("blocking", "cga_cluster_size", "min_ctas", "max_ctas", "net_name")


def _nccl_options_like(nccl, timeout: datetime.timedelta | None):
    """New ``ProcessGroupNCCL.Options`` with the settings of backend ``nccl``'s.

    Not a copy: torch's ``_new_process_group_helper`` writes ``split_from``
    and ``split_color`` into the options of a group it splits from a
    device-bound default group, and overwrites them only where it splits
    again, which it does not for the groups this module creates with the
    binding lifted. With a copy's, ProcessGroupNCCL (``initNCCLComm``) would
    split the new group's communicator from the default group's with the
    colour of ``nccl``'s ranks, a collective of every rank that the ranks
    outside the new group never join: a hang. ``global_ranks_in_group`` and
    ``group_name`` are the new group's, set by torch.
    """
    parent = nccl.options
    options = type(nccl).Options(is_high_priority_stream=parent.is_high_priority_stream)
    if timeout is not None:
        options._timeout = timeout  # torch warns where it differs from the group's timeout
    config, fresh = getattr(parent, "config", None), getattr(options, "config", None)
    if config is not None and fresh is not None:
        for field in _NCCL_CONFIG_FIELDS:
            value = getattr(config, field, None)
            if value is not None:  # an unset net_name reads None; setting None would fail
                setattr(fresh, field, value)
    return options


_GROUPS_LOCK = threading.Lock()
_GROUPS_MADE: dict[tuple[int, ...], int] = {}  # ranks -> how many gradcomp groups of them this process made


def _next_name(ranks: list[int]) -> str:
    """(holding ``_GROUPS_LOCK``) The name of the next gradcomp group of ``ranks``:
    ``gradcomp-<digest>`` of the ranks and how many such groups this process made
    before, a name every member agrees on."""
    number = _GROUPS_MADE.get(tuple(ranks), 0)
    _GROUPS_MADE[tuple(ranks)] = number + 1
    digest = hashlib.sha1(f"{sorted(ranks)}/{number}".encode(), usedforsecurity=False).hexdigest()
    return f"gradcomp-{digest}"


@contextlib.contextmanager
def _named(ranks: list[int], group_name: str):
    """While creating gradcomp's group of ``ranks``: torch names it ``group_name``."""
    c10d = dist.distributed_c10d
    original = getattr(c10d, "_process_group_name", None)
    if original is None:  # a torch that names groups otherwise: nothing to fix
        yield
        return

    def name(of_ranks, use_hashed_name):
        if use_hashed_name and sorted(of_ranks) == sorted(ranks):
            return group_name
        return original(of_ranks, use_hashed_name)

    c10d._process_group_name = name
    try:
        yield
    finally:
        c10d._process_group_name = original


def _backend_of(group: dist.ProcessGroup, device_type: str):
    """``group``'s backend object for ``device_type``, or None."""
    try:
        return group._get_backend(torch.device(device_type))
    except (RuntimeError, ValueError):
        return None


def group_timeout(group: dist.ProcessGroup) -> datetime.timedelta | None:
    """The timeout ``group`` was created with (None where torch does not say:
    the clone then gets torch's default)."""
    for device_type in ("cuda", "cpu"):
        options = getattr(_backend_of(group, device_type), "options", None)
        timeout = getattr(options, "_timeout", None)
        if timeout is not None:
            return timeout
    logger.warning("gradcomp: cannot read the timeout of process group %s; its clone gets the default", group)
    return None
