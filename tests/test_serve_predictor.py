"""``serve`` never defaults to ``oracle`` (issue 25, target 4): an API request has no true length.
Without ``--predictor`` it runs ``SERVE_PREDICTOR`` where that can load or fit, else ``none``, and
says which and why. Replays run the same (issue 54); on a simulated device the set-accuracy
predictor at that backend's measured accuracy."""
from pathlib import Path

import pytest

from aserve.commands import build_parser
from aserve.commands.common import cluster_config
from aserve.commands.replay import predictor_lines
from aserve.commands.serve_predictor import SERVE_PREDICTOR, WHY, default_predictor, serve_predictor
from predictors.dataset import DEFAULT_LABELS, DEFAULT_PROMPTS, labelling_order, load_prompts
from predictors.synthetic import write_synthetic_labels
from predictors.train import prepare


def serve(*flags):
    return build_parser().parse_args(["serve", "--chunk-size", "64", *flags])


def choose(*flags):
    return serve_predictor(serve(*flags), {})


def test_the_default_is_never_the_oracle():
    assert SERVE_PREDICTOR not in ("oracle", "none", "accuracy")
    assert serve("--predictor", "oracle").predictor == "oracle"  # asked for: allowed
    assert choose("--predictor", "lm") == ("lm", "--predictor")


def replay(*flags):
    return build_parser().parse_args(["replay", "t.jsonl", "--chunk-size", "64", *flags])


def test_a_replay_runs_what_serve_runs_and_a_simulation_the_shipped_accuracy(tmp_path, monkeypatch):
    """Issue 54: a trace knows every length, a served request none; a replay measures the server a
    user can run. A sim: device runs no backend: its predictor is as right as the shipped one."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = replay()
    assert a.predictor is None and default_predictor(a, {})[0] == serve_predictor(a, {})[0]
    assert default_predictor(replay("--predictor", "oracle"), {}) == ("oracle", {}, "--predictor")
    name, options, why = default_predictor(replay("--device", "sim:opt-13b-v100-32gb"), {})
    assert (name, options) == ("accuracy", {"accuracy": 0.6569}) and "65.7%" in why
    # an accuracy the user sets is kept; the backend stays the set-accuracy one
    sim = replay("--device", "sim:opt-13b-v100-32gb", "--predictor-option", "accuracy=0.9")
    assert cluster_config(sim).predictor_options == (("accuracy", 0.9),) or \
        dict(cluster_config(sim).predictor_options) == {"accuracy": 0.9}
    assert predictor_lines([("a", sim), ("b", sim)])[0].startswith("a, b: predictor accuracy 90.0%")
    oracle = replay("--device", "sim:opt-13b-v100-32gb", "--predictor", "oracle")
    assert cluster_config(oracle).predictor == "oracle"


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
