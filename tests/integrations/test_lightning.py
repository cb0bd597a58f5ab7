"""The Lightning callback on 2 CPU processes: the hook is registered, logs, and resumes exactly."""

from __future__ import annotations

import functools
import os

import pytest
import torch
import torch.distributed as dist

from tests.utils import run_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _lightning_installed():
    # Imported by the tests themselves, not at collection: Lightning takes seconds to
    # import, which the fast tier, where every test here is deselected, would pay.
    pytest.importorskip("lightning", reason="the Lightning extra is not installed")


@functools.cache
def _net_class():
    import lightning

    class _Net(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(16, 128),
                torch.nn.ReLU(),
                torch.nn.Linear(128, 128),
                torch.nn.ReLU(),
                torch.nn.Linear(128, 4),
            )

        def training_step(self, batch, batch_idx):
            inputs, labels = batch
            return torch.nn.functional.cross_entropy(self.net(inputs), labels)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    return _Net


def _net():
    return _net_class()()


def _loader():
    generator = torch.Generator().manual_seed(3)
    inputs = torch.randn(256, 16, generator=generator)
    labels = (inputs[:, :4]).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=16)


def _fit(directory: str, epochs: int, resume: str | None, checkpoints: bool, compression="default"):
    import lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gradcomp.integrations.lightning import GradientCompression

    if compression == "default":
        compression = GradientCompression("int8", min_numel=0)
    callbacks = [compression] if compression is not None else []
    if checkpoints:
        callbacks.append(
            ModelCheckpoint(dirpath=directory, save_top_k=-1, every_n_epochs=1, filename="{epoch}")
        )
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=lightning.pytorch.strategies.DDPStrategy(bucket_cap_mb=0.02),
        max_epochs=epochs,
        callbacks=callbacks,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=checkpoints,
        default_root_dir=directory,
        deterministic=True,
    )
    module = _net()
    trainer.fit(module, _loader(), ckpt_path=resume)
    weights = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return weights, compression, trainer


def _lightning_run(rank: int, world_size: int, directory: str) -> dict:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29500")
    whole, compression, trainer = _fit(directory, 2, None, checkpoints=True)
    stats = compression.state.last_stats
    mine = torch.tensor([int(stats is not None and stats.compressed_buckets == stats.buckets > 1)])
    dist.all_reduce(mine, op=dist.ReduceOp.MIN)
    resumed, again, _ = _fit(
        directory + "/resumed", 2, os.path.join(directory, "epoch=0.ckpt"), checkpoints=False
    )
    return {
        "compressed": bool(mine.item()),
        "ratio": stats.ratio,
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("gradcomp/")},
        "steps": len(compression.state.stats),
        "resumed_steps": len(again.state.stats),
        "same": torch.equal(whole, resumed),
    }


def test_callback_compresses_logs_and_resumes_bit_for_bit(tmp_path):
    result = run_ranks(_lightning_run, 2, str(tmp_path), timeout=300)
    assert result["compressed"], result  # every bucket of every step went through int8
    assert 3.5 < result["ratio"] < 4.1
    assert result["logged"]["gradcomp/ratio"] == pytest.approx(result["ratio"])
    assert result["logged"]["gradcomp/bytes_sent"] > 0
    assert result["steps"] == 16 and result["resumed_steps"] == 8  # 8 steps an epoch on each rank
    assert result["same"], "the resumed run ended elsewhere than the uninterrupted one"


def _from_a_dense_checkpoint(rank: int, world_size: int, directory: str) -> dict:
    import logging.handlers

    from gradcomp.integrations.lightning import GradientCompression

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    warned = logging.handlers.BufferingHandler(100)
    logging.getLogger("gradcomp.ddp").addHandler(warned)
    _fit(directory, 1, None, checkpoints=True, compression=None)
    dense = os.path.join(directory, "epoch=0.ckpt")
    with pytest.raises(ValueError, match="missing_residuals='zero'"):
        _fit(directory + "/refused", 2, dense, checkpoints=False)
    compression = GradientCompression("int8", min_numel=0, missing_residuals="zero")
    _fit(directory + "/resumed", 2, dense, checkpoints=False, compression=compression)
    return {
        "steps": len(compression.state.stats),
        "warned": any("residuals at zero" in record.getMessage() for record in warned.buffer),
    }


def test_compression_begins_from_a_dense_checkpoint_only_when_asked(tmp_path):
    # Lightning restores no callback state it does not find: without the refusal a dense
    # checkpoint would resume compressed without a word.
    result = run_ranks(_from_a_dense_checkpoint, 2, str(tmp_path), timeout=300)
    assert result == {"steps": 8, "warned": True}  # the second epoch's 8 steps


def test_a_checkpoint_of_another_world_size_is_refused():
    from gradcomp.integrations.lightning import GradientCompression

    callback = GradientCompression("int8")
    callback.state = object()
    with pytest.raises(ValueError, match="state of 3 ranks and this run has 1"):
        callback._load({"ranks": [None, None, None]})


def test_the_example_trains_and_resumes(tmp_path):
    import subprocess
    import sys

    script = os.path.join(
        os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
        "examples",
        "lightning_ddp.py",
    )
    runs = str(tmp_path / "runs")

    def run(*args):
        done = subprocess.run(
            [sys.executable, script, "--dir", runs, *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        return done.stdout

    first = run("--epochs", "1")
    assert "(3.9x fewer)" in first
    second = run("--epochs", "2", "--resume", os.path.join(runs, "epoch=0.ckpt"))
    assert "final loss" in second and os.path.exists(os.path.join(runs, "epoch=1.ckpt"))


def _two_fits(rank: int, world_size: int, directory: str) -> list[int]:
    import lightning

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", RANK=str(rank), WORLD_SIZE=str(world_size))
    from gradcomp.integrations.lightning import GradientCompression

    compression = GradientCompression("int8", min_numel=0)
    counts = []
    for epochs in (1, 2):
        trainer = lightning.Trainer(
            accelerator="cpu",
            devices=2,
            strategy="ddp",
            max_epochs=epochs,
            callbacks=[compression],
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            default_root_dir=directory,
        )
        trainer.fit(_net(), _loader())
        counts.append(len(compression.state.stats))
    return counts


def test_a_second_fit_compresses_too(tmp_path):
    # Lightning wraps the model anew for each fit: the hook must follow it.
    assert run_ranks(_two_fits, 2, str(tmp_path), timeout=300) == [8, 24]
