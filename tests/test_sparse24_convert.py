"""The GPU conversion kernels (kernels/sparse24_convert.py) against the torch ops, bit for bit.

On CPU they run under the Triton interpreter on CPU tensors; on a GPU, on CUDA
tensors, and through the public functions (prune, compress, pack, unpack).
"""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp
from kernelplan.kernels import interpreting
from kernelplan.sparse24 import layout

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _awkward(m: int, k: int, dtype, seed: int) -> torch.Tensor:
    """Random weights with ties, zeros, -0.0, infinities and subnormals in some groups."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(m, k, generator=g).to(dtype)
    w[:, ::7] = 0
    w[1, :8] = 1.0  # all four tied: the lower two kept
    w[2, 4:8] = -0.0
    w[3, 0:4] = torch.tensor([0.0, -2.0, 2.0, 0.0])  # tie across signs
    w[4, 8] = float("inf")
    w[5, 12:16] = torch.finfo(dtype).tiny / 4  # subnormal
    return w


@pytest.mark.parametrize("dtype", DTYPES)
def test_prune_and_compress_kernels_give_the_torch_ops_bits(dtype):
    from kernelplan.kernels import sparse24_convert as convert

    for m, k, seed in ((48, 520, 0), (17, 264, 1)):  # K a multiple of 8 only; M odd
        w = _awkward(m, k, dtype, seed).to(DEV)
        want = kp.sparse24.compress(kp.sparse24.prune(w.cpu()))
        values, metadata = convert.compress(w, prune=True)
        assert torch.equal(_bits(values.cpu()), _bits(want.values)) and torch.equal(metadata.cpu(), want.metadata)
        dense = convert.compress(w, prune=True, dense=True)
        assert torch.equal(_bits(dense.cpu()), _bits(kp.sparse24.prune(w.cpu())))
        values, metadata = convert.compress(dense, prune=False)  # the exact path: non-zeros, then fillers
        assert torch.equal(_bits(values.cpu()), _bits(want.values)) and torch.equal(metadata.cpu(), want.metadata)


@pytest.mark.parametrize("packed", [False, True], ids=["public", "device layout"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_refusals_leave_the_naming_to_the_torch_ops(dtype, packed):
    """Either kernel refuses (None) where the torch ops raise, and the public functions raise by name."""
    from kernelplan.kernels import sparse24_convert as convert

    kernel = convert.compress_tiled if packed else convert.compress
    w = _awkward(32, 256, dtype, 2).to(DEV)
    assert kernel(w, prune=False) is None  # groups of more than 2 non-zeros
    w[9, 33] = float("nan")
    assert kernel(w, prune=True) is None
    with pytest.raises(kp.InvalidProblem, match="contains NaN"):
        kp.sparse24.format.prune_compress(w, packed=packed)
    with pytest.raises(kp.InvalidProblem, match=r"row 0, group 0 .* more than 2"):
        kp.sparse24.compress(w, packed=packed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_compress_straight_into_the_device_layout_gives_the_torch_ops_bits(dtype):
    from kernelplan.kernels import sparse24_convert as convert

    # 5 steps: a partial block of steps; 3 tiles; rows of a wider tensor (stride K + 64); one step and one tile;
    # the default block (8 steps at K = 2048, 36 steps: a partial block).
    for m, k, steps, seed in ((48, 320, 4, 6), (32, 256, 1, 7), (16, 64, 2, 8), (16, 2304, None, 12)):
        wide = _awkward(m, k + 64, dtype, seed)
        w = wide[:, 32:32 + k]
        assert w.stride(0) == k + 64 and not w.is_contiguous()
        want = kp.sparse24.compress(kp.sparse24.prune(w)).packed()
        tv, tm = convert.compress_tiled(wide.to(DEV)[:, 32:32 + k], prune=True, steps=steps)
        assert tv.shape == (m // 16, k // 64, 512) and tm.shape == (m // 16, k // 64, 32) and tm.dtype == torch.int32
        assert torch.equal(_bits(tv.cpu()), _bits(want.values)) and torch.equal(tm.cpu(), want.metadata)
        pruned = kp.sparse24.prune(w).to(DEV)  # the exact path: the non-zeros, then fillers
        tv, tm = convert.compress_tiled(pruned, prune=False, steps=steps)
        assert torch.equal(_bits(tv.cpu()), _bits(want.values)) and torch.equal(tm.cpu(), want.metadata)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_group_of_special_values_keeps_what_the_torch_ops_keep(dtype):
    """Every group of 4 drawn from 0, -0, +-1, +-2 and inf (ties within and across signs, zeros of both signs),
    pruned and compressed into the device layout, against the torch ops; the 16-bit weights take their own ranking
    (``_pick16``), so each group's order is checked there once."""
    import itertools

    from kernelplan.kernels import sparse24_convert as convert

    special = [0.0, -0.0, 1.0, -1.0, 2.0, -2.0, float("inf")]
    groups = torch.tensor(list(itertools.product(special, repeat=4)), dtype=torch.float32)  # [2401, 4]
    w = torch.zeros(16 * 160, 4)
    w[: len(groups)] = groups
    w = w.reshape(16, 640).to(dtype)
    want = kp.sparse24.compress(kp.sparse24.prune(w)).packed()
    tv, tm = convert.compress_tiled(w.to(DEV), prune=True)
    assert torch.equal(_bits(tv.cpu()), _bits(want.values)) and torch.equal(tm.cpu(), want.metadata)
    pruned = kp.sparse24.prune(w)
    tv, tm = convert.compress_tiled(pruned.to(DEV), prune=False)
    assert torch.equal(_bits(tv.cpu()), _bits(want.values)) and torch.equal(tm.cpu(), want.metadata)
    public = want.public()  # the public format's kernel, and its masked dense output, the same way
    values, metadata = convert.compress(w.to(DEV), prune=True)
    assert torch.equal(_bits(values.cpu()), _bits(public.values)) and torch.equal(metadata.cpu(), public.metadata)
    assert torch.equal(_bits(convert.compress(w.to(DEV), prune=True, dense=True).cpu()), _bits(pruned))
    values, metadata = convert.compress(pruned.to(DEV), prune=False)
    assert torch.equal(_bits(values.cpu()), _bits(public.values)) and torch.equal(metadata.cpu(), public.metadata)


def test_compress_packed_holds_the_device_layout_where_the_shape_allows():
    w = kp.sparse24.prune(_awkward(48, 192, torch.bfloat16, 10))
    got, want = kp.sparse24.compress(w, packed=True), kp.sparse24.compress(w)
    assert got.layout == layout.SP_LAYOUT and torch.equal(got.values, want.packed().values)
    assert torch.equal(got.public().metadata, want.metadata)
    odd = kp.sparse24.prune(_awkward(40, 96, torch.bfloat16, 11))  # M % 16 and K % 64 are not 0: public
    got = kp.sparse24.format.prune_compress(odd, packed=True)
    assert got.layout == layout.PUBLIC and torch.equal(got.values, kp.sparse24.compress(odd).values)


@pytest.mark.parametrize("dtype", DTYPES)
def test_pack_and_unpack_kernels_give_the_torch_ops_bits(dtype):
    from kernelplan.kernels import sparse24_convert as convert

    w24 = kp.sparse24.compress(kp.sparse24.prune(_awkward(32, 320, dtype, 3)))  # 5 steps: a partial step block
    want = layout.pack_values(w24.values), layout.pack_metadata(w24.metadata)
    tv, tm = convert.pack(w24.values.to(DEV), w24.metadata.to(DEV), steps=4)
    assert torch.equal(_bits(tv.cpu()), _bits(want[0])) and torch.equal(tm.cpu(), want[1])
    values, metadata = convert.unpack(tv, tm, steps=2)
    assert torch.equal(_bits(values.cpu()), _bits(w24.values)) and torch.equal(metadata.cpu(), w24.metadata)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_the_gpu_the_public_functions_run_the_kernels_and_keep_autograd():
    w = _awkward(64, 512, torch.bfloat16, 4)
    wc = w.cuda()
    assert torch.equal(_bits(kp.sparse24.prune(wc).cpu()), _bits(kp.sparse24.prune(w)))
    pruned = kp.sparse24.prune(w)
    got, want = kp.sparse24.compress(pruned.cuda()), kp.sparse24.compress(pruned)
    assert torch.equal(got.values.cpu(), want.values) and torch.equal(got.metadata.cpu(), want.metadata)
    packed = got.packed()
    assert torch.equal(packed.values.cpu(), want.packed().values) and torch.equal(packed.public().metadata, got.metadata)
    values = packed.values.clone().requires_grad_()  # autograd through unpack: the torch ops, differentiable
    kp.sparse24.Sparse24Weight(values, packed.metadata).decompress().sum().backward()
    assert torch.equal(values.grad, torch.ones_like(values))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("bias", [False, True])
def test_from_dense_on_the_gpu_holds_what_the_cpu_path_holds(bias):
    linear = torch.nn.Linear(320, 96, bias=bias, dtype=torch.bfloat16)
    cpu = kp.nn.Sparse24Linear.from_dense(linear)
    on_gpu = torch.nn.Linear(320, 96, bias=bias, dtype=torch.bfloat16, device="cuda")
    on_gpu.load_state_dict(linear.state_dict())
    gpu = kp.nn.Sparse24Linear.from_dense(on_gpu)
    assert gpu.layout == cpu.layout == layout.SP_LAYOUT
    assert torch.equal(gpu.values.cpu(), cpu.values) and torch.equal(gpu.metadata.cpu(), cpu.metadata)
    if bias:
        assert torch.equal(gpu.bias.cpu(), linear.bias)
    public = kp.nn.Sparse24Linear.from_dense(on_gpu, layout="public")
    assert public.layout == layout.PUBLIC and torch.equal(public.to_dense().cpu(), cpu.to_dense())
