"""The learned backends on real prompts with synthetic-but-learnable lengths.

Real prompts come from the shared prompt pool; their lengths come from
``predictors.synthetic`` (rules of the kind a chat model's lengths follow), so each backend has
a signal to find and must beat always answering the most common bucket.
"""
from pathlib import Path

import numpy as np
import pytest

from predictors import get_predictor, load_predictor
from predictors.dataset import DEFAULT_PROMPTS, Example, labelling_order, load_prompts, split_by_id
from predictors.evaluate import score, to_requests
from predictors.sklearn_backend import CLASSIFIERS
from predictors.synthetic import approx_tokens, synthetic_length

pytestmark = pytest.mark.skipif(not Path(DEFAULT_PROMPTS).is_file(),
                                reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
G = 200


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    # a predictor runs on one thread in the server (parallel mode); on a busy 2-core machine a
    # second torch thread only spin-waits (measured: 5x slower encoding under load)
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data():
    rows = labelling_order(load_prompts())[:400]
    examples = [Example(p.id, p.prompt, approx_tokens(p.prompt), synthetic_length(p), p.source) for p in rows]
    return split_by_id(examples, 0.25)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.mktemp("feature-cache"))


def check_learns(predictor, data):
    train, test = data
    predictor.fit(train)
    result = score(predictor, test, train, predictor.buckets)
    assert result["accuracy"] > result["majority_accuracy"] + 0.05, result
    ranges = predictor.predict(to_requests(test[:5], 1024))
    assert all(0 < r.prob <= 1 and r.lo < r.hi for r in ranges)
    return result


def check_cover(predictor, data):
    """A cover q answers the lowest bucket holding q of the scores: the bucket never falls as q
    rises, reaches past the most likely one somewhere on real prompts, and None is argmax again."""
    reqs = to_requests(data[1][:40], 1024)
    argmax = [r.bucket for r in predictor.predict(reqs)]
    rows = []
    for q in (0.2, 0.5, 0.8, 0.99):
        predictor.cover = q
        rows.append([r.bucket for r in predictor.predict(reqs)])
    predictor.cover = None
    assert all(a <= b for lo, hi in zip(rows, rows[1:]) for a, b in zip(lo, hi)), rows
    assert any(b > a for a, b in zip(argmax, rows[-1])), (argmax, rows[-1])
    assert [r.bucket for r in predictor.predict(reqs)] == argmax


def roundtrip(predictor, data, tmp_path):
    test = to_requests(data[1][:20], 1024)
    before = predictor.predict(test)
    loaded = load_predictor(predictor.save(tmp_path / predictor.name))
    after = loaded.predict(test)
    assert [r.bucket for r in before] == [r.bucket for r in after]
    assert np.allclose([r.prob for r in before], [r.prob for r in after], atol=1e-3)
    return loaded


def test_sklearn_learns_and_roundtrips(data, tmp_path):
    p = get_predictor("sklearn", granularity=G)
    check_learns(p, data)
    check_cover(p, data)
    roundtrip(p, data, tmp_path)


@pytest.mark.parametrize("classifier", CLASSIFIERS)
def test_every_sklearn_classifier_fits_and_predicts(data, classifier):
    p = get_predictor("sklearn", granularity=G, classifier=classifier).fit(data[0][:80])
    ranges = p.predict(to_requests(data[1][:8], 1024))
    assert len(ranges) == 8 and all(0 < r.prob <= 1 for r in ranges)


def test_sklearn_bad_input(data):
    with pytest.raises(ValueError, match="valid: logreg"):
        get_predictor("sklearn", classifier="forest")
    with pytest.raises(RuntimeError, match="not trained"):
        get_predictor("sklearn").predict(to_requests(data[1][:1], 1024))
    with pytest.raises(ValueError, match="at least one example"):
        get_predictor("sklearn").fit([])
    p = get_predictor("sklearn").fit(data[0][:30])
    bad = to_requests(data[1][:1], 1024)[0]
    bad.prompt_text = ""
    with pytest.raises(ValueError, match="empty prompt_text"):
        p.predict([bad])


@pytest.fixture(scope="module")
def retrieval(data, cache):
    p = get_predictor("retrieval", granularity=G, max_tokens=64, threshold=0.5, cache_dir=cache)
    check_learns(p, data)
    return p


def test_retrieval_cover(retrieval, data):
    check_cover(retrieval, data)


def test_retrieval_roundtrip(retrieval, data, tmp_path):
    loaded = roundtrip(retrieval, data, tmp_path)
    assert loaded.index.size == retrieval.index.size


def test_retrieval_observe_changes_later_predictions(retrieval, data):
    (req,) = to_requests(data[1][:1], 1024)
    first = retrieval.predict([req])[0]
    target = 1000 if first.bucket < 3 else 10
    for _ in range(retrieval.k):  # the prompt itself, finished k times with a very different length
        retrieval.observe(req, target)
    after = retrieval.predict([req])[0]
    assert after.bucket == retrieval.buckets.bucket_of(target) != first.bucket


def test_long_prompts_are_cut_to_the_backbone_limit(retrieval, data):
    enc = retrieval.encoder
    long_text = "alpha " * 3000 + "omega"
    ids = enc.token_ids(long_text)
    assert len(ids) == enc.max_tokens == 64
    assert ids[0] == enc.tokenizer.cls_token_id and ids[-1] == enc.tokenizer.sep_token_id  # head and tail kept
    assert enc.tokenizer.convert_tokens_to_ids("omega") in ids
    (req,) = to_requests(data[1][:1], 1024)
    req.prompt_text = long_text
    assert retrieval.predict([req])[0].lo >= 0


def test_retrieval_falls_back_to_the_mlp(data, cache):
    p = get_predictor("retrieval", granularity=G, max_tokens=64, threshold=1.0, cache_dir=cache).fit(data[0])
    p.predict(to_requests(data[1][:10], 1024))
    assert p.stats["fallback"] == 10 and p.stats["neighbours"] == 0


def test_lm_learns_roundtrips_and_runs_in_parallel(data, cache, tmp_path):
    # a shallow slice of the real SmolLM2 backbone and short prompts keep this test fast
    p = get_predictor("lm", granularity=G, num_layers=2, max_tokens=64, epochs=40, cache_dir=cache)
    check_learns(p, data)
    check_cover(p, data)
    loaded = roundtrip(p, data, tmp_path)
    assert loaded.mode == "parallel"
    reqs = to_requests(data[1][:4], 1024)
    assert [r.bucket for r in loaded.predict_async(reqs).result(timeout=60)] == [r.bucket for r in p.predict(reqs)]
    loaded.close()
    # the head on handed-over backbone features (the served prefill's path) answers as predict does
    assert [r.bucket for r in p.predict_features(p.backbone_features(reqs), reqs)] == [r.bucket for r in p.predict(reqs)]
    from model.loader import resolve_model
    from predictors.evaluate import from_prefill_latency_ms

    assert p.feature_layer("default", resolve_model("default")) == 2
    timing = from_prefill_latency_ms(p, reqs, 4)
    assert 0 < timing["from_prefill_latency_ms_p50"] <= timing["from_prefill_latency_ms_p99"]


def test_lm_takes_any_local_checkpoint(data, tmp_path):
    # a tiny random OPT (the paper's family) with the default model's tokenizer, saved as HF does
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from model.loader import resolve_model
    from tests.tiny import OPT

    tokenizer = AutoTokenizer.from_pretrained(resolve_model("default"))
    conf = AutoConfig.for_model(**{**OPT, "vocab_size": len(tokenizer)})
    AutoModelForCausalLM.from_config(conf).save_pretrained(tmp_path / "opt")
    tokenizer.save_pretrained(tmp_path / "opt")
    p = get_predictor("lm", granularity=G, model=str(tmp_path / "opt"), max_tokens=64, epochs=5,
                      cache_dir=str(tmp_path / "cache")).fit(data[0][:60])
    assert p.encoder.num_layers == 2  # num_layers=16 asked for more than the model has: all of them
    ranges = p.predict(to_requests(data[1][:3], 1024))
    assert len(ranges) == 3 and all(0 < r.prob <= 1 for r in ranges)
    assert p.feature_layer("default", resolve_model("default")) == 0  # not the served model: no prefill features
    with pytest.raises(FileNotFoundError, match="model not found"):
        get_predictor("lm", model=str(tmp_path / "nope")).fit(data[0][:5])
