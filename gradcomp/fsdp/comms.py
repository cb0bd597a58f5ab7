"""What :func:`register` puts on each FSDP2 unit: the replicas' all-reduce hook, the
compressed reduce-scatter and parameter gather, and the checks it makes first
(the package's docstring says how they plug into FSDP2)."""

from __future__ import annotations

import hashlib
import warnings
import weakref

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather, ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_common import DDPMeshInfo

from gradcomp import planner, streams
from gradcomp.collectives import verify_settings
from gradcomp.collectives.arrival import wait_for_every_rank
from gradcomp.collectives.chooser import as_chooser
from gradcomp.collectives.inline import InlineGroup
from gradcomp.collectives.reduce_scatter import check_reduce_scatter_compressor
from gradcomp.compressors import Compressor, get_compressor, split_options
from gradcomp.fsdp.state import FSDPOptions, FSDPState

_REGISTERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # unit -> its state

OPTIONS = (
    "warmup_steps",
    "min_numel",
    "algorithm",
    "residual",
    "scatter_algorithm",
    "node_size",
    "intra",
    "history",
)


def register(
    model: torch.nn.Module,
    compressor: Compressor | str,
    *,
    replicate_group: dist.ProcessGroup | None = None,
    reduce_scatter: Compressor | str | None = None,
    parameters: Compressor | str | None = None,
    **options,
) -> FSDPState:
    """Compress the gradient reductions of every FSDP2 unit of ``model``; the state.

    Args:
        model: a model with ``fully_shard`` applied (to it and to its blocks), each
            unit on a 1-D mesh (not native 2-D HSDP), one parameter group a unit.
        compressor: with ``replicate_group``, the all-reduce between replicas'
            (any compressor, ``"auto"`` included); without, the reduce-scatter's
            (a quantizer or a 16-bit cast).
        replicate_group: the group of the ranks that hold this rank's shard on the
            other nodes (``mesh["replicate"].get_group()``).
        reduce_scatter: with ``replicate_group``, a compressor for FSDP's
            reduce-scatter inside the node too (``"bf16"``); None keeps FSDP's own.
        parameters: a compressor for FSDP's all-gather of the parameters (``"int8"``):
            every rank computes with the same weights, each shard encoded by its
            owner and decoded by all; the optimizer updates the exact shards. For
            shard groups that span nodes, where these all-gathers are most of the
            traffic between nodes; it costs accuracy (see the README).
        options: :class:`FSDPOptions` (``warmup_steps``, ``min_numel``,
            ``algorithm``, ``residual``, ``scatter_algorithm``, ``node_size``,
            ``intra``, ``history``) and the compressor's own; one that neither takes
            raises ``ValueError`` naming the nearest of both and both lists, before any
            collective.

    Every rank must call it with the same settings (ranks that differ raise).
    """
    # The options first, before the model and any collective: a typo raises on its rank alone.
    named = ("compressor", "replicate_group", "reduce_scatter", "parameters", *OPTIONS)
    own, options = split_options(compressor, options, named, "gradcomp.fsdp.register")
    fsdp_options = FSDPOptions(**own)
    units = fsdp_units(model)
    if replicate_group is None:
        if reduce_scatter is not None:
            raise ValueError(
                "reduce_scatter= names the reduce-scatter's compressor beside a replicate_group; "
                "without one, the compressor is the reduce-scatter's"
            )
        replicate, scatter = None, _scatter_compressor(compressor, options)
    else:
        replicate = as_chooser(compressor) if planner.is_auto(compressor) else None
        if replicate is not None and options:
            raise ValueError(f"compressor='auto' takes no compressor options, got {sorted(options)}")
        replicate = replicate or get_compressor(compressor, **options)
        if isinstance(replicate, Compressor) and replicate.low_rank:
            raise ValueError(
                f"{replicate.name!r} needs the gradients' matrices; FSDP hands the replicas a flat shard"
            )
        scatter = None if reduce_scatter is None else _scatter_compressor(reduce_scatter, {})
    if fsdp_options.scatter_algorithm == "hierarchical" and (scatter is None or replicate_group is not None):
        raise ValueError(
            "scatter_algorithm='hierarchical' is the compressed reduce-scatter of a shard group that spans "
            "nodes: register without replicate_group (with one, the shard group is a node)"
        )
    gather = None if parameters is None else _scatter_compressor(parameters, {})
    if gather is not None:
        _check_gathered_dtypes(model, units)
    registered = [name for name, module in model.named_modules() if module in _REGISTERED]
    if registered:
        raise RuntimeError(
            f"gradcomp.fsdp.register was already called on this model (unit {registered[0] or '(root)'!r}): "
            "a second call would replace the first's hooks and orphan its state and residuals. Register "
            "once; to change the settings, shard a new model"
        )
    state = FSDPState(replicate, scatter, replicate_group, fsdp_options, gather)
    device = _device_of(model)
    world = InlineGroup(None)
    wait_for_every_rank(None, "gradcomp.fsdp.register")  # before the collectives below
    verify_settings(world, "gradcomp.fsdp.register's settings", state.settings(), device)
    if replicate_group is not None:
        _check_replicas(units, replicate_group, device)
    else:
        _warn_unreduced_replicas(model, units)
    for index, (unit, param_group) in enumerate(units):
        if scatter is not None:  # its groups made here, in unit order on every rank
            state.shard_group(param_group.mesh_info.shard_process_group)
        if gather is not None:
            unit.set_custom_all_gather(CompressedParameterGather(state, index))
        if replicate is not None:
            unit.set_all_reduce_hook(ReplicateHook(state, index, param_group))
        if scatter is not None:
            unit.set_custom_reduce_scatter(CompressedReduceScatter(state, index, param_group))
        _REGISTERED[unit] = state
    return state


class ReplicateHook:
    """``set_all_reduce_hook``'s hook of one unit: its gradient shard all-reduced across
    the replicas, compressed. Under ``set_requires_all_reduce(False)`` (FSDP calls the
    hook all the same) the shard is held back and zeroed, and added to the next one
    that is all-reduced, as native HSDP does."""

    def __init__(self, state: FSDPState, unit: int, param_group):
        self.state, self.unit, self.param_group = state, unit, param_group

    def __call__(self, output: torch.Tensor) -> None:
        state, unit = self.state, self.unit
        # FSDP allocated ``output`` on its reduce-scatter stream and frees it (into that
        # stream's pool) once it has cast or accumulated it, whatever this stream still
        # has queued on it: the next unit's reduce-scatter would overwrite it.
        streams.keep_for_current_stream(output)
        held = state.partial.get(unit)
        if held is not None and held.device != output.device:  # restored with map_location="cpu"
            held = state.partial[unit] = held.to(output.device)
        if not self.param_group.all_reduce_grads:
            if held is None:
                state.partial[unit] = output.clone()
            else:
                held += output
            output.zero_()  # FSDP accumulates it into .grad next: nothing yet
            return
        if held is not None:
            output += held
            streams.keep_for_current_stream(held)  # load_state_dict made it on another stream
            del state.partial[unit]
        # FSDP divides by the shard group's size (AVG); a divide factor the user sets is the whole
        # world's, applied in the reduce-scatter (PREMUL_SUM), and the hook must only sum.
        op = "sum" if self.param_group.gradient_divide_factor is not None else "avg"
        state.replicate(unit, output, op)


class _Allocates:
    """FSDP's buffers as its default comms allocate them: plain ``torch.empty``."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)


class CompressedReduceScatter(_Allocates, ReduceScatter):
    """``set_custom_reduce_scatter``'s comm of one unit: FSDP's reduce-scatter, compressed."""

    def __init__(self, state: FSDPState, unit: int, param_group):
        self.state, self.unit, self.param_group = state, unit, param_group

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        factor = self.param_group.gradient_divide_factor
        self.state.scatter(self.unit, output_tensor, input_tensor, group, op, factor)
        return None


class CompressedParameterGather(_Allocates, AllGather):
    """``set_custom_all_gather``'s comm of one unit: FSDP's parameter all-gather, compressed
    (synchronous: FSDP waits on no work)."""

    def __init__(self, state: FSDPState, unit: int):
        self.state, self.unit = state, unit

    def __call__(self, output_tensor, input_tensor, group, async_op: bool = False):
        self.state.gather(self.unit, output_tensor, input_tensor, group)
        return None


def _param_groups(state) -> list:
    """A unit's parameter groups: torch 2.11 holds one (``_fsdp_param_group``,
    None without parameters), torch 2.13 a list (``_fsdp_param_groups``)."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = state._fsdp_param_group
    return [] if group is None else [group]


def fsdp_units(model: torch.nn.Module) -> list[tuple[FSDPModule, object]]:
    """Every FSDP2 unit of ``model`` with parameters, and its one parameter group, in
    module order (the same on every rank); ``ValueError`` for what cannot be compressed."""
    units = []
    for name, module in model.named_modules():
        if not isinstance(module, FSDPModule):
            continue
        groups = _param_groups(module._get_fsdp_state())
        if len(groups) > 1:
            raise ValueError(
                f"FSDP unit {name or '(root)'!r} holds {len(groups)} parameter groups (shard_placement_fn "
                "with several meshes): gradcomp compresses units of one parameter group"
            )
        if not groups:
            continue
        if isinstance(groups[0].mesh_info, DDPMeshInfo):
            raise ValueError(
                f"FSDP unit {name or '(root)'!r} is on a 2-D mesh (native HSDP): FSDP all-reduces between "
                "replicas before any hook and that all-reduce cannot be compressed. Shard each unit on the "
                "mesh's shard dimension (fully_shard(module, mesh=mesh['shard'])) and pass "
                "replicate_group=mesh['replicate'].get_group()"
            )
        units.append((module, groups[0]))
    if not units:
        raise TypeError(
            "register needs a model sharded with torch.distributed.fsdp.fully_shard, "
            f"got {type(model).__name__}"
        )
    return units


def _check_gathered_dtypes(model: torch.nn.Module, units) -> None:
    """``ValueError`` for a unit whose parameters FSDP would all-gather in several dtypes:
    it gathers them as bytes then, which no compressor can encode."""
    names = {id(module): name for name, module in model.named_modules()}
    for module, param_group in units:
        # FSDPParam.init_dtype_attrs, at FSDP's lazy init: the policy's param_dtype for
        # floating parameters where it is set, else the parameter's own dtype.
        cast = param_group.mp_policy.param_dtype
        dtypes = {
            cast if cast is not None and p.sharded_param.dtype.is_floating_point else p.sharded_param.dtype
            for p in param_group.fsdp_params
        }
        if len(dtypes) > 1 or not next(iter(dtypes)).is_floating_point:
            found = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
            raise ValueError(
                f"FSDP unit {names[id(module)] or '(root)'!r} all-gathers its parameters in {found}: "
                "parameters= compresses one floating dtype a unit. Give fully_shard a "
                "MixedPrecisionPolicy(param_dtype=...) or shard the parameters of other dtypes apart"
            )


def _scatter_compressor(compressor, options: dict) -> Compressor:
    if planner.is_auto(compressor):
        raise ValueError(
            "the reduce-scatter takes a compressor, not 'auto' ('auto' chooses the replicas' all-reduce)"
        )
    compressor = get_compressor(compressor, **options)
    check_reduce_scatter_compressor(compressor)
    return compressor


def _device_of(model: torch.nn.Module) -> torch.device:
    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")


def _warn_unreduced_replicas(model: torch.nn.Module, units) -> None:
    """Warn where shard groups apart hold the same model without a replicate_group: each
    trains its replica with its own data and nothing all-reduces between them (a 2-D
    mesh sharded on ``mesh["shard"]``), so the replicas drift apart. Groups holding
    other models (pipeline stages) are left alone. A collective over the world."""
    shards = dist.get_process_group_ranks(units[0][1].mesh_info.shard_process_group)
    structure = repr([(name, tuple(p.shape)) for name, p in model.named_parameters()])
    mine = (tuple(shards), hashlib.sha1(structure.encode()).hexdigest())
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    groups = sorted({ranks for ranks, kind in everyone if kind == mine[1]})
    if len(groups) > 1:  # on every such rank alike: under -W error, all of them raise
        warnings.warn(
            f"gradcomp.fsdp.register: shard groups {groups} each hold this model and no replicate_group "
            "was given: nothing all-reduces the gradients between them, so these replicas drift apart. "
            "Pass replicate_group=mesh['replicate'].get_group() (custom HSDP), or shard on the whole mesh",
            stacklevel=3,
        )


def _check_replicas(units, replicate_group: dist.ProcessGroup, device: torch.device) -> None:
    """``ValueError`` on every rank of the replicas unless each holds the same shard of
    the same units: the same place in a shard group of the same size."""
    mine = []
    for module, param_group in units:
        info = param_group.mesh_info
        shapes = tuple(tuple(p.shape) for p in module.parameters(recurse=False))
        mine.append((info.shard_mesh_rank, info.shard_mesh_size, shapes))
    everyone = [None] * dist.get_world_size(replicate_group)
    dist.all_gather_object(everyone, mine, group=replicate_group)
    if any(other != mine for other in everyone):
        ranks = dist.get_process_group_ranks(replicate_group)
        places = ", ".join(
            f"rank {r}: shard {o[0][0]} of {o[0][1]}" for r, o in zip(ranks, everyone, strict=True)
        )
        raise ValueError(
            "replicate_group does not fit the mesh: its ranks must hold the same shard (the same rank in "
            f"shard groups of one size, the same units); found {places}"
        )
