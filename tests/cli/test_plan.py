"""``python -m gradcomp plan``: every candidate and the choice, nodes, what it refuses."""

import dataclasses
import json

import pytest
import torch

from gradcomp import cli, planner
from tests.planner.profiles import BUCKET, GBIT, profile, two_nodes


def test_plan_with_params_prints_every_candidate_and_the_choice(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(GBIT).save(path)
    argv = ["plan", "--params", "350M", "--world", "16", "--profile", str(path), "--compute-ms", "500"]
    assert cli.main(argv) == 0
    text = capsys.readouterr().out
    buckets = 350_000_000 // BUCKET + 1
    assert f"350,000,000 fp32 parameters in {buckets} buckets of 25 MB, 16 ranks; link 1 Gbit/s" in text
    rows = {tuple(line.split()[:2]) for line in text.splitlines()}
    assert {("none", "dense"), ("bf16", "dense"), ("int8", "two_phase"), ("int4", "allgather")} <= rows
    assert f"auto picks: int4 (two_phase) for {buckets} buckets" in text
    # A faster link given on the command line replaces the profile's.
    assert cli.main([*argv, "--bandwidth", "400gbit", "--latency", "5us"]) == 0
    assert "link 400 Gbit/s per rank, 5 us a ring step" in capsys.readouterr().out
    # bf16 gradients: twice the elements a bucket, half the bytes dense, and no cast to bf16.
    assert cli.main([*argv, "--dtype", "bf16"]) == 0
    text = capsys.readouterr().out
    buckets = -(-350_000_000 // (2 * BUCKET))
    assert f"350,000,000 bf16 parameters in {buckets} buckets of 25 MB, 16 ranks" in text
    rows = {tuple(line.split()[:3]) for line in text.splitlines()}
    # A ring's bytes, and each bucket's all-reduce of its fingerprint's 64 lanes (2 bytes each).
    dense = 2 * 350_000_000 * 15 / 16 * 2 + buckets * 2 * 15 * 64 * 2 // 16
    assert ("none", "dense", f"{dense / 1e6:.4g}") in rows
    assert not any(row[0] == "bf16" for row in rows) and "auto picks: int4" in text
    assert cli.main(["plan", "--dtype", "bf16"]) == 2 and "--dtype needs --params" in capsys.readouterr().err


def test_plan_on_nodes_weighs_hierarchical_with_the_link_inside_a_node(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(GBIT).save(path)
    argv = ["plan", "--params", "350M", "--world", "16", "--profile", str(path), "--node-size", "8"]
    # 1 Gbit/s between nodes, NVLink-like inside: the shard's int4 between nodes wins.
    assert cli.main([*argv, "--intra-bandwidth", "7200gbit", "--intra-latency", "5us"]) == 0
    text = capsys.readouterr().out
    assert "nodes of 8 ranks: inside one 7.2e+03 Gbit/s per rank, 5 us a ring step" in text
    rows = {tuple(line.split()[:2]) for line in text.splitlines()}
    expected = {("int8", "two_phase"), ("int4", "hierarchical(two_phase)"), ("bf16", "hierarchical(dense)")}
    assert expected <= rows
    assert ("none", "hierarchical(dense)") not in rows
    buckets = 350_000_000 // BUCKET + 1
    assert f"auto picks: int4 (hierarchical(allgather)) for {buckets} buckets" in text
    # Inside a node no faster than between nodes (the profile's own 1 Gbit/s): flat.
    assert cli.main(argv) == 0
    assert f"auto picks: int4 (two_phase) for {buckets} buckets" in capsys.readouterr().out
    assert cli.main([*argv[:-1], "5"]) == 2
    assert "--node-size 5 does not divide 16 ranks" in capsys.readouterr().err
    assert cli.main([*argv[:-2], "--intra-bandwidth", "1gbit"]) == 2
    assert "need --node-size" in capsys.readouterr().err
    assert cli.main(["plan", "--node-size", "2"]) == 2 and "needs --params" in capsys.readouterr().err
    # A profile probed on nodes plans flat unless --node-size says where they are.
    dataclasses.replace(profile(GBIT), nodes=two_nodes(GBIT)).save(path)
    assert cli.main(argv[:-2]) == 0 and "hierarchical" not in capsys.readouterr().out


def test_plan_refuses_what_it_cannot_model(tmp_path, capsys):
    path = tmp_path / "profile.json"
    profile(GBIT).save(path)
    argv = ["plan", "--params", "1M", "--world", "4", "--profile", str(path)]
    assert cli.main([*argv, "--allow", "ternary"]) == 2
    assert "no measurement of 'ternary'" in capsys.readouterr().err
    assert cli.main([*argv, "--allow", "powersgd"]) == 2
    assert "low-rank" in capsys.readouterr().err
    assert cli.main([*argv[:-1], str(tmp_path / "missing.json")]) == 2
    # Files that are not profiles: refused, naming the file and what is wrong.
    good = profile(GBIT).to_json()
    no_rate = json.loads(json.dumps(good))
    del no_rate["codecs"]["int8"]["encode"]["rate"]
    bad = {
        "{}": "not a gradcomp profile: no 'codecs'",
        "[1, 2]": "not a gradcomp profile: a JSON list, not an object",
        "{bad": "not JSON (Expecting property name",
        json.dumps(
            no_rate
        ): "not a gradcomp profile: Linear.__init__() missing 1 required positional argument: 'rate'",
    }
    for where, value, said in (
        (("codecs", "int8", "encode", "rate"), 0, "codecs.int8.encode.rate must be positive, got 0"),
        (("link", "bandwidth"), -5, "link.bandwidth must be positive, got -5"),
        (("link", "latency"), "fast", "not a gradcomp profile: link.latency is 'fast', not a finite number"),
        (("world_size",), 0, "not a gradcomp profile: world_size is 0, not a positive integer"),
    ):
        changed = json.loads(json.dumps(good))
        inner = changed
        for key in where[:-1]:
            inner = inner[key]
        inner[where[-1]] = value
        bad[json.dumps(changed)] = said
    for text, said in bad.items():
        (tmp_path / "bad.json").write_text(text)
        assert cli.main([*argv[:-1], str(tmp_path / "bad.json")]) == 2
        assert f"gradcomp plan: {tmp_path / 'bad.json'}: {said}" in capsys.readouterr().err
    # Options that are not numbers the model can use, and empty lists.
    for option, value in (
        ("--bucket-mb", "nan"),
        ("--bucket-mb", "inf"),
        ("--bucket-mb", "0"),
        ("--compute-ms", "0"),
    ):
        with pytest.raises(SystemExit):
            cli.main([*argv, option, value])
        assert "must be a positive finite number" in capsys.readouterr().err
    assert cli.main([*argv, "--allow", ""]) == 2 and "allow names no candidate" in capsys.readouterr().err
    assert cli.main(["plan", "--compressors", "bogus"]) == 2
    assert "unknown compressor 'bogus'" in capsys.readouterr().err
    assert cli.main(["plan", "--compressors", ","]) == 2
    assert "--compressors names no compressor" in capsys.readouterr().err
    assert cli.main(["plan", "--params", "0.4", "--profile", str(path)]) == 2
    assert "--params must be at least 1" in capsys.readouterr().err
    assert cli.main(["plan", "--world", "8"]) == 2 and "--world needs --params" in capsys.readouterr().err
    assert (
        cli.main(["probe", "--compressors", "int8,powersgd"]) == 2 and "low-rank" in capsys.readouterr().err
    )
    with pytest.raises(SystemExit):
        cli.main(["plan", "--params", "-3"])


def test_the_stored_cpu_profile_loads_and_plans():
    stored = planner.Profile.load(planner.STORED / "cpu.json")
    if not torch.cuda.is_available():  # the default on a machine without a GPU
        assert planner.Profile.load() == stored
    assert set(planner.SAFE) - {"none"} <= set(stored.codecs)
    # Measured with the transport's CPU time (not a pingpong's: no algorithm runs on it).
    fits = (stored.link, stored.links["all_gather"], stored.links["all_to_all"])
    assert all(link.cpu_seconds_per_byte > 1e-12 for link in fits)
    plan = planner.best_plan([BUCKET, 1024], 16, stored.with_link(GBIT))
    assert plan[0].compressor in ("int8", "int4") and plan[1].compressor in ("none", "bf16")
