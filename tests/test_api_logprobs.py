"""Logprobs through the ``openai`` client against transformers' own log-softmax on the same
weights (the default model in fp32): chat (greedy, with top logprobs) and completions with echo
(the prompt's tokens scored, as lm-evaluation-harness asks: token-id prompts, max_tokens 0 or 1).

Tolerance: TOL in nats. Our fp32 forward matches transformers' logits to 1e-3 on this model
(test_default_model), and a log-softmax moves each value by at most twice that.
"""
import math

import pytest
import torch

from aserve.config import ClusterConfig, EngineConfig
from tests.api_support import ServerThread, openai_client

pytestmark = pytest.mark.slow
TOL = 2e-3
FP32 = EngineConfig(dtype="fp32", attention="reference", kv_cache_gb=0.25, num_threads=1)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer with one word."}]


@pytest.fixture(scope="module")
def server(default_bundle_fp32):
    with ServerThread(ClusterConfig(mode="coupled", num_coupled=1), engine=FP32,
                      model_bundle=default_bundle_fp32) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai_client(server)


@pytest.fixture(scope="module")
def hf(default_bundle_fp32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_bundle_fp32.path, dtype=torch.float32).eval()


def hf_logprobs(hf, ids) -> torch.Tensor:
    """[len(ids), vocab]: row i is the distribution of the token after ids[i]."""
    with torch.no_grad():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)


def test_chat_logprobs_match_transformers(client, hf, default_bundle_fp32):
    b = default_bundle_fp32
    out = client.chat.completions.create(model="default", messages=QUESTION, max_tokens=6, temperature=0,
                                         logprobs=True, top_logprobs=3)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    ids = b.encode(QUESTION)
    for entry in content:  # greedy: transformers' arg-max at each step is the token we returned
        want = hf_logprobs(hf, ids)[-1]
        top = want.topk(3)
        token = int(top.indices[0])
        assert entry.token == b.tokenizer.decode([token])
        assert abs(entry.logprob - want[token].item()) <= TOL
        assert [t.token for t in entry.top_logprobs] == [b.tokenizer.decode([int(i)]) for i in top.indices]
        assert all(abs(t.logprob - v) <= TOL for t, v in zip(entry.top_logprobs, top.values.tolist()))
        assert entry.bytes == list(entry.token.encode())
        ids.append(token)
    assert "Paris" in out.choices[0].message.content


@pytest.mark.parametrize("max_tokens", [0, 1])
def test_completion_echo_logprobs_match_transformers(client, hf, default_bundle_fp32, max_tokens):
    b = default_bundle_fp32
    prompts = [b.tokenizer.encode(t) for t in ("The capital of France is Paris", "Two plus two is four")]
    out = client.completions.create(model="default", prompt=prompts, echo=True, logprobs=2, max_tokens=max_tokens,
                                    temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    for ids, choice in zip(prompts, out.choices):
        lp = choice.logprobs
        want = hf_logprobs(hf, ids)
        assert len(lp.tokens) == len(ids) + max_tokens
        assert lp.tokens[:len(ids)] == [b.tokenizer.decode([t]) for t in ids]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing precedes the first token
        for i in range(1, len(ids)):
            assert abs(lp.token_logprobs[i] - want[i - 1, ids[i]].item()) <= TOL
            top = want[i - 1].topk(2)
            for t, v in zip(top.indices.tolist(), top.values.tolist()):
                assert abs(lp.top_logprobs[i][b.tokenizer.decode([t])] - v) <= TOL
            assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i]  # the token itself is always listed
        assert choice.text.startswith(b.tokenizer.decode(ids))
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        if max_tokens:
            assert lp.token_logprobs[-1] == pytest.approx(want[-1].max().item(), abs=TOL)  # greedy: the arg-max
    assert out.usage.completion_tokens == 2 * max_tokens
    assert out.usage.prompt_tokens == sum(map(len, prompts))


def test_echo_streamed_equals_unstreamed(client, default_bundle_fp32):
    kw = dict(model="default", prompt="The capital of France is", echo=True, logprobs=1, max_tokens=3, temperature=0)
    full = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == full.text
    streamed = [v for c in chunks if c.choices[0].logprobs for v in c.choices[0].logprobs.token_logprobs]
    assert streamed == full.logprobs.token_logprobs
    assert all(v is None or (v <= 0 and math.isfinite(v)) for v in streamed)


def test_logprobs_are_the_models_not_the_tempered_ones(client):
    """A seeded sample at temperature 1.5: the returned logprob of each token is the model's own
    (the same as the greedy request's for the same position and token)."""
    kw = dict(model="default", messages=QUESTION, max_tokens=1, logprobs=True, top_logprobs=5)
    greedy = client.chat.completions.create(temperature=0, **kw).choices[0].logprobs.content[0]
    hot = client.chat.completions.create(temperature=1.5, top_p=0.9, seed=3, **kw).choices[0].logprobs.content[0]
    assert [t.token for t in hot.top_logprobs] == [t.token for t in greedy.top_logprobs]
    assert [t.logprob for t in hot.top_logprobs] == pytest.approx([t.logprob for t in greedy.top_logprobs], abs=1e-5)


def test_disagg_gives_the_same_logprobs(client, default_bundle_fp32):
    """Disaggregated, the prompt's rows and the first token are scored on the prefill instance
    (in fixed-size chunks), the rest on the decode instance: the same numbers as coupled."""
    ids = default_bundle_fp32.tokenizer.encode("The capital of France is Paris, and the capital of Italy is")
    kw = dict(model="default", prompt=ids, echo=True, logprobs=2, max_tokens=4, temperature=0)
    want = client.completions.create(**kw).choices[0]
    with ServerThread(ClusterConfig(mode="disagg"), engine=FP32, model_bundle=default_bundle_fp32) as disagg:
        got = openai_client(disagg).completions.create(**kw).choices[0]
        disagg.wait_idle()
    assert got.text == want.text and got.logprobs.tokens == want.logprobs.tokens
    assert got.logprobs.token_logprobs[0] is None
    assert got.logprobs.token_logprobs[1:] == pytest.approx(want.logprobs.token_logprobs[1:], abs=TOL)
