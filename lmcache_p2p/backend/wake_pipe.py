"""A self-pipe that wakes a thread blocked in ``zmq.Poller.poll`` from any other thread.

The sender's service thread polls its sockets and this pipe's read end; the engine's thread (a store
batch), a pairing thread (its result) and the store watch thread (a store's GPU work done) write a byte
to wake it at once. Writes and the closing are serialized by the pipe's own lock, so a wake racing the
thread's shutdown writes to an open pipe or to none.
"""

from __future__ import annotations

import os
import threading


class WakePipe:
    """Non-blocking pipe: :meth:`wake` from anywhere, :meth:`drain` on the polling thread; idempotent close."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._read = self._write = -1

    def open(self) -> int:
        """Create the pipe; returns the file descriptor to poll for input."""
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        with self._lock:
            self._read, self._write = read, write
        return read

    @property
    def fd(self) -> int:
        """The read end (-1 when not open)."""
        return self._read

    def wake(self) -> None:
        with self._lock:
            if self._write < 0:
                return  # the poller is gone (its pipe is closed)
            try:
                os.write(self._write, b"x")
            except BlockingIOError:
                pass  # a full pipe wakes the poller anyway

    def drain(self) -> None:
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        with self._lock:
            for fd in (self._read, self._write):
                if fd >= 0:
                    os.close(fd)
            self._read = self._write = -1
