"""``ddp_train.py``'s results: derived figures, the cost model's predictions, the table, the plot.

Communication time is a run's step minus the compute-only run's; ratios are
against dense and torch's fp16 hook of the same run. The planner predicts each
static run's communication from a probe made in the run (or the stored
profile), and auto's from its own plan.

Example:
    >>> derive(records)
    >>> add_predictions(records, world_size, probed)
    >>> print(format_report(records))
"""

from __future__ import annotations

import math

from gradcomp import planner
from gradcomp.tables import format_cell, format_table
from gradcomp.units import format_size
from lib import link
from lib.ddp_training import CLASSES, LATENT
from lib.plots import figure
from lib.results import ratio
from lib.specs import compressor_of


def derive(records: list[dict]) -> None:
    """Add communication time and the ratios to each record, from the same run's baselines."""
    by_kind = {record["kind"]: record for record in records if not record["failed"]}
    compute = by_kind["compute"]["step_ms"]
    dense = by_kind["dense"]
    dense_comm = dense["step_ms"] - compute
    fp16 = by_kind.get("fp16_hook")
    fp16_comm = fp16["step_ms"] - compute if fp16 else math.nan
    for record in records:
        if record["failed"]:
            continue
        comm = record["step_ms"] - compute
        record["compute_ms"] = compute
        record["comm_ms"] = comm if record["kind"] != "compute" else 0.0
        record["ratio"] = ratio(record["dense_bytes_per_step"], record["bytes_per_step"])
        if record["kind"] != "compute":
            record["comm_speedup_vs_dense"] = ratio(dense_comm, comm)
            record["comm_speedup_vs_fp16_hook"] = ratio(fp16_comm, comm)
            record["step_speedup_vs_dense"] = ratio(dense["step_ms"], record["step_ms"])
    # A hierarchical run against the flat run of the same compressor, if there is one.
    flat = {
        r["name"]: r["comm_ms"]
        for r in records
        if r["kind"] == "gradcomp" and not r["failed"] and r["options"].get("algorithm") != "hierarchical"
    }
    for record in records:
        if record["kind"] == "gradcomp" and not record["failed"]:
            hierarchical = record["options"].get("algorithm") == "hierarchical"
            reference = flat.get(record["name"]) if hierarchical else None
            record["comm_speedup_vs_flat"] = ratio(reference, record["comm_ms"])


def add_predictions(records: list[dict], world_size: int, probed: dict | None = None) -> None:
    """The planner's predicted communication a step of dense and each static gradcomp run,
    against the observed (step minus compute-only): from ``probed`` (the profile measured in
    the run, on its link) where given, else from the stored profile on this run's link (a
    limited loopback carries every rank's sends: each rank gets the limit over the ranks;
    unlimited: the profile's own link). auto's is its plan's own (the link and codecs the
    hook measured in the run), where it planned. Each bucket's whole time: on CPUs the
    reductions compete with the backward pass for the cores, and crediting the overlap
    (``planner.exposed_seconds`` with auto's ``ready_offsets``) missed more
    (bench/reports/auto-sweeps-cpu2-2026.md, sweep G)."""
    for record in records:
        if record.get("name") == "auto" and not math.isnan(record.get("planned_comm_ms", math.nan)):
            record["predicted_comm_ms"] = record["planned_comm_ms"]
            record["model_error"] = ratio(record["planned_comm_ms"], record["comm_ms"]) - 1
    if probed is not None:
        profile, source = planner.Profile.from_json(probed), PROBED
    else:
        try:
            profile, source = planner.Profile.load(), STORED
        except FileNotFoundError:
            return
        limit = link.link_info()
        if limit:
            profile = profile.with_link(limit["bits_per_second"] / 8)
    for record in records:
        if record["failed"] or record["kind"] not in ("dense", "gradcomp") or record["name"] == "auto":
            continue
        algorithm, inter = record["options"].get("algorithm"), record["options"].get("inter_algorithm")
        try:
            compressor = compressor_of(record)
            seconds = sum(
                planner.predict(compressor, n, world_size, profile, algorithm, inter).seconds
                for n in record["bucket_numels"]
            )
        except (KeyError, ValueError):  # not measured in the profile, or not modelled
            continue
        record["predicted_comm_ms"] = 1e3 * seconds
        record["model_error"] = ratio(1e3 * seconds, record["comm_ms"]) - 1
        record["predicted_from"] = source


# Where a static run's predicted communication came from.
PROBED, STORED = "a probe in the run", "the stored profile"
# A static run's prediction counts as right within this fraction of its observed communication.
MODEL_TARGET = 0.25


def format_report(records: list[dict]) -> str:
    levels = any(not math.isnan(r.get("inter_bytes_per_step", math.nan)) for r in records)
    header = [
        "run",
        "bytes/step",
        *(["inter bytes/step", "comm x flat"] if levels else []),
        "ratio",
        "step ms",
        "comm ms",
        "comm x dense",
        "comm x fp16",
        "step x dense",
        "compress ms",
        "model ms",
        "loss",
        "buckets",
        "note",
    ]
    rows = []
    for r in records:
        if r["failed"]:
            rows.append(
                [r["run"], *["-"] * (len(header) - 2), f"failed: {r['failed']}; {r['note']}".strip("; ")]
            )
            continue
        rows.append(
            [
                r["run"],
                f"{r['bytes_per_step']:,.0f}",
                *(
                    [
                        format_cell(r.get("inter_bytes_per_step"), ",.0f"),
                        format_cell(r.get("comm_speedup_vs_flat"), ".2f", "x"),
                    ]
                    if levels
                    else []
                ),
                format_cell(r["ratio"], ".1f"),
                f"{r['step_ms']:.0f}",
                f"{r['comm_ms']:.0f}",
                format_cell(r.get("comm_speedup_vs_dense"), ".2f", "x"),
                format_cell(r.get("comm_speedup_vs_fp16_hook"), ".2f", "x"),
                format_cell(r.get("step_speedup_vs_dense"), ".2f", "x"),
                format_cell(r["compress_ms"], ".0f"),
                predicted_cell(r),
                format_cell(r["loss"], ".4f"),
                str(r["buckets"]),
                r["note"],
            ]
        )
    return format_table(header, rows, left=(0, -1))


def describe_model(records: list[dict]) -> str:
    """How many static runs the cost model predicted within its target, in a line ("" if none)."""
    static = [r for r in records if not r["failed"] and r.get("name") != "auto"]
    predicted = [r for r in static if not math.isnan(r.get("predicted_comm_ms", math.nan))]
    if not predicted:
        return ""
    within = sum(abs(r["model_error"]) <= MODEL_TARGET for r in predicted)
    sources = " and ".join(sorted({r.get("predicted_from") or STORED for r in predicted}))
    return (
        f"cost model ({sources}): {within} of {len(predicted)} static runs predicted within "
        f"{MODEL_TARGET:.0%} of the observed communication"
    )


def predicted_cell(record: dict) -> str:
    if math.isnan(record.get("predicted_comm_ms", math.nan)):
        return "-"
    return f"{record['predicted_comm_ms']:.0f} ({record['model_error']:+.0%})"


def plot(records: list[dict], title: str, path: str) -> None:
    """Stacked bars: compute and communication time per run, bytes ratio on top."""
    with figure(path, title, figsize=(max(8, 1.1 * len(records)), 5)) as (_, axis):
        labels = [r["run"] for r in records]
        positions = range(len(records))
        compute = [0 if r["failed"] else r["compute_ms"] for r in records]
        comm = [0 if r["failed"] else max(r["comm_ms"], 0) for r in records]
        axis.bar(positions, compute, color="#9aa5b1", label="compute (compute-only run)")
        axis.bar(positions, comm, bottom=compute, color="#d9534f", label="communication (step - compute)")
        for x, r in zip(positions, records, strict=True):
            top = 0 if r["failed"] else r["step_ms"]
            axis.text(x, top, _bar_label(r), ha="center", va="bottom", fontsize=7)
        axis.set_ylim(0, 1.15 * max(r.get("step_ms") or 0 for r in records))
        axis.set_xticks(list(positions), labels, rotation=30, ha="right", fontsize=8)
        label_step_axis(axis)


def label_step_axis(axis) -> None:
    """The step-time axis's label and the legend, as both of ddp_train's plots have them."""
    axis.set_ylabel("median step time (ms)")
    axis.legend(fontsize=8)


def _bar_label(record: dict) -> str:
    if record["failed"]:
        return "failed"
    if record["kind"] in ("compute", "dense"):
        return f"{record['step_ms']:.0f} ms"
    return f"{record['step_ms']:.0f} ms\n{record['ratio']:.0f}x fewer bytes"


def describe(settings: dict, records: list[dict]) -> str:
    parameters = next(r["parameters"] for r in records if not r["failed"])
    interleaved = (
        "runs interleaved (each run's untimed steps in turn, then a timed step of each, in rotating order); "
        if settings.get("interleave")
        else ""
    )
    return (
        f"MLP {settings['features']}-{settings['width']}-{settings['width']}-{CLASSES} "
        f"({parameters:,} parameters, bucket_cap_mb {settings['bucket_cap_mb']:g}), synthetic "
        f"data (a linear teacher on a {LATENT}-dim latent), batch {settings['batch_size']} per rank, "
        f"SGD lr {settings['lr']} momentum 0.9, "
        f"{settings['steps']} steps ({settings['warmup_steps']} untimed; auto runs its trial's "
        f"steps on top, untimed), median of the slowest rank; {interleaved}"
        "loss: cross-entropy on 2048 held-out samples after the steps (auto: after as many)"
    )


def describe_link(check: dict) -> str:
    text = (
        f"link check: dense all_reduce of {format_size(check['bytes'])} took "
        f"{check['seconds']:.3f} s = {check['loopback_gbit_per_s']:.2f} Gbit/s through the loopback "
        "(all ranks' traffic together)"
    )
    if "expected_seconds" in check:
        text += f"; the limit allows at best {check['expected_seconds']:.3f} s"
    return text


def describe_probe(profile: planner.Profile) -> str:
    """The in-run probe the static runs' predictions come from, in a line."""
    codecs = ", ".join(
        f"{name} {codec.encode.rate / 1e6:.0f}/{codec.decode.rate / 1e6:.0f}"
        for name, codec in profile.codecs.items()
    )
    text = (
        f"probe (after the first round's runs): all_reduce {profile.link.bandwidth * 8 / 1e9:.3g} Gbit/s "
        f"per rank, {profile.link.latency * 1e6:.3g} us a ring step"
    )
    links = {"all_reduce": profile.link, **profile.links}
    nodes = profile.nodes
    if nodes is not None:
        text += (
            f"; between nodes all_reduce {nodes.link.bandwidth * 8 / 1e9:.3g} Gbit/s per rank, "
            f"{nodes.link.latency * 1e6:.3g} us a ring step; the node's stages "
            f"{nodes.stages.rate / 1e6:.0f}M elements/s"
        )
        links |= {
            f"{name} between nodes": link for name, link in {"all_reduce": nodes.link, **nodes.links}.items()
        }
    per_byte = {name: link.cpu_seconds_per_byte for name, link in links.items()}
    cpu = ", ".join(f"{name} {seconds * 1e9:.2g}" for name, seconds in per_byte.items() if seconds)
    text += f"; the transport's CPU ms a MB sent: {cpu}" if cpu else ""
    return text + (f"; codecs, encode/decode M elements/s: {codecs}" if codecs else "")
