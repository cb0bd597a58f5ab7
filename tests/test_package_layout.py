"""Where the Triton kernels live: ``kernels/`` at the repository's top level, installed as
``gradcomp.kernels`` (``[tool.setuptools.package-dir]``), from a wheel and from an editable
install, and never in the place of Hugging Face's ``kernels`` (which transformers imports) for a
process started at the root, where ``sys.path[0]`` is the working directory.

Each check runs a fresh interpreter at the root and one outside the repository, with Hugging
Face's ``kernels`` as installed here, with another on ``PYTHONPATH``, and with none (this
Python's site-packages seen through links that leave it out); the two must find the same
``kernels``, except that where there is none the root finds an empty namespace package (see
kernels/__init__.py: transformers imports whatever ``find_spec`` finds).
"""

import json
import os
import pathlib
import shutil
import site
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What a fresh interpreter finds under the name "kernels", as JSON on its last line.
FIND_KERNELS = """
import json
try:
    import kernels
    found = {"file": getattr(kernels, "__file__", None), "path": list(getattr(kernels, "__path__", [])),
             "names": sorted(name for name in vars(kernels) if not name.startswith("__"))}
except ModuleNotFoundError as error:
    found = {"missing": error.name}
print(json.dumps(found))
"""

# What transformers' check finds (and the file it then imports from), or the error it raises.
TRANSFORMERS_CHECK = """
import json
try:
    from transformers.utils.import_utils import is_kernels_available
    found = [is_kernels_available()]
    if found[0]:
        import kernels  # what transformers then imports from (transformers.integrations.hub_kernels)
        found.append(kernels.__file__)
except Exception as error:
    found = f"{type(error).__name__}: {error}"
print(json.dumps(found))
"""

EMPTY_NAMESPACE = {"file": None, "path": [], "names": []}


def run(code: str, cwd: pathlib.Path, environment: dict) -> object:
    """The JSON the last line of ``python -c code`` prints, run in ``cwd`` in ``environment``
    (``{"site": folder}`` replaces site-packages, ``{"PYTHONPATH": ...}`` is added to them)."""
    env = {**os.environ, "PYTHONPATH": environment.get("PYTHONPATH", "")}
    command = [sys.executable, "-c", code]
    if "site" in environment:
        command = [
            sys.executable,
            "-S",
            "-c",
            f"import site; site.addsitedir({environment['site']!r})\n{code}",
        ]
    done = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command} in {cwd} failed:\n{done.stderr[-3000:]}"
    return json.loads(done.stdout.splitlines()[-1])


def site_without_kernels(folder: pathlib.Path) -> pathlib.Path:
    """``folder`` made a site-packages of links to this Python's, less Hugging Face's kernels."""
    folder.mkdir()
    for packages in map(pathlib.Path, site.getsitepackages()):
        for entry in packages.iterdir():
            hidden = entry.name == "kernels" or entry.name.startswith(
                "kernels-"
            )  # the package, its dist-info
            if not hidden and not (folder / entry.name).exists():
                (folder / entry.name).symlink_to(entry)
    return folder


def site_with_another_kernels(folder: pathlib.Path) -> pathlib.Path:
    """``folder`` holding a small ``kernels`` package and its metadata, at a version transformers
    accepts (its own lower bound), to put first on ``PYTHONPATH``."""
    from transformers.utils import import_utils

    # The constant is the installed transformers' own; 0.19.1 where it has none of that name.
    version = getattr(import_utils, "KERNELS_MIN_VERSION", "0.19.1")
    (folder / "kernels").mkdir(parents=True)
    (folder / "kernels" / "__init__.py").write_text(
        f"__version__ = {version!r}\n\ndef get_kernel(name):\n    return name\n"
    )
    (folder / f"kernels-{version}.dist-info").mkdir()
    (folder / f"kernels-{version}.dist-info" / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: kernels\nVersion: {version}\n"
    )
    return folder


# Hugging Face's kernels as installed here differs between machines (not in the tests' own
# packages); the other two are the same everywhere.
ENVIRONMENTS = ["another on PYTHONPATH", "none", pytest.param("as installed", marks=pytest.mark.slow)]


@pytest.fixture(params=ENVIRONMENTS)
def environment(request, tmp_path) -> dict:
    if request.param == "another on PYTHONPATH":
        return {"PYTHONPATH": str(site_with_another_kernels(tmp_path / "another"))}
    if request.param == "none":
        return {"site": str(site_without_kernels(tmp_path / "site"))}
    return {}


@pytest.fixture
def outside(tmp_path) -> pathlib.Path:
    """A working directory outside the repository."""
    folder = tmp_path / "elsewhere"
    folder.mkdir()
    return folder


def test_import_kernels_at_the_root_finds_what_it_finds_elsewhere(environment, outside):
    elsewhere = run(FIND_KERNELS, outside, environment)
    at_root = run(FIND_KERNELS, ROOT, environment)
    assert at_root == (EMPTY_NAMESPACE if "missing" in elsewhere else elsewhere)
    if environment.get("PYTHONPATH"):
        assert elsewhere["file"] == str(pathlib.Path(environment["PYTHONPATH"], "kernels", "__init__.py"))


@pytest.mark.slow
def test_transformers_check_for_kernels_at_the_root_is_the_one_elsewhere(environment, outside):
    assert run(TRANSFORMERS_CHECK, ROOT, environment) == run(TRANSFORMERS_CHECK, outside, environment)


@pytest.mark.slow
def test_transformers_trainer_imports_at_the_root_without_hugging_faces_kernels(tmp_path):
    # The Trainer's modules ask transformers whether "kernels" is installed when they load.
    code = "import json\nfrom transformers import Trainer\nprint(json.dumps(Trainer.__name__))"
    assert run(code, ROOT, {"site": str(site_without_kernels(tmp_path / "site"))}) == "Trainer"


@pytest.mark.slow
def test_gradcomp_kernels_is_the_top_level_folder_and_leaves_the_name_kernels_alone(outside):
    # From an editable install: at the root gradcomp comes from the working directory and
    # gradcomp.kernels from the install's mapping, elsewhere both from the mapping.
    code = (
        "import json, sys\nimport gradcomp.kernels\n"
        "print(json.dumps([gradcomp.kernels.__file__, gradcomp.kernels.quantize_blockwise.__module__,"
        " 'kernels' in sys.modules]))"
    )
    expected = [str(ROOT / "kernels" / "__init__.py"), "gradcomp.kernels.quantize", False]
    assert run(code, ROOT, {}) == expected
    assert run(code, outside, {}) == expected


@pytest.mark.slow
def test_a_wheel_installs_the_kernels_as_gradcomp_kernels(tmp_path, outside):
    # Built from a copy of the sources the wheel needs (no csrc/: the fatbins are not what
    # this checks, and a build would write them into the tree), without fetching anything.
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, source / name)
    for name in ("gradcomp", "kernels"):
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.fatbin"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    build = [*pip, "wheel", "--no-deps", "--no-build-isolation", str(source), "-w", str(tmp_path / "dist")]
    subprocess.run(build, check=True, capture_output=True, cwd=tmp_path, timeout=600)
    (wheel,) = (tmp_path / "dist").glob("gradcomp-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [path.name for path in (ROOT / "kernels").glob("*.py")]
    assert "__init__.py" in sources
    expected = {f"gradcomp/kernels/{name}" for name in sources}
    assert expected <= names, f"missing from the wheel: {sorted(expected - names)}"
    assert not [name for name in names if name.startswith("kernels/")], "the wheel ships a top-level kernels"

    target = tmp_path / "installed"
    install = [*pip, "install", "--no-deps", "--no-index", "--target", str(target), str(wheel)]
    subprocess.run(install, check=True, capture_output=True, timeout=600)
    code = "import json\nimport gradcomp.kernels\nprint(json.dumps(gradcomp.kernels.__file__))"
    # PYTHONPATH comes before site-packages, where the editable install's finder is.
    assert run(code, outside, {"PYTHONPATH": str(target)}) == str(
        target / "gradcomp" / "kernels" / "__init__.py"
    )
