"""The options the scripts share: ranks to spawn, the output folder, progress."""

from __future__ import annotations

import argparse

from lib.results import RESULTS


def add_common_options(parser: argparse.ArgumentParser, spawn_default: int | None = 2) -> None:
    """``--spawn N`` and :func:`add_output_options`; ``spawn_default`` None: torchrun's ranks."""
    parser.add_argument(
        "--spawn",
        type=int,
        metavar="N",
        default=spawn_default,
        help="spawn N Gloo ranks on 127.0.0.1"
        + (f" (default {spawn_default})" if spawn_default else " (default: run under torchrun)"),
    )
    add_output_options(parser)


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """``--out DIR`` (default ``bench/results/``) and ``--progress``."""
    parser.add_argument("--out", default=RESULTS, help=f"folder for CSV/JSON/PNG (default {RESULTS})")
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="rewrite a progress line on stderr (default: when stderr is a terminal)",
    )
