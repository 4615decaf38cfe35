"""The cuBLASLt GEMM backend against the fp64 reference: every epilogue and dtype, layouts, graphs, tuning."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned
from kernelplan.gemm import Epilogue, GemmArgs, GemmDescriptor, GemmPlan

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
              pytest.mark.skipif(importlib.util.find_spec("nvmath") is None,
                                 reason="nvmath-python is not installed: the cuBLASLt backend is its bindings")]
DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
DEV = "cuda:0"  # the spelling torch gives tensors: descriptors name the device they check against


def _run(backend, desc, a, b, *, c=None, bias=None, aux_in=None, alpha=1.0, beta=0.0):
    """Run ``desc`` on ``backend``; returns (D, aux written, bgrad)."""
    spec = Epilogue(desc.epilogue).spec
    dt, dev = a.dtype, a.device
    d = poisoned((desc.m, desc.n), dt, dev)
    aux = aux_in
    if spec.aux_out:
        aux = poisoned((desc.m, desc.n), torch.bool if spec.activation == "relu" else dt, dev)
    bgrad = poisoned((desc.n if spec.bgrad == "d" else desc.m,), dt, dev) if spec.bgrad else None
    plan = GemmPlan.select(desc, kp.PlanPreference.only(backend))
    plan.run(GemmArgs(a, b, d, c=c, bias=bias, aux=aux, bgrad=bgrad, alpha=alpha, beta=beta))
    return d, aux if spec.aux_out else None, bgrad


def _problem(dtype, epilogue, m=37, n=50, k=72, transa=False, transb=True, has_c=False):
    """Odd sizes on purpose: n off 8 sends GELU aux through the padded buffer, ReLU aux through bit padding."""
    spec = Epilogue(epilogue).spec
    dev = DEV
    a = torch.randn((k, m) if transa else (m, k), device=dev).to(dtype)
    b = (torch.randn((n, k) if transb else (k, n), device=dev) / k**0.5).to(dtype)
    c = torch.randn(m, n, device=dev).to(dtype) if has_c else None
    bias = torch.randn(n, device=dev).to(dtype) if spec.bias else None
    aux = None
    if spec.aux_in:
        z = torch.randn(m, n, device=dev).to(dtype)
        aux = z > 0 if spec.aux_in == "relu" else z
    desc = GemmDescriptor(m, n, k, kp.dtypes.dtype_info(dtype).name, epilogue=epilogue, transa=transa,
                          transb=transb, has_c=has_c, device=DEV)
    return desc, a, b, c, bias, aux


def _check(desc, a, b, c, bias, aux, alpha=1.0, beta=0.0):
    import dataclasses

    kw = dict(c=c, bias=bias, aux_in=aux, alpha=alpha, beta=beta)
    out = _run("cublaslt", desc, a, b, **kw)
    same = _run("reference", desc, a, b, **kw)  # same dtype: the error bar
    up = lambda t: None if t is None or t.dtype == torch.bool else t.double()  # noqa: E731
    desc64 = dataclasses.replace(desc, dtype="f64")
    oracle = _run("reference", desc64, a.double(), b.double(), c=up(c), bias=up(bias),
                  aux_in=aux if aux is None or aux.dtype == torch.bool else aux.double(), alpha=alpha, beta=beta)
    atol = 4 * FWD_ATOL[a.dtype]
    what = f"{desc.epilogue} {desc.dtype} transa={desc.transa} transb={desc.transb} c={c is not None}"
    assert_close(out[0], oracle[0], same[0], atol=atol, what=f"D of {what}")
    if out[2] is not None:
        assert_close(out[2], oracle[2], same[2], atol=atol, what=f"bgrad of {what}")
    if out[1] is not None:
        if out[1].dtype == torch.bool:
            # A sign can differ only where the pre-activation is within rounding of 0.
            z = _run("reference", dataclasses.replace(desc64, epilogue="gelu_aux" + ("_bias" if bias is not None else "")),
                     a.double(), b.double(), bias=up(bias), c=up(c), alpha=alpha, beta=beta)[1]
            sure = z.abs() > 1e-2 * z.abs().max()
            assert torch.equal(out[1][sure], (z > 0)[sure]), f"relu mask of {what}"
        else:
            assert_close(out[1], oracle[1], same[1], atol=atol, what=f"aux of {what}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("epilogue", [e.value for e in Epilogue])
def test_every_epilogue_matches_fp64(dtype, epilogue):
    torch.manual_seed(0)
    if dtype == torch.float64 and "gelu" in epilogue:
        with pytest.raises(kp.Unsupported, match="f64 GELU"):
            GemmPlan.select(_problem(dtype, epilogue)[0], kp.PlanPreference.only("cublaslt"))
        return
    _check(*_problem(dtype, epilogue))


@pytest.mark.parametrize("epilogue", ["bgrad", "drelu_bgrad", "relu_aux_bias"])
def test_vector_shapes(epilogue):
    """m = 1 and n = 1: a size-1 dim's stride is arbitrary, and BGRADB must still read B' row-major."""
    torch.manual_seed(4)
    for m, n in ((1, 24), (24, 1), (1, 1)):
        _check(*_problem(torch.float32, epilogue, m=m, n=n, k=40))


@pytest.mark.parametrize("transa,transb", [(False, False), (True, False), (True, True), (False, True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_transposes_alpha_beta_and_c(transa, transb, dtype):
    desc, a, b, c, bias, aux = _problem(dtype, "bias", transa=transa, transb=transb, has_c=True)
    _check(desc, a, b, c, bias, aux, alpha=0.75, beta=-1.5)


def test_strided_operands_and_outputs():
    """A D, C and aux that are views of larger buffers; a B strided in both dims (copied inside)."""
    torch.manual_seed(1)
    m, n, k = 24, 40, 64
    a = torch.randn(m, k, device=DEV)
    b = torch.randn(n, 2 * k, device=DEV)[:, ::2]  # neither dim unit-stride
    c_buf = torch.randn(m, n + 8, device=DEV)
    d_buf = torch.full((m, n + 8), float("nan"), device=DEV)
    aux_buf = torch.full((m, n + 8), float("nan"), device=DEV)
    bias = torch.randn(n, device=DEV)
    desc = GemmDescriptor(m, n, k, "f32", epilogue="gelu_aux_bias", transb=True, has_c=True, device=DEV)
    plan = GemmPlan.select(desc, kp.PlanPreference.only("cublaslt"))
    plan.run(GemmArgs(a, b, d_buf[:, :n], c=c_buf[:, :n], bias=bias, aux=aux_buf[:, :n], beta=0.5))
    z = a.double() @ b.double().T + 0.5 * c_buf[:, :n].double() + bias.double()
    torch.testing.assert_close(aux_buf[:, :n].double(), z, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(d_buf[:, :n].double(), torch.nn.functional.gelu(z, approximate="tanh"),
                               rtol=1e-5, atol=1e-4)
    assert torch.isnan(d_buf[:, n:]).all() and torch.isnan(aux_buf[:, n:]).all(), "wrote past the views"


def test_linear_dispatches_to_cublaslt_with_3d_and_transposed_x():
    torch.manual_seed(2)
    w = torch.randn(96, 64, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(96, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(3, 64, 10, device=DEV, dtype=torch.bfloat16).transpose(1, 2)  # [3, 10, 64], strided
    y = kp.linear(x, w, bias, "gelu_bias")
    ref = torch.nn.functional.gelu(torch.nn.functional.linear(x.double(), w.double(), bias.double()),
                                   approximate="tanh")
    assert_close(y, ref, torch.nn.functional.gelu(torch.nn.functional.linear(x, w, bias), approximate="tanh"),
                 atol=FWD_ATOL[torch.bfloat16])
    plan = GemmPlan.select(GemmDescriptor(30, 96, 64, "bf16", epilogue="gelu_bias", transb=True, device=DEV))
    assert plan.sku.backend == "cublaslt"
    assert "tanh" in plan.precision_guarantee.note


def test_repeated_plain_linear_takes_the_bound_call(monkeypatch):
    """The fast path's bound call: no run() once planned and tuned, right for every layout, after a release too."""
    from kernelplan.gemm import cublaslt

    runs = []
    backend = GemmPlan.registry.get("cublaslt")
    monkeypatch.setattr(type(backend), "run", lambda self, *a, real=type(backend).run: runs.append(1) or real(self, *a))
    torch.manual_seed(4)
    w = torch.randn(96, 64, device=DEV, dtype=torch.bfloat16)
    bias = torch.randn(96, device=DEV, dtype=torch.bfloat16)
    strided_bias = torch.randn(96, 2, device=DEV, dtype=torch.bfloat16)[:, 0]  # run() copies it: never bound
    base = torch.randn(3, 11, 65, device=DEV, dtype=torch.bfloat16)
    cases = [(torch.randn(10, 64, device=DEV, dtype=torch.bfloat16), bias, True),
             (base[..., 1:], None, True),  # 3-D, rows 130 bytes apart, data 2 bytes off alignment
             (base[..., :64].transpose(0, 1), bias, True),
             (torch.randn(10, 64, device=DEV, dtype=torch.bfloat16), strided_bias, False)]
    with torch.no_grad():
        for x, b, bound in cases:
            for call in range(4):
                if call == 3:
                    cublaslt.release_plans()  # the bound call's plan is destroyed: it plans again
                runs.clear()
                y = kp.linear(x, w, b)
                ref = torch.nn.functional.linear(x.double(), w.double(), None if b is None else b.double())
                assert_close(y, ref, torch.nn.functional.linear(x, w, b), atol=FWD_ATOL[torch.bfloat16])
                assert y.shape == (*x.shape[:-1], 96)
                if call == 2:
                    assert (not runs) == bound, "a warm plain call launches from the bound call"


def test_bound_call_follows_a_changed_bias():
    """The bound call sets the bias pointer only when it changes: a new bias, or one run() set, must be used."""
    torch.manual_seed(5)
    w = torch.randn(96, 64, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(10, 64, device=DEV, dtype=torch.bfloat16)
    biases = [torch.randn(96, device=DEV, dtype=torch.bfloat16) for _ in range(2)]
    with torch.no_grad():
        for b in (biases[0], biases[0], biases[1], biases[0], biases[1], biases[1]):
            y = kp.linear(x, w, b)
            ref = torch.nn.functional.linear(x.double(), w.double(), b.double())
            assert_close(y, ref, torch.nn.functional.linear(x, w, b), atol=FWD_ATOL[torch.bfloat16])
    # A grad-enabled call runs through run(), which sets the same plan's bias pointer on its own.
    b = biases[1].clone().requires_grad_()
    kp.linear(x, w, b).sum().backward()
    with torch.no_grad():
        y = kp.linear(x, w, biases[0])
    assert_close(y, torch.nn.functional.linear(x.double(), w.double(), biases[0].double()),
                 torch.nn.functional.linear(x, w, biases[0]), atol=FWD_ATOL[torch.bfloat16])


def test_runs_on_the_current_stream_and_under_graph_capture():
    torch.manual_seed(3)
    x = torch.randn(64, 128, device=DEV, dtype=torch.float16)
    w = torch.randn(256, 128, device=DEV, dtype=torch.float16)
    b = torch.randn(256, device=DEV, dtype=torch.float16)
    kp.linear(x, w, b, "relu_bias")  # plan and tune outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):  # the plain call's third run is its fast path's bound call
            kp.linear(x, w, b, "relu_bias")
            with torch.no_grad():
                kp.linear(x, w, b)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            y = kp.linear(x, w, b, "relu_bias")
            with torch.no_grad():
                plain = kp.linear(x, w, b)
    torch.cuda.current_stream().wait_stream(side)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    z = torch.nn.functional.linear(x.float(), w.float(), b.float())
    torch.testing.assert_close(y.float(), torch.relu(z), rtol=2e-3, atol=2e-2)
    torch.testing.assert_close(plain.float(), z, rtol=2e-3, atol=2e-2)


_SECOND_PROCESS = """
import torch, kernelplan as kp
from kernelplan.gemm import cublaslt
def refuse(*a, **k):
    raise AssertionError("timed again although the plan cache holds the choice")
cublaslt._tune = refuse
x = torch.randn(512, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.randn(768, 1024, device="cuda", dtype=torch.bfloat16)
kp.linear(x, w)
print("ok")
"""


def test_tuned_algorithm_persists_for_a_new_process(tmp_path, monkeypatch):
    from kernelplan.gemm import cublaslt

    monkeypatch.setenv("KERNELPLAN_CACHE_DIR", str(tmp_path / "cache"))
    cublaslt.release_plans()
    x = torch.randn(512, 1024, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(768, 1024, device=DEV, dtype=torch.bfloat16)
    kp.linear(x, w)
    plan = next(iter(cublaslt._plans.values()))
    if len(plan.results) == 1:
        pytest.skip("the heuristic offered one algorithm: nothing was timed, nothing to persist")
    out = subprocess.run([sys.executable, "-c", _SECOND_PROCESS], capture_output=True, text=True,
                         env={**__import__("os").environ}, timeout=300)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr[-2000:]


def test_bare_cuda_descriptor_takes_tensors_on_the_current_device():
    """``device="cuda"`` means the current device, as in torch: its tensors report ``cuda:0``."""
    x = torch.randn(8, 32, device="cuda")
    w = torch.randn(16, 32, device="cuda")
    d = torch.empty(8, 16, device="cuda")
    plan = GemmPlan.select(GemmDescriptor(8, 16, 32, "f32", transb=True, device="cuda"))
    plan.run(GemmArgs(x, w, d))
    torch.testing.assert_close(d, x @ w.T)


def test_workspace_hint_is_used_or_refused_before_writing():
    from kernelplan.gemm import cublaslt

    cublaslt.release_plans()  # so that the one plan left below is this problem's
    m, n, k = 128, 128, 65536  # small m and n over a long k: split-k algorithms, which need a workspace
    x = torch.randn(m, k, device=DEV, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=DEV, dtype=torch.bfloat16)
    desc = GemmDescriptor(m, n, k, "bf16", transb=True, device=DEV)
    plan = GemmPlan.select(desc, kp.PlanPreference.only("cublaslt"))
    d = torch.empty(m, n, device=DEV, dtype=torch.bfloat16)
    plan.run(GemmArgs(x, w, d), workspace=torch.empty(64 << 20, dtype=torch.uint8, device=DEV))
    torch.testing.assert_close(d.float(), x.float() @ w.float().T, rtol=2e-2, atol=2.0)
    d2 = poisoned((m, n), torch.bfloat16, DEV)
    with pytest.raises(kp.InvalidProblem, match="workspace is on cpu"):
        plan.run(GemmArgs(x, w, d2), workspace=torch.empty(64 << 20, dtype=torch.uint8))
    (needed,) = [p.workspace for p in cublaslt._plans.values()]
    if needed == 0:
        pytest.skip("the chosen algorithm uses no workspace: nothing to refuse")
    with pytest.raises(kp.WorkspaceTooSmall, match="cuBLASLt algorithm chosen"):
        plan.run(GemmArgs(x, w, d2), workspace=torch.empty(1, dtype=torch.uint8, device=DEV))
    assert torch.isnan(d2).all()
