"""The reference backends on a CUDA device (bf16 and f64 included).  Skipped without CUDA."""

from __future__ import annotations

import importlib.util

import pytest
import torch

import kernelplan as kp
import torch.nn.functional as F
from helpers import BWD_ATOL, FWD_ATOL, assert_close
from opinfo import OPS
from test_opinfo import _cast_sample

pytestmark = pytest.mark.gpu

# The cuSPARSELt backend's tests; without nvmath-python its supports() says so, tested on CPU too.
needs_nvmath = pytest.mark.skipif(importlib.util.find_spec("nvmath") is None,
                                  reason="nvmath-python is not installed: the cuSPARSELt backend needs it")


@pytest.mark.parametrize("op", OPS, ids=lambda o: o.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_ops_on_cuda_match_fp64(op, dtype):
    torch.manual_seed(0)
    for sample in op.samples("cuda", dtype):
        out = op.op(*sample.args, **sample.kwargs)
        assert out.device.type == "cuda"
        args64, kwargs64 = _cast_sample(sample, torch.float64)
        assert_close(out, op.reference(*args64, **kwargs64), op.reference(*sample.args, **sample.kwargs),
                     atol=FWD_ATOL[dtype], what=sample.desc)


def test_sku_names_the_gpu_arch():
    plan = kp.GemmPlan.select(kp.GemmDescriptor(16, 32, 64, "bf16", device="cuda"))
    major, minor = torch.cuda.get_device_capability()
    assert plan.sku.arch == f"sm{major}{minor}"


def test_gated_backward_on_cuda():
    x = torch.randn(64, 3, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    y = kp.gated_activation(x, "swiglu", dim=-1, gate="first")
    dy = torch.randn_like(y)
    y.backward(dy)
    x64 = x.detach().double().requires_grad_()
    a, b = x64.chunk(2, -1)
    (torch.nn.functional.silu(a) * b).backward(dy.double())
    xb = x.detach().clone().requires_grad_()
    ab, bb = xb.chunk(2, -1)
    (torch.nn.functional.silu(ab) * bb).backward(dy)
    assert_close(x.grad, x64.grad, xb.grad, atol=BWD_ATOL[torch.bfloat16])


def test_plan_runs_on_a_side_stream():
    desc = kp.GatedActivationDescriptor("geglu", (128, 64), 1, "f32", device="cuda:0")
    x = torch.randn(128, 64, device="cuda")
    y = torch.empty(128, 32, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    kp.GatedActivationPlan.select(desc).run(kp.GatedActivationArgs(x, y), stream=s)
    torch.cuda.current_stream().wait_stream(s)
    a, b = x.chunk(2, -1)
    torch.testing.assert_close(y, a * torch.nn.functional.gelu(b))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("kind, approximate", [("glu", "none"), ("reglu", "none"), ("swiglu", "none"),
                                               ("geglu", "none"), ("geglu", "tanh")])
@pytest.mark.parametrize("gate", ["second", "first"])
def test_gated_triton_bf16_and_f64(kind, approximate, gate, dtype):
    from test_gated_triton import _check, _layouts, _run

    torch.manual_seed(0)
    for desc, x, dim in _layouts(dtype):
        assert kp.GatedActivationPlan.select(
            kp.gated._descriptor(x, kind, dim % x.dim(), gate, approximate)).sku.backend == "triton"
        _check(x, kind, dim, gate, approximate, *_run(x, kind, dim, gate, approximate))


def test_gated_triton_above_2_31_elements():
    """x has 2**31 + 256 elements: offsets past 2**31 must be formed in 64 bits."""
    free, _ = torch.cuda.mem_get_info()
    if free < 12 * 2**30:
        pytest.skip("needs 12 GiB of free GPU memory")
    x = torch.randn(2, 2**30 + 128, device="cuda", dtype=torch.bfloat16)
    y = kp.gated_activation(x, "swiglu", gate="first")
    dy = torch.ones_like(y)
    dx = kp.gated_activation_backward(dy, x, "swiglu", gate="first")
    half = x.shape[-1] // 2
    for lo in (0, half - 4096):  # the start and the far end of each half
        a = x[:, lo:lo + 4096].float()
        b = x[:, half + lo:half + lo + 4096].float()
        torch.testing.assert_close(y[:, lo:lo + 4096].float(), (torch.nn.functional.silu(a) * b).bfloat16().float(),
                                   rtol=1e-2, atol=1e-2)  # one bf16 ulp; a wrong address is far off
        torch.testing.assert_close(dx[:, half + lo:half + lo + 4096].float(),
                                   torch.nn.functional.silu(a).bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_gated_compiles_with_inductor_fullgraph():
    torch._dynamo.reset()
    mlp = kp.nn.GatedMLP(256, 512, kind="swiglu", device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(mlp, fullgraph=True)
    x = torch.randn(4, 64, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    compiled(x).float().square().sum().backward()
    g = x.grad.clone()
    x.grad = None
    mlp(x).float().square().sum().backward()
    torch.testing.assert_close(g, x.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_sparse24_linear_under_inductor_matches_fp64_and_sees_in_place_weight_changes(mode):
    """A compiled graph runs the op's body through the eager path's kept entries (sparse24/gemm.py): inductor's
    kernels and CUDA graphs alike.  Fresh inputs each call, odd n, 3-D and non-contiguous x; after an in-place change
    of the weight (as an optimizer step makes) the compiled call reads the new values."""
    from kernelplan.sparse24.layout import SP_LAYOUT

    torch._dynamo.reset()
    torch.manual_seed(0)
    dense = torch.nn.Linear(1024, 768, device="cuda", dtype=torch.bfloat16)
    layer = kp.nn.Sparse24Linear.from_dense(dense)
    assert layer.layout == SP_LAYOUT
    compiled = torch.compile(lambda t: torch.nn.functional.gelu(layer(t)), mode=mode, fullgraph=True)
    for step, shape in enumerate([(1, 1024), (3, 37, 1024), (3, 37, 1024), (3, 37, 1024), (200, 2048)]):
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16)
        if shape[-1] == 2048:
            x = x[:, ::2]  # K-strided
        if step == 3:
            with torch.no_grad():
                layer.values.mul_(-0.5)
        with torch.no_grad():
            got = compiled(x).clone()  # a replay's output is overwritten by the next
            w = layer.to_dense()
            want = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double(), layer.bias.double()))
            base = torch.nn.functional.gelu(torch.nn.functional.linear(x, w, layer.bias))
        assert_close(got, want, base, atol=FWD_ATOL[torch.bfloat16], what=f"call {step}, x {tuple(x.shape)}")


# -- 2:4 linear on the GPU backends ---------------------------------------------

_SPARSE_CASES = [(1, 4096, 4096, None, False, "contiguous"), (7, 1000, 512, "gelu", True, "transposed"),
                 (33, 256, 1024, "relu", True, "strided"), (64, 512, 4096, "silu", False, "contiguous"),
                 (300, 768, 768, "gelu_tanh", True, "contiguous")]


@pytest.mark.parametrize("backend", ["triton", "triton_bfe", "triton_m128", "dense"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_sparse24_gpu_backends_match_fp64(backend, dtype):
    from test_sparse24_triton import run_backend

    if backend in ("triton_bfe", "triton_m128") and dtype == torch.float32:
        pytest.skip(f"{backend} refuses f32 (test_sparse24_triton.py checks the reason)")
    torch.manual_seed(0)
    for n, m, k, act, bias, layout in _SPARSE_CASES:
        if backend == "triton_m128" and n <= 16:
            continue  # 16-wide N tiles: refused with its reason (test_triton_wide_tiles_say_where_they_do_not_apply)
        w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).to(dtype)
        x = torch.randn(n, k, device="cuda").to(dtype)
        if layout == "transposed":
            x = x.t().contiguous().t()
        elif layout == "strided":
            x = torch.randn(n, 2 * k, device="cuda").to(dtype)[:, ::2]
        b = torch.randn(m, device="cuda").to(dtype) if bias else None
        y, oracle, baseline = run_backend(backend, x, w, b, act)
        assert_close(y, oracle, baseline, atol=FWD_ATOL[dtype], what=f"{backend} n={n} {m}x{k} {act} {layout}")


@pytest.mark.parametrize("backend", ["triton", "triton_bfe", "triton_m128"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_sparse24_triton_reads_values_it_cannot_pair_in_place(dtype, backend):
    """Values at an odd offset and odd row stride: the PRMT path reads a contiguous copy, same result (n = 21:
    every variant takes it)."""
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    torch.manual_seed(0)
    w = kp.sparse24.prune(torch.randn(96, 512, device="cuda")).to(dtype)
    w24 = kp.sparse24.compress(w)
    wide = torch.zeros(96, 257, device="cuda", dtype=dtype)
    wide[:, 1:] = w24.values
    values = wide[:, 1:]
    assert values.stride(0) % 2 and values.data_ptr() % 4
    x = torch.randn(21, 512, device="cuda", dtype=dtype)
    desc = GemmSparse24Descriptor(21, 96, 512, kp.dtypes.dtype_info(dtype).name, device="cuda")
    plan = GemmSparse24Plan.select(desc, kp.PlanPreference.only(backend))
    y = torch.full((21, 96), float("nan"), device="cuda", dtype=dtype)
    plan.run(GemmSparse24Args(x, values, w24.metadata, y, None))
    assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[dtype])


def test_sparse24_triton_relaunch_respecializes_on_alignment_and_strides():
    """The direct launcher keeps one compiled kernel per specialization: x aligned, then x at an odd
    offset and stride, then aligned again, all in one process and shape, each against the oracle."""
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    torch.manual_seed(0)
    w = kp.sparse24.prune(torch.randn(256, 1024, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(3, 256, 1024, "bf16", device="cuda"),
                                   kp.PlanPreference.only("triton"))
    wide = torch.randn(3, 1025 * 2, device="cuda", dtype=torch.bfloat16)
    for x in (torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16), wide[:, 1:2049:2],
              wide[:, 1:1025], torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16)):
        for _ in range(2):  # the second launch of a key takes the direct path
            y = torch.full((3, 256), float("nan"), device="cuda", dtype=torch.bfloat16)
            plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, None))
            assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[torch.bfloat16])


def test_sparse24_triton_split_counters_rearm_and_replay():
    """The one-launch split-K: each tile's last split sums the partials in split order and re-arms its
    counter, so launches on the default stream, on a side stream and from a graph's replays all give
    the same bits, and every counter is zero afterwards."""
    from kernelplan.kernels.sparse24 import _SCRATCH
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    torch.manual_seed(0)
    w = kp.sparse24.prune(torch.randn(4096, 4096, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    bias = torch.randn(4096, device="cuda", dtype=torch.bfloat16)
    desc = GemmSparse24Descriptor(5, 4096, 4096, "bf16", "gelu", True, device="cuda")
    plan = GemmSparse24Plan.select(desc, kp.PlanPreference.only("triton"))
    assert plan.backend._config(desc).splits > 1
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)

    def run():
        y = torch.full((5, 4096), float("nan"), device="cuda", dtype=torch.bfloat16)
        plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, bias))
        return y

    first = run()
    assert_close(first, F.gelu(F.linear(x.double(), w.double(), bias.double())), F.gelu(F.linear(x, w, bias)),
                 atol=FWD_ATOL[torch.bfloat16])
    for _ in range(3):
        assert torch.equal(run(), first)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = run()
    torch.cuda.current_stream().wait_stream(side)
    assert torch.equal(on_side, first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    x.copy_(torch.randn_like(x))
    eager = run()
    for _ in range(2):
        graph.replay()
        assert torch.equal(captured, eager)
    torch.cuda.synchronize()
    # A weight of more tiles next, on the same scratch: counters past the first 64 must be zero too.
    w = kp.sparse24.prune(torch.randn(8192, 4096, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    wide = GemmSparse24Plan.select(GemmSparse24Descriptor(5, 8192, 4096, "bf16", device="cuda"),
                                   kp.PlanPreference.only("triton"))
    assert wide.backend._config(wide.desc).splits > 1
    x = torch.randn(5, 4096, device="cuda", dtype=torch.bfloat16)
    for _ in range(2):
        y = torch.full((5, 8192), float("nan"), device="cuda", dtype=torch.bfloat16)
        wide.run(GemmSparse24Args(x, w24.values, w24.metadata, y, None))
        assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[torch.bfloat16])
    torch.cuda.synchronize()
    assert _SCRATCH and all(int(counters.count_nonzero()) == 0 for counters, _ in _SCRATCH.values())


def test_triton_launch_hooks_see_direct_launches(monkeypatch):
    """With a launch hook set (a profiler), kernels launch through Triton's own path, which calls it."""
    import triton.knobs

    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    w = kp.sparse24.prune(torch.randn(256, 512, device="cuda")).half()
    w24 = kp.sparse24.compress(w)
    x = torch.randn(3, 512, device="cuda", dtype=torch.half)
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(3, 256, 512, "f16", device="cuda"),
                                   kp.PlanPreference.only("triton"))
    y = torch.empty(3, 256, device="cuda", dtype=torch.half)
    plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, None))  # compiled, then direct from here on
    # Without hooks the launch skips Triton's per-call Python (kernel[grid]): Triton 3.6 and later
    # keep an empty hook chain there, not None.
    from triton.compiler.compiler import CompiledKernel

    slow = []
    monkeypatch.setattr(CompiledKernel, "__getitem__", lambda self, grid, real=CompiledKernel.__getitem__:
                        slow.append(grid) or real(self, grid))
    plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, None))
    assert slow == []
    seen = []
    chain = triton.knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(seen.append)
    else:
        triton.knobs.runtime.launch_enter_hook = seen.append
    try:
        y.fill_(float("nan"))
        plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, None))
    finally:
        if hasattr(chain, "remove"):
            chain.remove(seen.append)
        else:
            triton.knobs.runtime.launch_enter_hook = None
    assert len(seen) == 1 and len(slow) == 1
    assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[torch.half])


@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_sparse24_functional_3d_x_tunes_and_matches(activation):
    from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan
    from kernelplan.sparse24.tuning import tunable

    w = kp.sparse24.prune(torch.randn(512, 1024, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    x = torch.randn(2, 5, 1024, device="cuda", dtype=torch.bfloat16)
    y = kp.sparse24.linear(x, w24, activation=activation, memory="fast")  # "fast": every backend timed
    desc = GemmSparse24Descriptor(10, 512, 1024, "bf16", activation, device="cuda", memory="fast")
    timed = {b.name for b in tunable(desc)}
    assert {"triton", "triton_bfe", "dense"} <= timed  # and cusparselt for relu, where it is installed
    measured = GemmSparse24Plan.measured(desc)
    assert measured is not None and set(measured["timings_s"]) == timed
    act = getattr(F, activation)
    assert_close(y, act(F.linear(x.double(), w.double())), act(F.linear(x, w)), atol=FWD_ATOL[torch.bfloat16])


def test_graph_timings_leave_torchs_default_capture_stream_alone(monkeypatch):
    """Tile tuning's and the benchmarks' graph timings capture on a stream of their own: torch's default capture stream,
    made once per process on the device current at the first capture that names none, is not made by them (made on
    cuda:1 by a tuning there, it would take a user's later default captures on cuda:0; docs/design/0047)."""
    from kernelplan.timing import graph_rounds, graph_us

    monkeypatch.setattr(torch.cuda.graph, "default_capture_stream", None)
    count = torch.zeros((), dtype=torch.int64, device="cuda")
    graph_rounds({"count": [lambda: count.add_(1)]}, calls=4, rounds=2)
    torch.cuda.synchronize()
    assert int(count) == 1 + 4 * (1 + 2)  # the warm-up, the upload replay and 2 rounds: the graph holds the calls
    assert graph_us(lambda: count.add_(1), rep=2) > 0
    assert torch.cuda.graph.default_capture_stream is None


def test_sparse24_graph_capture_replays_the_right_result():
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(2048, 2048, device="cuda")).bfloat16())
    bias = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16)
    kp.sparse24.linear(x, w24, bias, "relu")  # warm-up: tuning and compilation outside the capture
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        kp.sparse24.linear(x, w24, bias, "relu")
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kp.sparse24.linear(x, w24, bias, "relu")
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(y, kp.sparse24.linear(x, w24, bias, "relu"))
    w = w24.decompress()
    torch.testing.assert_close(y.float(), F.relu(F.linear(x.float(), w.float(), bias.float())), rtol=2e-2, atol=2e-2)


def test_sparse24_a_graph_capture_runs_the_choice_made_for_graphs():
    """Tuning stores two choices, by host-inclusive time and by kernel time; a capture takes the second."""
    import dataclasses

    from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan
    from kernelplan.sparse24.gemm import fast_path_backends

    w = kp.sparse24.prune(torch.randn(768, 1024, device="cuda")).half()
    w24 = kp.sparse24.compress(w)
    x = torch.randn(6, 1024, device="cuda", dtype=torch.half)
    kp.sparse24.linear(x, w24, memory="fast")  # tunes this bucket
    desc = GemmSparse24Descriptor(6, 768, 1024, "f16", device="cuda", memory="fast")
    graphed = dataclasses.replace(desc, graph=True)
    assert set(GemmSparse24Plan.measured(graphed)["timings_s"]) == set(GemmSparse24Plan.measured(desc)["timings_s"])
    # Fake tables, so that the two choices differ whatever this GPU measured.
    GemmSparse24Plan.remember_fastest(desc, {"dense": 1e-6, "triton": 1e-3})
    GemmSparse24Plan.remember_fastest(graphed, {"dense": 1e-3, "triton": 1e-6})
    # Another weight of the bucket, never tuned: its eager warm-up must build what the capture's choice needs.
    w = kp.sparse24.prune(torch.randn(768, 1024, device="cuda")).half()
    w24 = kp.sparse24.compress(w)
    with torch.inference_mode():
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            eager = kp.sparse24.linear(x, w24, memory="fast")
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = kp.sparse24.linear(x, w24, memory="fast")
        graph.replay()
        ran = {(r["graph"], r["backend"]) for r in fast_path_backends() if (r["n"], r["m"], r["k"]) == (6, 768, 1024)}
        assert ran == {(False, "dense"), (True, "triton")}
        assert_close(y, F.linear(x.double(), w.double()), eager, atol=FWD_ATOL[torch.half])
        # A weight captured before any eager call: its layouts cannot be built inside the capture.
        cold = kp.sparse24.compress(kp.sparse24.prune(torch.randn(768, 1024, device="cuda")).half())
        with pytest.raises(kp.InvalidState, match=r"inside a CUDA graph capture.*run the same call once eagerly"):
            with torch.cuda.graph(torch.cuda.CUDAGraph()):
                kp.sparse24.linear(x, cold, memory="fast")


def test_sparse24_tuning_leaves_the_weight_only_its_choices_layouts():
    """Tuning times every candidate on a copy of the weight: the losers' layouts (a dense copy, tiled
    copies, cuSPARSELt's buffer) go with it, and the weight holds what its chosen backends built."""
    import dataclasses

    from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan

    torch.manual_seed(0)
    m, k = 1536, 1024  # a shape no other test tunes
    w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).bfloat16()
    w24 = kp.sparse24.compress(w)
    dense_bytes = m * k * 2
    chosen = set()
    for n in (16, 300):
        x = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        assert_close(kp.sparse24.linear(x, w24, memory="fast"), F.linear(x.double(), w.double()), F.linear(x, w),
                     atol=FWD_ATOL[torch.bfloat16], what=f"n={n}")
        desc = GemmSparse24Descriptor(n, m, k, "bf16", device="cuda:0", memory="fast")
        assert GemmSparse24Plan.measured(desc) is not None, f"n={n} was not tuned here"
        # The eager choice, and the one for calls recorded into graphs (prepared on the first call too).
        chosen |= {GemmSparse24Plan.select(d).sku.backend for d in (desc, dataclasses.replace(desc, graph=True))}
    held = w24.derived_bytes()
    if "dense" not in chosen:
        assert "dense" not in held, f"chosen {chosen}, but the weight holds a dense copy: {held}"
    # At most one copy per chosen backend, each at most the dense bytes (the dense copy) and mostly 9/16.
    assert sum(held.values()) <= dense_bytes * len(chosen), f"chosen {chosen}, held {held}"


def test_sparse24_tuning_is_reused_by_a_second_process(tmp_path):
    import os
    import subprocess
    import sys

    script = """
import torch, kernelplan as kp
from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan
import kernelplan.sparse24.tuning as tuning
calls = []
real = tuning.tune
tuning.tune = lambda *a, **k: calls.append(1) or real(*a, **k)
w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(1024, 1024, device="cuda")).half())
kp.sparse24.linear(torch.randn(3, 1024, device="cuda").half(), w24, memory="fast")
desc = GemmSparse24Descriptor(3, 1024, 1024, "f16", device="cuda", memory="fast")
print(len(calls), GemmSparse24Plan.measured(desc)["backend"])
"""
    env = {**os.environ, "KERNELPLAN_CACHE_DIR": str(tmp_path)}
    first = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    second = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    tuned, backend = first.stdout.split()
    assert tuned == "1" and second.stdout.split() == ["0", backend]


@needs_nvmath
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cusparselt_matches_fp64_and_stores_its_search(dtype):
    from kernelplan.cache import plan_cache
    from kernelplan.sparse24 import cusparselt
    from test_sparse24_triton import run_backend

    cusparselt.release_plans()  # plans made by earlier tests stored their search in those tests' caches
    torch.manual_seed(0)
    cases = [(16, 512, 1024, None, False), (256, 1024, 512, "relu", False), (48, 4096, 4096, None, False),
             (32, 512, 1024, "relu", True), (7, 256, 512, "gelu", True), (64, 256, 512, "silu", False)]
    for n, m, k, act, has_bias in cases:
        w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).to(dtype)
        x = torch.randn(n, k, device="cuda").to(dtype)
        bias = torch.randn(m, device="cuda").to(dtype) if has_bias else None
        y, oracle, baseline = run_backend("cusparselt", x, w, bias, act)
        assert_close(y, oracle, baseline, atol=FWD_ATOL[dtype], what=f"cusparselt n={n} {m}x{k} {act} bias={has_bias}")
        dt = kp.dtypes.dtype_info(dtype).name
        fused_relu = act == "relu" and not has_bias  # with a bias, relu runs in the epilogue pass
        problem = {"m": m, "k": k, "n": -(-n // 16) * 16, "dtype": dt, "relu": fused_relu}
        assert plan_cache().get("cusparselt_search", problem, device="cuda:0") is not None


def test_cusparselt_reports_shapes_it_cannot_take():
    from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan

    with pytest.raises(kp.Unsupported, match=r"cusparselt: cuSPARSELt needs m and k to be multiples of 16.*k=4104"):
        GemmSparse24Plan.select(GemmSparse24Descriptor(16, 4096, 4104, "bf16", device="cuda"),
                                kp.PlanPreference.only("cusparselt"))
    with pytest.raises(kp.Unsupported, match=r"cusparselt: dtype f32 .*1:2 sparsity"):
        GemmSparse24Plan.select(GemmSparse24Descriptor(64, 4096, 4096, "f32", device="cuda"),
                                kp.PlanPreference.only("cusparselt"))


@needs_nvmath
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cusparselt_pads_any_n(dtype):
    """N off the library's multiple of 16 (1 included) runs padded; only y's own elements are written."""
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    w = kp.sparse24.prune(torch.randn(256, 512, device="cuda")).to(dtype)
    w24 = kp.sparse24.compress(w)
    for n in (1, 5, 17, 40):
        x = torch.randn(512, n, device="cuda").to(dtype).t()  # [n, 512], column-major as well
        y_buf = torch.full((n + 1, 256), float("nan"), device="cuda", dtype=dtype)
        y = y_buf[:n]
        plan = GemmSparse24Plan.select(GemmSparse24Descriptor(n, 256, 512, kp.dtypes.dtype_info(dtype).name,
                                                              device="cuda:0"), kp.PlanPreference.only("cusparselt"))
        plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y))
        assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[dtype], what=f"n={n}")
        assert torch.isnan(y_buf[n]).all(), f"n={n}: a row past y was written"


@needs_nvmath
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cusparselt_weights_after_the_first_on_a_used_plan(dtype):
    """Weights compressed after their plan has searched and run (f16 once got a relative error of 1.4)."""
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan
    from kernelplan.sparse24 import cusparselt

    cusparselt.release_plans()  # planned here: from the stored search, or searched on the first weight
    torch.manual_seed(0)
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(16, 256, 512, kp.dtypes.dtype_info(dtype).name,
                                                          device="cuda:0"), kp.PlanPreference.only("cusparselt"))
    x = torch.randn(16, 512, device="cuda").to(dtype)
    for i in range(3):
        w = kp.sparse24.prune(torch.randn(256, 512, device="cuda")).to(dtype)
        w24 = kp.sparse24.compress(w)
        for _ in range(2):
            y = torch.full((16, 256), float("nan"), device="cuda", dtype=dtype)
            plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y))
            assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[dtype], what=f"weight {i}")


@needs_nvmath
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_cusparselt_keeps_one_compressed_copy_per_weight(dtype):
    """Every N bucket and epilogue of a weight runs on one compressed copy; a changed weight gets a new one."""
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan
    from kernelplan.sparse24.format import _DERIVED

    torch.manual_seed(0)
    m, k = 512, 1024
    w = kp.sparse24.prune(torch.randn(m, k, device="cuda")).to(dtype)
    w24 = kp.sparse24.compress(w)

    def copies():
        return [layout for key, (_, layout) in _DERIVED[id(w24.values)][1].items() if key.startswith("cusparselt:")]

    for n, act in ((16, None), (256, None), (1024, "relu"), (40, None)):
        x = torch.randn(n, k, device="cuda").to(dtype)
        y = torch.full((n, m), float("nan"), device="cuda", dtype=dtype)
        plan = GemmSparse24Plan.select(
            GemmSparse24Descriptor(n, m, k, kp.dtypes.dtype_info(dtype).name, activation=act, device="cuda:0"),
            kp.PlanPreference.only("cusparselt"))
        plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y))
        oracle, baseline = F.linear(x.double(), w.double()), F.linear(x, w)
        if act:
            oracle, baseline = oracle.relu(), baseline.relu()
        assert_close(y, oracle, baseline, atol=FWD_ATOL[dtype], what=f"n={n} {act}")
        held = {key: b for key, b in w24.derived_bytes().items() if key.startswith("cusparselt")}
        assert list(held) == [f"cusparselt:{kp.dtypes.dtype_info(dtype).name}"], f"n={n}: copies {held}"
    first = copies()[0]
    with torch.no_grad():
        w24.values.mul_(-1)  # a training step's in-place update: the copy must follow it
    x = torch.randn(16, k, device="cuda").to(dtype)
    y = torch.empty(16, m, device="cuda", dtype=dtype)
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(16, m, k, kp.dtypes.dtype_info(dtype).name, device="cuda:0"),
                                   kp.PlanPreference.only("cusparselt"))
    plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y))
    assert_close(y, F.linear(x.double(), -w.double()), F.linear(x, -w), atol=FWD_ATOL[dtype], what="after an update")
    assert len(copies()) == 1 and copies()[0] is not first


@needs_nvmath
def test_cusparselt_under_graph_capture():
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(1024, 2048, device="cuda")).half())
    x = torch.randn(64, 2048, device="cuda", dtype=torch.float16)
    y = torch.empty(64, 1024, device="cuda", dtype=torch.float16)
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(64, 1024, 2048, "f16", device="cuda:0"),
                                   kp.PlanPreference.only("cusparselt"))
    args = GemmSparse24Args(x, w24.values, w24.metadata, y)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        plan.run(args)  # search, compression and planning happen outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan.run(args)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    want = F.linear(x.float(), w24.decompress().float())
    torch.testing.assert_close(y.float(), want, rtol=2e-2, atol=2e-2)


@needs_nvmath
def test_cusparselt_takes_transposed_x_and_strided_y():
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    w = kp.sparse24.prune(torch.randn(512, 1024, device="cuda")).half()
    w24 = kp.sparse24.compress(w)
    x = torch.randn(1024, 64, device="cuda", dtype=torch.float16).t()  # [64, 1024], column-major
    y_buf = torch.full((64, 1024), float("nan"), device="cuda", dtype=torch.float16)
    y = y_buf[:, ::2]  # [64, 512], stride 2
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(64, 512, 1024, "f16", device="cuda:0"),
                                   kp.PlanPreference.only("cusparselt"))
    plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y))
    assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[torch.float16])
    assert torch.isnan(y_buf[:, 1::2]).all()


def test_sparsified_model_compiles_with_inductor_and_trains_on_cuda():
    """Issue 6: torch.compile(fullgraph=True) over Sparse24Linear layers on the GPU, then optimizer steps."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 128))
    model = model.to("cuda", torch.bfloat16)
    kp.sparsify(model, progress=False)
    x = torch.randn(4, 16, 256, device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, fullgraph=True)
    compiled(x).float().square().mean().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).float().square().mean().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        assert want.norm() > 0
        torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)
    masks = [layer.to_dense() != 0 for layer in model if isinstance(layer, kp.nn.Sparse24Linear)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        opt.zero_grad()
        compiled(x).float().square().mean().backward()
        opt.step()
    for layer, mask in zip((m for m in model if isinstance(m, kp.nn.Sparse24Linear)), masks):
        w = layer.to_dense()
        assert kp.sparse24.is_sparse24(w) and not (w[~mask] != 0).any(), "an optimizer step broke the 2:4 mask"


@pytest.mark.parametrize("recipe", ["tensor", "rowwise"])
def test_fp8_linear_runs_scaled_mm_on_cuda(recipe):
    """Issue 5: fp8 GEMMs dispatch to torch._scaled_mm on an sm_89+ GPU; SNR >= 25 dB against fp64."""
    import math

    from kernelplan.gemm import GemmDescriptor, GemmPlan

    torch.manual_seed(0)
    x, w = torch.randn(4, 100, 512, device="cuda"), torch.randn(1000, 512, device="cuda")  # n = 1000: padded
    b = torch.randn(1000, device="cuda").bfloat16()
    xq, wq = kp.fp8.quantize(x, recipe), kp.fp8.quantize(w, recipe)
    mode = "vector" if recipe == "rowwise" else "tensor"
    desc = GemmDescriptor(400, 1000, 512, "e4m3", out_dtype="bf16", epilogue="bias", transb=True,
                          scale_a=mode, scale_b=mode, device="cuda:0")
    assert GemmPlan.select(desc).sku.backend == "scaled_mm"
    y = kp.fp8.linear(xq, wq, b)
    ref = F.linear(x.double(), w.double(), b.double())
    snr = 10 * math.log10(float((ref**2).sum() / ((y.double() - ref) ** 2).sum()))
    assert snr >= 25, f"SNR {snr:.1f} dB"
