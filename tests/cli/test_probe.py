"""``python -m gradcomp probe``: the profile it writes, and the fits it refuses."""

import pytest

from gradcomp import cli, planner, spawn
from tests.planner.profiles import BUCKET


@pytest.mark.slow
def test_probe_command_writes_a_profile_that_plan_uses(tmp_path, capsys):
    out = tmp_path / "profile.json"
    argv = [
        "probe",
        "--sizes",
        "64K,4M",
        "--codec-sizes",
        "1K,16K",
        "--compressors",
        "none,int8,int4",
        "--repeat",
        "3",
        "--out",
        str(out),
    ]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    assert "us per ring step" in text and "wrote" in text
    assert "fit, pingpong: " in text and " us one way" in text
    assert "transport CPU ms" in text and "ms of the host's CPU a MB sent" in text
    measured = planner.Profile.load(out)
    # The pingpong is kept where its fit holds (one slow round trip on loopback can flatten it).
    assert set(measured.links) - {"pingpong"} == {"all_gather", "all_to_all"}
    assert set(measured.codecs) == {"int8", "int4"} and measured.link.bandwidth > 0
    argv = ["plan", "--params", "100M", "--world", "16", "--bandwidth", "1gbit", "--profile", str(out)]
    assert cli.main([*argv, "--compute-ms", "300", "--allow", "none,int8,int4"]) == 0
    text = capsys.readouterr().out
    assert f"100,000,000 fp32 parameters in {-(-100_000_000 // BUCKET)} buckets of 25 MB, 16 ranks" in text
    assert "auto picks:" in text and "Amdahl" in text


def _rows(collective: str, points: list[tuple[int, float]]) -> list[dict]:
    return [dict(collective=collective, numel=n, bytes_sent=4 * n, seconds=t) for n, t in points]


def test_a_fit_the_sizes_cannot_support_is_named():
    # 1 ms a message and 1 GB/s: 4M elements take 17 ms, most of it the transfer.
    good = _rows("all_reduce", [(n, 1e-3 + 4 * n / 1e9) for n in (4096, 65536, 1 << 20, 4 << 20)])
    flat = _rows("all_gather", [(4096, 2e-4), (65536, 1.9e-4)])  # jitter: no growth
    small = _rows("all_to_all", [(4096, 1e-3), (65536, 1.03e-3)])  # latency hides the transfer
    rows = good + flat + small
    links = {name: planner.measure.fit_link([r for r in rows if r["collective"] == name], 2) for name in
             ("all_reduce", "all_gather", "all_to_all")}  # fmt: skip
    reasons = planner.unsupported_fits(rows, links)
    assert len(reasons) == 2, reasons
    assert reasons[0].startswith("all_gather: its time did not grow with the size (4,096 to 65,536 elements)")
    assert reasons[1].startswith("all_to_all: at 65,536 elements the transfer is ")
    assert planner.unsupported_fits(good, {"all_reduce": links["all_reduce"]}) == []


def test_probe_leaves_out_a_pingpong_its_sizes_cannot_support(tmp_path, capsys, monkeypatch):
    rows = _rows("all_reduce", [(65536, 1e-3 + 4 * 65536 / 1e9), (4 << 20, 1e-3 + 16 * (1 << 20) / 1e9)])
    rows += _rows("pingpong", [(65536, 3.9e-3), (4 << 20, 3.7e-3)])  # one slow round trip: no growth
    fit = planner.measure.fit_link
    pingpong = {"pingpong": fit(rows[2:], 2)}
    profile = planner.Profile("cpu", fit(rows[:2], 2), {}, 2, "gloo, 2 ranks", pingpong, None)
    monkeypatch.setattr(spawn, "run_ranks", lambda *args, **kwargs: (profile, rows))
    out = tmp_path / "profile.json"
    assert cli.main(["probe", "--sizes", "64K,4M", "--compressors", "int8", "--out", str(out)]) == 0
    assert "not kept: pingpong: its time did not grow" in capsys.readouterr().out
    assert planner.Profile.load(out).links == {}


def test_probe_refuses_to_write_a_fit_its_sizes_cannot_support(tmp_path, capsys, monkeypatch):
    rows = _rows("all_reduce", [(4096, 1e-4), (65536, 0.9e-4)])
    profile = planner.Profile("cpu", planner.measure.fit_link(rows, 2), {}, 2, "gloo, 2 ranks", {}, None)
    monkeypatch.setattr(spawn, "run_ranks", lambda *args, **kwargs: (profile, rows))
    out = tmp_path / "profile.json"
    argv = ["probe", "--sizes", "4K,64K", "--codec-sizes", "64K", "--compressors", "int8", "--out", str(out)]
    assert cli.main(argv) == 1
    err = capsys.readouterr().err
    assert f"not writing {out}" in err and "all_reduce: its time did not grow with the size" in err
    assert not out.exists()
