"""The runtime's errors: a handle that is no longer valid, and a device worker that failed."""

from __future__ import annotations

from ..errors import KernelPlanError


class StaleBuffer(KernelPlanError):
    """A Buffer handle that was freed, or made by a worker before its restart: nothing was read or written."""


class DeviceFault(KernelPlanError):
    """The device worker died or reported a sticky CUDA error while the request was in flight."""


class DeviceFailed(DeviceFault):
    """The device worker restarted more often than the restart intensity allows: the device is marked failed."""
