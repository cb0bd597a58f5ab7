"""Fixed-width text tables, as ``python -m gradcomp`` and the bench scripts print them.

Example:
    >>> print(format_table(["run", "ms"], [["dense", "12.5"], ["int8", "3.1"]]))
    run      ms
    -----  ----
    dense  12.5
    int8    3.1
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def format_table(
    header: Sequence[str],
    rows: Sequence[Sequence[object]],
    groups: Sequence[tuple[str, int]] | None = None,
    left: Sequence[int] = (0,),
) -> str:
    """The rows under ``header``: the ``left`` columns (indices, negative ones from the
    end; default the first) left-aligned, the others right-aligned.

    ``groups``, if given, is a list of ``(title, number of columns)`` printed
    centred above the header (e.g. one title per compressor).
    """
    left = {i % len(header) for i in left}
    widths = [max(len(str(line[i])) for line in (header, *rows)) for i in range(len(header))]
    lines = []
    if groups:
        cells, column = [], 0
        for title, span in groups:
            width = sum(widths[column : column + span]) + 2 * (span - 1)
            cells.append(title[:width].center(width) if title else " " * width)
            column += span
        lines.append("  ".join(cells).rstrip())

    def join(cells):
        return "  ".join(
            str(cell).ljust(width) if i in left else str(cell).rjust(width)
            for i, (cell, width) in enumerate(zip(cells, widths, strict=True))
        ).rstrip()

    lines += [join(header), "  ".join("-" * width for width in widths), *map(join, rows)]
    return "\n".join(lines)


def format_cell(value: float | None, spec: str = ".2f", suffix: str = "") -> str:
    """``value`` formatted by ``spec``, ``"-"`` for None or NaN (a figure a run lacks)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:{spec}}{suffix}"
