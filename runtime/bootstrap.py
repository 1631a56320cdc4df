"""Host-side agreements between the ranks: MPI where the launcher made MPI processes, else a TCP
bootstrap on MASTER_ADDR:MASTER_PORT (torchrun and other torch-style launchers).

The GPU path needs only a few small host exchanges, never tensors: NCCL's unique id (rank 0 makes
it, every rank needs it), the setup agreement (each rank's error and fingerprint), the agreed exit,
and per-step scalars (loss, flags). ``HostGroup`` is those calls; ``MpiHost`` answers them with
MPI, ``TcpHost`` with the bootstrap below, so ``torchrun`` needs no MPI on GPUs.

The bootstrap has the shape of NCCL's own bootstrap root and of torch's TCPStore: rank 0 listens,
every other rank connects (retrying until a deadline: rank 0 may start later) and says who it is
(magic, rank, world size). The one primitive is ``allgather``: each rank sends rank 0 its value,
rank 0 answers everyone with the list in rank order; bcast, barrier and allreduce are allgathers.
Values are JSON (bytes travel as base64): nothing a stranger on the port sends is unpickled.

A rank that goes away closes its socket: rank 0 sees the end of the stream, the others then see
rank 0 close, and each raises a RunError instead of waiting forever.

Under torchrun, MASTER_PORT is already taken by torchrun's own store (TORCHELASTIC_USE_AGENT_STORE):
there the same allgather runs on that store through torch's client (``TorchStoreExchange``); torch
is present, since torchrun is part of it.
"""

from __future__ import annotations

import abc
import base64
import json
import os
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from runtime.errors import RunError

MAGIC = "graph-transpiler/bootstrap/1"
_HEADER = struct.Struct("!I")  # length of the JSON message that follows
_MAX_MESSAGE = 64 << 20


# -- the host group: what the runtime asks of the other ranks' hosts -----------------------------
class HostGroup(abc.ABC):
    """Rank ``rank`` of ``size``; every rank calls the same methods in the same order. A transport
    (MPI, the TCP bootstrap, torchrun's store) implements ``allgather``; the rest is built on it."""

    rank: int
    size: int

    @abc.abstractmethod
    def allgather(self, value: Any) -> list:
        """Every rank's ``value``, in rank order, on every rank."""

    def bcast(self, value: Any, root: int = 0) -> Any:
        return self.allgather(value if self.rank == root else None)[root]

    def barrier(self) -> None:
        self.allgather(None)

    def allreduce_scalars(self, values: Sequence[float], reduction: str = "mean") -> list[float]:
        """Summed in rank order on every rank: every rank gets the same bits."""
        rows = self.allgather([float(v) for v in values])
        totals = [sum(row[i] for row in rows) for i in range(len(values))]
        return [t / self.size if reduction == "mean" else t for t in totals]

    def abort(self, code: int) -> None:
        sys.stdout.flush()
        sys.stderr.flush()
        self.close()
        os._exit(code)

    def close(self) -> None:  # noqa: B027 - a transport without a connection has nothing to close
        pass


class MpiHost(HostGroup):
    """The host group of MPI ranks (an ``MpiCommunicator``)."""

    def __init__(self, comm):
        self.mpi, self.rank, self.size = comm, comm.rank, comm.size

    def allgather(self, value):
        return self.mpi.comm.allgather(value)

    def bcast(self, value, root=0):
        return self.mpi.comm.bcast(value, root=root)

    def barrier(self):
        self.mpi.barrier()

    def allreduce_scalars(self, values, reduction="mean"):
        return self.mpi.allreduce_scalars(values, reduction)

    def abort(self, code):
        self.mpi.abort(code)


# -- the wire: length-prefixed JSON --------------------------------------------------------------
def _encode(value: Any) -> bytes:
    def default(obj):
        if isinstance(obj, (bytes, bytearray)):
            return {"__bytes__": base64.b64encode(bytes(obj)).decode()}
        raise TypeError(f"cannot send a {type(obj).__name__} through the bootstrap")

    data = json.dumps(value, default=default, separators=(",", ":")).encode()
    return _HEADER.pack(len(data)) + data


def _decode(data: bytes) -> Any:
    def hook(obj):
        return base64.b64decode(obj["__bytes__"]) if obj.keys() == {"__bytes__"} else obj

    return json.loads(data, object_hook=hook)


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, left = [], n
    while left:
        chunk = sock.recv(min(left, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[bool, Any]:
    """(False, None) when the peer closed the connection, or sent what no rank sends (a stranger on
    the port: a health check, a scanner)."""
    try:
        header = _recv_exact(sock, _HEADER.size)
        (length,) = _HEADER.unpack(header) if header is not None else (None,)
        body = _recv_exact(sock, length) if length is not None and length <= _MAX_MESSAGE else None
    except OSError:  # reset, timed out
        return False, None
    if body is None:
        return False, None
    try:
        return True, _decode(body)
    except ValueError:
        return False, None


def _send(sock: socket.socket, value: Any) -> bool:
    try:
        sock.sendall(_encode(value))
        return True
    except OSError:
        return False


# -- the TCP bootstrap ---------------------------------------------------------------------------
class TcpHost(HostGroup):
    """Rank 0 listens on ``port`` (all interfaces) and waits for the other ``size - 1`` ranks; the
    others connect to ``addr:port``. Both give up after ``timeout`` seconds with one line."""

    def __init__(self, rank: int, size: int, addr: str, port: int, *, timeout: float = 300.0):
        self.rank, self.size, self.addr, self.port = rank, size, addr, port
        self._server: socket.socket | None = None
        self._peers: dict[int, socket.socket] = {}  # rank 0: every other rank's connection
        self._root: socket.socket | None = None  # the others: the connection to rank 0
        if size == 1:
            return
        if rank == 0:
            self._listen(timeout)
        else:
            self._connect(timeout)

    def _listen(self, timeout: float) -> None:
        try:
            if socket.has_dualstack_ipv6():
                self._server = socket.create_server(("", self.port), family=socket.AF_INET6, dualstack_ipv6=True)
            else:
                self._server = socket.create_server(("", self.port))
        except OSError as exc:
            raise RunError(f"rank 0: cannot listen on MASTER_PORT {self.port} for the bootstrap: "
                           f"{exc.strerror or exc}") from None
        deadline = time.monotonic() + timeout
        while len(self._peers) < self.size - 1:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = [r for r in range(1, self.size) if r not in self._peers]
                self.close()
                raise RunError(f"rank 0: rank(s) {', '.join(map(str, missing))} did not reach the bootstrap on port "
                               f"{self.port} within {timeout:.0f} s (not started, another MASTER_ADDR/MASTER_PORT, "
                               "or a firewall)")
            self._server.settimeout(min(left, 1.0))
            try:
                conn, _ = self._server.accept()
            except TimeoutError:
                continue
            conn.settimeout(min(left, 10.0))
            ok, hello = _recv(conn)
            problem = self._check_hello(hello if ok else None)
            if problem is not None:
                _send(conn, {"error": problem})
                conn.close()
                if ok and isinstance(hello, dict) and hello.get("magic") == MAGIC:
                    self.close()
                    raise RunError(f"rank 0: {problem}")
                continue  # a stranger (a port scanner, a health check): not ours, ignore it
            conn.settimeout(None)
            _send(conn, {"ok": True})
            self._peers[hello["rank"]] = conn

    def _check_hello(self, hello: Any) -> str | None:
        if not isinstance(hello, dict) or hello.get("magic") != MAGIC:
            return "not a graph-transpiler rank"
        rank, size = hello.get("rank"), hello.get("size")
        if size != self.size:
            return (f"rank {rank} was started with world size {size}, rank 0 with {self.size} "
                    "(WORLD_SIZE differs between the ranks)")
        if not isinstance(rank, int) or not 0 < rank < self.size or rank in self._peers:
            return f"two ranks say they are rank {rank} (RANK must be unique, 0 to {self.size - 1})"
        return None

    def _connect(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: OSError | None = None
        while time.monotonic() < deadline:
            try:
                sock = socket.create_connection((self.addr, self.port), timeout=min(5.0, max(0.1, deadline - time.monotonic())))
            except OSError as exc:  # refused (rank 0 not listening yet), unreachable, not resolvable
                last = exc
                time.sleep(0.2)
                continue
            _send(sock, {"magic": MAGIC, "rank": self.rank, "size": self.size})
            ok, reply = _recv(sock)
            if ok and isinstance(reply, dict) and reply.get("ok"):
                sock.settimeout(None)
                self._root = sock
                return
            sock.close()
            if ok and isinstance(reply, dict) and "error" in reply:
                raise RunError(f"rank {self.rank}: the bootstrap on rank 0 refused this rank: {reply['error']}")
            last = ConnectionError("the bootstrap server closed the connection")
            time.sleep(0.2)
        why = (last.strerror if isinstance(last, OSError) and last.strerror else last) or "timed out"
        raise RunError(f"rank {self.rank}: cannot reach rank 0's bootstrap at {self.addr}:{self.port} (MASTER_ADDR:"
                       f"MASTER_PORT) within {timeout:.0f} s: {why}")

    def allgather(self, value):
        if self.size == 1:
            return [value]
        if self.rank != 0:
            if not _send(self._root, value):
                raise RunError(self._gone())
            ok, values = _recv(self._root)
            if not ok:
                raise RunError(self._gone())
            return values
        values = [value]
        for rank in range(1, self.size):
            ok, theirs = _recv(self._peers[rank])
            if not ok:
                self.close()  # the others then see rank 0 close instead of waiting for the next round
                raise RunError(f"rank {rank} left the job (its bootstrap connection closed)")
            values.append(theirs)
        for sock in self._peers.values():
            _send(sock, values)
        return values

    def _gone(self) -> str:
        return f"rank 0 (the bootstrap at {self.addr}:{self.port}) closed the connection: it failed or stopped"

    def close(self) -> None:
        for sock in (*self._peers.values(), self._root, self._server):
            if sock is not None:
                try:
                    sock.close()
                except OSError:
                    pass
        self._peers, self._root, self._server = {}, None, None


class TorchStoreExchange(HostGroup):
    """The allgather on torchrun's own store (``TORCHELASTIC_USE_AGENT_STORE``): each rank sets its
    key of round k, reads every rank's, then deletes its key of round k - 1 (every rank has read it:
    they all wrote round k)."""

    def __init__(self, rank: int, size: int, addr: str, port: int, *, prefix: str, timeout: float = 300.0):
        from datetime import timedelta

        from torch.distributed import TCPStore

        self.rank, self.size, self._prefix, self._round = rank, size, prefix, 0
        try:
            self._store = TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout))
        except Exception as exc:  # noqa: BLE001 - torch raises RuntimeError/DistStoreError
            raise RunError(f"rank {rank}: cannot reach torchrun's store at {addr}:{port}: {exc}".splitlines()[0]) from None

    def _key(self, round_: int, rank: int) -> str:
        return f"{self._prefix}/{round_}/{rank}"

    def allgather(self, value):
        self._round += 1
        self._store.set(self._key(self._round, self.rank), _encode(value)[_HEADER.size:])
        try:
            values = [_decode(self._store.get(self._key(self._round, r))) for r in range(self.size)]
        except Exception as exc:  # noqa: BLE001 - a timeout: a rank never wrote its value
            raise RunError(f"rank {self.rank}: a rank did not reach host exchange {self._round} on torchrun's store: "
                           f"{exc}".splitlines()[0]) from None
        if self._round > 1:
            self._store.delete_key(self._key(self._round - 1, self.rank))
        return values


def torch_style_host(env: Mapping[str, str], rank: int, size: int, timeout: float) -> HostGroup:
    """The host group of a torch-style launch (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    addr = env["MASTER_ADDR"]
    try:
        port = int(env["MASTER_PORT"])
    except ValueError:
        raise RunError(f"MASTER_PORT={env['MASTER_PORT']!r} is not a port number") from None
    if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        prefix = f"graph-transpiler/{env.get('TORCHELASTIC_RUN_ID', '')}/{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"
        return TorchStoreExchange(rank, size, addr, port, prefix=prefix, timeout=timeout)
    return TcpHost(rank, size, addr, port, timeout=timeout)
