"""A supervised device runtime: one worker process per device, typed requests, generation-checked buffers.

    from kernelplan.runtime import Runtime, GatedForwardRequest
    with Runtime(devices=("cuda:0",)) as rt:
        x = rt.blocking.upload(torch.randn(16, 256))
        ...

A GPU fault (an illegal address, a sticky CUDA error, a dead worker) fails the
requests in flight with ``DeviceFault``; the worker restarts and later requests
run; handles from before the restart raise ``StaleBuffer``.  See ``client.py``.
"""

from .client import BlockingRuntime, Runtime
from .errors import DeviceFailed, DeviceFault, StaleBuffer
from .requests import (Buffer, FaultRequest, Fp8LinearRequest, GatedBackwardRequest, GatedForwardRequest, GemmRequest,
                       PlanRequest, Reply, Sparse24LinearRequest)

__all__ = ["Runtime", "BlockingRuntime", "Buffer", "Reply", "StaleBuffer", "DeviceFault", "DeviceFailed",
           "PlanRequest", "GemmRequest", "Fp8LinearRequest", "Sparse24LinearRequest", "GatedForwardRequest",
           "GatedBackwardRequest", "FaultRequest"]
