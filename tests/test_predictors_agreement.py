"""``aserve predictor agree``: how often two label runs of the same prompts agree."""
import json

import pytest

from aserve.commands import main
from predictors.agreement import label_agreement
from predictors.dataset import Label


def labels(lengths: dict, cap=512):
    return [Label(i, 10, (n,), cap) for i, n in lengths.items()]


def test_agreement_counts_buckets_on_shared_ids():
    a = labels({"x": 50, "y": 150, "z": 512, "w": 420, "only_a": 7})
    b = labels({"x": 60, "y": 250, "z": 512, "w": 512, "only_b": 9})
    r = label_agreement(a, b, [100, 200, 400])
    assert (r["n"], r["only_in_a"], r["only_in_b"], r["cap"]) == (4, 1, 1, 512)
    assert r["identical_length"] == 0.25  # z only
    assert r["mae_tokens"] == round((10 + 100 + 0 + 92) / 4, 1)
    assert r["at_cap"] == {"a": 0.25, "b": 0.5, "both": 0.25}
    g = r["granularities"]
    # g 100: buckets 0..5 (the last holds 500-512): x 0/0, y 1/2, z 5/5, w 4/5
    assert g["100"] == {"same_bucket": 0.5, "within_one_bucket": 1.0, "num_buckets": 6}
    # g 200: 0/0, 0/1, 2/2, 2/2
    assert g["200"]["same_bucket"] == 0.75 and g["200"]["num_buckets"] == 3
    # g 400: 0/0, 0/0, 1/1, 1/1
    assert g["400"]["same_bucket"] == 1.0


def test_agreement_cuts_both_runs_at_the_lower_cap():
    a = labels({"x": 300, "y": 900}, cap=1024)
    b = labels({"x": 256, "y": 256}, cap=256)  # both at b's cap
    r = label_agreement(a, b, [100])
    assert r["cap"] == 256 and r["identical_length"] == 1.0 and r["at_cap"]["both"] == 1.0


def test_agreement_refuses_disjoint_runs_and_uncapped_labels():
    with pytest.raises(ValueError, match="share no prompt id"):
        label_agreement(labels({"x": 1}), labels({"y": 1}), [100])
    with pytest.raises(ValueError, match="field 'max_tokens'"):
        label_agreement(labels({"x": 1}, cap=None), labels({"x": 1}), [100])


def write(path, rows):
    path.write_text("".join(json.dumps({"id": i, "prompt_tokens": 5, "output_tokens": [n], "max_tokens": 512}) + "\n"
                            for i, n in rows.items()))
    return path


def test_agree_command_writes_json_and_names_bad_fields(tmp_path, capsys):
    a = write(tmp_path / "a.jsonl", {"x": 10, "y": 300, "z": 512})
    b = write(tmp_path / "b.jsonl", {"x": 10, "y": 512, "z": 512})
    assert main(["predictor", "agree", str(a), str(b), "--json", str(tmp_path / "r.json")]) == 0
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["labels_a"] == str(a) and r["n"] == 3 and set(r["granularities"]) == {"100", "200", "400"}
    assert r["granularities"]["400"]["same_bucket"] == round(2 / 3, 4)
    assert "at the cap: 33.3% of run A, 66.7% of run B" in capsys.readouterr().out
    assert main(["predictor", "agree", str(a), str(tmp_path / "nope.jsonl")]) == 2
    assert "field 'labels_b'" in capsys.readouterr().err
    assert main(["predictor", "agree", str(a), str(b), "--granularities", "0"]) == 2
    assert "field 'granularities'" in capsys.readouterr().err
