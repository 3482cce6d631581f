"""Incremental detokenisation for streaming: token ids in, text deltas out.

Decoding each new token on its own is wrong (byte-level BPE splits multi-byte characters
across tokens; some tokenizers change a word's leading space by context), and decoding the
whole output on every token costs O(n^2). A fast (Rust) tokenizer streams with tokenizers' own
``DecodeStream``, which keeps the needed window itself and holds back an incomplete character;
a tokenizer without one takes the same approach by hand, a small window:

    ids:   [ ... committed ... | context (prefix..read) | new (read..) ]
    delta = decode(ids[prefix:]) - decode(ids[prefix:read])

The delta is committed only when it does not end in U+FFFD (an incomplete UTF-8 sequence:
wait for the next token). Committed text is then *released* to the client except for a tail
that could still grow into a stop string; once a stop string appears the text is cut before it
and nothing more is released. ``finish()`` releases whatever is left, so the concatenation of
every delta equals ``StopChecker.text`` of the finished request (tests check this).
"""
from __future__ import annotations

from typing import Sequence

from tokenizers.decoders import DecodeStream

_INCOMPLETE = "\ufffd"
# How many committed tokens of context the window keeps before the new ones.
_CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """One request's output text, released piece by piece; the event-loop thread only."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()):
        assert all(stop), "stop strings must be non-empty"
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.ids: list[int] = []
        self.text = ""  # committed text (cut at a stop string once one is found)
        self.num_released = 0  # chars of ``text`` handed out so far
        self.stopped = False  # a stop string was found: the text is final
        self._prefix = 0
        self._read = 0
        backend = getattr(tokenizer, "backend_tokenizer", None)  # a fast tokenizer's Rust core
        self._backend = backend
        self._stream = DecodeStream(skip_special_tokens=True) if backend is not None else None

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token_id: int) -> str:
        """Take one new token; return the text that may be sent now (often "")."""
        self.ids.append(token_id)
        if self.stopped:
            return ""
        if self._stream is not None:
            piece = self._stream.step(self._backend, token_id)
            if not piece:  # mid-character (None), or a token with no text of its own
                return ""
            self.text += piece
            return self._release(final=False)
        before = self._decode(self.ids[self._prefix:self._read])
        after = self._decode(self.ids[self._prefix:])
        if after.endswith(_INCOMPLETE) or len(after) < len(before):
            return ""  # mid-character: the next token completes it
        self.text += after[len(before):]
        self._read = len(self.ids)
        self._prefix = max(0, self._read - _CONTEXT_TOKENS)
        return self._release(final=False)

    def finish(self) -> str:
        """The request ended: return everything not yet released (cut at a stop string)."""
        if not self.stopped:
            # Re-decode the whole output once: it settles any held-back partial character.
            self.text = self._decode(self.ids)
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self.stop and not self.stopped:
            self._cut_at_stop()
        end = len(self.text)
        if not final and not self.stopped:
            end -= self._stop_prefix_len()
        end = max(end, self.num_released)
        delta = self.text[self.num_released:end]
        self.num_released = end
        return delta

    def _cut_at_stop(self) -> None:
        # An occurrence cannot start inside released text (that text held no stop-string
        # prefix at its end when released), so search from the first unreleased char on,
        # less the longest stop string for occurrences that straddle the boundary.
        start = max(0, self.num_released - max(map(len, self.stop)) + 1)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
        if hits:
            self.text = self.text[:min(hits)]
            self.stopped = True

    def _stop_prefix_len(self) -> int:
        """Length of the longest suffix of the unreleased text that starts some stop string."""
        tail = self.text[self.num_released:]
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(tail)), best, -1):
                if s.startswith(tail[-n:]):
                    best = n
                    break
        return best
