"""Train with Lightning's DDP strategy on 2 CPU processes, gradients compressed to int8.

    python examples/lightning_ddp.py [--epochs 3] [--resume PATH]

Lightning starts the second process itself. Each epoch's checkpoint holds
the model, the optimizer and every rank's compression state; ``--resume``
continues from one.
"""

import argparse

import lightning
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from gradcomp.integrations.lightning import GradientCompression


class Classifier(lightning.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))

    def training_step(self, batch, batch_idx):
        inputs, labels = batch
        loss = torch.nn.functional.cross_entropy(self.net(inputs), labels)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def data() -> torch.utils.data.DataLoader:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(4096, 32, generator=generator)
    labels = (inputs @ torch.randn(32, 10, generator=generator)).argmax(1)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, labels), batch_size=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume", default=None, help="a checkpoint to continue from")
    parser.add_argument("--dir", default="lightning_runs", help="where checkpoints go")
    args = parser.parse_args()
    torch.manual_seed(0)
    compression = GradientCompression("int8", warmup_steps=10)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp",
        max_epochs=args.epochs,
        callbacks=[compression, ModelCheckpoint(dirpath=args.dir, save_top_k=-1, filename="{epoch}")],
        default_root_dir=args.dir,
        logger=False,
        enable_model_summary=False,
    )
    trainer.fit(Classifier(), data(), ckpt_path=args.resume)
    if trainer.global_rank == 0:
        stats = compression.state.last_stats
        loss = float(trainer.callback_metrics["loss"])
        print(
            f"final loss {loss:.4f}; the last step sent {stats.bytes_sent:,} bytes ({stats.ratio:.1f}x fewer)"
        )


if __name__ == "__main__":
    main()
