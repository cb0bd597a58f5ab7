"""What the demo's rows say: each run's step on a slow link, its verdict against dense, the plot.

A run's step on a link of R bits per second a rank is *measured* where the
demo stepped behind a ``tc``-limited loopback (:attr:`gradcomp.demo.Row.link_step_ms`)
and *predicted* otherwise, from the run's own measurements: its step on the
unlimited loopback (compute, encoding, and the loopback's transfer) plus the
time its bytes take at R, one way, every rank sending at once. The prediction
is an upper bound: the loopback's own time for the bytes stays in, and DDP's
overlap of the exchange with the backward pass is not credited.

Example:
    >>> print("\\n".join(verdict_lines(rows, "500mbit")))
    int4: 1.9x faster than dense at 500 Mbit/s (measured), loss +0.4% vs dense; pays below 2.1 Gbit/s
"""

from __future__ import annotations

import math

from gradcomp.demo import Row
from gradcomp.files import atomic_write
from gradcomp.tables import format_cell, format_table
from gradcomp.units import format_rate, parse_rate


def predicted_step_ms(row: Row, bits_per_second: float) -> float:
    """``row``'s step on a link of ``bits_per_second`` a rank: its step on the loopback
    plus the time its bytes take at that rate."""
    return row.step_ms + 1e3 * row.bytes_per_step * 8 / bits_per_second


def measured(rows: list[Row]) -> bool:
    """Whether every row's step behind the limited link was measured."""
    return bool(rows) and all(math.isfinite(row.link_step_ms) for row in rows)


def step_at_link_ms(row: Row, bits_per_second: float) -> float:
    """``row``'s step on the link: measured where the demo measured it, else predicted."""
    return row.link_step_ms if math.isfinite(row.link_step_ms) else predicted_step_ms(row, bits_per_second)


def break_even(row: Row, dense: Row) -> float:
    """The link rate (bits per second a rank) below which ``row``'s predicted step is
    shorter than dense's: ``inf`` where it is at every rate, 0 where at none."""
    saved_bits = 8 * (dense.bytes_per_step - row.bytes_per_step)
    extra_seconds = (row.step_ms - dense.step_ms) / 1e3
    if saved_bits <= 0:
        return math.inf if extra_seconds < 0 and saved_bits == 0 else 0.0
    return math.inf if extra_seconds <= 0 else saved_bits / extra_seconds


def _dense(rows: list[Row]) -> Row:
    for row in rows:
        if row.label == "dense":
            return row
    raise ValueError("the verdict compares every run with dense: the rows have none")


def _speed(ratio: float) -> str:
    if 0.995 <= ratio <= 1.005:
        return "as fast as dense"
    return f"{ratio:.1f}x faster than dense" if ratio > 1 else f"{1 / ratio:.1f}x slower than dense"


def _pays(rate: float) -> str:
    if rate == math.inf:
        return "pays at any link rate"
    if rate == 0:
        return "pays at no link rate"
    return f"pays below {format_rate(rate)}"


def verdict_lines(rows: list[Row], link: str) -> list[str]:
    """One line a run other than dense: its step against dense's on ``link`` (a rate such as
    ``"500mbit"``; measured or predicted, and which), its held-out loss against dense's,
    and the link rate below which it pays (predicted)."""
    bits, dense = parse_rate(link), _dense(rows)
    how = "measured" if measured(rows) else "predicted"
    dense_ms = step_at_link_ms(dense, bits)
    lines = []
    for row in rows:
        if row is dense:
            continue
        loss = 100 * (row.test_loss / dense.test_loss - 1)
        lines.append(
            f"{row.label}: {_speed(dense_ms / step_at_link_ms(row, bits))} at {format_rate(bits)} ({how}), "
            f"loss {loss:+.1f}% vs dense; {_pays(break_even(row, dense))}"
        )
    return lines


def format_rows(rows: list[Row], link: str) -> str:
    """The rows as a fixed-width table: bytes, steps on the loopback, encoding, (relative
    error where measured,) held-out loss and accuracy, and each step on ``link`` predicted,
    and measured where it was."""
    bits = parse_rate(link)
    errors = any(math.isfinite(row.relative_error) for row in rows)
    header = ["compressor", "bytes/step", "ratio", "step ms", "compress ms"]
    header += [*(["rel. error"] if errors else []), "test loss", "test acc", f"ms at {link} (predicted)"]
    header += [f"ms at {link} (measured)"] if measured(rows) else []
    lines = [
        [
            row.label,
            f"{row.bytes_per_step:,.0f}",
            f"{row.ratio:.1f}",
            f"{row.step_ms:.2f}",
            format_cell(row.compress_ms),
            *([format_cell(row.relative_error, ".3f")] if errors else []),
            f"{row.test_loss:.4f}",
            f"{100 * row.test_accuracy:.1f}%",
            f"{predicted_step_ms(row, bits):.2f}",
            *([f"{row.link_step_ms:.2f}"] if measured(rows) else []),
        ]
        for row in rows
    ]
    return format_table(header, lines)


def plot_rates(link: str, points: int = 61) -> list[float]:
    """Link rates for the plot, evenly spaced on a log scale from 10 Mbit/s to 100 Gbit/s,
    widened to hold ``link`` with room on either side."""
    bits = parse_rate(link)
    low, high = math.log10(min(1e7, bits / 2)), math.log10(max(1e11, bits * 2))
    return [10 ** (low + (high - low) * i / (points - 1)) for i in range(points)]


def plot(rows: list[Row], link: str, path: str, title: str) -> None:
    """Write a PNG to ``path`` (whole or not at all): each run's step against the link's
    rate, predicted from its step on the loopback and its bytes, one line a run, a
    vertical line at ``link`` and each step measured there marked. Needs matplotlib."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter

    rates = plot_rates(link)
    bits = parse_rate(link)
    figure = Figure(figsize=(8, 5), layout="constrained")
    axes = figure.add_subplot()
    for row in rows:
        (line,) = axes.plot(rates, [predicted_step_ms(row, rate) for rate in rates], label=row.label)
        if math.isfinite(row.link_step_ms):
            axes.plot([bits], [row.link_step_ms], "o", color=line.get_color())
    axes.axvline(bits, color="gray", linestyle=":", linewidth=1)
    axes.set_xscale("log")
    axes.set_yscale("log")
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: format_rate(value)))
    axes.set_xlabel("each rank's link (bits per second, each way)")
    axes.set_ylabel("step time (ms)")
    marked = " (dots: measured behind tc)" if measured(rows) else ""
    axes.set_title(f"{title}\nlines: loopback step + bytes at the link (predicted){marked}", fontsize=9)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    atomic_write(path, lambda file: figure.savefig(file, format="png", dpi=120))
