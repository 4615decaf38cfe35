"""``kernels.direct``: compiled Triton kernels launched by one cuLaunchKernel through cuda-bindings."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from kernelplan.errors import KernelPlanError
from kernelplan.kernels import direct

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402


def _fake_kernel(signature: dict, **metadata):
    md = dict(num_ctas=1, launch_cooperative_grid=False, launch_pdl=False, global_scratch_size=0,
              profile_scratch_size=0, num_warps=4, shared=0, name="k")
    md.update(metadata)
    return SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=SimpleNamespace(**md))


@pytest.mark.parametrize("ty, value", [("i8", -7), ("i16", -300), ("i32", -(2**31)), ("i64", -(2**40)),
                                       ("u8", 250), ("u16", 65000), ("u32", 2**32 - 1), ("u64", 2**64 - 1),
                                       ("fp32", 1.5), ("fp64", -2.25), ("*bf16", 0xDEAD0000)])
def test_each_slot_holds_its_value_at_its_start(ty, value):
    """The driver copies a parameter's own size from the start of its 8-byte slot."""
    code, size = direct._slot_code(ty)
    slot = struct.pack("<" + code, value)
    assert len(slot) == 8
    read = {1: "b", 2: "h", 4: "i", 8: "q"}[size]
    if ty.startswith("u") or ty.startswith("*"):
        read = read.upper()
    if ty.startswith("fp"):
        read = {4: "f", 8: "d"}[size]
    assert struct.unpack_from("<" + read, slot)[0] == value


def test_why_not_direct_names_each_reason(monkeypatch):
    plain = {"x": "*fp32", "n": "i32", "BLOCK": "constexpr"}
    monkeypatch.setattr(direct, "_driver", lambda: None)
    assert "cuda-bindings is not installed" in direct.why_not_direct(_fake_kernel(plain))
    monkeypatch.setattr(direct, "_driver", lambda: object())
    assert direct.why_not_direct(_fake_kernel(plain)) is None
    assert "clusters" in direct.why_not_direct(_fake_kernel(plain, num_ctas=2))
    assert "PDL" in direct.why_not_direct(_fake_kernel(plain, launch_pdl=True))
    assert "scratch" in direct.why_not_direct(_fake_kernel(plain, global_scratch_size=64))
    assert "['fp16', 'nvTmaDesc']" in direct.why_not_direct(
        _fake_kernel({**plain, "s": "fp16", "d": "nvTmaDesc"}))


@triton.jit
def _scalars(out_ptr, a, b, c, d, one, e):
    # one == 1 is specialized away by Triton: the launch must skip it.
    tl.store(out_ptr + 0, a.to(tl.float64))
    tl.store(out_ptr + 1, b.to(tl.float64))
    tl.store(out_ptr + 2, c.to(tl.float64))
    tl.store(out_ptr + 3, d.to(tl.float64))
    tl.store(out_ptr + 4, (one + e).to(tl.float64))


@pytest.mark.gpu
def test_direct_launch_passes_pointers_and_32_and_64_bit_scalars():
    from kernelplan.kernels import Launcher

    out = torch.full((5,), float("nan"), dtype=torch.float64, device="cuda")
    args = (out, -123456, -(2**40), 0.375, -1.5 * 2.0**100, 1, 41)  # Python floats pass as fp32
    compiled = Launcher(_scalars).compiled(args, {}, num_warps=1)
    assert compiled.route == "cuLaunchKernel"
    ints = (out.data_ptr(), *args[1:])
    compiled((1, 1, 1), ints, torch.cuda.current_stream().cuda_stream)
    expected = torch.tensor([-123456, -(2**40), 0.375, -1.5 * 2.0**100, 42], dtype=torch.float64)
    assert torch.equal(out.cpu(), expected)


@pytest.mark.gpu
def test_direct_launch_refuses_a_signature_its_function_does_not_have():
    from kernelplan.kernels import Launcher

    out = torch.empty(5, dtype=torch.float64, device="cuda")
    kernel = Launcher(_scalars).compiled((out, -123456, -(2**40), 0.375, 2.0, 1, 41), {}, num_warps=1).kernel
    signature = dict(kernel.src.signature, a="i64")  # the function takes a 4-byte a
    fake = SimpleNamespace(src=SimpleNamespace(signature=signature), metadata=kernel.metadata,
                           function=kernel.function)
    with pytest.raises(KernelPlanError, match=r"compiled parameters have sizes \[8, 4, 8, 4, 4, 4, "):
        direct.DirectLaunch(fake, 7)
