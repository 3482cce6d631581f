"""Labelling through our own engine: JSONL lines, resume, and bad arguments."""
import json
from pathlib import Path

import pytest

from aserve.predict.label import done_ids, label_prompts
from predictors.dataset import DEFAULT_PROMPTS, read_labels

HAVE_POOL = Path(DEFAULT_PROMPTS).is_file()


def tiny_pool(tmp_path, n=3):
    """The ``n`` shortest real prompts (cheap prefill), as a prompts file of their own."""
    rows = [json.loads(line) for line in Path(DEFAULT_PROMPTS).open()]
    rows = sorted(rows, key=lambda r: (len(r["prompt"]), r["id"]))[:n]
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def llm():
    import torch

    from aserve.config import EngineConfig
    from aserve.engine.offline import LLM

    before = torch.get_num_threads()
    yield LLM(EngineConfig(kv_cache_gb=0.05, num_threads=1))  # one thread: no spin-waiting on a busy CPU
    torch.set_num_threads(before)  # LLM set it process-wide


@pytest.mark.skipif(not HAVE_POOL, reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
def test_label_writes_lines_and_resumes(tmp_path, llm):
    prompts, out = tiny_pool(tmp_path), tmp_path / "labels.jsonl"
    first = label_prompts(prompts, out, llm.cfg, limit=2, max_tokens=4, quiet=True, llm=llm)
    assert first["labelled"] == 2 and len(done_ids(out)) == 2
    before = out.read_text()
    second = label_prompts(prompts, out, llm.cfg, max_tokens=4, quiet=True, llm=llm)
    assert second == {**second, "labelled": 1, "already_done": 2}
    assert out.read_text().startswith(before)  # appended, the first lines untouched
    labels = read_labels(out)
    assert len(labels) == 3 and all(1 <= lab.output_tokens[0] <= 4 and lab.prompt_tokens > 5 for lab in labels)
    assert all(lab.max_tokens == 4 for lab in labels)
    assert label_prompts(prompts, out, llm.cfg, max_tokens=4, quiet=True, llm=llm)["labelled"] == 0


@pytest.mark.skipif(not HAVE_POOL, reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
def test_label_progress_reaches_a_log(tmp_path, llm, capsys):
    # stderr is not a terminal here, as in a log: a live bar would show nothing, so a line per batch
    label_prompts(tiny_pool(tmp_path), tmp_path / "labels.jsonl", llm.cfg, max_tokens=4, batch_size=2, llm=llm)
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("labelling ")]
    assert [ln.split(" prompts")[0] for ln in lines] == ["labelling 2/3", "labelling 3/3"], lines
    assert all("tok/s" in ln and "ETA" in ln for ln in lines)


@pytest.mark.skipif(not HAVE_POOL, reason=f"needs the shared prompt pool at {DEFAULT_PROMPTS}")
def test_label_refuses_a_foreign_label_file(tmp_path, llm):
    out = tmp_path / "labels.jsonl"
    out.write_text(json.dumps({"id": "not-a-prompt", "prompt_tokens": 3, "output_tokens": [1]}) + "\n")
    with pytest.raises(ValueError, match="not in the prompts file"):
        label_prompts(tiny_pool(tmp_path), out, llm.cfg, max_tokens=4, quiet=True, llm=llm)


@pytest.mark.parametrize("kw,msg", [({"samples": 2}, "needs temperature > 0"), ({"limit": 0}, "limit must be"),
                                    ({"max_tokens": 0}, "must be >= 1")])
def test_label_bad_arguments(tmp_path, kw, msg):
    with pytest.raises(ValueError, match=msg):
        label_prompts(tmp_path / "p.jsonl", tmp_path / "l.jsonl", None, **kw)


def test_label_missing_prompts_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        label_prompts(tmp_path / "p.jsonl", tmp_path / "l.jsonl", None, quiet=True)


def test_label_split_keeps_one_side_of_the_predictors_split(tmp_path):
    from aserve.predict.label import _todo
    from predictors.dataset import is_test, labelling_order, load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"prompt {i}"}) + "\n" for i in range(60)))
    pool = load_prompts(path)
    test, _ = _todo(path, tmp_path / "l.jsonl", None, "test")
    train, _ = _todo(path, tmp_path / "l.jsonl", None, "train")
    assert test and train and all(is_test(p.id) for p in test) and not any(is_test(p.id) for p in train)
    assert len(test) + len(train) == 60
    assert [p.id for p in test] == [p.id for p in labelling_order(pool) if is_test(p.id)]  # the stable order
    assert _todo(path, tmp_path / "l.jsonl", 3, "test")[0] == test[:3]  # limit counts within the split
    assert _todo(path, tmp_path / "l.jsonl", None, "all")[0] == labelling_order(pool)


def test_label_bad_split_names_the_field(tmp_path):
    with pytest.raises(ValueError, match="field 'split'"):
        label_prompts(tmp_path / "p.jsonl", tmp_path / "l.jsonl", None, split="dev")
