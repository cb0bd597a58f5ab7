"""Fold a sweep's result files into one JSON: each run's document whole, under its setting.

A sweep writes a file per run (``convergence.py`` once per setting, ``ddp_train.py
--bandwidth A,B`` once per link and once for the sweep's rows); ``bench/results/``
keeps one file per sweep. A run's key is its file's name less ``--prefix`` and
``.json``; the folded file holds the command that folded it, the prefix and
``runs``, each document as its script wrote it. ``bench/plot.py`` draws each run's
PNG under its file's name as it was.

Examples:
    python bench/fold.py bench/results/diloco-outer-sweep.json --prefix diloco-outer- \\
        bench/results/diloco-outer-*.json
    python bench/fold.py bench/results/ddp_train-cpu2-w2-sweep-q.json --prefix ddp_train-cpu2-w2- \\
        bench/results/ddp_train-cpu2-w2-sweep-q.json bench/results/ddp_train-cpu2-w2-sweep-q-*.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from gradcomp.files import write_text


def fold(paths: list[str], prefix: str = "") -> dict[str, dict]:
    """Each file's document by its key: its name less ``prefix`` and ``.json``.

    Args:
        paths: the sweep's result files, one a run.
        prefix: what their names start with, left out of the keys.

    Returns:
        The documents by key, in the order of the sorted paths.

    Raises:
        ValueError: two files give one key, or a file is folded already.
    """
    runs = {}
    for path in sorted(paths):
        key = os.path.basename(path).removesuffix(".json").removeprefix(prefix)
        if key in runs:
            raise ValueError(f"{path}: a second file for the key {key!r}")
        with open(path) as file:
            document = json.load(file)
        if "runs" in document:
            raise ValueError(f"{path} is folded already: give its runs' files")
        runs[key] = document
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", metavar="OUT", help="the folded JSON (may be one of the files)")
    parser.add_argument("files", nargs="+", metavar="JSON", help="the sweep's result files")
    parser.add_argument("--prefix", default="", help="what each file's name starts with, left out of its key")
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    try:
        runs = fold(args.files, args.prefix)
    except ValueError as error:
        parser.error(str(error))
    # Read whole before the write: OUT may be one of the files it folds.
    command = shlex.join(["python", "bench/fold.py", *argv])
    document = {"command": command, "prefix": args.prefix, "runs": runs}
    write_text(args.out, json.dumps(document, indent=1) + "\n")
    print(f"wrote {args.out}: {len(runs)} runs ({', '.join(runs)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
