"""Running the event loop: uvloop when it is installed, plain asyncio otherwise; and reading its lag."""
from __future__ import annotations

import asyncio


def run(coro):
    """``asyncio.run`` on uvloop's loop when available (faster callbacks, same semantics)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


async def overslept(seconds: float) -> float:
    """Sleep ``seconds`` on the running loop; return how much later than that it woke (>= 0): the
    loop's lag, what callbacks holding the loop or a starved thread cost every waiter."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    await asyncio.sleep(seconds)
    return max(0.0, loop.time() - t0 - seconds)
