"""Smoke test of the demo: two spawned Gloo ranks, one epoch, two runs."""

import dataclasses
import os

import pytest

from gradcomp import demo, limited_link
from gradcomp.cli import parser


@pytest.mark.slow
def test_demo_table_has_every_run():
    rows = demo.run_demo(["dense", "int8"], epochs=1, world_size=2, show_progress=False)
    table = demo.format_table(rows)
    assert [row.label for row in rows] == ["dense", "int8"]
    assert all(label in table for label in ("dense", "int8"))
    dense, int8 = rows
    assert dense.ratio == 1.0
    assert 3 <= int8.ratio <= 4.1
    assert int8.bytes_per_step < dense.bytes_per_step
    assert int8.buckets > 1, "bucket_cap_mb should split the model into several buckets"
    for row in rows:
        assert row.step_ms > 0
        assert 0 < row.train_loss < 2.3  # below the loss of a uniform guess over 10 classes
        assert 0.5 < row.test_accuracy <= 1


@pytest.mark.slow
def test_bad_settings_are_rejected_before_spawning():
    with pytest.raises(ValueError, match="unknown demo runs"):
        demo.run_demo(["dense", "int9"])
    with pytest.raises(ValueError, match="world_size must be at least 2"):
        demo.run_demo(["dense"], world_size=1)
    with pytest.raises(SystemExit):
        parser().parse_args(["demo", "--compressors", "int9"])


def test_demo_without_scikit_learn_says_what_to_install(monkeypatch, capsys):
    import importlib.util

    from gradcomp import cli

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "sklearn" else real(name, *a)
    )
    assert cli.main(["demo"]) == 2
    err = capsys.readouterr().err
    assert 'pip install -e ".[demo]"' in err and err.count("\n") == 1


def test_the_last_column_predicts_each_step_on_a_slower_link():
    nan = float("nan")
    dense = demo.Row("dense", 1e6, 1.0, 2.0, nan, nan, 0, 0.1, 0.9)  # 1 MB a step: 8 ms at 1 Gbit/s
    int8 = demo.Row("int8", 2.5e5, 4.0, 3.0, 0.5, 0.01, 3, 0.1, 0.9)  # slower on loopback, 2 ms
    table = demo.format_table([dense, int8])
    header, _, first, second = table.splitlines()[:4]
    assert header.rstrip().endswith("step ms at 1gbit (predicted)")
    assert first.split()[-1] == "10.00" and second.split()[-1] == "5.00"  # where compression pays
    assert "predicted" not in demo.format_table([dense], link=None)
    assert demo.format_table([dense], link="100mbit").splitlines()[2].split()[-1] == "82.00"


def test_a_measured_column_shows_the_same_runs_behind_a_slow_link():
    nan = float("nan")
    rows = [demo.Row("dense", 1e6, 1.0, 2.0, nan, nan, 0, 0.1, 0.9)]
    rows.append(demo.Row("int8", 2.5e5, 4.0, 3.0, 0.5, 0.01, 3, 0.1, 0.9))
    slow = [dataclasses.replace(rows[0], step_ms=11.5), dataclasses.replace(rows[1], step_ms=6.25)]
    header, _, first, second = demo.format_table(rows, "1gbit", measured=("1gbit", slow)).splitlines()
    assert header.rstrip().endswith("step ms at 1gbit (predicted)  step ms at 1gbit (measured)")
    assert first.split()[-2:] == ["10.00", "11.50"] and second.split()[-2:] == ["5.00", "6.25"]
    with pytest.raises(ValueError, match="other runs"):
        demo.format_table(rows, measured=("1gbit", slow[:1]))


def test_bandwidth_without_root_is_refused_before_training(monkeypatch, capsys):
    from gradcomp import cli

    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(demo, "run_demo", lambda *a, **k: pytest.fail("trained before refusing"))
    assert cli.main(["demo", "--bandwidth", "100mbit"]) == 2
    err = capsys.readouterr().err
    assert "needs root" in err and "--link" in err


@pytest.mark.slow
@pytest.mark.skipif(limited_link.unmet_requirement("") is not None, reason="needs root, ip and tc (netns)")
def test_bandwidth_measures_each_run_behind_the_limited_link(capsys):
    from gradcomp import cli

    rate = 20e6  # 20 Mbit/s a rank: dense's 340 KB a step take 136 ms, int8's a quarter of that
    assert cli.main(["demo", "--epochs", "1", "--compressors", "dense,int8", "--bandwidth", "20mbit"]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("compressor"))
    assert header.rstrip().endswith("step ms at 20mbit (predicted)  step ms at 20mbit (measured)")
    found = {line.split()[0]: line.split() for line in lines if line.split()[:1] in (["dense"], ["int8"])}
    dense_bytes = float(found["dense"][1].replace(",", ""))
    dense_loopback, dense_slow = float(found["dense"][3]), float(found["dense"][-1])
    # The link holds the sends back (a token bucket's burst lets some through at once).
    assert dense_slow > max(2 * dense_loopback, 0.5e3 * dense_bytes * 8 / rate)
    assert float(found["int8"][-1]) < dense_slow  # where compression pays
