"""The plan contract shared by every op (modelled on baracuda-kernels' plans).

A call is described by a frozen ``Descriptor`` dataclass.  ``Plan.select``
asks every registered backend whether it ``supports`` the descriptor; a
backend answers ``None`` (yes) or a reason string (no).  If none can take the
problem, the error lists every reason.  The chosen plan then validates real
tensors (``can_implement``), reports the ``workspace_size`` it needs and
``run``s.  ``sku`` and ``precision_guarantee`` say what ran and what the
numbers can be trusted for.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Iterator

import torch

from ._checks import same_device
from .errors import InvalidProblem, InvalidState, Unsupported, WorkspaceTooSmall
from .kernels import current_device, on_device

log = logging.getLogger("kernelplan.plan")


@dataclass(frozen=True)
class PlanPreference:
    """What ``Plan.select`` should optimise for.

    * ``PlanPreference()`` / ``PlanPreference.FASTEST``: the fastest backend
      measured on this device for this problem, else the highest-priority one;
    * ``PlanPreference.only("reference")``: that backend or an error;
    * ``PlanPreference.deterministic_only()``: only bitwise-reproducible backends.
    """

    backend: str | None = None
    deterministic: bool = False

    @classmethod
    def only(cls, backend: str) -> "PlanPreference":
        return cls(backend=backend)

    @classmethod
    def deterministic_only(cls) -> "PlanPreference":
        return cls(deterministic=True)


PlanPreference.FASTEST = PlanPreference()


@dataclass(frozen=True)
class PrecisionGuarantee:
    math_precision: str  # precision of the products: "f64", "f32", "tf32", "bf16", ...
    accumulator: str  # dtype sums are kept in
    deterministic: bool  # same inputs, same device -> same bits, run after run
    bit_stable: bool  # same bits across launches with other shapes in flight / batch sizes
    note: str = ""


@dataclass(frozen=True)
class Sku:
    """Which op, dtype, architecture and backend a plan runs."""

    op: str
    dtype: str
    arch: str
    backend: str
    epilogue: str | None = None


class Backend:
    """One way to run an op.  Subclasses override what differs from these defaults."""

    name: ClassVar[str]
    # Which backend ``PlanPreference.FASTEST`` takes before anything was measured.
    # The reference is 0; a GPU kernel that is usually faster says so with more.
    priority: ClassVar[int] = 0

    def supports(self, desc) -> str | None:
        raise NotImplementedError(f"{type(self).__name__}.supports")

    def precision(self, desc) -> PrecisionGuarantee:
        raise NotImplementedError(f"{type(self).__name__}.precision")

    def priority_for(self, desc) -> int:
        """``priority`` for this problem; a backend that can run but should not be the default lowers it."""
        return self.priority

    def workspace_size(self, desc) -> int:
        return 0

    def can_implement(self, desc, args) -> None:
        """Backend-specific checks of real tensors (alignment, contiguity)."""

    def run(self, desc, args, workspace: torch.Tensor | None) -> None:
        raise NotImplementedError(f"{type(self).__name__}.run")

    def bind(self, desc) -> Callable | None:
        """A call for ``desc`` that takes the op's checked inputs and returns its output, or None.

        An op's functional path calls it, where offered, instead of building
        args for ``run``: the host work of each call is then what the backend
        itself needs, which on a host-bound call (decode) is the call's time.
        """
        return None


class BackendRegistry:
    """The ordered backends of one op.  ``reference`` is registered first."""

    def __init__(self, op: str):
        self.op = op
        self._backends: dict[str, Backend] = {}
        self.version = 0  # bumps on every change, so memoised plans are dropped

    def register(self, backend: Backend) -> Backend:
        if backend.name in self._backends:
            raise InvalidProblem(
                f"backend name {backend.name!r} is already registered for op {self.op!r}; "
                f"unregister it first or choose another name"
            )
        self._backends[backend.name] = backend
        self.version += 1
        return backend

    def unregister(self, name: str) -> Backend:
        backend = self._backends.pop(name)
        self.version += 1
        return backend

    def get(self, name: str) -> Backend | None:
        return self._backends.get(name)

    def names(self) -> list[str]:
        return list(self._backends)

    def __iter__(self) -> Iterator[Backend]:
        return iter(list(self._backends.values()))


@functools.lru_cache(maxsize=None)
def _cuda_arch(index: int) -> str:
    major, minor = torch.cuda.get_device_capability(index)
    return f"sm{major}{minor}"


def arch_of(device: str) -> str:
    """``"cpu"`` or ``"sm90"``-style; queries CUDA only when first asked about a GPU."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return _cuda_arch(dev.index if dev.index is not None else torch.cuda.current_device())
    return dev.type


def _canonical_device(key: dict[str, Any]) -> dict[str, Any]:
    """``cuda`` and ``cuda:0`` name one GPU: measurements must not depend on the spelling."""
    dev = torch.device(key["device"]) if "device" in key else None
    if dev is not None and dev.type == "cuda" and dev.index is None:
        key["device"] = f"cuda:{torch.cuda.current_device()}"
    return key


def descriptor_key(desc) -> dict[str, Any]:
    """A JSON-able dict of a descriptor, for plan-cache keys."""
    return {f.name: getattr(desc, f.name) for f in dataclasses.fields(desc)}


class Plan:
    """Base of every op's plan.  Build one with ``select``, never directly."""

    op: ClassVar[str]
    registry: ClassVar[BackendRegistry]

    def __init__(self, desc, backend: Backend):
        self.desc = desc
        self.backend = backend
        self.sku = Sku(
            op=self.op,
            dtype=desc.dtype,
            arch=arch_of(desc.device),
            backend=backend.name,
            epilogue=getattr(desc, "epilogue", None),
        )
        self.precision_guarantee = backend.precision(desc)
        self._workspace_bytes: int | None = None  # run_prechecked's, asked of the backend once
        # The CUDA device the backend launches on, made current around its run (None: CPU, or "cuda"
        # meaning the current one).  Libraries launch into the current device, torch's ops do not.
        device = torch.device(desc.device)
        self._device_index = device.index if device.type == "cuda" else None

    # -- selection -------------------------------------------------------
    @classmethod
    def check_descriptor(cls, desc) -> None:
        """Raise :class:`InvalidProblem` if ``desc`` is ill-formed for every backend."""

    @classmethod
    def dispatch_key(cls, desc) -> dict[str, Any]:
        """The plan-cache key a measured choice is stored under; ops that bucket sizes override it."""
        return _canonical_device(descriptor_key(desc))

    @classmethod
    def candidates(cls, desc) -> list[Backend]:
        """The backends that support ``desc``, in registration order."""
        cls.check_descriptor(desc)
        return [b for b in cls.registry if b.supports(desc) is None]

    @classmethod
    def measured(cls, desc) -> dict | None:
        """The stored measurement for ``desc``'s dispatch key, if any."""
        from .cache import plan_cache

        cache = plan_cache()
        row = cache.get(f"dispatch:{cls.op}", cls.dispatch_key(desc))
        if row is None or (isinstance(row, dict) and isinstance(row.get("backend"), str)):
            return row
        # A row of another shape (hand-edited, another version's): missing, not a crash in dispatch.
        cache._warn_once(f"kernelplan plan cache {cache.path}: the stored {cls.op} choice for {desc} is "
                         f"{str(row)[:80]!r}, not a {{'backend': name}} record; it counts as missing")
        return None

    @classmethod
    def select(cls, desc, preference: PlanPreference = PlanPreference.FASTEST) -> "Plan":
        cls.check_descriptor(desc)
        reasons: dict[str, str] = {}
        candidates: list[Backend] = []
        for backend in cls.registry:
            if preference.backend is not None and backend.name != preference.backend:
                reasons[backend.name] = f"not the requested backend {preference.backend!r}"
                continue
            reason = backend.supports(desc)
            if reason is None and preference.deterministic and not backend.precision(desc).deterministic:
                reason = "not deterministic, and a deterministic backend was requested"
            if reason is not None:
                log.debug("%s: backend %s skipped: %s", cls.op, backend.name, reason)
                reasons[backend.name] = reason
                continue
            candidates.append(backend)
        if not candidates:
            if preference.backend is not None and preference.backend not in reasons:
                reasons[preference.backend] = (
                    f"no such backend; registered: {', '.join(cls.registry.names())}"
                )
            listing = "; ".join(f"{name}: {why}" for name, why in reasons.items())
            raise Unsupported(f"no backend of {cls.op} can run {desc}. Reasons: {listing}")
        return cls(desc, cls._choose(desc, candidates))

    @classmethod
    def _choose(cls, desc, candidates: list[Backend]) -> Backend:
        if len(candidates) > 1:
            measured = cls.measured(desc)
            for backend in candidates:
                if measured is not None and backend.name == measured.get("backend"):
                    return backend
        return max(candidates, key=lambda b: b.priority_for(desc))

    @classmethod
    def remember_fastest(cls, desc, timings_s: dict[str, float], *, floor: str | None = None,
                         margin: float = 0.0, ties: dict[str, float] | None = None) -> str:
        """Store the fastest of measured ``{backend: seconds}`` for ``desc``; return its name.

        With ``floor``, that backend is kept unless another beats it by more than
        ``margin`` (a fraction): timings of a few microseconds differ by a few
        percent from run to run, and a win inside that noise is not a win.
        With ``ties`` (``{backend: seconds}`` by a second measure), the backends
        within ``margin`` of the fastest are a tie, which the second measure decides;
        the tie beats the floor where its fastest does.
        """
        unknown = set(timings_s) - set(cls.registry.names())
        if unknown or not timings_s:
            raise InvalidProblem(
                f"timings_s names backends {sorted(unknown) or 'none'}; it must time at least "
                f"one of the registered backends {cls.registry.names()}"
            )
        best = fastest = min(timings_s, key=timings_s.get)
        if ties:
            tied = [name for name, t in timings_s.items() if name in ties and t <= (1 + margin) * timings_s[fastest]]
            best = min(tied, key=ties.get, default=fastest)
        if floor in timings_s and timings_s[fastest] > (1 - margin) * timings_s[floor]:
            best = floor
        from .cache import plan_cache

        plan_cache().put(
            f"dispatch:{cls.op}", cls.dispatch_key(desc), {"backend": best, "timings_s": timings_s}
        )
        _memo.cache_clear()  # memoised plans chose before this measurement existed
        _MEASURED[0] += 1
        return best

    # -- execution -------------------------------------------------------
    def check_args(self, args) -> None:
        """Op-specific checks of real tensors against the descriptor."""

    def can_implement(self, args) -> None:
        """Raise if ``args`` do not match this plan; return None if they do."""
        self.check_args(args)
        self.backend.can_implement(self.desc, args)

    def workspace_size(self) -> int:
        return self.backend.workspace_size(self.desc)

    def run(self, args, workspace: torch.Tensor | None = None, stream=None):
        """Validate everything, then launch.  Nothing is written if a check fails."""
        if self.registry.get(self.backend.name) is not self.backend:
            raise InvalidState(
                f"this {type(self).__name__} was selected with backend {self.backend.name!r}, which has "
                f"since been unregistered or replaced; call {type(self).__name__}.select(desc) again"
            )
        self.can_implement(args)
        workspace = self._workspace(workspace)
        device = torch.device(self.desc.device)
        if stream is None:
            with on_device(self._device_index):
                return self.backend.run(self.desc, args, workspace)
        if device.type != "cuda":
            raise InvalidProblem(
                f"stream is {stream!r} but this plan runs on {device}; streams exist only on "
                f"CUDA devices: pass stream=None"
            )
        with on_device(self._device_index), torch.cuda.stream(stream):
            return self.backend.run(self.desc, args, workspace)

    def bound(self, args):
        """``run_prechecked(args)`` resolved once, as a closure of no arguments, where the backend can (args
        that stay the same tensors, on the current device, no workspace); None otherwise.  For callers that
        run one checked request again and again (the runtime's worker)."""
        make = getattr(self.backend, "bound", None)
        index = self._device_index
        if make is None or self.workspace_size() or (index is not None and current_device() != index):
            return None
        return make(self.desc, args)

    def run_prechecked(self, args) -> None:
        """Launch on the current stream without re-checking ``args`` against the descriptor.

        For the library's functional paths only, which built ``args`` from inputs
        they validated and outputs they allocated: the checks of ``run`` would
        repeat theirs, and on a small problem they are a third of the host time.
        """
        needed = self._workspace_bytes
        if needed is None:
            needed = self._workspace_bytes = self.workspace_size()
        workspace = torch.empty(needed, dtype=torch.uint8, device=self.desc.device) if needed else None
        index = self._device_index
        if index is not None and current_device() != index:
            with torch.cuda.device(index):
                return self.backend.run(self.desc, args, workspace)
        return self.backend.run(self.desc, args, workspace)

    def _workspace(self, workspace: torch.Tensor | None) -> torch.Tensor | None:
        needed = self.workspace_size()
        if workspace is None:
            if needed == 0:
                return None
            return torch.empty(needed, dtype=torch.uint8, device=self.desc.device)
        got = workspace.numel() * workspace.element_size()
        if got < needed:
            raise WorkspaceTooSmall(needed, got)
        if needed > 0 and not same_device(workspace.device, self.desc.device):
            raise InvalidProblem(
                f"workspace is on {workspace.device} but the plan runs on {self.desc.device}; "
                f"allocate the workspace on {self.desc.device}"
            )
        return workspace

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.sku}, {self.precision_guarantee})"


# Bumped by every new measurement: callers that keep selected plans past the memo compare it.
_MEASURED = [0]


def dispatch_generation(plan_cls: type[Plan]) -> tuple[int, int]:
    """Changes whenever what ``memoised_select`` returns for ``plan_cls`` may change."""
    return plan_cls.registry.version, _MEASURED[0]


def memoised_select(plan_cls: type[Plan], desc, preference: PlanPreference = PlanPreference.FASTEST) -> Plan:
    """``plan_cls.select`` behind an in-process memo, for the functional hot path."""
    return _memo(plan_cls, desc, preference, plan_cls.registry.version)


@functools.lru_cache(maxsize=4096)
def _memo(plan_cls, desc, preference, _registry_version):
    return plan_cls.select(desc, preference)
