"""The device worker: a process started with ``spawn`` that owns one device, its buffers and its plans.

Messages in (a ``multiprocessing`` connection, pickled with torch's reductions):

* ``("upload", rid, buffer_id, generation, tensor)``, ``("download", rid, buffer_id, generation)``,
  ``("free", buffer_id, generation)`` (no reply), ``("run", rid, request pickled)``: bytes, so that the
  worker finds a request it bound before (the same descriptor and handles) without reading it again or
  checking its plan again, only its handles (``Worker.bound``, the last 64);
* ``("prepare", rid, id, request)``: the request checked once and kept; ``("run_prepared", rid, id)`` runs it
  (its handles checked again by the client; freeing one of them drops it here);

replies out: ``("ok", rid, value)`` or ``("error", rid, exception)``; a request
that ran is answered in a batch of plain tuples, ``("ran", None, [(rid, sku_index,
kernel_ms), ...])``, every request finished since the last batch in one message,
with ``("sku", index, sku)`` sent once before the first use of each sku: the
client builds the ``Reply`` from the outputs its request named.  (Pickling a
``Reply`` of dataclasses, and reading it back, cost 30 us a request; the tuple 2.)
A batch goes out when no message is waiting, or at 8: a request that ran but
was not yet answered when the worker dies fails with ``DeviceFault``, as one
in flight does (its outputs die with the worker).
Before it exits on a sticky CUDA error (the context is poisoned for good), a
worker sends ``("fault", rid, text)``.  Each buffer is checked against its slot's
generation before anything is read or written.
"""

from __future__ import annotations

import collections
import functools
import importlib
import os
import pickle
import select
import signal
import struct
import time

from .errors import StaleBuffer
from .requests import FaultRequest, buffers_in, resolve

STICKY_EXIT = 70  # the worker's exit code after it reported a sticky CUDA error


def send_message(conn, message: tuple) -> None:
    """``conn.send``, with plain pickle where no tensor rides along: ``Connection.send`` builds a
    ForkingPickler, and copies its table of reductions, on every message (about 6 of the 15 us a small one
    cost on 2 cores).  Tensors need those reductions (shared memory, CUDA IPC)."""
    if message[0] == "upload" or (message[0] == "ok" and hasattr(message[2], "data_ptr")):  # a tensor
        conn.send(message)
    else:
        conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


class FrameReader:
    """The messages of a ``multiprocessing`` connection's byte stream (a 4-byte big-endian length, or -1 and 8
    bytes, then the pickle), read off its file descriptor as many at a time as one ``read`` brings.
    ``Connection.recv`` makes two reads a message, and a reader that sleeps between them makes the writer wake it
    each time: on 2 cores those syscalls and wake-ups were most of a pipelined request's cost
    (bench/runtime_latency.py).  The connection's other reader must not read from it once this one has."""

    _CHUNK = 1 << 16

    def __init__(self, conn):
        self.fd = conn.fileno()
        self.buf = bytearray()
        self.pos = 0

    def _frame(self):
        """The next whole message's (start, end) in ``buf``, or None."""
        have = len(self.buf) - self.pos
        if have < 4:
            return None
        size, = struct.unpack_from("!i", self.buf, self.pos)
        start = self.pos + 4
        if size == -1:
            if have < 12:
                return None
            size, = struct.unpack_from("!Q", self.buf, start)
            start += 8
        return (start, start + size) if len(self.buf) >= start + size else None

    def pending(self) -> bool:
        """A whole message is buffered (no syscall)."""
        return self._frame() is not None

    def ready(self) -> bool:
        """A whole message is buffered, or bytes wait on the descriptor (``Connection.poll(0)``)."""
        return self.pending() or bool(select.select([self.fd], [], [], 0)[0])

    def recv(self):
        """The next message, unpickled (torch's reductions apply: they are registered with pickle's copyreg);
        ``EOFError`` where the other end closed the stream."""
        while (frame := self._frame()) is None:
            if self.pos:  # drop what was read before reading on
                del self.buf[:self.pos]
                self.pos = 0
            chunk = os.read(self.fd, self._CHUNK)
            if not chunk:
                raise EOFError
            self.buf += chunk
        start, end = frame
        self.pos = end
        return pickle.loads(memoryview(self.buf)[start:end])


def portable(exc: BaseException):
    """The exception itself where it survives pickling, else (module, class name, message) for ``rebuild``: an
    exception whose ``__init__`` takes more than its message (``BufferTooSmall``) cannot be unpickled."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001
        return (type(exc).__module__, type(exc).__qualname__, str(exc))


def rebuild(value) -> BaseException:
    """The client's side of ``portable``: the same class, made without its ``__init__``, with the message."""
    if isinstance(value, BaseException):
        return value
    module, name, message = value
    try:
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, BaseException)):
            raise TypeError(name)
        exc = cls.__new__(cls)
        exc.args = (message,)
        return exc
    except Exception:  # noqa: BLE001
        return RuntimeError(f"{module}.{name}: {message}")


def is_sticky_cuda_error(exc: BaseException) -> bool:
    """A CUDA error that leaves the context unusable: any CUDA error in an exception's text (torch raises
    ``torch.AcceleratorError``, a RuntimeError, with the driver's message)."""
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("CUDA error" in text or "illegal memory access" in text
                                              or "unspecified launch failure" in text)


class Ran(tuple):
    """A request that ran: ``(sku, kernel_ms)``; the client adds the outputs its request named (``Reply``)."""


class Pending:
    """A GPU request launched and not yet complete: its events, and what its reply will say."""

    __slots__ = ("start", "end", "sku", "pool")  # pool: the worker's free events, reused

    def __init__(self, start, end, sku, pool):
        self.start, self.end, self.sku, self.pool = start, end, sku, pool

    def wait(self, done: bool = False) -> Ran:
        if not done:  # (a query already said so)
            self.end.synchronize()
        ran = Ran((self.sku, self.start.elapsed_time(self.end)))
        self.pool.append((self.start, self.end))
        return ran


class Worker:
    def __init__(self, device: str, worker_generation: int):
        import torch

        self.torch = torch
        self.device = torch.device(device)
        self.worker_generation = worker_generation
        self.buffers: dict[int, tuple[int, object]] = {}  # id -> (generation, tensor)
        self.prepared: dict[int, tuple] = {}  # id -> (request, plan, args as tensors), checked once
        # a request's bytes -> (its buffers, plan, args): the last 64 run (the client's _blobs: why ordered)
        self.bound: collections.OrderedDict[bytes, tuple] = collections.OrderedDict()
        self.events: list = []  # CUDA timing events, reused
        self.stream = None
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # Events record on it by name: Event.record() with no stream asks torch.cuda.current_stream(), 8 of
            # the 10 us a record cost on an H100's host (bench/runtime_latency.py).  The worker never changes it.
            self.stream = torch.cuda.current_stream(self.device)

    def tensor(self, buf) -> object:
        held = self.buffers.get(buf.buffer_id)
        if buf.worker_generation != self.worker_generation or held is None or held[0] != buf.generation:
            current = None if held is None else held[0]
            raise StaleBuffer(f"{buf} is stale on this worker (worker generation {self.worker_generation}, "
                              f"slot generation {current}): it was freed, or made before a restart; upload again")
        return held[1]

    def upload(self, buffer_id: int, generation: int, tensor):
        # A CPU tensor arrives in shared memory the client copied it into (runtime/client.py), which nothing else
        # holds: a CPU worker keeps it as it is.  A CUDA tensor arrives as an IPC handle to the caller's memory:
        # copied once, so the buffer does not depend on the caller keeping it.  Other devices: one copy onto this one.
        t = tensor if tensor.device == self.device and tensor.is_shared() else tensor.to(self.device, copy=True)
        self.buffers[buffer_id] = (generation, t)
        return None

    def download(self, buf):
        # A snapshot in fresh shared memory (one copy, which the reply's pickling then passes without another):
        # the worker's later writes do not show through the caller's tensor.
        t = self.tensor(buf)
        out = self.torch.empty(t.shape, dtype=t.dtype).share_memory_()
        out.copy_(t)
        return out

    def free(self, buffer_id: int, generation: int) -> None:
        held = self.buffers.get(buffer_id)
        if held is not None and held[0] == generation:
            del self.buffers[buffer_id]
            # A prepared request holding the tensor would keep its memory: it could only be refused from here on.
            for pid in [p for p, (request, *_) in self.prepared.items()
                        if any(b.buffer_id == buffer_id for b in buffers_in(request.args))]:
                del self.prepared[pid]
            for blob in [k for k, (bufs, *_) in self.bound.items() if any(b.buffer_id == buffer_id for b in bufs)]:
                del self.bound[blob]

    def _bind(self, request):
        """The request's plan and its args as tensors, after every check: handles, then the plan's own."""
        for buf in buffers_in(request.args):  # every handle checked before anything is read or written
            self.tensor(buf)
        module, _, name = request.plan_class.partition(":")
        plan_cls = getattr(importlib.import_module(module), name)
        from ..plan import memoised_select

        plan = memoised_select(plan_cls, request.desc)
        args = resolve(request.args, self.tensor)
        hint = getattr(request, "workspace_hint", 0)
        if hint and plan.workspace_size() > hint:
            raise ValueError(f"{request.describe()}: the plan ({plan.sku}) wants {plan.workspace_size()} bytes of "
                             f"workspace, more than the request's workspace_hint of {hint}")
        plan.can_implement(args)
        return plan, args, plan.bound(args)

    def run(self, blob: bytes):
        """A request as the client pickled it; bound again only if these bytes were not run lately."""
        entry = self.bound.get(blob)
        if entry is None:
            request = pickle.loads(blob)
            if isinstance(request, FaultRequest):
                return self.fault(request)
            bound = self._bind(request)
            if len(self.bound) >= 64:
                self.bound.popitem(last=False)  # the oldest
            entry = self.bound[blob] = (buffers_in(request.args), *bound)
        else:
            for buf in entry[0]:  # a handle freed since (or from before a restart) is refused here
                self.tensor(buf)
        return self._launch(*entry[1:])

    def prepare(self, prepared_id: int, request) -> None:
        self.prepared[prepared_id] = (request, *self._bind(request))

    def run_prepared(self, prepared_id: int):
        entry = self.prepared.get(prepared_id)
        if entry is None:
            raise StaleBuffer(f"prepared request #{prepared_id} is gone from this worker: one of its buffers was "
                              f"freed; prepare it again with live buffers")
        _, plan, args, launch = entry
        return self._launch(plan, args, launch)

    def _launch(self, plan, args, launch=None):
        """``launch``: the plan's ``bound`` closure of these args, where it has one (one driver call)."""
        run = launch or functools.partial(plan.run_prechecked, args)
        if self.device.type == "cuda":
            # Launched, not waited for: the reply goes out when the end event completes (``main``'s ``settle``),
            # so the next request's launch overlaps this one's kernel.
            start, end = self.events.pop() if self.events else (self._event(), self._event())
            start.record(self.stream)
            run()
            end.record(self.stream)
            return Pending(start, end, plan.sku, self.events)
        t0 = time.perf_counter()
        run()
        return Ran((plan.sku, (time.perf_counter() - t0) * 1e3))

    def _event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def fault(self, request: FaultRequest):
        if request.kind == "exit":
            os._exit(3)
        if request.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if request.kind == "sticky":
            raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated by FaultRequest)")
        if request.kind == "illegal_address":
            from .fault_kernel import write_out_of_bounds

            write_out_of_bounds(self.device)
            self.torch.cuda.synchronize(self.device)
        if request.kind == "sleep":
            time.sleep(request.seconds)
        return Ran((None, 0.0))


def main(conn, device: str, worker_generation: int) -> None:
    """The worker's loop (the spawned process's target)."""
    importlib.import_module("torch.multiprocessing")  # registers torch's reductions: shared memory, CUDA IPC

    try:
        worker = Worker(device, worker_generation)
    except BaseException as e:  # noqa: BLE001 (reported, then the process ends)
        conn.send(("fault", None, f"the worker could not start on {device}: {type(e).__name__}: {e}"))
        return
    send = functools.partial(send_message, conn)
    reader = FrameReader(conn)
    launched: collections.deque = collections.deque()  # (rid, Pending) of GPU requests, in launch order
    ran: list = []  # (rid, sku index, kernel ms) of requests done and not yet answered: one message for them all
    skus: dict = {None: -1}  # sku -> index, as the client was told

    def done(rid, result: Ran) -> None:
        sku, ms = result
        index = skus.get(sku)
        if index is None:
            index = skus[sku] = len(skus) - 1
            send(("sku", index, sku))
        ran.append((rid, index, ms))
        if len(ran) >= 8:  # a steady stream of messages does not hold answers back for long
            flush()

    def flush() -> None:
        if ran:
            send(("ran", None, ran[:]))
            ran.clear()

    def fail(rid, e: BaseException) -> None:
        if is_sticky_cuda_error(e):
            flush()  # what finished before the fault is answered as such
            send(("fault", rid, f"{type(e).__name__}: {e}"))
            conn.close()
            os._exit(STICKY_EXIT)
        send(("error", rid, portable(e)))

    def settle(block: bool) -> None:
        """Reply for the launched requests whose kernels are done, in launch order; ``block``: wait for the oldest.
        One thread does it all: a second one, waiting on events, cost GIL hand-offs on every request."""
        while launched:
            rid, pending = launched[0]
            try:
                finished = pending.end.query()
                if not (block or finished):
                    return
                launched.popleft()
                done(rid, pending.wait(finished))
            except BaseException as e:  # noqa: BLE001 (a CUDA error here is sticky: fail() ends the worker)
                if launched and launched[0][0] == rid:
                    launched.popleft()
                fail(rid, e)
            block = False

    send(("ready", None, os.getpid()))
    while True:
        if not reader.ready():  # nothing new to launch: answer what is done, then the oldest kernel's reply
            flush()
            if launched:
                settle(True)
                continue
        try:
            msg = reader.recv()
        except (EOFError, OSError):  # the client is gone
            return
        kind, rid = msg[0], msg[1]
        if kind == "stop":
            return
        if kind == "free":
            worker.free(msg[1], msg[2])
            continue
        try:
            if kind == "upload":
                value = worker.upload(msg[2], msg[3], msg[4])
            elif kind == "download":
                value = worker.download(msg[2])
            elif kind == "prepare":
                value = worker.prepare(msg[2], msg[3])
            elif kind == "run_prepared":
                value = worker.run_prepared(msg[2])
            else:
                value = worker.run(msg[2])
            if isinstance(value, Pending):
                launched.append((rid, value))
                settle(False)
            elif isinstance(value, Ran):
                done(rid, value)
            else:
                send(("ok", rid, value))
        except BaseException as e:  # noqa: BLE001 (every failure goes back to the request that caused it)
            fail(rid, e)
