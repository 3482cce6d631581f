"""The main model's prefill slowdown while a predictor runs beside it (TetriInfer §3.3.2: the
paper runs its OPT-125M predictor in parallel with the prefill and measures about 10%).

In the server the predictor has a thread of its own next to the prefill instance's engine
(``aserve/predict/online.py``), so this measures the same arrangement: one prompt chunk of the
served model on the calling thread, timed alone and again while a second thread predicts
without pause (one request at a time, cycling through ``requests``). Both sides use the torch
threads the caller set (one, as in the server). What they share is the cores, the memory
bandwidth and, for backends that run Python, the GIL: all of it shows in the slowdown.
"""
from __future__ import annotations

import statistics
import threading
import time
from typing import Optional, Sequence

from scheduling.request import Request


def prefill_slowdown(predictor, requests: Sequence[Request], chunk: int = 512, reps: int = 5,
                     model: str = "default", dtype: str = "auto") -> dict:
    """``{"chunk", "alone_ms", "with_predictor_ms", "slowdown", "predictions_meanwhile"}``
    (medians of ``reps`` chunks each)."""
    import torch

    from aserve.config import EngineConfig
    from aserve.engine.bundle import ModelBundle
    from aserve.devices.torch_device import build_runner
    from scheduling.step import SeqStep, StepPlan

    cfg = EngineConfig(model=model, dtype=dtype, kv_cache_gb=0.05, num_threads=torch.get_num_threads())
    bundle = ModelBundle.load(cfg)
    runner, blocks = build_runner(bundle, cfg)
    block_ids = blocks.allocate(-(-chunk // blocks.block_size))
    ids = torch.randint(100, 30000, (chunk,), generator=torch.Generator().manual_seed(0)).tolist()
    step = StepPlan((SeqStep("overlap", tuple(ids), 0, tuple(block_ids)),))

    def prefill_ms() -> float:
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            runner.execute(step)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    runner.execute(step)  # warm-up
    alone = prefill_ms()
    stop, done, failure = threading.Event(), [0], []

    def predict_forever() -> None:
        try:
            while not stop.is_set():
                predictor.predict([requests[done[0] % len(requests)]])
                done[0] += 1
        except Exception as e:  # reported, not swallowed: a predictor that fails here fails the eval
            failure.append(e)

    worker = threading.Thread(target=predict_forever, name="predictor", daemon=True)
    worker.start()
    try:
        time.sleep(0.2)  # the predictor is busy before the first timed chunk
        beside = prefill_ms()
    finally:
        stop.set()
        worker.join()
    if failure:
        raise RuntimeError(f"the predictor failed while running beside the prefill: {failure[0]}") from failure[0]
    blocks.free(block_ids)
    return {"chunk": chunk, "alone_ms": round(alone, 2), "with_predictor_ms": round(beside, 2),
            "slowdown": round(beside / alone, 3), "predictions_meanwhile": done[0]}


def format_overlap(row: Optional[dict]) -> str:
    if not row:
        return "not measured"
    return (f"prefill of {row['chunk']} tokens: {row['alone_ms']:.1f} ms alone, {row['with_predictor_ms']:.1f} ms "
            f"beside the predictor (x{row['slowdown']:.2f}, {row['predictions_meanwhile']} predictions meanwhile)")
