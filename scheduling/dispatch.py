"""Dispatch: which decode instance takes a request once its prefill is done (TetriInfer §3.3.3).

A prefill instance sees the decode instances only through the loads the cluster monitor last
broadcast. Between two broadcasts the dispatcher adds what it sent itself to that view, so a
burst of finished prefills is not all sent to the instance that looked emptiest at the last
broadcast; the next broadcast replaces the view.

A decode is *heavy* when its predicted output upper bound exceeds ``heavy_threshold`` (128
tokens in the paper). Heavy decodes grow the KV cache for long and slow each step they share;
the ``interference`` policy spreads them, ``imbalance`` piles them on one instance (Figure 19).
"""
from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Hashable, Iterable

from scheduling.block_manager import blocks_needed
from scheduling.request import Request


class NoDecodeInstance(RuntimeError):
    """Raised by ``choose`` when no decode instance is known."""


def predicted_max_output(request: Request) -> int:
    """Safe upper bound of the request's output tokens, the bound memory policies must use.

    A prediction is a bucket ``[lo, hi)``, so the output has at most ``hi - 1`` tokens; without a
    prediction (the ``none``/``oracle``-less case) ``max_tokens`` is the only bound there is.
    Never more than ``max_tokens`` and never less than 1 (the first token always exists).
    """
    bound = request.sampling.max_tokens
    if request.predicted is not None:
        bound = min(bound, request.predicted.hi - 1)
    return max(1, bound)


def expected_output(request: Request) -> float:
    """The output a cost estimate expects: the predicted bucket's middle, else ``max_tokens``
    (where nothing is predicted, the bound is all there is); at least 1."""
    bound = request.sampling.max_tokens
    if request.predicted is not None:
        bound = min(bound, (request.predicted.lo + request.predicted.hi - 1) / 2)
    return max(1.0, bound)


def is_heavy(request: Request, heavy_threshold: int) -> bool:
    """A heavy decode: predicted output upper bound above ``heavy_threshold`` tokens."""
    return predicted_max_output(request) > heavy_threshold


def predicted_total_blocks(request: Request, block_size: int) -> int:
    """Blocks the request's KV is predicted to need at its end: prompt + predicted output."""
    return blocks_needed(request.num_prompt_tokens + predicted_max_output(request), block_size)


@dataclass(frozen=True)
class DecodeLoad:
    """One decode instance's load, as broadcast by the cluster monitor."""

    instance_id: Hashable
    free_blocks: int
    total_blocks: int
    num_heavy: int
    num_light: int
    block_size: int

    def __post_init__(self):
        assert 0 <= self.free_blocks <= self.total_blocks, (self.free_blocks, self.total_blocks)
        assert self.num_heavy >= 0 and self.num_light >= 0 and self.block_size > 0

    def fits(self, request: Request) -> bool:
        """Enough free blocks for the prompt plus the predicted output upper bound."""
        return predicted_total_blocks(request, self.block_size) <= self.free_blocks


@dataclass(frozen=True)
class DispatchConfig:
    heavy_threshold: int = 128  # output tokens; the paper's split between light and heavy
    seed: int = 0  # for the random choices (power-of-two, random)

    def __post_init__(self):
        if self.heavy_threshold < 0:
            raise ValueError(f"heavy_threshold must be >= 0, got {self.heavy_threshold}")


class Dispatcher:
    """Base class: keeps the view of decode loads; subclasses implement ``pick``.

    Use: ``update_loads(loads)`` on every broadcast (it lists the instances that may be chosen:
    active decode instances only), ``choose(request)`` per finished prefill.
    """

    name = "base"

    def __init__(self, config: DispatchConfig = DispatchConfig()):
        self.config = config
        self.rng = random.Random(config.seed)
        self._view: dict[Hashable, DecodeLoad] = {}

    # --- view -----------------------------------------------------------------------------
    def update_loads(self, loads: Iterable[DecodeLoad]) -> None:
        """A new broadcast: it replaces the whole view, including what was added since."""
        self._view = {load.instance_id: load for load in loads}

    def view(self) -> tuple[DecodeLoad, ...]:
        """The current view of every known instance, sorted by id so that policies are
        deterministic given a seed."""
        return tuple(self._view[i] for i in sorted(self._view, key=str))

    # --- choice ---------------------------------------------------------------------------
    def heavy(self, request: Request) -> bool:
        return is_heavy(request, self.config.heavy_threshold)

    def choose(self, request: Request) -> Hashable:
        """The decode instance for ``request``; adds the request to the view of that instance."""
        loads = list(self.view())
        if not loads:
            raise NoDecodeInstance("no decode instance is known")
        chosen = self.pick(request, loads)
        self._add(chosen, request)
        return chosen.instance_id

    def pick(self, request: Request, loads: list[DecodeLoad]) -> DecodeLoad:
        raise NotImplementedError

    def _add(self, load: DecodeLoad, request: Request) -> None:
        # The instance will hold the prompt now and grow towards the predicted bound; counting
        # the whole predicted need is the conservative view until the next broadcast corrects it.
        need = predicted_total_blocks(request, load.block_size)
        heavy = self.heavy(request)
        self._view[load.instance_id] = dataclasses.replace(
            load,
            free_blocks=max(0, load.free_blocks - need),
            num_heavy=load.num_heavy + heavy,
            num_light=load.num_light + (not heavy),
        )


def _most_free(loads: list[DecodeLoad]) -> DecodeLoad:
    # max keeps the first of equals, and loads are sorted by id: deterministic ties.
    return max(loads, key=lambda load: load.free_blocks)


class InterferenceDispatcher(Dispatcher):
    """TetriInfer's policy: power-of-two among instances with room, least heavy interference.

    Instances with enough free blocks for prompt + predicted upper bound form the set α; two
    are drawn at random from α (the one, if α has one). Of the two, the request goes to the one
    with fewer heavy decodes, then the lower heavy:light ratio after adding it, then more free
    blocks. With α empty, the instance with most free blocks.

    Why heavy count first: ranking by the ratio alone feeds on itself (light decodes flock to
    instances with few heavy ones, whose many lights then make the ratio attract heavy ones),
    and in simulation one instance ended with 14 more heavy decodes than another out of 32.
    The random pair is what keeps several prefill instances with stale views from herding.
    """

    name = "interference"

    def pick(self, request: Request, loads: list[DecodeLoad]) -> DecodeLoad:
        roomy = [load for load in loads if load.fits(request)]
        if not roomy:
            return _most_free(loads)
        pair = self.rng.sample(roomy, min(2, len(roomy)))
        heavy = self.heavy(request)
        return min(pair, key=lambda load: (
            load.num_heavy, _heavy_share(load, heavy), -load.free_blocks))


def _heavy_share(load: DecodeLoad, heavy: bool) -> float:
    """heavy / (heavy + light) after adding one decode: orders instances as heavy:light does,
    and stays finite when an instance has no light decode."""
    num_heavy = load.num_heavy + heavy
    num_light = load.num_light + (not heavy)
    return num_heavy / (num_heavy + num_light)


class RandomDispatcher(Dispatcher):
    """Uniformly random instance; ignores load (baseline)."""

    name = "random"

    def pick(self, request: Request, loads: list[DecodeLoad]) -> DecodeLoad:
        return self.rng.choice(loads)


class RoundRobinDispatcher(Dispatcher):
    """Instances in turn, by id; ignores load (baseline)."""

    name = "round-robin"

    def __init__(self, config: DispatchConfig = DispatchConfig()):
        super().__init__(config)
        self._next = 0

    def pick(self, request: Request, loads: list[DecodeLoad]) -> DecodeLoad:
        chosen = loads[self._next % len(loads)]
        self._next += 1
        return chosen


class LeastLoadedDispatcher(Dispatcher):
    """The instance with most free blocks."""

    name = "least-loaded"

    def pick(self, request: Request, loads: list[DecodeLoad]) -> DecodeLoad:
        return _most_free(loads)


class ImbalanceDispatcher(Dispatcher):
    """Every heavy decode to one instance (the first by id), light ones least-loaded
    among the others: the deliberately bad placement of the paper's Figure 19."""

    name = "imbalance"

    def pick(self, request: Request, loads: list[DecodeLoad]) -> DecodeLoad:
        if self.heavy(request) or len(loads) == 1:
            return loads[0]
        return _most_free(loads[1:])
