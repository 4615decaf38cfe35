"""The layout's CUDA C++ kernels beside cuda_ws (whose own test compiles its tiles: test_sparse24_ws.py) compile under
NVRTC for their architectures on a machine without a GPU: cuda_wg, cuda_sp and cuda_mma, both dtypes, with and
without an epilogue.  A change to a shared header or to how the one device layout is read fails here before a GPU
run.  And the sources are where the project keeps them: in the package's .cu/.cuh files, with no multi-line macros."""

from __future__ import annotations

import re
from importlib import resources
from pathlib import Path

import torch

from kernelplan.kernels import sparse24_mma as mma
from kernelplan.kernels import sparse24_sp as sp
from kernelplan.kernels import sparse24_wg as wg


def test_warpgroup_and_mma_sp_kernels_compile(compile_for):
    # Both dtypes and an epilogue, taken in turn (a compile takes seconds on CI's two cores).
    assert compile_for(wg.source(wg.wg_config(256, 4096, 4096, 132), "f16", True, "gelu_tanh"), "sm_90a")[:4] == b"\x7fELF"
    for n, arch, sms, dtype, bias, act in ((16, "sm_90a", 132, "bf16", True, "gelu_tanh"), (64, "sm_80", 108, "f16", False, None),
                                           (8, "sm_89", 128, "bf16", False, "relu"), (32, "sm_90a", 132, "f16", True, "gelu"),
                                           (4, "sm_80", 108, "bf16", True, "quick_gelu")):
        assert compile_for(sp.source(sp.sp_config(n, 4096, 4096, sms), dtype, bias, act), arch)[:4] == b"\x7fELF"
    for n, arch, dtype, bias, act in ((1, "sm_90a", "bf16", True, "silu"), (16, "sm_80", "f16", False, None)):
        assert compile_for(mma.source(mma.mma_config(n, 4096, 4096, 132), dtype, bias, act), arch)[:4] == b"\x7fELF"


def test_cuda_sources_live_in_cu_files_without_multi_line_macros():
    """Every kernel's CUDA C++ is in the package's .cu/.cuh files (no Python module holds a kernel), and no line of
    them is continued (a trailing backslash: a multi-line macro).  Code is written as functions, lambdas and
    constexpr values; a #define names one of a variant's parameters (issue 26's "CUDA sources")."""
    package = resources.files("kernelplan")
    sources = [p for p in package.joinpath("kernels", "cuda").iterdir() if p.name.endswith((".cu", ".cuh"))]
    assert {"sparse24_mma.cu", "sparse24_sp.cu", "sparse24_ws.cu"} <= {p.name for p in sources}
    assert [f"{p.name}: {line}" for p in sources for line in p.read_text().splitlines() if line.endswith("\\")] == []
    modules = [p for p in Path(str(package)).rglob("*.py")]
    assert len(modules) > 20
    assert [p.name for p in modules if re.search(r"__global__|\basm\s*(volatile\s*)?\(", p.read_text())] == []


def test_the_kernels_erf_gelu_is_accurate_in_fp32_over_its_range():
    """``common.cuh``'s erfc (a fit for 16-bit results, with the fast exponential) emulated in fp32 with its own
    constants, read from the header: gelu within 7e-5 relative of fp64 over z in [-12, 12], the left tail included
    (f16's rounding is 4.9e-4, bf16's 3.9e-3)."""
    text = resources.files("kernelplan.kernels").joinpath("cuda/common.cuh").read_text()
    body = text[text.index("float erfc_nonneg"):text.index("}", text.index("float erfc_nonneg"))]
    first = [float(v) for v in re.findall(r"fmaf\(t, ([-0-9.]+)f, ([-0-9.]+)f\)", body)[0]]
    rest = [float(v) for v in re.findall(r"fmaf\(p, t, ([-0-9.]+)f\)", body)]
    assert len(first) == 2 and len(rest) == 4
    z = torch.linspace(-12, 12, 240001, dtype=torch.float64)
    x = (-z * 0.70710678118654752).float()
    t = 1 / (1 + 0.5 * x.abs())
    p = t * first[0] + first[1]
    for c in rest:
        p = p * t + c
    e = t * torch.exp(-x.abs() * x.abs() + p)
    got = z.float() * 0.5 * torch.where(x >= 0, e, 2 - e)
    want = z * 0.5 * torch.special.erfc(-z / 2 ** 0.5)
    rel = ((got.double() - want).abs() / want.abs()).nan_to_num(0.0)
    assert float(rel.max()) < 7e-5


def test_cuda_sp_stays_within_the_registers_its_rule_sizes_rings_by(compile_for):
    """``sparse24_sp._resident`` counts the CTAs an SM holds by SMALL_N_MAX_REGS registers a thread at n <= 16; a
    tile that took more would hold fewer CTAs than its ring was sized for.  Read from the cubin's resource usage
    (the cuobjdump Triton ships) for the rule's tiles and their nearest candidates, tall and small."""
    import os
    import subprocess
    import tempfile

    import pytest

    triton = pytest.importorskip("triton")
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.isfile(tool):
        pytest.skip("no cuobjdump beside Triton")
    tiles = sp.sp_candidates(16, 152064, 8192, 132)[:3] + sp.sp_candidates(8, 4096, 4096, 132)[:3]
    for cfg in tiles:
        with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
            f.write(compile_for(sp.source(cfg, "bf16", True, "gelu"), "sm_90a"))
            f.flush()
            usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        regs = int(re.search(r"REG:(\d+)", usage).group(1))
        assert 32 <= regs <= sp.SMALL_N_MAX_REGS, (cfg, regs)
