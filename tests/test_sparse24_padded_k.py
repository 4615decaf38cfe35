"""Weights whose K is not a multiple of 64 on the GPU: held in the device layout padded to K' (sparse24/layout.py,
``padded_k``), run by the layout's kernels, which read x's K columns and zeros past them (docs/design/0083).

The layout, its conversions and the module at CPU: tests/test_sparse24_layout.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned, sm90

gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
DTYPES = (torch.bfloat16, torch.float16)
NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}

# (M, K): SigLIP-so400m's fc2 (the vision towers of Gemma-3, PaliGemma 2, LLaVA-OneVision), a tall weight whose
# last step holds 8 columns (cuda_sp at n <= 8 on Hopper), and a small one of 11 steps, the last of 8 columns.
SHAPES = ((1152, 4304), (9216, 4168), (272, 648))
NS = (1, 5, 8, 9, 16, 33, 64, 200, 729, 1030, 4099)


def _layer(m: int, k: int, dtype: torch.dtype, bias: bool = True):
    torch.manual_seed(m + k)
    return kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, bias=bias, device="cuda", dtype=dtype))


def _check(y, x, layer, what, act=lambda t: t):
    w = layer.to_dense()
    b = layer.bias
    want = act(F.linear(x.double(), w.double(), None if b is None else b.double()))
    assert_close(y, want, act(F.linear(x, w, b)), atol=FWD_ATOL[y.dtype], what=what)


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_padded_layer_matches_fp64_at_every_n_and_holds_nothing_beside_its_layout(dtype, seed):
    """Through Sparse24Linear by the rule (cuda_sp and cuda_ws, every tile kind the rule gives from n = 1 to 4099:
    K split over clusters, one CTA a tile, persistent): against fp64, bias and an activation, 3-D and strided x,
    graph replay.  After calls at n = 1, 64, 256 and 4096 the weight holds its layout alone, at K' = K rounded up to
    64: 0.5625 K'/K of the dense bytes."""
    from test_sparse24_ws import _graph_replayed

    for m, k in SHAPES:
        layer = _layer(m, k, dtype)
        held = -(-k // 64) * 64
        assert layer.values.shape[1] == held // 64 and layer.in_features == k
        with torch.no_grad():
            for n in NS:
                x = torch.randn(n, k, device="cuda", dtype=dtype)
                _check(layer(x), x, layer, f"{m}x{k} n = {n}")
            for n in (1, 64, 256, 4096):
                layer(torch.randn(n, k, device="cuda", dtype=dtype))
            assert layer.weight24.derived_bytes() == {}
            assert (layer.values.nbytes + layer.metadata.nbytes) * 16 == 9 * m * held * 2  # 0.5625x at K'
            x = torch.randn(37, k, device="cuda", dtype=dtype)
            _check(kp.sparse24.linear(x, layer.weight24, layer.bias, "gelu_tanh"), x, layer, "gelu_tanh",
                   lambda t: F.gelu(t, approximate="tanh"))
            x3 = torch.randn(2, 7, k + 8, device="cuda", dtype=dtype)[..., 8:]  # rows 16-byte aligned, strided
            xt = torch.randn(k, 13, device="cuda", dtype=dtype).t()  # copied
            for x in (x3, xt):
                _check(layer(x), x, layer, f"{m}x{k} x of {tuple(x.shape)}")
            xg, yg = _graph_replayed(layer, 11, dtype)
            _check(yg, xg, layer, f"{m}x{k} graph replay")


@gpu
@sm90
@pytest.mark.parametrize("m, k", [(1000, 1608), (272, 648)])
def test_every_tile_kind_reads_a_padded_k_against_fp64(m, k, seed):
    """Launched as they are on the padded layout with x of K columns, y first all NaN: cuda_sp's tiles (K slices in
    a CTA) and cuda_ws's (one CTA a tile, x shared along M, K split over a cluster, persistent split and ping-pong)."""
    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24 import sm_count
    from kernelplan.kernels.sparse24_sp import SpKernel, _tiled, sp_candidates
    from kernelplan.kernels.sparse24_ws import WsKernel
    from kernelplan.kernels.sparse24_ws_rule import _deepest, small_n_splits

    held = -(-k // 64) * 64
    w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    pairs, codes = _tiled(w24.values, w24.metadata)
    assert pairs.shape[1] == held // 64
    bias = torch.randn(m, device="cuda").bfloat16()
    # One cuda_sp tile of each count of K slices (which end on the padded step) and row tiles.
    sp = {(c.k_warps, c.row_tiles, n): c for n in (8, 64) for c in sp_candidates(n, m, held, sm_count(0))}
    cases = [(SpKernel(), n, c) for (_, _, n), c in sp.items()]
    cases += [(WsKernel(), 16, c) for c in small_n_splits(16, held)]
    cases += [(WsKernel(), 300, c) for c in (_deepest(128, 2, 1, 1), _deepest(128, 2, 2, 1), _deepest(64, 1, 1, 2),
                                           _deepest(128, 2, 1, 1, sk=True), _deepest(64, 2, 1, 1, pp=True))]
    for kernel, n, cfg in cases:
        if cfg is None:
            continue
        x = torch.randn(n, k, device="cuda").bfloat16()
        y = poisoned((n, m), torch.bfloat16, "cuda")
        launch, grid = kernel.launch_config(cfg, n, m, "bf16", True, "gelu", 0)
        launch(grid, (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), bias.data_ptr(), y.data_ptr(), n, m, k,
                      x.stride(0), y.stride(0)), raw_stream(0))
        want = F.gelu(F.linear(x.double(), w.double(), bias.double()))
        assert_close(y, want, F.gelu(F.linear(x, w, bias)), atol=FWD_ATOL[torch.bfloat16], what=f"{kernel.name} {cfg}")


@gpu
@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_padded_gated_pair_matches_fp64(dtype, seed):
    """The gated epilogue (the kernels' pairs of rows from W's two halves) over a padded K: swiglu at n = 1, 8, 64
    and 500."""
    m, k = 2 * 1152, 4304
    layer = _layer(m, k, dtype, bias=False)
    w = layer.to_dense()
    with torch.no_grad():
        for n in (1, 8, 64, 500):
            x = torch.randn(n, k, device="cuda", dtype=dtype)
            y = layer.gated(x)
            z64 = F.linear(x.double(), w.double())
            want = F.silu(z64[:, :m // 2]) * z64[:, m // 2:]
            z = F.linear(x, w)
            assert_close(y, want, F.silu(z[:, :m // 2]) * z[:, m // 2:], atol=FWD_ATOL[dtype], what=f"n = {n}")


@gpu
@needs_cuda
def test_the_gpu_conversions_of_a_padded_k_give_the_torch_ops_bits(seed):
    """compress(packed=True) and prune_compress on the GPU (w's zero columns appended, one pass), pack and unpack at
    K: the same tensors as the torch ops on the CPU; the state_dict of a layer made on the GPU is its public format
    at K."""
    from kernelplan.sparse24.format import prune_compress
    from kernelplan.sparse24.layout import pack, unpack

    for m, k in SHAPES:
        w = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        pruned = kp.sparse24.prune(w)
        gpu = kp.sparse24.compress(pruned, packed=True)
        cpu = kp.sparse24.compress(pruned.cpu(), packed=True)
        assert gpu.shape == (m, k) and torch.equal(gpu.values.cpu(), cpu.values)
        assert torch.equal(gpu.metadata.cpu(), cpu.metadata)
        both = prune_compress(w, packed=True)
        assert torch.equal(both.values, gpu.values) and torch.equal(both.metadata, gpu.metadata)
        public = kp.sparse24.compress(pruned)
        tv, tm = pack(public.values, public.metadata)
        assert torch.equal(tv, gpu.values) and torch.equal(tm, gpu.metadata)
        values, metadata = unpack(tv, tm, k)
        assert torch.equal(values, public.values) and torch.equal(metadata, public.metadata)
        layer = kp.nn.Sparse24Linear(public.values, public.metadata)
        state = layer.state_dict()
        assert torch.equal(state["values"], public.values) and torch.equal(state["metadata"], public.metadata)
