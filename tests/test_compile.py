"""The custom ops trace under torch.compile(fullgraph=True), forward and backward."""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp
from helpers import recording_backend


def test_sparse24_linear_and_gated_activation_compile_fullgraph():
    torch._dynamo.reset()
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 64)))
    bias = torch.randn(32, requires_grad=True)
    w24.values.requires_grad_(True)

    def block(x):
        h = kp.sparse24.linear(x, w24, bias, activation="silu")
        return kp.gated_activation(h, "swiglu", dim=-1, gate="first")

    # aot_eager traces through the fake and autograd registrations without a C++ toolchain.
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 5, 64, requires_grad=True)
    y = compiled(x)
    y.square().sum().backward()
    grads = [t.grad.clone() for t in (x, bias, w24.values)]
    for t in (x, bias, w24.values):
        t.grad = None
    block(x).square().sum().backward()
    for got, want in zip(grads, (x.grad, bias.grad, w24.values.grad)):
        assert want.norm() > 0
        torch.testing.assert_close(got, want)


def test_gated_out_forms_compile_fullgraph():
    """The out= ops mutate their last argument; torch.compile functionalises them."""
    torch._dynamo.reset()

    def step(x, y, dy, dx):
        kp.gated_activation(x, "geglu", dim=0, gate="first", out=y)
        kp.gated_activation_backward(dy, x, "geglu", dim=0, gate="first", out=dx)
        return y.sum() + dx.sum()

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    x, dy = torch.randn(8, 5), torch.randn(4, 5)
    y, dx = torch.full((4, 5), float("nan")), torch.full((8, 5), float("nan"))
    total = compiled(x, y, dy, dx)
    want_y = kp.gated_activation(x, "geglu", dim=0, gate="first")
    want_dx = kp.gated_activation_backward(dy, x, "geglu", dim=0, gate="first")
    torch.testing.assert_close(y, want_y)
    torch.testing.assert_close(dx, want_dx)
    torch.testing.assert_close(total, want_y.sum() + want_dx.sum())


def test_sparse24_inference_skips_the_op_in_eager_but_not_under_compile():
    """Plain eager inference calls the implementation directly; compile still sees the custom op."""
    from unittest import mock

    from kernelplan.sparse24 import gemm

    torch._dynamo.reset()
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 64)))
    x = torch.randn(3, 64)
    with mock.patch.object(gemm, "_sparse24_linear_op", wraps=gemm._sparse24_linear_op) as op:
        eager = kp.sparse24.linear(x, w24, activation="relu")
        assert op.call_count == 0
        xg = x.clone().requires_grad_()
        kp.sparse24.linear(xg, w24, activation="relu").sum().backward()
        assert op.call_count == 1 and xg.grad is not None  # autograd takes the op
    # Under compile the traced graph holds the custom op (fullgraph would fail on the raw kernels).
    backend, graphs = recording_backend()

    compiled = torch.compile(lambda t: kp.sparse24.linear(t, w24, activation="relu"), fullgraph=True, backend=backend)(x)
    assert any("kernelplan.sparse24_linear" in g for g in graphs)
    torch.testing.assert_close(eager, compiled)
    torch.testing.assert_close(eager, torch.relu(x @ w24.decompress().T))


def test_compiled_inference_takes_the_op_without_autograd_and_training_the_one_with_it():
    """A traced call that needs no gradient is ``kernelplan::sparse24_linear_inference`` (no autograd layer to
    cross on each call); one that does is ``kernelplan::sparse24_linear``, whose backward runs."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 64)))
    bias = torch.randn(32)
    backend, graphs = recording_backend()

    fn = torch.compile(lambda t, b: kp.sparse24.linear(t, w24, b, activation="gelu"), fullgraph=True, backend=backend)
    x = torch.randn(2, 3, 64)
    want = torch.nn.functional.gelu(x @ w24.decompress().T + bias)
    with torch.no_grad():
        torch.testing.assert_close(fn(x, bias), want)
    assert "kernelplan.sparse24_linear_inference" in graphs[-1]
    xg, bg = x.clone().requires_grad_(), bias.clone().requires_grad_()
    fn(xg, bg).sum().backward()  # grad mode and requires_grad are guarded: a second graph, the autograd op
    assert len(graphs) == 2 and "kernelplan.sparse24_linear_inference" not in graphs[-1]
    assert "kernelplan.sparse24_linear." in graphs[-1]
    xr, br = x.clone().requires_grad_(), bias.clone().requires_grad_()
    torch.nn.functional.gelu(xr @ w24.decompress().T + br).sum().backward()
    torch.testing.assert_close(xg.grad, xr.grad)
    torch.testing.assert_close(bg.grad, br.grad)


@pytest.mark.parametrize("op", ["sparse24_linear", "sparse24_linear_inference"])
def test_the_sparse24_ops_pass_opcheck(op):
    """torch.library.opcheck: schema, fake form against the real output, dispatch under AOT (odd, 3-D, bias)."""
    torch.manual_seed(0)
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(48, 64)))
    x = torch.randn(3, 5, 64)
    torch.library.opcheck(getattr(torch.ops.kernelplan, op).default,
                          (x, w24.values, w24.metadata, torch.randn(48), "silu", "compact"))


def test_gated_inference_skips_the_op_in_eager_and_compile_keeps_it():
    from unittest import mock

    from kernelplan import gated

    torch._dynamo.reset()
    x = torch.randn(4, 10)
    with mock.patch.object(gated, "_gated_op", wraps=gated._gated_op) as op:
        eager = kp.gated_activation(x, "geglu", gate="first")
        assert op.call_count == 0
        kp.gated_activation(x.clone().requires_grad_(), "geglu", gate="first").sum().backward()
        assert op.call_count == 1
    backend, graphs = recording_backend()

    compiled = torch.compile(lambda t: kp.gated_activation(t, "geglu", gate="first"), fullgraph=True, backend=backend)(x)
    assert any("kernelplan.gated_activation" in g for g in graphs)
    torch.testing.assert_close(eager, compiled)


def test_model_holding_sparse24_linear_compiles_fullgraph_and_trains():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))
    kp.sparsify(model, progress=False)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    x = torch.randn(4, 64)
    compiled(x).square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    model(x).square().sum().backward()
    for got, want in zip(grads, (p.grad for p in model.parameters())):
        assert want.norm() > 0
        torch.testing.assert_close(got, want)


def _compiled_matches_eager(fn, *inputs, grads=True):
    """fn compiled with fullgraph=True (aot_eager) against eager: outputs and, where asked, every input's gradient."""
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    outs = compiled(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    want = fn(*inputs)
    want = want if isinstance(want, tuple) else (want,)
    for got, w in zip(outs, want):
        torch.testing.assert_close(got, w)
    if not grads:
        return
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    got_g = torch.autograd.grad(outs[0].square().sum(), leaves)
    want_g = torch.autograd.grad(fn(*inputs)[0].square().sum() if isinstance(fn(*inputs), tuple)
                                 else fn(*inputs).square().sum(), leaves)
    for g, w in zip(got_g, want_g):
        assert w.norm() > 0
        torch.testing.assert_close(g, w)


FORWARD_EPILOGUES = ["none", "bias", "relu", "relu_bias", "gelu", "gelu_bias"]


@pytest.mark.parametrize("epilogue", FORWARD_EPILOGUES + ["relu_aux_bias", "gelu_aux_bias", "gelu_aux", "relu_aux"])
def test_linear_forward_epilogues_compile_fullgraph_forward_and_backward(epilogue):
    x = torch.randn(2, 3, 16, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    b = torch.randn(8, requires_grad=True) if "bias" in epilogue else None
    leaves = (x, w) if b is None else (x, w, b)
    _compiled_matches_eager(lambda *t: kp.linear(t[0], t[1], t[2] if len(t) > 2 else None, epilogue), *leaves)


@pytest.mark.parametrize("epilogue", ["drelu", "dgelu", "drelu_bgrad", "dgelu_bgrad", "bgrad"])
def test_linear_backward_epilogues_compile_fullgraph(epilogue):
    x, w1, w2 = torch.randn(6, 16), torch.randn(24, 16), torch.randn(8, 24)
    fwd = "relu_aux" if "relu" in epilogue else "gelu_aux"
    _, aux = kp.linear(x, w1, None, fwd)  # aux [6, 24]
    dy = torch.randn(6, 8)
    args = (dy, w2.t().contiguous(), aux) if epilogue != "bgrad" else (x, w1, None)
    _compiled_matches_eager(lambda a, b, c: kp.linear(a, b, None, epilogue, aux=c), *args, grads=False)


def test_linear_c_alpha_beta_and_out_compile_fullgraph():
    x, w, c = torch.randn(4, 16, requires_grad=True), torch.randn(8, 16), torch.randn(4, 8, requires_grad=True)
    _compiled_matches_eager(lambda x, c: kp.linear(x, w, c=c, alpha=0.5, beta=2.0), x, c)
    out = torch.full((4, 8), float("nan"))
    torch._dynamo.reset()
    torch.compile(lambda x: kp.linear(x, w, out=out), fullgraph=True, backend="aot_eager")(x.detach())
    torch.testing.assert_close(out, x.detach() @ w.T)


@pytest.mark.parametrize("recipe", ["tensor", "rowwise"])
def test_fp8_linear_compiles_fullgraph(recipe):
    x, w, b = torch.randn(2, 8, 32), torch.randn(16, 32), torch.randn(16).bfloat16()
    xq, wq = kp.fp8.quantize(x, recipe), kp.fp8.quantize(w, recipe)
    _compiled_matches_eager(lambda xd, wd: kp.fp8.linear(
        kp.fp8.Quantized(xd, xq.scale, xq.amax, recipe), kp.fp8.Quantized(wd, wq.scale, wq.amax, recipe), b),
        xq.data, wq.data, grads=False)


@pytest.mark.parametrize("module", ["FusedLinear-gelu", "FusedLinear-relu", "FusedLinear-none", "FusedMLP-gelu",
                                    "FusedMLP-relu", "GatedMLP", "Sparse24Linear"])
def test_modules_compile_fullgraph_forward_and_backward(module):
    torch.manual_seed(0)
    name, _, act = module.partition("-")
    if name == "FusedLinear":
        m = kp.nn.FusedLinear(16, 24, activation=None if act == "none" else act)
    elif name == "FusedMLP":
        m = kp.nn.FusedMLP(16, 32, 8, activation=act)
    elif name == "GatedMLP":
        m = kp.nn.GatedMLP(16, 24, kind="swiglu")
    else:
        m = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(16, 24))
    x = torch.randn(2, 3, 16, requires_grad=True)
    torch._dynamo.reset()
    y = torch.compile(m, fullgraph=True, backend="aot_eager")(x)
    y.square().sum().backward()
    got = [x.grad.clone()] + [p.grad.clone() for p in m.parameters()]
    x.grad = None
    m.zero_grad()
    want_y = m(x)
    want_y.square().sum().backward()
    torch.testing.assert_close(y, want_y)
    for g, w in zip(got, [x.grad] + [p.grad for p in m.parameters()]):
        assert w.norm() > 0
        torch.testing.assert_close(g, w)


def test_the_ops_body_runs_the_eager_fast_paths_entry_not_a_dispatch_a_call():
    """A compiled graph (or autograd) runs the op's body on every call: it dispatches once per operands and then
    runs the entry it kept, as an eager call does; new operands, another epilogue or an in-place change of the
    weight are seen."""
    from unittest import mock

    from kernelplan.sparse24 import gemm

    torch.manual_seed(0)
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(48, 64)))
    bias = torch.randn(48)
    op = torch.ops.kernelplan.sparse24_linear
    x = torch.randn(5, 64)
    with mock.patch.object(gemm, "_plan_for", wraps=gemm._plan_for) as plan_for:
        for _ in range(3):
            got = op(x, w24.values, w24.metadata, bias, "", "compact")
        assert plan_for.call_count == 1
        torch.testing.assert_close(got, x @ w24.decompress().T + bias)
        relu = op(x, w24.values, w24.metadata, bias, "relu", "compact")
        other = op(torch.randn(7, 64), w24.values, w24.metadata, None, "", "compact")
        assert plan_for.call_count == 3 and other.shape == (7, 48)
        torch.testing.assert_close(relu, torch.relu(x @ w24.decompress().T + bias))
        with torch.no_grad():
            w24.values.mul_(2)  # in place: the same tensors, the entry kept
        torch.testing.assert_close(op(x, w24.values, w24.metadata, bias, "", "compact"),
                                   x @ w24.decompress().T + bias)
        assert plan_for.call_count == 3
