"""The language-model task of ``bench/convergence.py --task lm``.

A GPT-style decoder (learned positions, pre-norm blocks of causal
self-attention and a GELU MLP, the output layer tied to the byte embedding)
learns to predict the next byte of Python's own standard library sources,
which every machine with Python has offline. The corpus is the top-level
``.py`` files of the standard library in name order, cut to ``corpus_bytes``;
the last tenth is held out for validation. A second corpus, ``c10``, is
another language: the C++ headers of torch's c10 library (``torch/include/c10``,
1.7 MB, in path order), which every machine with torch has. AdamW with a linear warm-up and a
cosine decay to a tenth of the peak; every run sees the same batches in the
same order (a seeded generator), and validation always reads the same
fixed windows.
"""

from __future__ import annotations

import argparse
import math
import os
import sysconfig

import torch
import torch.nn.functional as F
from torch import nn

from gradcomp.units import argument, parse_size


def add_gpt_options(
    parser: argparse.ArgumentParser, width: int, layers: int, heads: int, layer_help: str = ""
) -> None:
    """The GPT, its batches and AdamW's lr as options, for the bench scripts that time training steps."""
    parser.add_argument("--width", type=int, default=width, help=f"GPT width (default {width})")
    parser.add_argument(
        "--layers", type=int, default=layers, help=f"GPT blocks{layer_help} (default {layers})"
    )
    parser.add_argument("--heads", type=int, default=heads, help=f"attention heads (default {heads})")
    parser.add_argument("--context", type=int, default=128, help="bytes a window (default 128)")
    parser.add_argument("--batch-size", type=int, default=4, help="windows per rank and step (default 4)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    parser.add_argument(
        "--corpus-bytes",
        type=argument(parse_size),
        default=parse_size("4M"),
        help="bytes of the standard library's sources to train on (default 4M)",
    )


CORPORA = ("stdlib", "c10")
# AdamW's settings besides the learning rate, GPT-style, in every script that trains the GPT.
ADAMW = dict(weight_decay=0.1, betas=(0.9, 0.95))


def corpus_files(corpus: str) -> tuple[str, list[str]]:
    """(the corpus's folder, its files in order, relative to it)."""
    if corpus == "stdlib":
        directory = sysconfig.get_paths()["stdlib"]
        return directory, sorted(name for name in os.listdir(directory) if name.endswith(".py"))
    if corpus == "c10":
        directory = os.path.join(os.path.dirname(torch.__file__), "include", "c10")
        found = [
            os.path.relpath(os.path.join(root, name), directory)
            for root, _, names in os.walk(directory)
            for name in names
            if name.endswith(".h")
        ]
        return directory, sorted(found)
    raise ValueError(f"corpus must be one of {CORPORA}, got {corpus!r}")


def load_corpus(corpus_bytes: int, corpus: str = "stdlib") -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, validation bytes, a description) as uint8 tensors."""
    directory, names = corpus_files(corpus)
    chunks, total = [], 0
    for name in names:
        with open(os.path.join(directory, name), "rb") as file:
            chunks.append(file.read())
        total += len(chunks[-1])
        if total >= corpus_bytes:
            break
    data = torch.frombuffer(bytearray(b"".join(chunks)[:corpus_bytes]), dtype=torch.uint8)
    split = len(data) * 9 // 10
    description = dict(
        corpus=corpus,
        source=directory,
        files=len(chunks),
        bytes=len(data),
        validation_bytes=len(data) - split,
    )
    return data[:split], data[split:], description


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(width, dim=2)
        q, k, v = (t.view(batch, length, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, length, width))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class GPT(nn.Module):
    """A byte-level decoder: ``layers`` blocks of ``width`` units, ``context`` positions."""

    def __init__(self, width: int, layers: int, heads: int, context: int, seed: int):
        super().__init__()
        generator_state = torch.random.get_rng_state()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(256, width)
        self.position = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.norm = nn.LayerNorm(width)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)
                if getattr(module, "bias", None) is not None:
                    nn.init.zeros_(module.bias)
        torch.random.set_rng_state(generator_state)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()  # tied output layer


def gpt(settings: dict) -> GPT:
    """The GPT that :func:`add_gpt_options`' ``settings`` describe, seeded 0."""
    return GPT(settings["width"], settings["layers"], settings["heads"], settings["context"], seed=0)


def random_starts(data: torch.Tensor, count: int, context: int, seed: int) -> torch.Tensor:
    """``count`` starts of windows of ``context`` bytes in ``data``, drawn from a generator
    seeded ``seed`` (the global RNG untouched)."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, len(data) - context - 1, (count,), generator=generator)


def windows(data: torch.Tensor, starts: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, next-byte targets) of the windows of ``context`` bytes at ``starts``."""
    index = starts[:, None] + torch.arange(context + 1)
    chunk = data[index].long()
    return chunk[:, :-1], chunk[:, 1:]


def loss_of(model: nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def validation_loss(model: nn.Module, data: torch.Tensor, context: int, batches: int, batch: int) -> float:
    """Mean loss over ``batches`` fixed, evenly spaced windows of the validation bytes."""
    starts = torch.linspace(0, len(data) - context - 2, batches * batch).long()
    total = 0.0
    with torch.no_grad():
        for part in starts.split(batch):
            total += loss_of(model, *windows(data, part, context)).item()
    return total / batches


def schedule(optimizer: torch.optim.Optimizer, steps: int, warmup: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Linear warm-up over ``warmup`` steps, then a cosine decay to a tenth of the peak."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, steps - warmup)
        return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
