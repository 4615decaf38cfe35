"""The layout's CUDA C++ kernels beside cuda_ws (whose own test compiles its tiles: test_sparse24_ws.py) compile under
NVRTC for their architectures on a machine without a GPU: cuda_wg and cuda_sp, both dtypes, with and without an
epilogue.  A change to a shared header or to how the one device layout is read fails here before a GPU run."""

from __future__ import annotations

from kernelplan.kernels import sparse24_sp as sp
from kernelplan.kernels import sparse24_wg as wg


def test_warpgroup_and_mma_sp_kernels_compile(compile_for):
    # Both dtypes and an epilogue, taken in turn (a compile takes seconds on CI's two cores).
    assert compile_for(wg.source(wg.wg_config(256, 4096, 4096, 132), "f16", True, "gelu_tanh"), "sm_90a")[:4] == b"\x7fELF"
    for n, arch, sms, dtype, bias, act in ((16, "sm_90a", 132, "bf16", True, "gelu_tanh"), (64, "sm_80", 108, "f16", False, None),
                                           (8, "sm_89", 128, "bf16", False, "relu")):
        assert compile_for(sp.source(sp.sp_config(n, 4096, 4096, sms), dtype, bias, act), arch)[:4] == b"\x7fELF"
