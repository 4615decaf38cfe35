"""``Runtime``: the client of the device workers, and the supervisor that restarts them.

One worker process per device (``worker.py``), started with ``spawn``.  The
client sends requests down a pipe; a blocking call reads its own reply, and a
reader thread per worker resolves the other futures (``replies.py``); many
requests may be in flight (pipelined).  When the pipe
breaks (the worker exited or was killed) or the worker reports a sticky CUDA
error, every request in flight fails with ``DeviceFault`` naming it and the
cause, the worker is restarted under a restart intensity (at most
``max_restarts`` in ``period_s`` seconds, as OTP supervisors count them; past
that the device is failed, ``DeviceFailed``), and requests sent after the fault
run on the new worker.  Buffers of the old worker are stale.

Where data is copied (``upload``/``download``):

* CPU tensor to a CPU worker: one copy, into fresh shared memory the worker then
  maps (no second copy on the way);
* CPU tensor to a CUDA worker: the same, then one host-to-device copy;
* CUDA tensor to a CUDA worker: a CUDA IPC handle, then one device-to-device copy
  so the buffer does not depend on the caller's tensor staying alive;
* download: one copy into fresh shared memory (a snapshot), mapped by the client.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import pickle
import threading
import time
from dataclasses import dataclass, field

from .errors import DeviceFailed, DeviceFault, StaleBuffer
from .replies import Pending, ReplyStream
from .requests import Buffer, buffers_in
from .worker import send_message

_START_TIMEOUT_S = 120  # a spawned worker imports torch before it answers
BACKENDS = ("local", "ray")


class RestartIntensity:
    """At most ``max_restarts`` restarts within ``period_s`` seconds (OTP's restart intensity): ``allow`` records a
    restart and says yes, or says no (the device is then failed)."""

    def __init__(self, max_restarts: int, period_s: float):
        self.max_restarts, self.period_s = max_restarts, period_s
        self.restarts: collections.deque = collections.deque()

    def allow(self) -> bool:
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.period_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            return False
        self.restarts.append(now)
        return True

    def refusal(self, device: str, cause: str) -> str:
        return (f"{device} failed: {len(self.restarts) + 1} worker deaths within {self.period_s:g} s (the restart "
                f"intensity allows {self.max_restarts}); the last: {cause}")


class SupervisedWorker:
    """What the local workers and the Ray ones (``ray_worker.py``) share: the record of the buffer handles a worker
    gave out (``slots``: buffer id -> live generation, for the worker ``generation``), which every request's
    handles are checked against before anything is sent, and what follows a worker's death."""

    device: str
    generation: int
    slots: dict
    failed: str | None
    intensity: RestartIntensity
    _ready: threading.Event

    def check(self, buffers) -> None:
        for buf in buffers:
            if buf.device != self.device:
                raise StaleBuffer(f"{buf} lives on {buf.device}, not on {self.device}: a request runs where all its "
                                  f"buffers are")
            if buf.worker_generation != self.generation or self.slots.get(buf.buffer_id) != buf.generation:
                raise StaleBuffer(f"{buf} is stale: it holds worker generation {buf.worker_generation}, slot "
                                  f"generation {buf.generation}; current worker generation {self.generation}, slot "
                                  f"generation {self.slots.get(buf.buffer_id)} (freed, or made before a restart): "
                                  f"upload again")

    def new_slot(self) -> tuple[int, int]:
        buffer_id = next(self._slot_ids)
        self.slots[buffer_id] = 0
        return buffer_id, 0

    def fail_lost(self, lost: dict, generation: int, cause: str) -> None:
        """``DeviceFault`` for each request that was in flight on the dead worker generation."""
        for fut, what, *_ in lost.values():
            fut.set_exception(DeviceFault(f"{what} on {self.device} failed: worker generation {generation} died "
                                          f"({cause}); later requests run on a restarted worker"))

    def restart(self, cause: str) -> None:
        """A new worker, within the restart intensity; past it, or where the new one does not start, the device is
        failed (waiters wake to that)."""
        if not self.intensity.allow():
            self.failed = self.intensity.refusal(self.device, cause)
            self._ready.set()
            return
        try:
            self._start()
        except DeviceFault as e:
            self.failed = str(e)
            self._ready.set()


class _DeviceWorker(SupervisedWorker):
    """One device's worker process, its pipe, its in-flight requests and its buffer slots, and its supervision."""

    def __init__(self, device: str, max_restarts: int, period_s: float):
        import torch.multiprocessing as mp

        self.device, self.max_restarts, self.period_s = device, max_restarts, period_s
        self._ctx = mp.get_context("spawn")
        self._lock = threading.Lock()
        # Writes to the pipe, apart from _lock: a write under _lock made the reader thread, come to resolve replies
        # while it ran, sleep on _lock and be woken again (two thread switches a request on 2 cores).
        self._send_lock = threading.Lock()
        self._ready = threading.Event()
        self._ids = itertools.count()
        self.generation = 0
        self.failed: str | None = None
        self.intensity = RestartIntensity(max_restarts, period_s)
        # rid -> (future, what, the outputs a run's Reply names: None for other messages, whether a caller reads
        # for it)
        self.inflight: dict[int, tuple[concurrent.futures.Future, str, tuple | None, bool]] = {}
        self.slots: dict[int, int] = {}  # buffer id -> its live generation (this worker generation's buffers)
        self._slot_ids = itertools.count()
        self._closing = False
        self._accepting = False  # under the lock: requests may be sent on self.conn
        self._start()

    # -- life cycle -------------------------------------------------------------------------------------------
    def _start(self) -> None:
        from . import worker

        generation = self.generation + 1
        parent, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=worker.main, args=(child, self.device, generation), daemon=True,
                                      name=f"kernelplan-worker-{self.device}-{generation}")
        self.proc.start()
        child.close()
        try:
            kind, _, detail = parent.recv() if parent.poll(_START_TIMEOUT_S) else ("timeout", None, None)
        except (EOFError, OSError) as e:
            kind, detail = "died", e
        if kind != "ready":
            raise DeviceFailed(f"the {self.device} worker did not start: {detail or f'no answer in {_START_TIMEOUT_S} s'}")
        stream = ReplyStream(parent, generation, self)
        with self._lock:
            self.generation, self.slots, self.conn, self._accepting = generation, {}, parent, True
            self.stream = stream
        self.reader = threading.Thread(target=stream.reader_thread, daemon=True,
                                       name=f"kernelplan-reader-{self.device}-{generation}")
        self.reader.start()
        self._ready.set()

    def _on_death(self, generation: int, sticky: str | None) -> None:
        with self._lock:  # from here no request is sent to the dead worker, and none in flight is missed
            self._accepting = False
            lost, self.inflight = self.inflight, {}
        self._ready.clear()
        self.proc.join(timeout=5)
        code = self.proc.exitcode
        cause = (sticky if sticky and sticky.startswith("a reply") else f"a sticky CUDA error: {sticky}" if sticky else
                 f"the worker was killed by signal {-code}" if code is not None and code < 0 else
                 f"the worker exited with code {code}")
        self.fail_lost(lost, generation, cause)
        if not self._closing:
            self.restart(cause)

    def close(self) -> None:
        self._closing = True
        self._ready.wait(timeout=_START_TIMEOUT_S)  # a restart under way finishes first
        try:
            with self._send_lock:
                self.conn.send(("stop", None))
        except (OSError, ValueError):
            pass
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.kill()
        with self._lock:
            lost, self.inflight = self.inflight, {}
        for fut, what, *_ in lost.values():
            fut.set_exception(DeviceFault(f"{what} on {self.device}: the runtime was closed"))

    # -- requests ---------------------------------------------------------------------------------------------
    def submit(self, message: tuple, what: str, buffers=(), make=None, outputs=None,
               attended: bool = False) -> concurrent.futures.Future:
        """Send ``message`` (its request id is filled in) once the worker is ready; ``make()`` runs under the lock
        first (a new buffer's slot) and its value goes in the message's tail.  ``outputs``: a run's, for its Reply.
        ``attended``: the caller waits for it at once, through ``wait`` (it reads the reply itself)."""
        fut = Pending()
        while True:
            if not self._ready.is_set():
                self._ready.wait()
            with self._lock:
                if self.failed:
                    raise DeviceFailed(self.failed)
                accepting = self._accepting
                if accepting:
                    self.check(buffers)
                    rid = next(self._ids)
                    extra = make() if make else ()
                    self.inflight[rid] = (fut, what, outputs, attended)
                    conn, stream = self.conn, self.stream
                    if attended:
                        fut.stream = stream
                    else:
                        stream.attend()
            if accepting:
                try:
                    with self._send_lock:
                        send_message(conn, (message[0], rid, *message[1:], *extra))
                    return fut
                except (OSError, ValueError):  # not delivered: the worker is dying
                    with self._lock:
                        mine = stream.take(rid)
                        if conn is self.conn:
                            self._accepting = False
                    if mine is None:  # the death took it first: it failed with DeviceFault, as one in flight does
                        return fut
                    # else sent again, to the next worker
            time.sleep(0.001)  # a restart is under way (the reader has yet to clear _ready): wait for the new worker

    @staticmethod
    def payload(tensor):
        """What an upload sends: a CPU tensor copied once into fresh shared memory, a CUDA one as it is (an IPC
        handle)."""
        return _shared_copy(tensor)

    def free(self, buf: Buffer) -> None:
        with self._lock:
            self.check([buf])
            self.slots.pop(buf.buffer_id)
            conn = self.conn
        try:
            with self._send_lock:
                conn.send(("free", buf.buffer_id, buf.generation))
        except (OSError, ValueError):
            pass


def _indexed(device):
    """``cuda`` as ``cuda:0``; any other device as it is."""
    import torch

    return torch.device("cuda", 0) if device.type == "cuda" and device.index is None else device


def _shared_copy(tensor):
    """The tensor copied once into fresh shared memory (CPU), or itself (CUDA: sent as an IPC handle)."""
    import torch

    if tensor.device.type == "cuda":
        return tensor
    out = torch.empty(tensor.shape, dtype=tensor.dtype).share_memory_()
    out.copy_(tensor)
    return out


class Runtime:
    """Device workers behind an asyncio API (``upload``, ``download``, ``run``) and a blocking one (``blocking``).

    ``devices``: e.g. ``("cpu",)`` or ``("cuda:0", "cuda:1")``.  ``max_restarts`` worker deaths within ``period_s``
    seconds are restarted; one more fails the device.  ``backend``: ``"local"`` (a spawned process per device,
    the default) or ``"ray"`` (a Ray actor per device, on the cluster ``ray.init`` connected to, or a local one
    it starts: ``ray_worker.py``; the ``ray`` extra).
    """

    def __init__(self, devices=("cpu",), *, max_restarts: int = 5, period_s: float = 60.0, backend: str = "local"):
        import torch

        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}: give one of {', '.join(BACKENDS)}")
        if backend == "ray":
            from .ray_worker import RayDeviceWorker as worker_class
        else:
            worker_class = _DeviceWorker

        # "cuda" is device 0 (of those visible), named so that its buffers and replies say which: asking
        # torch.cuda.current_device() would start CUDA in this, the client's, process.
        self.devices = tuple(str(_indexed(torch.device(d))) for d in devices)
        self._prepared_ids = itertools.count()
        # popitem(last=False) evicts the oldest at once, where a dict's next(iter()) walks the holes its
        # deletions left at the front.
        self._blobs: collections.OrderedDict[int, tuple[object, bytes]] = collections.OrderedDict()
        self._blobs_lock = threading.Lock()
        self._workers: dict[str, SupervisedWorker] = {}
        try:
            for d in self.devices:
                self._workers[d] = worker_class(d, max_restarts, period_s)
        except BaseException:
            self.close()
            raise
        self.blocking = BlockingRuntime(self)

    def _worker(self, device) -> SupervisedWorker:
        import torch

        hit = self._workers.get(device)  # the usual case: a buffer's own device string
        if hit is not None:
            return hit
        key = str(_indexed(torch.device(device)))
        if key not in self._workers:
            raise ValueError(f"device {device!r} is not one of this runtime's: {', '.join(self.devices)}")
        return self._workers[key]

    def worker_generation(self, device=None) -> int:
        return self._worker(device or self.devices[0]).generation

    # -- futures (thread-safe; the asyncio and blocking APIs wrap these) ------------------------------------------
    def submit_upload(self, tensor, device=None) -> concurrent.futures.Future:
        w = self._worker(device or self.devices[0])
        payload = w.payload(tensor.detach())
        holder = {}

        def make():  # under the worker's lock, with the generation the message goes to
            holder["id"], holder["gen"] = w.new_slot()
            holder["worker"] = w.generation
            return holder["id"], holder["gen"], payload

        inner = w.submit(("upload",), f"upload of {tuple(tensor.shape)}", make=make)
        buf = Buffer(w.device, holder["worker"], holder["id"], holder["gen"], tuple(tensor.shape),
                     str(tensor.dtype).removeprefix("torch."))
        return _then(inner, lambda _: buf)

    def submit_download(self, buf: Buffer, attended: bool = False) -> concurrent.futures.Future:
        """(``attended``: the caller waits for the future at once, through ``wait``; so do the other submits.)"""
        return self._worker(buf.device).submit(("download", buf), f"download of {buf}", [buf], attended=attended)

    def submit_run(self, request, attended: bool = False) -> concurrent.futures.Future:
        bufs = buffers_in(getattr(request, "args", None))
        device = bufs[0].device if bufs else self.devices[0]
        return self._worker(device).submit(("run", self._pickled(request)), request.describe(), bufs,
                                           outputs=request.outputs(), attended=attended)

    def _pickled(self, request) -> bytes:
        """The request's bytes, pickled once per request object (the last 64 kept): the worker keys its bound
        requests by them."""
        hit = self._blobs.get(id(request))
        if hit is not None and hit[0] is request:
            return hit[1]
        blob = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        with self._blobs_lock:
            if len(self._blobs) >= 64:
                self._blobs.popitem(last=False)
            self._blobs[id(request)] = (request, blob)  # the request held, so that its id is not reused
        return blob

    def submit_prepare(self, request) -> concurrent.futures.Future:
        """Check ``request`` once in the worker and keep it; the future gives a ``Prepared`` to run again and again
        with only its handles re-checked (a serving loop's fixed buffers; a message of a few bytes)."""
        bufs = buffers_in(request.args)
        w = self._worker(bufs[0].device if bufs else self.devices[0])
        holder = {}

        def make():
            holder["id"], holder["worker"] = next(self._prepared_ids), w.generation
            return holder["id"], request

        inner = w.submit(("prepare",), f"prepare {request.describe()}", bufs, make=make)
        return _then(inner, lambda _: Prepared(request, w.device, holder["worker"], holder["id"]))

    def submit_run_prepared(self, prepared: "Prepared", attended: bool = False) -> concurrent.futures.Future:
        w = self._worker(prepared.device)
        if prepared.worker_generation != w.generation:
            raise StaleBuffer(f"{prepared} was prepared on worker generation {prepared.worker_generation}; the "
                              f"current one is {w.generation} (restarted): prepare it again with new buffers")
        return w.submit(("run_prepared", prepared.prepared_id), prepared.what, prepared.buffers,
                        outputs=prepared.outputs, attended=attended)

    def wait(self, fut: concurrent.futures.Future):
        """The result of a future that a submit with ``attended=True`` gave (this thread may read its reply)."""
        stream = getattr(fut, "stream", None)  # a local worker's Pending; a Ray one's reply comes on Ray's thread
        return fut.result() if stream is None else stream.wait(fut)

    def free(self, buf: Buffer) -> None:
        """Release a buffer; its handle (and every copy of it) is stale from here on."""
        self._worker(buf.device).free(buf)

    # -- asyncio --------------------------------------------------------------------------------------------------
    async def upload(self, tensor, device=None) -> Buffer:
        return await asyncio.wrap_future(self.submit_upload(tensor, device))

    async def download(self, buf: Buffer):
        return await asyncio.wrap_future(self.submit_download(buf))

    async def run(self, request):
        """A request, or a ``Prepared`` one."""
        submit = self.submit_run_prepared if isinstance(request, Prepared) else self.submit_run
        return await asyncio.wrap_future(submit(request))

    async def prepare(self, request) -> "Prepared":
        return await asyncio.wrap_future(self.submit_prepare(request))

    def close(self) -> None:
        for w in self._workers.values():
            w.close()
        self._workers = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class BlockingRuntime:
    """The same calls, each waiting for its reply."""

    def __init__(self, rt: Runtime):
        self._rt = rt

    def upload(self, tensor, device=None) -> Buffer:
        return self._rt.submit_upload(tensor, device).result()

    def download(self, buf: Buffer):
        return self._rt.wait(self._rt.submit_download(buf, attended=True))

    def run(self, request):
        submit = self._rt.submit_run_prepared if isinstance(request, Prepared) else self._rt.submit_run
        return self._rt.wait(submit(request, attended=True))

    def prepare(self, request) -> "Prepared":
        return self._rt.submit_prepare(request).result()

    def free(self, buf: Buffer) -> None:
        self._rt.free(buf)


@dataclass(frozen=True)
class Prepared:
    """A request kept by one worker generation (``Runtime.prepare``)."""

    request: object
    device: str
    worker_generation: int
    prepared_id: int
    # Worked out once, not on every run: what a failure names, the handles checked, the Reply's outputs.
    what: str = field(init=False, repr=False, compare=False)
    buffers: tuple = field(init=False, repr=False, compare=False)
    outputs: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "what", self.request.describe())
        object.__setattr__(self, "buffers", tuple(buffers_in(self.request.args)))
        object.__setattr__(self, "outputs", self.request.outputs())


def _then(fut: concurrent.futures.Future, fn) -> concurrent.futures.Future:
    out: concurrent.futures.Future = concurrent.futures.Future()

    def done(f):
        exc = f.exception()
        if exc is not None:
            out.set_exception(exc)
        else:
            out.set_result(fn(f.result()))

    fut.add_done_callback(done)
    return out
