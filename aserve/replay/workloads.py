"""The paper's five workloads, and the prompt token ids a replay sends for each trace request.

TetriInfer (§5) classes a request by its prompt and output lengths:

                     output <= 128 (light decode)   output > 128 (heavy decode)
    prompt <= 512        LPLD                           LPHD
    prompt >  512        HPLD                           HPHD

Each workload samples lengths from ShareGPT's length table filtered to its class; ``Mixed``
takes the four classes evenly; ``Shift`` is HPLD then LPHD (half each, in that order), a load
that moves from prefill-heavy to decode-heavy for the flip policies. Arrivals are Poisson (or Gamma) at ``rate``; everything seeded.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Optional, Sequence

from aserve.replay.trace_formats import TraceRequest, read_lengths
from aserve.replay.traces import gamma_arrivals

HEAVY_PREFILL = 512  # prompt tokens above this: heavy prefill
HEAVY_DECODE = 128  # output tokens above this: heavy decode
CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD")
WORKLOADS = CLASSES + ("Mixed", "Shift")
# Shift: the first half HPLD, then the second half LPHD, in that order: a load that moves from
# prefill-heavy to decode-heavy, for the flip policies (TetriInfer §3.5).
PHASES = {"Shift": ("HPLD", "LPHD")}
SHARED_DATA = Path(__file__).resolve().parents[3] / "shared" / "data"  # ../shared beside the checkout
SHAREGPT_LENGTHS = SHARED_DATA / "traces" / "sharegpt8k_lengths_llama2tok.csv"
PROMPTS_FILE = SHARED_DATA / "prompts" / "prompts.jsonl"


def length_class(prompt_tokens: int, output_tokens: int) -> str:
    """LPLD | LPHD | HPLD | HPHD."""
    p = "HP" if prompt_tokens > HEAVY_PREFILL else "LP"
    d = "HD" if output_tokens > HEAVY_DECODE else "LD"
    return p + d


def canonical_name(name: str) -> str:
    for w in WORKLOADS:
        if w.lower() == name.lower():
            return w
    raise ValueError(f"unknown workload {name!r}: choose one of {', '.join(WORKLOADS)}")


def make_workload(name: str, num_requests: int = 128, rate: float = 1.0, burstiness: float = 1.0,
                  seed: int = 0, lengths_path: Path = SHAREGPT_LENGTHS) -> list[tuple[str, TraceRequest]]:
    """``num_requests`` (class, request) pairs of workload ``name``, arrivals drawn at ``rate``."""
    name = canonical_name(name)
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    if not Path(lengths_path).is_file():
        raise FileNotFoundError(f"ShareGPT length table not found: {lengths_path}")
    pool: dict[str, list[TraceRequest]] = {c: [] for c in CLASSES}
    for r in read_lengths(Path(lengths_path)).requests:
        pool[length_class(r.prompt_tokens, r.output_tokens)].append(r)
    rng = random.Random(seed)
    if name in PHASES:  # phases in order, each an equal share (the first takes the remainder)
        phases = PHASES[name]
        sizes = [num_requests // len(phases)] * len(phases)
        sizes[0] += num_requests - sum(sizes)
        wanted = [cls for cls, n in zip(phases, sizes) for _ in range(n)]
    else:
        wanted = [name] * num_requests if name != "Mixed" else [CLASSES[i % 4] for i in range(num_requests)]
        rng.shuffle(wanted)
    picked = []
    for cls in wanted:
        if not pool[cls]:
            raise ValueError(f"{lengths_path} has no {cls} requests")
        picked.append((cls, rng.choice(pool[cls])))
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got {rate!r}, {burstiness!r}")
    times = gamma_arrivals(len(picked), rate, burstiness, seed)
    return [(c, TraceRequest(round(t, 6), r.prompt_tokens, r.output_tokens)) for t, (c, r) in zip(times, picked)]


def write_workload(pairs: Sequence[tuple[str, TraceRequest]], path) -> Path:
    """Write the project's JSONL (schema in traces/README.md)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for cls, r in pairs:
            row = {"timestamp": r.arrival_s, "prompt_tokens": r.prompt_tokens, "output_tokens": r.output_tokens,
                   "class": cls}
            if r.hash_ids:
                row.update(hash_ids=list(r.hash_ids), hash_block=r.hash_block)
            f.write(json.dumps(row) + "\n")
    return path


# ---- prompt token ids for a replay ---------------------------------------------------------------
class PromptBuilder:
    """Token ids of exactly ``prompt_tokens`` for each trace request.

    Text the trace carries is tokenised and cut, or extended with more text; with a prompts
    file (JSONL with a ``prompt`` field) real prompts are taken in a seeded order and joined
    until long enough; otherwise ids are drawn uniformly from the vocabulary minus special ids.
    With ``chat``, each request's text is sent as one user turn of the tokenizer's chat template,
    as a chat client would send it, and its length is what the template makes of it (the trace's
    ``prompt_tokens`` is not imposed; a request without text is an error).
    """

    def __init__(self, tokenizer, prompts_file: Optional[Path] = None, seed: int = 0, chat: bool = False):
        self.tokenizer, self.rng, self.chat, self.seed = tokenizer, random.Random(seed), chat, seed
        self._blocks: dict[tuple[int, int], list[int]] = {}  # (hash id, size) -> its tokens
        special = set(getattr(tokenizer, "all_special_ids", []) or [])
        self.vocab = [i for i in range(len(tokenizer)) if i not in special]
        self.lines: list[str] = []
        self.next_line = 0
        if prompts_file is not None:
            if not Path(prompts_file).is_file():
                raise FileNotFoundError(f"prompts file not found: {prompts_file}")
            with open(prompts_file) as f:
                self.lines = [ln for ln in f if ln.strip()]
            self.rng.shuffle(self.lines)
        self.source = str(prompts_file) if prompts_file else "random token ids"

    def describe(self, reqs: Sequence[TraceRequest]) -> str:
        """Where the prompts of ``reqs`` come from, for the report: the trace's own text, the
        prompts file, random ids, or a mix (text cut or extended)."""
        with_text = sum(1 for r in reqs if r.prompt_text)
        hashed = sum(1 for r in reqs if r.hash_ids and not r.prompt_text)
        if hashed and not self.chat:
            return f"random token ids, shared where the trace's hash_ids repeat ({hashed} of {len(reqs)} requests)"
        if self.chat:
            return "the trace's text, one chat turn each"
        if with_text == 0:
            return self.source
        if with_text == len(reqs):
            return "the trace's text"
        return f"the trace's text ({with_text} of {len(reqs)}), else {self.source}"

    def _next_text(self) -> str:
        line = self.lines[self.next_line % len(self.lines)]
        self.next_line += 1
        try:
            return json.loads(line)["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise ValueError(f"prompts file {self.source}: a line without a 'prompt' string: {line[:80]!r}") from None

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def chat_ids(self, text: str) -> list[int]:
        """``text`` as one user turn of the chat template, ready for the reply."""
        from model.loader import chat_token_ids

        return chat_token_ids(self.tokenizer, [{"role": "user", "content": text}])

    def token_ids(self, req: TraceRequest) -> list[int]:
        if self.chat:
            return self.chat_ids(req.prompt_text)
        n = req.prompt_tokens
        if req.hash_ids and not req.prompt_text:
            ids = [t for h in req.hash_ids for t in self._hash_block(h, req.hash_block)][:n]
            return ids + self.rng.choices(self.vocab, k=n - len(ids))  # past the last hash block: its own
        ids = self._encode(req.prompt_text) if req.prompt_text else []
        if not ids and not self.lines:
            return self.rng.choices(self.vocab, k=n)
        while len(ids) < n:
            extra = self._encode("\n\n" + self._next_text()) if self.lines else self.rng.choices(self.vocab, k=n)
            ids.extend(extra)
        return ids[:n]

    def _hash_block(self, hash_id: int, size: int) -> list[int]:
        """The tokens of one hash block: a function of the id, the size and the seed only, so every
        request naming it starts its block with the same ids (a partial last block is their prefix)."""
        key = (hash_id, size)
        if key not in self._blocks:
            self._blocks[key] = random.Random(f"{self.seed}/{hash_id}/{size}").choices(self.vocab, k=size)
        return self._blocks[key]

    def build(self, reqs: Sequence[TraceRequest]) -> list[list[int]]:
        if self.chat:
            missing = [i for i, r in enumerate(reqs) if not r.prompt_text]
            if missing:
                raise ValueError(f"--chat sends each request's text as a chat turn, but {len(missing)} of "
                                 f"{len(reqs)} requests have no prompt text (the first: request {missing[0]})")
        return [self.token_ids(r) for r in reqs]
