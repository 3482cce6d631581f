"""The step channel between the driver and an instance's actor (aserve/devices/step_channel.py),
over a real loopback socket without Ray: answers come back to the right caller, an error raised
in the actor fails that step only, a step the driver stopped waiting for is dropped when it lands
(the next answer is not taken for it), a stranger without the token is refused before anything
is unpickled, and a connection that closes fails the step in flight and every later one."""
import asyncio
import socket
import threading
import time

import pytest

from aserve.devices.kv_wire import _recv_msg, _send_msg
from aserve.devices.step_channel import ChannelClosed, StepChannel, StepChannelServer, StepError


def serve(run):
    return StepChannelServer("127.0.0.1", "tok", run)


def test_answers_errors_and_a_cancelled_step():
    calls = []

    def run(kind, payload):
        calls.append(kind)
        if kind == "boom":
            raise ValueError("the step raised")
        if kind == "slow":
            time.sleep(payload)
        return (kind, payload)

    srv = serve(run)

    async def main():
        ch = await StepChannel.open(srv.address, "tok", "c0")
        assert await asyncio.gather(*(ch.call("echo", i) for i in range(5))) == [("echo", i) for i in range(5)]
        with pytest.raises(StepError, match="ValueError: the step raised"):
            await ch.call("boom")
        slow = asyncio.ensure_future(ch.call("slow", 0.3))
        await asyncio.sleep(0.05)
        slow.cancel()  # the instance's loop halted mid-step: the answer lands later and is dropped
        assert await ch.call("echo", "next") == ("echo", "next")
        ch.post("note", 1)  # no one waits for it; it runs before what follows
        assert await ch.call("echo", 2) == ("echo", 2)
        await ch.close()

    asyncio.run(main())
    srv.close()
    assert calls == ["echo"] * 5 + ["boom", "slow", "echo", "note", "echo"]


def test_a_stranger_is_refused_before_anything_is_unpickled():
    srv = serve(lambda kind, payload: pytest.fail("ran a frame for a stranger"))

    async def main():
        with pytest.raises(ChannelClosed, match="did not present the cluster's token"):
            await StepChannel.open(srv.address, "guess", "c0")
        with pytest.raises(ChannelClosed, match="no step channel to 127.0.0.1:1"):
            await StepChannel.open(("127.0.0.1", 1), "tok", "c0")

    asyncio.run(main())
    srv.close()


def test_a_closed_connection_fails_the_step_in_flight_and_every_later_one():
    """A peer that answers the handshake, reads one step and closes the connection unanswered,
    as an actor whose process died mid-step."""
    listener = socket.create_server(("127.0.0.1", 0))
    got_step = threading.Event()

    def die_mid_step():
        conn, _ = listener.accept()
        with conn:
            _recv_msg(conn)
            _send_msg(conn, {"ok": True})
            conn.recv(1 << 16)
            got_step.set()
            time.sleep(0.1)

    threading.Thread(target=die_mid_step, daemon=True).start()

    async def main():
        ch = await StepChannel.open(listener.getsockname(), "tok", "d1")
        with pytest.raises(ChannelClosed, match="instance d1: step channel closed from the actor's side .* is gone"):
            await ch.call("step", None)
        with pytest.raises(ChannelClosed, match="instance d1"):
            await ch.call("step", None)
        await ch.close()

    asyncio.run(main())
    assert got_step.is_set()
    listener.close()
