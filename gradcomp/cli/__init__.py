"""The ``gradcomp`` command line (also ``python -m gradcomp``): one subcommand a module,
each adding its parser and running it: :mod:`gradcomp.cli.demo`, :mod:`gradcomp.cli.plan`,
:mod:`gradcomp.cli.probe`.

Example:
    $ python -m gradcomp demo --plot demo.png
    $ python -m gradcomp demo --small --epochs 4 --compressors dense,int8,topk
    $ python -m gradcomp plan --numel 25M --bandwidth 10gbit --latency 20us
    $ python -m gradcomp probe --out profile.json
    $ python -m gradcomp plan --params 350M --world 16 --bandwidth 10gbit --profile profile.json
"""

from __future__ import annotations

import argparse

from gradcomp.cli import demo, plan, probe


def parser() -> argparse.ArgumentParser:
    """The argument parser of :func:`main`."""
    top = argparse.ArgumentParser(
        prog="gradcomp", description="Gradient compression for data-parallel PyTorch."
    )
    commands = top.add_subparsers(dest="command", required=True)
    for command in (demo, plan, probe):
        command.add_parser(commands)
    return top


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    args = parser().parse_args(argv)
    return args.run(args)
