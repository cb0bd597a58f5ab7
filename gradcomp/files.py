"""The files gradcomp writes and reads: written whole or not at all, read without running code.

A write goes to a temporary file beside its target (``.<name>.tmp-<pid>``), is flushed and
fsynced, then renamed over the target and the folder fsynced: a process killed at any point
leaves the previous file or the new one, never a part of either. A load reads tensors and
plain containers only (``torch.load(weights_only=True)``): a file that needs anything more
to load would run code, and is refused.

Example:
    >>> atomic_write("state.pt", lambda file: torch.save(state, file))
    >>> state = load_file("state.pt")
"""

from __future__ import annotations

import errno
import glob
import os
import pickle
from collections.abc import Callable
from typing import BinaryIO

import torch

# What a failed load of a file that is not whole (or was damaged) raises from torch.load:
# the zip reader (RuntimeError), the unpickler (EOFError, UnicodeDecodeError, UnpicklingError)
# and reads past the end of a short file (OSError EINVAL).
_DAMAGED = (RuntimeError, EOFError, ValueError, pickle.UnpicklingError, OSError)
_NOT_DAMAGED = (FileNotFoundError, IsADirectoryError, PermissionError)


class UnsafeFileError(ValueError):
    """A file that needs more than tensors and plain containers to load: refused unread."""


class DamagedFileError(ValueError):
    """A file that is truncated or corrupt."""


def temporary_path(path: str | os.PathLike, pid: int | str | None = None) -> str:
    """Where :func:`atomic_write` writes ``path`` before renaming it (process ``pid``'s, by
    default this one's): a hidden name beside it that no loader takes for the file itself."""
    folder, name = os.path.split(os.fspath(path))
    return os.path.join(folder, f".{name}.tmp-{os.getpid() if pid is None else pid}")


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Write ``path`` whole or not at all: ``write(file)`` fills a temporary file in the same
    folder, which is flushed, fsynced and renamed over ``path``; the folder is fsynced so
    that the rename survives a power cut. What an earlier write of ``path`` killed midway
    left behind is removed first.

    Args:
        path: the file to write.
        write: called once with the temporary file, opened for binary writing.
    """
    path = os.fspath(path)
    _remove_leftovers(path)
    temporary = temporary_path(path)
    try:
        with open(temporary, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.remove(temporary)
        raise
    _sync_folder(os.path.dirname(path) or ".")


def write_text(path: str | os.PathLike, text: str) -> None:
    """``text`` into ``path`` (UTF-8), whole or not at all (:func:`atomic_write`)."""
    atomic_write(path, lambda file: file.write(text.encode()))


def load_file(source: str | os.PathLike | BinaryIO, name: str | None = None):
    """What ``source`` (a path or a binary file) holds, read with ``torch.load(weights_only=True)``,
    tensors on the CPU.

    Args:
        source: the file.
        name: what to call it in errors (default: the path).

    Raises:
        UnsafeFileError: loading it needs more than tensors and plain containers (it would
            run code); nothing of it was run.
        DamagedFileError: it is truncated or corrupt.
        FileNotFoundError: there is no such file.
    """
    name = name or (os.fspath(source) if isinstance(source, (str, os.PathLike)) else "the file")
    try:
        return torch.load(source, map_location="cpu", weights_only=True)
    except _NOT_DAMAGED:
        raise
    except pickle.UnpicklingError as error:
        reason = _unsafe_reason(str(error))
        if reason is None:
            raise DamagedFileError(
                f"{name} is truncated or corrupt, or not a file torch.save wrote ({_reason(error)}); "
                "nothing of it was run"
            ) from None
        raise UnsafeFileError(
            f"{name} was refused: loading it needs more than tensors and plain containers "
            f"({reason}), which could run code; gradcomp's files never do. Use a file gradcomp wrote"
        ) from None
    except _DAMAGED as error:
        if isinstance(error, OSError) and error.errno not in (errno.EINVAL, None):
            raise
        raise DamagedFileError(
            f"{name} is truncated or corrupt ({type(error).__name__}: {_reason(error)}): "
            "it was not written whole, or was damaged since; resume from another checkpoint"
        ) from error


def _unsafe_reason(message: str) -> str | None:
    """The global torch's restricted unpickler refused, in its words; None where it refused
    something else (a damaged stream)."""
    for line in message.splitlines():
        if "GLOBAL" in line:
            return line.strip().split(". ")[0].rstrip(".")
    return None


# The lines torch wraps around the reason a restricted load failed.
_TORCH_PREAMBLE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def _reason(error: BaseException) -> str:
    """Why a load failed, in a sentence: torch's reason without its advice."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    told = [line for line in lines if not line.startswith(_TORCH_PREAMBLE)]
    return (told or lines or [repr(error)])[0].split(". ")[0].rstrip(".")


def _remove_leftovers(path: str) -> None:
    """Remove the temporary files of writes of ``path`` whose process is gone (killed midway)."""
    for leftover in glob.glob(glob.escape(temporary_path(path, "")) + "*"):
        pid = leftover.rsplit("-", 1)[-1]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            try:
                os.remove(leftover)
            except FileNotFoundError:  # removed by another process meanwhile
                pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def _sync_folder(folder: str) -> None:
    if os.name != "posix":  # folders cannot be opened for fsync elsewhere
        return
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
