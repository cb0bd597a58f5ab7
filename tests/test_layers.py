"""The layers docs/design.md draws, enforced: no import cycle among gradcomp's
modules, and every import points into its own layer or one below.

Static: every ``gradcomp/**/*.py`` and every module of a folder that
pyproject.toml's ``[tool.setuptools.package-dir]`` installs inside gradcomp (the
Triton kernels: ``kernels/`` at the top level, installed as ``gradcomp.kernels``)
is parsed with :mod:`ast`, and every import of a gradcomp module counts
wherever it stands: at module level, inside a function (a call-time import is a
dependency all the same) or under ``TYPE_CHECKING``.
Imports of a computed name (``importlib.import_module(name)``) are not seen.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]

# The layers, top first. A module may import modules of its own layer and of the
# layers below. A module's layer is its component's, the first name under
# gradcomp ("" is gradcomp/__init__.py): gradcomp.ddp and gradcomp.ddp.hook are both
# "ddp", so a module keeps its layer when it becomes a package.
LAYERS = (
    # The package's top and the commands; spawn runs ranks for the demo, bench and
    # tests, limited_link runs them behind a slow loopback; units, tables and profiling
    # are helpers of these that import nothing.
    (
        "entry points",
        ("", "__main__", "cli", "demo", "spawn", "limited_link", "units", "tables", "profiling"),
    ),
    ("framework glue", ("integrations",)),
    ("training", ("ddp", "optim", "fsdp", "diloco")),
    ("bucket layouts", ("buckets",)),
    ("planner", ("planner",)),
    ("collectives", ("collectives",)),
    ("compressors", ("compressors",)),
    ("feedback and payload", ("feedback", "payload")),
    ("ops", ("ops",)),
    ("streams", ("streams",)),  # which CUDA stream work runs on: imports torch only
    ("files", ("files",)),  # writes files whole, loads them without running code: imports torch only
    ("kernels", ("kernels",)),  # imports triton and torch only, never the rest of gradcomp
)
RANK = {component: len(LAYERS) - i for i, (_, components) in enumerate(LAYERS) for component in components}
LAYER_NAME = {component: name for name, components in LAYERS for component in components}
KERNELS_MAY_IMPORT = {"torch", "triton"}

# Imports that go against the layers (or name a module that is not there) today, each
# (importer, imported) with the way out. Every entry must still occur: one that no
# longer does fails the test, so the list only shrinks.
KNOWN_EXCEPTIONS: dict = {}


@dataclasses.dataclass(frozen=True)
class Import:
    """One import of a gradcomp module: ``imported`` is the module it loads, or the
    name as written where the tree has no such module (``found`` False)."""

    importer: str
    imported: str
    path: str  # relative to the tree's root
    line: int
    found: bool = True


def package_dirs(root: pathlib.Path) -> dict[str, str]:
    """``[tool.setuptools.package-dir]`` of the tree's pyproject.toml: package -> folder."""
    path = root / "pyproject.toml"
    if not path.exists():
        return {}
    with open(path, "rb") as file:
        return tomllib.load(file).get("tool", {}).get("setuptools", {}).get("package-dir", {})


def modules(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the tree by its import name, where the package-dir mapping puts it."""
    found = {}
    for package, folder in {"gradcomp": "gradcomp", **package_dirs(root)}.items():
        for path in sorted((root / folder).rglob("*.py")):
            parts = [*package.split("."), *path.relative_to(root / folder).with_suffix("").parts]
            found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = importer.split(".") if is_package else importer.split(".")[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])


def imports(root: pathlib.Path) -> list[Import]:
    """Every import of a gradcomp module in the tree, wherever it stands."""
    known = modules(root)
    found = []
    for importer, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [(alias.name, None) for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(node, importer, path.name == "__init__.py")
                targets = [(module, alias.name) for alias in node.names]
            else:
                continue
            for module, name in targets:
                if module.split(".")[0] != "gradcomp":
                    continue
                if name is not None and f"{module}.{name}" in known:
                    module = f"{module}.{name}"  # from package import submodule
                where = path.relative_to(root).as_posix()
                found.append(Import(importer, module, where, node.lineno, module in known))
    return found


def cycles(edges: list[Import], node_of=lambda module: module) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's), each sorted;
    a node is a module, or what ``node_of`` makes of it (its component)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        importer, imported = node_of(edge.importer), node_of(edge.imported)
        if imported != importer:
            graph.setdefault(importer, set()).add(imported)
            graph.setdefault(imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in on_stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return components


def component(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward(edges: list[Import]) -> list[Import]:
    """The imports into a higher layer (components without a layer are reported apart)."""
    return [
        edge
        for edge in edges
        if component(edge.importer) in RANK
        and component(edge.imported) in RANK
        and RANK[component(edge.imported)] > RANK[component(edge.importer)]
    ]


def _described(edge: Import) -> str:
    def layer(module: str) -> str:
        return LAYER_NAME.get(component(module), "no layer")

    return (
        f"{edge.path}:{edge.line}: {edge.importer} ({layer(edge.importer)}) imports "
        f"{edge.imported} ({layer(edge.imported)})"
    )


def _unexcused(edges: list[Import]) -> list[Import]:
    return [edge for edge in edges if (edge.importer, edge.imported) not in KNOWN_EXCEPTIONS]


# ----------------------------------------------------------------------------- the package


def test_no_import_cycle_among_gradcomps_modules():
    edges = imports(ROOT)
    found = cycles(edges)
    described = []
    for members in found:
        inside = [edge for edge in edges if edge.importer in members and edge.imported in members]
        described.append(" <-> ".join(members) + "".join(f"\n    {_described(e)}" for e in inside))
    assert not found, "import cycles:\n  " + "\n  ".join(described)


def test_no_import_cycle_between_components():
    # Importing gradcomp.planner.model runs gradcomp/planner/__init__.py first: modules of
    # two components that import each other's packages form a cycle at run time, even where
    # their modules do not (and the layers do not tell two components of one layer apart).
    edges = [edge for edge in imports(ROOT) if component(edge.importer) and component(edge.imported)]
    found = cycles(edges, component)
    described = []
    for members in found:
        across = [e for e in edges if {component(e.importer), component(e.imported)} <= set(members)]
        across = [e for e in across if component(e.importer) != component(e.imported)]
        described.append(" <-> ".join(members) + "".join(f"\n    {_described(e)}" for e in across))
    assert not found, "import cycles between components:\n  " + "\n  ".join(described)


def test_every_module_has_a_layer():
    missing = sorted({component(m) for m in modules(ROOT)} - set(RANK))
    assert not missing, f"components without a layer: {missing}; add them to LAYERS, as docs/design.md draws"


def test_imports_point_down_the_layers():
    against = _unexcused(upward(imports(ROOT)))
    assert not against, "imports into a higher layer:\n  " + "\n  ".join(map(_described, against))


def test_every_imported_gradcomp_module_exists():
    missing = _unexcused([edge for edge in imports(ROOT) if not edge.found])
    assert not missing, "imports of modules that are not there:\n  " + "\n  ".join(map(_described, missing))


def test_kernels_import_triton_and_torch_only():
    wrong = []
    for name, path in modules(ROOT).items():
        if component(name) != "kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                tops = [alias.name.split(".")[0] for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                tops = [(node.module or "").split(".")[0]]
            else:
                continue  # relative: the kernels' own modules
            wrong += [
                f"{path.relative_to(ROOT).as_posix()}:{node.lineno}: {top}"
                for top in tops
                if top not in KERNELS_MAY_IMPORT and top not in sys.stdlib_module_names
            ]
    assert not wrong, f"the kernels import more than triton and torch: {wrong}"


def test_every_known_exception_still_occurs():
    edges = imports(ROOT)
    missing = [edge for edge in edges if not edge.found]
    present = {(edge.importer, edge.imported) for edge in [*upward(edges), *missing]}
    gone = sorted(set(KNOWN_EXCEPTIONS) - present)
    assert not gone, f"fixed: remove these from KNOWN_EXCEPTIONS: {gone}"


# ----------------------------------------------------------------------------- the checks themselves


def _tree(root: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_checks_find_a_planted_cycle_an_upward_import_and_a_missing_module(tmp_path):
    root = _tree(
        tmp_path,
        {
            "gradcomp/__init__.py": "from gradcomp import collectives\n",
            "gradcomp/collectives/__init__.py": "from gradcomp.collectives.job import Job\n",
            # A cycle through an import inside a function and one under TYPE_CHECKING.
            "gradcomp/collectives/job.py": "import typing\nif typing.TYPE_CHECKING:\n    from . import run\n",
            "gradcomp/collectives/run.py": "def f():\n    from gradcomp.collectives import job\n",
            # ops reaches up into the planner (a package: its layer is its component's).
            "gradcomp/ops/__init__.py": "def g():\n    from gradcomp.planner.model import x\n",
            "gradcomp/planner/__init__.py": "from gradcomp.ops import g\n",
            "gradcomp/planner/model.py": "from gradcomp.collectives.gone import Job\n",
            # The kernels where the card puts them, installed inside gradcomp.
            "pyproject.toml": '[tool.setuptools.package-dir]\n"gradcomp.kernels" = "kernels"\n',
            "kernels/__init__.py": "from .common import k\n",
            "kernels/common.py": "import triton\n",
        },
    )
    edges = imports(root)
    assert cycles(edges) == [["gradcomp.collectives.job", "gradcomp.collectives.run"]]
    assert cycles(edges, component) == [["ops", "planner"]]  # no module cycle: through the package
    assert [(e.importer, e.imported, e.line) for e in upward(edges)] == [
        ("gradcomp.ops", "gradcomp.planner.model", 2)
    ]
    assert [(e.importer, e.imported) for e in edges if not e.found] == [
        ("gradcomp.planner.model", "gradcomp.collectives.gone")
    ]
    assert ("gradcomp.kernels", "gradcomp.kernels.common") in {(e.importer, e.imported) for e in edges}
    assert _described(upward(edges)[0]) == (
        "gradcomp/ops/__init__.py:2: gradcomp.ops (ops) imports gradcomp.planner.model (planner)"
    )


def test_every_package_of_the_tree_is_installed():
    # pyproject.toml lists the packages: one missing from it is left out of a wheel.
    with open(ROOT / "pyproject.toml", "rb") as file:
        listed = set(tomllib.load(file)["tool"]["setuptools"]["packages"])
    tree = {name for name, path in modules(ROOT).items() if path.name == "__init__.py"}
    assert sorted(tree - listed) == [], "packages missing from pyproject.toml"
    assert sorted(listed - tree) == [], "pyproject.toml lists what is not a package"
