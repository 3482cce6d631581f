"""A disk cache of pooled backbone features, keyed by backbone settings and prompt text.

Training a head over a frozen backbone is cheap; running the backbone over thousands of
prompts is not. The cache makes the second ``fit`` (another granularity, another head, a
re-run) nearly free::

    <cache>/features/<sha1 of backbone settings>.npz   hashes: [n] bytes20, feats: [n, hidden]
"""
from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np


CHUNK = 1024  # texts per compute call (and per rewrite of the cache file)


@contextlib.contextmanager
def _progress(total: int):
    """A rich progress bar for long backbone passes (thousands of prompts); silent for short ones."""
    if total < CHUNK:
        yield lambda n: None
        return
    from rich.progress import Progress

    with Progress(transient=True) as bar:
        task = bar.add_task("backbone features", total=total)
        yield lambda n: bar.update(task, advance=n)


def text_hash(text: str) -> bytes:
    return hashlib.sha1(text.encode()).digest()


class FeatureCache:
    """Pooled features for texts; computes only the missing ones and appends them to the file."""

    def __init__(self, folder: Optional[Path], settings: dict):
        key = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.file = Path(folder) / "features" / f"{key}.npz" if folder else None
        self._rows: dict[bytes, np.ndarray] = {}
        if self.file is not None and self.file.is_file():
            with np.load(self.file) as data:
                self._rows = dict(zip((bytes(h) for h in data["hashes"]), data["feats"]))

    def get(self, texts: Sequence[str], compute: Callable[[list[str]], np.ndarray]) -> np.ndarray:
        """Features for ``texts`` in order; ``compute`` runs on the texts not cached yet, a chunk at
        a time, and the file is rewritten after each chunk (a killed run keeps what it did)."""
        hashes = [text_hash(t) for t in texts]
        missing = list({h: t for h, t in zip(hashes, texts) if h not in self._rows}.items())
        with _progress(len(missing)) as advance:
            for start in range(0, len(missing), CHUNK):
                part = missing[start:start + CHUNK]
                self._rows.update(zip((h for h, _ in part), compute([t for _, t in part])))
                self._write()
                advance(len(part))
        return np.stack([self._rows[h] for h in hashes]) if hashes else np.zeros((0, 0), np.float32)

    def _write(self) -> None:
        if self.file is None:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp.npz")
        hashes = np.array(list(self._rows.keys()), dtype="S20")
        np.savez(tmp, hashes=hashes, feats=np.stack(list(self._rows.values())).astype(np.float32))
        tmp.replace(self.file)  # atomic: a killed run never leaves half a cache
