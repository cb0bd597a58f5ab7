"""gradcomp in Hugging Face's Trainer (gradcomp.integrations.transformers), on 2 Gloo ranks.

The real Trainer (transformers 5) on a tiny GPT-2, CPU ranks: the callback registers
the hook on Trainer's DDP (compiled or not), its figures reach Trainer's logs, a resumed
run ends where the uninterrupted one does, a dense checkpoint begins compression only
when asked, and accumulation sends once per optimizer step.
"""

from __future__ import annotations

import dataclasses
import logging
import logging.handlers
import math
import os
import warnings

import pytest
import torch

from tests.utils import run_ranks, same_on_all_ranks

transformers = pytest.importorskip("transformers", reason="the transformers extra is not installed")

from gradcomp.integrations.transformers import GradcompCallback  # noqa: E402

VOCAB, LENGTH = 64, 16


def _model(width: int = 32):
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=width, n_layer=2, n_head=2)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _data(count: int = 96) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    # A learnable sequence: each token the one before plus one, from a random start.
    starts = torch.randint(0, VOCAB, (count, 1), generator=generator)
    tokens = (starts + torch.arange(LENGTH)) % VOCAB
    return [{"input_ids": t, "labels": t} for t in tokens]


def _trainer(output_dir: str, callbacks, trainer_class=None, width: int = 32, **arguments):
    options = dict(
        output_dir=output_dir,
        per_device_train_batch_size=4,
        learning_rate=5e-3,
        max_steps=6,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        disable_tqdm=True,
        seed=0,
        data_seed=0,
    )
    options.update(arguments)
    args = transformers.TrainingArguments(**options)
    return (trainer_class or transformers.Trainer)(
        model=_model(width), args=args, train_dataset=_data(), callbacks=callbacks
    )


def _parameters(trainer) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()])


def _environment(rank: int, world: int) -> None:
    # What torchrun sets: accelerate reads it (the process group already exists).
    ranks = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    os.environ.update({name: str(value) for name, value in ranks.items()})


def _trains_compressed_and_logs(rank: int, world: int, root: str) -> None:
    _environment(rank, world)
    dense = _trainer(os.path.join(root, "dense"), [])
    dense.train()
    callback = GradcompCallback("int8")
    compressed = _trainer(os.path.join(root, "int8"), [callback])
    compressed.train()
    assert same_on_all_ranks(_parameters(compressed))
    assert callback.state is not None and callback.state.last_stats.ratio > 3
    losses = [entry["loss"] for entry in compressed.state.log_history if "loss" in entry]
    dense_losses = [entry["loss"] for entry in dense.state.log_history if "loss" in entry]
    assert abs(losses[-1] - dense_losses[-1]) <= 0.01 * dense_losses[-1], (losses, dense_losses)
    logged = [entry for entry in compressed.state.log_history if "loss" in entry]  # a step's
    assert len(logged) == 6 and all(entry["gradcomp/ratio"] > 3 for entry in logged)
    assert all(entry["gradcomp/bytes_sent"] > 0 for entry in logged)
    # A second train() call: the hook stays registered once (DDP refuses a second).
    compressed.train()
    assert callback.state.step == 12


@pytest.mark.slow
def test_trainer_trains_compressed_with_int8s_loss_and_logs_the_ratio(tmp_path):
    run_ranks(_trains_compressed_and_logs, 2, str(tmp_path))


def _resumes_exactly(rank: int, world: int, root: str) -> dict:
    _environment(rank, world)
    ended = {}
    for name, callbacks in (("dense", list), ("int8", lambda: [GradcompCallback("int8", min_numel=0)])):
        folder = os.path.join(root, name)
        whole = _trainer(folder, callbacks(), save_strategy="steps", save_steps=3)
        whole.train()
        resumed = _trainer(folder, callbacks())
        resumed.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-3"))
        ended[name] = torch.equal(_parameters(whole), _parameters(resumed))
        if name == "int8":
            assert os.path.exists(os.path.join(folder, "checkpoint-3", f"gradcomp_rank{rank}.pt"))
            # Without its residuals the resumed run would not end where the whole one did.
            lost = _trainer(folder, [GradcompCallback("int8", min_numel=0)])
            os.remove(os.path.join(folder, "checkpoint-3", f"gradcomp_rank{rank}.pt"))
            with pytest.raises(
                FileNotFoundError, match="holds no compression state.*missing_residuals='zero'"
            ):
                lost.train(resume_from_checkpoint=os.path.join(folder, "checkpoint-3"))
    return ended


@pytest.mark.slow
def test_a_resumed_run_ends_where_the_uninterrupted_one_does_as_trainers_own(tmp_path):
    ended = run_ranks(_resumes_exactly, 2, str(tmp_path))
    assert ended == {"dense": True, "int8": True}


def _accumulates(rank: int, world: int, root: str) -> None:
    _environment(rank, world)
    callback = GradcompCallback("int8")
    trainer = _trainer(root, [callback], gradient_accumulation_steps=3, max_steps=4)
    trainer.train()
    # Twelve backward passes, four exchanges: one a step, each the bytes of one.
    stats = callback.state.stats
    assert callback.state.step == 4 and len(stats) == 4
    assert len({s.bytes_sent for s in stats}) == 1 and stats[0].bytes_sent > 0


@pytest.mark.slow
def test_accumulation_sends_once_per_optimizer_step(tmp_path):
    run_ranks(_accumulates, 2, str(tmp_path))


def test_one_process_warns_and_trains_without_compression(tmp_path, caplog):
    callback = GradcompCallback("int8")
    trainer = _trainer(str(tmp_path), [callback], max_steps=2)
    with caplog.at_level("WARNING", logger="gradcomp.integrations.transformers"):
        trainer.train()
    assert "nothing to exchange" in caplog.text and callback.state is None
    assert math.isfinite(trainer.state.log_history[-1]["train_loss"])


class _Probe(transformers.Trainer):
    def begin(self):
        return self.callback_handler.on_train_begin(self.args, self.state, self.control)


def test_deepspeed_is_refused_and_bad_settings_fail_at_once(tmp_path):
    trainer = _trainer(str(tmp_path), [GradcompCallback("int8")], trainer_class=_Probe)
    trainer.is_deepspeed_enabled = True
    with pytest.raises(RuntimeError, match="DeepSpeed exchanges gradients itself"):
        trainer.begin()
    with pytest.raises(ValueError, match="no option"):
        GradcompCallback("int8", blokc=128)
    with pytest.raises(ValueError, match="takes no compressor options"):
        GradcompCallback("auto", ratio=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GradcompCallback("auto", warmup_steps=3, allow=("int8",))


def _losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def _compiled_trains_compressed(rank: int, world: int, root: str) -> None:
    _environment(rank, world)
    # Several buckets (dynamo's DDPOptimizer splits the compiled graph at each; it takes no
    # bucket under its first's 1 MB). aot_eager compiles forward and backward as inductor
    # does (AOTAutograd), without its C++ build.
    settings = dict(max_steps=3, ddp_bucket_cap_mb=1, torch_compile_backend="aot_eager", width=128)
    eager = _trainer(os.path.join(root, "eager"), [GradcompCallback("int8", min_numel=0)], **settings)
    eager.train()
    callback = GradcompCallback("int8", min_numel=0)
    compiled = _trainer(os.path.join(root, "compiled"), [callback], torch_compile=True, **settings)
    compiled.train()
    assert type(compiled.model_wrapped).__name__ == "OptimizedModule"
    stats = callback.state.last_stats
    assert callback.state.step == 3 and stats.compressed_buckets == stats.buckets > 1, stats
    assert same_on_all_ranks(_parameters(compiled))
    assert _losses(compiled) == pytest.approx(_losses(eager), rel=1e-4)


@pytest.mark.slow
def test_torch_compile_compresses_the_ddp_under_the_compiled_module(tmp_path):
    run_ranks(_compiled_trains_compressed, 2, str(tmp_path))


def _logs_each_plan(rank: int, world: int, root: str) -> tuple:
    from tests.ddp.test_auto import REPLAN_PROFILES

    _environment(rank, world)
    callback = GradcompCallback(
        "auto",
        allow=("int8", "int4", "topk"),
        profile=REPLAN_PROFILES[0],  # a slow link: compression pays
        warmup_steps=2,
        check_every=2,
        trial_steps=0,
        min_numel=0,
    )

    class FasterLink(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if state.global_step == 5:  # a link on which dense wins: auto re-plans
                auto = callback.state.auto
                auto.options = dataclasses.replace(auto.options, profile=REPLAN_PROFILES[2])
                if rank == 0:
                    callback.state.replan()

    trainer = _trainer(root, [callback, FasterLink()], max_steps=12)
    trainer.train()
    numels = [p.numel for p in callback.state.plan]
    # The plan each step ran, as the callback writes it (steps 1-2: the warm-up's, no plan).
    ran = {
        s.step + 1: "; ".join(f"{n} {s.compressors[i]}" for i, n in enumerate(numels))
        for s in callback.state.stats
    }
    logged = {e["step"]: e["gradcomp/plan"] for e in trainer.state.log_history if "gradcomp/plan" in e}
    return ran, logged


@pytest.mark.slow
def test_auto_s_plan_is_logged_each_time_it_changes(tmp_path):
    ran, logged = run_ranks(_logs_each_plan, 2, str(tmp_path))
    plans = [ran[step] for step in sorted(ran) if step > 2]
    assert len(set(plans)) == 2 and "dense" not in plans[0] and "int8" not in plans[-1], plans
    changes = {step: ran[step] for step in sorted(ran) if step > 2 and ran[step] != ran.get(step - 1)}
    first = min(changes)
    assert logged == changes and first == 3, (logged, ran)


def _told_to_pass_use_cpu(rank: int, world: int, root: str) -> None:
    _environment(rank, world)
    # As under torchrun on CPUs without use_cpu=True: accelerate joins the process group
    # (it exists here already) but sets up no distributed run, so each rank would train alone.
    trainer = _trainer(root, [GradcompCallback("int8")], use_cpu=False, max_steps=1)
    assert trainer.args.world_size == 1
    with pytest.raises(RuntimeError, match=r"2 processes were launched.*use_cpu=True"):
        trainer.train()


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="with GPUs, Trainer sets up DDP without use_cpu")
def test_processes_trainer_did_not_join_are_told_to_pass_use_cpu(tmp_path):
    run_ranks(_told_to_pass_use_cpu, 2, str(tmp_path))


def _begins_compression_from_a_dense_checkpoint(rank: int, world: int, root: str) -> dict:
    _environment(rank, world)
    warned = logging.handlers.BufferingHandler(100)
    logging.getLogger("gradcomp.ddp").addHandler(warned)
    _trainer(root, [], save_strategy="steps", save_steps=3).train()
    checkpoint = os.path.join(root, "checkpoint-3")
    refused = _trainer(root, [GradcompCallback("int8", min_numel=0)])
    with pytest.raises(FileNotFoundError, match="missing_residuals='zero'"):
        refused.train(resume_from_checkpoint=checkpoint)
    callback = GradcompCallback("int8", min_numel=0, missing_residuals="zero")
    resumed = _trainer(root, [callback])
    resumed.train(resume_from_checkpoint=checkpoint)
    assert same_on_all_ranks(_parameters(resumed))
    logged = [entry for entry in resumed.state.log_history if "loss" in entry]
    return {
        "warned": any("residuals at zero" in record.getMessage() for record in warned.buffer),
        "steps": callback.state.step,
        "compressed steps": [entry["step"] for entry in logged if entry.get("gradcomp/ratio", 0) > 3],
    }


@pytest.mark.slow
def test_compression_begins_from_a_dense_checkpoint_only_when_asked(tmp_path):
    result = run_ranks(_begins_compression_from_a_dense_checkpoint, 2, str(tmp_path))
    assert result == {"warned": True, "steps": 3, "compressed steps": [4, 5, 6]}


class _FSDPOnCPUTrainer(transformers.Trainer):
    """Trainer as it runs FSDP2 on GPUs, on CPU ranks.

    accelerate chooses ``DistributedType.FSDP`` only for accelerator ranks
    (``AcceleratorState.__init__``: the FSDP plugin is read inside the branch for
    MULTI_GPU, MULTI_XPU, ...; on CPU it stays MULTI_CPU and wraps in DDP). This
    sets the type and plugin that branch sets; the sharding (``fully_shard`` of each
    GPT2Block, then the model), the checkpoints and the loop are accelerate's and
    Trainer's own."""

    def create_accelerator_and_postprocess(self):
        from accelerate.state import PartialState
        from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

        super().create_accelerator_and_postprocess()
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.accelerator.state.distributed_type = DistributedType.FSDP
        self.accelerator.state.fsdp_plugin = FullyShardedDataParallelPlugin(**self.args.fsdp_plugin_args)
        self.is_fsdp_enabled = True


# Sharded checkpoints: a full state dict's gather for saving fails on Gloo CPU ranks
# (accelerate's FULL_STATE_DICT path; a size mismatch in Gloo, with or without gradcomp).
FSDP2 = dict(
    fsdp=True,
    fsdp_config={
        "version": 2,
        "transformer_layer_cls_to_wrap": ["GPT2Block"],
        "state_dict_type": "SHARDED_STATE_DICT",
    },
)


def _full_parameters(model) -> torch.Tensor:
    """Every parameter whole (FSDP2 shards them: gathered from every rank)."""
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def _fsdp2_trains_compressed(rank: int, world: int, root: str) -> dict:
    _environment(rank, world)
    from torch.distributed.fsdp import FSDPModule

    dense = _trainer(os.path.join(root, "dense"), [], trainer_class=_FSDPOnCPUTrainer, **FSDP2)
    dense.train()
    callback = GradcompCallback("int8", residual="fp32")  # error feedback: state to resume
    compressed = _trainer(
        os.path.join(root, "int8"), [callback], trainer_class=_FSDPOnCPUTrainer,
        save_strategy="steps", save_steps=3, **FSDP2,
    )  # fmt: skip
    compressed.train()
    assert isinstance(compressed.model_wrapped, FSDPModule)
    assert callback.state.reduce_scatter is not None and callback.state.step == 6
    losses = [entry["loss"] for entry in compressed.state.log_history if "loss" in entry]
    dense_losses = [entry["loss"] for entry in dense.state.log_history if "loss" in entry]
    assert abs(losses[-1] - dense_losses[-1]) <= 0.01 * dense_losses[-1], (losses, dense_losses)
    logged = [entry for entry in compressed.state.log_history if "loss" in entry]
    assert len(logged) == 6 and all(entry["gradcomp/ratio"] > 3 for entry in logged)
    whole = _full_parameters(compressed.model)
    assert same_on_all_ranks(whole)
    assert os.path.exists(os.path.join(root, "int8", "checkpoint-3", f"gradcomp_rank{rank}.pt"))
    resumed = _trainer(
        os.path.join(root, "int8"),
        [GradcompCallback("int8", residual="fp32")],
        trainer_class=_FSDPOnCPUTrainer,
        **FSDP2,
    )
    resumed.train(resume_from_checkpoint=os.path.join(root, "int8", "checkpoint-3"))
    return {"resumed exactly": torch.equal(whole, _full_parameters(resumed.model))}


@pytest.mark.slow
def test_trainer_under_fsdp2_compresses_the_reduce_scatter_logs_and_resumes(tmp_path):
    assert run_ranks(_fsdp2_trains_compressed, 2, str(tmp_path)) == {"resumed exactly": True}
