"""``ddp_train.py --bandwidth RATE,RATE,...``: the whole bench once per link, then auto judged.

Each rate runs in a process (and a limited namespace) of its own; ``none`` is
the unlimited loopback. Per link, auto's step is set against the best static
choice among its candidates and against dense, and the cost model's
predicted communication against the observed, for the static runs and for
auto's own plan.

Example:
    >>> rows = sweep_rows([("1gbit", document), ("none", other)])
    >>> print(format_sweep(rows))
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

from gradcomp import planner
from gradcomp.tables import format_table
from lib.ddp_report import MODEL_TARGET, STORED, label_step_axis, predicted_cell
from lib.machine import machine
from lib.plots import figure
from lib.results import Results, publish

# auto's targets: its step at most this many times the best static choice among its
# candidates (the dense run stands for "none") on every link, and dense's on the unlimited one.
AUTO_TARGET_BEST, AUTO_TARGET_DENSE = 1.05, 1.03


def sweep(script: str, args: argparse.Namespace, rates: list[str], argv: list[str]) -> int:
    """``script`` (ddp_train.py) once per rate, each in a process (and a limited namespace)
    of its own (``none``: the unlimited loopback); then, per rate, each run against the best
    static choice among auto's candidates, and the cost model against the observed."""
    base = _without_option(argv, "--bandwidth")
    facts = machine(args.spawn, "gloo")
    documents = []
    for rate in rates:
        limited = rate != "none"
        print(f"== link: {rate} ==", flush=True)
        command = [sys.executable, script, *base]
        command += ["--bandwidth", rate] if limited else []
        code = subprocess.run(command).returncode
        if code:
            return code
        written = Results("ddp_train", facts, {}, args.out, suffix=f"-{rate}" if limited else "")
        with open(written.path("json")) as file:
            documents.append((rate, json.load(file)))
    rows = sweep_rows(documents)
    print(format_sweep(rows))
    results = Results("ddp_train", facts, {**vars(args), "rates": rates}, args.out, suffix="-sweep")
    results.title = f"ddp_train across links: {facts['machine']}"
    publish(results, rows, plot_sweep, extra=dict(sources=[document["command"] for _, document in documents]))
    return 0


def _without_option(argv: list[str], option: str) -> list[str]:
    kept, skip = [], False
    for item in argv:
        if skip:
            skip = False
        elif item == option:
            skip = True
        elif not item.startswith(option + "="):
            kept.append(item)
    return kept


def sweep_rows(documents: list[tuple[str, dict]]) -> list[dict]:
    """A row per link and run: step and communication time, the model's prediction,
    whether the run is one of auto's static candidates (``auto_candidate``) or auto's own
    (``auto_run``), and for auto its picks against the best static choice among its
    candidates and dense."""
    rows = []
    for rate, document in documents:
        records = [r for r in document["records"] if not r["failed"] and r["kind"] != "compute"]
        auto = next((r for r in records if r["name"] == "auto"), None)
        allow = planner.checked_candidates((auto or {}).get("options", {}).get("allow"))
        names = {planner.from_spec(spec).name for spec in allow} | {""}  # "": dense, no hook
        static = [r for r in records if r["kind"] in ("dense", "gradcomp") and r["name"] in names]
        best = min(static, key=lambda r: r["step_ms"]) if static else None
        dense = next((r for r in records if r["kind"] == "dense"), None)
        for record in records:
            row = dict(
                link=rate,
                run=record["run"],
                step_ms=record["step_ms"],
                comm_ms=record["comm_ms"],
                predicted_comm_ms=record.get("predicted_comm_ms", math.nan),
                model_error=record.get("model_error", math.nan),
                predicted_from=record.get("predicted_from", ""),
                note=record["note"],
                auto_candidate=record in static,
                auto_run=record is auto,
            )
            if record is auto and best is not None and dense is not None:
                row.update(
                    best_static=best["run"],
                    x_best_static=record["step_ms"] / best["step_ms"],
                    x_dense=record["step_ms"] / dense["step_ms"],
                )
            rows.append(row)
    return rows


def format_sweep(rows: list[dict]) -> str:
    """The runs of every link, then per link what auto chose and whether the targets hold."""
    header = ["link", "run", "step ms", "comm ms", "model ms", "note"]
    table = [
        [
            r["link"],
            r["run"],
            f"{r['step_ms']:.0f}",
            f"{r['comm_ms']:.0f}",
            predicted_cell(r),
            r["note"],
        ]
        for r in rows
    ]
    lines = [format_table(header, table, left=(0, 1, -1))]
    for r in rows:
        if "x_best_static" not in r:
            continue
        verdict = "met" if r["x_best_static"] <= AUTO_TARGET_BEST else "NOT met"
        line = (
            f"{r['link']}: {r['note']}; {r['step_ms']:.0f} ms = {r['x_best_static']:.2f}x the best static "
            f"choice ({r['best_static']}; target <= {AUTO_TARGET_BEST}x: {verdict}), "
            f"{r['x_dense']:.2f}x dense"
        )
        if r["link"] == "none":
            verdict = "met" if r["x_dense"] <= AUTO_TARGET_DENSE else "NOT met"
            line += f" (target on the unlimited link <= {AUTO_TARGET_DENSE}x: {verdict})"
        lines.append(line)
    for runs in ("static", "auto"):
        predicted = [
            r
            for r in rows
            if not math.isnan(r["predicted_comm_ms"]) and r.get("auto_run", False) == (runs == "auto")
        ]
        sources = {r.get("predicted_from") or STORED for r in predicted}
        source = "its own measurements" if runs == "auto" else " and ".join(sorted(sources))
        if predicted:
            # A step no slower than compute-only leaves no communication to compare with:
            # counted, not within.
            within = sum(abs(r["model_error"]) <= MODEL_TARGET for r in predicted)
            line = (
                f"cost model ({source}): {within} of {len(predicted)} {runs} runs predicted within "
                f"{MODEL_TARGET:.0%} of the observed communication"
            )
            unobserved = sum(math.isnan(r["model_error"]) for r in predicted)
            if unobserved:
                line += f" ({unobserved} with no communication observed: step within compute-only)"
            lines.append(line)
    return "\n".join(lines)


def plot_sweep(rows: list[dict], title: str, path: str) -> None:
    """Step time per link for every run (log scale), auto drawn bold."""
    links = list(dict.fromkeys(r["link"] for r in rows))
    with figure(path, title, figsize=(8, 5)) as (_, axis):
        for run in dict.fromkeys(r["run"] for r in rows):
            points = [(links.index(r["link"]), r["step_ms"]) for r in rows if r["run"] == run]
            auto = run.startswith("auto")
            axis.plot(*zip(*points, strict=True), marker="o", linewidth=3 if auto else 1.2, label=run)
        axis.set_xticks(range(len(links)), links)
        axis.set_yscale("log")
        axis.set_xlabel("each rank's link (tc limit on the loopback; none: unlimited)")
        label_step_axis(axis)
