"""The size of gradcomp's parts, enforced: no class longer than 350 lines (from its ``class``
line to the end of its body) and no module longer than 600, in every ``gradcomp/**/*.py`` and
in the Triton kernels (``kernels/``, installed as ``gradcomp.kernels``). A class that grows
past it has a part with a name of its own to move out; a module, a concern.

Static: the files are those :mod:`tests.test_layers` checks, parsed with :mod:`ast`.
"""

from __future__ import annotations

import ast
import pathlib

from tests.test_layers import ROOT, modules

MAX_CLASS_LINES = 350
MAX_MODULE_LINES = 600


def class_lengths(path: pathlib.Path) -> list[tuple[str, int, int]]:
    """Each class of the file, nested ones too: its name, its line and its length in lines."""
    tree = ast.parse(path.read_text(), str(path))
    return [
        (node.name, node.lineno, node.end_lineno - node.lineno + 1)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef)
    ]


def test_the_files_checked_include_the_kernels():
    found = modules(ROOT)
    assert "gradcomp.ddp.auto" in found and "gradcomp.kernels" in found, sorted(found)


def test_no_class_is_longer_than_350_lines():
    offenders = [
        f"{path.relative_to(ROOT).as_posix()}:{line} {name}: {length} lines"
        for path in modules(ROOT).values()
        for name, line, length in class_lengths(path)
        if length > MAX_CLASS_LINES
    ]
    assert not offenders, f"classes over {MAX_CLASS_LINES} lines:\n" + "\n".join(offenders)


def test_no_module_is_longer_than_600_lines():
    offenders = [
        f"{path.relative_to(ROOT).as_posix()}: {length} lines"
        for path in modules(ROOT).values()
        if (length := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not offenders, f"modules over {MAX_MODULE_LINES} lines:\n" + "\n".join(offenders)
