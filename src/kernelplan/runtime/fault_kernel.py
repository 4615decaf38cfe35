"""The fault drill's kernel (``kernels/cuda/fault.cu``): a write to an address no allocation holds."""

from __future__ import annotations


def write_out_of_bounds(device) -> None:
    """Launch the kernel on ``device`` (a CUDA device) on the current stream; the error shows at the next sync."""
    import torch

    from ..kernels import nvrtc
    from ..kernels.direct import FunctionLaunch

    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = nvrtc.function(nvrtc.cuda_source("fault.cu"), "kp_write_out_of_bounds", index)
    # 16 bytes past the null page's start: nothing is mapped there on any CUDA device.
    FunctionLaunch(fn, "kp_write_out_of_bounds", ["*i32"], 32, 0)((1, 1, 1), (16,), torch.cuda.current_stream(device).cuda_stream)
