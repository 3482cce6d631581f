"""The length predictor online: one per cluster, on its own thread, feeding ``Request.predicted``.

    submit ─start()─► requests that arrived together, one batch ─► predictor thread: a view of each
                      (text clipped, or decoded from the ids) -> backend.predict -> LengthRange
      parallel:   the prefill runs meanwhile; the KV handoff awaits the range (attach) before the
                  dispatcher reads it (TetriInfer's default)
      sequential: the request waits for its range before it enters the prefill queue (adds to TTFT)
      coupled:    the range is on the request before the coupled scheduler sees it when the batching
                  policy reads predictions (alise); vllm and sarathi do not wait (it is only scored)
      prefill features: a backend whose backbone is the served model's first layers (lm) does not
                  run them again where the served prefill computes them: at submit, a request whose
                  prompt ids are exactly what the backbone would read (its text as one chat turn,
                  within the backbone's token cut) is marked (``Request.feature_layer``); its prompt's
                  last chunk returns that token's state after those layers (``feed``), and the head
                  answers at once, before the handoff. Other requests take the path above.
    _finish ─finish()─► score (a hit: the actual length's bucket is the predicted one, the last
                        bucket open-ended up to max_tokens) and observe (on the predictor thread:
                        retrieval adds the request to its index, the backends' online learning)

A prediction that raises, or is not ready ``timeout_s`` after it started (or by the handoff, when
that comes later), is dropped: the request goes on with ``predicted = None`` (what ``none``
gives) and the fallback is counted by reason (timeout | error | unknown: the oracle has no true
length). Nothing here is ever an error for the client.

On a virtual clock (a simulated device, aserve/devices/virtual_time.py) a thread's work would
take no simulated time while the clock jumps ahead of it (every sklearn prediction of a simulated
replay timed out at 3 s of virtual time): there the predictor thread is modelled instead. Its
work runs on the loop when it is asked for, is timed, and its answer lands on the virtual clock
that long after the thread's earlier work ends (one thread: predictions and learning queue up as
they would). The served prefill's features (``feed``) are answered that long after, too.

Thread rule: jobs, counters and requests change on the event-loop thread only. The predictor
thread reads a request's fixed fields (ids, text, sampling) and builds its own view of it, and
reads a job's ``settled`` flag to skip predictions nobody waits for any more.
"""
from __future__ import annotations

import asyncio
import bisect
import collections
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional

from predictors.base import LengthPredictor, prompt_of
from predictors.serving import load_for_serving, prompt_view
from predictors.simple import UnknownLength
from scheduling.request import LengthRange, Request

if TYPE_CHECKING:
    from aserve.config import ClusterConfig

FALLBACK_REASONS = ("timeout", "error", "unknown")
MAX_BATCH = 8  # requests in one predict call: a batch is answered at once, and on CPU the encoders
# (lm, retrieval) go prompt by prompt anyway, so smaller batches let a burst's first requests go sooner
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


# ---- counters -----------------------------------------------------------------------------------
@dataclass
class LatencyHistogram:
    """Prediction latencies: Prometheus-style bucket counts plus the recent ones for percentiles."""

    bounds: tuple = LATENCY_BUCKETS
    counts: list = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS) + 1))  # last: above every bound
    sum_s: float = 0.0
    recent: collections.deque = field(default_factory=lambda: collections.deque(maxlen=2048))

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.sum_s += seconds
        self.recent.append(seconds)

    def quantile(self, q: float, since: int = 0) -> Optional[float]:
        """The ``q`` quantile of the latencies observed after the first ``since`` (of those
        ``recent`` still holds); None when there are none."""
        new = sum(self.counts) - since
        if new <= 0 or not self.recent:
            return None
        ordered = sorted(self.recent if new >= len(self.recent) else list(self.recent)[-new:])
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    def snapshot(self) -> dict:
        cumulative, total = [], 0
        for bound, n in zip(self.bounds, self.counts):
            total += n
            cumulative.append([bound, total])
        return {"count": sum(self.counts), "sum_s": self.sum_s, "p50_s": self.quantile(0.5),
                "p99_s": self.quantile(0.99), "buckets": cumulative}


@dataclass(frozen=True)
class _Outcome:
    range: Optional[LengthRange]
    reason: Optional[str] = None  # a fallback reason when range is None
    error: Optional[str] = None


TIMED_OUT = _Outcome(None, "timeout", None)


def _failure(e: BaseException) -> _Outcome:
    return _Outcome(None, "unknown" if isinstance(e, UnknownLength) else "error", f"{type(e).__name__}: {e}")


@dataclass
class _Job:
    request: Request
    start: float  # loop time
    future: asyncio.Future  # -> _Outcome (never an exception: nobody has to retrieve one)
    view: Optional[Request] = None  # what the backend saw (set once the thread answered; at start for prefill features)
    settled: bool = False  # the outcome reached the request (or the timeout did)
    from_prefill: bool = False  # answered by ``feed`` from the prefill's features


# ---- the online predictor -----------------------------------------------------------------------
class OnlinePredictor:
    """Owned by the Cluster: ``load`` once (off the loop), then ``start`` at submit, ``attach``
    where the range must be on the request, ``finish`` when the request ends."""

    def __init__(self, cfg: "ClusterConfig"):
        self.cfg = cfg
        self.name, self.granularity, self.mode = cfg.predictor, cfg.predictor_granularity, cfg.predictor_mode
        self.timeout_s = cfg.predictor_timeout_s
        self.backend: Optional[LengthPredictor] = None
        self._decode: Optional[Callable[[list[int]], str]] = None
        self._jobs: dict[str, _Job] = {}
        self._queue: list[_Job] = []
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self.latency = LatencyHistogram()
        self.counts = {"predictions": 0, "scored": 0, "hits": 0, "observed": 0, "observe_errors": 0, "from_prefill": 0,
                       **{f"fallback_{r}": 0 for r in FALLBACK_REASONS}}
        self.last_error: Optional[str] = None
        self.feature_layer = 0  # > 0: features from the served prefill after this many layers
        self._virtual = False  # the loop runs on a virtual clock: the predictor thread is modelled
        self._thread_free_at = 0.0  # there: when the modelled thread has done what it was given

    def load(self, decode: Optional[Callable[[list[int]], str]] = None, served_model: Optional[tuple] = None,
             at_handoff: bool = False) -> None:
        """Build the backend (loading, maybe fitting: seconds). ``decode`` turns prompt ids into
        text for requests that come without it; ``served_model`` (the served model's name and
        checkpoint folder) and ``at_handoff`` (predictions are awaited at the KV handoff, after
        the prefill) decide whether the backend can read its features from the prefill
        (``predictor_features``)."""
        self._decode = decode
        cfg = self.cfg
        self.backend = load_for_serving(cfg.predictor, cfg.predictor_granularity, dict(cfg.predictor_options),
                                        cfg.predictor_path, cfg.predictor_labels, cfg.predictor_prompts)
        if self.backend is not None and not self.backend.inline:
            self.backend.mode = "parallel"  # its own thread, whatever mode the artefact was saved in
        if self.backend is not None:
            self.backend.cover = cfg.predictor_cover  # a serving choice: the artefact holds none
        if self.backend is not None and cfg.predictor_features != "prompt" and served_model is not None and at_handoff:
            self.feature_layer = self.backend.feature_layer(*served_model)
        if self.feature_layer:  # the tokenizer the submit-time check needs, loaded here, off the loop
            self.backend.feature_ids(Request("warm-up", [1], prompt_text="warm-up"))
        if cfg.predictor_features == "prefill" and not self.feature_layer:
            raise ValueError(f"predictor_features 'prefill': the {cfg.predictor!r} predictor's backbone is not the "
                             f"served model's first layers, so the prefill has no features for it")

    def close(self) -> None:
        """Stop the predictor thread after the work queued on it (blocks: call it off the loop)."""
        if self.backend is not None:
            self.backend.close()

    # ---- predicting ------------------------------------------------------------------------------
    def start(self, req: Request) -> None:
        """Begin predicting ``req`` (at submit); requests submitted in one loop turn share a batch."""
        if self.backend is None or req.request_id in self._jobs:
            return
        self._loop = asyncio.get_running_loop()
        self._virtual = getattr(self._loop, "clock", None) is not None
        job = _Job(req, self._loop.time(), self._loop.create_future())
        self._jobs[req.request_id] = job
        view = self._view_read_as_trained(req) if self.feature_layer else None
        if view is not None:
            job.from_prefill, job.view = True, view
            req.feature_layer = self.feature_layer  # the prefill's last chunk returns the features (feed)
            return
        if self.backend.inline:  # none / oracle: microseconds, no thread hop
            try:
                outcome = _Outcome(self.backend.predict([req])[0])
            except Exception as e:  # noqa: BLE001 - a predictor's failure is a fallback, never the client's error
                outcome = _failure(e)
            self._answer(job, outcome, self._loop.time())
            return
        self._queue.append(job)
        if len(self._queue) == 1:
            self._loop.call_soon(self._flush)

    def _view_read_as_trained(self, req: Request) -> Optional[Request]:
        """``req`` as the backend sees it, if its prompt ids are what the backbone reads for its
        text (then the served prefill's state at its last token is the backend's feature), else
        None: one tokenisation on the loop."""
        try:
            view = prompt_view(req, self._decode)
            return view if self.backend.feature_ids(view) == req.prompt_token_ids else None
        except Exception:  # noqa: BLE001 - no text, a template that refuses it: the usual path
            return None

    def feed(self, features: dict) -> None:
        """The prefill's features ({request_id: [hidden]}) of requests marked at ``start``: the head
        answers each at once (a small MLP, on the loop), so the handoff finds its range ready."""
        for rid, vec in features.items():
            job = self._jobs.get(rid)
            if job is None or not job.from_prefill or job.future.done():
                continue  # a re-run's second prefill, or nobody waits
            job.start = self._loop.time()  # the prediction starts when its input exists
            began = time.perf_counter()
            try:
                outcome = _Outcome(self.backend.predict_features(vec.numpy()[None, :], [job.view])[0])
                self.counts["from_prefill"] += 1
            except Exception as e:  # noqa: BLE001
                outcome = _failure(e)
            if self._virtual:  # the head's time, which on a real device the loop spends here
                at = job.start + time.perf_counter() - began
                self._loop.call_at(at, self._answer, job, outcome, at)
            else:
                self._answer(job, outcome, self._loop.time())

    def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[:MAX_BATCH], self._queue[MAX_BATCH:]
            if self._virtual:
                result, error, at = self._as_on_thread(self._predict_batch, batch)
                self._loop.call_at(at, self._answer_batch, batch, result, error)
                continue
            try:
                done = self.backend.run_async(self._predict_batch, batch)
            except RuntimeError as e:  # the thread is shut down (the cluster is stopping)
                self._answer_batch(batch, None, e)
                continue
            done.add_done_callback(lambda f, b=batch: self._to_loop(self._answered, b, f))

    def _predict_batch(self, jobs: list[_Job]) -> tuple[list[Optional[_Outcome]], list[Optional[Request]]]:
        """On the predictor thread: a view of each request, then one ``predict`` for the usable ones.
        A job already settled (its wait timed out while it sat in the queue) is skipped: nobody reads
        its answer, and computing it anyway makes every later request in a backlog late too."""
        outcomes: list[Optional[_Outcome]] = [None] * len(jobs)
        views: list[Optional[Request]] = [None] * len(jobs)
        for i, job in enumerate(jobs):
            if job.settled:
                outcomes[i] = TIMED_OUT
                continue
            req = job.request
            try:
                views[i] = prompt_view(req, self._decode)
                prompt_of(views[i])  # an empty prompt fails alone, not its whole batch
            except Exception as e:  # noqa: BLE001
                views[i], outcomes[i] = None, _failure(e)
        usable = [i for i, v in enumerate(views) if v is not None]
        for i, rng in zip(usable, self.backend.predict([views[i] for i in usable]) if usable else []):
            outcomes[i] = _Outcome(rng)
        return outcomes, views

    def _as_on_thread(self, fn, *args):
        """Virtual clock: ``fn(*args)`` now, on the loop, timed; (its result, its error, the
        virtual time the predictor thread would have finished it: after its earlier work, as long
        as it took here)."""
        began = time.perf_counter()
        try:
            result, error = fn(*args), None
        except Exception as e:  # noqa: BLE001 - read by the caller, as a thread's future would give it
            result, error = None, e
        start = max(self._loop.time(), self._thread_free_at)
        self._thread_free_at = start + time.perf_counter() - began
        return result, error, self._thread_free_at

    def _to_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass

    def _answered(self, batch: list[_Job], done) -> None:
        try:
            outcomes, views = done.result()
        except Exception as e:  # noqa: BLE001
            self._answer_batch(batch, None, e)
            return
        self._answer_batch(batch, (outcomes, views), None)

    def _answer_batch(self, batch: list[_Job], result, error: Optional[BaseException]) -> None:
        now = self._loop.time()
        for i, job in enumerate(batch):
            if result is None:
                self._answer(job, _failure(error), now)
            else:
                job.view = result[1][i]
                self._answer(job, result[0][i], now)

    def _answer(self, job: _Job, outcome: _Outcome, now: float) -> None:
        if outcome.range is not None:
            self.latency.observe(now - job.start)
        if not job.future.done():
            job.future.set_result(outcome)

    # ---- attaching ---------------------------------------------------------------------------------
    def try_attach(self, req: Request) -> bool:
        """Settle ``req``'s prediction now if it is ready or there is none to wait for; False
        when the caller has to ``await attach(req)``."""
        job = self._jobs.get(req.request_id)
        if job is None or job.settled:
            return True
        if not job.future.done():
            return False
        self._settle(job, job.future.result())
        return True

    async def attach(self, req: Request) -> None:
        """Put ``req``'s predicted range on it, waiting until ``timeout_s`` after the prediction
        started at most; a miss or a failure leaves ``predicted`` None and counts a fallback."""
        job = self._jobs.get(req.request_id)
        if job is None or job.settled:
            return
        if not job.future.done():
            wait = job.start + self.timeout_s - asyncio.get_running_loop().time()
            try:
                await asyncio.wait_for(asyncio.shield(job.future), max(0.0, wait))
            except asyncio.TimeoutError:
                pass
        if not job.settled:  # another waiter (a re-run's handoff) may have settled it meanwhile
            self._settle(job, job.future.result() if job.future.done() else TIMED_OUT)

    def _settle(self, job: _Job, outcome: _Outcome) -> None:
        job.settled = True
        if outcome.range is not None:
            job.request.predicted = outcome.range
            self.counts["predictions"] += 1
            return
        self.counts[f"fallback_{outcome.reason}"] += 1
        self.last_error = outcome.error or self.last_error

    # ---- learning ----------------------------------------------------------------------------------
    def finish(self, req: Request) -> None:
        """``req`` ended: score its prediction and let the backend learn its length (stop or
        length only: an abort or an error says nothing about the length)."""
        job = self._jobs.pop(req.request_id, None)
        if self.backend is None or req.finish_reason not in ("stop", "length"):
            return
        actual = req.num_output_tokens
        if req.predicted is not None:
            self.counts["scored"] += 1
            self.counts["hits"] += self.backend.buckets.bucket_of(actual) == req.predicted.bucket
        if type(self.backend).observe is LengthPredictor.observe:
            return  # the backend does not learn online
        if self.backend.inline:  # the oracle's table is keyed by the request's text: none, nothing to learn
            if req.prompt_text.strip():
                self._to_counts(self._observe(req, req, actual))
            return
        view = job.view if job is not None else None
        if self._virtual:
            error, _, at = self._as_on_thread(self._observe, req, view, actual)
            self._loop.call_at(at, self._to_counts, error)
            return
        try:
            done = self.backend.run_async(self._observe, req, view, actual)
        except RuntimeError:  # the thread is shut down (the cluster is stopping)
            return
        done.add_done_callback(lambda f: self._to_loop(self._to_counts, f.result()))

    def _observe(self, req: Request, view: Optional[Request], actual: int) -> Optional[str]:
        """On the predictor thread (inline backends: the loop's); the error, if any, as text."""
        try:
            self.backend.observe(view or prompt_view(req, self._decode), actual)
        except Exception as e:  # noqa: BLE001 - learning must not hurt serving
            return f"{type(e).__name__}: {e}"
        return None

    def _to_counts(self, error: Optional[str]) -> None:
        self.counts["observe_errors" if error else "observed"] += 1

    # ---- views ---------------------------------------------------------------------------------------
    def snapshot(self) -> dict:
        """The ``predictor`` object of /v1/stats (also what /metrics reads)."""
        c = self.counts
        fallbacks = {r: c[f"fallback_{r}"] for r in FALLBACK_REASONS}
        latency = self.latency.snapshot()
        return {"name": self.name, "granularity": self.granularity, "mode": self.mode, "timeout_s": self.timeout_s,
                "predictions": c["predictions"], "fallbacks": sum(fallbacks.values()), "fallback_reasons": fallbacks,
                "hits": c["hits"], "scored": c["scored"],
                "accuracy": c["hits"] / c["scored"] if c["scored"] else None,
                "latency_p50_s": latency["p50_s"], "latency": latency, "in_flight": len(self._jobs),
                "observed": c["observed"], "observe_errors": c["observe_errors"], "last_error": self.last_error,
                "features": f"prefill (layer {self.feature_layer})" if self.feature_layer else "prompt",
                "from_prefill": c["from_prefill"]}
