"""Sampled labels (issue 25, target 2): every sample's length is kept, old label files still load,
a trace takes one sample per request, training can use the samples, and the prompt-only ceiling
and a backend's share of it match what is computed here by hand."""
import json
from pathlib import Path
from typing import Optional

import pytest

from aserve.commands import build_parser
from predictors.base import Buckets
from predictors.dataset import DEFAULT_PROMPTS, Example, is_test, labelling_order, load_prompts, read_labels
from predictors.samples import (fresh_sample_accuracy, heldout_ceiling, modal_buckets, pick_length,
                                training_rows)
from predictors.synthetic import approx_tokens, synthetic_length

A, B, C = [50, 60, 150], [250, 260, 270, 510], [700]


def run(*argv):
    args = build_parser().parse_args([str(a) for a in argv])
    return args.func(args)


def write_labels(path: Path, rows: dict, cap: int = 1024, prompt_tokens: Optional[dict] = None) -> Path:
    with path.open("w") as f:
        for pid, lengths in rows.items():
            f.write(json.dumps({"id": pid, "prompt_tokens": (prompt_tokens or {}).get(pid, 9), "output_tokens": lengths,
                                "max_tokens": cap}) + "\n")
    return path


def test_ceiling_by_hand():
    # g 100. A's buckets 0 0 1: holding out either 0 leaves a tie {0, 1} (a fair draw: 1/2 each),
    # holding out the 1 leaves mode 0 (a miss): 1/3. B's 2 2 2 5: the three 2s are hits, the 5
    # a miss: 3/4. C has one sample: skipped. Ceiling (1/3 + 3/4) / 2 = 13/24.
    out = heldout_ceiling([A, B, C], Buckets(100, 1024))
    assert out == {"ceiling": round(13 / 24, 4), "n": 2, "single": 1}
    # g 400: A is 0 0 0 (1), B is 0 0 0 1 (3/4)
    assert heldout_ceiling([A, B, C], Buckets(400, 1024))["ceiling"] == round((1 + 0.75) / 2, 4)
    assert heldout_ceiling([C], Buckets(100, 1024))["ceiling"] is None
    assert modal_buckets([3, 1, 3, 1, 2]) == [1, 3]


def test_fresh_sample_accuracy_by_hand():
    # predicting bucket 0 for A holds 2 of its 3 samples, bucket 2 for B 3 of 4: (2/3 + 3/4) / 2
    assert fresh_sample_accuracy([0, 2], [A, B], Buckets(100, 1024)) == round(17 / 24, 4)
    with pytest.raises(ValueError, match="one prediction per prompt"):
        fresh_sample_accuracy([0], [A, B], Buckets(100, 1024))


def test_training_rows_from_samples():
    e = Example("a", "p", 3, 60, lengths=(50, 60, 150))
    tie = Example("t", "p", 3, 100, lengths=(50, 150))
    g100 = Buckets(100, 1024)
    assert training_rows([e], "median", g100) == [e]
    assert [r.length for r in training_rows([e], "samples", g100)] == [50, 60, 150]
    assert [r.length for r in training_rows([e, tie], "mode", g100)] == [55, 50]  # a tie: the lower bucket
    with pytest.raises(ValueError, match="field 'targets'"):
        training_rows([e], "mean", g100)


def test_old_single_sample_files_still_load(tmp_path):
    old = tmp_path / "old.jsonl"  # the format before samples mattered: one length, no 'lengths' anywhere
    old.write_text(json.dumps({"id": "x", "prompt_tokens": 5, "output_tokens": [212], "max_tokens": 512}) + "\n")
    (label,) = read_labels(old)
    assert label.length == 212 and label.lengths == (212,)
    assert Example("x", "p", 5, 212).lengths == (212,)


def test_pick_length_is_one_seeded_sample():
    e = Example("q1", "p", 3, 300, lengths=(100, 300, 900))
    assert pick_length(e, "median", 0) == 300
    picks = {pick_length(e, "sample", s) for s in range(30)}
    assert picks == {100, 300, 900}  # every sample can be drawn ...
    assert pick_length(e, "sample", 7) == pick_length(e, "sample", 7)  # ... by the seed alone
    with pytest.raises(ValueError, match="field 'length'"):
        pick_length(e, "mean", 0)


def test_ceiling_command_on_a_hand_made_file(tmp_path, capsys):
    labels = write_labels(tmp_path / "sampled.jsonl", {"A": A, "B": B, "C": C})
    assert run("predictor", "ceiling", labels, "--granularity", "100,400", "--json", tmp_path / "c.json") == 0
    report = json.loads((tmp_path / "c.json").read_text())
    assert report["samples_per_prompt"] == {"min": 1, "mean": 2.67, "max": 4} and report["cap"] == 1024
    assert report["granularities"]["100"]["ceiling"] == round(13 / 24, 4)
    assert report["granularities"]["400"]["ceiling"] == 0.875
    assert json.loads(capsys.readouterr().out)["100"]["ceiling"] == round(13 / 24, 4)


@pytest.fixture()
def sampled(tmp_path, monkeypatch):
    """Four samples a prompt around a learnable length (synthetic: never for measurements)."""
    if not Path(DEFAULT_PROMPTS).is_file():
        pytest.skip(f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    pool = labelling_order(load_prompts())[:200]
    rows = {p.id: [max(1, min(1024, int(synthetic_length(p) * f))) for f in (0.7, 0.9, 1.1, 1.4)] for p in pool}
    return write_labels(tmp_path / "sampled.jsonl", rows, prompt_tokens={p.id: approx_tokens(p.prompt) for p in pool})


def test_backend_share_of_the_ceiling(sampled, tmp_path):
    assert run("predictor", "ceiling", sampled, "--granularity", "200", "--backends", "sklearn",
               "--json", tmp_path / "c.json") == 0
    r = json.loads((tmp_path / "c.json").read_text())["granularities"]["200"]
    test = [lab.lengths for lab in read_labels(sampled) if is_test(lab.id)]
    assert r["test"] == {"ceiling": heldout_ceiling(test, Buckets(200, 1024))["ceiling"], "n": len(test)}
    sk = r["backends"]["sklearn"]
    assert sk["of_ceiling"] == pytest.approx(sk["fresh_sample_accuracy"] / r["test"]["ceiling"], abs=1e-3)
    assert sk["trained"].startswith("fitted") and "-tsamples" in sk["trained"]
    assert sk["fresh_sample_accuracy"] > r["majority"]["fresh_sample_accuracy"]  # it learnt something


def test_train_on_samples_and_a_trace_of_one_sample_each(sampled, tmp_path, capsys):
    assert run("predictor", "train", "--backend", "sklearn", "--labels", sampled, "--targets", "samples") == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["targets"] == "samples" and summary["n_rows"] == 4 * summary["n_train"]
    assert summary["path"].endswith("-tsamples")
    by_id = {lab.id: lab for lab in read_labels(sampled)}
    for how in ("sample", "median"):
        out = tmp_path / f"{how}.jsonl"
        assert run("predictor", "trace", "--labels", sampled, "--out", out, "--num-requests", 20,
                   "--length", how) == 0
        rows = [json.loads(x) for x in out.read_text().splitlines()]
        if how == "median":
            assert all(r["output_tokens"] == by_id[r["id"]].length for r in rows)
        else:
            assert all(r["output_tokens"] in by_id[r["id"]].lengths for r in rows)
            assert any(r["output_tokens"] != by_id[r["id"]].length for r in rows)  # not the median every time
