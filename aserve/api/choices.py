"""One choice of a response as its tokens arrive: text deltas, logprobs in the endpoint's shape,
the echoed prompt, and the token count that usage reports.

    TokenEvent --Choice.add--> Piece(text, logprobs)   chat:        {"content": [{token, logprob, bytes, top_logprobs}]}
                                                       completions: {"tokens", "token_logprobs", "top_logprobs", "text_offset"}

Token strings are each token decoded on its own (as vLLM does), so a character split across
tokens shows as pieces; the text itself comes from the incremental detokenizer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from aserve.api.detok import IncrementalDetokenizer
from aserve.api.validate import GenerationRequest
from aserve.cluster.requests import RequestHandle, TokenEvent
from scheduling.step import TokenLogprobs


class TokenText:
    """Token id -> its text decoded alone, cached (top logprobs decode the same tokens often)."""

    def __init__(self, tokenizer):
        self.tokenizer, self.cache = tokenizer, {}

    def __call__(self, token_id: int) -> str:
        text = self.cache.get(token_id)
        if text is None:
            text = self.cache[token_id] = self.tokenizer.decode([token_id])
        return text


@dataclass
class Piece:
    """What one event adds to a choice: text (may be empty) and its tokens' logprobs (None: not asked)."""

    text: str = ""
    logprobs: Optional[dict] = None


@dataclass
class _Logprobs:
    """Completions' logprobs lists, built up token by token (``text_offset`` into the choice's text)."""

    kind: str
    token_text: TokenText
    offset: int = 0
    lists: dict = field(default_factory=dict)

    def __post_init__(self):
        self.clear()

    def clear(self) -> None:
        keys = ("content",) if self.kind == "chat" else ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        self.lists = {k: [] for k in keys}

    def add(self, token_id: int, lp: Optional[TokenLogprobs]) -> None:
        """One token; ``lp`` None: the prompt's first token (nothing before it to condition on)."""
        text = self.token_text(token_id)
        if self.kind == "chat":
            top = [_chat_entry(self.token_text(t), v) for t, v in lp.top]
            self.lists["content"].append({**_chat_entry(text, lp.logprob), "top_logprobs": top})
            return
        top = None
        if lp is not None:  # the token itself is always listed too (OpenAI's "up to logprobs + 1")
            top = {self.token_text(t): v for t, v in lp.top}
            top.setdefault(text, lp.logprob)
        for key, value in zip(("tokens", "token_logprobs", "top_logprobs", "text_offset"),
                              (text, None if lp is None else lp.logprob, top, self.offset)):
            self.lists[key].append(value)
        self.offset += len(text)

    def take(self) -> dict:
        out = self.lists if self.kind == "completion" else {"content": self.lists["content"], "refusal": None}
        self.clear()
        return out


def _chat_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}


class Choice:
    """Choice ``index`` of one response, over its request's ``handle``."""

    def __init__(self, index: int, req: GenerationRequest, handle: RequestHandle, token_text: TokenText,
                 prompt_text: str = ""):
        self.index, self.req, self.handle = index, req, handle
        self.detok = IncrementalDetokenizer(token_text.tokenizer, req.stop)
        self.logprobs = _Logprobs(req.kind, token_text) if req.logprobs is not None else None
        self.prompt_text = prompt_text if req.echo else ""
        self.discard = req.max_tokens == 0  # echo only: the one token the engine samples is not returned
        self.num_tokens = 0  # completion tokens returned
        self.started = False
        self.finish_reason: Optional[str] = None

    @property
    def num_prompt_tokens(self) -> int:
        return self.handle.request.num_prompt_tokens

    def _echo(self) -> str:
        """The prompt, before the first token: its text, and its tokens' logprobs when asked."""
        if self.logprobs is not None and self.req.echo:
            # every prompt row is scored by the step that samples the first token; a device that
            # computes no logprobs (a simulated one) leaves them None
            ids = self.handle.request.prompt_token_ids
            scored = self.handle.prompt_logprobs + [None] * (len(ids) - 1 - len(self.handle.prompt_logprobs))
            self.logprobs.add(ids[0], None)
            for tid, lp in zip(ids[1:], scored):
                self.logprobs.add(tid, lp)
        return self.prompt_text

    def add(self, ev: TokenEvent) -> Piece:
        """One event of the choice's request (a token, or the final one)."""
        text = ""
        if not self.started:
            self.started = True
            text = self._echo()
        if ev.token_id is not None and not self.discard:
            self.num_tokens += 1
            text += self.detok.add(ev.token_id)
            if self.logprobs is not None and ev.logprobs is not None:
                self.logprobs.add(ev.token_id, ev.logprobs)
        if ev.finished:
            text += self.detok.finish()
            # echo only: the prompt is all there is, whatever the token not returned did
            self.finish_reason = "length" if self.discard and ev.finish_reason == "stop" else ev.finish_reason
        streamed = self.logprobs is not None and self.req.stream  # else they are taken once, at the end
        return Piece(text, self.logprobs.take() if streamed else None)

    def all_logprobs(self) -> Optional[dict]:
        """Not streaming: every token's logprobs, in one object (None: not asked)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def usage(self) -> dict:
        """This choice's usage so far (vLLM's continuous usage stats are per choice)."""
        return {"prompt_tokens": self.num_prompt_tokens, "completion_tokens": self.num_tokens,
                "total_tokens": self.num_prompt_tokens + self.num_tokens}


def total_usage(choices: list[Choice], n: int) -> dict:
    """Each prompt's tokens once (its ``n`` choices share it), every choice's completion tokens."""
    prompt = sum(c.num_prompt_tokens for c in choices[::n])
    completion = sum(c.num_tokens for c in choices)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
