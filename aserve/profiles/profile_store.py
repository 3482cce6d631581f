"""Measured engine figures kept between runs, under ``~/.cache/aserve``.

- ``device_profiles.json``: a ``CostModel`` (aserve/profiles/cost_model.py) per (model, device,
  dtype, torch threads), measured by ``aserve profile device``, or on the first run that needs a
  setting derived from it (the prefill chunk size, the Sarathi token budget). Each keeps the
  machine it was measured on and the measurement's version; a profile of another machine, or of an
  older measurement, is measured again.
- ``profile.json``: the token budget ``aserve profile token-budget`` saved for a (model, device,
  dtype, threads) at an SLO the user chose; it takes precedence over the derived budget.

The thread count is part of both keys because a step's time scales with it on a CPU.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from aserve.profiles.cost_model import CostModel

DEFAULT_CHUNK = 512
DEFAULT_TOKEN_BUDGET = 512


def _dir(cache_dir: Optional[str]) -> Path:
    from model.loader import default_cache_dir

    return Path(cache_dir or default_cache_dir())


def _key(model: str, device: str, dtype: str, threads: int) -> str:
    import torch

    # 0 means "every core": torch's default count, read before anyone changed it
    return f"{model}|{device.split(':')[0]}|{dtype}|{threads or torch.get_num_threads()}t"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _save(path: Path, key: str, value) -> None:
    data = _load(path)
    data[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def save_token_budget(cache_dir: Optional[str], model: str, device: str, dtype: str, threads: int,
                      budget: int) -> None:
    path, key = _dir(cache_dir) / "profile.json", _key(model, device, dtype, threads)
    _save(path, key, {**_load(path).get(key, {}), "token_budget": budget})


def token_budget(cache_dir: Optional[str], model: str, device: str, dtype: str, threads: int) -> Optional[int]:
    """The token budget ``aserve profile token-budget`` saved, or None."""
    value = _load(_dir(cache_dir) / "profile.json").get(_key(model, device, dtype, threads), {}).get("token_budget")
    return None if value is None else int(value)


def device_profile_path(cache_dir: Optional[str]) -> Path:
    return _dir(cache_dir) / "device_profiles.json"


def save_cost_model(cache_dir: Optional[str], model: str, device: str, dtype: str, threads: int,
                    cost: CostModel) -> Path:
    path = device_profile_path(cache_dir)
    _save(path, _key(model, device, dtype, threads), cost.to_json())
    return path


def cost_model(cache_dir: Optional[str], model: str, device: str, dtype: str, threads: int,
               machine: Optional[str] = None, version: Optional[int] = None) -> Optional[CostModel]:
    """The saved profile, or None (none saved, unreadable, measured on another ``machine``, or by
    an older measurement than ``version``: ``meta.version``, 1 when absent)."""
    data = _load(device_profile_path(cache_dir)).get(_key(model, device, dtype, threads))
    if data is None:
        return None
    try:
        cost = CostModel.from_json(data)
    except (ValueError, TypeError):
        return None
    if machine is not None and cost.meta.get("machine") != machine:
        return None
    if version is not None and cost.meta.get("version", 1) < version:
        return None
    return cost
