"""A matplotlib figure (the Agg backend: no display needed) written to a file on exit.

Example:
    >>> with figure(path, "allreduce: 2 CPUs", ncols=2, figsize=(13, 5)) as (fig, (left, right)):
    ...     left.plot(sizes, times)
"""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def figure(path: str, title: str, **subplots):
    """``plt.subplots(**subplots)``'s figure and axes; on exit the figure is titled,
    laid out and written to ``path`` at 120 dpi."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn, axes = plt.subplots(**subplots)
    try:
        yield drawn, axes
        drawn.suptitle(title, fontsize=9)
        drawn.tight_layout()
        drawn.savefig(path, dpi=120)
    finally:
        plt.close(drawn)
