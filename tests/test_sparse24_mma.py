"""The CUDA C++ 2:4 linear for n <= 16 (``cuda_mma``) against the fp64 oracle; what both tiled kernels share.

The kernel needs a GPU and NVRTC; on CPU the tiled layout it reads, its
launch configuration and its refusals are checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned
from kernelplan.errors import KernelPlanError
from kernelplan.kernels.sparse24 import code_metadata
from kernelplan.kernels.sparse24_mma import MmaConfig, MmaLinear, TiledKernel, mma_config, tiled_codes, tiled_values
from kernelplan.kernels.sparse24_sp import SpKernel
from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan
from kernelplan.sparse24.backends import CudaMmaSparse24Backend, CudaSpSparse24Backend
from test_sparse24_triton import _ACT, check_backend

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Both tiled kernels: cuda_mma (n <= 16) and cuda_sp (n <= 64, tests/test_sparse24_sp.py).
TILED = [("cuda_mma", TiledKernel, 4), ("cuda_sp", SpKernel, 48)]
each_tiled_kernel = pytest.mark.parametrize("name, kernel, n", TILED, ids=[t[0] for t in TILED])


def test_tiled_layout_puts_each_lanes_words_where_the_kernel_reads_them():
    m, k = 48, 512
    pairs = torch.randint(-2**31, 2**31 - 1, (m, k // 4), dtype=torch.int32)
    codes = torch.randint(-2**31, 2**31 - 1, (k // 64, m, 2), dtype=torch.int32)
    tp, tc = tiled_values(pairs).flatten(), tiled_codes(codes).flatten()
    steps = k // 64
    for tile, s, h, lane in [(0, 0, 0, 0), (2, 7, 1, 31), (1, 3, 0, 13), (2, 0, 1, 6)]:
        g, t = lane >> 2, lane & 3
        run = (tile * steps + s) * 2 + h  # the kernel's pointer arithmetic, per warp step
        for c in range(4):
            assert tp[run * 128 + lane * 4 + c] == pairs[16 * tile + 8 * h + g, 16 * s + 4 * t + c]
        assert tc[run * 16 + g * 2 + (t >> 1)] == codes[s, 16 * tile + 8 * h + g, t >> 1]


def test_tiled_layout_of_a_real_weight_keeps_every_word(seed):
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 256)).half())
    pairs = w24.values.view(torch.int32)
    codes = code_metadata(w24.metadata)
    assert sorted(tiled_values(pairs).flatten().tolist()) == sorted(pairs.flatten().tolist())
    assert sorted(tiled_codes(codes).flatten().tolist()) == sorted(codes.flatten().tolist())


def test_config_makes_about_15_warps_per_sm_with_k_slices_that_divide_k():
    assert mma_config(1, 8192, 8192, 132) == MmaConfig(1, 4, stages=4, min_blocks=4)
    assert mma_config(16, 4096, 4096, 132) == MmaConfig(2, 8, stages=2, min_blocks=2)
    assert mma_config(9, 1024, 4096, 132) == MmaConfig(2, 16, stages=2, min_blocks=1)
    assert mma_config(1, 1024, 192, 132) == MmaConfig(1, 1, stages=4, min_blocks=16)  # 3 K steps: one slice


@pytest.mark.parametrize("backend, max_n", [(CudaMmaSparse24Backend(), 16), (CudaSpSparse24Backend(), 64)],
                         ids=["cuda_mma", "cuda_sp"])
def test_refusals_are_reasons(backend, max_n):
    for desc, reason in [
        (GemmSparse24Descriptor(1, 64, 128, "f32", device="cuda"), "f16 and bf16"),
        (GemmSparse24Descriptor(4, 64, 128, "bf16", device="cpu"), "CUDA devices"),
    ] + ([] if backend.pads_k else [
        (GemmSparse24Descriptor(4, 64, 96, "bf16", device="cuda"), "multiple of 64"),
    ]) + ([] if backend.chunks else [
        (GemmSparse24Descriptor(max_n + 1, 64, 128, "bf16", device="cuda"), f"at most {max_n} rows"),
    ]):
        assert reason in backend.supports(desc)


def test_cuda_sp_takes_any_n_in_chunks_but_competes_only_up_to_its_widest_tile():
    backend = CudaSpSparse24Backend()
    wide = GemmSparse24Descriptor(65, 64, 128, "bf16", device="cuda")
    assert backend.chunks and backend.priority_for(wide) < 0
    assert backend.priority_for(GemmSparse24Descriptor(64, 64, 128, "bf16", device="cuda")) >= 0


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n, m, k, activation, bias, layout", [
    (1, 64, 128, None, False, "contiguous"),
    (3, 70, 192, "relu", True, "contiguous"),  # M not a multiple of 16: padded rows, masked stores
    (8, 1000, 4096, "gelu", True, "transposed"),  # non-contiguous x: copied
    (9, 256, 1024, "gelu_tanh", True, "strided"),  # two N tiles, the second one row
    (16, 4096, 4096, "silu", False, "contiguous"),  # 8 K slices
    (5, 8192, 512, None, True, "contiguous"),
])
def test_cuda_mma_matches_fp64(n, m, k, activation, bias, layout, dtype, seed):
    check_backend("cuda_mma", n, m, k, activation, bias, layout, dtype)


@gpu
@needs_cuda
@each_tiled_kernel
def test_3d_and_misaligned_x_and_strided_y(name, kernel, n, seed):
    w = kp.sparse24.prune(torch.randn(200, 512, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    x = torch.randn(2, n // 2, 513, device="cuda").bfloat16()[..., 1:]  # rows 2 bytes off 16-byte alignment
    call = MmaLinear(None, kernel())
    assert_close(call(x, w24.values, w24.metadata, None), F.linear(x.double(), w.double()), F.linear(x, w),
                 atol=FWD_ATOL[torch.bfloat16])
    x2 = x.reshape(n, 512)
    for y in (poisoned((n, 300), torch.bfloat16, "cuda")[:, :200], poisoned((200, n), torch.bfloat16, "cuda").t()):
        call.launch(x2, w24.values, w24.metadata, None, y)
        assert_close(y, F.linear(x2.double(), w.double()), F.linear(x2, w), atol=FWD_ATOL[torch.bfloat16])


@gpu
@needs_cuda
@each_tiled_kernel
def test_too_many_rows_is_refused_and_nothing_written_or_run_in_chunks(name, kernel, n, seed):
    """A kernel that does not chunk refuses past its widest tile; cuda_sp runs 2.5 tiles of rows, each right."""
    w = kp.sparse24.prune(torch.randn(64, 128, device="cuda")).half()
    w24 = kp.sparse24.compress(w)
    rows = kernel.max_n + 1 if not kernel.chunks else 2 * kernel.max_n + kernel.max_n // 2 + 1
    x = torch.randn(rows, 128, device="cuda").half()
    y = torch.zeros(rows, 64, device="cuda", dtype=torch.float16)
    if not kernel.chunks:
        with pytest.raises(KernelPlanError, match=f"at most {kernel.max_n}"):
            MmaLinear(None, kernel()).launch(x, w24.values, w24.metadata, None, y)
        assert not y.any()
        return
    MmaLinear(None, kernel()).launch(x, w24.values, w24.metadata, None, y)
    assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[torch.float16])


@gpu
@needs_cuda
@each_tiled_kernel
def test_graph_replay_reads_new_inputs(name, kernel, n, seed):
    w = kp.sparse24.prune(torch.randn(4096, 1024, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    b = torch.randn(4096, device="cuda").bfloat16()
    x = torch.randn(n, 1024, device="cuda").bfloat16()
    call = MmaLinear("silu", kernel())
    call(x, w24.values, w24.metadata, b)  # builds the tiled weight outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = call(x, w24.values, w24.metadata, b)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert_close(y, _ACT["silu"](F.linear(x.double(), w.double(), b.double())), F.silu(F.linear(x, w, b)),
                 atol=FWD_ATOL[torch.bfloat16])


@gpu
@needs_cuda
@each_tiled_kernel
def test_dispatch_times_it(name, kernel, n, seed):
    desc = GemmSparse24Descriptor(n, 4096, 4096, "bf16", device="cuda")
    assert name in [b.name for b in GemmSparse24Plan.candidates(desc)]
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(4096, 4096, device="cuda")).bfloat16())
    x = torch.randn(n, 4096, device="cuda").bfloat16()
    plan = GemmSparse24Plan.select(desc, kp.PlanPreference.only(name))
    y = poisoned((n, 4096), torch.bfloat16, "cuda")
    plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y))
    ref = F.linear(x.double(), w24.decompress().double())
    assert_close(y, ref, F.linear(x, w24.decompress()), atol=FWD_ATOL[torch.bfloat16])


def test_a_held_weight_s_launches_build_nothing_a_capture_refuses(monkeypatch):
    """A weight held in the kernel's layout is read as it is: its _TiledWeight takes the weight's own tensors without
    ``derived_from``, which refuses any build inside a CUDA graph capture.  A capture can be a weight state's first
    call (cudagraph trees re-record a graph whose weights moved, in a capture: docs/design/0078).  A weight in
    another layout still goes through derived_from."""
    from kernelplan.kernels import sparse24_mma
    from kernelplan.sparse24.format import prune_compress

    def refused(*args, **kwargs):
        raise AssertionError("derived_from called")

    monkeypatch.setattr(sparse24_mma, "derived_from", refused)
    held = prune_compress(torch.randn(48, 256, dtype=torch.bfloat16), packed=True)
    weight = sparse24_mma._TiledWeight(held.values, held.metadata, None, SpKernel())
    assert weight.held and weight.pairs.data_ptr() == held.values.data_ptr()
    assert weight.codes.data_ptr() == held.metadata.data_ptr()
    public = held.public()
    with pytest.raises(AssertionError, match="derived_from called"):
        sparse24_mma._TiledWeight(public.values, public.metadata, None, SpKernel())


class _Weight:
    """A _TiledWeight's part DirectCall reads: its addresses, device, launch table and slow call (counted), each
    launch it made recorded in ``launched``."""

    def __init__(self, values, metadata, m):
        self.weight, self.device, self.m = (values.data_ptr(), metadata.data_ptr()), 0, m
        self._direct, self.slow_calls, self.launched = {}, [], []

    def linear(self, slow, x, values, metadata, bias):
        self.slow_calls.append(tuple(x.shape))
        y = x.new_zeros(*x.shape[:-1], self.m)
        if x.is_contiguous() and x.data_ptr() % 16 == 0:  # as _first_linear: an entry for x of this shape
            self._direct[(x.shape, bias is None)] = (lambda *a: self.launched.append(a), tuple(y.shape))
        return y


def test_a_direct_call_launches_its_kept_launch_and_sends_the_rest_through_the_weight(monkeypatch):
    """``DirectCall`` (an eager fast-path entry on a weight held in the kernel's layout): its first call goes through
    the weight and keeps the launch the weight made for x's shape; later calls launch it with x's, the bias's and
    y's addresses.  x of another shape, with or without a bias where the kept launch was the other, a copy of x
    that is strided or not 16-byte aligned, the weight's storage replaced, another current device, and launches
    dropped (tile tuning) each go through the weight again."""
    from kernelplan.kernels import sparse24_mma

    monkeypatch.setattr(sparse24_mma, "raw_stream", lambda device: 77)
    device = [0]
    monkeypatch.setattr(sparse24_mma, "current_device", lambda: device[0])
    values, metadata = torch.zeros(4, 2, 128), torch.zeros(4, 2, 32, dtype=torch.int32)
    weight = _Weight(values, metadata, 64)
    call = sparse24_mma.DirectCall(None, weight)
    x, launched = torch.zeros(3, 5, 128), weight.launched
    y = call(x, values, metadata, None)
    assert weight.slow_calls == [(3, 5, 128)] and launched == [] and y.shape == (3, 5, 64)
    for _ in range(2):
        y = call(x, values, metadata, None)
        assert launched[-1] == (x.data_ptr(), 0, y.data_ptr(), 77) and y.shape == (3, 5, 64)
    assert weight.slow_calls == [(3, 5, 128)] and len(launched) == 2
    bias = torch.zeros(64)
    unaligned = torch.zeros(3 * 5 * 128 + 1)[1:].view(3, 5, 128)
    cases = {
        "another shape": (torch.zeros(2, 128), values, metadata, None),
        "a bias": (x, values, metadata, bias),
        "strided x": (torch.zeros(3, 5, 256)[..., ::2], values, metadata, None),
        "unaligned x": (unaligned, values, metadata, None),
        "values replaced": (x, values.clone(), metadata, None),
        "metadata replaced": (x, values, metadata.clone(), None),
        "another device": (x, values, metadata, None),
        "launches dropped": (x, values, metadata, None),
    }
    for case, args in cases.items():
        slow, runs = len(weight.slow_calls), len(launched)
        device[0] = 1 if case == "another device" else 0
        if case == "launches dropped":
            sparse24_mma.drop_launches()
        call(*args)
        device[0] = 0
        assert len(weight.slow_calls) == slow + 1 and len(launched) == runs, case
        call(x, values, metadata, None)  # x again: kept for it again where the other call kept another
        y = call(x, values, metadata, None)
        assert launched[-1] == (x.data_ptr(), 0, y.data_ptr(), 77) and len(launched) > runs, case
