"""Measured engine figures kept between runs (``~/.cache/aserve/profile.json``).

``aserve bench engine`` records the ``saturate_chunk`` it finds for a (model, device, dtype);
the prefill instances' chunk size defaults to it (TetriInfer's ChunkSize), else 512.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

DEFAULT_CHUNK = 512


def _path(cache_dir: Optional[str]) -> Path:
    from model.loader import default_cache_dir

    return Path(cache_dir or default_cache_dir()) / "profile.json"


def _key(model: str, device: str, dtype: str) -> str:
    return f"{model}|{device.split(':')[0]}|{dtype}"


def save_saturate_chunk(cache_dir: Optional[str], model: str, device: str, dtype: str, chunk: int) -> None:
    path = _path(cache_dir)
    data = json.loads(path.read_text()) if path.is_file() else {}
    data[_key(model, device, dtype)] = {"saturate_chunk": chunk}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def saturate_chunk(cache_dir: Optional[str], model: str, device: str, dtype: str) -> int:
    """The profiled chunk size, or 512 when this model/device/dtype was never profiled."""
    path = _path(cache_dir)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return DEFAULT_CHUNK
    return int(data.get(_key(model, device, dtype), {}).get("saturate_chunk", DEFAULT_CHUNK))
