"""gradcomp.files: a write leaves the old file or the new one, a load runs no code and names
a damaged file."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

from gradcomp import files


class RunsCode:
    """Unpickling it would create ``marker``: what a crafted checkpoint does."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _crafted(folder, how: str) -> tuple[str, str]:
    path, marker = str(folder / f"crafted_{how}.pt"), str(folder / f"ran_{how}")
    payload = {"world_size": 1, "state": RunsCode(marker)}
    if how == "torch.save":
        torch.save(payload, path)
    else:
        with open(path, "wb") as file:
            pickle.dump(payload, file, protocol=int(how.removeprefix("pickle")))
    return path, marker


@pytest.mark.parametrize("how", ["torch.save", "pickle2"])
def test_a_file_that_would_run_code_is_refused_unrun(tmp_path, how):
    path, marker = _crafted(tmp_path, how)
    with pytest.raises(files.UnsafeFileError, match="needs more than tensors and plain containers") as caught:
        files.load_file(path)
    assert path in str(caught.value) and "GLOBAL" in str(caught.value)
    assert not os.path.exists(marker), "loading ran the file's code"


def test_a_pickle_torch_cannot_read_safely_is_refused_unrun(tmp_path):
    # Protocol 4's framing stops torch's restricted unpickler before it meets the global.
    path, marker = _crafted(tmp_path, "pickle4")
    with pytest.raises(files.DamagedFileError, match="not a file torch.save wrote.*nothing of it was run"):
        files.load_file(path)
    assert not os.path.exists(marker), "loading ran the file's code"


def _cuts(size: int) -> list[int]:
    return sorted({0, 1, 7, 100, 1000, size // 3, size // 2, size - 100, size - 22, size - 1})


def test_a_truncated_file_is_named_as_truncated_at_every_length(tmp_path):
    whole = tmp_path / "whole.pt"
    torch.save({"step": 3, "residuals": {i: torch.randn(5000) for i in range(3)}}, whole)
    data = whole.read_bytes()
    for cut in _cuts(len(data)):
        path = tmp_path / f"cut{cut}.pt"
        path.write_bytes(data[:cut])
        with pytest.raises(files.DamagedFileError, match="is truncated or corrupt") as caught:
            files.load_file(path)
        assert str(path) in str(caught.value), cut


def test_a_missing_file_stays_a_file_not_found_error(tmp_path):
    with pytest.raises(FileNotFoundError):
        files.load_file(tmp_path / "absent.pt")


def test_a_file_object_is_named_as_told(tmp_path):
    import io

    buffer = io.BytesIO()
    torch.save({"a": torch.ones(3)}, buffer)
    assert torch.equal(files.load_file(io.BytesIO(buffer.getvalue()))["a"], torch.ones(3))
    with pytest.raises(files.DamagedFileError, match="^entry rank0 is truncated"):
        files.load_file(io.BytesIO(buffer.getvalue()[:50]), "entry rank0")


def test_a_write_replaces_the_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "profile.json"
    files.write_text(path, "old\n")
    files.write_text(path, "new\n")
    assert path.read_text() == "new\n"
    assert sorted(os.listdir(tmp_path)) == ["profile.json"]
    # The file is made as open() makes one (the umask's permissions), not private as mkstemp's.
    probe = tmp_path / "probe"
    probe.write_text("")
    assert os.stat(path).st_mode == os.stat(probe).st_mode


def test_a_write_that_fails_keeps_the_old_file(tmp_path):
    path = tmp_path / "state.pt"
    files.write_text(path, "old")

    def fails(file):
        file.write(b"part of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.atomic_write(path, fails)
    assert path.read_text() == "old" and sorted(os.listdir(tmp_path)) == ["state.pt"]


def test_a_killed_writes_leftover_is_removed_by_the_next_write_and_a_live_ones_kept(tmp_path):
    path = tmp_path / "gradcomp_rank0.pt"
    exited = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    leftover = files.temporary_path(path, int(exited.stdout))
    with open(leftover, "wb") as file:
        file.write(b"a write killed midway")
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        writing = files.temporary_path(path, live.pid)  # another process still writing
        with open(writing, "wb") as file:
            file.write(b"being written")
        assert os.path.basename(leftover).startswith(".gradcomp_rank0.pt.tmp-")
        files.atomic_write(path, lambda file: file.write(b"new"))
        assert path.read_bytes() == b"new"
        assert not os.path.exists(leftover) and os.path.exists(writing)
    finally:
        live.kill()
        live.wait()
