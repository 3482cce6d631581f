"""Measured engine figures kept between runs (``~/.cache/aserve/profile.json``).

``aserve bench engine`` records the ``saturate_chunk`` it finds for a (model, device, dtype);
the prefill instances' chunk size defaults to it (TetriInfer's ChunkSize), else 512.
``aserve profile token-budget`` records the ``token_budget`` it finds for a (model, device,
dtype, torch threads): the largest Sarathi token budget whose iteration met a TBT SLO;
``--batching sarathi`` defaults ``--max-num-batched-tokens`` to it, else 512. The thread count
is part of that key because an iteration's time scales with it on CPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

DEFAULT_CHUNK = 512
DEFAULT_TOKEN_BUDGET = 512


def _path(cache_dir: Optional[str]) -> Path:
    from model.loader import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "profile.json"


def _key(model: str, device: str, dtype: str) -> str:
    return f"{model}|{device.split(':')[0]}|{dtype}"


def _threads_key(model: str, device: str, dtype: str, threads: int) -> str:
    import torch

    # 0 means "every core": torch's default count, read before anyone changed it
    return f"{_key(model, device, dtype)}|{threads or torch.get_num_threads()}t"


def _load(cache_dir: Optional[str]) -> dict:
    try:
        return json.loads(_path(cache_dir).read_text())
    except (OSError, ValueError):
        return {}


def _save(cache_dir: Optional[str], key: str, name: str, value: int) -> None:
    """Set one figure of one key, keeping the key's other figures."""
    data = _load(cache_dir)
    data.setdefault(key, {})[name] = value
    path = _path(cache_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def save_saturate_chunk(cache_dir: Optional[str], model: str, device: str, dtype: str, chunk: int) -> None:
    _save(cache_dir, _key(model, device, dtype), "saturate_chunk", chunk)


def saturate_chunk(cache_dir: Optional[str], model: str, device: str, dtype: str) -> int:
    """The profiled chunk size, or 512 when this model/device/dtype was never profiled."""
    return int(_load(cache_dir).get(_key(model, device, dtype), {}).get("saturate_chunk", DEFAULT_CHUNK))


def save_token_budget(cache_dir: Optional[str], model: str, device: str, dtype: str, threads: int,
                      budget: int) -> None:
    _save(cache_dir, _threads_key(model, device, dtype, threads), "token_budget", budget)


def token_budget(cache_dir: Optional[str], model: str, device: str, dtype: str, threads: int) -> Optional[int]:
    """The profiled Sarathi token budget, or None when this key was never profiled."""
    value = _load(cache_dir).get(_threads_key(model, device, dtype, threads), {}).get("token_budget")
    return None if value is None else int(value)
