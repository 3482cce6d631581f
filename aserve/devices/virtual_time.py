"""A virtual-time event loop: simulated hours run as fast as the host computes them.

    loop.time()            -> a VirtualClock (the cluster, the link and the replay read it too)
    asyncio.sleep(d)        -> a timer at time() + d, as ever
    nothing ready to run    -> instead of waiting for the next timer, the clock jumps to it

The loop's selector is the only change: when no callback is ready it polls the real file
descriptors without waiting, and when none is ready and a timer is due later, advances the clock
by the wait instead of sleeping; unless work handed to a thread (``run_in_executor``,
``asyncio.to_thread``) is still out: then it waits for real until that work posts back, so the
clock does not run past every pending timeout meanwhile (a slow heap trim on removing an instance
let a drill's stream timeouts fire).
So everything written against asyncio (sleeps, timeouts, ``call_later``, the cluster monitor's
period, the link's landing times, the replay's arrivals) runs unchanged on virtual time. Only a
wait with no timer at all (the loop idles until another thread posts work) blocks for real.

Work done on other threads takes no virtual time: a simulated device runs no torch, and a
predictor that predicts on a thread is answered at the virtual instant its answer arrives (use
the inline, set-accuracy predictor on simulated runs; aserve/predict/online.py).
"""
from __future__ import annotations

import asyncio
import selectors
from typing import Optional


class VirtualClock:
    """Seconds on the simulation's scale; the loop moves it, ``Clock`` readers read it."""

    def __init__(self, start: float = 0.0):
        self.t = start

    def now(self) -> float:
        return self.t


class _JumpingSelector(selectors.BaseSelector):
    """The real selector, polled without waiting; a wait for a timer becomes a clock jump."""

    def __init__(self, clock: VirtualClock):
        self._real = selectors.DefaultSelector()
        self._clock = clock
        self.threads_out = 0  # work handed to threads and not yet back (the loop counts it)

    def register(self, fileobj, events, data=None):
        return self._real.register(fileobj, events, data)

    def unregister(self, fileobj):
        return self._real.unregister(fileobj)

    def modify(self, fileobj, events, data=None):
        return self._real.modify(fileobj, events, data)

    def get_map(self):
        return self._real.get_map()

    def close(self) -> None:
        self._real.close()

    def select(self, timeout: Optional[float] = None):
        if timeout is not None and timeout <= 0:
            # callbacks are ready: the loop runs them now whatever the descriptors say, and a
            # thread's callback is in its ready queue already (the self-pipe only wakes a loop
            # that waits); the next poll, before the clock moves, reads what came meanwhile. A
            # poll here was a system call every turn of a simulated run's loop (issue 57)
            return []
        ready = self._real.select(0)
        if ready:
            return ready
        if timeout is None or self.threads_out:  # only another thread can wake the loop, or one will
            return self._real.select(None)
        self._clock.t += timeout
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self, clock: Optional[VirtualClock] = None):
        self.clock = clock or VirtualClock()
        super().__init__(selector=_JumpingSelector(self.clock))

    def time(self) -> float:
        return self.clock.t

    def run_in_executor(self, executor, func, *args):
        """The thread's work, counted out until it is back: the clock waits for it."""
        fut = super().run_in_executor(executor, func, *args)
        selector = self._selector
        selector.threads_out += 1

        def back(_):
            selector.threads_out -= 1
        fut.add_done_callback(back)
        return fut


def run_virtual(coro, clock: Optional[VirtualClock] = None):
    """``asyncio.run`` on a virtual-time loop (``clock`` shared with the caller's cluster)."""
    loop = VirtualTimeLoop(clock)
    try:
        asyncio.set_event_loop(loop)
        return loop.run_until_complete(coro)
    finally:
        try:
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()
