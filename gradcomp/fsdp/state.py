"""What gradcomp keeps for a model sharded with FSDP2: the options, the step, the
residuals, the statistics, and the two reductions its comms run."""

from __future__ import annotations

import dataclasses
import warnings

import torch
import torch.distributed as dist

from gradcomp.collectives import (
    HIERARCHICAL,
    Chooser,
    Job,
    ReduceStats,
    c10d,
    check_algorithm,
    hierarchy_for,
    key_of,
)
from gradcomp.collectives.chooser import chosen_steps
from gradcomp.collectives.inline import InlineGroup
from gradcomp.collectives.node_layout import check_node_size
from gradcomp.collectives.parameter_gather import parameter_gather
from gradcomp.collectives.reduce_scatter import (
    compressed_reduce_scatter,
    hierarchical_reduce_scatter,
    padded_row,
    reduce_scatter_bytes,
)
from gradcomp.collectives.worker import drive
from gradcomp.compressors import Compressor, get_compressor
from gradcomp.ddp.stats import StepLedger, StepStats
from gradcomp.feedback import ErrorFeedback

SCHEMA_VERSION = 1
RESIDUALS = ("fp32", "bf16", None)
_NONE = get_compressor("none")


@dataclasses.dataclass(frozen=True)
class FSDPOptions:
    """The options of :func:`gradcomp.fsdp.register`, checked when made.

    Attributes:
        warmup_steps: the first steps (backward passes that communicate)
            reduce dense.
        min_numel: a unit whose gradient shard (replicate all-reduce) or
            reduce-scatter input has fewer elements reduces dense.
        algorithm: the replicate all-reduce's algorithm (default from the
            compressor and the replicate group's size); not ``"hierarchical"``.
        residual: the reduce-scatter's error feedback: None (default: none),
            ``"fp32"`` (an fp32 residual the size of the unit's unsharded
            gradient: more memory than FSDP saves by sharding from 4 ranks on)
            or ``"bf16"`` (the same in bf16). On the LM task at 2 and 4 ranks,
            int8 ended within 1% of dense FSDP's loss with each of the three
            (bench/reports/fsdp-cpu2-2026-12-04.md).
        scatter_algorithm: the reduce-scatter's: ``"flat"`` (every row compressed
            to its rank) or ``"hierarchical"`` (a shard group spanning nodes: an
            all-to-all inside each node in ``intra``, then compressed rows between
            nodes, one a node).
        node_size: ranks per node for ``"hierarchical"`` (consecutive ranks of the
            shard group); default torchrun's ``LOCAL_WORLD_SIZE``, else host names.
        intra: the dtype rows travel in inside a node: ``"bf16"`` (default) or None
            (the gradients' reduce dtype).
        history: how many steps' statistics to keep.
    """

    warmup_steps: int = 0
    min_numel: int = 0
    algorithm: str | None = None
    residual: str | None = None
    scatter_algorithm: str = "flat"
    node_size: int | None = None
    intra: str | None = "bf16"
    history: int = 1000

    def __post_init__(self):
        for name in ("warmup_steps", "min_numel"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        if not isinstance(self.history, int) or self.history < 1:
            raise ValueError(f"history must be an int >= 1, got {self.history!r}")
        if self.residual == "full":  # its old name
            warnings.warn(
                "gradcomp: residual='full' is now residual='fp32' (as the DDP hook's); 'full' goes",
                FutureWarning,
                stacklevel=4,
            )
            object.__setattr__(self, "residual", "fp32")
        if self.residual not in RESIDUALS:
            raise ValueError(f"residual must be one of {RESIDUALS}, got {self.residual!r}")
        if self.scatter_algorithm not in ("flat", HIERARCHICAL):
            raise ValueError(
                f"scatter_algorithm must be 'flat' or 'hierarchical', got {self.scatter_algorithm!r}"
            )
        if self.intra not in ("bf16", None):
            raise ValueError(f"intra must be 'bf16' or None, got {self.intra!r}")
        check_node_size(self.node_size)
        if self.algorithm == HIERARCHICAL:
            raise ValueError(
                "algorithm='hierarchical' does not apply to the replicate all-reduce: the replicate "
                "group holds one rank a node already (shard inside each node with fully_shard)"
            )


class FSDPState:
    """gradcomp's state for an FSDP2 model (:func:`gradcomp.fsdp.register` makes it).

    Attributes:
        compressor: the replicate all-reduce's compressor or chooser (None without
            a replicate group).
        reduce_scatter: the reduce-scatter's compressor (None: FSDP's own).
        parameters: the parameter all-gather's compressor (None: FSDP's own).
        replicate_group: the group of this rank's replicas (None: none).
        step: backward passes that communicated so far (each unit once at most).
        feedback: the replicate all-reduces' residuals, per unit.
        scatter_feedback: the reduce-scatters' residuals, per unit.
    """

    def __init__(
        self,
        compressor: Compressor | Chooser | None,
        reduce_scatter: Compressor | None,
        replicate_group: dist.ProcessGroup | None,
        options: FSDPOptions,
        parameters: Compressor | None = None,
    ):
        self.compressor = compressor
        self.reduce_scatter = reduce_scatter
        self.replicate_group = replicate_group
        self.parameters = parameters
        self.options = options
        self.process_group = None  # the world: checkpoints are per global rank
        self.step = 0
        self.feedback = ErrorFeedback()
        self.scatter_feedback = ErrorFeedback()  # fp32, or bf16 with residual="bf16"
        self.ledger = StepLedger(options.history)
        self.partial: dict[int, torch.Tensor] = {}  # unit -> reduce-scatter outputs held back
        self._open: StepStats | None = None
        self._callback_queued = False
        self._replicas = InlineGroup(replicate_group) if replicate_group is not None else None
        self._shard_groups: dict[dist.ProcessGroup, InlineGroup] = {}

    # ------------------------------------------------------------------ statistics
    @property
    def stats(self) -> list[StepStats]:
        """The last ``history`` steps' statistics, oldest first."""
        return self.ledger.closed

    @property
    def last_stats(self) -> StepStats | None:
        return self.ledger.closed[-1] if self.ledger.closed else None

    def settings(self) -> dict:
        """What every rank must agree on."""

        def described(compressor) -> str | None:
            return None if compressor is None else repr(sorted(compressor.settings().items()))

        return {
            "compressor": described(self.compressor),
            "reduce_scatter": described(self.reduce_scatter),
            "parameters": described(self.parameters),
            "replicate_size": None if self._replicas is None else self._replicas.world_size,
            **dataclasses.asdict(self.options),
        }

    # ------------------------------------------------------------------ the reductions
    def replicate(self, unit: int, output: torch.Tensor, op: str) -> None:
        """All-reduce unit ``unit``'s gradient shard ``output`` across the replicas, in place."""
        replicas = self._replicas
        dense = self.step < self.options.warmup_steps or output.numel() < self.options.min_numel
        job = Job(output, _NONE, op, "dense", None, key_of((unit, "replicate")), self.step)
        if dense:
            stats, how = replicas.run(job), "none dense"
        elif isinstance(self.compressor, Compressor):
            job.compressor, job.feedback = self.compressor, self.feedback
            job.algorithm = check_algorithm(self.compressor, self.options.algorithm, replicas.world_size)
            stats = replicas.run(job)
            how = f"{self.compressor.name} {job.algorithm}"
        else:  # a chooser ("auto")
            job.compressor, job.feedback, job.algorithm = None, self.feedback, None
            stats = drive(chosen_steps(self.compressor, job, replicas))
            how = f"{stats.compressor} {stats.algorithm}"
        stats.bytes_sent_inter = stats.bytes_sent
        self._record(unit, stats, how)

    def shard_group(self, group: dist.ProcessGroup) -> InlineGroup:
        """The inline group of a unit's shard group (made once; with
        ``scatter_algorithm="hierarchical"`` its nodes' groups too: call it on every
        rank in the same order, as register does)."""
        inline = self._shard_groups.get(group)
        if inline is None:
            inline = self._shard_groups[group] = InlineGroup(group)
            if self.options.scatter_algorithm == HIERARCHICAL and self.reduce_scatter is not None:
                hierarchy_for(inline, self.options.node_size)
        return inline

    def scatter(
        self, unit: int, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup, op, factor
    ) -> None:
        """FSDP's reduce-scatter of unit ``unit``, compressed: ``op`` is FSDP's (AVG, SUM,
        or a PREMUL_SUM by ``1 / factor``)."""
        shard_group = self.shard_group(group)
        world = shard_group.world_size
        divisor, scale = _divisors(op, world, factor)
        if self.step < self.options.warmup_steps or input.numel() < self.options.min_numel:
            c10d.reduce_scatter_single(output, input, op=dist.ReduceOp.SUM, group=group)
            if divisor != 1:
                output.div_(divisor)
            nbytes = input.numel() * input.element_size()
            stats = ReduceStats(reduce_scatter_bytes(nbytes, world), reduce_scatter_bytes(nbytes, world))
            how = "none reduce_scatter"
        elif self.options.scatter_algorithm == HIERARCHICAL:
            hierarchy = hierarchy_for(shard_group, self.options.node_size)
            numel = len(hierarchy.nodes) * padded_row(self.reduce_scatter, output.numel())
            residual = self._scatter_residual(unit, numel, input.device)
            intra = (
                None
                if self.options.intra is None
                else getattr(torch, {"bf16": "bfloat16"}[self.options.intra])
            )
            key = key_of((unit, "reduce_scatter"))
            stats = hierarchical_reduce_scatter(
                output,
                input,
                self.reduce_scatter,
                hierarchy,
                intra_dtype=intra,
                divisor=divisor,
                residual=residual,
                step=self.step,
                key=key,
            )
            how = f"{self.reduce_scatter.name} hierarchical_reduce_scatter"
        else:
            numel = world * padded_row(self.reduce_scatter, output.numel())
            residual = self._scatter_residual(unit, numel, input.device)
            stats = compressed_reduce_scatter(
                output,
                input,
                self.reduce_scatter,
                group,
                divisor=divisor,
                residual=residual,
                step=self.step,
                key=key_of((unit, "reduce_scatter")),
            )
            how = f"{self.reduce_scatter.name} reduce_scatter"
        if scale is not None:
            output.mul_(scale)
        if self._replicas is not None:
            stats.bytes_sent_intra = stats.bytes_sent  # the shard group: inside a node
        self._record(unit, stats, f"{how}@rs", scatter=True)

    def gather(self, unit: int, output: torch.Tensor, input: torch.Tensor, group: dist.ProcessGroup) -> None:
        """FSDP's all-gather of unit ``unit``'s parameters, compressed (dense in the warm-up).
        Its bytes count in the step whose backward pass comes next."""
        if self.step < self.options.warmup_steps:
            c10d.all_gather_single(output, input, group=group)
            world = dist.get_world_size(group)
            nbytes = (world - 1) * input.numel() * input.element_size()
            stats, how = ReduceStats(nbytes, nbytes), "none parameter_gather"
        else:
            stats = parameter_gather(output, input, self.parameters, group, key=key_of((unit, "gather")))
            how = f"{self.parameters.name} parameter_gather"
        if self._open is None:
            self._open = StepStats(self.step)
        step = self._open  # bytes and time only: a unit counts once a step, for its gradients
        step.bytes_sent += stats.bytes_sent
        step.dense_bytes += stats.dense_bytes
        step.compress_seconds += stats.compress_seconds
        step.compressors[(unit, "parameter_gather")] = how

    def _scatter_residual(self, unit: int, numel: int, device: torch.device) -> torch.Tensor | None:
        if self.options.residual is None or not self.reduce_scatter.needs_feedback:
            return None
        key = key_of((unit, "reduce_scatter"))
        residual = self.scatter_feedback.get(key)
        if residual is None:
            dtype = torch.bfloat16 if self.options.residual == "bf16" else torch.float32
            residual = torch.zeros(numel, dtype=dtype, device=device)
            self.scatter_feedback.set(key, residual)
        elif residual.device != device:  # restored from a checkpoint on another device
            residual = residual.to(device)
            self.scatter_feedback.set(key, residual)
        if residual.numel() != numel:
            raise ValueError(
                f"unit {unit}'s reduce-scatter residual has {residual.numel()} elements, not {numel}"
            )
        return residual

    def _record(self, unit: int, stats: ReduceStats, how: str, scatter: bool = False) -> None:
        if self._open is None:
            self._open = StepStats(self.step)
        self._open.add(stats, compressed=not how.startswith("none "))
        self._open.compressors[(unit, "reduce_scatter" if scatter else "replicate")] = how.removesuffix("@rs")
        if not self._callback_queued:
            self._callback_queued = True
            try:  # closes the step once the backward pass has run every unit's reduction
                torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
            except RuntimeError:  # called outside a backward pass: the step closes now
                self.end_backward()

    def end_backward(self) -> None:
        """The backward pass is over: its statistics close and the step advances."""
        self._callback_queued = False
        if self._open is None:
            return
        ledger = self.ledger
        ledger.closed.append(self._open)
        del ledger.closed[: max(0, len(ledger.closed) - ledger.history)]
        self._open = None
        self.step += 1

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """This rank's residuals, held-back shards and step: loaded into a fresh state
        of the same settings before the first step, a run continues bit for bit."""
        return {
            "version": SCHEMA_VERSION,
            "step": self.step,
            "settings": self.settings(),
            "feedback": self.feedback.state_dict(),
            "scatter_feedback": self.scatter_feedback.state_dict(),
            "partial": {unit: t.clone() for unit, t in self.partial.items()},
        }

    def load_state_dict(self, saved: dict) -> None:
        version = saved.get("version")
        if version != SCHEMA_VERSION:
            raise ValueError(
                f"gradcomp FSDP state of schema {version!r}; this version reads {SCHEMA_VERSION}"
            )
        if saved["settings"].get("residual") == "full":  # saved under its old name
            saved = {**saved, "settings": {**saved["settings"], "residual": "fp32"}}
        if saved["settings"] != self.settings():
            differ = sorted(k for k in self.settings() if saved["settings"].get(k) != self.settings()[k])
            raise ValueError(f"the checkpoint's gradcomp FSDP settings differ in {differ}")
        self.step = int(saved["step"])
        self.feedback.load_state_dict(saved["feedback"])
        self.scatter_feedback.load_state_dict(saved["scatter_feedback"])
        self.partial = {int(unit): t.clone() for unit, t in saved["partial"].items()}


def _divisors(op, world: int, factor: float | None) -> tuple[int, float | None]:
    """(an integer divisor, a scale after it) that together apply FSDP's ``op``."""
    if op == dist.ReduceOp.AVG:
        return world, None
    if op == dist.ReduceOp.SUM:
        return 1, None
    if factor is None:
        raise ValueError(f"gradcomp's reduce-scatter takes AVG, SUM or FSDP's PREMUL_SUM, got {op!r}")
    return 1, 1.0 / factor
