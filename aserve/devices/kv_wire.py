"""KV blocks straight from one actor's process to another's, over a TCP connection of their own.

    prefill actor A                                         decode actor B
    push_kv(rid, blocks, B's address, B's blocks)           KVWireServer (a thread per connection)
      gather the blocks (A's copy thread)
      ── header: token, request id, B's block ids, nbytes ─►  checks the header (token, size)
      ◄─ {"go": true} or {"error": "..."} ────────────────
      ── the bytes, one sendall ──────────────────────────►   recv_into one buffer, then
                                                               write(rid, ids, bytes): into B's pool
      ◄─ {"ok": true} or {"error": "..."} ────────────────   (after the blocks are in the pool)

Nothing lands in the object store and nothing is pinned: the bytes go from A's memory to B's
in one stream, as NIXL or a NCCL send would move them between GPUs. The driver makes one call
(``A.push_kv``) and learns from its answer that B holds the blocks. A stream cut short (either
process gone, a timeout) never writes a partial block set: B copies only a whole payload. Each
cluster's actors share a random token; a connection that does not present it is refused, so the
port writes nothing for anyone else (it runs no code either; docs/RAY.md, "Security").

This module is plain sockets and numpy: ``DeviceHost`` runs a server and a sender in its actor,
and the tests drive both in one process.
"""
from __future__ import annotations

import hmac
import json
import socket
import struct
import threading
from typing import Callable, Optional, Sequence

import numpy as np

LENGTH = struct.Struct("!I")  # the byte length of the JSON header (or ack) that follows
MAX_HEADER = 1 << 20
WIRE_TIMEOUT_S = 120.0  # a peer that neither sends nor answers for this long is gone
# a buffer up to this size is kept for the next push (each side): the first touch of a fresh
# 94 MB buffer cost ~90 ms of page faults here, the copy into a warm one 17 ms
KEEP_BYTES = 256 * 2**20


class Staging:
    """Reusable byte buffers (flat uint8 numpy): the ``keep`` largest given back, none over ``KEEP_BYTES``."""

    def __init__(self, keep: int = 2):
        self.keep, self._free, self._lock = keep, [], threading.Lock()

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)[:nbytes]
        return np.empty(nbytes, dtype=np.uint8)

    def give(self, buf: np.ndarray) -> None:
        base = buf.base if isinstance(buf.base, np.ndarray) else buf
        if base.nbytes <= KEEP_BYTES:
            with self._lock:  # the largest are kept: each serves every smaller push too
                self._free.append(base)
                self._free.sort(key=lambda b: b.nbytes, reverse=True)
                del self._free[self.keep:]


class WireError(RuntimeError):
    """A push that did not land: refused by the receiver, or the connection broke."""


def _send_msg(sock: socket.socket, obj: dict) -> None:
    data = json.dumps(obj).encode()
    sock.sendall(LENGTH.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise ConnectionError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def _recv_msg(sock: socket.socket) -> dict:
    head = bytearray(LENGTH.size)
    _recv_exact(sock, memoryview(head))
    (n,) = LENGTH.unpack(head)
    if n > MAX_HEADER:
        raise ConnectionError(f"a header of {n} bytes (at most {MAX_HEADER})")
    body = bytearray(n)
    _recv_exact(sock, memoryview(body))
    return json.loads(body)


class SocketServer:
    """A listening socket on ``host`` (an ephemeral port) and a thread per connection running
    ``_serve(conn)``; ``close`` stops accepting (connections end when their peer closes)."""

    def __init__(self, host: str, name: str):
        self._sock = socket.create_server((host, 0), backlog=64)
        self.address = (host, self._sock.getsockname()[1])
        self._closed, self._name = False, name
        threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.settimeout(WIRE_TIMEOUT_S)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=self._serve, args=(conn,), name=self._name, daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.close()
        except OSError:
            pass


class KVWireServer(SocketServer):
    """Listens on ``host`` (an ephemeral port); for every pushed payload calls
    ``write(request_id, block_ids, data)`` (``data``: flat uint8 numpy, the whole payload) after
    ``check(request_id, block_ids, nbytes)`` returned None (else that string is the error sent
    back, and the payload is not read: the connection is closed)."""

    def __init__(self, host: str, token: str, check: Callable[[str, list[int], int], Optional[str]],
                 write: Callable[[str, list[int], np.ndarray], None]):
        self.token, self._check, self._write = token, check, write
        self.counts = {"received": 0, "refused": 0, "broken": 0}
        super().__init__(host, "kv-wire")

    def _serve(self, conn: socket.socket) -> None:
        """One connection: pushes one after another until the sender closes it."""
        staging = Staging(keep=1)  # one push at a time on a connection
        with conn:
            while not self._closed:
                try:
                    conn.settimeout(None)  # an idle connection waits for its next push as long as it takes
                    header = _recv_msg(conn)
                    conn.settimeout(WIRE_TIMEOUT_S)
                except (ConnectionError, OSError, ValueError):
                    return  # the sender closed it (between pushes: the normal end) or broke it
                try:
                    if not hmac.compare_digest(str(header.get("token", "")), self.token):
                        raise PermissionError("this connection did not present the cluster's token")
                    rid, nbytes = str(header["request"]), int(header["nbytes"])
                    ids = [int(i) for i in header["blocks"]]
                except (AttributeError, KeyError, TypeError, ValueError, PermissionError) as e:
                    self.counts["refused"] += 1
                    _try_send(conn, {"error": f"refused: {e}" if isinstance(e, PermissionError) else
                                     f"a malformed header ({type(e).__name__}: {e})"})
                    return
                why = self._check(rid, ids, nbytes)
                if why:
                    self.counts["refused"] += 1
                    _try_send(conn, {"error": why})
                    return  # no payload follows an error; the sender closes its end too
                if not _try_send(conn, {"go": True}):
                    return
                data = staging.take(nbytes)
                try:
                    _recv_exact(conn, memoryview(data))
                except (ConnectionError, OSError):
                    self.counts["broken"] += 1
                    return  # a partial payload: nothing is written
                try:
                    self._write(rid, ids, data)
                except Exception as e:  # noqa: BLE001 - the sender must learn why, in one line
                    _try_send(conn, {"error": f"{type(e).__name__}: {e}"})
                    return
                staging.give(data)  # written into the pool: the buffer is free again
                self.counts["received"] += 1
                if not _try_send(conn, {"ok": True}):
                    return


def _try_send(conn: socket.socket, obj: dict) -> bool:
    try:
        _send_msg(conn, obj)
        return True
    except OSError:
        return False


class KVWireSender:
    """Pushes payloads to ``KVWireServer``s; keeps idle connections per address for reuse (a push
    at a time on each connection, a new one for a push that finds none idle)."""

    def __init__(self, token: str):
        self.token = token
        self._idle: dict[tuple, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def push(self, address: Sequence, request_id: str, block_ids: Sequence[int], data: np.ndarray) -> int:
        """Blocking (run it on a thread): send ``data`` for ``block_ids`` of the receiver's pool and
        wait until the receiver has written them. Returns the bytes sent; ``WireError`` if not."""
        addr = (str(address[0]), int(address[1]))
        sock, reused = self._take(addr)
        try:
            _send_msg(sock, {"token": self.token, "request": request_id, "blocks": [int(i) for i in block_ids],
                             "nbytes": int(data.nbytes)})
            ack = _recv_msg(sock)
            if "go" in ack:
                sock.sendall(memoryview(data).cast("B"))
                ack = _recv_msg(sock)
        except (OSError, ConnectionError, ValueError) as e:
            sock.close()
            if reused:  # a kept connection the receiver has let go of (its process restarted): anew
                return self.push(address, request_id, block_ids, data)
            raise WireError(f"request {request_id!r}: KV push to {addr[0]}:{addr[1]} broke: "
                            f"{type(e).__name__}: {e}") from None
        if "error" in ack:
            sock.close()  # the receiver ends a connection it refused anything on
            raise WireError(f"request {request_id!r}: the receiver refused the KV: {ack['error']}")
        with self._lock:
            self._idle.setdefault(addr, []).append(sock)
        return int(data.nbytes)

    def _take(self, addr: tuple) -> tuple[socket.socket, bool]:
        """An idle connection to ``addr`` (reused: True), else a new one."""
        with self._lock:
            pool = self._idle.get(addr)
            if pool:
                return pool.pop(), True
        try:
            sock = socket.create_connection(addr, timeout=WIRE_TIMEOUT_S)
        except OSError as e:
            raise WireError(f"cannot reach the KV receiver at {addr[0]}:{addr[1]}: {e}") from None
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, False

    def close(self) -> None:
        with self._lock:
            for pool in self._idle.values():
                for sock in pool:
                    sock.close()
            self._idle.clear()
