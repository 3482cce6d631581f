"""A small classification head trained on frozen, cached features (torch, CPU).

The ``lm`` backend's head: the paper fine-tunes OPT-125M with a sequence-classification head;
on a CPU we keep the backbone frozen, cache its pooled features once, and train only this::

    x [n, hidden] -> standardise -> Linear(hidden, width) -> GELU -> Dropout -> Linear(width, K)

(``width = 0`` makes it a single linear layer, i.e. exactly the HF classification head.)
A slice of the training rows (by a hash of the row index, so runs are reproducible) picks the
epoch to keep: the head is small and the data noisy, so over-fitting comes quickly.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class HeadConfig:
    width: int = 256
    dropout: float = 0.2
    lr: float = 1e-3
    weight_decay: float = 1e-2
    epochs: int = 60
    batch_size: int = 256
    val_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self):
        if self.width < 0 or self.epochs < 1 or self.batch_size < 1:
            raise ValueError("head width must be >= 0, epochs and batch_size >= 1")
        if not 0 <= self.dropout < 1 or not 0 <= self.val_fraction < 1:
            raise ValueError("dropout and val_fraction must be in [0, 1)")


def build_head(dim: int, num_classes: int, cfg: HeadConfig) -> torch.nn.Module:
    if cfg.width == 0:
        return torch.nn.Linear(dim, num_classes)
    return torch.nn.Sequential(torch.nn.Linear(dim, cfg.width), torch.nn.GELU(), torch.nn.Dropout(cfg.dropout),
                               torch.nn.Linear(cfg.width, num_classes))


class Head:
    """Standardisation statistics plus the torch module; ``probs(x)`` gives bucket probabilities."""

    def __init__(self, dim: int, num_classes: int, cfg: HeadConfig = HeadConfig()):
        self.cfg, self.num_classes = cfg, num_classes
        self.mean, self.std = np.zeros(dim, np.float32), np.ones(dim, np.float32)
        self.net = build_head(dim, num_classes, cfg)

    def _tensor(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x - self.mean) / self.std).astype(np.float32))

    def fit(self, x: np.ndarray, y: np.ndarray) -> "Head":
        torch.manual_seed(self.cfg.seed)
        self.mean, self.std = x.mean(0).astype(np.float32), (x.std(0) + 1e-6).astype(np.float32)
        # a fixed, scattered slice of the rows picks the epoch (none for tiny sets: too few to tell)
        val = (np.arange(len(y)) * 2654435761 % 1000) < self.cfg.val_fraction * 1000
        if len(y) < 50:
            val[:] = False
        xt, yt = self._tensor(x[~val]), torch.from_numpy(y[~val].astype(np.int64))
        xv, yv = self._tensor(x[val]), y[val]
        opt = torch.optim.AdamW(self.net.parameters(), lr=self.cfg.lr, weight_decay=self.cfg.weight_decay)
        best, best_state = -1.0, None
        gen = torch.Generator().manual_seed(self.cfg.seed)
        for _ in range(self.cfg.epochs):
            self.net.train()
            for idx in torch.randperm(len(yt), generator=gen).split(self.cfg.batch_size):
                loss = torch.nn.functional.cross_entropy(self.net(xt[idx]), yt[idx])
                opt.zero_grad()
                loss.backward()
                opt.step()
            if val.any():
                acc = float((self._predict_t(xv).argmax(1).numpy() == yv).mean())
                if acc > best:  # keep the epoch that generalises best, not the last one
                    best, best_state = acc, {k: v.clone() for k, v in self.net.state_dict().items()}
        if best_state is not None:
            self.net.load_state_dict(best_state)
        self.net.eval()
        return self

    @torch.inference_mode()
    def _predict_t(self, xt: torch.Tensor) -> torch.Tensor:
        self.net.eval()
        return torch.softmax(self.net(xt), dim=-1)

    def probs(self, x: np.ndarray) -> np.ndarray:
        """Bucket probabilities ``[n, K]``."""
        return self._predict_t(self._tensor(x)).numpy()

    def state(self) -> dict[str, torch.Tensor]:
        state = {f"net.{k}": v for k, v in self.net.state_dict().items()}
        return {**state, "mean": torch.from_numpy(self.mean), "std": torch.from_numpy(self.std)}

    def load_state(self, state: dict[str, torch.Tensor]) -> None:
        self.mean, self.std = state["mean"].numpy(), state["std"].numpy()
        self.net.load_state_dict({k[4:]: v for k, v in state.items() if k.startswith("net.")})
        self.net.eval()

    def memory_bytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.state().values())
