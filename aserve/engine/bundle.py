"""The loaded model: weights, tokenizer and arguments, shared by every instance of a process."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence, Union

import torch

from aserve.config import EngineConfig
from model import native
from model.attention import pick_backend
from model.config import ModelArgs
from model.loader import chat_token_ids, load_model, pick_dtype, read_config, resolve_model

Prompt = Union[str, Sequence[int], list]  # text, token ids, or chat messages [{"role", "content"}]


class PromptTooLong(ValueError):
    """Prompt plus max_tokens does not fit the model's context window."""


@dataclass
class ModelBundle:
    """A loaded model with its tokenizer; CPU instances share one bundle (same memory)."""

    path: Path
    args: ModelArgs
    model: Optional[torch.nn.Module]  # None: the shape and tokenizer alone (a Ray driver, a simulated device)
    tokenizer: object
    dtype: torch.dtype
    device: str

    @staticmethod
    def load(cfg: EngineConfig, model: Optional[torch.nn.Module] = None, weights: bool = True) -> "ModelBundle":
        """``weights=False``: the model's shape and tokenizer without its weights (a Ray driver,
        whose actors load their own)."""
        from transformers import AutoTokenizer

        path = resolve_model(cfg.model, Path(cfg.cache_dir) if cfg.cache_dir else None)
        hf_cfg = read_config(path)
        args = ModelArgs.from_hf(hf_cfg)
        dtype = pick_dtype(cfg.dtype, cfg.device)
        if model is None and weights:
            kernels = native.resolve_kernels(cfg.kernels, cfg.device)
            backend = pick_backend(cfg.attention, cfg.device, native_ok=kernels != "fallback",
                                   block_size=cfg.block_size, dtype=dtype)
            model = load_model(path, dtype, cfg.device, backend, kernels)
        tokenizer = AutoTokenizer.from_pretrained(path)
        return ModelBundle(path, args, model, tokenizer, dtype, cfg.device)

    @property
    def kernels(self) -> str:
        """Which kernels the model runs on: native, unfused or fallback (``native.use_kernels``);
        "in the actors" for a bundle without weights (a Ray driver's)."""
        return getattr(self.model, "kernels", "unknown") if self.model is not None else "in the actors"

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        ids = set(self.args.eos_token_ids)
        if getattr(self.tokenizer, "eos_token_id", None) is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    def encode(self, prompt: Prompt, chat: bool = False) -> list[int]:
        """Token ids of a prompt; ``chat`` wraps a string as one user message."""
        if isinstance(prompt, (list, tuple)) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        if isinstance(prompt, (list, tuple)):  # chat messages
            return chat_token_ids(self.tokenizer, list(prompt))
        if chat:
            return self.encode([{"role": "user", "content": prompt}])
        return self.tokenizer.encode(prompt)

    def check_fits(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.args.max_position
        if num_prompt_tokens + max_tokens > limit:
            raise PromptTooLong(f"prompt of {num_prompt_tokens} tokens plus max_tokens {max_tokens} exceeds "
                                f"the model's context window of {limit} tokens")
