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
from gradcomp.compressors import get_compressor
from gradcomp.ddp import records
from gradcomp.ddp.hook import OLD_NAMES


class GradientCompression(Callback):
    """Register gradcomp's DDP hook on the strategy's model and checkpoint its state.

    Args:
        compressor: a compressor name or object (see :func:`gradcomp.get_compressor`).
        log: log ``gradcomp/ratio``, ``gradcomp/bytes_sent`` (and
            ``gradcomp/relative_error`` with ``measure_error=True``) every step.
        **options: :func:`gradcomp.ddp.register`'s options, the hook's and
            the compressor's (``warmup_steps``, ``algorithm``, ``ratio``, ...).

    Attributes:
        state: the :class:`gradcomp.ddp.HookState` once fitting has started.
    """

    def __init__(self, compressor="int8", log: bool = True, **options):
        self.compressor = compressor
        self.log = log
        self.options = options
        self.state: ddp.HookState | None = None
        self._model = None  # the DDP wrapper the hook is registered on
        self._restored: dict | None = None
        get_compressor(compressor, **_compressor_options(options))  # bad settings fail now

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
    restore them with ``gradcomp.ddp.load_rank_file``.

    Example:
        >>> fabric = lightning.Fabric(strategy="ddp", devices=2)
        >>> model, optimizer = fabric.setup(model, optimizer)
        >>> state = register_fabric(model, "int8", warmup_steps=10)
    """
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


def _compressor_options(options: dict) -> dict:
    hook = {*ddp.STATE_OPTIONS, *OLD_NAMES}
    return {k: v for k, v in options.items() if k not in hook}
