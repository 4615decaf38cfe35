"""What a device worker is asked to do: typed requests built from each op's plan-level descriptor and Args, with
``Buffer`` handles where the Args hold tensors, and the worker's reply.

A request's ``desc`` is the op's own descriptor (``GemmDescriptor``,
``GemmSparse24Descriptor``, ``GatedActivationDescriptor``); its ``args`` the
op's Args dataclass, each tensor field a ``Buffer`` (``GemmArgs`` with a
``ScaleSet`` of Buffers, too).  The worker selects the plan for ``desc`` (its
memoised choice), swaps each Buffer for its tensor, and runs it.  ``outputs``
names the fields the op writes.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

from ..errors import InvalidProblem


@dataclass(frozen=True)
class Buffer:
    """A handle to a tensor a worker holds: valid while ``worker_generation`` is the device worker's current one and
    ``generation`` the buffer slot's current one (a freed slot's generation moves on)."""

    device: str
    worker_generation: int
    buffer_id: int
    generation: int
    shape: tuple[int, ...]
    dtype: str

    def __repr__(self) -> str:
        return (f"Buffer({self.device} worker gen {self.worker_generation}, #{self.buffer_id} gen {self.generation}, "
                f"{self.dtype}{list(self.shape)})")


@dataclass(frozen=True)
class Reply:
    """What came back: the backend that ran (``sku``), the kernel's time (CUDA events on a GPU, wall time on the
    CPU) and the output buffers the request named."""

    sku: Any
    kernel_ms: float
    outputs: tuple[Buffer, ...]


def buffers_in(value) -> list[Buffer]:
    """Every Buffer in a request's args, ScaleSets included."""
    if isinstance(value, Buffer):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [b for f in dataclasses.fields(value) for b in buffers_in(getattr(value, f.name))]
    return []


def resolve(value, lookup):
    """``value`` with each Buffer replaced by ``lookup(buffer)`` (a new dataclass where one held a Buffer)."""
    if isinstance(value, Buffer):
        return lookup(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        changes = {f.name: resolve(getattr(value, f.name), lookup) for f in dataclasses.fields(value)}
        return dataclasses.replace(value, **changes) if any(
            changes[n] is not getattr(value, n) for n in changes) else value
    return value


@dataclass(frozen=True)
class PlanRequest:
    """One op's plan run on the worker: ``desc`` its descriptor, ``args`` its Args with Buffers for tensors."""

    desc: Any
    args: Any
    plan_class: ClassVar[str] = ""  # "module:Class" of the op's Plan, imported in the worker
    output_fields: ClassVar[tuple[str, ...]] = ()
    args_class: ClassVar[str] = ""

    def __post_init__(self):
        want = self.args_class.rpartition(":")[2]
        if type(self.args).__name__ != want:
            raise InvalidProblem(f"{type(self).__name__}.args is a {type(self.args).__name__}; it takes the op's "
                                 f"{want}, with Buffers (Runtime.upload) where it holds tensors")
        tensors = [f.name for f in dataclasses.fields(self.args)
                   if _is_tensor(getattr(self.args, f.name))]
        if tensors:
            raise InvalidProblem(f"{type(self).__name__}.args.{tensors[0]} is a tensor; a request holds Buffers: "
                                 f"upload it first (buf = await rt.upload(tensor))")
        for name in self.output_fields:
            if getattr(self.args, name, None) is not None and not isinstance(getattr(self.args, name), Buffer):
                raise InvalidProblem(f"{type(self).__name__}.args.{name} is written by the op and must be a Buffer")

    def outputs(self) -> tuple[Buffer, ...]:
        """The buffers the op writes: the Args' output fields that are set."""
        return tuple(getattr(self.args, n) for n in self.output_fields if getattr(self.args, n, None) is not None)

    def describe(self) -> str:
        return f"{type(self).__name__}({self.desc})"


def _is_tensor(value) -> bool:
    import torch

    return isinstance(value, torch.Tensor)


@dataclass(frozen=True)
class GemmRequest(PlanRequest):
    """D = epilogue(alpha op(A) op(B) + beta C + bias): the seed's MatmulRequest (a, b, c, optional d, alpha, beta,
    trans flags and epilogue in ``desc``, bias, aux, ScaleSet) on ``GemmPlan``; ``workspace_hint`` is the bytes of
    workspace the caller expects the plan to want (0: the plan's own)."""

    workspace_hint: int = 0
    plan_class: ClassVar[str] = "kernelplan.gemm.plan:GemmPlan"
    args_class: ClassVar[str] = "kernelplan.gemm.plan:GemmArgs"
    output_fields: ClassVar[tuple[str, ...]] = ("d", "aux", "bgrad")


@dataclass(frozen=True)
class Fp8LinearRequest(GemmRequest):
    """An fp8 linear: a ``GemmRequest`` whose descriptor has fp8 A and B (scales in ``args.scales``)."""

    def __post_init__(self):
        super().__post_init__()
        if not self.desc.is_fp8:
            raise InvalidProblem(f"Fp8LinearRequest.desc has A in {self.desc.dtype}; an fp8 linear takes "
                                 f"float8_e4m3fn or float8_e5m2 A and B (a GemmRequest runs the others)")


@dataclass(frozen=True)
class Sparse24LinearRequest(PlanRequest):
    """y = act(x W^T + bias), W 2:4 in the public format (values, metadata), on ``GemmSparse24Plan``."""

    plan_class: ClassVar[str] = "kernelplan.sparse24.plan:GemmSparse24Plan"
    args_class: ClassVar[str] = "kernelplan.sparse24.plan:GemmSparse24Args"
    output_fields: ClassVar[tuple[str, ...]] = ("y",)


@dataclass(frozen=True)
class GatedForwardRequest(PlanRequest):
    plan_class: ClassVar[str] = "kernelplan.gated:GatedActivationPlan"
    args_class: ClassVar[str] = "kernelplan.gated:GatedActivationArgs"
    output_fields: ClassVar[tuple[str, ...]] = ("y",)


@dataclass(frozen=True)
class GatedBackwardRequest(PlanRequest):
    plan_class: ClassVar[str] = "kernelplan.gated:GatedActivationBackwardPlan"
    args_class: ClassVar[str] = "kernelplan.gated:GatedActivationBackwardArgs"
    output_fields: ClassVar[tuple[str, ...]] = ("dx",)


FAULTS = ("exit", "kill", "sticky", "illegal_address", "sleep", "none")


@dataclass(frozen=True)
class FaultRequest:
    """For tests and drills: ``exit`` (``os._exit``), ``kill`` (SIGKILL to itself), ``sticky`` (a CUDA-error
    exception, reported as a sticky error), ``illegal_address`` (a CUDA kernel writing out of bounds: GPU only),
    ``sleep`` (``seconds``, then a reply), ``none`` (a reply at once: the transport's round trip)."""

    kind: str
    seconds: float = 0.0

    def __post_init__(self):
        if self.kind not in FAULTS:
            raise InvalidProblem(f"FaultRequest.kind is {self.kind!r}; choose one of {', '.join(FAULTS)}")

    def outputs(self) -> tuple[Buffer, ...]:
        return ()

    def describe(self) -> str:
        return f"FaultRequest({self.kind})"
