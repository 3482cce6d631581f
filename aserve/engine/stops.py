"""Stop conditions and text: EOS / stop token ids, stop strings, max_tokens."""
from __future__ import annotations

from typing import Optional

from scheduling.request import Request


class StopChecker:
    """Decides when a request is done after each new token, and its final text."""

    def __init__(self, tokenizer, eos_token_ids: tuple[int, ...]):
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)

    def check(self, req: Request) -> Optional[str]:
        """Return ``"stop"`` or ``"length"`` when the request must end, else None."""
        sp = req.sampling
        last = req.output_token_ids[-1]
        if (not sp.ignore_eos and last in self.eos_token_ids) or last in sp.stop_token_ids:
            return "stop"
        if sp.stop and self._tail_has_stop(req):
            return "stop"
        if req.num_output_tokens >= (sp.length_after or sp.max_tokens):
            return "length"
        return None

    def _tail_has_stop(self, req: Request) -> bool:
        # a stop string can span tokens: look at the text of the last few tokens only
        width = max(len(s) for s in req.sampling.stop) + 8
        tail = self.tokenizer.decode(req.output_token_ids[-width:], skip_special_tokens=True)
        return any(s in tail for s in req.sampling.stop)

    def text(self, req: Request) -> str:
        """The output text, cut before the first stop string, without EOS/stop tokens."""
        ids = list(req.output_token_ids)
        if ids and req.finish_reason == "stop" and (ids[-1] in self.eos_token_ids or ids[-1] in req.sampling.stop_token_ids):
            ids = ids[:-1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        cut = [text.find(s) for s in req.sampling.stop if s in text]
        return text[:min(cut)] if cut else text
