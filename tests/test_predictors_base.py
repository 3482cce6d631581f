"""Length predictors: bucket maths, the id split, label files, the registry, none and oracle."""
import json

import pytest

from predictors import Buckets, get_predictor, load_predictor
import numpy as np

from predictors.base import pick, prompt_of
from aserve.commands.predictor import parse_options
from predictors.dataset import (Example, PromptRow, check_labels_match, is_test, join_examples, labelling_order,
                                load_prompts, read_labels, split_by_id)
from predictors.simple import ORACLE_ATTR
from scheduling.request import Request, SamplingParams


def req(text="How are you?", max_tokens=1024, rid="r0", n_tokens=5):
    return Request(rid, [1] * n_tokens, SamplingParams(max_tokens=max_tokens), prompt_text=text)


# -- buckets ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("g,expected", [(100, 11), (200, 6), (400, 3), (1024, 1), (2000, 1)])
def test_number_of_buckets_covers_the_cap(g, expected):
    assert Buckets(g, 1024).num_buckets == expected


def test_bucket_of_edges_and_open_last_bucket():
    b = Buckets(200, 1024)
    assert [b.bucket_of(n) for n in (0, 199, 200, 399, 1000, 1024, 5000)] == [0, 0, 1, 1, 5, 5, 5]
    assert b.bounds(0) == (0, 200) and b.bounds(4) == (800, 1000)
    assert b.bounds(5) == (1000, 1025)  # the last bucket holds the cap itself
    assert b.bounds(5, max_tokens=4096) == (1000, 4097)  # ...and runs to the request's own cap
    assert list(b.bucket_array([0, 250, 9999])) == [0, 1, 5]


def test_midpoint_of_last_bucket_stops_at_the_cap():
    b = Buckets(400, 1024)
    assert b.midpoint(0) == 199.5 and b.midpoint(2) == (800 + 1024) / 2


def test_pick_is_argmax_or_the_lowest_bucket_covering_q():
    scores = np.array([[0.1, 0.5, 0.2, 0.2], [0.6, 0.1, 0.1, 0.2], [2.0, 1.0, 1.0, 0.0]])  # rows need not sum to 1
    assert pick(scores).tolist() == [1, 0, 0]
    assert pick(scores, 0.5).tolist() == [1, 0, 0]
    assert pick(scores, 0.6).tolist() == [1, 0, 1]  # 0.6 of row 2 is reached in its second bucket
    assert pick(scores, 0.8).tolist() == [2, 2, 2]
    assert pick(scores, 1.0).tolist() == [3, 3, 2]  # row 2's last bucket holds nothing: never answered
    with pytest.raises(ValueError, match="predictor_cover must be in"):
        from aserve.config import ClusterConfig

        ClusterConfig(predictor_cover=0.0)


def test_to_range_clips_to_request_max_tokens():
    b = Buckets(100, 1024)
    r = b.to_range(7, 0.6, max_tokens=250)  # a bucket beyond the cap becomes the cap's bucket
    assert (r.lo, r.hi, r.bucket, r.prob) == (200, 251, 2, 0.6)
    assert b.to_range(1, 0.5, max_tokens=1024).hi == 200


@pytest.mark.parametrize("kw", [{"granularity": 0}, {"granularity": 1.5}, {"max_length": 0}])
def test_bad_buckets(kw):
    with pytest.raises(ValueError, match="must be an integer"):
        Buckets(**kw)
    with pytest.raises(ValueError, match=">= 0"):
        Buckets(100).bucket_of(-1)


# -- split and label files -------------------------------------------------------------------------
def test_split_by_id_is_deterministic_disjoint_and_ignores_order():
    rows = [PromptRow(f"p-{i}", "x", "hi") for i in range(2000)]
    train, test = split_by_id(rows)
    train2, test2 = split_by_id(list(reversed(rows)))
    assert {r.id for r in test} == {r.id for r in test2} and {r.id for r in train} == {r.id for r in train2}
    assert not {r.id for r in train} & {r.id for r in test}
    assert len(train) + len(test) == 2000 and 0.17 < len(test) / 2000 < 0.23
    assert all(is_test(r.id) for r in test) and not any(is_test(r.id) for r in train)


def test_labelling_order_is_stable_and_mixes():
    rows = [PromptRow(f"{s}-{i}", s, "hi") for s in ("a", "b") for i in range(50)]
    order = labelling_order(rows)
    assert order == labelling_order(list(reversed(rows)))
    assert {r.source for r in order[:10]} == {"a", "b"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_label_file_roundtrip_and_median(tmp_path):
    f = write_jsonl(tmp_path / "l.jsonl", [{"id": "a", "prompt_tokens": 5, "output_tokens": [10, 300, 20]},
                                           {"id": "b", "prompt_tokens": 7, "output_tokens": [4], "max_tokens": 64}])
    labels = read_labels(f)
    assert [lab.length for lab in labels] == [20, 4] and labels[1].max_tokens == 64


@pytest.mark.parametrize("row,msg", [({"prompt_tokens": 5, "output_tokens": [1]}, "missing field 'id'"),
                                     ({"id": "a", "prompt_tokens": 5}, "missing field 'output_tokens'"),
                                     ({"id": "a", "prompt_tokens": 5, "output_tokens": 3}, "must be a list"),
                                     ({"id": "a", "prompt_tokens": 0, "output_tokens": [1]}, "prompt_tokens"),
                                     ({"id": "a", "prompt_tokens": 3, "output_tokens": []}, "output_tokens")])
def test_bad_label_lines_name_the_field(tmp_path, row, msg):
    with pytest.raises(ValueError, match=msg):
        read_labels(write_jsonl(tmp_path / "l.jsonl", [row]))


def test_missing_files_and_bad_json(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        read_labels(tmp_path / "nope.jsonl")
    (tmp_path / "bad.jsonl").write_text("{not json\n")
    with pytest.raises(ValueError, match="bad.jsonl:1: not JSON"):
        load_prompts(tmp_path / "bad.jsonl")
    write_jsonl(tmp_path / "dup.jsonl", [{"id": "a", "prompt": "x"}, {"id": "a", "prompt": "y"}])
    with pytest.raises(ValueError, match="duplicate 'id'"):
        load_prompts(tmp_path / "dup.jsonl")
    write_jsonl(tmp_path / "empty.jsonl", [{"id": "a", "prompt": ""}])
    with pytest.raises(ValueError, match="empty 'prompt'"):
        load_prompts(tmp_path / "empty.jsonl")


def test_labels_that_do_not_match_the_prompts(tmp_path):
    prompts = [PromptRow("a", "s", "hello"), PromptRow("b", "s", "world")]
    labels = read_labels(write_jsonl(tmp_path / "l.jsonl", [{"id": "a", "prompt_tokens": 3, "output_tokens": [9]},
                                                            {"id": "zzz", "prompt_tokens": 3, "output_tokens": [9]}]))
    with pytest.raises(ValueError, match="1 of 2 label ids are not in the prompts file.*'zzz'"):
        check_labels_match(labels, prompts)
    assert [e.length for e in join_examples(prompts, labels[:1])] == [9]


# -- registry, none, oracle ------------------------------------------------------------------------
def test_registry_names_and_errors():
    with pytest.raises(ValueError, match="valid names: none, oracle, sklearn, lm, retrieval, accuracy"):
        get_predictor("gpt")
    with pytest.raises(ValueError, match="bad options for the 'none' predictor"):
        get_predictor("none", bogus=1)
    with pytest.raises(ValueError, match="mode must be one of"):
        get_predictor("lm", mode="sideways")


def test_none_gives_the_full_range():
    (r,) = get_predictor("none", granularity=100).predict([req(max_tokens=300)])
    assert (r.lo, r.hi, r.prob) == (0, 301, 1.0)


def test_oracle_uses_the_documented_sources():
    oracle = get_predictor("oracle", granularity=100)
    r = req()
    setattr(r, ORACLE_ATTR, 250)
    assert oracle.predict([r])[0].bucket == 2
    with pytest.raises(ValueError, match="oracle_length"):
        oracle.predict([req(text="unknown")])
    oracle.fit([Example("e", "known prompt", 3, 420)])
    assert oracle.predict([req(text="known prompt")])[0].bucket == 4
    ignore = Request("x", [1], SamplingParams(max_tokens=130, ignore_eos=True), prompt_text="q")
    assert oracle.predict([ignore])[0].bucket == 1
    assert oracle.predict([r])[0].prob == 1.0


def test_empty_prompt_is_a_clear_error():
    with pytest.raises(ValueError, match="empty prompt_text"):
        prompt_of(req(text="  "))
    with pytest.raises(ValueError, match="request 'r0' has an empty prompt_text"):
        prompt_of(req(text=""))


def test_predict_async_sequential_and_parallel():
    oracle = get_predictor("oracle", granularity=100)
    r = req()
    setattr(r, ORACLE_ATTR, 150)
    assert oracle.predict_async([r]).result()[0].bucket == 1
    oracle.mode = "parallel"
    assert oracle.predict_async([r]).result(timeout=10)[0].bucket == 1
    bad = oracle.predict_async([req(text="nobody knows")])
    with pytest.raises(ValueError):
        bad.result(timeout=10)
    oracle.close()


def test_save_load_simple_backends(tmp_path):
    p = get_predictor("none", granularity=400, max_length=512)
    loaded = load_predictor(p.save(tmp_path / "none"))
    assert loaded.name == "none" and loaded.buckets == Buckets(400, 512)
    with pytest.raises(FileNotFoundError, match="no trained predictor"):
        load_predictor(tmp_path / "missing")


def test_parse_options():
    assert parse_options(["k=3", "pooling=last", "threshold=0.5"]) == {"k": 3, "pooling": "last", "threshold": 0.5}
    with pytest.raises(ValueError, match="field 'option'"):
        parse_options(["novalue"])


def test_feature_cache_computes_each_text_once(tmp_path):
    import numpy as np

    from predictors.features_cache import FeatureCache

    calls = []

    def compute(texts):
        calls.append(list(texts))
        return np.array([[len(t), 1.0] for t in texts], np.float32)

    first = FeatureCache(tmp_path, {"backbone": "x"}).get(["a", "bb", "a"], compute)
    assert first[:, 0].tolist() == [1, 2, 1] and calls == [["a", "bb"]]
    again = FeatureCache(tmp_path, {"backbone": "x"}).get(["bb", "ccc"], compute)  # a new process, same file
    assert again[:, 0].tolist() == [2, 3] and calls[-1] == ["ccc"]
    FeatureCache(tmp_path, {"backbone": "y"}).get(["bb"], compute)  # other settings: other features
    assert calls[-1] == ["bb"]
