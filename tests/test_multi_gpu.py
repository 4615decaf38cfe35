"""Every GPU path on a device that is not the current one, and one problem on two devices.

Triton, cuBLASLt and cuSPARSELt launch into the current device's context, where
torch's ops follow their tensors.  These run each op on cuda:0 and cuda:1 with
the other device current, the same shapes on both, so that a kernel compiled,
a plan built or a route cached on one device is never taken on the other.
Skipped without two CUDA devices.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import BWD_ATOL, FWD_ATOL, assert_close
from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

# (device the data is on, device current while the op runs): each problem runs on both in turn.
PAIRS = [(1, 0), (0, 1)]
SPARSE_BACKENDS = ["triton", "triton_bfe", "triton_m128", "dense", "cusparselt"]


def _on_each_device(run):
    """``run(device)`` for cuda:1 then cuda:0, with the other device current; the current device is restored."""
    for data, current in PAIRS:
        with torch.cuda.device(current):
            run(torch.device("cuda", data))
            assert torch.cuda.current_device() == current


@pytest.mark.parametrize("bias", [False, True])
def test_linear_fast_path_and_epilogues(bias, seed):
    def run(dev):
        x = torch.randn(3, 5, 256, device=dev, dtype=torch.bfloat16)  # 3-D
        w = torch.randn(192, 256, device=dev, dtype=torch.bfloat16) / 16
        b = torch.randn(192, device=dev, dtype=torch.bfloat16) if bias else None
        ref = F.linear(x.double(), w.double(), None if b is None else b.double())
        for _ in range(3):  # the first call plans and tunes; the next take linear()'s fast path
            y = kp.linear(x, w, b)
            assert y.device == dev
            assert_close(y, ref, F.linear(x, w, b), atol=FWD_ATOL[torch.bfloat16])
        y, z = kp.linear(x, w, b, "gelu_aux_bias" if bias else "gelu_aux")
        assert_close(y, F.gelu(ref, approximate="tanh"), F.gelu(F.linear(x, w, b), approximate="tanh"),
                     atol=FWD_ATOL[torch.bfloat16])
        assert z.device == dev

    _on_each_device(run)


def test_fused_linear_training_step(seed):
    def run(dev):
        torch.manual_seed(1)
        layer = kp.nn.FusedLinear(128, 96, activation="gelu", device=dev, dtype=torch.bfloat16)
        x = torch.randn(2, 40, 128, device=dev, dtype=torch.bfloat16, requires_grad=True)
        dy = torch.randn(2, 40, 96, device=dev, dtype=torch.bfloat16)
        got = torch.autograd.grad(layer(x), (x, layer.weight, layer.bias), dy)
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, layer.weight, layer.bias))
        want = torch.autograd.grad(F.gelu(F.linear(x64, w64, b64), approximate="tanh"), (x64, w64, b64), dy.double())
        same = torch.autograd.grad(F.gelu(F.linear(x, layer.weight, layer.bias), approximate="tanh"),
                                   (x, layer.weight, layer.bias), dy)
        for name, g, r, s in zip(("dx", "dW", "db"), got, want, same):
            assert g.device == dev
            assert_close(g, r, s, atol=BWD_ATOL[torch.bfloat16], what=name)

    _on_each_device(run)


@pytest.mark.parametrize("backend", SPARSE_BACKENDS)
def test_sparse24_backends(backend, seed):
    if backend == "cusparselt" and importlib.util.find_spec("nvmath") is None:
        pytest.skip("nvmath-python is not installed: the cuSPARSELt backend needs it")

    def run(dev):
        w = kp.sparse24.prune(torch.randn(256, 512, device=dev, dtype=torch.bfloat16))
        w24 = kp.sparse24.compress(w)
        x = torch.randn(48, 512, device=dev, dtype=torch.bfloat16)
        b = torch.randn(256, device=dev, dtype=torch.bfloat16)
        desc = GemmSparse24Descriptor(48, 256, 512, "bf16", "relu", True, str(dev))
        plan = GemmSparse24Plan.select(desc, kp.PlanPreference.only(backend))
        y = torch.full((48, 256), float("nan"), device=dev, dtype=torch.bfloat16)
        plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, b))
        assert_close(y, F.relu(F.linear(x.double(), w.double(), b.double())), F.relu(F.linear(x, w, b)),
                     atol=FWD_ATOL[torch.bfloat16], what=f"{backend} on {dev}")

    _on_each_device(run)


def test_sparse24_functional_path_tunes_on_the_weights_device(seed):
    def run(dev):
        w = kp.sparse24.prune(torch.randn(512, 1024, device=dev, dtype=torch.float16))
        w24 = kp.sparse24.compress(w)
        x = torch.randn(7, 1024, device=dev, dtype=torch.float16)
        ref = F.linear(x.double(), w.double())
        for _ in range(3):  # tuning, then the fast path
            y = kp.sparse24.linear(x, w24)
            assert y.device == dev
            assert_close(y, ref, F.linear(x, w), atol=FWD_ATOL[torch.float16])

    _on_each_device(run)


def test_gated_activation_forward_and_backward(seed):
    def run(dev):
        x = torch.randn(6, 33, 512, device=dev, dtype=torch.bfloat16, requires_grad=True)
        y = kp.gated_activation(x, "swiglu", dim=-1, gate="first")
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        x64 = x.detach().double().requires_grad_()
        a, b = x64.chunk(2, -1)
        want = F.silu(a) * b
        (dx64,) = torch.autograd.grad(want, x64, dy.double())
        xs = x.detach().requires_grad_()
        a_s, b_s = xs.chunk(2, -1)
        same = F.silu(a_s) * b_s
        (dxs,) = torch.autograd.grad(same, xs, dy)
        assert_close(y, want, same, atol=FWD_ATOL[torch.bfloat16], what="y")
        assert_close(dx, dx64, dxs, atol=BWD_ATOL[torch.bfloat16], what="dx")

    _on_each_device(run)


def test_fp8_linear(seed):
    def run(dev):
        x, w = torch.randn(64, 256, device=dev), torch.randn(128, 256, device=dev) / 16
        y = kp.fp8.linear(kp.fp8.quantize(x, "rowwise"), kp.fp8.quantize(w, "rowwise"))
        assert y.device == dev
        ref = x.double() @ w.double().T
        snr = 10 * math.log10(float((ref**2).sum() / ((y.double() - ref) ** 2).sum()))
        assert snr >= 25.0, f"SNR {snr:.1f} dB on {dev}"

    _on_each_device(run)



# -- the default (memory="compact") 2:4 path: the one device layout's kernels, by rule --------------------------


def _is_hopper(dev: torch.device) -> bool:
    return torch.cuda.get_device_capability(dev) == (9, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sparse24_module_default_path_every_kernel_family(dtype, seed):
    """``Sparse24Linear`` on each device with the other current, over n = 1-4096: the rule's kernel for the weight's
    own device (cuda_sp at n <= 8 on a tall weight, cuda_ws's ping-pong and cluster tiles past it; cuda_sp on
    Ampere), each call twice (the first binds the launch on the weight's device, the second takes the bound call),
    3-D and non-contiguous x, a CUDA graph, and one copy of the weight: 0.5625x of the dense bytes, f16 on
    device index 1 included."""
    from kernelplan.sparse24.dispatch import SP_MAX_N_HOPPER, SP_MIN_M_HOPPER, SP_TALL_MIN_K
    from kernelplan.sparse24.gemm import rule_backend
    from kernelplan.sparse24.layout import SP_LAYOUT

    m, k = SP_MIN_M_HOPPER, SP_TALL_MIN_K  # the smallest weight Hopper's rule gives cuda_sp at small n (dispatch.py)

    def run(dev):
        dense = torch.nn.Linear(k, m, device=dev, dtype=dtype)
        layer = kp.nn.Sparse24Linear.from_dense(dense)
        assert layer.layout == SP_LAYOUT and layer.values.device == dev
        w, b = layer.to_dense(), layer.bias.detach()
        for n in (1, 13, 64, 200, 1000, 4096):
            desc = GemmSparse24Descriptor(n, m, k, "bf16" if dtype == torch.bfloat16 else "f16", None, True, str(dev))
            backend = GemmSparse24Plan.select(desc).backend.name
            assert backend == rule_backend(desc)
            assert backend == ("cuda_ws" if _is_hopper(dev) and n > SP_MAX_N_HOPPER else "cuda_sp"), (n, backend)
            x = torch.randn(n, k, device=dev, dtype=dtype)
            ref, same = F.linear(x.double(), w.double(), b.double()), F.linear(x, w, b)
            for call in range(2):
                with torch.no_grad():
                    y = layer(x)
                assert y.device == dev
                assert_close(y, ref, same, atol=FWD_ATOL[dtype], what=f"n = {n} ({backend}), call {call} on {dev}")
        x3 = torch.randn(2, 70, k + 8, device=dev, dtype=dtype)[..., 8:]  # 3-D, rows off 16-byte alignment
        y3 = layer(x3)
        assert_close(y3, F.linear(x3.double(), w.double(), b.double()), F.linear(x3, w, b), atol=FWD_ATOL[dtype],
                     what=f"3-D strided x on {dev}")
        xt = torch.randn(k, 300, device=dev, dtype=dtype).t()  # transposed
        assert_close(layer(xt), F.linear(xt.double(), w.double(), b.double()), F.linear(xt, w, b),
                     atol=FWD_ATOL[dtype], what=f"transposed x on {dev}")
        # A graph is captured on a stream of its tensors' device.  Named: torch.cuda.graph's default capture stream
        # is made once per process, on the device current at the first capture, and taken on every device after.
        xg = torch.randn(256, k, device=dev, dtype=dtype)
        with torch.cuda.device(dev), torch.no_grad():
            layer(xg)  # warm-up outside the capture, as torch asks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=torch.cuda.Stream(dev)):
                yg = layer(xg)
            xg.copy_(torch.randn_like(xg))
            graph.replay()
            torch.cuda.synchronize(dev)
        assert_close(yg, F.linear(xg.double(), w.double(), b.double()), F.linear(xg, w, b), atol=FWD_ATOL[dtype],
                     what=f"graph replay on {dev}")
        held = layer.weight24.derived_bytes()
        assert sum(held.values()) == 0, held  # nothing beside the values and metadata the module holds
        element = torch.finfo(dtype).bits // 8
        assert layer.values.nbytes + layer.metadata.nbytes == m * k * element * 9 // 16

    _on_each_device(run)


def test_sparse24_functional_bias_activations_and_fast_policy_f16_on_each_device(seed):
    """``kp.sparse24.linear`` on a public-format f16 weight with bias and each activation, by rule, then under
    memory="fast": on device index 1 cuSPARSELt's f16 search is refused with its reason (cusparselt.py), and
    the backends that do run compete; the result is right either way."""
    m, k = 768, 2048

    def run(dev):
        w = kp.sparse24.prune(torch.randn(m, k, device=dev, dtype=torch.float16))
        w24 = kp.sparse24.compress(w)
        b = torch.randn(m, device=dev, dtype=torch.float16)
        for n, activation in ((5, "relu"), (96, "gelu"), (333, "gelu_tanh"), (2048, "silu")):
            x = torch.randn(n, k, device=dev, dtype=torch.float16)
            act = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
                   "silu": F.silu}[activation]
            ref, same = act(F.linear(x.double(), w.double(), b.double())), act(F.linear(x, w, b))
            # "fast" times every backend at a bucket's first call: once is enough to see the f16 refusal's effect.
            for memory in ("compact", "fast") if n == 96 else ("compact",):
                y = kp.sparse24.linear(x, w24, bias=b, activation=activation, memory=memory)
                assert y.device == dev
                assert_close(y, ref, same, atol=FWD_ATOL[torch.float16], what=f"n = {n} {activation} {memory} {dev}")
        reason = GemmSparse24Plan.registry.get("cusparselt").supports(GemmSparse24Descriptor(96, m, k, "f16", device=str(dev)))
        if dev.index == 1:
            assert reason is not None and "device index 1" in reason, reason

    _on_each_device(run)


def test_a_tile_tuned_on_one_device_is_taken_there_alone(tmp_path, monkeypatch, seed):
    """``tune_tiles`` for cuda:1 with cuda:0 current keys its choices by cuda:1; a tile set for one device (cuda_ws
    at n = 128, cuda_sp at n = 4) is launched by a layer on that device, against fp64, while the same layer on the
    other device keeps the rule's tile."""
    from kernelplan.sparse24 import tiles
    from kernelplan.sparse24.dispatch import backend_for, config_for
    from test_sparse24_tiles import _tile_of_last_launch

    if not all(_is_hopper(torch.device("cuda", i)) for i in (0, 1)):
        pytest.skip("tile tuning here times Hopper's kernels on both devices")
    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path))
    # As in a fresh process: torch makes its default capture stream at the first capture that names none.
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    tiles.clear_tuned_tiles()
    try:
        with torch.cuda.device(0):
            got = kp.sparse24.tune_tiles([(3072, 3072), (28672, 1024)], [4, 128], device="cuda:1",
                                         dtype=torch.float16, rounds=2)
        # Its timing captured on a stream of its own: torch's default, made on cuda:1 here, took every later default
        # capture of the process (on cuda:0: empty graphs; docs/design/0047).
        assert torch.cuda.graph.default_capture_stream is None
        assert all(c.tile is not None for c in got)
        for c in got:
            backend = tiles.backend_of(c.tile)
            assert tiles.tuned_tile(1, c.n, c.m, c.k, False, backend) == c.tile
            assert tiles.tuned_tile(0, c.n, c.m, c.k, False, backend) is None
        tiles.clear_tuned_tiles()
        for n, m, k in ((128, 3072, 3072), (4, 28672, 1024)):
            backend = backend_for((9, 0), n, m, k, "f16")
            rule = config_for(backend, n, m, k, torch.cuda.get_device_properties(0).multi_processor_count)
            other = next(c for c in tiles.candidates(n, m, k, 132, False, backend=backend) if c != rule)
            tiles._TUNED[(1, backend, m, k, tiles.run_of(n), False)] = other
            for index, want in ((1, other), (0, rule)):
                dev = torch.device("cuda", index)
                dense = torch.nn.Linear(k, m, device=dev, dtype=torch.float16)
                layer = kp.nn.Sparse24Linear.from_dense(dense)
                x = torch.randn(n, k, device=dev, dtype=torch.float16)
                with torch.cuda.device(1 - index), torch.no_grad():
                    y = layer(x)
                assert _tile_of_last_launch(layer) == {str(want)}, (n, index)
                w, b = layer.to_dense(), layer.bias.detach()
                assert_close(y, F.linear(x.double(), w.double(), b.double()), F.linear(x, w, b),
                             atol=FWD_ATOL[torch.float16], what=f"{want} on {dev}")
    finally:
        tiles.clear_tuned_tiles()


def test_sparse24_ws_tile_kinds_on_each_device(seed):
    """Each kind of ``cuda_ws`` launch compiled and its tensor maps encoded with the other device current, then
    launched on the weight's device: a cluster sharing x along M and splitting K, ping-pong, and the persistent split whose
    workspace is allocated per call."""
    from kernelplan.kernels import raw_stream
    from kernelplan.kernels.sparse24_sp import _tiled
    from kernelplan.kernels.sparse24_ws import WsKernel
    from kernelplan.kernels.sparse24_ws_rule import WsConfig

    n, m, k = 200, 1024, 2048
    cfgs = (WsConfig(128, 2, 2, 2, 8), WsConfig(64, 3, stages=7, pp=True), WsConfig(64, 1, stages=8, sk=True))

    def run(dev):
        if not _is_hopper(dev):
            pytest.skip(f"{dev} is not Hopper: cuda_ws is sm_90a code")
        w = kp.sparse24.prune(torch.randn(m, k, device=dev)).bfloat16()
        w24 = kp.sparse24.compress(w)
        pairs, codes = _tiled(w24.values, w24.metadata)
        b = torch.randn(m, device=dev).bfloat16()
        x = torch.randn(n, k, device=dev).bfloat16()
        ref, same = F.gelu(F.linear(x.double(), w.double(), b.double())), F.gelu(F.linear(x, w, b))
        for cfg in cfgs:
            launch, grid = WsKernel().launch_config(cfg, n, m, "bf16", True, "gelu", dev.index)
            y = torch.full((n, m), float("nan"), device=dev, dtype=torch.bfloat16)
            with torch.cuda.device(dev):  # a launch goes to the current context, as the kernels' callers make it
                launch(grid, (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), b.data_ptr(), y.data_ptr(), n, m, k,
                              x.stride(0), y.stride(0)), raw_stream(dev.index))
            assert_close(y, ref, same, atol=FWD_ATOL[torch.bfloat16], what=f"{cfg} on {dev}")

    _on_each_device(run)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_training_a_packed_sparse24_linear_on_each_device(dtype, seed):
    """Backward through a packed ``Sparse24Linear`` on each device with the other current: dx and the values'
    gradient against fp64 (the gradient of the kept weights, unpacked from the device layout), then an optimizer
    step that keeps the 2:4 mask.  Unpacking the gradient and re-reading the weight launch the conversions, which
    once ran on the current device (24c0103)."""
    from kernelplan.sparse24.layout import SP_LAYOUT, unpack_values

    m, k, n = 384, 512, 70

    def run(dev):
        torch.manual_seed(3)
        layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(k, m, device=dev, dtype=dtype))
        assert layer.layout == SP_LAYOUT
        positions = layer.weight24.positions()
        x = torch.randn(2, n, k, device=dev, dtype=dtype, requires_grad=True)  # 3-D
        dy = torch.randn(2, n, m, device=dev, dtype=dtype)
        dx, dvalues, dbias = torch.autograd.grad(layer(x), (x, layer.values, layer.bias), dy)
        assert dx.device == dvalues.device == dbias.device == dev
        w = layer.to_dense().detach()
        x64, w64, b64 = (t.detach().double().requires_grad_() for t in (x, w, layer.bias))
        want = torch.autograd.grad(F.linear(x64, w64, b64), (x64, w64, b64), dy.double())
        xs, ws, bs = (t.detach().clone().requires_grad_() for t in (x, w, layer.bias))
        same = torch.autograd.grad(F.linear(xs, ws, bs), (xs, ws, bs), dy)
        assert_close(dx, want[0], same[0], atol=BWD_ATOL[dtype], what=f"dx on {dev}")
        kept = torch.gather(want[1], 1, positions), torch.gather(same[1], 1, positions)
        assert_close(unpack_values(dvalues), *kept, atol=BWD_ATOL[dtype], what=f"d values on {dev}")
        assert_close(dbias, want[2], same[2], atol=BWD_ATOL[dtype], what=f"d bias on {dev}")
        mask = w != 0
        layer.values.grad = dvalues
        torch.optim.SGD([layer.values], lr=0.5).step()
        after = layer.to_dense()
        assert after.device == dev and kp.sparse24.is_sparse24(after)
        assert not (after[~mask] != 0).any() and not torch.equal(after, w)

    _on_each_device(run)


@pytest.mark.parametrize("n", [1, 64])
def test_grouped_sibling_layers_on_each_device(n, seed):
    """q/k/v grouped by ``fuse_siblings`` (their weights laid out on their own device, one GEMM there) with the
    other device current, against each layer's fp64 reference; then moved to the other device and laid out again."""
    from kernelplan.nn import fuse_siblings

    class QKV(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = (torch.nn.Linear(512, m) for m in (512, 128, 128))

        def forward(self, x):
            return self.q(x), self.k(x), self.v(x)

    def run(dev):
        model = QKV().to(dev, torch.bfloat16)
        kp.sparsify(model, progress=False, fuse=False)
        (siblings,) = fuse_siblings(model)
        x = torch.randn(n, 512, device=dev, dtype=torch.bfloat16)
        with torch.no_grad():
            for _ in range(3):
                got = model(x)
        assert siblings.stats["fused"] == 2 and siblings.groups[0].fused[0].device == dev
        for name, y in zip("qkv", got):
            layer = model.get_submodule(name)
            ref = F.linear(x.double(), layer.to_dense().double(), layer.bias.double())
            assert_close(y, ref, F.linear(x, layer.to_dense(), layer.bias), atol=FWD_ATOL[torch.bfloat16], what=name)
        other = torch.device("cuda", 1 - dev.index)
        model.to(other)
        with torch.no_grad():
            moved = model(x.to(other))
        assert siblings.stats["fused"] == 3 and siblings.groups[0].fused[0].device == other
        for a, b in zip(got, moved):
            torch.testing.assert_close(a, b.to(dev), rtol=0, atol=0)

    _on_each_device(run)


def test_from_pretrained_with_a_device_map_over_two_devices_runs_each_2_4_layer_where_it_was_placed(tmp_path, seed):
    """transformers' own loader (kernelplan's quantizer) with decoder layers split over cuda:0 and cuda:1: each 2:4
    layer is laid out on its own device, and the forward (accelerate's hooks moving activations) matches fp64."""
    transformers = pytest.importorskip("transformers")
    from test_hf import _llama
    from test_hf_quantizer import _fp64_logits, _same_state

    model = _llama(tie=False).to(torch.bfloat16)  # a tied LM head would sit on the embedding's device
    kp.sparsify(model, progress=False)
    model.save_pretrained(tmp_path)
    split = {"model.embed_tokens": 0, "model.layers.0": 0, "model.layers.1": 1, "model.norm": 1,
             "model.rotary_emb": 1, "lm_head": 1}
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, device_map=split)
    layers = {n: m for n, m in loaded.named_modules() if isinstance(m, kp.nn.Sparse24Linear)}
    assert {(n.split(".")[2], m.values.device.index) for n, m in layers.items()} == {("0", 0), ("1", 1)}
    assert {m.layout for m in layers.values()} == {"sp tiled"} and {type(m) for m in layers.values()} == {
        kp.nn.Sparse24Linear}
    ids = torch.randint(0, 96, (2, 12))
    with torch.no_grad():
        got = loaded(ids.cuda(0)).logits.double().cpu()
    ref = _fp64_logits(model, ids)
    assert (got - ref).abs().max() <= 0.05 * ref.abs().max()  # bf16 through the whole model, as tests/test_hf.py
    _same_state({k: v.cpu() for k, v in loaded.state_dict().items()}, model.state_dict())


@pytest.mark.parametrize("tokens", [3, 600])
def test_moe_experts_on_each_device(tokens, seed):
    """A MoE layer's 2:4 experts on each device with the other current, against fp64: on Hopper in one grouped
    launch (without autograd), with autograd through each expert's layers.  The grouped kernel is loaded into its
    device's context; its launch went to the current one until 0046 (CUDA_ERROR_INVALID_HANDLE on cuda:1)."""
    from test_experts import _experts_against_the_oracle

    def run(dev):
        for grad in (False, True):
            _experts_against_the_oracle(dev, tokens, grad)

    _on_each_device(run)


def test_llama4_routed_experts_on_each_device(seed):
    """Llama-4's every-token experts called as its MoE route calls them (``routed``, the inputs scaled by the sigmoid
    of the router's top logits in the routing kernel: nn/moe_routes.py) on each device with the other current,
    against fp64 at a decode's token and a prefill's; then a tiny sparsified Llama-4 there, routed, against the same
    model with its routes detached (every expert on every token)."""
    import copy

    pytest.importorskip("transformers")
    from test_experts_every_token import _experts, _llama4_model, _oracle

    from kernelplan.nn import Sparse24Experts
    from kernelplan.nn.routes import route_of

    dense = _experts(torch.float64, experts=6, hidden=256, inner=320)

    def run(dev):
        sparse = Sparse24Experts.from_experts(copy.deepcopy(dense).to(torch.bfloat16)).to(dev)
        oracle = _oracle(dense, sparse)
        baseline = copy.deepcopy(oracle).to(torch.bfloat16).to(dev)
        with torch.no_grad():
            for tokens in (1, 300):
                hidden = torch.randn(tokens, 256, device=dev).to(torch.bfloat16)
                top, index = torch.topk(torch.randn(tokens, 6, device=dev).to(torch.bfloat16), 2, dim=1)
                scores = torch.zeros(tokens, 6, device=dev, dtype=torch.bfloat16).scatter_(
                    1, index, torch.sigmoid(top.float()).to(torch.bfloat16))
                copies = hidden.repeat(6, 1) * scores.t().reshape(-1, 1)
                got = sparse.routed(hidden, index, top, weigh="sigmoid inputs")
                assert got.device == dev
                assert_close(got, oracle(copies.double().cpu()).view(6, tokens, 256).sum(0).to(dev),
                             baseline(copies).view(6, tokens, 256).sum(0), atol=FWD_ATOL[torch.bfloat16])
        model = _llama4_model(torch.bfloat16).to(dev)
        kp.sparsify(model, progress=False, experts="all")  # on dev: the experts laid out for the grouped kernel
        assert all(m.runs_grouped(dev, torch.bfloat16) == _is_hopper(dev) for m in model.modules()
                   if isinstance(m, Sparse24Experts))
        unrouted = copy.deepcopy(model)
        for m in unrouted.modules():
            if route_of(m) is not None:
                route_of(m).detach()
        ids = torch.randint(0, 128, (2, 9), device=dev)
        with torch.no_grad():
            for _ in range(2):  # the first call checks each route against its layer's own forward
                got, want = model(ids).logits.float(), unrouted(ids).logits.float()
        assert all(route_of(m).stats["fused"] == 2 for m in model.modules() if route_of(m) is not None)
        assert (got - want).abs().max() <= 0.02 * want.abs().max()  # bf16: the two sum experts' outputs apart

    _on_each_device(run)


def test_a_moe_model_over_two_devices_sparsified_loaded_and_dequantized_where_each_layer_was_placed(tmp_path, seed):
    """Mixtral with its decoder layers split over cuda:0 and cuda:1 (a device_map, accelerate's hooks moving the
    activations): ``kp.sparsify`` prunes each layer's experts on its own device, straight into the span there;
    ``save_pretrained`` then ``from_pretrained`` lays each out where the map puts it; ``dequantize`` gives each
    layer its dense experts back on its device.  Every model computes the fp64 twin's function."""
    transformers = pytest.importorskip("transformers")
    from test_experts import _dense_twin, _mixtral
    from test_hf_quantizer import _same_state

    dense = _mixtral(torch.float32, experts=4, top_k=4)  # every token to every expert: no bf16 routing flip
    dense.save_pretrained(tmp_path / "dense")
    split = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.layers.0": 0, "model.layers.1": 1,
             "model.norm": 1, "lm_head": 1}
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "dense", device_map=split,
                                                             dtype=torch.bfloat16)
    kp.sparsify(model, progress=False, experts="all")
    ids = torch.randint(0, 256, (2, 9))
    with torch.no_grad():
        want = _dense_twin(model, dense).double()(ids).logits
    model.save_pretrained(tmp_path / "sparse")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "sparse", device_map=split)
    for got in (model, loaded):
        for i in range(2):
            experts = got.model.layers[i].mlp.experts
            assert isinstance(experts, kp.nn.Sparse24Experts)
            for layers in (experts.first, experts.down):
                assert {m.values.device.index for m in layers} == {i} and {m.layout for m in layers} == {"sp tiled"}
                values = experts._span(layers)[0]  # the span, held as the experts' storage: one, on their device
                assert values.device.index == i and {m.values.untyped_storage().data_ptr() for m in layers} == {
                    values.untyped_storage().data_ptr()}
        with torch.no_grad():
            logits = got(ids.cuda(0)).logits.double().cpu()
        assert (logits - want).abs().max() <= 0.05 * want.abs().max()
    _same_state(*({k: v.cpu() for k, v in m.state_dict().items()} for m in (loaded, model)))
    loaded.dequantize()
    for i in range(2):
        experts = loaded.model.layers[i].mlp.experts
        assert type(experts) is type(dense.model.layers[i].mlp.experts) and experts.gate_up_proj.device.index == i
    with torch.no_grad():
        logits = loaded(ids.cuda(0)).logits.double().cpu()
    assert (logits - want).abs().max() <= 0.05 * want.abs().max()


def test_graph_timings_capture_on_the_current_device_whatever_capture_came_first(monkeypatch):
    """A user's first default capture on cuda:1 makes torch's default capture stream there, for the whole process.
    ``graph_rounds`` (tile tuning's timing) and ``graph_us`` (the benchmarks') on cuda:0 after it still record their
    calls: each call's work is counted on the device, and a graph captured on the other device's stream runs its
    calls once, during the capture, and its replays nothing.  torch's default is left as it was."""
    from kernelplan.timing import graph_rounds, graph_us

    users = torch.cuda.Stream(1)
    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", users)
    count = torch.zeros((), dtype=torch.int64, device="cuda:0")
    made = []

    def call():
        made.append(1)
        count.add_(1)

    with torch.cuda.device(0):
        graph_rounds({"count": [call]}, calls=5, rounds=3)
        torch.cuda.synchronize(0)
        assert int(count) == 1 + 5 * (1 + 3), int(count)  # one warm-up call, then the upload replay and 3 rounds
        assert len(made) == 1 + 5  # the warm-up and the captured calls: the replays make no Python calls
        count.zero_(), made.clear()
        assert graph_us(call, rep=2) > 0
        torch.cuda.synchronize(0)
        assert int(count) > len(made), (int(count), len(made))  # replays ran calls that Python never made
    assert torch.cuda.graph.default_capture_stream is users


@pytest.mark.skipif(torch.cuda.device_count() < 2 or torch.cuda.get_device_capability(1) < (9, 0),
                    reason="needs a second device with thread-block clusters (sm_90)")
def test_gpu_facts_of_a_device_that_is_not_current():
    """The tile rule's clusters of cuda:1 asked while cuda:0 is current: its probe loads and is queried there."""
    from kernelplan.kernels.gpu_facts import device_facts

    torch.cuda.set_device(0)
    slots = device_facts(1)
    assert slots.source == "driver" and slots.sms == torch.cuda.get_device_properties(1).multi_processor_count
    assert 0 < slots.at(3) <= slots.sms and torch.cuda.current_device() == 0
