"""``kernelplan bench sparse24``: the 2:4 linear beside dense ``F.linear`` and torch's 2:4 path.

Every case times, in one process on the same inputs, ``kernelplan.sparse24.linear``
(dispatch as users get it: tuned once per N bucket, then the stored choice),
dense ``F.linear`` on the pruned weight, and ``torch.sparse.to_sparse_semi_structured``
where torch can build it.  It checks kernelplan against an fp64 oracle at the
bar of the test suite, and reports the host time per call at a small shape.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan
from kernelplan.timing import host_report, host_report_line, interleaved

LLAMA = [(4096, 4096), (14336, 4096), (4096, 14336), (8192, 8192), (28672, 8192), (8192, 28672)]  # (M, K)
NS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
_ATOL = {torch.bfloat16: 1e-3, torch.float16: 1e-3, torch.float32: 1e-3}  # the floor


@dataclass
class SparseRow:
    m: int
    k: int
    n: int
    dtype: str
    backend: str
    kp_ms: float
    dense_ms: float
    torch24_ms: float | None  # None: torch could not build or run its 2:4 tensor here
    speedup: float  # dense_ms / kp_ms
    torch24_speedup: float | None
    err: float
    dense_err: float
    ok: bool


def _rel(out, oracle) -> float:
    return float((out.double() - oracle).abs().max() / oracle.abs().max().clamp_min(1e-30))


def _torch24(w: torch.Tensor):
    try:
        from torch.sparse import to_sparse_semi_structured

        return to_sparse_semi_structured(w)
    except Exception as e:  # sm90 without cuSPARSELt, an unsupported dtype or shape: report, don't stop
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


def _cases(dev):
    if dev.type == "cuda":
        # KERNELPLAN_BENCH_DTYPES=bf16 runs one dtype: tuning every bucket makes both ~10 minutes.
        names = os.environ.get("KERNELPLAN_BENCH_DTYPES", "bf16,f16").split(",")
        return LLAMA, NS, tuple(kp.dtypes.dtype_info(name.strip(), "KERNELPLAN_BENCH_DTYPES").dtype for name in names)
    return [(256, 512)], [1, 16, 128], (torch.float32,)


def host_overhead_us(dev) -> dict:
    """Host work per call of kernelplan and F.linear, and their back-to-back wall time (``timing.host_report``)."""
    (n, m, k), calls = ((16, 4096, 4096), 200) if dev.type == "cuda" else ((16, 256, 512), 20)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = kp.sparse24.prune(torch.randn(m, k, device=dev)).to(dtype)
    w24, x = kp.sparse24.compress(w), torch.randn(n, k, device=dev, dtype=dtype)
    with torch.no_grad():
        out = host_report({"kernelplan": lambda: kp.sparse24.linear(x, w24), "F.linear": lambda: F.linear(x, w)},
                          dev, calls)
    return {"shape": [n, m, k], **out}


def run(dev: torch.device) -> tuple[list[dict], bool]:
    from .gated import _timer

    timed = _timer(dev)
    shapes, ns, dtypes = _cases(dev)
    torch.manual_seed(0)
    rows: list[SparseRow] = []
    notes: dict[str, str] = {}
    memory: dict[str, dict] = {}
    print(f"\nsparse24: kernelplan.sparse24.linear (tuned dispatch) vs dense F.linear and torch's 2:4 on {dev}")
    if dev.type == "cpu":
        print("CPU: the reference backend; times support no speed claim")
    for dtype in dtypes:
        for m, k in shapes:
            w = kp.sparse24.prune(torch.randn(m, k, device=dev)).to(dtype)
            w24 = kp.sparse24.compress(w)
            w_torch24 = _torch24(w) if dev.type == "cuda" else "CPU run"
            if isinstance(w_torch24, str):
                notes[f"{m}x{k} {dtype}"] = w_torch24
            for n in ns:
                x = torch.randn(n, k, device=dev, dtype=dtype)
                y = kp.sparse24.linear(x, w24)  # the first call of a bucket tunes it
                oracle = F.linear(x.double(), w.double())
                err, dense_err = _rel(y, oracle), _rel(F.linear(x, w), oracle)
                del oracle, y
                desc = GemmSparse24Descriptor(n, m, k, kp.dtypes.dtype_info(dtype).name, device=str(x.device))
                backend = GemmSparse24Plan.select(desc).sku.backend
                # Three alternating rounds: one timing each put a row whose dispatch chose F.linear
                # itself at 0.75x of F.linear (H100, 4096x4096 n = 1024, 64.7 against 48.7 us).
                both = interleaved({"kp": lambda: timed(lambda: kp.sparse24.linear(x, w24)),
                                    "dense": lambda: timed(lambda: F.linear(x, w))}, rounds=3)
                kp_ms, dense_ms = both["kp"], both["dense"]
                t24 = None
                if not isinstance(w_torch24, str):
                    try:
                        t24 = timed(lambda: F.linear(x, w_torch24))
                    except Exception as e:  # some n are refused by torch's kernels
                        notes[f"{m}x{k} n={n} {dtype}"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                rows.append(SparseRow(
                    m, k, n, str(dtype).replace("torch.", ""), backend, kp_ms, dense_ms, t24,
                    dense_ms / kp_ms, dense_ms / t24 if t24 else None, err, dense_err,
                    err <= 2 * dense_err + _ATOL[dtype],
                ))
                print(_line(rows[-1]), flush=True)
            memory[f"{m}x{k} {kp.dtypes.dtype_info(dtype).name}"] = held = _held(w, w24)
            print(_memory_line(m, k, held), flush=True)
    overhead = host_overhead_us(dev)
    print(host_report_line(overhead, f"n={overhead['shape'][0]}, {overhead['shape'][1]}x{overhead['shape'][2]}"))
    for what, why in notes.items():
        print(f"torch 2:4 unavailable for {what}: {why}")
    result = [asdict(r) for r in rows]
    return [{"host_overhead_us": overhead, "torch24_notes": notes, "memory": memory}] + result, all(r.ok for r in rows)


def _held(w: torch.Tensor, w24) -> dict:
    """What the 2:4 weight holds after every n ran through dispatch: its format, and each backend layout built."""
    return {"dense_bytes": w.nbytes, "format_bytes": w24.values.nbytes + w24.metadata.nbytes,
            "derived_bytes": w24.derived_bytes()}


def _memory_line(m: int, k: int, held: dict) -> str:
    dense = held["dense_bytes"]
    derived = held["derived_bytes"]
    total = held["format_bytes"] + sum(derived.values())
    parts = ", ".join(f"{key} {b / dense:.2f}" for key, b in sorted(derived.items(), key=lambda kv: -kv[1]))
    return (f"  {m}x{k}: the 2:4 weight holds {total / dense:.2f}x of dense bytes after every n: "
            f"format {held['format_bytes'] / dense:.2f}" + (f", {parts}" if parts else ""))


def _line(r: SparseRow) -> str:
    t24 = f"{r.torch24_speedup:5.2f}x" if r.torch24_speedup else "    -"
    return (f"{r.m:6}x{r.k:<6} n={r.n:<5} {r.dtype:9} {r.backend:9} kp {r.kp_ms * 1e3:9.1f} us  "
            f"dense {r.dense_ms * 1e3:9.1f} us  kp {r.speedup:5.2f}x  torch 2:4 {t24}  err {r.err:.1e} "
            f"{'ok' if r.ok else 'NO'}")


def plot(rows: list[dict], path: str) -> None:
    """Speedup over dense against n, one line per shape and implementation."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [r for r in rows if "m" in r]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, dtype in zip(axes, ("bfloat16", "float16")):
        for m, k in sorted({(r["m"], r["k"]) for r in cases}):
            sel = sorted((r for r in cases if (r["m"], r["k"]) == (m, k) and r["dtype"] == dtype), key=lambda r: r["n"])
            if not sel:
                continue
            line, = ax.plot([r["n"] for r in sel], [r["speedup"] for r in sel], marker="o", label=f"kernelplan {m}x{k}")
            t24 = [(r["n"], r["torch24_speedup"]) for r in sel if r["torch24_speedup"]]
            if t24:
                ax.plot(*zip(*t24), linestyle="--", color=line.get_color(), alpha=0.5)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (rows of x)")
        ax.set_title(f"{dtype}: speedup over dense F.linear (dashed: torch 2:4)")
    axes[0].set_ylabel("dense time / time")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
