"""A growable inner-product index over unit vectors, with the output length of each row.

Exact search (a matrix product, then ``argpartition``) in numpy; with 27k rows of 384 floats it
takes about a millisecond per query, so an approximate index buys nothing at this size. When
``faiss`` is importable and the index is large, ``IndexFlatIP`` does the same search faster.

Online use: ``add`` may run on the owner's thread while ``search`` runs on the predictor's
thread. Invariant that makes this safe without a lock: rows ``[0, size)`` are always complete,
since a row is written before ``size`` grows, and growth swaps in a new array (a reader holding
the old one still sees a complete prefix). Past ``capacity`` rows, the oldest are replaced
(a ring), so the index follows the workload as it drifts.
"""
from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np

FAISS_MIN_ROWS = 50_000


class VectorIndex:
    """Unit vectors ``[n, d]`` with lengths ``[n]``; ``search`` returns cosine similarities."""

    def __init__(self, dim: int, capacity: int = 200_000):
        if dim < 1 or capacity < 1:
            raise ValueError("index dim and capacity must be >= 1")
        self.dim, self.capacity = dim, capacity
        self._vecs = np.zeros((min(1024, capacity), dim), np.float32)
        self._lengths = np.zeros(len(self._vecs), np.int32)
        self.size, self._next = 0, 0  # rows filled; where the next row goes (wraps at capacity)
        self._faiss = importlib.util.find_spec("faiss") is not None

    def add(self, vecs: np.ndarray, lengths) -> None:
        vecs = np.asarray(vecs, np.float32).reshape(-1, self.dim)
        lengths = np.asarray(lengths, np.int32).reshape(-1)
        if len(vecs) != len(lengths):
            raise ValueError(f"{len(vecs)} vectors but {len(lengths)} lengths")
        for v, n in zip(vecs, lengths):
            self._add_one(v, int(n))

    def _add_one(self, vec: np.ndarray, length: int) -> None:
        if self._next == len(self._vecs) and len(self._vecs) < self.capacity:
            grown = min(self.capacity, 2 * len(self._vecs))
            vecs, lens = np.zeros((grown, self.dim), np.float32), np.zeros(grown, np.int32)
            vecs[:self.size], lens[:self.size] = self._vecs[:self.size], self._lengths[:self.size]
            self._vecs, self._lengths = vecs, lens  # swap after the copy: readers see a full prefix
        slot = self._next % self.capacity
        self._vecs[slot], self._lengths[slot] = vec, length
        self._next = slot + 1
        self.size = max(self.size, slot + 1)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` ``(similarities, lengths)``, each ``[m, k']`` with ``k' = min(k, size)``, best first."""
        vecs, lens, n = self._vecs, self._lengths, self.size
        queries = np.asarray(queries, np.float32).reshape(-1, self.dim)
        k = min(k, n)
        if k == 0:
            return np.zeros((len(queries), 0), np.float32), np.zeros((len(queries), 0), np.int32)
        if self._faiss and n >= FAISS_MIN_ROWS:
            return self._faiss_search(vecs[:n], lens[:n], queries, k)
        sims = queries @ vecs[:n].T  # [m, n]
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        top_sims = np.take_along_axis(sims, top, axis=1)
        order = np.argsort(-top_sims, axis=1)
        top = np.take_along_axis(top, order, axis=1)
        return np.take_along_axis(top_sims, order, axis=1), lens[top]

    @staticmethod
    def _faiss_search(vecs, lens, queries, k):
        import faiss

        index = faiss.IndexFlatIP(vecs.shape[1])
        index.add(vecs)
        sims, top = index.search(queries, k)
        return sims, lens[top]

    def memory_bytes(self) -> int:
        return self._vecs.nbytes + self._lengths.nbytes

    def save(self, path: Path) -> None:
        # float16 halves the file; similarities move by ~1e-3, far below any threshold's resolution
        np.savez(path, vecs=self._vecs[:self.size].astype(np.float16), lengths=self._lengths[:self.size],
                 capacity=self.capacity)

    @staticmethod
    def load(path: Path) -> "VectorIndex":
        with np.load(path) as data:
            vecs = data["vecs"].astype(np.float32)
            index = VectorIndex(vecs.shape[1], int(data["capacity"]))
            index.add(vecs, data["lengths"])
        return index
