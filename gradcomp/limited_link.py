"""A slow link on one machine: a network namespace of its own whose loopback a ``tc``
token bucket limits.

RATE is each rank's link in bits per second each way, as a NIC's rate is given
and as ``gradcomp plan --bandwidth`` takes it (``1gbit``, ``100mbit``). The
loopback carries every rank's sends, and in a ring collective every rank sends
at once, so the bucket's rate is RATE times the ranks and each gets RATE. Needs
root and iproute2; the namespace is deleted afterwards, whatever happens.

Two ways in: :func:`run_limited` runs a command in a namespace limited from the
start (the bench scripts' ``--bandwidth``); :class:`Namespace` holds one whose
loopback starts unlimited, spawned ranks enter it (:func:`enter_namespace`) and
:func:`limit_loopback` limits it and lifts the limit while they run (the demo
trains on the unlimited loopback, then times steps behind the limit).

Example:
    >>> status = run_limited([sys.executable, "bench/allreduce.py"], "100mbit", ranks=2)
    >>> with Namespace("gradcomp demo") as name:
    ...     limit_loopback(name, link_settings("500mbit", ranks=2))
"""

from __future__ import annotations

import ctypes
import json
import os
import secrets
import shutil
import subprocess
import sys

from gradcomp.units import parse_rate

# Set in the environment of a command run inside a limited namespace: the link's settings (JSON).
LINK_ENV = "GRADCOMP_BENCH_LINK"


def link_info() -> dict | None:
    """The link limit this process runs under (None: unlimited loopback or a real network)."""
    text = os.environ.get(LINK_ENV)
    return json.loads(text) if text else None


def link_settings(rate: str, ranks: int = 1) -> dict:
    """tc token-bucket settings for one interface that ``ranks`` ranks share, each at ``rate``
    (the bucket's rate ``rate`` times ``ranks``): a burst of 2 ms at that rate, at least
    256 KiB (above loopback's 64 KiB packets), and 50 ms of queue, which measured no drops
    at 1gbit."""
    bits = parse_rate(rate)
    shared = bits * ranks
    return {
        "rate": rate.strip().lower(),
        "bits_per_second": bits,
        "ranks": ranks,
        "tc_rate": f"{shared:.0f}bit",
        "tc_bits_per_second": shared,
        "burst_bytes": max(256 * 1024, int(shared / 8 * 0.002)),
        "latency": "50ms",
    }


def token_bucket(settings: dict) -> list[str]:
    """The ``tc qdisc add ... root`` arguments that limit an interface to ``settings``."""
    return [
        "tbf", "rate", settings["tc_rate"], "burst", str(settings["burst_bytes"]),
        "latency", settings["latency"],
    ]  # fmt: skip


def unmet_requirement(what: str) -> str | None:
    """Why ``what`` cannot make namespaces here (not root, no ``ip``/``tc``), or None."""
    if os.geteuid() != 0:
        return f"{what} needs root: it creates network namespaces and limits links with tc."
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"{what} needs {' and '.join(missing)} (iproute2), not found on PATH"
    return None


class Namespace:
    """A network namespace of its own, named ``gradcomp-<pid>-<random>``, its loopback up and
    unlimited; deleted on leaving the ``with`` block, whatever happens. Entering it yields its
    name.

    Args:
        what: the command or option that asked, named in the error where the machine
            cannot make one (not root, no ``ip``/``tc``).

    Raises:
        PermissionError: on entering, where :func:`unmet_requirement` says why it cannot.
        subprocess.CalledProcessError: ``ip`` failed to make it.
    """

    def __init__(self, what: str = "--bandwidth"):
        self.what = what
        self.name = f"gradcomp-{os.getpid()}-{secrets.token_hex(3)}"

    def __enter__(self) -> str:
        unmet = unmet_requirement(self.what)
        if unmet:
            raise PermissionError(unmet)
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        try:
            subprocess.run(["ip", "-n", self.name, "link", "set", "lo", "up"], check=True)
        except BaseException:
            self.__exit__()
            raise
        return self.name

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.name], stderr=subprocess.DEVNULL)


def limit_loopback(name: str, settings: dict | None) -> None:
    """Limit the loopback of namespace ``name`` to ``settings`` (:func:`link_settings`), or lift
    the limit (None). Always names the namespace: the machine's own loopback is never touched."""
    if settings is None:
        command = ["tc", "-n", name, "qdisc", "del", "dev", "lo", "root"]
    else:
        command = ["tc", "-n", name, "qdisc", "replace", "dev", "lo", "root", *token_bucket(settings)]
    subprocess.run(command, check=True)


_CLONE_NEWNET = 0x40000000


def enter_namespace(name: str, rank: int = 0, world_size: int = 0) -> None:
    """Move this thread into network namespace ``name`` (threads it starts later follow); as
    ``functools.partial(enter_namespace, name)``, a :func:`gradcomp.spawn.run_ranks` setup that
    puts every rank in it before the ranks meet on its loopback."""
    libc = ctypes.CDLL(None, use_errno=True)
    descriptor = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if libc.setns(descriptor, _CLONE_NEWNET) != 0:
            error = ctypes.get_errno()
            raise OSError(error, f"cannot enter network namespace {name}: {os.strerror(error)}")
    finally:
        os.close(descriptor)


def run_limited(command: list[str], rate: str, ranks: int, what: str = "--bandwidth") -> int:
    """Run ``command`` inside a fresh namespace whose loopback gives each of ``ranks`` ranks
    ``rate`` (its environment holds the settings: :func:`link_info`).

    Returns the command's exit status, or 2 with a message on stderr when the
    machine cannot do it (not root, no ``ip``/``tc``: ``what`` names the option
    that asked).
    """
    settings = link_settings(rate, ranks)
    unmet = unmet_requirement(what)
    if unmet:
        sys.stderr.write(f"{unmet} Drop {what} to run on the unlimited loopback.\n")
        return 2
    try:
        with Namespace(what) as name:
            limit_loopback(name, settings)
            sys.stderr.write(
                f"network namespace {name}: loopback limited to {settings['tc_rate']}, "
                f"{settings['rate']} for each of {ranks} ranks\n"
            )
            env = {**os.environ, LINK_ENV: json.dumps(settings), "TORCH_CPP_LOG_LEVEL": "ERROR"}
            return subprocess.run(["ip", "netns", "exec", name, *command], env=env).returncode
    except subprocess.CalledProcessError as error:
        sys.stderr.write(f"could not set up the limited namespace: {error}\n")
        return 2
