"""A fork server for grammar compile workers: one small process per engine process that imports
xgrammar once and forks a worker for each request, so a worker starts in milliseconds (not the
seconds xgrammar's import of torch takes) and shares those pages with its siblings.

Why not `multiprocessing`: its spawn and fork-server children import the main module again,
which runs a user's unguarded script a second time inside the worker. This server is started as
`python -m shoal.engine.grammar_zygote`, and its children run only `grammar_worker.serve`.

The engine talks to it over a Unix socket pair: "fork" (with a socket the worker will serve on,
passed as a file descriptor) answers the worker's pid; "kill" SIGKILLs one of its own living
children (never a reused pid: it reaps them itself). When the engine's process goes away the
socket closes, and the server kills its workers and exits; on Linux a worker also dies with it.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

_MESSAGE = 9  # b"F" or b"K", then a pid as 8 bytes
_PID = struct.Struct("q")
_READY_TIMEOUT_S = 300.0  # importing xgrammar (and torch) on a loaded machine


def _recv_exactly(sock: socket.socket, n: int, data: bytes = b"") -> bytes:
    while len(data) < n:
        more = sock.recv(n - len(data))
        if not more:
            raise EOFError("the grammar fork server went away")
        data += more
    return data


class Zygote:
    """The engine's side of the fork server."""

    def __init__(self) -> None:
        ours, theirs = socket.socketpair()
        import shoal

        env = dict(os.environ)
        root = str(Path(shoal.__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shoal.engine.grammar_zygote", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            env=env,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self._lock = threading.Lock()
        ours.settimeout(_READY_TIMEOUT_S)
        try:
            _recv_exactly(ours, 1)
        except (OSError, EOFError):
            self.proc.kill()
            raise
        ours.settimeout(None)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def fork(self) -> tuple[int, Connection]:
        """A new worker: its pid and the connection to it."""
        ours, theirs = socket.socketpair()
        try:
            with self._lock:
                socket.send_fds(self.sock, [b"F" + bytes(8)], [theirs.fileno()])
                (pid,) = _PID.unpack(_recv_exactly(self.sock, _PID.size))
        finally:
            theirs.close()
        return pid, Connection(ours.detach())

    def kill(self, pid: int) -> None:
        with self._lock:
            self.sock.sendall(b"K" + _PID.pack(pid))


_shared: Zygote | None = None
_shared_lock = threading.Lock()


def zygote() -> Zygote:
    """This process's fork server, started on first use (and again if it died)."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive:
            _shared = Zygote()
        return _shared


# -- the fork server process ----------------------------------------------------------------
def die_with_parent() -> None:
    """Linux: SIGKILL this process when the one that forked it exits."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL(None).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _reap(live: set[int]) -> None:
    for pid in list(live):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done:
            live.discard(pid)


def _serve(sock: socket.socket) -> None:
    parent = os.getppid()
    from shoal.engine.grammar_worker import NICE, serve

    # Compiles yield the CPU to request handling; every worker inherits this.
    os.setpriority(os.PRIO_PROCESS, 0, max(NICE, os.getpriority(os.PRIO_PROCESS, 0)))
    import xgrammar  # noqa: F401  (imported once, here, for every worker)

    live: set[int] = set()
    try:
        sock.sendall(b"R")
        while os.getppid() == parent:  # else the engine's process died (its socket may live on)
            _reap(live)
            if not select.select([sock], [], [], 1.0)[0]:
                continue
            data, fds, _, _ = socket.recv_fds(sock, _MESSAGE, 1)
            if not data:
                return  # the engine's process is gone
            data = _recv_exactly(sock, _MESSAGE, data)
            (pid,) = _PID.unpack(data[1:])
            if data[:1] == b"F":
                child = os.fork()
                if child == 0:
                    sock.close()
                    die_with_parent()
                    try:
                        serve(Connection(fds[0]))
                    finally:
                        os._exit(0)
                os.close(fds[0])
                live.add(child)
                sock.sendall(_PID.pack(child))
            else:
                _reap(live)
                if pid in live:
                    os.kill(pid, signal.SIGKILL)
    except (EOFError, OSError):
        return  # the engine's process is gone
    finally:
        for pid in live:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)


if __name__ == "__main__":
    _serve(socket.socket(fileno=int(sys.argv[1])))
