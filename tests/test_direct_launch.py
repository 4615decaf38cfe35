"""``kernels.direct``: compiled Triton kernels launched by one cuLaunchKernel through cuda-bindings."""

from __future__ import annotations

import struct
from types import SimpleNamespace

import pytest
import torch

from helpers import stub_driver
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


def _stub_launch(monkeypatch, types, error=0):
    stub = stub_driver(monkeypatch, types, error)
    return stub, direct.FunctionLaunch("fn", "kp_test", types, 128, 4096)


_SPARSE24 = ["*u16", "*u16", "*u16", "*u16", "*u16", "i32", "i32", "i32", "i32", "i32"]


def test_a_bound_launch_packs_what_the_unbound_one_does(monkeypatch):
    stub, launch = _stub_launch(monkeypatch, _SPARSE24)
    args = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 16, 768, 1024, 1024, 768)
    bound = launch.bind((6, 1, 1), args)
    for x, bias, y in ((0x1000, 0x4000, 0x5000), (0x7770, 0, 0x9990), (0xABC0, 0x4400, 0x5500)):
        launch((6, 1, 1), (x, 0x2000, 0x3000, bias, y) + args[5:], 7)
        bound(x, bias, y, 7)
        unbound, got = stub.launches[-2:]
        assert got == unbound and got[0] == (6, 1, 1) and got[3] == ("stream", 7)
        assert struct.unpack("<QQ", got[4][3] + got[4][4]) == (bias, y)


def test_a_pdl_launch_packs_the_same_and_asks_for_programmatic_serialization(monkeypatch):
    """``pdl`` (sparse24_ws.cu's KP_PDL experiment, docs/design/0050): the launch goes through cuLaunchKernelEx with
    programmatic stream serialization allowed, its grid, block, shared bytes, stream and parameters those of the
    plain launch, bound or not; without ``pdl`` it stays cuLaunchKernel."""
    stub, launch = _stub_launch(monkeypatch, _SPARSE24)
    args = (0x1000, 0x2000, 0x3000, 0x4000, 0x5000, 16, 768, 1024, 1024, 768)
    launch((6, 2, 3), args, 7)
    plain = stub.launches[-1]
    assert not hasattr(stub, "attributes")
    launch.pdl = True
    for call in (lambda: launch((6, 2, 3), args, 7), lambda: launch.bind((6, 2, 3), args)(0x1000, 0x4000, 0x5000, 7)):
        stub.__dict__.pop("attributes", None)
        call()
        assert stub.launches[-1] == plain
        assert stub.attributes == [(stub.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
                                    {"programmaticStreamSerializationAllowed": 1})]


def test_a_bound_launch_maps_x_once_per_address(monkeypatch):
    types = ["tensormap", "tensormap", "tensormap", "*u16", "*u16", "i32"]
    stub, launch = _stub_launch(monkeypatch, types)
    mapped = []

    def x_map(address):
        mapped.append(address)
        return address.to_bytes(8, "little") * 16

    bound = direct.BoundLaunch(launch, (2, 3, 1), (b"x" * 128, b"v" * 128, b"e" * 128, 0, 0, 5), x_map)
    for x in (0x100, 0x200, 0x100, 0x100):
        bound(x, 0x30, 0x40, 0)
        slots = stub.launches[-1][4]
        assert slots[0] == x.to_bytes(8, "little") * 16 and slots[1:3] == [b"v" * 128, b"e" * 128]
        assert struct.unpack("<QQi", b"".join(slots[3:6])) == (0x30, 0x40, 5)
    assert mapped == [0x100, 0x200]
    for x in range(0x1000, 0x1000 + 16 * (direct.BoundLaunch.MAX_X + 1), 16):  # past its bound: kept ones dropped
        bound(x, 0, 0, 0)
    assert len(bound._maps) <= direct.BoundLaunch.MAX_X


def test_a_bound_launch_refuses_parameters_not_in_the_2_4_kernels_order(monkeypatch):
    _, launch = _stub_launch(monkeypatch, ["*u16", "*u16", "*u16", "i32", "*u16"])  # an i32 where the bias goes
    with pytest.raises(KernelPlanError, match=r"kp_test: parameters .* are not a 2:4 kernel's"):
        launch.bind((1, 1, 1), (1, 2, 3, 4, 5))
    _, launch = _stub_launch(monkeypatch, _SPARSE24)
    with pytest.raises(KernelPlanError, match="x a tensor map"):
        direct.BoundLaunch(launch, (1, 1, 1), (0,) * 10, x_map=lambda x: b"\0" * 128)


def test_a_failed_bound_launch_names_the_kernel_and_its_grid(monkeypatch):
    error = type("CUresult", (), {"name": "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", "__bool__": lambda self: True})()
    _, launch = _stub_launch(monkeypatch, _SPARSE24, error=error)
    bound = launch.bind((9, 1, 1), (0,) * 10)
    with pytest.raises(KernelPlanError, match=r"cuLaunchKernel of kp_test \(grid \(9, 1, 1\).*OUT_OF_RESOURCES"):
        bound(0x100, 0, 0x200, 0)
