"""The fault matrix: what a run does when something goes wrong, case by case.

Each case injects one fault into real Gloo ranks on this machine (spawned
processes) or into gradcomp's files, and checks the promise a user relies on:

* a peer killed (SIGKILL) or stopped (SIGSTOP) during a DDP step: every survivor
  raises within the group's timeout;
* a save killed at several points while it writes over a checkpoint: the previous
  or the new checkpoint is whole;
* ranks that disagree on the settings (after each setting was used, at first use,
  wire sizes that differ, random-K's step or name per rank, Top-K's ratio): every
  rank raises, no wrong result, no abort;
* payloads decoded by another compressor or into another shape: an error that says so;
* crafted, truncated, NaN-holding and another rank's checkpoint files: refused with
  the file named, no code run;
* a DCP checkpoint of 2 ranks loaded on 3 (``mismatch="raise"`` and ``"drop"``);
* DiLoCo ranks that synchronise at other steps, a NaN gradient under CompressedAdam
  and DiLoCo, a rank killed in the shared-memory set-up.

The table gives each case's outcome and the seconds from the fault to the last
rank's error; the summary counts what must stay at 0: silent wrong results, lost
checkpoints, code run on load, process aborts, hangs, errors on some ranks only,
unclear errors, shared memory left behind.

Example:
    python bench/faults.py                 # every case, results in bench/results/
    python bench/faults.py --cases disagree --timeout 10
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys

from lib import fault_cases, fault_files, fault_ranks, machine, options, results

from gradcomp import tables


def all_cases(timeout: float) -> list[tuple[str, callable]]:
    """(name, case) pairs in the order the table shows them; a case returns a :class:`lib.fault_ranks.Row`."""
    found = [
        ("dead peer", lambda: fault_cases.dead_peer(signal.SIGKILL, timeout)),
        ("stopped peer", lambda: fault_cases.dead_peer(signal.SIGSTOP, timeout)),
        ("killed save", fault_files.killed_save),
    ]
    found += [
        (f"disagree {label}", lambda label=label: fault_cases.disagreement(label, timeout))
        for label in fault_cases.DISAGREEMENTS
    ]
    found += [
        ("decode other compressor", fault_files.other_compressor),
        ("decode other shape", fault_files.other_shape),
    ]
    found += [
        (f"file {kind}", lambda kind=kind: fault_files.bad_file(kind))
        for kind in ("crafted (runs code)", "truncated", "residuals hold NaN", "another rank's file")
    ]
    found += [
        ("dcp raise", lambda: fault_files.dcp_world_change("raise")),
        ("dcp drop", lambda: fault_files.dcp_world_change("drop")),
        ("uneven diloco", lambda: fault_cases.uneven_diloco(timeout)),
        ("nan adam", lambda: fault_cases.nan_gradient("CompressedAdam", timeout)),
        ("nan diloco", lambda: fault_cases.nan_gradient("DiLoCo", timeout)),
        ("shared memory kill", lambda: fault_cases.shared_memory_kill(timeout)),
    ]
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--cases",
        nargs="*",
        default=None,
        help="run only the cases whose name holds one of these words (default: all)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        help="the process group's timeout in seconds, which a dead peer must be found within",
    )
    options.add_output_options(parser)
    args = parser.parse_args(argv)
    chosen = [
        (name, case)
        for name, case in all_cases(args.timeout)
        if args.cases is None or any(word in name for word in args.cases)
    ]
    if not chosen:
        print("no case matches; the cases:\n" + "\n".join(name for name, _ in all_cases(args.timeout)))
        return 2
    facts = machine.machine(4, "gloo")  # the most ranks a case spawns
    print(f"machine: {facts['machine']}", flush=True)
    found = results.Results("faults", facts, vars(args), args.out, suffix="")
    rows = []
    for name, case in chosen:
        print(f"  {name} ...", file=sys.stderr, flush=True)
        rows.append(case())
    print(
        tables.format_table(
            ["case", "promise", "outcome", "s to error", "detail"],
            [
                [
                    r.case,
                    r.promise,
                    r.outcome,
                    tables.format_cell(r.seconds, ".1f"),
                    " ".join(r.detail.split())[:70],
                ]
                for r in rows
            ],
            left=(0, 1, 2, 4),
        )
    )
    counts = {kind: sum(r.outcome == kind for r in rows) for kind in fault_ranks.BROKEN}
    print("broken promises: " + ", ".join(f"{n} {kind}" for kind, n in counts.items()))
    results.publish(found, [dataclasses.asdict(r) for r in rows], extra={"broken": counts})
    return 0 if not any(counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
