"""One worker generation's stream of replies, read by its reader thread or by a caller that waits for its own.

A reply that a reader thread reads reaches a blocked caller through a second thread wake-up. On a 2-core machine,
each wake-up costs about as much as a pipelined request (40-70 us; docs/runtime.md). So a blocking call
(``Runtime.blocking``) reads the stream itself, and the reader thread reads only:
- for requests that no caller waits on (futures, asyncio);
- when a caller met the stream's end;
- every ``IDLE_LOOK_S``, so that a worker that dies idle is restarted.

Whoever reads holds ``role``. A caller that finds it taken waits for its future as any other does.
"""

from __future__ import annotations

import concurrent.futures
import select
import threading

from .requests import Reply
from .worker import FrameReader, rebuild

IDLE_LOOK_S = 0.05  # how often the reader thread looks at a stream with nothing to read for: a death while idle
# How long the reader thread goes on waiting on the stream once no request is left for it, before it gives the
# stream to callers: pipelined requests come in streams, and the reader woken by a request's send and then by
# its reply (rather than by the reply alone) cost 55 -> 70 us a request on 2 cores.
LINGER_S = 0.002


class Pending(concurrent.futures.Future):
    """A request's future, and the stream its reply comes on (``stream``: None where no caller reads for it)."""

    stream: "ReplyStream | None" = None


class ReplyStream:
    """The replies of worker generation ``generation`` on ``conn``.  ``owner`` is the client's worker: its ``_lock``
    guards ``owner.inflight`` (rid -> (future, what, outputs, attended)), and this stream's counts."""

    def __init__(self, conn, generation: int, owner):
        self.frames = FrameReader(conn)
        self.generation, self.owner = generation, owner
        self.skus = {-1: None}  # this generation's skus, by the index its "ran" batches use
        self.sticky: str | None = None  # the worker's last word: a sticky CUDA error, or an unreadable reply
        self.role = threading.Lock()
        self.unattended = 0  # under owner._lock: requests in flight that no caller reads for
        self.served = 0  # replies to those, dispatched
        self.parked = False  # under owner._lock: the reader thread waits on ``wanted``
        self.suspect = False  # under owner._lock: a caller met the stream's end
        self.wanted = threading.Condition(owner._lock)

    # -- what a reply does ----------------------------------------------------------------------------------------
    def take(self, rid):
        """The in-flight entry of ``rid`` (None if gone), no longer counted; under owner._lock."""
        entry = self.owner.inflight.pop(rid, None)
        if entry is not None and not entry[3]:
            self.unattended -= 1
            self.served += 1
        return entry

    def _dispatch(self, message) -> None:
        kind, rid, value = message
        if kind == "fault":
            self.sticky = value
        elif kind == "sku":
            self.skus[rid] = value
        elif kind == "ran":
            with self.owner._lock:
                done = [(self.take(r), index, ms) for r, index, ms in value]
            for entry, index, ms in done:
                if entry is not None:
                    entry[0].set_result(Reply(self.skus[index], ms, entry[2]))
        else:
            with self.owner._lock:
                entry = self.take(rid)
            if entry is not None:
                if kind == "ok":
                    entry[0].set_result(value)
                else:
                    entry[0].set_exception(rebuild(value))

    def read(self, block: bool) -> bool:
        """Dispatch one message (waiting for it where ``block``, else only if one is there), then every one that
        the same read brought; False once the stream has ended.  The caller holds ``role``."""
        if not (block or self.frames.ready()):
            return True
        first = True
        while first or self.frames.pending():
            first = False
            try:
                message = self.frames.recv()
            except (EOFError, OSError):
                return False
            except Exception as e:  # noqa: BLE001  a reply that cannot be read: its request is unknown, so the
                # worker is stopped and everything in flight fails, rather than a request waiting for ever
                self.sticky = f"a reply could not be read ({type(e).__name__}: {e}); the worker was stopped"
                self.owner.proc.kill()
                continue
            self._dispatch(message)
        return True

    # -- who reads ------------------------------------------------------------------------------------------------
    def reader_thread(self) -> None:
        """The generation's reader thread, until the stream ends (then the owner's death handling)."""
        owner = self.owner
        while True:
            if not (self.unattended or self.suspect):  # (read without the lock: rechecked under it)
                with owner._lock:
                    if not (self.unattended or self.suspect):
                        self.parked = True
                        self.wanted.wait(IDLE_LOOK_S)
                        self.parked = False
            block = bool(self.unattended or self.suspect)
            with self.role:  # taken while a caller reads for its own reply
                alive = self.read(block)
                # Linger while what comes is for this thread (not after an idle look).
                while alive and block and not (self.unattended or self.suspect):
                    served = self.served
                    if not select.select([self.frames.fd], [], [], LINGER_S)[0]:
                        break
                    alive = self.read(True)  # bytes are there: no second look
                    if self.served == served:  # a waiting caller's reply: callers read their own from here
                        break
            if not alive:
                break
        if not owner._closing:
            owner._on_death(self.generation, self.sticky)

    def attend(self) -> None:
        """A request was sent that no caller reads for: the reader thread reads (under owner._lock)."""
        self.unattended += 1
        if self.parked:
            self.wanted.notify()

    def wait(self, fut: Pending):
        """``fut``'s result, its reply read by this thread where nobody else reads the stream."""
        while not fut.done() and self.role.acquire(blocking=False):
            try:
                alive = fut.done() or self.read(True)
            finally:
                self.role.release()
            if not alive:  # the stream ended: the reader thread reads it to its end, and fails what was lost
                with self.owner._lock:
                    self.suspect = True
                    if self.parked:
                        self.wanted.notify()
                break
        return fut.result()
