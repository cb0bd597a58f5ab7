"""The compressed all-reduce over torchft's replica groups: :class:`Compression`.

torchft's process groups are not members of torch.distributed's world (no global
ranks, no clones), and its Manager replaces the communicator inside whenever the
quorum changes. So each call runs the flat algorithms in the caller's thread on the
communicator the Manager configured last (:func:`communicator_of`), averaged over the
step's participants, its residual changes settled when torchft commits or discards the
step. :mod:`gradcomp.integrations.torchft` builds torchft's DDP and optimizer wrapper
on it, :mod:`gradcomp.diloco.replicas` DiLoCo's exchanges; the module docstring of the
first says what a user does and why the heal carries no residuals.
"""

from __future__ import annotations

import dataclasses
import datetime
from collections.abc import Hashable

import torch
import torch.distributed as dist

from gradcomp import ops
from gradcomp.collectives.agreement import settings_key
from gradcomp.collectives.dispatch import job_steps
from gradcomp.collectives.inline import InlineGroup
from gradcomp.collectives.job import Job
from gradcomp.collectives.low_rank import warm_start_key
from gradcomp.collectives.policy import HIERARCHICAL, check_algorithm
from gradcomp.collectives.reduce import key_of
from gradcomp.collectives.stats import ReduceStats
from gradcomp.collectives.two_phase import owner_key, owner_ranges
from gradcomp.collectives.worker import drive
from gradcomp.compressors import Compressor, get_compressor
from gradcomp.compressors.base import check_tensor
from gradcomp.feedback import ErrorFeedback, UndoLog


def communicator_of(pg) -> dist.ProcessGroup:
    """The torch.distributed group a torchft process group runs on now (``pg.parent``,
    replaced at each reconfiguration; followed through torchft groups that wrap others).
    Its ``rank()`` is the quorum's; the torchft wrapper's own ``rank()`` is 0 on every replica."""
    from torchft.process_group import ProcessGroupWrapper

    seen = pg
    while isinstance(seen, ProcessGroupWrapper):
        try:
            seen = seen.parent
        except AssertionError:  # torchft asserts on a group it has not configured yet
            raise RuntimeError(
                "gradcomp: the torchft process group is not configured yet: call the Manager's "
                "start_quorum() (the optimizer wrapper's zero_grad()) before the step's all-reduces"
            ) from None
    if not isinstance(seen, dist.ProcessGroup) or type(seen).__module__.startswith("torchft"):
        raise TypeError(
            f"gradcomp runs on torchft's ProcessGroupGloo and ProcessGroupNCCL (a communicator in this "
            f"process), not {type(pg).__name__}"
        )
    return seen


# What a failed exchange raises (Gloo's and NCCL's errors, a timeout, a peer gone): reported to
# the Manager, which discards the step. Anything else is a bug or misuse and raises.
EXCHANGE_ERRORS = (RuntimeError, TimeoutError, ConnectionError)


@dataclasses.dataclass
class _Route:
    """How a tensor was last reduced: the quorum's size and this replica's rank, the algorithm."""

    world_size: int
    rank: int
    algorithm: str


class Compression:
    """gradcomp's compressed all-reduce on a torchft Manager's process group, with error
    feedback that follows torchft's commits and heals.

    Args:
        manager: the :class:`torchft.Manager` (its ``pg`` a torchft ``ProcessGroupGloo`` or
            ``ProcessGroupNCCL``).
        compressor: a :class:`~gradcomp.compressors.Compressor` or a spec (``"int8"``,
            ``"topk:ratio=0.01"``, ``"powersgd:rank=4"``); not ``"auto"``, whose plans
            would have to be agreed again at every quorum.
        algorithm: ``"dense"``, ``"allgather"`` or ``"two_phase"``; default by the
            compressor and the quorum's size, as :func:`gradcomp.all_reduce` picks.
        key: the name its heal state is registered under with the Manager
            (``register_state_dict_fn``); every replica registers the same keys.
        compressor_options: options of a compressor given by name.

    Attributes:
        feedback: the residuals (an :class:`~gradcomp.ErrorFeedback`), keyed by the names
            passed to :meth:`all_reduce`.
        bytes_sent, dense_bytes: what this replica sent over the calls so far, and what a
            dense ring all-reduce of the same tensors would have sent
            (:class:`~gradcomp.ReduceStats`'s counting).
        commits, discards: the steps :meth:`should_commit` committed and discarded.
    """

    def __init__(
        self,
        manager,
        compressor: Compressor | str,
        *,
        algorithm: str | None = None,
        key: str = "gradcomp",
        **compressor_options,
    ):
        if isinstance(compressor, str) and compressor.split(":")[0] == "auto":
            raise ValueError(
                "gradcomp on torchft takes a fixed compressor, not 'auto': name one (int8, topk, ...)"
            )
        self.compressor = get_compressor(compressor, **compressor_options)
        if algorithm == HIERARCHICAL:
            raise ValueError(
                "gradcomp on torchft runs the flat algorithms: 'dense', 'allgather' or 'two_phase'"
            )
        if algorithm is not None:
            check_algorithm(self.compressor, algorithm)
        self.manager = manager
        self.algorithm = algorithm
        self.feedback = ErrorFeedback()
        self._log = UndoLog(self.feedback)
        self._group: InlineGroup | None = None
        self._routes: dict[int, _Route] = {}  # as of the last commit
        self._step_routes: dict[int, _Route] = {}  # this step's
        self._sat_out: ErrorFeedback | None = None  # this step's residuals of a replica not participating
        self._quorum = None  # the quorum (its future) of the step the residual changes belong to
        self._replicated: dict = {}  # the state every replica holds alike, at the last commit
        self.bytes_sent = 0
        self.dense_bytes = 0
        self.commits = 0
        self.discards = 0
        manager.register_state_dict_fn(key, self._load_heal_state, self._heal_state)

    def all_reduce(self, tensor: torch.Tensor, name: Hashable, op: str = "avg") -> ReduceStats | None:
        """Average ``tensor`` in place over the replica groups that take part in this step.

        Waits for the step's quorum first. A replica that does not take part (it heals
        this step) sends zeros, keeps its residuals, and gets the others' average. An
        error of the exchange (a replica died) goes to the Manager (``report_error``), which
        then discards the step: the tensor holds no average and the call returns None, as
        do the step's later calls. A disagreement on the settings raises ``ValueError``
        on every replica.

        Args:
            tensor: a floating tensor, the same shape and dtype on every replica.
            name: the tensor's residual key (a DDP bucket's index, a parameter's name),
                the same on every replica and step after step.
            op: ``"avg"`` (over the participants) or ``"sum"``.
        """
        check_tensor(tensor)
        ops.check_forced_backend()
        if op not in ("avg", "sum"):
            raise ValueError(f"op must be 'avg' or 'sum', got {op!r}")
        if not tensor.is_contiguous():
            raise ValueError("gradcomp on torchft reduces contiguous tensors in place: pass a contiguous one")
        self._check_device(tensor.device)
        q = self._ready()
        if q is None:
            return None
        manager = self.manager
        participants = manager.num_participants()
        feedback = self.feedback
        if not manager.is_participating():
            tensor.zero_()
            feedback = self._sat_out = self._sat_out or ErrorFeedback()
        key = key_of(name)
        algorithm = check_algorithm(self.compressor, self.algorithm, q.world_size)
        try:
            with self._log.recording():
                if feedback is self.feedback:
                    self._hand_over(key, q, algorithm, tensor)
                job = Job(tensor, self.compressor, "sum", algorithm, feedback, key, manager.current_step())
                stats = drive(job_steps(job, q))
        except EXCHANGE_ERRORS as error:  # the exchange failed: torchft discards the step
            if isinstance(error, torch.OutOfMemoryError):
                raise
            manager.report_error(error)
            return None
        if op == "avg":
            tensor.div_(participants)
        self.bytes_sent += stats.bytes_sent
        self.dense_bytes += stats.dense_bytes
        return stats

    def sums(self, values: list[float], device: torch.device) -> list[float] | None:
        """The sums of ``values`` over the quorum's replica groups (fp64: exact for counts and
        small integers; a tensor on ``device``, the tensors' device, a CUDA one for NCCL);
        None where the exchange failed (reported to the Manager, as :meth:`all_reduce`)."""
        self._check_device(torch.device(device))
        q = self._ready()
        if q is None:
            return None
        total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
        try:
            dist.all_reduce(total, group=q.group)
        except EXCHANGE_ERRORS as error:
            if isinstance(error, torch.OutOfMemoryError):
                raise
            self.manager.report_error(error)
            return None
        return total.tolist()

    def _check_device(self, device: torch.device) -> None:
        backend = str(getattr(self.manager._pg, "getBackendName", lambda: "")())
        if "nccl" in backend and device.type != "cuda":
            raise ValueError(f"gradcomp on torchft: {backend} reduces CUDA tensors, not {device.type} ones")

    def _ready(self) -> InlineGroup | None:
        """The step's quorum waited for, its group view; None where the step already failed
        (or its quorum did: reported)."""
        manager = self.manager
        if getattr(manager, "_quorum_future", True) is None:
            raise RuntimeError(
                "gradcomp on torchft: no quorum started: call the Manager's start_quorum() (the "
                "optimizer wrapper's zero_grad()) before the step's all-reduces"
            )
        if manager.errored() is not None:
            return None
        try:
            manager.wait_quorum()
        except Exception as error:  # no quorum: torchft discards the step
            manager.report_error(error)
            return None
        if manager.errored() is not None:  # the quorum's reconfiguration failed (torchft reported it)
            return None
        quorum = manager._quorum_future
        if self._quorum is not quorum and (
            self._log.before or self._step_routes or self._sat_out is not None
        ):
            raise RuntimeError(
                "gradcomp on torchft: a new step began before the last one was settled: commit through "
                "Compression.should_commit() (gradcomp's OptimizerWrapper does), not the Manager's own"
            )
        self._quorum = quorum
        return self._quorum_group()

    def should_commit(self, timeout: datetime.timedelta | None = None) -> bool:
        """``manager.should_commit()``, with the residuals settled: the step's kept where
        the replicas commit it, those before it put back where they discard it."""
        try:
            committed = self.manager.should_commit(timeout)
        except BaseException:  # no verdict (torchft's retries ran out, its RPC timed out): as discarded
            self._settle(False)
            raise
        self._settle(committed)
        return committed

    def _settle(self, committed: bool) -> None:
        sat_out, self._sat_out = self._sat_out, None
        routes, self._step_routes = self._step_routes, {}
        if committed:
            self._log.before.clear()
            self._routes.update(routes)
            if sat_out is not None:  # the state every replica holds alike, as this step left it
                for name in _replicated_keys(sat_out):
                    self.feedback.set(name, sat_out.get(name))
            self._replicated = {
                name: self.feedback.get(name).clone() for name in _replicated_keys(self.feedback)
            }
            self.commits += 1
        else:
            self._log.undo()
            self.discards += 1

    def _quorum_group(self) -> InlineGroup:
        """The group view of the communicator the Manager configured last; a new one when
        it changed (a new quorum)."""
        communicator = communicator_of(self.manager._pg)
        if self._group is None or self._group.group is not communicator:
            size = communicator.size()  # the quorum's ranks: no global ones
            timeout = getattr(self.manager._pg, "_timeout", None) or dist.constants.default_pg_timeout
            self._group = InlineGroup(
                communicator,
                rank=communicator.rank(),
                world_size=size,
                ranks=list(range(size)),
                timeout=timeout,
            )
        return self._group

    def _hand_over(self, key: int, q: InlineGroup, algorithm: str, tensor: torch.Tensor) -> None:
        """Where tensor ``key`` was reduced in another quorum (or by another algorithm), the
        residual a two_phase owner kept of the chunks it owned there goes into this
        replica's own residual, to be sent by this call."""
        route = _Route(q.world_size, q.rank, algorithm)
        last = self._step_routes.get(key) or self._routes.get(key)  # a second call this step: its route
        self._step_routes[key] = route
        if last is None or last == route:
            return
        held = self.feedback.pop(owner_key(key))
        if held is None:
            return
        flat = tensor.reshape(-1)
        residual = self.feedback.residual(key, flat)
        at = 0
        for begin, end in owner_ranges(
            self.compressor, last.algorithm, flat.numel(), last.world_size, last.rank, flat.device
        ):
            residual.view(-1)[begin:end].add_(held[at : at + end - begin].to(residual.dtype))
            at += end - begin

    def _heal_state(self) -> dict:
        """What a healing replica takes from this one (torchft calls it, on its quorum
        thread): the settings and the state every replica holds alike, as of the last commit."""
        return {"settings": settings_key(self.compressor), "replicated": dict(self._replicated)}

    def _load_heal_state(self, state: dict) -> None:
        """Take a peer's heal state: its replicated state, and no residuals."""
        mine = settings_key(self.compressor)
        if state["settings"] != mine:
            raise ValueError(
                f"gradcomp on torchft: this replica compresses with {mine}, the peer it heals from "
                f"with {state['settings']}: every replica group needs the same compressor"
            )
        self.feedback.clear()
        self._log.before.clear()
        self._routes.clear()
        self._step_routes.clear()
        for name, value in state["replicated"].items():
            self.feedback.set(name, value.clone())
        self._replicated = dict(state["replicated"])

    def state_dict(self) -> dict:
        """For this replica's own checkpoint: its residuals, as of the last commit."""
        if self._log.before:
            raise RuntimeError("gradcomp on torchft: save between steps, after should_commit()")
        routes = {key: dataclasses.astuple(route) for key, route in self._routes.items()}
        return {
            "settings": settings_key(self.compressor),
            "feedback": self.feedback.state_dict(),
            "routes": routes,
        }

    def load_state_dict(self, state: dict) -> None:
        if state["settings"] != settings_key(self.compressor):
            raise ValueError(
                f"gradcomp on torchft: the checkpoint compressed with {state['settings']}, "
                f"this replica with {settings_key(self.compressor)}"
            )
        self.feedback.load_state_dict(state["feedback"])
        self._replicated = {name: self.feedback.get(name).clone() for name in _replicated_keys(self.feedback)}
        # Where each tensor was last reduced: a two_phase owner's residual is handed over from
        # there if this run's quorum differs.
        self._routes = {key: _Route(*route) for key, route in state.get("routes", {}).items()}
        self._step_routes.clear()


def _replicated_keys(feedback: ErrorFeedback) -> list:
    """The entries every replica holds alike: PowerSGD's warm starts."""
    return [name for name in feedback.keys() if isinstance(name, tuple) and name[:1] == warm_start_key(0)[:1]]
