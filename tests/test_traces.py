"""Trace readers, fitting and the paper's workloads (no model needed)."""
from __future__ import annotations

import json
import math
from collections import Counter

import pytest

from aserve.replay.traces import (FitOptions, RawTrace, TraceError, TraceRequest, detect_format, fit, load_trace,
                           parse_azure_time, read_trace)
from aserve.replay.workloads import (CLASSES, HEAVY_DECODE, HEAVY_PREFILL, SHAREGPT_LENGTHS, PromptBuilder, length_class,
                              make_workload, write_workload)
from conftest import SHARED

TRACES = SHARED / "data" / "traces"
needs_data = pytest.mark.skipif(not TRACES.is_dir(), reason=f"shared traces not found at {TRACES}")


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---- formats --------------------------------------------------------------------------------------
def test_azure_csv(tmp_path):
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:15:50.9951690,396,109\n"
                                    "2023-11-16 18:15:46.6805900,374,44\n")
    raw = read_trace(path)
    assert raw.format == "azure" and raw.timed
    assert raw.requests[0] == TraceRequest(0.0, 374, 44)  # sorted by time, relative to the first
    assert raw.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)


def test_azure_time_keeps_seven_digits():
    assert parse_azure_time("2023-11-16 18:15:46.0000001")[1] == pytest.approx(1e-7, abs=1e-12)


def test_azure_sub_microsecond_gaps(tmp_path):
    path = write(tmp_path, "a.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"
                                    "2023-11-16 18:15:46.9999999,1,1\n2023-11-16 18:15:47.0000002,1,1\n")
    assert read_trace(path).requests[1].arrival_s == pytest.approx(3e-7, abs=1e-12)


def test_lengths_csv(tmp_path):
    path = write(tmp_path, "l.csv", "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n10,5,15,2\n7,0,7,0\n")
    raw = read_trace(path)
    assert raw.format == "lengths" and not raw.timed
    assert [(r.prompt_tokens, r.output_tokens) for r in raw.requests] == [(10, 5), (7, 1)]  # output >= 1


def test_mooncake_jsonl(tmp_path):
    rows = [{"timestamp": 0, "input_length": 6955, "output_length": 52, "hash_ids": [0, 1, 2]},
            {"timestamp": 1500, "input_length": 100, "output_length": 7, "hash_ids": [3]}]
    path = write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    raw = read_trace(path)
    assert raw.format == "mooncake"
    assert raw.requests[1] == TraceRequest(1.5, 100, 7, hash_ids=(3,))
    assert raw.requests[0].hash_ids == (0, 1, 2) and raw.requests[0].hash_block == 512


def test_aserve_jsonl_text_and_counts(tmp_path):
    rows = [{"timestamp": 0.5, "prompt_tokens": 12, "output_tokens": 3},
            {"timestamp": 1.0, "prompt": "one two three", "output_tokens": 4}]
    path = write(tmp_path, "a.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(TraceError, match="tokenizer"):
        read_trace(path)
    raw = read_trace(path, count_tokens=lambda text: len(text.split()))
    assert raw.format == "aserve"
    assert raw.requests[0] == TraceRequest(0.0, 12, 3)
    assert raw.requests[1] == TraceRequest(0.5, 3, 4, "one two three")


@pytest.mark.parametrize("name,text,match", [
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.1,abc,3\n", "ContextTokens"),
    ("bad.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\nyesterday,3,3\n", "TIMESTAMP"),
    ("bad.csv", "num_prefill_tokens,num_decode_tokens\n5,-1\n", "num_decode_tokens"),
    ("bad.csv", "a,b\n1,2\n", "unknown CSV header"),
    ("bad.jsonl", '{"input_length": 5, "output_length": 3}\n', "timestamp"),
    ("bad.jsonl", '{"timestamp": 0, "prompt_tokens": 5}\n', "unknown JSONL"),
    ("bad.jsonl", '{"timestamp": 0, "prompt_tokens": 5, "output_tokens": 1}\n{"prompt_tokens": 5, "output_tokens": 1}\n',
     "every line or on none"),
    ("bad.jsonl", '{"output_tokens": 3}\n', "prompt_tokens"),
    ("bad.txt", "hello\n", "extension"),
])
def test_bad_files_name_the_file_and_field(tmp_path, name, text, match):
    path = write(tmp_path, name, text)
    with pytest.raises(TraceError, match=match) as e:
        read_trace(path)
    assert str(path) in str(e.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError):
        read_trace(tmp_path / "nope.csv")


@needs_data
def test_real_shared_traces_first_rows():
    conv = read_trace(TRACES / "azure2023_conv.csv")
    assert conv.format == "azure" and len(conv.requests) == 19366
    assert conv.requests[0] == TraceRequest(0.0, 374, 44)
    assert conv.requests[1].arrival_s == pytest.approx(4.314579, abs=1e-6)
    code = read_trace(TRACES / "azure2023_code.csv")
    assert (code.requests[0].prompt_tokens, code.requests[0].output_tokens) == (4808, 10)
    share = read_trace(TRACES / "sharegpt8k_lengths_llama2tok.csv")
    assert share.format == "lengths" and share.requests[0] == TraceRequest(0.0, 74, 918)
    assert detect_format(TRACES / "arxiv_summarization_lengths_llama2tok.csv") == "lengths"


# ---- fitting --------------------------------------------------------------------------------------
def raw(lengths, times=None):
    times = times or [0.0] * len(lengths)
    return RawTrace(tuple(TraceRequest(t, p, o) for t, (p, o) in zip(times, lengths)), "test", times is not None)


def test_fit_selects_and_rescales_time():
    r = raw([(10, 2)] * 5, [0.0, 1.0, 2.0, 3.0, 4.0])
    t = fit(r, FitOptions(num_requests=3, time_scale=0.5))
    assert [x.arrival_s for x in t.requests] == [0.0, 0.5, 1.0]
    assert any("first 3 of 5" in c for c in t.changes) and any("x0.5" in c for c in t.changes)
    t = fit(r, FitOptions(rate=2.0))  # 1 req/s -> 2 req/s
    assert t.requests[-1].arrival_s == pytest.approx(2.0)


def test_fit_draws_seeded_arrivals_for_untimed_traces():
    r = RawTrace(tuple(TraceRequest(0.0, 10, 2) for _ in range(2000)), "lengths", False)
    a, b = fit(r, FitOptions(rate=4.0, seed=1)), fit(r, FitOptions(rate=4.0, seed=1))
    assert a.requests == b.requests
    assert (len(a.requests) - 1) / a.requests[-1].arrival_s == pytest.approx(4.0, rel=0.1)
    bursty = fit(r, FitOptions(rate=4.0, burstiness=0.25, seed=1))
    gaps = [y.arrival_s - x.arrival_s for x, y in zip(bursty.requests, bursty.requests[1:])]
    mean = sum(gaps) / len(gaps)
    cv = math.sqrt(sum((g - mean) ** 2 for g in gaps) / len(gaps)) / mean
    assert cv > 1.5  # Gamma shape 1/4: coefficient of variation 2
    assert fit(r, FitOptions()).changes == ("no arrival times and no --rate: every request arrives at t=0",)


def test_fit_option_checks():
    with pytest.raises(ValueError, match="not both"):
        FitOptions(rate=1.0, time_scale=2.0)
    with pytest.raises(ValueError, match="burstiness"):
        fit(raw([(1, 1)] * 2, [0.0, 1.0]), FitOptions(burstiness=0.5))
    with pytest.raises(ValueError):
        FitOptions(num_requests=0)


def test_fit_clips_and_counts():
    r = raw([(100, 10), (5000, 10), (10, 900), (8000, 500), (20, 20)], [0.0, 1.0, 2.0, 3.0, 4.0])
    t = fit(r, FitOptions(max_prompt_tokens=6000, max_output_tokens=800, context_window=4096))
    got = [(x.prompt_tokens, x.output_tokens) for x in t.requests]
    assert got == [(100, 10), (4086, 10), (10, 800), (3596, 500), (20, 20)]
    assert t.clipped == frozenset({1, 2, 3}) and t.num_clipped == 3
    text = "\n".join(t.changes)
    assert "--max-prompt-tokens 6000: 1 requests" in text
    assert "--max-output-tokens 800: 1 requests" in text
    assert "context of 4096 tokens: 2 requests" in text
    assert all(x.prompt_tokens + x.output_tokens <= 4096 for x in t.requests)


def test_fit_length_scale():
    t = fit(raw([(100, 10), (3, 1)], [0.0, 1.0]), FitOptions(length_scale=0.5))
    assert [(x.prompt_tokens, x.output_tokens) for x in t.requests] == [(50, 5), (2, 1)]
    assert t.num_clipped == 0 and any("x0.5" in c for c in t.changes)


# ---- workloads and prompts ------------------------------------------------------------------------
@needs_data
@pytest.mark.parametrize("name", CLASSES)
def test_workload_classes_respect_thresholds(name):
    pairs = make_workload(name, 64, seed=3)
    assert len(pairs) == 64
    for cls, r in pairs:
        assert cls == name == length_class(r.prompt_tokens, r.output_tokens)
        assert (r.prompt_tokens > HEAVY_PREFILL) == (name[0] == "H")
        assert (r.output_tokens > HEAVY_DECODE) == (name[2] == "H")
    assert make_workload(name, 64, seed=3) == pairs


@needs_data
def test_mixed_workload_round_trips(tmp_path):
    pairs = make_workload("mixed", 10, rate=2.0)
    assert sorted(Counter(c for c, _ in pairs).values()) == [2, 2, 3, 3]
    path = write_workload(pairs, tmp_path / "Mixed.jsonl")
    t = load_trace(path)
    assert t.format == "aserve" and t.requests == tuple(r for _, r in pairs)


def test_workload_needs_the_length_table(tmp_path):
    with pytest.raises(FileNotFoundError, match="length table"):
        make_workload("LPLD", 4, lengths_path=tmp_path / "missing.csv")
    with pytest.raises(ValueError, match="unknown workload"):
        make_workload("XYZ", 4, lengths_path=SHAREGPT_LENGTHS)


class FakeTokenizer:
    all_special_ids = [0, 1, 2]

    def __len__(self):
        return 50

    def encode(self, text, add_special_tokens=False):
        return [3 + (hash(w) % 40) for w in text.split()]


def test_prompt_builder_random_and_text(tmp_path):
    b = PromptBuilder(FakeTokenizer(), seed=0)
    ids = b.token_ids(TraceRequest(0.0, 37, 1))
    assert len(ids) == 37 and not set(ids) & {0, 1, 2}
    assert len(b.token_ids(TraceRequest(0.0, 2, 1, "a b c d e"))) == 2  # cut
    assert len(b.token_ids(TraceRequest(0.0, 9, 1, "a b c"))) == 9  # extended
    prompts = write(tmp_path, "p.jsonl", "".join(json.dumps({"prompt": f"w{i} x y"}) + "\n" for i in range(4)))
    b = PromptBuilder(FakeTokenizer(), prompts, seed=0)
    assert [len(x) for x in b.build([TraceRequest(0.0, n, 1) for n in (2, 10, 3)])] == [2, 10, 3]


def test_prompt_builder_chat_sends_each_text_as_one_chat_turn():
    from transformers import AutoTokenizer

    from model.loader import resolve_model

    tok = AutoTokenizer.from_pretrained(resolve_model("default"))
    b = PromptBuilder(tok, chat=True)
    question = "What is the capital of France?"
    (ids,) = b.build([TraceRequest(0.0, 3, 1, question)])
    # the whole turn, not cut to the trace's 3 tokens, ready for the assistant's reply
    assert tok.decode(ids).endswith(f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n")
    assert len(ids) > 3 and b.describe([]) == "the trace's text, one chat turn each"
    with pytest.raises(ValueError, match=r"1 of 2 requests have no prompt text \(the first: request 1\)"):
        b.build([TraceRequest(0.0, 3, 1, question), TraceRequest(0.1, 3, 1)])


# ---- shared prefixes: hash_ids and the multi-turn workload ----------------------------------------------
def test_hash_ids_become_shared_prompt_prefixes():
    b = PromptBuilder(FakeTokenizer(), seed=0)
    first, second, other = b.build([TraceRequest(0.0, 20, 1, hash_ids=(7, 8), hash_block=16),
                                    TraceRequest(1.0, 40, 1, hash_ids=(7, 8, 9), hash_block=16),
                                    TraceRequest(2.0, 20, 1, hash_ids=(5, 8), hash_block=16)])
    assert len(first) == 20 and len(second) == 40 and second[:20] == first  # a partial block is a prefix
    assert other[:16] != first[:16] and other[16:20] == first[16:20]  # block 8's tokens, another prefix
    longer = b.token_ids(TraceRequest(0.0, 50, 1, hash_ids=(7,), hash_block=16))  # past its blocks: its own
    assert len(longer) == 50 and longer[:16] == first[:16]
    assert "hash_ids" in b.describe([TraceRequest(0.0, 20, 1, hash_ids=(7,))])


def test_length_scale_scales_hash_blocks(tmp_path):
    rows = [{"timestamp": 0, "prompt_tokens": 1000, "output_tokens": 10, "hash_ids": [1, 2], "hash_block": 512}]
    path = write(tmp_path, "h.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    (r,) = load_trace(path, FitOptions(length_scale=0.25)).requests
    assert r.prompt_tokens == 250 and r.hash_block == 128 and r.hash_ids == (1, 2)
    bad = write(tmp_path, "b.jsonl", json.dumps({"prompt_tokens": 5, "output_tokens": 1, "hash_ids": ["x"]}) + "\n")
    with pytest.raises(TraceError, match="hash_ids"):
        read_trace(bad)


@needs_data
def test_chat_workload_turns_extend_earlier_turns(tmp_path):
    from aserve.replay.conversations import make_conversations

    assert len({r.hash_ids[0] for _, r in make_conversations(60, rate=2.0, seed=1)}) <= 4  # four system prompts
    # one system prompt of exactly 4 blocks: a prefix longer than 4 blocks is a conversation's own
    pairs = make_conversations(60, rate=2.0, seed=1, num_system_prompts=1, system_tokens=(256, 256))
    reqs = [r for _, r in pairs]
    assert len(reqs) == 60 and all(a.arrival_s <= b.arrival_s for a, b in zip(reqs, reqs[1:]))
    assert all(len(r.hash_ids) == -(-r.prompt_tokens // r.hash_block) and r.prompt_tokens <= 1536 for r in reqs)
    assert len({r.hash_ids[:4] for r in reqs}) == 1
    # some prompt is a later turn: its hash ids start with an earlier turn's full blocks
    full = {r.hash_ids[:r.prompt_tokens // r.hash_block] for r in reqs}
    assert any(r.hash_ids[:len(f)] == f and len(r.hash_ids) > len(f) and len(f) > 4 for r in reqs for f in full)
    path = write_workload(pairs, tmp_path / "chat.jsonl")  # the hash ids survive a round trip
    assert [r.hash_ids for r in read_trace(path).requests] == [r.hash_ids for r in reqs]
