"""``kernelplan bench gated``: gated activations against torch eager and torch.compile.

Every case runs kernelplan, the eager torch composite and the same composite
under ``torch.compile`` on the same inputs, in one process, and reports TB/s
against the copy bandwidth measured in the same run.  Bytes count each
kernel's tensors read once and written once: forward reads x and writes y;
forward + backward adds the backward kernel's x, dy and dx (x is read twice
because only x is saved).  The same bytes are used for all three, so the
ratios are ratios of times.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.gated import GatedActivationPlan, _descriptor
from kernelplan.plan import memoised_select

_ACT = {"glu": torch.sigmoid, "reglu": F.relu, "swiglu": F.silu, "geglu": F.gelu}
# The bar of the test suite: within 2x torch's own error plus a floor, relative to max |oracle|.
_ATOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}


@dataclass
class GatedRow:
    case: str
    kind: str
    dtype: str
    direction: str  # "fwd" or "fwd+bwd"
    backend: str
    gbytes: float
    kp_ms: float
    eager_ms: float
    compile_ms: float | None
    kp_tbps: float
    eager_tbps: float
    compile_tbps: float | None
    copy_tbps: float
    of_copy: float  # kp_tbps / copy_tbps
    vs_eager: float  # eager_ms / kp_ms
    vs_compile: float | None
    err: float
    torch_err: float
    ok: bool


def _composite(kind: str, dim: int) -> Callable:
    act = _ACT[kind]

    def f(x):
        g, v = x.chunk(2, dim=dim)
        return act(g) * v

    return f


def _cases(dev: torch.device):
    """(name, kind, x, dim) in the issue's order; small shapes on CPU."""
    gpu = dev.type == "cuda"
    rows, cols = (8192, 28672) if gpu else (64, 512)
    dtypes = (torch.bfloat16, torch.float16) if gpu else (torch.float32,)
    for dtype in dtypes:
        for kind in ("swiglu", "geglu", "reglu", "glu"):
            yield f"[{rows}, {cols}] dim -1", kind, torch.randn(rows, cols, device=dev, dtype=dtype), -1
    bf16 = torch.bfloat16 if gpu else torch.float32
    shape3 = (4, 2048, 28672) if gpu else (2, 16, 512)
    yield f"3-D {list(shape3)} dim -1", "swiglu", torch.randn(shape3, device=dev, dtype=bf16), -1
    mid = (2048, 2 * 4096, 8) if gpu else (32, 64, 8)
    yield f"{list(mid)} dim 1 (strided halves)", "swiglu", torch.randn(mid, device=dev, dtype=bf16), 1
    yield (f"transposed [{cols}, {rows}].t() dim -1", "swiglu",
           torch.randn(cols, rows, device=dev, dtype=bf16).t(), -1)


def _timer(dev: torch.device) -> Callable[[Callable], float]:
    if dev.type == "cuda":
        import triton.testing

        return lambda fn: triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")
    from . import _time_ms

    return lambda fn: _time_ms(fn, dev)


def _rel(out, oracle) -> float:
    return float((out.double() - oracle).abs().max() / oracle.abs().max().clamp_min(1e-30))


def _measure(name, kind, x, dim, direction, dev, timed, copy_tbps, use_compile) -> GatedRow:
    composite = _composite(kind, dim)
    desc = _descriptor(x, kind, dim % x.dim(), "first", "none")
    backend = memoised_select(GatedActivationPlan, desc).sku.backend
    ours = lambda t: kp.gated_activation(t, kind, dim=dim, gate="first")  # noqa: E731
    compiled = None
    if use_compile:
        torch._dynamo.reset()  # a fresh cache per case: no recompile limit, no dynamic shapes
        compiled = torch.compile(composite, dynamic=False)
    n_out = x.numel() // 2 * x.element_size()
    x64 = x.double().requires_grad_(direction == "fwd+bwd")
    oracle = composite(x64)

    if direction == "fwd":
        gbytes = 3 * n_out / 1e9
        run = lambda f: (lambda: f(x))  # noqa: E731
        ours_out, eager_out = ours(x), composite(x)
        err, torch_err = _rel(ours_out, oracle.detach()), _rel(eager_out, oracle.detach())
        del ours_out, eager_out
    else:
        gbytes = (3 + 5) * n_out / 1e9
        xr = x.detach().requires_grad_(True)
        dy = torch.randn(oracle.shape, device=dev, dtype=x.dtype)

        def run(f):
            return lambda: torch.autograd.grad(f(xr), xr, dy)

        (dx64,) = torch.autograd.grad(oracle, x64, dy.double())
        err, torch_err = _rel(run(ours)()[0], dx64), _rel(run(composite)()[0], dx64)
        del dx64
    del oracle, x64
    kp_ms, eager_ms = timed(run(ours)), timed(run(composite))
    compile_ms = timed(run(compiled)) if compiled is not None else None
    tbps = lambda ms: gbytes / ms  # GB per ms is TB per s  # noqa: E731
    return GatedRow(
        case=name,
        kind=kind,
        dtype=str(x.dtype).replace("torch.", ""),
        direction=direction,
        backend=backend,
        gbytes=gbytes,
        kp_ms=kp_ms,
        eager_ms=eager_ms,
        compile_ms=compile_ms,
        kp_tbps=tbps(kp_ms),
        eager_tbps=tbps(eager_ms),
        compile_tbps=tbps(compile_ms) if compile_ms else None,
        copy_tbps=copy_tbps,
        of_copy=tbps(kp_ms) / copy_tbps,
        vs_eager=eager_ms / kp_ms,
        vs_compile=compile_ms / kp_ms if compile_ms else None,
        err=err,
        torch_err=torch_err,
        ok=err <= 2 * torch_err + _ATOL[x.dtype],
    )


def copy_bandwidth(dev: torch.device, timed, nbytes: int) -> float:
    """TB/s of ``dst.copy_(src)``: the ceiling an elementwise kernel is measured against."""
    src = torch.empty(nbytes // 2, device=dev, dtype=torch.bfloat16).normal_()
    dst = torch.empty_like(src)
    return 2 * nbytes / 1e9 / timed(lambda: dst.copy_(src))


def run(dev: torch.device) -> tuple[list[dict], bool]:
    timed = _timer(dev)
    use_compile = dev.type == "cuda"  # inductor on CPU needs a C++ toolchain CI machines lack
    torch.manual_seed(0)
    rows: list[GatedRow] = []
    copy_tbps = None
    for name, kind, x, dim in _cases(dev):
        if copy_tbps is None:
            copy_tbps = copy_bandwidth(dev, timed, x.numel() * x.element_size())
        for direction in ("fwd", "fwd+bwd"):
            rows.append(_measure(name, kind, x, dim, direction, dev, timed, copy_tbps, use_compile))
        del x
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    _print(rows, dev)
    return [asdict(r) for r in rows], all(r.ok for r in rows)


def _print(rows: list[GatedRow], dev: torch.device) -> None:
    print(f"\ngated activations, gate='first'; copy bandwidth {rows[0].copy_tbps:.2f} TB/s in this run")
    if dev.type == "cpu":
        print("CPU: the reference backend and no torch.compile; times support no speed claim")
    head = (f"{'case':36} {'kind':6} {'dtype':8} {'dir':7} {'kp TB/s':>7} {'%copy':>6} {'eager':>6} "
            f"{'compile':>7} {'vs eager':>8} {'vs comp':>7} {'err':>8} ok")
    print(head)
    print("-" * len(head))
    for r in rows:
        comp = f"{r.compile_tbps:7.2f}" if r.compile_tbps else f"{'-':>7}"
        vs_comp = f"{r.vs_compile:7.2f}" if r.vs_compile else f"{'-':>7}"
        print(f"{r.case:36} {r.kind:6} {r.dtype:8} {r.direction:7} {r.kp_tbps:7.2f} {100 * r.of_copy:5.1f}% "
              f"{r.eager_tbps:6.2f} {comp} {r.vs_eager:8.2f} {vs_comp} {r.err:8.1e} {'yes' if r.ok else 'NO'}")
