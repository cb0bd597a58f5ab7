"""``gradcomp demo``: the verdict against dense (predicted or measured), the table, the plot,
the refusals said before training, and the demo run end to end on two spawned Gloo ranks."""

import dataclasses
import importlib.util
import math
import os

import pytest

from gradcomp import cli, demo, limited_link
from gradcomp.cli import verdict
from gradcomp.units import format_rate

NAN = float("nan")


def rows(measured: bool = False) -> list[demo.Row]:
    """dense sends 1 MB a step (8 ms at 1 Gbit/s), int4 an eighth of it and takes 3 ms longer."""
    dense = demo.Row("dense", 1e6, 1.0, 2.0, NAN, NAN, 0, 1.0, 0.9)
    int4 = demo.Row("int4", 1.25e5, 8.0, 5.0, 2.5, NAN, 2, 1.01, 0.89)
    if measured:
        return [dataclasses.replace(dense, link_step_ms=20.0), dataclasses.replace(int4, link_step_ms=8.0)]
    return [dense, int4]


def test_verdict_predicts_each_step_at_the_link_from_loopback_step_and_bytes():
    # dense at 100 Mbit/s: 2 + 80 = 82 ms; int4: 5 + 10 = 15 ms; int4 pays below 7 Mbit / 3 ms.
    (line,) = verdict.verdict_lines(rows(), "100mbit")
    assert line == (
        "int4: 5.5x faster than dense at 100 Mbit/s (predicted), loss +1.0% vs dense; pays below 2.3 Gbit/s"
    )
    # On a fast link its 3 ms of encoding outweigh the bytes saved.
    (line,) = verdict.verdict_lines(rows(), "10gbit")
    assert line.startswith("int4: 1.8x slower than dense at 10 Gbit/s (predicted)")
    assert verdict.break_even(rows()[1], rows()[0]) == pytest.approx(7e6 / 3e-3)
    assert format_rate(5e8) == "500 Mbit/s" and format_rate(2.25e9) == "2.2 Gbit/s"


def test_verdict_says_measured_where_each_step_was_measured_behind_the_link():
    (line,) = verdict.verdict_lines(rows(measured=True), "100mbit")
    assert line.startswith("int4: 2.5x faster than dense at 100 Mbit/s (measured), loss +1.0% vs dense")
    header, _, dense, int4 = verdict.format_rows(rows(measured=True), "100mbit").splitlines()
    assert header.endswith("ms at 100mbit (predicted)  ms at 100mbit (measured)")
    assert dense.split()[-2:] == ["82.00", "20.00"] and int4.split()[-2:] == ["15.00", "8.00"]
    assert "measured" not in verdict.format_rows(rows(), "100mbit")
    with pytest.raises(ValueError, match="dense"):
        verdict.verdict_lines(rows()[1:], "100mbit")


def test_break_even_at_every_rate_and_at_none():
    dense, int4 = rows()
    assert verdict.break_even(dataclasses.replace(int4, step_ms=1.0), dense) == math.inf
    assert verdict.break_even(dataclasses.replace(int4, bytes_per_step=2e6), dense) == 0
    assert verdict.verdict_lines([dense, dataclasses.replace(int4, bytes_per_step=2e6)], "1gbit")[0].endswith(
        "pays at no link rate"
    )


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is None, reason="needs matplotlib")
def test_plot_draws_each_run_over_link_rates_and_marks_the_measured_steps(tmp_path):
    import matplotlib.image

    path = tmp_path / "demo.png"
    verdict.plot(rows(measured=True), "100mbit", str(path), "a test")
    assert matplotlib.image.imread(str(path)).shape[:2] == (600, 960)  # 8 x 5 inches at 120 dpi
    rates = verdict.plot_rates("100mbit")
    assert rates[0] == pytest.approx(1e7) and rates[-1] == pytest.approx(1e11)
    assert verdict.plot_rates("1mbit")[0] == pytest.approx(5e5)  # widened to hold the link


def _refused(argv, capsys) -> str:
    assert cli.main(argv) == 2
    return capsys.readouterr().err


def test_bad_options_are_refused_before_training(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("trained before refusing"))
    assert "no folder" in _refused(["demo", "--plot", str(tmp_path / "missing" / "demo.png")], capsys)
    assert "ending in .png" in _refused(["demo", "--plot", str(tmp_path / "demo.pdf")], capsys)
    os.mkdir(tmp_path / "a.png")
    assert "is a folder" in _refused(["demo", "--plot", str(tmp_path / "a.png")], capsys)
    assert "--epochs is --small's" in _refused(["demo", "--epochs", "2"], capsys)
    assert "with --small give --epochs" in _refused(["demo", "--small", "--steps", "2"], capsys)
    assert "not both" in _refused(["demo", "--link", "1gbit", "--bandwidth", "1gbit"], capsys)
    for argv in (
        ["--link", "fast"],
        ["--link", "0mbit"],
        ["--compressors", "int4"],
        ["--compressors", "int9"],
    ):
        with pytest.raises(SystemExit):
            cli.main(["demo", *argv])
    assert "add dense" in capsys.readouterr().err


def test_missing_matplotlib_or_scikit_learn_says_what_to_install(monkeypatch, tmp_path, capsys):
    real = importlib.util.find_spec
    missing = {"matplotlib", "sklearn"}
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name in missing else real(name, *a)
    )
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("trained before refusing"))
    for argv in (["--plot", str(tmp_path / "demo.png")], ["--small"]):
        err = _refused(["demo", *argv], capsys)
        assert 'pip install -e ".[demo]"' in err and err.count("\n") == 1


def test_bandwidth_without_root_is_refused_before_training(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("trained before refusing"))
    err = _refused(["demo", "--bandwidth", "100mbit"], capsys)
    assert "needs root" in err and "--link" in err


def test_without_root_the_step_is_predicted_and_says_why(monkeypatch, capsys):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    given = {}

    def trained(names, setup, world_size, link):
        given.update(names=names, link=link, steps=setup.steps)
        return rows()

    monkeypatch.setattr(demo, "run_demo", trained)
    assert cli.main(["demo", "--steps", "3", "--compressors", "dense,int4", "--link", "100mbit"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert given == {"names": ["dense", "int4"], "link": None, "steps": 3}
    assert "predicted" in out[-3] and "needs root" in out[-3]
    assert out[-1].startswith("int4: 5.5x faster than dense at 100 Mbit/s (predicted)")


@pytest.mark.slow
def test_demo_end_to_end_ends_with_a_verdict_and_writes_the_plot(tmp_path, capsys):
    path = tmp_path / "demo.png"
    argv = ["demo", "--steps", "3", "--compressors", "dense,int4", "--predicted", "--plot", str(path)]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("int4: ") and "at 500 Mbit/s (predicted)" in lines[-2]
    assert lines[-1] == f"plot: {path}" and path.stat().st_size > 10_000
    table = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["dense"], ["int4"])}
    assert float(table["int4"][2]) > 7  # ratio: 4 bits and a scale a block against 32 bits


@pytest.mark.slow
def test_small_demo_trains_the_digits_mlp_with_every_run():
    setup = dataclasses.replace(demo.SMALL, epochs=1)
    dense, int8 = demo.run_demo(["dense", "int8"], setup, world_size=2, show_progress=False)
    assert (dense.label, int8.label) == ("dense", "int8")
    assert dense.ratio == 1.0 and 3 <= int8.ratio <= 4.1
    assert int8.buckets > 1, "bucket_cap_mb should split the model into several buckets"
    for row in (dense, int8):
        assert row.step_ms > 0 and math.isnan(row.link_step_ms)
        assert 0 < row.test_loss < 2.3  # below the loss of a uniform guess over 10 classes
        assert 0.5 < row.test_accuracy <= 1


@pytest.mark.slow
@pytest.mark.skipif(limited_link.unmet_requirement("") is not None, reason="needs root, ip and tc (netns)")
def test_bandwidth_measures_each_run_behind_the_limited_link(capsys):
    rate = 100e6  # 100 Mbit/s a rank: dense's 19 MB a step take 1.5 s, int4's an eighth of that
    argv = ["demo", "--steps", "2", "--compressors", "dense,int4", "--bandwidth", "100mbit"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    found = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["dense"], ["int4"])}
    dense_bytes, dense_loopback = float(found["dense"][1].replace(",", "")), float(found["dense"][3])
    dense_slow, int4_slow = float(found["dense"][-1]), float(found["int4"][-1])
    # The link holds the sends back (a token bucket's burst lets some through at once).
    assert dense_slow > max(2 * dense_loopback, 0.5e3 * dense_bytes * 8 / rate)
    assert int4_slow < dense_slow / 2  # where compression pays
    assert "(measured)" in lines[-1] and lines[-1].startswith("int4: ")
