"""The core lender (aserve/devices/cores.py): an idle instance's threads join a busy one's large
steps, never a share whose owner has a step to run, and an owner waits for a lent share only
until the borrower's step ends. Pure asyncio, no model: the engine's side is in test_lifecycle.py."""
import asyncio

import pytest

from aserve.config import ClusterConfig
from aserve.devices.cores import CoreLender, lender_for


def _pair(cores=2, min_rows=8):
    lender = CoreLender(cores, min_rows)
    lender.join("a", 1)
    lender.join("b", 1)
    return lender


def test_an_idle_instances_share_goes_to_a_large_step_only():
    async def main():
        lender = _pair()
        lender.set_idle("b", True)
        assert await lender.take("a", 256) == 2  # a prompt chunk: both cores
        lender.give("a")
        assert await lender.take("a", 1) == 1  # a batch-1 decode: two threads were slower
        lender.give("a")
        assert await lender.take("a", 8) == 2  # min_rows is the edge
        lender.give("a")
        assert lender.counts == {"steps": 3, "lent_steps": 2, "waits": 0}
    asyncio.run(main())


def test_a_share_whose_owner_has_work_is_never_lent():
    async def main():
        lender = _pair()
        # b has work but is between steps (not idle, not holding): its core stays its own
        assert await lender.take("a", 256) == 1
        lender.give("a")
        lender.set_idle("b", True)
        lender.set_idle("b", False)  # woken by a request before a's next step
        assert await lender.take("a", 256) == 1
    asyncio.run(main())


def test_an_owner_waits_for_its_lent_share_until_the_borrowers_step_ends():
    async def main():
        lender = _pair()
        lender.set_idle("b", True)
        assert await lender.take("a", 256) == 2
        lender.set_idle("b", False)  # a request for b arrives mid-step
        b_step = asyncio.create_task(lender.take("b", 64))
        await asyncio.sleep(0)
        assert not b_step.done()  # its core is in a's step
        lender.give("a")
        assert await b_step == 1
        # a's next step finds b holding its share: one thread, no wait
        assert await asyncio.wait_for(lender.take("a", 256), 1) == 1
        assert lender.counts["waits"] == 1 and lender.held == {"a": 1, "b": 1}
    asyncio.run(main())


def test_more_instances_than_cores_time_slice_as_without_a_lender():
    """Four instances of one thread on two cores: each may step at once (as with ``shared``),
    nobody waits, and nothing is lent while all have work."""
    async def main():
        lender = CoreLender(2)
        for name in "abcd":
            lender.join(name, 1)
        assert [await lender.take(n, 256) for n in "abcd"] == [1, 1, 1, 1]
        assert lender.counts["waits"] == 0
        for name in "abcd":
            lender.give(name)
        for name in "bcd":
            lender.set_idle(name, True)
        assert await lender.take("a", 256) == 2  # the three idle shares, up to the cores there are
    asyncio.run(main())


def test_a_left_device_gives_its_threads_back_and_lends_nothing():
    async def main():
        lender = _pair()
        lender.set_idle("a", True)
        assert await lender.take("b", 256) == 2
        lender.set_idle("a", False)
        waiting = asyncio.create_task(lender.take("a", 1))
        await asyncio.sleep(0)
        lender.leave("b")  # removed mid-step: its threads come back, a goes on
        assert await asyncio.wait_for(waiting, 1) == 1
        assert lender.snapshot()["held"] == {"a": 1}
    asyncio.run(main())


def test_lend_is_a_device_share_and_only_cpu_devices_lend():
    assert ClusterConfig(device_share="lend").device_share == "lend"
    with pytest.raises(ValueError, match="shared, lend, dedicated"):
        ClusterConfig(device_share="borrow")
    assert isinstance(lender_for("lend", "cpu", 2), CoreLender)
    assert lender_for("lend", "cuda", 2) is None and lender_for("shared", "cpu", 2) is None


def test_a_lone_row_is_lent_only_where_the_warm_up_measured_it_faster():
    """``learn``: a one-row step 10% faster on every core than on an instance's share (an fp32
    model on a Zen 3, bound by one core's memory stream) makes one row enough to borrow an idle
    core; slower or within 10%, the edge stays at min_rows."""
    async def main():
        slower = _pair()
        slower.learn(own_s=0.020, lent_s=0.023)
        level = _pair()
        level.learn(own_s=0.080, lent_s=0.075)
        faster = _pair()
        faster.learn(own_s=0.080, lent_s=0.055)
        for lender, rows_lent in ((slower, 8), (level, 8), (faster, 1)):
            assert lender.measured is not None and lender.min_rows == rows_lent
            lender.set_idle("b", True)
            assert await lender.take("a", 1) == (2 if rows_lent == 1 else 1)
            lender.give("a")
        assert faster.snapshot()["min_rows"] == 1
        assert faster.describe() == ("an idle instance's cores go to another's steps of 1+ rows (a lone decode "
                                     "row: 80.0 ms on its own share, 55.0 ms on all 2 cores)")
        assert _pair().describe() == "an idle instance's cores go to another's steps of 8+ rows"
    asyncio.run(main())
