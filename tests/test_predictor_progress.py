"""No silent first-use training (issue 25, target 5): a fit says what it fits on and where it
saves, a backbone pass shows progress with an ETA on a stderr that is not a terminal (a log, CI,
this capture), the second use loads what the first saved, and ``predictor prepare`` trains ahead."""
import io
import json
from pathlib import Path

import numpy as np
import pytest

from aserve.commands import build_parser
from predictors.dataset import DEFAULT_PROMPTS, labelling_order, load_prompts
from predictors.features_cache import FeatureCache
from predictors.progress import StepProgress
from predictors.serving import load_for_serving
from predictors.synthetic import write_synthetic_labels
from predictors.train import TrainConfig, artefact_dir, train_predictor

needs_pool = pytest.mark.skipif(not Path(DEFAULT_PROMPTS).is_file(),
                                reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_plain_lines_every_tenth_with_an_eta():
    out, clock = io.StringIO(), FakeClock()
    with StepProgress("lm: backbone features", 200, stream=out, clock=clock) as p:
        for _ in range(100):  # 2 items a second
            clock.now += 1.0
            p.advance(2)
            if p.done == 50:
                assert p.eta_s() == pytest.approx(75.0)  # 25 s for 50, 150 left
    lines = out.getvalue().splitlines()
    assert lines[0] == "lm: backbone features 0/200 (0%), starting"
    assert lines[1] == "lm: backbone features 20/200 (10%), 10 s elapsed, ETA 90 s"
    assert lines[-1] == "lm: backbone features 200/200 (100%), 100 s elapsed, ETA 0 s"
    assert len(lines) == 11  # the start and one a tenth: a log gets a line, not a flood


def test_nothing_to_do_prints_nothing():
    out = io.StringIO()
    with StepProgress("x", 0, stream=out):
        pass
    assert out.getvalue() == ""


def test_feature_cache_shows_progress_for_a_long_pass_only(tmp_path, capsys):
    def compute(texts):
        return np.ones((len(texts), 4), np.float32)

    cache = FeatureCache(tmp_path, {"backbone": "b"}, name="lm")
    cache.get([f"t{i}" for i in range(70)], compute)
    err = capsys.readouterr().err
    assert "lm: backbone features 0/70 (0%), starting" in err and "70/70 (100%)" in err and "ETA" in err
    cache.get([f"t{i}" for i in range(75)], compute)  # 5 missing: seconds at most, no progress
    assert capsys.readouterr().err == ""
    assert FeatureCache(tmp_path, {"backbone": "b"}).get(["t74"], compute).shape == (1, 4)  # saved at the end


@pytest.fixture()
def labels(tmp_path, monkeypatch):
    """A small synthetic label file and a private artefact cache."""
    if not Path(DEFAULT_PROMPTS).is_file():
        pytest.skip(f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return write_synthetic_labels(labelling_order(load_prompts())[:60], tmp_path / "labels_small.jsonl")


def test_first_use_fit_says_what_and_where_then_the_second_loads(labels, capsys):
    first = load_for_serving("sklearn", 200, labels=labels)
    err = capsys.readouterr().err
    where = artefact_dir("sklearn", 200, labels)
    assert "fitting one now" in err and "predictor prepare" in err
    assert "prompts, the train split of" in err and str(labels) in err and f"saved to {where}" in err
    second = load_for_serving("sklearn", 200, labels=labels)
    err = capsys.readouterr().err
    assert "fitting" not in err and f"loaded from {where}" in err
    assert type(second) is type(first)


def test_prepare_trains_ahead_and_keeps_what_is_there(labels, capsys):
    def prepare(*extra):
        args = build_parser().parse_args(["predictor", "prepare", "--backends", "sklearn", "--granularities", "100,200",
                                          "--labels", str(labels), *extra])
        assert args.func(args) == 0
        return json.loads(capsys.readouterr().out)

    rows = prepare()
    assert [(r["backend"], r["granularity"]) for r in rows] == [("sklearn", 100), ("sklearn", 200)]
    assert all(isinstance(r["fit_seconds"], float) and Path(r["path"], "meta.json").is_file() for r in rows)
    assert [r["fit_seconds"] for r in prepare()] == ["present", "present"]
    load_for_serving("sklearn", 100, labels=labels)  # what serve then does: loads, fits nothing
    assert "loaded from" in capsys.readouterr().err
    with pytest.raises(ValueError, match="field 'backends'"):
        prepare("--backends", "oracle")


@needs_pool
def test_lm_fit_shows_the_backbone_pass_with_an_eta(tmp_path, capsys):
    """The real ``lm`` backbone (SmolLM2's first layers) over 40 prompts: the pass that took 766 s
    on 8,428 prompts with nothing on screen now reports as it goes."""
    labels = write_synthetic_labels(labelling_order(load_prompts())[:50], tmp_path / "labels.jsonl")
    cfg = TrainConfig("lm", 200, labels, out=tmp_path / "lm", options={"cache_dir": str(tmp_path), "num_layers": 4,
                                                                         "epochs": 2})
    _, out, summary = train_predictor(cfg)
    err = capsys.readouterr().err
    n = summary["n_train"]
    assert f"fitting the lm length predictor (granularity 200) on {n} prompts" in err
    assert f"lm: backbone features {n}/{n} (100%)" in err and "ETA" in err and f"saved to {out}" in err
    assert list((tmp_path / "features").glob("*.npz"))  # the features are cached: another head costs no pass
