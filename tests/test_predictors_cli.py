"""``aserve predictor train|eval`` and ``aserve label`` as the command line registers them."""
import json
from pathlib import Path

import pytest

from aserve.commands import build_parser
from predictors.dataset import DEFAULT_PROMPTS, labelling_order, load_prompts
from predictors.synthetic import write_synthetic_labels

pytestmark = pytest.mark.skipif(not Path(DEFAULT_PROMPTS).is_file(),
                                reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")


def parser():
    return build_parser()


def run(*argv):
    args = parser().parse_args([str(a) for a in argv])
    return args.func(args)


@pytest.fixture(scope="module")
def labels(tmp_path_factory):
    return write_synthetic_labels(labelling_order(load_prompts())[:300], tmp_path_factory.mktemp("l") / "labels.jsonl")


@pytest.mark.long
def test_train_then_eval_writes_the_report(labels, tmp_path, capsys):
    out = tmp_path / "model"
    assert run("predictor", "train", "--backend", "sklearn", "--granularity", 200, "--labels", labels,
               "--out", out / "g200") == 0
    assert json.loads(capsys.readouterr().out)["n_train"] > 200 and (out / "g200" / "meta.json").is_file()
    report_path = tmp_path / "eval.json"
    assert run("predictor", "eval", "--backend", "sklearn", "--json", report_path, "--labels", labels,
               "--model-dir", out, "--granularities", "100,200", "--latency-samples", 10) == 0
    report = json.loads(report_path.read_text())
    assert report["backend"] == "sklearn" and set(report["granularities"]) == {"100", "200"}
    g200 = report["granularities"]["200"]
    assert g200["trained"].startswith("loaded") and report["granularities"]["100"]["trained"].startswith("fitted")
    for key in ("accuracy", "majority_accuracy", "mae_tokens", "latency_ms_p50", "latency_ms_p99",
                "latency_ms_batch", "memory_mb", "n"):
        assert key in g200, key
    assert g200["accuracy"] > g200["majority_accuracy"]
    # the served model's prefill, alone and beside the predictor's thread, once (at g 200)
    overlap = report["prefill_overlap"]
    assert overlap["chunk"] == 512 and overlap["alone_ms"] > 0 and overlap["predictions_meanwhile"] > 0
    assert overlap["slowdown"] == pytest.approx(overlap["with_predictor_ms"] / overlap["alone_ms"], rel=1e-2)


def test_eval_oracle_is_perfect(labels, tmp_path):
    assert run("predictor", "eval", "--backend", "oracle", "--json", tmp_path / "o.json", "--labels", labels,
               "--latency-samples", 10) == 0
    report = json.loads((tmp_path / "o.json").read_text())
    assert [r["accuracy"] for r in report["granularities"].values()] == [1.0, 1.0, 1.0]
    assert report["prefill_overlap"] is None  # answered inline: the server runs it on no thread


def test_cli_errors_name_the_field(labels, tmp_path):
    with pytest.raises(FileNotFoundError, match="field 'labels'"):
        run("predictor", "eval", "--backend", "none", "--json", tmp_path / "x.json", "--labels", tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="field 'prompts'"):
        run("predictor", "train", "--backend", "sklearn", "--labels", labels, "--prompts", tmp_path / "nope")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "ghost", "prompt_tokens": 3, "output_tokens": [5]}) + "\n")
    with pytest.raises(ValueError, match="field 'id'.*do not match"):
        run("predictor", "train", "--backend", "sklearn", "--labels", bad)
    with pytest.raises(ValueError, match="field 'granularities'"):
        run("predictor", "eval", "--backend", "none", "--json", tmp_path / "x.json", "--labels", labels,
            "--granularities", "a,b")
    with pytest.raises(SystemExit):  # argparse: an unknown backend is a usage error
        run("predictor", "train", "--backend", "psychic")


def test_label_command_is_registered():
    args = parser().parse_args(["label", "--limit", "5", "--max-tokens", "8", "--threads", "1"])
    assert args.limit == 5 and args.max_tokens == 8 and callable(args.func)


def test_trace_writes_held_out_prompts_with_their_labelled_lengths(labels, tmp_path):
    from aserve.replay.trace_formats import read_aserve
    from predictors.dataset import is_test, read_labels

    out = tmp_path / "heldout.jsonl"
    assert run("predictor", "trace", "--labels", labels, "--out", out, "--num-requests", 20, "--rate", 4) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    truth = {lab.id: lab.length for lab in read_labels(labels)}
    prompts = {p.id: p.prompt for p in load_prompts()}
    assert len(rows) == 20 and len({r["id"] for r in rows}) == 20
    assert all(is_test(r["id"]) and r["output_tokens"] == truth[r["id"]] and r["prompt"] == prompts[r["id"]]
               for r in rows)
    times = [r["timestamp"] for r in rows]
    assert times == sorted(times) and times[0] == 0 and 1 < times[-1] < 20  # about 19 gaps of 0.25 s
    trace = read_aserve(out, lambda text: len(text.split()))  # the replay reads it back, text and all
    assert [r.output_tokens for r in trace.requests] == [r["output_tokens"] for r in rows]
    assert all(r.prompt_text for r in trace.requests)


def test_trace_refuses_more_requests_than_the_test_split_has(labels, tmp_path):
    with pytest.raises(ValueError, match="--num-requests 5000: only"):
        run("predictor", "trace", "--labels", labels, "--out", tmp_path / "t.jsonl", "--num-requests", 5000)
