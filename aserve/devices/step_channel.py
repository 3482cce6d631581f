"""The driver's steps to an instance's actor over a socket of their own, not a Ray call each.

    driver (RayDevice, its event loop)                  actor (DeviceHost, a thread per connection)
      connect, {"token": ...} as JSON ───────────────►  checks the token before it reads anything else
      frame (seq, kind, payload), pickled ───────────►  run(kind, payload) on the device's step thread
      a reader task resolves seq's future ◄──────────   frame (seq, ok, result or error text)

Why: a Ray actor call from an asyncio driver took 2.5-3 ms median on this 2-core machine with the
actor doing nothing (a plain ``ray.get`` 1.3 ms), and a step's round trip through Ray 5-6 ms
beyond the actor's busy time; on a decode step of a small model that is most of the price of
running on Ray. A frame each way on a connection the two already hold costs two system calls and
a pickle. Ray still starts, places and watches the actor, and carries everything else.

Frames are answered in order, each tagged with its sequence number, so a step the driver stopped
waiting for (its loop cancelled mid-step) is read and dropped when it lands instead of being
taken for the next step's answer. The connection closing (the actor's process gone, its host
lost) fails every step in flight and every later one with ``ChannelClosed``.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import pickle
import socket
from typing import Any, Callable, Optional, Sequence

from aserve.devices.kv_wire import LENGTH, SocketServer, _recv_exact, _recv_msg, _try_send


class ChannelClosed(ConnectionError):
    """The step channel to an actor is gone (or never came up)."""


class StepError(RuntimeError):
    """What the actor raised running a frame, in one line."""


def _frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return LENGTH.pack(len(data)) + data


class StepChannelServer(SocketServer):
    """In the actor: accepts the driver's connection(s) on ``host`` (an ephemeral port) and answers
    each frame ``(seq, kind, payload)`` with ``run(kind, payload)``, on the connection's thread."""

    def __init__(self, host: str, token: str, run: Callable[[str, Any], Any]):
        self.token, self._run = token, run
        super().__init__(host, "step-channel")

    def _serve(self, conn: socket.socket) -> None:
        with conn:  # the handshake comes at once (the server's timeout); steps may be far apart
            try:
                hello = _recv_msg(conn)
                ok = isinstance(hello, dict) and hmac.compare_digest(str(hello.get("token", "")), self.token)
            except (ConnectionError, OSError, ValueError):
                return
            if not ok:
                _try_send(conn, {"error": "refused: this connection did not present the cluster's token"})
                return
            if not _try_send(conn, {"ok": True}):
                return
            conn.settimeout(None)
            head = bytearray(LENGTH.size)
            while not self._closed:
                try:
                    _recv_exact(conn, memoryview(head))
                    (n,) = LENGTH.unpack(head)
                    body = bytearray(n)
                    _recv_exact(conn, memoryview(body))
                except (ConnectionError, OSError):
                    return  # the driver closed it, or is gone
                seq, kind, payload = pickle.loads(body)
                try:
                    reply = (seq, True, self._run(kind, payload))
                except Exception as e:  # noqa: BLE001 - the driver fails the step with this line
                    reply = (seq, False, f"{type(e).__name__}: {e}")
                try:
                    conn.sendall(_frame(reply))
                except OSError:
                    return


class StepChannel:
    """The driver's end: ``await call(kind, payload)`` returns the actor's answer (``StepError``
    for what it raised there, ``ChannelClosed`` once the connection is gone)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, name: str):
        self.name, self._reader, self._writer = name, reader, writer
        self._seq = 0
        self._pending: dict[int, asyncio.Future] = {}
        self._closed: Optional[str] = None
        self._task = asyncio.get_running_loop().create_task(self._read(), name=f"step-channel-{name}")

    @classmethod
    async def open(cls, address: Sequence, token: str, name: str, timeout_s: float = 30.0) -> "StepChannel":
        host, port = str(address[0]), int(address[1])
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
            hello = json.dumps({"token": token}).encode()
            writer.write(LENGTH.pack(len(hello)) + hello)
            (n,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(LENGTH.size), timeout_s))
            answer = json.loads(await asyncio.wait_for(reader.readexactly(n), timeout_s))
        except (OSError, asyncio.TimeoutError, asyncio.IncompleteReadError, ValueError) as e:
            raise ChannelClosed(f"instance {name}: no step channel to {host}:{port}: {type(e).__name__}: {e}") from None
        if "error" in answer:
            writer.close()
            raise ChannelClosed(f"instance {name}: the actor refused the step channel: {answer['error']}")
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return cls(reader, writer, name)

    async def call(self, kind: str, payload: Any = None) -> Any:
        if self._closed is not None:
            raise ChannelClosed(self._closed)
        self._seq += 1
        seq = self._seq
        fut = asyncio.get_running_loop().create_future()
        self._pending[seq] = fut
        try:
            self._writer.write(_frame((seq, kind, payload)))
            ok, result = await fut  # a cancel here leaves the answer to be read and dropped
        finally:
            self._pending.pop(seq, None)
        if not ok:
            raise StepError(result)
        return result

    def post(self, kind: str, payload: Any = None) -> None:
        """A frame whose answer nobody waits for (dropped when it lands); the actor runs it before
        any frame sent after it."""
        if self._closed is None:
            self._seq += 1
            self._writer.write(_frame((self._seq, kind, payload)))

    async def _read(self) -> None:
        why = "closed"
        try:
            while True:
                (n,) = LENGTH.unpack(await self._reader.readexactly(LENGTH.size))
                seq, ok, result = pickle.loads(await self._reader.readexactly(n))
                fut = self._pending.get(seq)
                if fut is not None and not fut.done():
                    fut.set_result((ok, result))
        except asyncio.CancelledError:
            why = "closed by the driver"
            raise
        except (asyncio.IncompleteReadError, OSError) as e:
            why = f"closed from the actor's side ({type(e).__name__}): its process or its host is gone"
        finally:
            self._closed = f"instance {self.name}: step channel {why}"
            for fut in self._pending.values():
                if not fut.done():
                    fut.set_exception(ChannelClosed(self._closed))

    async def close(self) -> None:
        self._task.cancel()
        try:
            await self._task
        except asyncio.CancelledError:
            pass
        self._writer.close()
