"""``serve`` never defaults to ``oracle`` (issue 25, target 4): an API request has no true length.
Without ``--predictor`` it runs ``SERVE_PREDICTOR`` where that can load or fit, else ``none``, and
says which and why; replays keep the oracle (a trace knows every length)."""
from pathlib import Path

import pytest

from aserve.commands import build_parser
from aserve.commands.common import cluster_config
from aserve.commands.serve_predictor import SERVE_PREDICTOR, WHY, serve_predictor
from predictors.dataset import DEFAULT_LABELS, DEFAULT_PROMPTS, labelling_order, load_prompts
from predictors.synthetic import write_synthetic_labels
from predictors.train import prepare


def serve(*flags):
    return build_parser().parse_args(["serve", "--chunk-size", "64", *flags])


def choose(*flags):
    return serve_predictor(serve(*flags), {})


def test_the_default_is_never_the_oracle():
    assert SERVE_PREDICTOR not in ("oracle", "none", "accuracy")
    assert build_parser().parse_args(["replay", "t.jsonl"]).predictor == "oracle"  # a trace knows the lengths
    assert serve("--predictor", "oracle").predictor == "oracle"  # asked for: allowed
    assert choose("--predictor", "lm") == ("lm", "--predictor")


@pytest.mark.skipif(not (Path(DEFAULT_PROMPTS).is_file() and Path(DEFAULT_LABELS).is_file()),
                    reason="needs the shared prompt pool and the committed labels")
def test_default_where_it_can_fit_and_the_config_follows(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # no artefact: it fits at start-up (prompts and labels here)
    assert choose() == (SERVE_PREDICTOR, WHY)
    assert cluster_config(serve()).predictor == SERVE_PREDICTOR


def test_none_with_the_reason_when_it_cannot_load_or_fit(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    name, why = choose("--predictor-labels", str(tmp_path / "absent.jsonl"))
    assert name == "none" and "absent.jsonl" in why and "aserve predictor prepare" in why
    assert cluster_config(serve("--predictor-labels", str(tmp_path / "absent.jsonl"))).predictor == "none"


@pytest.mark.skipif(not Path(DEFAULT_PROMPTS).is_file(), reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
def test_a_trained_artefact_serves_without_the_prompts(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    labels = write_synthetic_labels(labelling_order(load_prompts())[:60], tmp_path / "labels.jsonl")
    absent = str(tmp_path / "no-prompts.jsonl")
    flags = ("--predictor-labels", str(labels), "--predictor-prompts", absent)
    assert choose(*flags)[0] == "none"  # nothing trained, nothing to fit on
    prepare([SERVE_PREDICTOR], [200], labels)
    assert choose(*flags) == (SERVE_PREDICTOR, WHY)  # 'predictor prepare' made it loadable
