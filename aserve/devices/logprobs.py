"""Log-probabilities for the rows of a step that ask for them.

They are the model's own: log-softmax of the fp32 logits, before temperature, top-k and top-p
(what vLLM returns by default, and what evaluation harnesses score with). A step where no row
asks pays nothing: no log-softmax over the vocabulary, no extra logits.

    sampled rows  (SeqStep.num_logprobs)   the logits the sampler already has -> TokenLogprobs
    prompt rows   (SeqStep.prompt_targets) hidden rows -> LM head, PROMPT_SLICE_ROWS at a time
                                           -> PromptLogprobs (echo)
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from scheduling.step import PromptLogprobs, SeqStep, TokenLogprobs

# Prompt rows scored per LM-head call: bounds the [rows, vocab] fp32 logits (~50 MB at a 49k
# vocabulary) whatever the chunk size.
PROMPT_SLICE_ROWS = 256


def token_logprobs(logits: torch.Tensor, token_ids: Sequence[int], ks: Sequence[int]) -> list[TokenLogprobs]:
    """logits: [N, vocab] -> row i: ``token_ids[i]``'s logprob and the ``ks[i]`` most likely."""
    assert logits.shape[0] == len(token_ids) == len(ks)
    lp = torch.log_softmax(logits.float(), dim=-1)  # [N, vocab]
    ids = torch.tensor(list(token_ids), dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    k_max = min(max(ks, default=0), lp.shape[-1])
    top_values, top_ids = ([], [])
    if k_max:
        values, indices = lp.topk(k_max, dim=-1)  # sorted, most likely first
        top_values, top_ids = values.tolist(), indices.tolist()
    return [TokenLogprobs(t, c, tuple(zip(top_ids[i][:k], top_values[i][:k])) if k else ())
            for i, (t, c, k) in enumerate(zip(token_ids, chosen, ks))]


def sampled_logprobs(logits: torch.Tensor, seqs: Sequence[SeqStep], tokens: Sequence[int]) -> dict:
    """The sampled rows that asked: request id -> TokenLogprobs (``logits`` row i is ``seqs[i]``'s)."""
    want = [i for i, s in enumerate(seqs) if s.num_logprobs is not None]
    if not want:
        return {}
    rows = logits if len(want) == len(seqs) else logits[torch.tensor(want, device=logits.device)]
    got = token_logprobs(rows, [tokens[i] for i in want], [seqs[i].num_logprobs for i in want])
    return {seqs[i].request_id: g for i, g in zip(want, got)}


def prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    scored: Sequence[tuple[int, SeqStep]]) -> dict:
    """Echo: ``scored`` holds (first row in ``hidden``, its SeqStep) for rows with prompt targets;
    returns request id -> PromptLogprobs. Only those rows go through the LM head."""
    rows, targets, ks = [], [], []
    for first, s in scored:
        rows.extend(range(first, first + len(s.prompt_targets)))
        targets.extend(s.prompt_targets)
        ks.extend([s.num_prompt_logprobs] * len(s.prompt_targets))
    entries: list[TokenLogprobs] = []
    for a in range(0, len(rows), PROMPT_SLICE_ROWS):
        index = torch.tensor(rows[a:a + PROMPT_SLICE_ROWS], dtype=torch.long, device=hidden.device)
        entries.extend(token_logprobs(lm_head(hidden[index]), targets[a:a + PROMPT_SLICE_ROWS],
                                      ks[a:a + PROMPT_SLICE_ROWS]))
    out, at = {}, 0
    for _, s in scored:
        n = len(s.prompt_targets)
        out[s.request_id] = PromptLogprobs(s.start_pos + 1, tuple(entries[at:at + n]))
        at += n
    return out
