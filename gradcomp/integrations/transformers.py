"""A Hugging Face Trainer callback that compresses the gradients Trainer exchanges.

Trainer builds its ``DistributedDataParallel`` through accelerate, whose
``comm_hook`` takes only PyTorch's built-in hooks. :class:`GradcompCallback`
registers gradcomp's hook on the wrapped model itself when training begins,
with any Trainer subclass (TRL's included), logs what it sends into Trainer's
logs, and keeps each rank's residuals in every checkpoint, so that
``trainer.train(resume_from_checkpoint=...)`` continues the compressed run as
Trainer's own resume continues a dense one.

Example:
    >>> from gradcomp.integrations.transformers import GradcompCallback
    >>> trainer = Trainer(model=model, args=args, train_dataset=data,
    ...                   callbacks=[GradcompCallback("int8", warmup_steps=10)])
    >>> trainer.train()
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from torch.distributed.fsdp import FSDPModule

try:
    from transformers import Trainer, TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as error:  # the extra is missing
    raise ImportError(
        'this module needs transformers: pip install -e ".[transformers]" or pip install transformers'
    ) from error

from gradcomp import ddp, fsdp
from gradcomp.ddp.checkpoint import check_missing_residuals
from gradcomp.integrations import common

logger = logging.getLogger(__name__)


class GradcompCallback(TrainerCallback):
    """Compress the gradients of Trainer's wrapped model, log what is sent, checkpoint it.

    Args:
        compressor: a compressor name or object (:func:`gradcomp.get_compressor`),
            or ``"auto"``.
        log: add ``gradcomp/ratio`` and ``gradcomp/bytes_sent`` to every log Trainer
            writes (its history and every ``report_to`` integration), and with
            ``"auto"`` its plan, as ``gradcomp/plan``, at the first log and at each
            log after it changed (a trial's turn, its verdict, a re-plan).
        missing_residuals: what ``train(resume_from_checkpoint=...)`` does with a
            checkpoint that holds no gradcomp state (saved by a dense run):
            ``"raise"`` (default) refuses it; ``"zero"`` warns and begins compressing
            from it, residuals at zero and the hook's warm-up from the start.
        **options: :func:`gradcomp.ddp.register`'s options, the hook's and the
            compressor's (``warmup_steps``, ``min_numel``, ``ratio``, ``allow``, ...);
            under FSDP2, :func:`gradcomp.fsdp.register`'s.

    Under DDP (Trainer's default on several processes) it registers gradcomp's
    hook, with ``torch_compile=True`` too (accelerate compiles the DDP it built);
    under FSDP2 (``fsdp_config={"version": 2}``) it compresses FSDP's
    reduce-scatter with :func:`gradcomp.fsdp.register` (a quantizer or a 16-bit
    cast; accelerate's 2-D HSDP mesh is refused, its all-reduce between replicas
    happens before any hook). Either is registered once, whatever the number of
    ``train()`` calls.
    Gradient accumulation sends once per optimizer step (Trainer accumulates
    under DDP's ``no_sync``). Each checkpoint gets a ``gradcomp_rank{r}.pt`` a
    rank; a resumed run loads it, on as many ranks. On one process there is
    nothing to exchange: it warns and trains as without it. Several processes
    launched (torchrun) that Trainer did not join into one run, on CPUs without
    ``TrainingArguments(use_cpu=True)``, are refused. DeepSpeed, which exchanges
    gradients itself, is refused.

    Attributes:
        state: what the compression keeps, once training has begun (None before,
            and on one process): the :class:`gradcomp.ddp.HookState` under DDP, the
            :class:`gradcomp.fsdp.FSDPState` under FSDP2. Read ``state.last_stats``
            (the last step's :class:`gradcomp.ddp.StepStats`: ``ratio``,
            ``bytes_sent``, ...), ``state.stats`` (every step's), ``state.step``
            (optimizer steps exchanged), and with ``"auto"`` ``state.plan``; it is
            what each checkpoint's ``gradcomp_rank{r}.pt`` holds.

    Example:
        >>> callback = GradcompCallback("int8", warmup_steps=10)
        >>> Trainer(model=model, args=args, train_dataset=data, callbacks=[callback]).train()
        >>> callback.state.last_stats.ratio  # 3.9: int8 sends a quarter of fp32's bytes
    """

    def __init__(self, compressor="int8", log: bool = True, missing_residuals: str = "raise", **options):
        self.compressor = compressor
        self.log = log
        self.missing_residuals = check_missing_residuals(missing_residuals)
        self.options = options
        self.state: ddp.HookState | fsdp.FSDPState | None = None
        self._model = None  # the DDP wrapper the hook is on
        self._plan_logged = ""  # the plan last logged, as logged
        # Bad settings fail here, not at the first step; which of DDP's or FSDP2's options
        # applies is known at train(): either's are taken now.
        hook_options = {*common.DDP_OPTIONS, *common.FSDP_OPTIONS}
        common.check_options(
            compressor, options, hook_options, "GradcompCallback", ("log", "missing_residuals")
        )

    # ------------------------------------------------------------------ Trainer's events
    def on_train_begin(self, args, state, control, **kwargs):
        trainer, resume = _calling_trainer()
        if trainer.is_deepspeed_enabled:
            raise RuntimeError(
                "GradcompCallback compresses DDP's gradient exchange; DeepSpeed exchanges gradients itself. "
                "Train without deepspeed= (Trainer then uses DDP), or use DeepSpeed's own compression"
            )
        # With torch_compile=True accelerate compiles the DDP it built: the hook goes on that DDP.
        model = common.uncompiled(trainer.model_wrapped)
        if isinstance(model, FSDPModule):
            if self.state is None:  # FSDP2 keeps the module it sharded: one register for every train()
                self.state = fsdp.register(model, self.compressor, **self.options)
        elif isinstance(model, torch.nn.parallel.DistributedDataParallel):
            if self.state is None:
                self.state = ddp.register(model, self.compressor, **self.options)
            elif model is not self._model:  # a train() call that wrapped the model anew
                model.register_comm_hook(self.state, ddp.hook)
        elif args.world_size > 1:
            raise RuntimeError(
                f"GradcompCallback compresses DDP and FSDP2 (fsdp_config={{'version': 2}}); Trainer wrapped "
                f"the model in a {type(model).__name__}, which exchanges gradients otherwise"
            )
        elif common.launched_processes() > 1:
            # accelerate, which sets up Trainer's devices, joins CPU processes into one run
            # only when told to use the CPU: without it each trains alone, on its own data.
            raise RuntimeError(
                f"GradcompCallback: {common.launched_processes()} processes were launched (WORLD_SIZE) but "
                "Trainer did not set up distributed training, so each would train alone: on CPUs pass "
                "TrainingArguments(use_cpu=True) (or set ACCELERATE_USE_CPU=true)"
            )
        else:
            logger.warning("gradcomp: one process, nothing to exchange: training without compression")
            return
        self._model = model
        if self.log:  # first: what on_log adds reaches every integration's callback
            callbacks = trainer.callback_handler.callbacks
            callbacks.insert(0, callbacks.pop(callbacks.index(self)))
        if state.global_step > 0:  # a resumed run
            folder = resume or os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            ddp.load_rank_file(self.state, folder, self.missing_residuals)

    def on_log(self, args, state, control, logs=None, **kwargs):
        stats = self.state.last_stats if self.state is not None else None
        if not self.log or stats is None or logs is None:
            return
        values = {"gradcomp/ratio": stats.ratio, "gradcomp/bytes_sent": float(stats.bytes_sent)}
        if self.options.get("measure_error"):
            values["gradcomp/relative_error"] = stats.relative_error
        plan = getattr(self.state, "plan", None)
        if plan is not None:
            text = "; ".join(f"{p.numel} {p.compressor} {p.how}" for p in plan)
            if text != self._plan_logged:  # the first plan, and each one that replaces it
                values["gradcomp/plan"] = self._plan_logged = text
        logs.update(values)
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(values)  # Trainer copied logs into its history before this

    def on_save(self, args, state, control, **kwargs):
        if self.state is not None:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            ddp.save_rank_file(self.state, folder)


def _calling_trainer() -> tuple[Trainer, str | None]:
    """The Trainer whose event is being handled, and the checkpoint it resumes from.

    Found on the call stack (an event is always called from a method of the Trainer,
    any subclass), because no public route reaches either: ``CallbackHandler.call_event``
    hands a callback ``model`` (``Trainer.model``, the unwrapped model; not
    ``model_wrapped``, the DDP that takes the hook), ``optimizer`` (accelerate's
    ``AcceleratedOptimizer``, which keeps no reference to the model or the Accelerator),
    ``lr_scheduler``, ``train_dataloader``, ``eval_dataloader`` and ``processing_class``;
    ``TrainerState`` does not record the folder ``train(resume_from_checkpoint=...)``
    resolved (``True`` resolves to the last checkpoint); and the one callback of
    transformers that needs its Trainer (``JITCheckpointCallback``) is handed it by
    ``Trainer.__init__`` itself (``set_trainer``), which a user's callback is not."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if isinstance(owner, Trainer):
            resume = frame.f_locals.get("resume_from_checkpoint")
            return owner, resume if isinstance(resume, str) else None
        frame = frame.f_back
    raise RuntimeError("GradcompCallback's events must come from a transformers Trainer")
