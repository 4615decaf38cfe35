"""``kernelplan bench``: correctness and timing of every op, beside the torch baseline.

Each case runs kernelplan and the same-dtype torch composite on the same
inputs, reports the error of both against an fp64 oracle, and their median
times.  On CPU the shapes are small and the times only show the reference's
overhead; on a GPU, times come from ``triton.testing.do_bench`` (median).
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from ..gemm import linear
from ..timing import host_report, host_report_line, interleaved
from .cases import SUITES
from .results import gpu_attributes


@dataclass
class Row:
    suite: str
    case: str
    dtype: str
    backend: str
    err: float  # max |out - oracle| / max |oracle|
    torch_err: float  # the same for the torch baseline in the same dtype
    kp_ms: float
    torch_ms: float
    ok: bool
    floor_ms: dict | None = None  # the case's GEMMs alone, by whose GEMMs (Case.floors), where it has them


def _time_ms(fn, device: torch.device) -> float:
    if device.type == "cuda":
        import triton.testing

        return triton.testing.do_bench(fn, return_mode="median")
    fn()  # warm-up: plan selection and allocator
    samples = []
    for _ in range(7):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(samples)


def _rel_err(out: torch.Tensor, oracle: torch.Tensor) -> float:
    scale = oracle.abs().max().clamp_min(1e-30)
    return float((out.double() - oracle).abs().max() / scale)


def run_bench(suite: str = "all", device: str | None = None, json_path: str | None = None) -> int:
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from . import accuracy, gated, llama, sparse24

    runners = {"sparse24": sparse24.run, **{name: (lambda d, name=name: _run_cases(name, d)) for name in SUITES},
               "gated": gated.run}
    extra = {"llama": llama.run, "accuracy": accuracy.bench}  # need transformers: by name only, never in "all"
    names = list(runners) if suite == "all" else [suite]
    runners.update(extra)
    unknown = [n for n in names if n not in runners]
    if unknown:
        print(f"unknown suite {unknown[0]!r}; choose one of: all, {', '.join(runners)}")
        return 2
    results, ok = {}, True
    for name in names:
        results[name], good = runners[name](dev)
        ok = ok and good
    if json_path:
        env = environment(dev)
        if "sparse24" in results and dev.type == "cuda":
            env["cusparselt"] = torch.backends.cusparselt.version()
        with open(json_path, "w") as f:
            json.dump({**env, "suites": results}, f, indent=1)
        if "sparse24" in results:
            _plot(results["sparse24"], json_path.removesuffix(".json") + ".png")
    return 0 if ok else 1


def run_sweep_command(device: str | None, dtype: str, quick: bool, json_path: str | None, l2: str = "cold",
                      batch: list[int] | None = None, shape_set: str = "sweep set", shapes: dict | None = None,
                      shapes_from: str | None = None, skipped: list | None = None) -> int:
    """``kernelplan bench sparse24 --sweep``: the sweep, its JSON and PNG, and its summary; 1 if a result was wrong.
    ``batch``: these batch sizes instead of the sweep's (a part of a sweep too long for one run; ``--merge``).
    ``shape_set``: the sweep set, or the same models' LM heads (``sweep.SHAPE_SETS``), or ``"given"``: ``shapes``,
    ``{(M, K): [layer names]}``, which came from ``shapes_from`` (``--model DIR``, ``--shapes FILE``), where the
    layers ``skipped`` were left out (the JSON says which and why)."""
    from . import sweep

    dev = torch.device(device or "cuda")
    t0 = time.time()
    sizes = batch or (sweep.QUICK_BATCH_SIZES if quick else sweep.BATCH_SIZES)
    head = {**environment(dev), "dtype": dtype, "timing": sweep.TIMING, "l2": l2, "l2_means": sweep.L2_MEANS[l2],
            "shape_set": shape_set, **({"shapes_from": shapes_from, "skipped": skipped or []} if shapes_from else {})}
    path = json_path or f"{sweep.default_name(torch.cuda.get_device_name(dev), dtype, l2, shape_set)}.json"
    shapes = sweep.SHAPE_SETS[shape_set]() if shapes is None else shapes
    partial = path + ".partial"

    def done(rows: list[dict]) -> None:
        # A run cut off by a time limit keeps what it timed (a sweep's JSON is written at its end): merge refuses it.
        timed = len({(r["m"], r["k"]) for r in rows})
        doc = {**head, "rows": rows, "batch_sizes": sorted(sizes),
               "cut_short": f"{timed} of {len(shapes)} shapes timed at n = {', '.join(map(str, sizes))}"}
        with open(partial, "w") as f:
            json.dump(doc, f, indent=1)

    rows = sweep.run_sweep(dev, {"bf16": torch.bfloat16, "f16": torch.float16}[dtype], sizes, shapes=shapes,
                           log=lambda line: print(line, flush=True), l2=l2, done=done)
    doc = {**head, "rows": rows, "batch_sizes": sorted({r["n"] for r in rows if "n" in r})}
    status = _write_sweep(doc, path)
    if os.path.exists(partial):
        os.remove(partial)
    print(f"wrote {path} in {time.time() - t0:.0f} s")
    return status


def merge_sweep_command(paths: list[str], json_path: str | None) -> int:
    """``kernelplan bench sparse24 --sweep --merge A.json B.json ...``: one sweep from runs over disjoint batch
    sizes, with its summary and PNG; no GPU needed.  2 if the parts do not make one sweep."""
    from . import sweep

    try:
        parts = []
        for path in paths:
            try:
                with open(path) as f:
                    parts.append((path, json.load(f)))
            except (OSError, ValueError) as exc:  # ValueError: not JSON, or cut short
                raise ValueError(f"{path} could not be read as a sweep's JSON ({exc})") from exc
        doc = sweep.merge(parts)
    except ValueError as exc:
        print(f"kernelplan bench --merge: {exc}", file=sys.stderr)
        return 2
    path = json_path or f"{sweep.default_name(doc['device'], doc['dtype'], doc['l2'], sweep.shape_set_of(doc))}.json"
    status = _write_sweep(doc, path)
    print(f"wrote {path} from {len(parts)} parts ({', '.join(str(p['batch_sizes']) for p in doc['parts'])})")
    return status


def _write_sweep(doc: dict, path: str) -> int:
    """A sweep's JSON, its summary printed, and its PNG beside it (where matplotlib is installed); the command's
    exit status: 1 if a kernel's result was wrong."""
    from . import sweep

    if sweep.shape_set_of(doc) == "given":  # a user's model: its layers as one, too
        doc["together"] = sweep.together(doc["rows"])
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    print("\n".join(sweep.summary(doc["rows"]) + doc.get("together", [])))
    if line := sweep.facts_line(doc.get("gpu", {})):
        print(line)
    try:
        png = path.removesuffix(".json") + ".png"
        sweep.plot(doc["rows"], png, f"2:4 linear (one layout) vs dense, {doc['dtype']}, L2 {doc['l2']}, "
                                     f"{doc['device']}, {doc['commit']}")
        print(f"plot written to {png}")
    except ImportError:
        print("no plot written: matplotlib is not installed (pip install matplotlib)")
    return 1 if any(k.endswith("_wrong") for r in doc["rows"] for k in r) else 0


def _plot(rows, path: str) -> None:
    from .sparse24 import plot

    try:
        plot(rows, path)
    except ImportError:
        print(f"no plot written to {path}: matplotlib is not installed (pip install matplotlib)")
        return
    print(f"plot written to {path}")


def _run_cases(name: str, dev: torch.device) -> tuple[list[dict], bool]:
    """A suite of ``Case``s: kernelplan and the torch baseline, error and median time of each."""
    rows: list[Row] = []
    for case in SUITES[name](dev):
        out, backend = case.run_kp()
        baseline = case.run_torch()
        err, torch_err = _rel_err(out, case.oracle), _rel_err(baseline, case.oracle)
        floors = case.floors or {}
        # three alternating rounds: one timing each left the ratio to drift (the FusedLinear
        # gelu step at 2048x4096->14336 timed 1.30 ms here on an H200 and 1.01 ms alone)
        ms = interleaved({"kp": lambda: _time_ms(case.run_kp, dev), "torch": lambda: _time_ms(case.run_torch, dev),
                          **{f"floor {who}": lambda fn=fn: _time_ms(fn, dev) for who, fn in floors.items()}},
                         rounds=3)
        rows.append(
            Row(
                suite=name,
                case=case.name,
                dtype=str(case.dtype).replace("torch.", ""),
                backend=backend,
                err=err,
                torch_err=torch_err,
                kp_ms=ms["kp"],
                torch_ms=ms["torch"],
                floor_ms={who: ms[f"floor {who}"] for who in floors} or None,
                # the bar the tests use: within 2x torch's own error plus a small floor
                ok=err <= 2 * torch_err + case.atol,
            )
        )
    _print(rows, dev)
    extra = [{"host_overhead_us": gemm_host_overhead_us(dev)}] if name == "gemm" else []
    return extra + [asdict(r) for r in rows], all(r.ok for r in rows)


def gemm_host_overhead_us(dev: torch.device) -> dict:
    """``kernelplan.linear`` against ``F.linear`` at a small shape, host time per call."""
    import torch.nn.functional as F

    (m, n, k), calls = ((16, 4096, 4096), 200) if dev.type == "cuda" else ((16, 256, 512), 50)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    x, w = torch.randn(m, k, device=dev, dtype=dtype), torch.randn(n, k, device=dev, dtype=dtype)
    out = host_report({"kernelplan": lambda: linear(x, w), "F.linear": lambda: F.linear(x, w)}, dev, calls)
    print(host_report_line(out, f"{m}x{k} -> {n}"))
    return {"shape": [m, n, k], **out}


def environment(dev: torch.device) -> dict:
    """What a result file must name: device (and a GPU's attributes, ``results.gpu_attributes``), library versions,
    commit and date."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    cuda = dev.type == "cuda"
    return {
        "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
        **({"gpu": gpu_attributes(dev.index)} if cuda else {}),
        "torch": torch.__version__,
        "triton": triton_version,
        "commit": os.environ.get("KERNELPLAN_COMMIT", commit),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _print(rows: list[Row], dev: torch.device) -> None:
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "CPU"
    print(f"kernelplan bench on {name} (torch {torch.__version__}); errors are relative to an fp64 oracle")
    if dev.type == "cpu":
        print("CPU times show the reference backends' overhead; speed claims come from GPU runs only")
    header = f"{'suite':10} {'case':34} {'dtype':9} {'backend':10} {'err':>9} {'torch err':>9} {'kp ms':>8} {'torch ms':>8}  ok"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r.suite:10} {r.case:34} {r.dtype:9} {r.backend:10} {r.err:9.2e} {r.torch_err:9.2e} "
            f"{r.kp_ms:8.3f} {r.torch_ms:8.3f}  {'yes' if r.ok else 'NO'}"
            + (f"   GEMMs alone: {', '.join(f'{who} {t:.3f}' for who, t in r.floor_ms.items())} ms; torch over the "
               f"faster {r.torch_ms / min(r.floor_ms.values()):.2f}x, the most fusion around them gives"
               if r.floor_ms else "")
        )
