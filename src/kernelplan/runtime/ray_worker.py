"""``Runtime(backend="ray")``: each device's worker as a Ray actor, for devices on more than one machine.

The actor holds the same ``worker.Worker`` as a local worker process does (its
buffers, plans and bound requests), and the client keeps the same contract:
buffer slots and generations checked before a request is sent, ``DeviceFault``
for every request in flight when the worker dies, restarts under the runtime's
restart intensity, ``StaleBuffer`` for handles from before a restart.  What Ray
gives: the actor's placement (``num_gpus=1`` for a CUDA device; the actor's
process sees one GPU, its ``cuda:0``), its process, ordered calls from one
client, and futures.  What it does not: Ray's own actor restarts are off
(``max_restarts=0``) because a restarted actor would keep the generation of the
one that died; the client starts a new actor itself, with a new generation.

A death is seen as Ray's ``RayActorError`` on any call in flight (the process
exited or was killed, or its node was lost), or as a sticky CUDA error the actor
reports: then the client kills the actor, whose CUDA context is poisoned.

Where data is copied: an upload's tensor goes to the actor through Ray's object
store as its bytes (a NumPy array, which Ray serializes without a copy; a CUDA
tensor is first copied to the host, since Ray moves no CUDA IPC handles), then
onto the device; a download comes back the same way.  Tensors are not handed to
Ray's pickling as tensors: a tensor in shared memory (what a worker's download
gives) pickles as a storage that torch's loader refuses in another process
("UntypedStorage has no dtype").  Requests are sent as the bytes the client pickled once
(``Runtime._pickled``), as to a local worker.

Ray is an optional dependency (``pip install kernelplan[ray]``); ``ray.init()``
is called with its defaults (a local cluster) unless the caller connected to one.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import threading

from .client import RestartIntensity, SupervisedWorker
from .errors import DeviceFailed, DeviceFault
from .requests import Buffer, Reply
from .worker import Pending, Ran, Worker, is_sticky_cuda_error, portable, rebuild

_START_TIMEOUT_S = 300  # a new actor's process imports torch before it answers (and may wait for a node)


class Packed(tuple):
    """A tensor as Ray carries it here: (its bytes as a NumPy uint8 array, dtype name, shape)."""


def pack(tensor) -> Packed:
    import torch

    t = tensor.detach().cpu().contiguous()
    return Packed((t.reshape(-1).view(torch.uint8).numpy(), str(t.dtype).removeprefix("torch."), tuple(t.shape)))


def unpack(packed: Packed):
    import torch

    raw, dtype, shape = packed
    return torch.from_numpy(raw.copy()).view(getattr(torch, dtype)).reshape(shape)


class _Actor:
    """The device's ``Worker`` behind one Ray method: a message kind, its arguments, and an answer tuple."""

    def __init__(self, device: str, worker_generation: int):
        import torch

        # Ray gives the actor one GPU, which its process sees as cuda:0, whichever the client named.
        self.worker = Worker("cuda:0" if device.startswith("cuda") else device, worker_generation)
        self.torch = torch

    def ready(self) -> int:
        import os

        return os.getpid()

    def call(self, kind: str, *args) -> tuple:
        try:
            args = tuple(unpack(a) if isinstance(a, Packed) else a for a in args)
            value = getattr(self.worker, kind)(*args)
            if isinstance(value, Pending):
                value = value.wait()
        except BaseException as e:  # noqa: BLE001 (every failure goes back to the request that caused it)
            if is_sticky_cuda_error(e):
                return ("fault", f"{type(e).__name__}: {e}")
            return ("error", portable(e))
        if isinstance(value, Ran):
            return ("ran", value[0], value[1])
        return ("ok", pack(value) if isinstance(value, self.torch.Tensor) else value)


class RayDeviceWorker(SupervisedWorker):
    """One device's Ray actor, its in-flight requests and buffer slots, and its supervision (``client.py``'s
    ``_DeviceWorker`` contract)."""

    def __init__(self, device: str, max_restarts: int, period_s: float):
        try:
            import ray
        except ImportError as e:
            raise ImportError("Runtime(backend='ray') needs Ray: pip install 'kernelplan[ray]'") from e
        if not ray.is_initialized():
            ray.init()
        self._ray = ray
        self.device = device
        self._remote = ray.remote(num_gpus=1 if device.startswith("cuda") else 0, max_restarts=0)(_Actor)
        self._lock = threading.Lock()
        self._ready = threading.Event()  # cleared from a death until the new actor is up (or the device failed)
        self._ids = itertools.count()
        self._slot_ids = itertools.count()
        self.intensity = RestartIntensity(max_restarts, period_s)
        self.generation = 0
        self.failed: str | None = None
        self.inflight: dict[int, tuple[concurrent.futures.Future, str, tuple | None]] = {}
        self.slots: dict[int, int] = {}
        self._closing = False
        self._start()

    def _start(self) -> None:
        generation = self.generation + 1
        actor = self._remote.remote(self.device, generation)
        try:
            self._ray.get(actor.ready.remote(), timeout=_START_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 (a worker that cannot start fails the device, with Ray's reason)
            self._ray.kill(actor)
            raise DeviceFailed(f"the {self.device} Ray actor did not start: {type(e).__name__}: {e}") from None
        with self._lock:
            self.actor, self.generation, self.slots = actor, generation, {}
        self._ready.set()

    # -- requests ---------------------------------------------------------------------------------------------
    @staticmethod
    def payload(tensor) -> Packed:
        """What an upload sends: the tensor's bytes on the host."""
        return pack(tensor)

    def submit(self, message: tuple, what: str, buffers=(), make=None, outputs=None,
               attended: bool = False) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._ready.wait()  # a restart under way finishes first
        with self._lock:
            if self.failed:
                raise DeviceFailed(self.failed)
            self.check(buffers)
            rid = next(self._ids)
            extra = make() if make else ()
            self.inflight[rid] = (fut, what, outputs)
            generation, actor = self.generation, self.actor
            ref = actor.call.remote(message[0], *message[1:], *extra)
        ref.future().add_done_callback(lambda f: self._answer(rid, generation, f))
        return fut

    def _answer(self, rid: int, generation: int, done: concurrent.futures.Future) -> None:
        exc = done.exception()
        if exc is not None:  # the call did not return: the actor is gone (RayActorError and its kin)
            self._death(generation, f"the Ray actor died ({type(exc).__name__}: {exc})")
            return
        answer = done.result()
        if answer[0] == "fault":
            self._death(generation, f"a sticky CUDA error: {answer[1]}", kill=True)
            return
        with self._lock:
            entry = self.inflight.pop(rid, None)
        if entry is None:
            return
        fut, _, outputs = entry
        if answer[0] == "ran":
            fut.set_result(Reply(answer[1], answer[2], outputs))
        elif answer[0] == "ok":
            fut.set_result(unpack(answer[1]) if isinstance(answer[1], Packed) else answer[1])
        else:
            fut.set_exception(rebuild(answer[1]))

    def _death(self, generation: int, cause: str, kill: bool = False) -> None:
        # Handled on a thread of its own: this runs on Ray's callback thread, and ray.kill and the new actor's
        # ray.get wait for answers that thread would deliver (a deadlock when called from it).
        threading.Thread(target=self._on_death, args=(generation, cause, kill), daemon=True,
                         name=f"kernelplan-ray-death-{self.device}").start()

    def _on_death(self, generation: int, cause: str, kill: bool = False) -> None:
        with self._lock:
            if generation != self.generation or self._closing or not self._ready.is_set():
                return  # another call of the same dead actor (its death is being handled), or closed
            lost, self.inflight = self.inflight, {}
            self._ready.clear()  # no request is sent until the new actor is up
            actor = self.actor
        self.fail_lost(lost, generation, cause)
        if kill:  # its CUDA context is poisoned
            self._ray.kill(actor)
        self.restart(cause)

    def free(self, buf: Buffer) -> None:
        with self._lock:
            self.check([buf])
            self.slots.pop(buf.buffer_id)
            self.actor.call.remote("free", buf.buffer_id, buf.generation)

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self.failed = self.failed or f"{self.device}: the runtime was closed"
            lost, self.inflight = self.inflight, {}
            actor = getattr(self, "actor", None)
        self._ready.set()
        if actor is not None:
            self._ray.kill(actor)
        for fut, what, _ in lost.values():
            fut.set_exception(DeviceFault(f"{what} on {self.device}: the runtime was closed"))
