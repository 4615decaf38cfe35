"""The one device layout (sparse24/layout.py): conversions, and Sparse24Linear holding the weight in it alone."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelplan as kp
from helpers import BWD_ATOL, FWD_ATOL, assert_close
from kernelplan.sparse24.layout import SP_LAYOUT, check_layout, pack, pack_reason, unpack

DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _weight(m, k, dtype=torch.bfloat16, seed=0, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    w = kp.sparse24.prune(torch.randn(m, k, generator=g)).to(dtype)
    # Groups with fewer than 2 non-zeros store filler positions: some of every kind.
    w[:, ::12] = 0
    return w.to(device), kp.sparse24.compress(w.to(device))


def _oracle(values: torch.Tensor, metadata: torch.Tensor):
    """The layout from its definition, element by element (layout.py's docstring), independent of the permutes."""
    m, half = values.shape
    k = 2 * half
    tv = torch.zeros(m // 16, k // 64, 512, dtype=values.dtype)
    tm = torch.zeros(m // 16, k // 64, 32, dtype=torch.int64)
    byte = metadata.to(torch.int64)
    for row in range(m):
        i, h, g = row // 16, (row // 8) % 2, row % 8
        for group in range(k // 4):
            s, u, j, t = group // 16, (group // 8) % 2, (group // 4) % 2, group % 4
            for e in range(2):
                tv[i, s, ((((u * 2 + j) * 2 + h) * 8 + g) * 4 + t) * 2 + e] = values[row, 2 * group + e]
            nibble = (byte[row, group // 2] >> (8 * (group % 2))) & 0xF
            quarter = (group % 16) // 4  # the 16-column quarter t' of the 64-column step s
            tm[i, s, 4 * g + quarter] |= nibble << (4 * (group % 4) + 16 * h)
    return tv, torch.where(tm >= 2**31, tm - 2**32, tm).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_pack_matches_the_layouts_definition(dtype):
    _, w24 = _weight(32, 128, dtype)
    tv, tm = pack(w24.values, w24.metadata)
    ov, om = _oracle(w24.values, w24.metadata)
    assert torch.equal(tv, ov) and torch.equal(tm, om)


@settings(max_examples=25, deadline=None)
@given(tiles=st.integers(1, 4), steps=st.integers(1, 4), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_pack_then_unpack_is_the_identity(tiles, steps, dtype, seed):
    w, w24 = _weight(16 * tiles, 64 * steps, dtype, seed)
    tv, tm = pack(w24.values, w24.metadata)
    assert tv.shape == (tiles, steps, 512) and tm.shape == (tiles, steps, 32) and tm.dtype == torch.int32
    values, metadata = unpack(tv, tm)
    assert torch.equal(values, w24.values) and torch.equal(metadata, w24.metadata)
    packed = kp.sparse24.Sparse24Weight(tv, tm)  # validated through the public format
    assert packed.layout == SP_LAYOUT and packed.shape == w.shape and torch.equal(packed.decompress(), w)
    # Bytes: values as before, 4 bits per group of metadata where the format keeps 8.
    assert tm.nbytes * 2 == w24.metadata.nbytes and tv.nbytes == w24.values.nbytes


@settings(max_examples=25, deadline=None)
@given(tiles=st.integers(1, 3), groups=st.integers(1, 40), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16))
def test_a_k_off_the_step_packs_padded_and_unpacks_to_its_own_k(tiles, groups, dtype, seed):
    """K any multiple of 8: held as K' = K rounded up to 64, the columns past K zeros at positions 0 and 1 (the
    layout of the weight with zero columns appended, by the oracle), and unpacked at K to the weight itself."""
    k = 8 * groups
    held = -(-k // 64) * 64
    w, w24 = _weight(16 * tiles, k, dtype, seed)
    tv, tm = pack(w24.values, w24.metadata)
    assert tv.shape == (tiles, held // 64, 512) and tm.shape == (tiles, held // 64, 32)
    wide = kp.sparse24.compress(F.pad(w, (0, held - k)))
    ov, om = _oracle(wide.values, wide.metadata)
    assert torch.equal(tv, ov) and torch.equal(tm, om)
    values, metadata = unpack(tv, tm, k)
    assert torch.equal(values, w24.values) and torch.equal(metadata, w24.metadata)
    assert values.is_contiguous() and metadata.is_contiguous()
    assert torch.equal(unpack(tv, tm)[0], wide.values)  # no k: every column held
    packed = kp.sparse24.Sparse24Weight(tv, tm, k=k)  # validated: zeros past K
    assert packed.shape == w.shape and torch.equal(packed.decompress(), w) and torch.equal(packed.mask(), w24.mask())
    assert torch.equal(packed.public().values, w24.values) and packed.to(torch.float64).shape == w.shape
    again = kp.sparse24.compress(w, packed=True)
    assert again.shape == w.shape and torch.equal(again.values, tv) and torch.equal(again.metadata, tm)
    assert torch.equal(w24.packed().values, tv) and w24.packed().shape == w.shape


def test_a_padded_weight_is_refused_a_k_it_does_not_hold_or_non_zeros_past_it():
    w, w24 = _weight(16, 72)
    tv, tm = pack(w24.values, w24.metadata)
    for k in (64, 136, 76):  # a step less, a step more, not a multiple of 8
        with pytest.raises(kp.InvalidProblem, match=f"k = {k}, but the sp tiled values hold 128 columns"):
            kp.sparse24.Sparse24Weight(tv, tm, k=k, _validate=False)  # checked, validated or not
        with pytest.raises(kp.InvalidProblem, match=f"k = {k}, but the sp tiled values hold 128 columns"):
            kp.sparse24.Sparse24Weight(tv, tm, k=k)
        with pytest.raises(kp.InvalidProblem, match=f"k = {k}: a weight whose device layout holds 128 columns"):
            unpack(tv, tm, k)
    full = kp.sparse24.compress(kp.sparse24.prune(torch.randn(16, 128)).to(torch.bfloat16), packed=True)
    with pytest.raises(kp.InvalidProblem, match="non-zeros past column 72"):
        kp.sparse24.Sparse24Weight(full.values, full.metadata, k=72)
    assert kp.sparse24.Sparse24Weight(full.values, full.metadata, k=128).k is None  # all of it: nothing padded
    assert "held padded to 128 columns" in repr(kp.sparse24.Sparse24Weight(tv, tm, k=72))
    with pytest.raises(kp.InvalidProblem, match="k = 64, but the public values hold 72 columns"):
        kp.sparse24.Sparse24Weight(w24.values, w24.metadata, k=64)  # the public format holds K itself
    with pytest.raises(kp.InvalidProblem, match="k = 64, but the public values hold 72 columns"):
        kp.nn.Sparse24Linear(w24.values, w24.metadata, in_features=64)


def test_the_kernels_read_the_packed_weight_as_they_would_derive_it():
    from kernelplan.kernels.sparse24_sp import _tiled

    _, w24 = _weight(48, 192)
    tv, tm = pack(w24.values, w24.metadata)
    pairs, words = _tiled(w24.values, w24.metadata)  # what cuda_sp / cuda_wg derive from the public format
    assert torch.equal(tv, pairs) and torch.equal(tm.flatten(), words.flatten())
    held = _tiled(tv, tm)
    assert held[0].data_ptr() == tv.data_ptr() and held[1] is tm  # held, not copied


def test_shapes_off_the_tile_are_refused_with_the_reason():
    assert "multiple of 16" in pack_reason(24, 64) and "multiple of 8" in pack_reason(16, 100)
    assert pack_reason(16, 64) is None and pack_reason(16, 72) is None  # K padded to 128
    _, w24 = _weight(24, 64)
    with pytest.raises(kp.InvalidProblem, match=r"\[24, 64\] cannot be held.*multiple of 16.*layout='public'"):
        pack(w24.values, w24.metadata)
    _, w24 = _weight(16, 64)
    tv, tm = pack(w24.values, w24.metadata)
    with pytest.raises(kp.InvalidProblem, match=r"metadata has shape \(1, 1, 16\) but must have shape \(1, 1, 32\)"):
        check_layout(tv, tm[..., :16])
    with pytest.raises(kp.InvalidProblem, match=r"dtype torch.int16.*int32|must have dtype torch.int32"):
        check_layout(tv, tm.to(torch.int16))
    with pytest.raises(kp.InvalidProblem, match=r"values has shape \(1, 1, 256\).*\[M/16, K/64, 512\]"):
        check_layout(tv[..., :256], tm)


def test_a_corrupt_packed_word_is_refused():
    _, w24 = _weight(16, 64)
    tv, tm = pack(w24.values, w24.metadata)
    bad = tm.clone()
    bad[0, 0, 5] = bad[0, 0, 5] & ~0xF | 0b0101  # pos0 = pos1 = 1 in the word's first group
    with pytest.raises(kp.InvalidProblem, match="not a valid 2:4 word"):
        kp.sparse24.Sparse24Weight(tv, bad)


# -- Sparse24Linear holds the device layout alone ----------------------------


def _layer(m=64, k=128, dtype=torch.float32, bias=True, layout="auto"):
    torch.manual_seed(0)
    dense = torch.nn.Linear(k, m, bias=bias).to(dtype)
    return dense, kp.nn.Sparse24Linear.from_dense(dense, layout=layout)


def test_the_module_holds_only_the_device_layout_at_9_16_of_dense():
    dense, layer = _layer(64, 128, torch.bfloat16)
    assert layer.layout == SP_LAYOUT and "layout='sp tiled'" in repr(layer)
    held = layer.values.nbytes + layer.metadata.nbytes
    assert held * 16 == dense.weight.nbytes * 9  # 0.5625x: values, and 4 bits per group of 4
    x = torch.randn(3, 128).to(torch.bfloat16)
    layer(x)
    assert layer.weight24.derived_bytes() == {}  # the reference read it as held: no copy kept
    _, odd = _layer(40, 128)
    assert odd.layout == "public"  # M off the 16-row tile: the public format
    _, public = _layer(64, 128, layout="public")
    assert public.layout == "public" and public.values.shape == (64, 64)
    with pytest.raises(kp.InvalidProblem, match="layout"):
        _layer(layout="tiled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_the_packed_module_computes_what_the_public_one_does(dtype):
    dense, layer = _layer(48, 192, dtype)
    _, public = _layer(48, 192, dtype, layout="public")
    w = kp.sparse24.prune(dense.weight.detach())
    base = torch.randn(2, 5, 384, dtype=dtype)
    for x in (torch.randn(7, 192, dtype=dtype), base[..., ::2], torch.randn(1, 192, dtype=dtype)):  # 3-D, strided
        x = x.clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
        y = layer(x)
        oracle = F.linear(x.double(), w.double(), dense.bias.double())
        assert_close(y, oracle, F.linear(x, w, dense.bias), atol=FWD_ATOL[dtype])
        assert torch.equal(y, public(x))
        (dy,) = torch.autograd.grad(y.float().square().sum(), x)
        (dp,) = torch.autograd.grad(public(x).float().square().sum(), x)
        assert torch.equal(dy, dp)


def test_training_the_packed_module_keeps_the_mask_and_gives_the_public_gradient():
    dense, layer = _layer(32, 128)
    _, public = _layer(32, 128, layout="public")
    x = torch.randn(6, 128)
    layer(x).square().mean().backward()
    public(x).square().mean().backward()
    assert layer.values.grad.shape == layer.values.shape
    grad = kp.sparse24.layout.unpack_values(layer.values.grad)
    w64 = public.to_dense().detach().double().requires_grad_()
    F.linear(x.double(), w64, dense.bias.double()).square().mean().backward()
    oracle = torch.gather(w64.grad, 1, public.weight24.positions())
    assert_close(grad, oracle, public.values.grad, atol=BWD_ATOL[torch.float32])
    mask = layer.to_dense() != 0
    torch.optim.SGD(layer.parameters(), lr=0.1).step()
    w = layer.to_dense()
    assert kp.sparse24.is_sparse24(w) and not (w[~mask] != 0).any()


def test_state_dict_and_checkpoints_hold_the_public_format(tmp_path):
    dense, layer = _layer(64, 128, torch.bfloat16)
    state = layer.state_dict()
    w24 = kp.sparse24.compress(kp.sparse24.prune(dense.weight.detach()))
    assert torch.equal(state["values"], w24.values) and torch.equal(state["metadata"], w24.metadata)
    fresh = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(128, 64).to(torch.bfloat16))
    fresh.load_state_dict(state)
    assert fresh.layout == SP_LAYOUT and torch.equal(fresh.values, layer.values)
    assert torch.equal(fresh.metadata, layer.metadata) and "values" in state  # the caller's dict is untouched
    assert state["values"].dim() == 2
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert torch.equal(fresh.values, layer.values)
    model = torch.nn.Sequential(layer)
    kp.save_compressed(model.state_dict(), tmp_path / "m.safetensors")
    loaded = kp.load_compressed(tmp_path / "m.safetensors")
    assert torch.equal(loaded["0.values"], w24.values) and torch.equal(loaded["0.metadata"], w24.metadata)


@pytest.mark.parametrize("k", [72, 200, 4304])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_layer_of_k_off_the_step_holds_it_padded_and_computes_saves_and_trains_at_its_own_k(k, dtype):
    """in_features 72, 200 and 4304 (SigLIP-so400m's MLP): the device layout padded to K' (+1.1-78% bytes), no
    other copy; forward against fp64 on 2-D, 3-D and strided x; x's and the kept values' gradients against the
    dense weight's; state_dict and checkpoints at K; an x of K' columns refused, naming both."""
    dense, layer = _layer(48, k, dtype)
    held = -(-k // 64) * 64
    assert layer.layout == SP_LAYOUT and layer.in_features == k and layer.values.shape == (3, held // 64, 512)
    assert layer.weight.shape == (48, k) and layer.weight24.shape == (48, k)
    # The dense weight's bytes at K': half the values, 4 bits a group of 4 columns.
    assert layer.values.nbytes == 48 * held // 2 * dense.weight.element_size()
    assert layer.metadata.nbytes == 48 * held // 8
    w = kp.sparse24.prune(dense.weight.detach())
    assert torch.equal(layer.to_dense(), w)
    base = torch.randn(2, 5, 2 * k, dtype=dtype)
    for x in (torch.randn(7, k, dtype=dtype), base[..., ::2], torch.randn(1, 3, k, dtype=dtype)):
        x = x.clone().requires_grad_() if x.is_contiguous() else x.detach().requires_grad_()
        y = layer(x)
        assert_close(y, F.linear(x.double(), w.double(), dense.bias.double()), F.linear(x, w, dense.bias),
                     atol=FWD_ATOL[dtype])
        layer.values.grad = None
        y.square().sum().backward()
        w64 = w.double().clone().requires_grad_()  # fresh each pass: .double() of float64 is the tensor itself
        x64 = x.detach().double().clone().requires_grad_()
        F.linear(x64, w64, dense.bias.double()).square().sum().backward()
        assert_close(x.grad, x64.grad, x64.grad.to(dtype), atol=BWD_ATOL[dtype])
        grad = kp.sparse24.layout.unpack_values(layer.values.grad, k)
        assert not kp.sparse24.layout.unpack_values(layer.values.grad)[:, k // 2:].any()  # the padding's stays 0
        oracle = torch.gather(w64.grad, 1, layer.weight24.positions())
        assert_close(grad, oracle, oracle.to(dtype), atol=BWD_ATOL[dtype])
    assert layer.weight24.derived_bytes() == {}
    state = layer.state_dict()
    w24 = kp.sparse24.compress(w)
    assert torch.equal(state["values"], w24.values) and torch.equal(state["metadata"], w24.metadata)
    fresh = kp.nn.Sparse24Linear(state["values"], state["metadata"], state["bias"])
    assert fresh.in_features == k and torch.equal(fresh.values, layer.values)
    buf = io.BytesIO()
    torch.save(layer.state_dict(), buf)
    fresh.load_state_dict(torch.load(io.BytesIO(buf.getvalue())))
    assert torch.equal(fresh.values, layer.values) and fresh.in_features == k
    wide = torch.randn(2, held, dtype=dtype)
    with pytest.raises(kp.InvalidProblem, match=rf"K = {k} .*held padded to {held} columns"):
        layer(wide)
    with pytest.raises(kp.InvalidProblem, match=rf"K = {k} "):
        kp.sparse24.linear(wide, layer.weight24)
    # The parts alone (an op called directly) say nothing of K: x of K or of the held K' reads the same weight.
    got = kp.sparse24.gemm.linear_parts(F.pad(x.detach(), (0, held - k)), layer.values, layer.metadata, layer.bias)
    assert torch.equal(got, layer(x.detach()))


def test_loading_a_corrupt_state_dict_changes_nothing():
    _, layer = _layer(64, 128)
    before = layer.values.detach().clone(), layer.metadata.clone()
    state = layer.state_dict()
    state["metadata"] = state["metadata"].clone()
    state["metadata"][3, 2] = 0x0505
    with pytest.raises(kp.InvalidProblem, match=r"metadata\[3, 2\] = 0x0505 is not a valid 2:4 word"):
        layer.load_state_dict(state)
    assert torch.equal(layer.values, before[0]) and torch.equal(layer.metadata, before[1])
    state = layer.state_dict()
    state["values"] = state["values"][:, :32]
    with pytest.raises(RuntimeError, match="size mismatch for values"):
        layer.load_state_dict(state)


@pytest.mark.parametrize("k", [128, 200])  # 200: held padded to 256
def test_the_packed_module_compiles_fullgraph_forward_and_backward(k):
    _, layer = _layer(32, k)
    x = torch.randn(2, 3, k, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(layer, fullgraph=True, backend="aot_eager")(x)
    y.square().sum().backward()
    got = [x.grad.clone(), layer.values.grad.clone()]
    x.grad, layer.values.grad, layer.bias.grad = None, None, None
    layer(x).square().sum().backward()
    assert torch.equal(got[0], x.grad) and torch.equal(got[1], layer.values.grad)


# -- on the GPU --------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@cuda
def test_a_deleted_layer_gives_its_memory_back_after_calls_eager_inference_and_graphed():
    """Nothing kernelplan keeps (fast-path entries, layouts derived per weight) outlives the weight: a 70B-shaped
    model once left about 7 GiB allocated after it was deleted (docs/design/0008)."""
    import gc

    torch.cuda.synchronize()
    gc.collect()
    before = torch.cuda.memory_allocated()
    dense, layer = _layer(1024, 4096, torch.bfloat16)
    layer = layer.cuda()
    for n in (1, 16, 64, 300):
        x = torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16)
        layer(x)
        with torch.inference_mode():
            layer(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        layer(x)
    graph.replay()
    held = torch.cuda.memory_allocated() - before
    assert held >= layer.values.nbytes + layer.metadata.nbytes
    del dense, layer, x, graph
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() - before < 1 << 20, (torch.cuda.memory_allocated() - before, held)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_on_the_gpu_the_module_holds_nothing_beyond_its_layout_after_calls_at_every_n(dtype):
    """Bytes held per weight after calls at n = 1, 64, 256, 4096 (bias): 0.5625x of dense, no derived copy."""
    dense, layer = _layer(1024, 4096, dtype)
    dense, layer = dense.cuda(), layer.cuda()
    w = kp.sparse24.prune(dense.weight.detach())
    for n in (1, 64, 256, 4096, 37):
        x = torch.randn(n, 4096, device="cuda").to(dtype)
        assert_close(layer(x), F.linear(x.double(), w.double(), dense.bias.double()), F.linear(x, w, dense.bias),
                     atol=FWD_ATOL[dtype])
    assert layer.weight24.derived_bytes() == {}
    assert (layer.values.nbytes + layer.metadata.nbytes) * 16 == w.nbytes * 9
    graph = torch.cuda.CUDAGraph()
    x = torch.randn(64, 4096, device="cuda").to(dtype)
    with torch.cuda.graph(graph):
        y = layer(x)
    x.copy_(torch.randn(64, 4096, device="cuda").to(dtype))
    graph.replay()
    assert torch.equal(y, layer(x)) and layer.weight24.derived_bytes() == {}


@pytest.mark.gpu
@cuda
def test_on_the_gpu_conversions_match_the_cpu_and_f32_derives_the_public_format_reported():
    w, w24 = _weight(256, 512, torch.bfloat16)
    tv, tm = pack(w24.values.cuda(), w24.metadata.cuda())
    cpu = pack(w24.values, w24.metadata)
    assert torch.equal(tv.cpu(), cpu[0]) and torch.equal(tm.cpu(), cpu[1])
    back = unpack(tv, tm)
    assert torch.equal(back[0].cpu(), w24.values) and torch.equal(back[1].cpu(), w24.metadata)
    dense, layer = _layer(256, 512, torch.float32)
    layer = layer.cuda()  # f32: the rule runs the Triton kernel, which reads the public format
    x = torch.randn(8, 512, device="cuda")
    wd = layer.to_dense()
    assert_close(layer(x), F.linear(x.double(), wd.double(), layer.bias.double()), F.linear(x, wd, layer.bias),
                 atol=FWD_ATOL[torch.float32])
    held = layer.weight24.derived_bytes()  # the public copy, and what the Triton kernel derives from it in turn
    assert held["public"] == w24.values.nbytes * 2 + w24.metadata.nbytes and all(k.startswith("public") for k in held)


@pytest.mark.gpu
@cuda
def test_on_the_gpu_the_direct_launch_of_a_held_weight_follows_edits_and_shapes():
    """The inference fast path launches a held weight's kernel directly: repeat calls, 3-D x, edits, new storage."""
    dense, layer = _layer(512, 1024, torch.bfloat16)
    layer = layer.cuda()
    with torch.inference_mode():
        for shape in ((1, 1024), (3, 5, 1024), (64, 1024), (300, 1024)):
            x = torch.randn(*shape, device="cuda").to(torch.bfloat16)
            for _ in range(3):  # the first call records the direct entry, the next ones take it
                w = layer.to_dense()
                assert_close(layer(x), F.linear(x.double(), w.double(), layer.bias.double()),
                             F.linear(x, w, layer.bias), atol=FWD_ATOL[torch.bfloat16])
        x = torch.randn(16, 1024, device="cuda").to(torch.bfloat16)
        before = layer(x)
        layer.values.mul_(2)  # an in-place edit: read as it is, no copy to refresh
        w = layer.to_dense()
        assert_close(layer(x), F.linear(x.double(), w.double(), layer.bias.double()), F.linear(x, w, layer.bias),
                     atol=FWD_ATOL[torch.bfloat16])
        layer.values.data = layer.values.data / 2  # new storage under the same Parameter: exact halves
        assert torch.equal(layer(x), before)
        strided = torch.randn(16, 2048, device="cuda").to(torch.bfloat16)[:, ::2]  # not read in place: copied
        assert torch.equal(layer(strided), layer(strided.contiguous()))
