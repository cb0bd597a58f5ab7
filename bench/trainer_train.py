"""Hugging Face Trainer end to end: a GPT-2 trained dense and through ``GradcompCallback``.

Each run trains the same GPT-2 (``transformers.GPT2LMHeadModel``, byte-level:
256 tokens) on the language-model task's corpus (the standard library's
sources, :mod:`lib.lm`) with Trainer's own loop (AdamW, linear warm-up then
cosine, DDP on spawned Gloo ranks, ``use_cpu``), the same seed and batches. The
runs: ``dense`` (Trainer alone) and one per ``--compressors`` spec through
``GradcompCallback`` (default ``int8`` and ``auto``). ``--rounds N`` runs the
list N times in turn (dense, int8, auto, dense, ...) so that a machine whose
speed drifts slows every run alike; a run's step time is the median of rank 0's
intervals between optimizer steps after ``--warmup-steps``, pooled over rounds.
The final loss is Trainer's ``evaluate()`` on fixed held-out windows.

``--bandwidth RATE`` gives each rank a link of RATE (:mod:`lib.link`, needs root).

Examples:
    python bench/trainer_train.py --steps 20 --rounds 1
    python bench/trainer_train.py --bandwidth 1gbit --steps 300 --rounds 2   # needs root
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
from lib import link, spawning
from lib.lm import add_gpt_options, load_corpus, random_starts
from lib.machine import machine
from lib.options import add_common_options
from lib.results import Results, publish, ratio

DENSE = "dense"


def options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--compressors", nargs="+", default=["int8", "auto"], help="specs beside dense")
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps a run (default 300)")
    parser.add_argument(
        "--warmup-steps", type=int, default=20, help="steps left out of the timing (default 20)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="times the list runs, in turn (default 2)")
    add_gpt_options(parser, width=384, layers=6, heads=6)
    add_common_options(parser)
    link.add_bandwidth_option(parser)
    return parser


class _Dataset(torch.utils.data.Dataset):
    """Windows of ``context + 1`` bytes at seeded starts; labels are the inputs (Trainer's GPT-2 shifts)."""

    def __init__(self, data: torch.Tensor, count: int, context: int, seed: int, spread: bool = False):
        if spread:  # fixed, evenly spaced: the held-out windows
            self.starts = torch.linspace(0, len(data) - context - 1, count).long()
        else:
            self.starts = random_starts(data, count, context, seed)
        self.data, self.context = data, context

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> dict:
        start = int(self.starts[index])
        tokens = self.data[start : start + self.context].long()
        return {"input_ids": tokens, "labels": tokens}


def _train(rank: int, world: int, spec: str, settings: dict) -> dict:
    import transformers

    from gradcomp.integrations.transformers import GradcompCallback

    ranks = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": world}
    os.environ.update({name: str(value) for name, value in ranks.items()})
    train, held_out, _ = load_corpus(settings["corpus_bytes"])
    config = transformers.GPT2Config(
        vocab_size=256,
        n_positions=settings["context"],
        n_embd=settings["width"],
        n_layer=settings["layers"],
        n_head=settings["heads"],
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    steps, batch = settings["steps"], settings["batch_size"]

    class Clock(transformers.TrainerCallback):
        def __init__(self):
            self.ends: list[float] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    clock = Clock()
    callbacks = [clock] if spec == DENSE else [clock, GradcompCallback(spec)]
    arguments = transformers.TrainingArguments(
        output_dir=os.path.join(settings["folder"], f"{spec}-{rank}"), max_steps=steps,
        per_device_train_batch_size=batch, per_device_eval_batch_size=32, dataloader_num_workers=0,
        learning_rate=settings["lr"], weight_decay=0.1,  # AdamW, as the LM task's
        lr_scheduler_type="cosine", warmup_steps=max(1, steps // 20),
        logging_steps=max(1, steps // 10), save_strategy="no", report_to=[], disable_tqdm=True,
        use_cpu=True, seed=0, data_seed=0,  # DDP on CPU ranks; every run the same batches
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model,
        args=arguments,
        train_dataset=_Dataset(train, steps * batch * world, settings["context"], seed=1),
        eval_dataset=_Dataset(held_out, 256, settings["context"], seed=0, spread=True),
        callbacks=callbacks,
    )
    trainer.train()
    evaluation = trainer.evaluate()
    intervals = [b - a for a, b in zip(clock.ends[:-1], clock.ends[1:], strict=True)][
        settings["warmup_steps"] :
    ]
    last = next(entry for entry in reversed(trainer.state.log_history) if "loss" in entry)
    record = {
        "run": spec,
        "parameters": sum(p.numel() for p in model.parameters()),
        "intervals": intervals,
        "eval_loss": evaluation["eval_loss"],
        "train_loss": last["loss"],
        "ratio": last.get("gradcomp/ratio", 1.0),
        "bytes_sent": last.get("gradcomp/bytes_sent"),
        "plan": next((e["gradcomp/plan"] for e in trainer.state.log_history if "gradcomp/plan" in e), None),
    }
    return record if rank == 0 else None


def main() -> int:
    args = options().parse_args()
    link.maybe_run_limited(args)
    runs = [DENSE, *args.compressors]
    settings = {k: v for k, v in vars(args).items() if k not in ("out", "bandwidth", "progress")}
    facts = machine(args.spawn, "gloo")
    results = Results("trainer_train", facts, settings, directory=args.out)
    print(facts["machine"], "|", facts["link"])
    pooled: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="gradcomp-trainer-") as scratch:
        for round_ in range(args.rounds):
            for spec in runs:
                record = spawning.spawn(
                    _train, args.spawn, spec, {**settings, "folder": scratch}, timeout=3600
                )
                entry = pooled.setdefault(spec, {**record, "intervals": [], "eval_losses": []})
                entry["intervals"] += record["intervals"]
                entry["eval_losses"].append(record["eval_loss"])
                step = statistics.median(record["intervals"])
                loss = record["eval_loss"]
                print(f"round {round_ + 1} {spec:>8}: step {step * 1e3:7.1f} ms, eval loss {loss:.4f}")
    dense = pooled[DENSE]
    dense_step = statistics.median(dense["intervals"])
    records = []
    print(f"\n{'run':>8} {'step ms':>9} {'vs dense':>9} {'eval loss':>10} {'vs dense':>9} {'ratio':>6}")
    for spec in runs:
        entry = pooled[spec]
        step = statistics.median(entry["intervals"])
        loss = statistics.mean(entry["eval_losses"])
        record = {
            "run": spec,
            "parameters": entry["parameters"],
            "step_ms": step * 1e3,
            "step_vs_dense": ratio(step, dense_step),
            "eval_loss": loss,
            "eval_losses": entry["eval_losses"],
            "loss_vs_dense": loss / statistics.mean(dense["eval_losses"]) - 1,
            "train_loss": entry["train_loss"],
            "ratio": entry["ratio"],
            "bytes_sent": entry["bytes_sent"],
            "plan": entry["plan"],
            "timed_steps": len(entry["intervals"]),
        }
        records.append(record)
        print(
            f"{spec:>8} {record['step_ms']:9.1f} {record['step_vs_dense']:9.3f} {loss:10.4f} "
            f"{record['loss_vs_dense']:+9.2%} {record['ratio']:6.2f}"
        )
    publish(results, records)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
