"""Smoke tests of the bench scripts: tiny runs, checked for their tables and result files."""

from __future__ import annotations

import importlib
import json
import math
import os
import pathlib
import re
import shutil
import subprocess

import pytest
import torch

import gradcomp
from gradcomp import tables, units
from gradcomp.collectives import agreement, stats
from tests.bench.smoke import (  # noqa: F401
    BENCH,
    LOAD_COLUMNS,
    MACHINE_COLUMNS,
    ROOT,
    TINY_GPT,
    TINY_MODEL,
    cluster,
    link,
    machine,
    read_results,
    run_script,
    run_smoke,
    spawning,
    specs,
    stem,
)

# The ring bytes of one set of the fingerprint's lanes at 2 ranks, fp32 (a summed payload's).
LANE_BYTES = stats.ring_all_reduce_bytes(agreement.lane_count(torch.float32, 2) * 4, 2)

# ----------------------------------------------------------------------------- helpers


def test_sizes_rates_and_lists_parse():
    assert units.parse_size("64KiB") == 65536
    assert units.parse_size("1M") == 2**20
    assert units.parse_size("4096") == 4096
    assert units.format_size(65536) == "64K"
    assert units.format_size(1.5 * 2**20) == "1.5M"
    assert units.parse_rate("1gbit") == 1e9
    assert units.parse_rate("100mbit") == 1e8
    assert units.split_list(["int8,fp16", "topk:ratio=0.1,exact=true"]) == [
        "int8",
        "fp16",
        "topk:ratio=0.1,exact=true",
    ]
    assert specs.parse_run("topk:ratio=0.1,exact=true") == (
        "topk:ratio=0.1,exact=true",
        "topk",
        {"ratio": 0.1, "exact": True},
    )
    assert specs.parse_run("auto:allow=int8|topk@0.01") == (
        "auto:allow=int8|topk@0.01",
        "auto",
        {"allow": ("int8", "topk@0.01")},
    )
    assert specs.parse_run("auto") == ("auto", "auto", {})
    # The compressor as gradcomp.planner.from_spec reads it, name@value included.
    assert specs.parse_run("topk@0.1:algorithm=two_phase")[1:] == (
        "topk",
        {"ratio": 0.1, "algorithm": "two_phase"},
    )
    assert specs.parse_run("int8:algorithm=hierarchical,inter_algorithm=allgather")[2] == {
        "algorithm": "hierarchical",
        "inter_algorithm": "allgather",
    }
    for bad in (
        "int9",
        "topk:ratio",
        "topk:bogus=1",
        "auto:ratio=1",
        "auto:allow=int8|int9",
        "auto:allow=powersgd",
        "int8:inter_algorithm=allgather",  # only with algorithm=hierarchical
        "topk:algorithm=hierarchical,inter_algorithm=dense",  # Top-K's payloads cannot be summed
    ):
        with pytest.raises(Exception, match="."):
            specs.parse_run(bad)
    with pytest.raises(ValueError, match="rate"):
        units.parse_rate("1gbps")


def test_table_aligns_and_groups():
    rows = [["x", "1", "left"], ["yy", "22", "l"]]
    table = tables.format_table(["a", "b", "note"], rows, [("", 1), ("G", 2)], left=(0, -1))
    lines = table.splitlines()
    assert lines[0].strip() == "G"
    assert lines[3] == "x    1  left"
    assert lines[4] == "yy  22  l"


def test_allreduce_methods_follow_the_algorithm_option():
    allreduce = importlib.import_module("allreduce")
    default = allreduce.methods(["int8", "topk"], "default")
    assert [(m["label"], m["algorithm"]) for m in default] == [("int8", "two_phase"), ("topk", "allgather")]
    wide = allreduce.methods(["topk"], "default", 8)  # the defaults of 8 ranks
    assert [(m["label"], m["algorithm"]) for m in wide] == [("topk", "two_phase")]
    every = allreduce.methods(["int8", "randk"], "all")
    assert [m["label"] for m in every] == [
        "int8/allgather",
        "int8/two_phase",
        "randk/dense",
        "randk/allgather",
    ]
    assert allreduce.message_sizes(65536, 300_000) == [65536, 131072, 262144]


# The scripts that draw a PNG beside their results: those that publish with a plot.
PLOTTING = sorted(
    name.removesuffix(".py")
    for name in os.listdir(BENCH)
    if name.endswith(".py")
    and re.search(r"publish(_curves)?\([^)]*\bplot\b", pathlib.Path(BENCH, name).read_text())
)


@pytest.mark.parametrize("script", PLOTTING)
def test_plot_draws_again_what_each_script_drew(script):
    plot = importlib.import_module("plot")
    assert plot.drawer({"benchmark": script, "settings": {}, "curves": {}}) is not None


def test_a_folded_sweep_keeps_each_run_whole_and_plot_names_them_as_before(tmp_path):
    fold, plot = importlib.import_module("fold"), importlib.import_module("plot")
    runs = {
        "lr1e-3": {"benchmark": "x", "records": [{"loss": 1.5}]},
        "lr2e-3": {"benchmark": "x", "records": []},
    }
    for key, document in runs.items():
        (tmp_path / f"convergence-w2-{key}.json").write_text(json.dumps(document))
    folded = tmp_path / "convergence-w2-lr-sweep.json"
    files = sorted(str(path) for path in tmp_path.glob("convergence-w2-lr*.json"))
    assert fold.main([str(folded), "--prefix", "convergence-w2-", *files]) == 0
    document = json.loads(folded.read_text())
    assert document["runs"] == runs and document["prefix"] == "convergence-w2-"
    assert document["command"].startswith("python bench/fold.py ")
    pngs = [png for _, png in plot.documents(str(folded))]
    assert pngs == [str(tmp_path / f"convergence-w2-{key}.png") for key in runs]
    with pytest.raises(SystemExit):  # a folded file is not folded again
        fold.main([str(tmp_path / "again.json"), str(folded)])


@pytest.mark.slow
def test_every_script_has_help():
    for name in ("allreduce.py", "ddp_train.py", "convergence.py"):
        assert "usage:" in run_script(name, "--help").stdout


def test_bandwidth_without_root_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert link.run_limited(["true"], "1gbit", 2) == 2
    assert "needs root" in capsys.readouterr().err


def test_emulated_cluster_without_root_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(SystemExit) as ended:
        cluster.EmulatedCluster(2, 2, "1gbit").__enter__()
    assert ended.value.code == 2 and "needs root" in capsys.readouterr().err


@pytest.mark.slow
def test_cluster_options_are_checked():
    result = run_script("ddp_train.py", "--nodes", "2", "--bandwidth", "1gbit", check=False)
    assert result.returncode == 2 and "use --inter-bandwidth" in result.stderr
    result = run_script("ddp_train.py", "--nodes", "1", check=False)
    assert result.returncode == 2 and "at least 2 nodes" in result.stderr


def _abort_on_rank_one(rank, world_size):
    if rank == 1:
        os.abort()
    import torch.distributed as dist

    dist.barrier()


@pytest.mark.slow
def test_spawn_reports_a_native_abort():
    with pytest.raises(gradcomp.spawn.RanksFailed, match="SIGABRT") as failed:
        spawning.spawn(_abort_on_rank_one, 2, timeout=60)
    assert "SIGABRT" in spawning.reason(failed.value)


# ----------------------------------------------------------------------------- scripts


@pytest.mark.slow
def test_allreduce_smoke(tmp_path):
    args = ["--spawn", "2", "--min-bytes", "64KiB", "--max-bytes", "128KiB", "--warmup", "1", "--iters", "2"]
    result = run_script("allreduce.py", *args, "--compressors", "none", "int8,topk", "--out", str(tmp_path))
    assert "dense fp32 all_reduce" in result.stdout and "int8" in result.stdout
    rows, document = read_results(tmp_path, stem("allreduce"))
    assert [(int(r["size_bytes"]), r["method"]) for r in rows] == [
        (size, method) for size in (65536, 131072) for method in ("dense", "none", "int8", "topk")
    ]
    for row in rows:
        assert float(row["time_us"]) > 0 and float(row["speedup"]) > 0
        assert row["backend"] == "gloo" and row["world_size"] == "2"
    dense = rows[0]
    assert float(dense["busbw_GBps"]) == pytest.approx(float(dense["algbw_GBps"]))  # 2 (W-1)/W = 1
    int8 = next(r for r in rows if r["method"] == "int8")
    assert 3.5 < int(int8["dense_bytes_sent"]) / int(int8["bytes_sent"]) < 4.1
    assert document["settings"]["iters"] == 2


@pytest.mark.slow
def test_ddp_train_smoke(tmp_path):
    args = [*TINY_MODEL, "--bucket-cap-mb", "4096", "--compressors", "int8", "auto:allow=int8"]
    args += ["--baselines", "fp16_hook", "powersgd", "--link-check-bytes", "256KiB", "--rounds", "2"]
    result = run_script("ddp_train.py", *args, "--out", str(tmp_path))
    assert "link check" in result.stdout
    rows, document = read_results(tmp_path, stem("ddp_train"))
    assert [r["run"] for r in rows] == [
        "compute only",
        "dense",
        "torch fp16 hook",
        "torch PowerSGD r4",
        "int8",
        "auto:allow=int8",
    ]
    by_run = {r["run"]: r for r in rows}
    # auto planned its one bucket (the model's whole 6.9K parameters) as int8 or dense,
    # and says what it tried where the model could not tell two choices apart.
    kept, _, tried = by_run["auto:allow=int8"]["note"].partition(" (tried ")
    assert kept in ("auto: int8 allgather x1", "auto: int8 two_phase x1", "auto: none dense x1")
    pattern = r".+ against .+: (\d+|inf) vs (\d+|inf) ms, kept the (first|second)\)"
    assert not tried or re.fullmatch(pattern, tried)
    assert all(not r["failed"] for r in rows)
    assert float(by_run["dense"]["ratio"]) == 1.0
    assert float(by_run["torch fp16 hook"]["ratio"]) == 2.0
    assert 3.5 < float(by_run["int8"]["ratio"]) < 4.1
    assert float(by_run["torch PowerSGD r4"]["ratio"]) > 1  # rank-4 factors of a 64-wide MLP
    for run in ("dense", "int8"):
        assert float(by_run[run]["step_ms"]) > 0 and 0 < float(by_run[run]["loss"]) < 3
    assert document["link_check"]["seconds"] > 0
    # Two rounds: each run's one timed step from both rounds pooled.
    pooled = {r["run"]: r for r in document["records"]}
    for run in ("int8", "torch PowerSGD r4"):
        assert len(pooled[run]["step_ms_all"]) == 2 and pooled[run]["rounds"] == 2


def test_interleaved_runs_take_their_untimed_steps_in_turn_then_a_timed_step_each_in_rotation(monkeypatch):
    schedule = importlib.import_module("lib.ddp_schedule")
    order = []

    class Fake:
        def __init__(self, rank, world_size, run, settings):
            self.label, self.done = run["label"], 0
            self.warmup = settings["warmup_steps"] + (2 if run["label"] == "auto" else 0)  # its trial
            self.steps = settings["steps"] + self.warmup - settings["warmup_steps"]

        def step(self):
            order.append((self.label, self.done))
            self.done += 1

        def run_until(self, steps):
            while self.done < steps:
                self.step()

        def record(self):
            assert self.done == self.steps
            return self.label

    monkeypatch.setattr(schedule, "Training", Fake)
    runs = [dict(label=label, position=i) for i, label in enumerate(("dense", "int8", "auto"), 1)]
    settings = dict(steps=5, warmup_steps=2, total_runs=3)
    assert schedule.train_interleaved(0, 2, runs, settings) == ["dense", "int8", "auto"]
    untimed = [("dense", 0), ("dense", 1), ("int8", 0), ("int8", 1), *[("auto", s) for s in range(4)]]
    timed = [("dense", 2), ("int8", 2), ("auto", 4), ("int8", 3), ("auto", 5), ("dense", 3)]
    timed += [("auto", 6), ("dense", 4), ("int8", 4)]
    assert order == untimed + timed


@pytest.mark.slow
def test_ddp_train_interleaved_trains_each_run_as_run_alone(tmp_path):
    args = [*TINY_MODEL, "--compressors", "int8", "--baselines", "--link-check-bytes", "256KiB"]
    alone = run_script("ddp_train.py", *args, "--out", str(tmp_path / "alone"))
    interleaved = run_script("ddp_train.py", *args, "--interleave", "--out", str(tmp_path / "interleaved"))
    assert "runs interleaved" in interleaved.stdout and "runs interleaved" not in alone.stdout
    losses = []
    for out in ("alone", "interleaved"):
        rows, _ = read_results(tmp_path / out, stem("ddp_train"))
        assert [r["run"] for r in rows] == ["compute only", "dense", "int8"]
        assert all(float(r["step_ms"]) > 0 for r in rows)
        losses.append({r["run"]: r["loss"] for r in rows if r["run"] != "compute only"})
    # The same steps on the same batches: the same bits, whatever ran in between.
    assert losses[0] == losses[1] and all(0 < float(v) < 3 for v in losses[0].values())


@pytest.mark.slow
def test_convergence_smoke(tmp_path):
    args = ["--epochs", "1", "--width", "32", "--compressors", "int8", "--momentum", "0.5"]
    result = run_script("convergence.py", *args, "--progress", "--out", str(tmp_path))
    assert "momentum 0.5 " in result.stdout
    # tqdm rewrites its bar in place: a carriage return, then the run and the count.
    assert re.search(r"\r[^\r\n]*int8[^\r\n]*\| *[23]/3 ", result.stderr), result.stderr[-500:]
    rows, document = read_results(tmp_path, stem("convergence"))
    assert [r["run"] for r in rows] == ["dense", "int8 (feedback)", "int8 (no feedback)"]
    columns = {"train_loss", "loss_vs_dense", "test_accuracy", "test_loss", "weight_sq", "bytes_per_step"}
    assert columns | {"target"} <= set(rows[0])
    assert float(rows[0]["weight_sq"]) > 0 and float(rows[0]["test_loss"]) > 0
    assert float(rows[0]["loss_vs_dense"]) == 0
    assert rows[1]["target"].startswith(("met", "missed"))
    assert all(len(curve) == 1 for curve in document["curves"].values())
    assert document["settings"]["momentum"] == 0.5


@pytest.mark.slow
def test_convergence_dense_steps_reduce_first_and_count_their_bytes(tmp_path):
    # 1347 training images in batches of 64: 21 steps an epoch; the dense start is the first epoch.
    args = ["--epochs", "2", "--width", "32", "--compressors", "int8"]
    plain, start = tmp_path / "plain", tmp_path / "dense_start"
    run_script("convergence.py", *args, "--out", str(plain))
    result = run_script("convergence.py", *args, "--dense-steps", "21", "--out", str(start))
    assert "compressed runs dense for their first 21 steps" in result.stdout
    plain_rows, plain_doc = read_results(plain, stem("convergence"))
    start_rows, start_doc = read_results(start, stem("convergence"))
    dense, compressed = float(plain_rows[0]["bytes_per_step"]), float(plain_rows[1]["bytes_per_step"])
    assert compressed < dense / 3
    for row in start_rows[1:]:
        assert int(row["steps"]) == 42
        # The hook's dense steps send DDP's bytes and the fingerprint's lanes (one set a step).
        expected = (dense + LANE_BYTES + compressed) / 2
        assert float(row["bytes_per_step"]) == pytest.approx(expected, rel=1e-12)
    # The dense epoch trains exactly as the dense run does (the same average, bit for bit);
    # a compressed first epoch does not.
    dense_curve = start_doc["curves"]["dense"]
    for run in ("int8 (feedback)", "int8 (no feedback)"):
        assert start_doc["curves"][run][0] == dense_curve[0]
        assert plain_doc["curves"][run][0] != dense_curve[0]
    assert start_doc["settings"]["dense_steps"] == 21


@pytest.mark.slow
def test_convergence_vision_task_trains_a_cnn(tmp_path):
    args = ["--task", "vision", "--epochs", "1", "--width", "4", "--compressors", "powersgd"]
    result = run_script("convergence.py", *args, "--out", str(tmp_path))
    assert "CNN conv4-conv8-pool-10" in result.stdout
    rows, _ = read_results(tmp_path, stem("convergence-vision"))
    assert [r["run"] for r in rows] == ["dense", "powersgd (feedback)", "powersgd (no feedback)"]
    # Bytes as the cost model counts them for this CNN's shapes: the 10 x 128
    # layer factorised at rank 4, the convolutions (too small to pay) and biases dense.
    net = importlib.import_module("convergence").make_cnn(4, 10, seed=0)
    shapes = [tuple(p.shape) for p in net.parameters()]
    numel = sum(p.numel() for p in net.parameters())
    expected = gradcomp.collectives.cost_model.cost("powersgd", numel, 2, shapes=shapes).bytes_sent
    assert float(rows[1]["bytes_per_step"]) == expected < float(rows[0]["bytes_per_step"])


@pytest.mark.slow
def test_convergence_lm_task_runs_every_kind_and_counts_bytes_alike(tmp_path):
    args = ["--task", "lm", "--steps", "4", "--corpus-bytes", "40000", "--dense-steps", "2"]
    result = run_script("convergence.py", *args, "--compressors", "powersgd", "int8", "--out", str(tmp_path))
    assert (
        "byte-level GPT" in result.stdout and "compressed runs dense for their first 2 steps" in result.stdout
    )
    rows, document = read_results(tmp_path, stem("convergence-lm"))
    # And CompressedAdam's default run, its warm-up a fifth of the steps.
    names = ["dense", "torch fp16 hook", "torch PowerSGD rank 4", "powersgd", "int8"]
    assert [r["run"] for r in rows] == [*names, "CompressedAdam sign:gradient=int4 (warm-up 1)"]
    bytes_per_step = {r["run"]: float(r["bytes_per_step"]) for r in rows}
    # gradcomp's powersgd counts what its collectives send; torch's hook is
    # counted from the model's shapes by the same rule: they agree but for the
    # fingerprint's lanes gradcomp adds, whole sets of them.
    extra = (bytes_per_step["powersgd"] - bytes_per_step["torch PowerSGD rank 4"]) * 4  # 4 steps
    assert extra > 0 and extra % LANE_BYTES == 0, extra
    assert bytes_per_step["powersgd"] < bytes_per_step["int8"] < bytes_per_step["dense"]
    assert all(math.isfinite(float(r["validation_loss"])) for r in rows)
    assert rows[3]["target"].startswith(("met", "missed")) and rows[1]["target"] == ""
    # Every run starts from the same model: the same loss before the first step.
    assert len({curve[0][1] for curve in document["curves"].values()}) == 1
    assert document["corpus"]["bytes"] == 40000 and document["corpus"]["validation_bytes"] == 4000


@pytest.mark.slow
def test_convergence_lm_task_runs_under_fsdp2_between_replicas_and_in_the_reduce_scatter(tmp_path):
    args = ["--task", "lm", "--fsdp", "--spawn", "2", "--steps", "3", "--corpus-bytes", "40000"]
    specs = ["int8", "int8:via=reduce_scatter,residual=bf16"]
    run_script("convergence.py", *args, "--compressors", *specs, "--out", str(tmp_path))
    rows, document = read_results(tmp_path, stem("convergence-lm-fsdp"))
    assert [r["run"] for r in rows] == ["dense", "int8", "int8,via=reduce_scatter,residual=bf16"]
    # Bytes from gradcomp's statistics: 3.9x fewer than the same reduction dense.
    assert all(3.8 < float(r["ratio"]) < 4 for r in rows[1:])
    assert all(math.isfinite(float(r["validation_loss"])) for r in rows)
    assert len({curve[0][1] for curve in document["curves"].values()}) == 1


@pytest.mark.slow
def test_convergence_lm_task_runs_diloco_and_counts_the_bytes_of_its_synchronisations(tmp_path):
    args = [
        "--task",
        "lm",
        "--steps",
        "6",
        "--corpus-bytes",
        "40000",
        "--compressors",
        "--baselines",
        "--adam",
    ]
    streamed = "int4:sync_every=3,fragments=2,overlap_steps=1,lr=1e-3"
    runs = ["int4:sync_every=3,outer_lr=0.7", streamed]
    run_script("convergence.py", *args, "--diloco", *runs, "--out", str(tmp_path))
    rows, _ = read_results(tmp_path, stem("convergence-lm"))
    assert [r["run"] for r in rows] == ["dense", *(f"DiLoCo {run}" for run in runs)]
    net = importlib.import_module("lib.lm").GPT(
        **importlib.import_module("lib.convergence_lm").LM_MODEL, seed=0
    )
    numel = sum(p.numel() for p in net.parameters())
    # Two synchronisations of int4 in six steps, rank 0's bytes.
    int4 = gradcomp.collectives.cost_model.cost("int4", numel, 2).bytes_sent
    assert float(rows[1]["bytes_per_step"]) == pytest.approx(2 * int4 / 6, rel=1e-12)
    assert math.isfinite(float(rows[1]["validation_loss"]))
    # Two fragments, each exchanged twice in six steps, then both once more at the end
    # (synchronize(): the model every rank holds); a fragment's payload has its own padding.
    assert float(rows[2]["bytes_per_step"]) == pytest.approx(3 * int4 / 6, rel=0.02)
    assert math.isfinite(float(rows[2]["validation_loss"]))


@pytest.mark.slow
def test_convergence_lm_task_starts_every_run_from_the_same_dense_steps(tmp_path):
    args = ["--task", "lm", "--steps", "2", "--corpus-bytes", "40000", "--compressors", "--baselines"]
    args += ["--adam", "--init-steps", "3", "--diloco", "int4:sync_every=2", "--out", str(tmp_path)]
    run_script("convergence.py", *args)
    rows, document = read_results(tmp_path, stem("convergence-lm"))
    start = document["start"]
    assert start["steps"] == 3 and [step for step, _ in start["curve"]] == [0, 3]
    # Every run's first evaluation is the start's last: the weights it saved, loaded.
    assert [curve[0] for curve in document["curves"].values()] == [[0, start["validation_loss"]]] * 2
    # Three dense steps at lr 2e-3 moved the weights: not the untrained model's loss.
    assert start["validation_loss"] < start["curve"][0][1] - 0.1
    assert [r["run"] for r in rows] == ["dense", "DiLoCo int4:sync_every=2"]


@pytest.mark.slow
def test_convergence_lm_task_trains_another_gpt_on_another_corpus(tmp_path):
    shape = dict(width=32, layers=3, heads=2, context=16)
    args = ["--task", "lm", "--steps", "4", "--corpus-bytes", "20000", "--corpus", "c10", "--compressors"]
    args += ["--gpt", ",".join(f"{k}={v}" for k, v in shape.items()), "--baselines", "--adam"]
    # H = 3 in 4 steps: one exchange, then the run's end (total_steps) averages.
    args += ["--diloco", "int4:sync_every=2,follow_inner_lr=1", "int4:sync_every=3,total_steps=1"]
    args += ["--out", str(tmp_path)]
    result = run_script("convergence.py", *args)
    assert "bytes of torch's c10 C++ headers" in result.stdout
    rows, document = read_results(tmp_path, stem("convergence-lm-c10"))
    corpus = document["corpus"]
    assert document["model"] == shape and corpus["corpus"] == "c10" and corpus["bytes"] == 20000
    assert corpus["source"].endswith(os.path.join("include", "c10"))
    numel = sum(p.numel() for p in importlib.import_module("lib.lm").GPT(**shape, seed=0).parameters())
    int4 = gradcomp.collectives.cost_model.cost("int4", numel, 2).bytes_sent
    for row in rows[1:]:  # two exchanges each
        assert float(row["bytes_per_step"]) == pytest.approx(2 * int4 / 4, rel=1e-12)
    assert all(math.isfinite(float(r["validation_loss"])) for r in rows)
    bad = run_script("convergence.py", "--task", "lm", "--gpt", "depth=3", check=False)
    assert bad.returncode == 2 and "--gpt takes" in bad.stderr


@pytest.mark.slow
def test_convergence_vision_task_runs_diloco_from_a_dense_start(tmp_path):
    specs = ["int4:sync_every=4", "none:sync_every=5,follow_inner_lr=1"]
    args = ["--task", "vision", "--epochs", "2", "--compressors", "--init-steps", "30", "--diloco", *specs]
    stdout = run_script("convergence.py", *args, "--out", str(tmp_path)).stdout
    rows, document = read_results(tmp_path, stem("convergence-vision"))
    start = document["start"]
    # Every run starts below the untrained CNN's loss (ln 10), from the start's weights.
    assert start["steps"] == 30 and start["train_loss"] < math.log(10) - 0.1
    assert all(curve[0] < start["train_loss"] for curve in document["curves"].values())
    assert "every run from the weights of 30 dense steps" in stdout
    assert [r["run"] for r in rows] == ["dense", *(f"DiLoCo {spec}" for spec in specs)]
    numel = sum(p.numel() for p in importlib.import_module("convergence").make_cnn(16, 10, 0).parameters())
    # 2 epochs of 21 steps: 10 exchanges at H = 4, then synchronize() at step 42; 8 at H = 5, then one.
    int4 = gradcomp.collectives.cost_model.cost("int4", numel, 2).bytes_sent
    assert float(rows[1]["bytes_per_step"]) == pytest.approx(11 * int4 / 42, rel=1e-12)
    dense = float(rows[0]["bytes_per_step"])
    # `none` sends the tensor itself and the fingerprint's lanes in an all-reduce of their own.
    assert float(rows[2]["bytes_per_step"]) == pytest.approx(9 * (dense + LANE_BYTES) / 42, rel=1e-12)


@pytest.mark.slow
def test_convergence_runs_diloco_with_a_node_of_ranks_as_one_replica(tmp_path):
    spec = "int4:sync_every=4,total_steps=1,node_size=2"
    args = ["--task", "vision", "--epochs", "1", "--compressors", "--spawn", "4", "--diloco", spec]
    run_script("convergence.py", *args, "--out", str(tmp_path))
    rows, _ = read_results(tmp_path, stem("convergence-vision", 4))
    numel = sum(p.numel() for p in importlib.import_module("convergence").make_cnn(16, 10, 0).parameters())
    # Between 2 nodes, a rank sends its half of the node's int4 shard: 2 ranks' ratio, within
    # rounding, for 6 exchanges in 21 steps (every 4th, then the end).
    cost = gradcomp.collectives.cost_model.cost("int4", numel, 2).bytes_sent
    assert float(rows[1]["ratio"]) == pytest.approx(numel * 4 / cost * 21 / 6, rel=0.01)
    assert math.isfinite(float(rows[1]["test_loss"]))
    bad = run_script("convergence.py", *args[:-1], "int4:sync_every=4,node_size=3", check=False)
    assert bad.returncode == 2 and "node_size=3 must divide --spawn 4" in bad.stderr


@pytest.mark.slow
def test_convergence_lm_task_runs_compressed_adam_and_counts_its_bytes(tmp_path):
    args = ["--task", "lm", "--steps", "5", "--corpus-bytes", "40000", "--compressors", "--baselines"]
    adam = [
        "--adam",
        "sign:warmup=2,algorithm=allgather",
        "int4:warmup=3,gradient=int8:block=128,exact=embeddings,block=512",
    ]
    run_script("convergence.py", *args, *adam, "--out", str(tmp_path))
    rows, document = read_results(tmp_path, stem("convergence-lm"))
    assert [r["run"] for r in rows] == [
        "dense",
        "CompressedAdam sign:warmup=2,algorithm=allgather",
        "CompressedAdam int4:warmup=3,gradient=int8:block=128,exact=embeddings,block=512",
    ]
    convergence = importlib.import_module("lib.convergence_lm")
    net = importlib.import_module("lib.lm").GPT(**convergence.LM_MODEL, seed=0)
    numel = sum(p.numel() for p in net.parameters())
    cost = gradcomp.collectives.cost_model.cost
    # Rank 0's bytes: two dense steps, then three of sign gathered; one bucket.
    sign = cost("sign", numel, 2, "allgather").bytes_sent
    expected = (2 * cost("none", numel, 2).bytes_sent + 3 * sign) / 5
    assert float(rows[1]["bytes_per_step"]) == pytest.approx(expected, rel=1e-12)
    # With exact embeddings, those and every vector go dense at every step.
    groups = convergence.adam_groups(net, "embeddings")
    exact = sum(p.numel() for p in groups[1]["params"])
    assert exact == 256 * 128 + 64 * 128 + sum(p.numel() for p in net.parameters() if p.dim() < 2)
    assert float(rows[2]["bytes_per_step"]) < float(rows[0]["bytes_per_step"]) / 2
    assert all(math.isfinite(float(r["validation_loss"])) for r in rows) and rows[1]["target"] == ""
    assert len({curve[0][1] for curve in document["curves"].values()}) == 1


@pytest.mark.slow
def test_convergence_adam_specs_are_checked():
    for spec, message in (
        ("sign:warmup=x", "warmup must be an integer"),
        ("sign:exact=norms", "exact must be one of"),
        ("sign:gradient=int3", "unknown compressor"),
        ("sign:blok=3", "has no option"),
        ("sign:gradient=int8:algorithm=allgather", "takes the run's algorithm"),
    ):
        result = run_script("convergence.py", "--task", "lm", "--adam", spec, check=False)
        assert result.returncode == 2 and message in result.stderr, (spec, result.stderr)
    result = run_script("convergence.py", "--adam", "sign", check=False)
    assert result.returncode == 2 and "--adam is for --task lm" in result.stderr


@pytest.mark.slow
def test_convergence_rejects_bad_settings():
    result = run_script("convergence.py", "--momentum", "1", check=False)
    assert result.returncode == 2 and "--momentum" in result.stderr
    result = run_script("convergence.py", "--dense-steps", "-1", check=False)
    assert result.returncode == 2 and "--dense-steps" in result.stderr


needs_namespaces = pytest.mark.skipif(
    os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")),
    reason="--bandwidth and --nodes need root and iproute2 (ip, tc) to create network namespaces",
)


def _namespaces() -> set[str]:
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in listing.splitlines() if line.strip()}


@pytest.mark.slow
@needs_namespaces
def test_bandwidth_limit_applies_and_the_namespace_is_removed(tmp_path):
    before = _namespaces()
    args = [
        *TINY_MODEL,
        "--compressors",
        "--baselines",
        "--bandwidth",
        "50mbit",
        "--link-check-bytes",
        "1MiB",
        "--out",
        str(tmp_path),
    ]
    result = run_script("ddp_train.py", *args)
    # Each rank's link: the loopback carries both ranks' sends, limited to twice the rate.
    assert "loopback limited to 100000000bit, 50mbit for each of 2 ranks" in result.stderr
    assert _namespaces() == before
    rows, document = read_results(tmp_path, stem("ddp_train") + "-50mbit")
    assert "50mbit a rank" in rows[0]["link"] and "50mbit a rank" in rows[0]["machine"]
    check = document["link_check"]
    # 2 ranks x 1 MiB cross the loopback: 168 ms at 100 Mbit/s; unlimited it takes about 1 ms.
    assert check["expected_seconds"] == pytest.approx(2 * 2**20 * 8 / 100e6)
    assert check["seconds"] > 0.5 * check["expected_seconds"] > 0.05


@pytest.mark.slow
@needs_namespaces
def test_a_sweep_of_links_runs_auto_beside_the_static_choices_at_each(tmp_path):
    before = _namespaces()
    args = [*TINY_MODEL, "--compressors", "int8", "auto", "--baselines", "--bandwidth", "50mbit,none"]
    args += ["--link-check-bytes", "256KiB", "--out", str(tmp_path)]
    result = run_script("ddp_train.py", *args, timeout=400)
    assert _namespaces() == before
    # Each link's own results, then the sweep's.
    _, limited = read_results(tmp_path, stem("ddp_train") + "-50mbit")
    read_results(tmp_path, stem("ddp_train"))
    rows, document = read_results(tmp_path, stem("ddp_train") + "-sweep")
    assert [(r["link"], r["run"]) for r in rows] == [
        (link, run) for link in ("50mbit", "none") for run in ("dense", "int8", "auto")
    ]
    for row in rows:
        assert float(row["step_ms"]) > 0
        if row["run"] == "auto":
            assert row["best_static"] in ("dense", "int8") and float(row["x_best_static"]) > 0
            assert row["note"].startswith("auto: ")
            assert float(row["predicted_comm_ms"]) > 0  # its plan's, from what the hook measured
        else:  # predicted from the probe in the run on that link
            assert float(row["predicted_comm_ms"]) > 0 and row["predicted_from"] == "a probe in the run"
    # The prediction on the limited link: from the probe the run made on it, after its runs,
    # of the link and of the static runs' codecs at the model's bucket sizes.
    from gradcomp import planner

    buckets = next(r for r in limited["records"] if r["run"] == "dense")["bucket_numels"]
    probed = planner.Profile.from_json(limited["probe"])
    assert list(probed.codecs) == ["int8"] and probed.world_size == 2
    expected = sum(planner.predict("none", n, 2, probed).seconds for n in buckets)
    int8 = sum(planner.predict("int8", n, 2, probed).seconds for n in buckets)
    assert buckets and sum(buckets) == 32 * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    predicted = {(r["link"], r["run"]): float(r["predicted_comm_ms"]) for r in rows}
    assert predicted["50mbit", "dense"] == pytest.approx(1e3 * expected)
    assert predicted["50mbit", "int8"] == pytest.approx(1e3 * int8)
    assert "50mbit: auto: " in result.stdout and "target on the unlimited link" in result.stdout
    assert "cost model (a probe in the run): " in result.stdout and " of 4 static runs" in result.stdout
    assert "probe (after the first round's runs): all_reduce " in result.stdout
    assert "the transport's CPU ms a MB sent: all_reduce " in result.stdout
    assert "cost model (its own measurements): " in result.stdout and " of 2 auto runs" in result.stdout
    # auto's prediction is its plan's: the planned buckets' predicted seconds, in ms.
    auto = next(r for r in limited["records"] if r["run"] == "auto")
    assert auto["predicted_comm_ms"] == auto["planned_comm_ms"] > 0
    # When its buckets were handed over, before the last (kept for the overlap comparison).
    assert len(auto["ready_offsets"]) == len(auto["bucket_numels"]) and max(auto["ready_offsets"]) == 0
    assert len(document["sources"]) == 2


def test_the_ranks_get_time_for_every_dense_step_on_a_slow_link():
    schedule = importlib.import_module("lib.ddp_schedule")
    settings = dict(features=2048, width=4096, spawn=2, steps=12)
    assert schedule.ranks_deadline(settings, 7, None) == 600.0
    # 25.2M parameters: 2 ranks send 202 MB a dense step through a loopback of 100 Mbit/s
    # (50 Mbit/s a rank), 16 s.
    slow = schedule.ranks_deadline(settings, 7, link.link_settings("50mbit", 2))
    assert slow == pytest.approx(600 + 7 * 12 * 2 * 4 * 25_214_986 * 8 / 100e6)
    assert 1900 < slow < 2000


def test_sweep_rows_judge_auto_against_the_best_static_candidate():
    sweep = importlib.import_module("lib.ddp_sweep")
    report = importlib.import_module("lib.ddp_report")

    def record(run, kind, name, step_ms, options=None, note=""):
        return dict(
            run=run,
            kind=kind,
            name=name,
            options=options or {},
            step_ms=step_ms,
            comm_ms=step_ms - 100,
            note=note,
            failed="",
            bucket_numels=[2**20],
        )

    slow = [
        record("compute only", "compute", "", 100),
        record("dense", "dense", "", 2000),
        record("int8", "gradcomp", "int8", 950),
        record("topk", "gradcomp", "topk", 300),  # not a candidate of auto's default
        record("auto", "gradcomp", "auto", 990, note="auto: int4 allgather x2"),
    ]
    fast = [
        record("dense", "dense", "", 600),
        record("int8", "gradcomp", "int8", 900),
        record("auto:allow=int8|topk", "gradcomp", "auto", 610, {"allow": ["int8", "topk"]}, "auto: none"),
        record("topk", "gradcomp", "topk", 700),
    ]
    rows = sweep.sweep_rows([("1gbit", {"records": slow}), ("none", {"records": fast})])
    autos = [r for r in rows if "x_best_static" in r]
    assert [(r["link"], r["best_static"]) for r in autos] == [("1gbit", "int8"), ("none", "dense")]
    assert autos[0]["x_best_static"] == pytest.approx(990 / 950)
    assert autos[1]["x_dense"] == pytest.approx(610 / 600)
    assert [r["auto_candidate"] for r in rows if r["link"] == "1gbit"] == [True, True, False, False]
    text = sweep.format_sweep(rows)
    judged = "1gbit: auto: int4 allgather x2; 990 ms = "
    judged += "1.04x the best static choice (int8; target <= 1.05x: met)"
    assert judged in text
    assert "(target on the unlimited link <= 1.03x: met)" in text
    # auto's prediction is its own plan's (a labelled auto run too); a failed run is passed over.
    slow[-1]["planned_comm_ms"], fast[2]["planned_comm_ms"] = 800.0, 1000.0
    failed = dict(run="torch PowerSGD r4", kind="powersgd", failed="process 0 terminated", note="")
    report.add_predictions([*slow, failed], 2)
    report.add_predictions(fast, 2)
    assert slow[-1]["model_error"] == pytest.approx(800 / 890 - 1) and fast[2]["predicted_comm_ms"] == 1000.0
    text = sweep.format_sweep(sweep.sweep_rows([("1gbit", {"records": slow}), ("none", {"records": fast})]))
    assert "cost model (its own measurements): 1 of 2 auto runs predicted within 25%" in text
    assert "cost model (the stored profile): " in text and " of 6 static runs" in text
    assert "no communication observed" not in text
    # A step no faster than compute-only leaves nothing to compare with: counted, not within.
    idle = [record("dense", "dense", "", 95), record("auto", "gradcomp", "auto", 99)]
    idle[-1]["planned_comm_ms"] = 0.5
    report.add_predictions(idle, 2)
    assert math.isnan(idle[-1]["model_error"]) and idle[-1]["predicted_comm_ms"] == 0.5
    text = sweep.format_sweep(
        sweep.sweep_rows(
            [("1gbit", {"records": slow}), ("none", {"records": fast}), ("x", {"records": idle})]
        )
    )
    assert (
        "cost model (its own measurements): 1 of 3 auto runs predicted within 25% of the observed "
        "communication (1 with no communication observed: step within compute-only)"
    ) in text
    # A probe of the run's own machine and link predicts instead of the stored profile.
    from gradcomp import planner

    probed = planner.Profile.load().with_link(1e6)  # 1 MB/s a rank: slower than any stored link
    report.add_predictions(slow, 2, probed.to_json())
    dense = 1e3 * planner.predict("none", 2**20, 2, probed).seconds
    assert slow[1]["predicted_comm_ms"] == pytest.approx(dense) and dense > 1e3 * 4 * 2**20 / 1e6
    assert slow[2]["predicted_from"] == "a probe in the run" and "model_error" in slow[2]
    text = sweep.format_sweep(sweep.sweep_rows([("1gbit", {"records": slow})]))
    assert "cost model (a probe in the run): 0 of 3 static runs" in text


def test_lm_targets_judge_runs_of_few_bytes_against_dense_and_torch_powersgd():
    convergence = importlib.import_module("lib.convergence_lm")

    def run(kind, loss, ratio, compressor="", options=None):
        return dict(
            kind=kind,
            validation_loss=loss,
            ratio=ratio,
            bytes_per_step=1000 / ratio,
            compressor=compressor,
            options=options or {},
        )

    records = [
        run("dense", 2.0, 1.0),
        run("powersgd_hook", 2.2, 18.5),
        run("gradcomp", 2.01, 3.9, "int8"),
        run("adam", 2.05, 19.4, "sign"),  # +2.5% at 19.4x: met, and beats torch's hook
        run("adam", 2.07, 19.4, "sign"),  # +3.5%: missed
        run("gradcomp", 2.05, 16.5, "ternary", {"block": 64}),  # within 3% but more bytes than the hook
        run("gradcomp", 2.0, 15.9, "int2"),  # under 16x: no target
        run("adam", math.nan, 30.0, "sign"),
    ]
    convergence.lm_derive(records)
    targets = [r["target"] for r in records]
    assert targets[:3] == ["", "", "met (within 1%)"]
    assert targets[3] == "met (16x+, within 3%); beats torch PowerSGD"
    assert targets[4] == "missed (16x+, within 3%): +3.5%"
    assert targets[5] == "missed: not below torch PowerSGD in both loss and bytes"
    assert targets[6] == "" and targets[7] == "missed (16x+, within 3%): no finite loss"
    # Without torch's hook in the run, only dense judges.
    del records[1]
    convergence.lm_derive(records)
    assert records[4]["target"] == "met (16x+, within 3%)"


def test_convergence_target_says_when_a_run_diverged():
    convergence = importlib.import_module("convergence")
    records = [{"run": "dense", "train_loss": 0.005}, {"run": "randk (feedback)", "train_loss": float("nan")}]
    records.append({"run": "int8 (feedback)", "train_loss": 0.00505})
    convergence.derive(records)
    assert records[1]["target"] == "missed: the loss is not finite (diverged)"
    assert records[2]["target"] == "met"


@pytest.mark.slow
@needs_namespaces
def test_emulated_cluster_limits_only_the_links_between_nodes(tmp_path):
    from gradcomp import planner

    before = _namespaces()
    args = [*TINY_MODEL, "--compressors", "int8:algorithm=hierarchical", "--baselines"]
    args += ["--nodes", "2", "--ranks-per-node", "2", "--inter-bandwidth", "100mbit"]
    result = run_script(
        "ddp_train.py", *args, "--link-check-bytes", "2MiB", "--out", str(tmp_path), timeout=240
    )
    assert _namespaces() == before
    assert "matches the limit" in result.stdout, result.stdout
    rows, document = read_results(tmp_path, stem("ddp_train", 4) + "-2x2-100mbit")
    assert "2 nodes x 2 ranks, 100mbit between nodes" in rows[0]["link"]
    check = document["link_check"]
    # Between nodes a 2-rank all-reduce of 2 MiB sends 2 MiB each way: 168 ms at 100 Mbit/s.
    assert 0.75 * 0.168 < check["inter_seconds"] < 0.168 / 0.75
    assert check["intra_gbit_per_s"] > 3 * 0.1  # inside a node: loopback, not limited
    hierarchical = next(r for r in rows if r["run"] == "int8:algorithm=hierarchical")
    # Each local rank sends its int8 shard (half the model) to the other node only.
    assert 0 < float(hierarchical["inter_bytes_per_step"]) < float(hierarchical["bytes_per_step"])
    assert 0 < float(hierarchical["loss"]) < 3
    # The probe in the run measured both levels, and the hierarchical run is predicted from it.
    probed = planner.Profile.from_json(document["probe"])
    assert (probed.nodes.count, probed.nodes.size) == (2, 2) and probed.world_size == 4
    record = next(r for r in document["records"] if r["run"] == "int8:algorithm=hierarchical")
    buckets = record["bucket_numels"]
    expected = sum(planner.predict("int8", n, 4, probed, "hierarchical").seconds for n in buckets)
    assert record["predicted_from"] == "a probe in the run"
    assert record["predicted_comm_ms"] == pytest.approx(1e3 * expected)
    assert "cost model (a probe in the run): " in result.stdout and " of 2 static runs" in result.stdout
    assert "; between nodes all_reduce " in result.stdout and "all_reduce between nodes " in result.stdout


@pytest.mark.slow
def test_ddp_train_writes_profiler_traces_with_gradcomps_ranges(tmp_path):
    traces = tmp_path / "traces"
    args = [*TINY_MODEL, "--compressors", "int8", "--baselines", "--profile", str(traces)]
    run_script("ddp_train.py", *args, "--link-check-bytes", "256KiB", "--out", str(tmp_path))
    with open(traces / "ddp_train-int8.json") as file:
        names = {event.get("name", "") for event in json.load(file)["traceEvents"]}
    assert {"gradcomp.compress", "gradcomp.exchange", "gradcomp.decode", "gradcomp.bucket 0"} <= names
    assert (traces / "ddp_train-dense.json").exists()


@pytest.mark.slow
def test_trainer_train_smoke(tmp_path):
    pytest.importorskip("transformers", reason="the transformers extra is not installed")
    tiny = ["--layers", "1", "--width", "32", "--heads", "2", "--context", "32", "--corpus-bytes", "256000"]
    result = run_script(
        "trainer_train.py", *tiny, "--steps", "6", "--warmup-steps", "1", "--rounds", "1",
        "--compressors", "int8", "--out", str(tmp_path),
    )  # fmt: skip
    assert "round 1    dense" in result.stdout and "round 1     int8" in result.stdout
    with open(os.path.join(tmp_path, f"{stem('trainer_train')}.json")) as file:
        records = json.load(file)["records"]
    dense, int8 = records
    assert (dense["run"], int8["run"]) == ("dense", "int8")
    assert dense["ratio"] == 1.0 and 3 < int8["ratio"] < 4.1 and int8["timed_steps"] == 4
    assert abs(int8["eval_loss"] - dense["eval_loss"]) < 0.02 * dense["eval_loss"]
