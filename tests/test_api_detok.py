"""Streaming text: the deltas of ``IncrementalDetokenizer`` add up to the engine's final text."""
import functools

from hypothesis import given, settings, strategies as st

from aserve.api.detok import IncrementalDetokenizer
from aserve.engine.stops import StopChecker
from scheduling.request import Request, SamplingParams

EOS = 2
ALPHABET = "ab ,.\n\té中文🙂🎉Paris"


@functools.lru_cache(maxsize=1)
def tokenizer():
    from transformers import AutoTokenizer

    from model.loader import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("default"))


def engine_text(ids: list[int], stop: tuple[str, ...]) -> tuple[str, int]:
    """What the engine would end with: tokens until StopChecker says stop, then its text."""
    checker = StopChecker(tokenizer(), (EOS,))
    req = Request("r", [1], SamplingParams(max_tokens=max(1, len(ids)), stop=stop))
    for tok in ids:
        req.output_token_ids.append(tok)
        reason = checker.check(req)
        if reason:
            req.finish_reason = reason
            break
    return checker.text(req), req.num_output_tokens


def streamed(ids: list[int], stop: tuple[str, ...]) -> tuple[str, list[str]]:
    detok = IncrementalDetokenizer(tokenizer(), stop)
    deltas = [detok.add(t) for t in ids]
    deltas.append(detok.finish())
    return "".join(deltas), deltas


@settings(max_examples=120, deadline=None)
@given(text=st.text(ALPHABET, min_size=1, max_size=40), data=st.data())
def test_deltas_add_up_to_the_final_text(text, data):
    ids = tokenizer().encode(text)
    if data.draw(st.booleans()):
        ids.append(EOS)
    stop = ()
    if data.draw(st.booleans()) and len(text) > 1:
        i = data.draw(st.integers(0, len(text) - 1))
        n = data.draw(st.integers(1, 4))
        stop = tuple({text[i:i + n], "zz"} - {""})
    want, num_tokens = engine_text(ids, stop)
    got, deltas = streamed(ids[:num_tokens], stop)
    assert got == want
    assert all(s not in got for s in stop)


def test_multibyte_character_is_held_until_complete():
    ids = tokenizer().encode("🙂")
    assert len(ids) > 1, "the emoji spans several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer())
    partial = [detok.add(t) for t in ids[:-1]]
    assert "".join(partial) == ""
    assert detok.add(ids[-1]) + detok.finish() == "🙂"


def test_stop_string_prefix_is_held_back_then_released():
    tok = tokenizer()
    detok = IncrementalDetokenizer(tok, ("Paris!",))
    out = "".join(detok.add(t) for t in tok.encode("It is Paris, of course"))
    assert out + detok.finish() == "It is Paris, of course"
    detok = IncrementalDetokenizer(tok, ("Paris!",))
    out = "".join(detok.add(t) for t in tok.encode("It is Paris! yes"))
    assert out + detok.finish() == "It is " and detok.stopped
