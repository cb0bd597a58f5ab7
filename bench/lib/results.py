"""Result files: a run's records as CSV and JSON (and a PNG), each naming the machine.

Files go to ``bench/results/`` (or ``--out``) as ``<benchmark>-<machine kind>-w<ranks>
<suffix>.{csv,json,png}``; the JSON holds the command, the date, the settings, the
machine, the load average at start and end, and the records. ``bench/plot.py``
draws a PNG again from its JSON.

Example:
    >>> results = Results("allreduce", machine(2, "gloo"), settings=vars(args))
    >>> publish(results, records, plot)  # bench/results/allreduce-cpu2-w2.{csv,json,png}
"""

from __future__ import annotations

import csv
import datetime
import json
import math
import os
import sys
import time
from collections.abc import Callable

from lib import link
from lib.machine import loadavg

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "results")


class Results:
    """Collects a run's records and writes them with the machine and the load average.

    Args:
        benchmark: the script's name, first in the file names.
        machine_facts: :func:`lib.machine.machine`'s facts.
        settings: the run's options, kept in the JSON.
        directory: where the files go.
        suffix: the end of the file names (default: the link's rate under ``--bandwidth``).
    """

    def __init__(
        self,
        benchmark: str,
        machine_facts: dict,
        settings: dict,
        directory: str = RESULTS,
        suffix: str | None = None,
    ):
        self.benchmark = benchmark
        self.machine = machine_facts
        self.settings = settings
        self.directory = directory
        self.load_start = loadavg()
        self.started = time.time()
        self.title = f"{benchmark}: {machine_facts['machine']}"
        limit = link.link_info()
        if suffix is None:
            suffix = f"-{limit['rate']}" if limit else ""
        self.stem = f"{benchmark}-{machine_facts['kind']}-w{machine_facts['world_size']}{suffix}"

    def path(self, extension: str) -> str:
        return os.path.join(self.directory, f"{self.stem}.{extension}")

    def write(self, records: list[dict], extra: dict | None = None) -> list[str]:
        """Write ``records`` as CSV (machine columns first) and JSON; returns the paths."""
        os.makedirs(self.directory, exist_ok=True)
        load_end = loadavg()
        facts = {
            **self.machine,
            "load_start": "/".join(map(str, self.load_start)),
            "load_end": "/".join(map(str, load_end)),
        }
        rows = [{**facts, **record} for record in records]
        columns = list(dict.fromkeys(key for row in rows for key in row))
        with open(self.path("csv"), "w", newline="") as file:
            writer = csv.DictWriter(file, columns)
            writer.writeheader()
            writer.writerows(rows)
        document = {
            "benchmark": self.benchmark,
            "title": self.title,
            "command": " ".join(["python", *sys.argv]),
            "date": datetime.datetime.fromtimestamp(self.started).isoformat(timespec="seconds"),
            "seconds": round(time.time() - self.started, 1),
            "machine": self.machine,
            "load_start": self.load_start,
            "load_end": load_end,
            "settings": self.settings,
            **(extra or {}),
            "records": rows,
        }
        with open(self.path("json"), "w") as file:
            json.dump(document, file, indent=1, default=_jsonable)
        return [self.path("csv"), self.path("json")]


def publish(
    results: Results,
    records: list[dict],
    draw: Callable[[list[dict], str, str], None] | None = None,
    extra: dict | None = None,
    prefix: str = "",
) -> list[str]:
    """Write the records (and ``draw(records, title, path)``'s PNG), then say where they
    went and the load average at start and end, each line after ``prefix``."""
    paths = results.write(records, extra)
    if draw is not None:
        paths.append(results.path("png"))
        draw(records, results.title, paths[-1])
    print(f"{prefix}wrote {', '.join(paths)}")
    print(f"{prefix}load average (1/5/15 min): {results.load_start} at start, {loadavg()} at end")
    return paths


def _jsonable(value):
    if isinstance(value, float) and math.isnan(value):
        return None
    return str(value)


def ratio(numerator: float | None, denominator: float | None) -> float:
    """numerator / denominator, NaN when either is missing or the denominator is not positive."""
    if numerator is None or denominator is None or not denominator > 0:
        return math.nan
    return numerator / denominator


def publish_curves(
    results: Results,
    records: list[dict],
    draw: Callable[[list[dict], str, str], None],
    extra: dict | None = None,
) -> list[str]:
    """:func:`publish` for records that carry a ``curve`` each: the JSON keeps the curves
    apart (``curves``, by run), the CSV leaves them out, ``draw`` gets them."""
    curves = {record["run"]: record.pop("curve") for record in records}

    def draw_with_curves(rows: list[dict], title: str, path: str) -> None:
        draw(with_curves(rows, curves), title, path)

    return publish(results, records, draw_with_curves, extra=dict(curves=curves, **(extra or {})))


def with_curves(records: list[dict], curves: dict) -> list[dict]:
    """The records with each run's curve put back (from the JSON's ``curves``)."""
    return [{**record, "curve": curves[record["run"]]} for record in records]
