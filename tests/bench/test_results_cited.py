"""bench/results/ keeps what a report, the README or the docs cite, and each path they cite is there."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
MOST_FILES = 80

# A path into bench/results as the markdown writes it: `bench/results/NAME` in prose, or
# ../results/NAME in a report's link; NAME may hold shell braces ({a,b}), a folder ends it.
CITATION = re.compile(r"(?:bench/|\.\./)results/([\w.@{},-]+)")


def citing_texts() -> dict[str, str]:
    paths = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    paths += sorted((ROOT / "bench" / "reports").glob("*.md"))
    return {str(path.relative_to(ROOT)): path.read_text() for path in paths}


def expand_braces(name: str) -> list[str]:
    """``name`` with each ``{a,b}`` group expanded, as the shell does."""
    group = re.search(r"\{([^{}]*)\}", name)
    if group is None:
        return [name]
    head, tail = name[: group.start()], name[group.end() :]
    choices = group.group(1).split(",")
    return [expanded for choice in choices for expanded in expand_braces(head + choice + tail)]


def cited_paths() -> dict[str, str]:
    """Each bench/results name a text cites by its path, with the first text that does."""
    cited = {}
    for source, text in citing_texts().items():
        for match in CITATION.finditer(text):
            for name in expand_braces(match.group(1).rstrip(".,")):
                cited.setdefault(name, source)
    return cited


def test_every_cited_result_exists():
    missing = {name: source for name, source in cited_paths().items() if not (RESULTS / name).exists()}
    assert not missing, f"cited but not in bench/results: {missing}"


def test_every_result_is_cited():
    cited = cited_paths()
    texts = "\n".join(citing_texts().values())
    # A file a report names without its path (a heading's `convergence-cpu2-w2.json`) is cited too.
    uncited = [
        entry.name for entry in RESULTS.iterdir() if entry.name not in cited and entry.name not in texts
    ]
    assert not uncited, f"in bench/results, cited by no report, README.md or docs/: {sorted(uncited)}"


def test_results_stay_few():
    files = [path for path in RESULTS.rglob("*") if path.is_file()]
    assert len(files) <= MOST_FILES, f"{len(files)} files in bench/results: fold a sweep's (bench/fold.py)"


def test_braces_expand_as_the_shell_does():
    assert expand_braces("x-{a,b}-{1,2}.json") == ["x-a-1.json", "x-a-2.json", "x-b-1.json", "x-b-2.json"]
    assert expand_braces("plain.txt") == ["plain.txt"]
