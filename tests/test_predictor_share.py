"""Each backend's share of the oracle's scheduling gain (issue 25, target 1): the arithmetic,
the grid of replays ``aserve predictor share`` runs (every one a command the CLI accepts), its
resume, and the summary over seeds, on hand-written replay reports."""
import json
import statistics

import pytest

from aserve.commands import build_parser
from aserve.replay.share import ShareStudy, share, spread


def test_share_arithmetic():
    assert share(10.0, 8.0, 6.0) == 0.5  # half the oracle's 4 s
    assert share(10.0, 6.0, 6.0) == 1.0 and share(10.0, 10.0, 6.0) == 0.0
    assert share(10.0, 12.0, 6.0) == -0.5  # worse than not predicting
    assert share(10.0, 5.0, 6.0) == 1.25  # better than the oracle (it happens: docs/notes/predictors.md)
    assert share(10.0, 8.0, 10.0) is None and share(10.0, 8.0, 11.0) is None  # the oracle gained nothing


def test_spread_over_seeds():
    s = spread([0.5, 0.7, None, 0.9])
    assert s["n"] == 3 and s["mean"] == pytest.approx(0.7) and s["min"] == 0.5 and s["max"] == 0.9
    assert s["std"] == pytest.approx(statistics.stdev([0.5, 0.7, 0.9]))
    assert spread([0.4])["std"] == 0.0 and spread([None])["mean"] is None


def report(path, name, jct):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"systems": {name: {"jct": {"mean": jct}, "normalized_latency": {"mean": jct / 100}}}}))


def test_summary_from_replay_reports(tmp_path):
    study = ShareStudy(tmp_path, backends=("sklearn", "lm"), policies=("reserve-dynamic",), seeds=(0, 1, 2))
    jcts = {0: dict(none=20, oracle=10, sklearn=15, lm=18), 1: dict(none=30, oracle=20, sklearn=21, lm=35),
            2: dict(none=25, oracle=25, sklearn=20, lm=20)}  # seed 2: the oracle gained nothing
    for seed, row in jcts.items():
        report(study.result(seed, "none"), "none", row["none"])
        for b in ("oracle", "sklearn", "lm"):
            report(study.result(seed, f"reserve-dynamic-{b}"), f"reserve-dynamic-{b}", row[b])
    rows = study.summarize()["policies"]["reserve-dynamic"]
    assert rows["sklearn"]["per_seed"] == {"0": 0.5, "1": 0.9, "2": None}
    assert rows["sklearn"]["n"] == 2 and rows["sklearn"]["mean"] == pytest.approx(0.7)
    assert rows["lm"]["per_seed"]["1"] == -0.5 and rows["lm"]["mean"] == pytest.approx((0.2 - 0.5) / 2)
    means = study.summarize()["means"]
    assert means["none"] == {"0": 20, "1": 30, "2": 25} and means["reserve-dynamic-lm"]["1"] == 35
    assert ShareStudy(tmp_path, backends=("sklearn",), policies=("reserve-dynamic",), seeds=(0,),
                      metric="normalized_latency").summarize()["policies"]["reserve-dynamic"]["sklearn"]["mean"] == \
        pytest.approx(0.5)
    missing = ShareStudy(tmp_path, backends=("sklearn",), policies=("reserve-static",), seeds=(0,)).summarize()
    assert missing["policies"]["reserve-static"]["sklearn"] == {"per_seed": {}, "n": 0, "mean": None, "std": None,
                                                                "min": None, "max": None}


def test_every_replay_is_a_command_the_cli_takes(tmp_path):
    study = ShareStudy(tmp_path, backends=("sklearn", "lm"), seeds=(0, 1), system_args="--kv-cache-gb 0.1",
                       replay_args="--chat", trace_args="--num-requests 8")
    steps = study.commands(["aserve"])
    assert len(steps) == 2 * (1 + 1 + 2 * 3)  # per seed: a trace, none, and oracle + 2 backends per policy
    parser = build_parser()
    seen = set()
    for path, argv in steps:
        a = parser.parse_args(argv[1:])
        if argv[1] == "predictor":
            assert a.out == str(path) and a.num_requests == 8
            continue
        assert a.json == str(path) and a.dispatch == "interference" and a.kv_cache_gb == 0.1 and a.chat
        seen.add((a.seed, a.decode_policy, a.predictor))
    assert (0, "greedy", "none") in seen and (1, "reserve-static", "oracle") in seen
    assert (1, "reserve-dynamic", "lm") in seen and len(seen) == 2 * 7


def test_dry_run_prints_what_is_missing_only(tmp_path, capsys):
    def dry():
        a = build_parser().parse_args(["predictor", "share", "--out", str(tmp_path), "--seeds", "0",
                                       "--backends", "sklearn", "--dry-run"])
        assert a.func(a) == 0
        return capsys.readouterr().out.splitlines()

    assert len(dry()) == 1 + 1 + 2 * 2
    report(tmp_path / "s0" / "none.json", "none", 1.0)  # done: a resumed study does not run it again
    lines = dry()
    assert len(lines) == 5 and not any("--name none " in x for x in lines)
    assert not list(tmp_path.glob("*.jsonl"))  # nothing ran


def test_bad_studies_name_the_field(tmp_path):
    with pytest.raises(ValueError, match="field 'policies'"):
        ShareStudy(tmp_path, policies=("greedy",))
    with pytest.raises(ValueError, match="field 'backends'"):
        ShareStudy(tmp_path, backends=("oracle",))
    with pytest.raises(ValueError, match="field 'seeds'"):
        ShareStudy(tmp_path, seeds=(1, 1))
