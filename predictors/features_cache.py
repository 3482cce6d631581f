"""A disk cache of pooled backbone features, keyed by backbone settings and prompt text.

Training a head over a frozen backbone is cheap; running the backbone over thousands of
prompts is not. The cache makes the second ``fit`` (another granularity, another head, a
re-run) nearly free::

    <cache>/features/<sha1 of backbone settings>.npz   hashes: [n] bytes20, feats: [n, hidden]
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np

from predictors.progress import StepProgress


CHUNK = 1024  # texts per rewrite of the cache file (a killed run keeps what it did)
STEP = 32  # texts per compute call: how often the progress moves (the CPU encoder goes one prompt at a time anyway)
MIN_PROGRESS = 16  # fewer missing texts than this take a second or two: no progress shown


def text_hash(text: str) -> bytes:
    return hashlib.sha1(text.encode()).digest()


class FeatureCache:
    """Pooled features for texts; computes only the missing ones and appends them to the file."""

    def __init__(self, folder: Optional[Path], settings: dict, name: str = "predictor"):
        self.name = name  # who computes: the progress line says "<name>: backbone features ..."
        key = hashlib.sha1(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()[:16]
        self.file = Path(folder) / "features" / f"{key}.npz" if folder else None
        self._rows: dict[bytes, np.ndarray] = {}
        if self.file is not None and self.file.is_file():
            with np.load(self.file) as data:
                self._rows = dict(zip((bytes(h) for h in data["hashes"]), data["feats"]))

    def get(self, texts: Sequence[str], compute: Callable[[list[str]], np.ndarray]) -> np.ndarray:
        """Features for ``texts`` in order; ``compute`` runs on the texts not cached yet, ``STEP`` at
        a time (with progress and an ETA on stderr when there are many), and the file is rewritten
        every ``CHUNK`` texts and at the end (a killed run keeps what it did)."""
        hashes = [text_hash(t) for t in texts]
        missing = list({h: t for h, t in zip(hashes, texts) if h not in self._rows}.items())
        total = len(missing) if len(missing) >= MIN_PROGRESS else 0
        with StepProgress(f"{self.name}: backbone features", total) as progress:
            for start in range(0, len(missing), STEP):
                part = missing[start:start + STEP]
                self._rows.update(zip((h for h, _ in part), compute([t for _, t in part])))
                progress.advance(len(part))
                if (start + STEP) % CHUNK == 0 or start + STEP >= len(missing):
                    self._write()
        return np.stack([self._rows[h] for h in hashes]) if hashes else np.zeros((0, 0), np.float32)

    def _write(self) -> None:
        if self.file is None:
            return
        self.file.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.file.with_suffix(".tmp.npz")
        hashes = np.array(list(self._rows.keys()), dtype="S20")
        np.savez(tmp, hashes=hashes, feats=np.stack(list(self._rows.values())).astype(np.float32))
        tmp.replace(self.file)  # atomic: a killed run never leaves half a cache
