"""Draw a result's PNG again from its JSON, as the script that measured it drew it.

Every script keeps its records in the JSON it writes (``bench/results/``); the
PNG beside it is drawn from them, so only the JSON is kept in the repository
and this script draws the PNG again: ``X.png`` beside each ``X.json`` given,
and for a sweep folded into one JSON (``bench/fold.py``) each run's PNG under its
file's name before the fold.
A JSON without a plot (``kernel_speed``, ``faults``, ``trainer_train``) is named
and passed over.

Examples:
    python bench/plot.py bench/results/ddp_train-cpu2-w2-sweep-q.json
    python bench/plot.py bench/results/*.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

import allreduce
import convergence
import diloco_train
import fsdp_train
import host_cost
from lib import convergence_lm, ddp_report, ddp_sweep
from lib.results import with_curves


def drawer(document: dict) -> Callable[[list[dict], str, str], None] | None:
    """The plot of the script that wrote ``document`` (None: it draws none)."""
    benchmark = document["benchmark"]
    if benchmark == "ddp_train":
        return ddp_sweep.plot_sweep if "rates" in document["settings"] else ddp_report.plot
    if benchmark.startswith("convergence"):
        draw = convergence_lm.lm_plot if benchmark == "convergence-lm" else convergence.plot
        return lambda records, title, path: draw(with_curves(records, document["curves"]), title, path)
    scripts = (allreduce, diloco_train, fsdp_train, host_cost)
    return {script.__name__: script.plot for script in scripts}.get(benchmark)


def documents(path: str) -> list[tuple[dict, str]]:
    """The results in the JSON at ``path``, each with the PNG it draws: the one run's, or
    each run's of a folded sweep, named as the run's own file was (prefix and key)."""
    with open(path) as file:
        document = json.load(file)
    if "runs" in document:
        stem = os.path.join(os.path.dirname(path), document["prefix"])
        return [(run, f"{stem}{key}.png") for key, run in document["runs"].items()]
    return [(document, path.removesuffix(".json") + ".png")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", metavar="JSON", help="results the bench scripts wrote")
    args = parser.parse_args(argv)
    for path in args.results:
        for document, png in documents(path):
            draw = drawer(document)
            if draw is None:
                print(f"{path}: {document['benchmark']} draws no plot")
                continue
            title = document.get("title") or f"{document['benchmark']}: {document['machine']['machine']}"
            draw(document["records"], title, png)
            print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
