"""The Triton gated-activation kernels against the fp64 oracle.

On CPU they run under the Triton interpreter (the README's test command sets
TRITON_INTERPRET=1); on a GPU the same tests run compiled, and the ``gpu``
tests add bf16, f64, 64-bit indexing and torch.compile with inductor.
"""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp
from helpers import BWD_ATOL, FWD_ATOL, assert_close, poisoned
from kernelplan.errors import InvalidProblem
from kernelplan.gated import (
    GatedActivationArgs,
    GatedActivationBackwardArgs,
    GatedActivationBackwardPlan,
    GatedActivationPlan,
    _descriptor,
)
from kernelplan.kernels import interpreting
from opinfo import _gated_reference

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEV == "cpu" and not interpreting(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
TRITON = kp.PlanPreference.only("triton")
VARIANTS = [("glu", "none"), ("reglu", "none"), ("swiglu", "none"), ("geglu", "none"), ("geglu", "tanh")]


def _layouts(dtype):
    """(description, x, split dim): ranks 1-8, every split position, strides of every sort."""
    r = lambda *s: torch.randn(*s, device=DEV).to(dtype)  # noqa: E731
    return [
        ("2-D last dim, several tiles", r(70, 300), -1),
        ("3-D middle dim", r(3, 6, 5), 1),
        ("4-D first dim", r(4, 3, 2, 5), 0),
        ("1-D", r(10), 0),
        ("rank 8", r(1, 2, 1, 2, 3, 1, 2, 4), 7),
        ("rank 8, nothing merges", r(2, 2, 2, 2, 2, 2, 2, 4).permute(7, 5, 3, 1, 0, 2, 4, 6), 0),
        ("transposed input", r(300, 130).t(), -1),
        ("strided input", r(6, 40)[:, ::2], -1),
        ("permuted 4-D", r(4, 6, 8, 10).permute(2, 0, 3, 1), 1),
        ("split along dim 1 of [B, 2H, 8]", r(16, 2 * 24, 8), 1),
        ("odd sizes", r(7, 2, 9), 1),
    ]


def _run(x, kind, dim, gate, approximate, y=None, dx=None, dy=None):
    """Forward and backward through the Triton plans into (poisoned) outputs."""
    desc = _descriptor(x, kind, dim % x.dim(), gate, approximate)
    y = poisoned(desc.output_shape(), x.dtype, DEV) if y is None else y
    fwd = GatedActivationPlan.select(desc, TRITON)
    fwd.run(GatedActivationArgs(x, y))
    dy = torch.randn(desc.output_shape(), device=DEV).to(x.dtype) if dy is None else dy
    dx = poisoned(x.shape, x.dtype, DEV) if dx is None else dx
    GatedActivationBackwardPlan.select(desc, TRITON).run(GatedActivationBackwardArgs(dy, x, dx))
    assert fwd.sku.backend == "triton"
    return y, dy, dx


def _check(x, kind, dim, gate, approximate, y, dy, dx):
    x64 = x.detach().double().requires_grad_(True)
    oracle = _gated_reference(x64, kind, dim, gate, approximate)
    (oracle_dx,) = torch.autograd.grad(oracle, x64, dy.double())
    xb = x.detach().clone().requires_grad_(True)
    baseline = _gated_reference(xb, kind, dim, gate, approximate)
    (baseline_dx,) = torch.autograd.grad(baseline, xb, dy)
    assert_close(y, oracle, baseline, atol=FWD_ATOL[x.dtype], what="y")
    assert_close(dx, oracle_dx, baseline_dx, atol=BWD_ATOL[x.dtype], what="dx")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("gate", ["second", "first"])
@pytest.mark.parametrize("kind, approximate", VARIANTS)
def test_every_kind_and_gate(kind, approximate, gate, dtype, seed):
    # f16 takes a shape the tiles divide (the unmasked EVEN variant), f32 one they do not.
    shape = (32, 2 * 64) if dtype == torch.float16 else (33, 2 * 40)
    x = torch.randn(shape, device=DEV).to(dtype) * 3
    _check(x, kind, -1, gate, approximate, *_run(x, kind, -1, gate, approximate))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("case", range(len(_layouts(torch.float32))), ids=[d for d, _, _ in _layouts(torch.float32)])
def test_layouts(case, dtype, seed):
    desc, x, dim = _layouts(dtype)[case]
    kind, approximate = VARIANTS[case % len(VARIANTS)]
    gate = ("second", "first")[case % 2]
    _check(x, kind, dim, gate, approximate, *_run(x, kind, dim, gate, approximate))


def test_strided_outputs_and_only_their_elements_are_written(seed):
    x = torch.randn(12, 2 * 20, device=DEV)
    y_buf = poisoned((12, 2 * 20), torch.float32, DEV)
    dx_buf = poisoned((2 * 40, 12), torch.float32, DEV)  # dx written through a transposed view
    y, dx = y_buf[:, ::2], dx_buf.t()[:, ::2]
    _check(x, "geglu", -1, "first", "none", *_run(x, "geglu", -1, "first", "none", y=y, dx=dx))
    assert torch.isnan(y_buf[:, 1::2]).all() and torch.isnan(dx_buf[1::2]).all()


def test_64_bit_indexing_path(monkeypatch, seed):
    """The INT64 variant (taken above 2**31 elements) computes the same; forced here on a small tensor."""
    import kernelplan.kernels.gated as kernels

    monkeypatch.setattr(kernels, "_needs_int64", lambda *a: True)
    kernels._launch_params.cache_clear()  # launch parameters are memoised per problem
    try:
        x = torch.randn(30, 3, 40, device=DEV)[:, 1:]
        _check(x, "swiglu", 2, "second", "none", *_run(x, "swiglu", 2, "second", "none"))
    finally:
        kernels._launch_params.cache_clear()


def test_needs_int64_counts_masked_lanes_and_the_half_offset():
    from kernelplan.kernels.gated import Layout, _needs_int64

    # x rows of 4096 elements: the last real row starts at 2**31 - 8192, its end is below 2**31 - 1.
    rows = Layout(sizes=(2**19 - 1, 2040), strides=((4096, 1), (4096, 1), (2040, 1)))
    assert not _needs_int64(rows, (0, 0), (1, 8))
    assert _needs_int64(rows, (0, 0), (16, 8))  # the last tile's masked rows reach past 2**31
    assert _needs_int64(rows, (2**20, 0), (1, 8))  # so does the second half of x


def test_collapse_merges_what_is_contiguous_everywhere():
    from kernelplan.kernels.gated import collapse

    # [2048, 4096, 8] output of a split along dim 1 of [2048, 8192, 8]: dims 1 and 2 merge.
    lay = collapse((2048, 4096, 8), [(8192 * 8, 8, 1), (4096 * 8, 8, 1), (4096 * 8, 8, 1)])
    assert lay.sizes == (2048, 4096 * 8)
    # Transposed x: R is the dim x is contiguous along, C the output's.
    lay = collapse((64, 32), [(1, 64), (32, 1), (32, 1)])
    assert lay.sizes == (64, 32) and lay.strides[0] == (1, 64)


def test_functional_and_autograd_dispatch_to_the_measured_backend(seed):
    x = torch.randn(5, 3, 2 * 16, device=DEV, requires_grad=True)
    desc = _descriptor(x, "swiglu", 2, "first", "none")
    expected = "triton" if DEV == "cuda" else "reference"
    assert GatedActivationPlan.select(desc).sku.backend == expected
    for plan in (GatedActivationPlan, GatedActivationBackwardPlan):  # a fake timing table
        plan.remember_fastest(desc, {"triton": 1e-6, "reference": 1e-3})
    assert GatedActivationPlan.select(desc).sku.backend == "triton"
    y = kp.gated_activation(x, "swiglu", dim=-1, gate="first")
    dy = torch.randn_like(y)
    y.backward(dy)
    _check(x.detach(), "swiglu", -1, "first", "none", y.detach(), dy, x.grad)


def test_cpu_without_interpreter_is_refused_with_a_reason(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    desc = _descriptor(torch.randn(4, 6), "glu", 1, "second", "none")
    with pytest.raises(kp.Unsupported, match=r"triton: device cpu: Triton kernels run on CUDA"):
        GatedActivationPlan.select(desc, TRITON)
    assert GatedActivationPlan.select(desc).sku.backend == "reference"


# -- out= -----------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_forms_write_out_and_return_it(backend, seed):
    x = torch.randn(6, 2 * 8, device=DEV)
    desc = _descriptor(x, "geglu", 1, "second", "none")
    for plan in (GatedActivationPlan, GatedActivationBackwardPlan):
        plan.remember_fastest(desc, {backend: 1e-6})
    y = poisoned((8, 6), torch.float32, DEV).t()
    assert kp.gated_activation(x, "geglu", out=y) is y
    dy = torch.randn(6, 8, device=DEV)
    dx = poisoned((6, 16), torch.float32, DEV)
    assert kp.gated_activation_backward(dy, x, "geglu", out=dx) is dx
    _check(x, "geglu", -1, "second", "none", y, dy, dx)


def _out_errors():
    x = torch.randn(4, 6, device=DEV)
    dy = torch.randn(4, 3, device=DEV)
    buf = torch.randn(4, 6, device=DEV)
    ga, gab = kp.gated_activation, kp.gated_activation_backward
    return [
        ("out aliases x", lambda: ga(x, "glu", out=x[:, :3]), x[:, :3], r"y shares memory with x"),
        ("dx out aliases x", lambda: gab(dy, x, "glu", out=x), x, r"dx shares memory with x"),
        ("dx out aliases dy", lambda: gab(buf[:, :3], x, "glu", out=buf), buf, r"dx shares memory with dy"),
        ("out wrong shape", lambda: ga(x, "glu", out=poisoned((4, 4), torch.float32, DEV)), None, r"y has shape \(4, 4\).*\(4, 3\)"),
        ("out too small", lambda: ga(x, "glu", out=poisoned((2, 3), torch.float32, DEV)), None, r"y .* holds 6 .* 12 are needed"),
        ("out dtype", lambda: ga(x, "glu", out=torch.empty(4, 3, device=DEV).half()), None, r"y has dtype torch.float16"),
        ("out overlaps itself", lambda: ga(x, "glu", out=torch.empty(4, 1, device=DEV).expand(4, 3)), None,
         r"y has shape \(4, 3\) and strides \(1, 0\).*share memory"),
        ("out with grad", lambda: ga(x.clone().requires_grad_(), "glu", out=torch.empty(4, 3, device=DEV)), None,
         r"out= was given but x requires grad"),
    ]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("case", range(len(_out_errors())), ids=[c[0] for c in _out_errors()])
def test_out_errors_write_nothing(case, backend):
    _, call, watched, match = _out_errors()[case]
    desc = _descriptor(torch.empty(4, 6, device=DEV), "glu", 1, "second", "none")
    for plan in (GatedActivationPlan, GatedActivationBackwardPlan):
        plan.remember_fastest(desc, {backend: 1e-6})
    before = watched.clone() if watched is not None else None
    with pytest.raises(InvalidProblem, match=match):
        call()
    if watched is not None:
        assert torch.equal(watched, before), "a refused call wrote into its input"


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_geglu_keeps_relative_accuracy_in_the_tails(approximate):
    """fp32 GeGLU elementwise, not just against the largest value, out to |z| = 9.

    The bound grows with z^2 because fp32 rounding of the argument of exp(-z^2/2)
    is relative to z^2; torch's fp32 F.gelu, by contrast, is 100% off below z = -6.
    """
    z = torch.linspace(-9, 9, 4001, device=DEV)
    x = torch.stack([z, torch.ones_like(z)], dim=1)  # gate="first": y = gelu(z) * 1
    y, dy, dx = _run(x, "geglu", 1, "first", approximate, dy=torch.ones(4001, 1, device=DEV))
    z64 = z.double().requires_grad_()
    # Not F.gelu: its 1 + erf(z) (1 + tanh) cancels to nothing below z = -8 even in fp64.
    if approximate == "tanh":
        want = z64 * torch.sigmoid(2 * (2 / torch.pi) ** 0.5 * (z64 + 0.044715 * z64**3))
    else:
        want = z64 * 0.5 * torch.special.erfc(-z64 / 2**0.5)
    (want_grad,) = torch.autograd.grad(want.sum(), z64)
    z_d = z.double()
    # gelu' = Phi(z) + z phi(z) crosses zero near z = -0.75: measure it against its terms' size there.
    terms = want_grad.detach().abs() + z_d.abs() * torch.exp(-z_d**2 / 2) / (2 * torch.pi) ** 0.5
    for got, ref, scale, c, what in ((y[:, 0], want, want.detach().abs(), 5e-7, "gelu"),
                                     (dx[:, 0], want_grad, terms, 1e-6, "gelu'")):
        keep = scale > 1e-30
        rel = ((got.double() - ref.detach()).abs() / scale / (1 + z_d**2))[keep]
        assert rel.max() < c, f"{what}: relative error / (1 + z^2) {rel.max():.2e} at z={z[keep][rel.argmax()]:.2f}"


# bf16 only compiled: the interpreter's bf16 conversions are not IEEE rounding.
@pytest.mark.parametrize("dtype", [torch.float16] + ([torch.bfloat16] if DEV == "cuda" else []), ids=str)
def test_16_bit_geglu_is_within_half_an_ulp_and_its_erfc_fit(dtype):
    """f16/bf16 GeGLU takes a cheaper erfc (fractional error < 6.4e-5): elementwise, in the tails too.

    Every normal result must be within half an ulp of the exact GELU plus that
    fit error; 1 + erf in fp32 already fails this near z = -4.
    """
    z = torch.linspace(-9, 9, 4001, device=DEV).to(dtype)
    x = torch.stack([z, torch.ones_like(z)], dim=1)
    y, _, _ = _run(x, "geglu", 1, "first", "none", dy=torch.ones(4001, 1, device=DEV, dtype=dtype))
    z64 = z.double()
    want = z64 * 0.5 * torch.special.erfc(-z64 / 2**0.5)
    normal = want.abs() >= torch.finfo(dtype).tiny
    rel = ((y[:, 0].double() - want).abs() / want.abs())[normal]
    bound = torch.finfo(dtype).eps / 2 + 6.4e-5 + 1e-6  # + fp32 evaluation
    assert rel.max() <= bound, f"relative error {rel.max():.2e} at z={z[normal][rel.argmax()]:.2f}; bound {bound:.2e}"
