"""Lightning: a Trainer callback that compresses DDP's gradients with gradcomp, and
:func:`register_fabric` for Lightning Fabric.

Lightning registers ``DDPStrategy(ddp_comm_hook=...)`` only when its root
device is a GPU; on CPUs a run with gradcomp's hook passed that way trains
dense without a word. This callback registers the hook itself, on any
device, logs what it sends, and keeps each rank's hook state (residuals
differ between ranks) in the trainer's checkpoints, so that
``trainer.fit(ckpt_path=...)`` continues the compressed run.

Example:
    >>> from gradcomp.integrations.lightning import GradientCompression
    >>> trainer = lightning.Trainer(strategy="ddp", devices=2,
    ...                             callbacks=[GradientCompression("int8", warmup_steps=10)])
"""

from __future__ import annotations

import torch
import torch.distributed as dist

try:
    from lightning.pytorch.callbacks import Callback
except ImportError as error:  # the extra is missing
    raise ImportError(
        'this module needs Lightning: pip install -e ".[lightning]" or pip install lightning'
    ) from error

from gradcomp import ddp
from gradcomp.ddp import records
from gradcomp.ddp.checkpoint import check_missing_residuals, without_residuals
from gradcomp.integrations import common


class GradientCompression(Callback):
    """Register gradcomp's DDP hook on the strategy's model and checkpoint its state.

    Args:
        compressor: a compressor name or object (see :func:`gradcomp.get_compressor`),
            or ``"auto"``.
        log: log ``gradcomp/ratio``, ``gradcomp/bytes_sent`` (and
            ``gradcomp/relative_error`` with ``measure_error=True``) every step.
        missing_residuals: what ``fit(ckpt_path=...)`` does with a checkpoint that
            holds no state of this callback (saved by a dense run): ``"raise"``
            (default) refuses it; ``"zero"`` warns and begins compressing from it,
            residuals at zero and the hook's warm-up from the start.
        **options: :func:`gradcomp.ddp.register`'s options, the hook's and
            the compressor's (``warmup_steps``, ``algorithm``, ``ratio``, ...).

    Attributes:
        state: the :class:`gradcomp.ddp.HookState` once fitting has started.
    """

    def __init__(self, compressor="int8", log: bool = True, missing_residuals: str = "raise", **options):
        self.compressor = compressor
        self.log = log
        self.missing_residuals = check_missing_residuals(missing_residuals)
        self.options = options
        self.state: ddp.HookState | None = None
        self._model = None  # the DDP wrapper the hook is registered on
        self._restored: dict | None = None
        own = ("log", "missing_residuals")  # bad settings fail now, in one message
        common.check_options(compressor, options, common.DDP_OPTIONS, "GradientCompression", own)

    def on_fit_start(self, trainer, pl_module) -> None:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise RuntimeError(
                "GradientCompression needs a DDP strategy (strategy='ddp'); "
                f"the model is a {type(model).__name__}"
            )
        if self.state is None:
            self.state = ddp.register(model, self.compressor, **self.options)
        elif model is not self._model:
            # Lightning wraps the model anew for every fit: the hook goes on the new wrapper.
            model.register_comm_hook(self.state, ddp.hook)
        self._model = model
        if self._restored is not None:
            self._load(self._restored)
            self._restored = None
        elif trainer.ckpt_path is not None:  # Lightning restores no state it does not find
            without_residuals(self.missing_residuals, f"the checkpoint {trainer.ckpt_path}", ValueError)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        stats = self.state.last_stats if self.state is not None else None
        if not self.log or stats is None:
            return
        values = {"gradcomp/ratio": stats.ratio, "gradcomp/bytes_sent": float(stats.bytes_sent)}
        if self.options.get("measure_error"):
            values["gradcomp/relative_error"] = stats.relative_error
        pl_module.log_dict(values, on_step=True, on_epoch=False, rank_zero_only=True)

    def state_dict(self) -> dict:
        """Every rank's hook state, gathered (Lightning writes rank 0's checkpoint):
        a collective, so checkpoints must be saved by every rank, as
        ``ModelCheckpoint`` and ``trainer.save_checkpoint`` do."""
        rank, world = _rank_and_world()
        mine = records.record(self.state, rank, world) if self.state is not None else None
        if world == 1:
            return {"ranks": [mine]}
        everyone = [None] * world
        dist.all_gather_object(everyone, mine)
        return {"ranks": everyone}

    def load_state_dict(self, state_dict: dict) -> None:
        # Lightning restores callbacks before it wraps the model: apply at fit start.
        self._restored = state_dict

    def _load(self, saved: dict) -> None:
        ranks = saved["ranks"]
        rank, world = _rank_and_world()
        if len(ranks) != world:
            raise ValueError(
                f"the checkpoint holds the compression state of {len(ranks)} ranks and this run has {world}: "
                "residuals belong to their rank; resume on the same number of ranks"
            )
        # Every rank checks every rank's entry (all are in the checkpoint): where one is refused,
        # every rank raises.
        opened = [
            None if entry is None else records.opened(entry, self.state, r, f"the checkpoint's rank {r}")
            for r, entry in enumerate(ranks)
        ]
        if opened[rank] is not None:  # residuals move to their gradients' device at first use
            self.state.load_state_dict(opened[rank][0])


def register_fabric(module, compressor="int8", **options) -> ddp.HookState:
    """Register gradcomp's DDP hook on a model ``fabric.setup`` returned (Lightning Fabric's
    ``DDPStrategy`` takes no comm hook); its state.

    Args:
        module: what ``fabric.setup(model, ...)`` returned, on a DDP strategy.
        compressor, options: as :func:`gradcomp.ddp.register`'s.

    Each rank keeps its own residuals: save them with ``gradcomp.ddp.save_rank_file(state,
    folder)`` on every rank beside ``fabric.save`` (which writes from rank 0 only), and
    restore them with ``gradcomp.ddp.load_rank_file`` (``missing_residuals="zero"`` begins
    compressing from a checkpoint saved without them, residuals at zero).

    Example:
        >>> fabric = lightning.Fabric(strategy="ddp", devices=2)
        >>> model, optimizer = fabric.setup(model, optimizer)
        >>> state = register_fabric(model, "int8", warmup_steps=10)
    """
    common.check_options(compressor, options, common.DDP_OPTIONS, "register_fabric")
    wrapped = getattr(module, "_forward_module", module)
    if not isinstance(wrapped, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(
            f"register_fabric needs the module fabric.setup returned on a DDP strategy (strategy='ddp'); "
            f"it wraps a {type(wrapped).__name__}"
        )
    return ddp.register(wrapped, compressor, **options)


def _rank_and_world() -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()
