"""``kernelplan bench sparse24 --sweep``: the 2:4 kernels of the one layout against dense ``F.linear`` on the sweep
set (``bench/shapes.py``: the linear layers of public model configs), every shape at every batch size.

Each weight is held as ``Sparse24Linear`` holds it, in the device layout alone.
For every (M, K) and n: each kernel that reads the layout is checked against
fp64 first, then timed as a CUDA graph replay (kernel time;
``triton.testing.do_bench_cudagraph``, median) beside dense ``F.linear`` in the
same process, alternating; and the default path a user calls
(``kp.sparse24.linear``, the rule's kernel) runs eagerly, host work included,
beside ``F.linear``.  After the calls at every n, the bytes the weight holds.

``l2="cold"`` (the default) rotates each call over copies of the weight, dense
and 2:4 alike, that together exceed twice the GPU's L2, so every call reads its
weight from DRAM, as a model's forward does (its other layers pass through L2
between two calls of one layer).  ``l2="warm"`` times one weight over and over:
a weight of a few tens of MB then stays in L2, which is not what a model sees,
and favours dense, which reads twice the bytes.

Writes the JSON (device, versions, commit, date, one row per problem) and a
PNG, and prints a summary: min and median per batch-size range, the worst five
rows, wrong results, bytes held.
"""

from __future__ import annotations

import statistics

import torch

from ..sparse24.dispatch import runs_sm90a
from .shapes import BATCH_SIZES, held_out_shapes, lm_head_shapes, sweep_shapes

QUICK_BATCH_SIZES = (1, 16, 64, 256, 1024, 4096)
# What a sweep's JSON says of its two columns and its L2 mode.
TIMING = ("CUDA graph replay, median (triton.testing.do_bench_cudagraph); eager: wall per call of 50 back-to-back "
          "calls, 9 rounds alternating with dense, median of the rounds' ratios")
L2_MEANS = {"cold": "each call's weight is the next of copies past twice the L2 (weight_copies per row), dense and "
                    "2:4 alike: read from DRAM, as in a model's forward",
            "warm": "one weight, called over and over: held in L2 where it fits"}
L2_MODES = tuple(L2_MEANS)
MAX_COPIES = 256
EAGER_CALLS, EAGER_ROUNDS = 50, 9  # eager: back-to-back calls a reading, readings of each (paired) a row
RANGES = (("n <= 16", 1, 16), ("n = 32-64", 32, 64), ("n = 128-512", 128, 512), ("n >= 1024", 1024, 1 << 30))


def _kernels(capability: tuple[int, int]) -> dict:
    """The one layout's kernels the sweep times on a GPU of ``capability``: name -> (kernel, largest n it is timed
    at).  ``cuda_ws`` is sm_90a's alone (wgmma.sp, TMA, clusters): Ampere and Ada time ``cuda_sp``."""
    from ..kernels.sparse24_sp import SpKernel
    from ..kernels.sparse24_ws import WsKernel

    out = {"cuda_sp": (SpKernel, 64), "cuda_ws": (WsKernel, 1 << 30)}
    return out if runs_sm90a(capability) else {"cuda_sp": out["cuda_sp"]}


def _rel_err(out, ref) -> float:
    return float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _precompile(shapes, batch, dtype: str, device: int) -> None:
    """Every cuda_ws variant the sweep will run past n = 16, compiled in threads (NVRTC is thread-safe), before any
    timing; none on a GPU where the dispatch runs no cuda_ws (sm_90a only: Ampere and Ada run cuda_sp)."""
    import concurrent.futures

    from ..kernels.sparse24_ws import WsKernel, _launcher
    from ..sparse24.dispatch import backend_for

    kernel, capability = WsKernel(), torch.cuda.get_device_capability(device)
    configs = {kernel.config(n, m, k, device) for (m, k) in shapes for n in batch
               if n > 16 and backend_for(capability, n, m, k, dtype) == "cuda_ws"}
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        list(pool.map(lambda c: _launcher(c, dtype, False, None, device), configs))


def copies_past_l2(l2_bytes: int, weight_bytes: int, l2: str) -> int:
    """How many copies of a weight (its smaller, 2:4 form: ``weight_bytes``) a call rotates over: past twice the L2
    where ``l2 == "cold"`` (at most ``MAX_COPIES``), one where "warm"."""
    if l2 not in L2_MODES:
        raise ValueError(f"l2={l2!r}: give one of {L2_MODES}")
    return 1 if l2 == "warm" else max(1, min(MAX_COPIES, -(-2 * l2_bytes // weight_bytes)))


def _cycling(fns):
    """One call of each of ``fns`` in turn, a call at a time (a CUDA graph captures the calls' order).  Each is
    called once here first, eagerly: what a weight derives on its first call is not built inside a capture."""
    import itertools

    for fn in fns:
        fn()
    turn = itertools.cycle(fns)
    return lambda: next(turn)()


def run_sweep(device: torch.device, dtype: torch.dtype = torch.bfloat16, batch=BATCH_SIZES, rep: int = 20,
              shapes: dict | None = None, log=print, l2: str = "cold", done=None) -> list[dict]:
    """The sweep's rows: one per (M, K, n) timed, and one per (M, K) with the bytes its weight held.
    ``done(rows)``, if given, gets the rows so far after each shape."""
    import torch.nn.functional as F

    from ..kernels.sparse24_mma import MmaLinear
    from ..kernels.sparse24_ws import WsKernel
    from ..sparse24 import compress, linear, prune
    from ..sparse24.dispatch import backend_for
    from ..sparse24.layout import pack_reason
    from ..timing import graph_us, host_us_per_call

    shapes = sweep_shapes() if shapes is None else shapes
    row_dtype = {torch.bfloat16: "bf16", torch.float16: "f16"}[dtype]
    index = device.index if device.index is not None else torch.cuda.current_device()
    l2_bytes = torch.cuda.get_device_properties(index).L2_cache_size
    _precompile(shapes, batch, row_dtype, index)
    kernels = _kernels(torch.cuda.get_device_capability(index))

    def graph_ms(fn) -> float:
        return graph_us(fn, rep) / 1e3

    def eager_ms(fn) -> float:
        return host_us_per_call(fn, device, EAGER_CALLS) / 1e3

    def host_ms(fn) -> float:
        return host_us_per_call(fn, device, EAGER_CALLS, wait=False) / 1e3

    rows = []
    with torch.cuda.device(index):
        for (m, k), where in shapes.items():
            w = prune(torch.randn(m, k, device=device)).to(dtype)
            held = (lambda c: compress(c).packed()) if pack_reason(m, k) is None else compress  # as Sparse24Linear
            w24 = held(w)  # holds it: the device layout alone, where the shape allows
            dense_bytes = w.numel() * w.element_size()
            copies = copies_past_l2(l2_bytes, w24.values.nbytes + w24.metadata.nbytes, l2)
            ws = [w] + [w.clone() for _ in range(copies - 1)]
            w24s = [w24] + [held(c) for c in ws[1:]]
            for n in batch:
                x = torch.randn(n, k, device=device).to(dtype)
                ref = F.linear(x.double(), w.double())
                row = {"m": m, "k": k, "n": n, "layers": where, "dense_err": _rel_err(F.linear(x, w), ref),
                       "weight_copies": copies}
                dense = _cycling([lambda c=c: F.linear(x, c) for c in ws])
                times, dense_times = {}, []
                for name, (kernel, max_n) in kernels.items():
                    if n > max_n:
                        continue
                    call = MmaLinear(None, kernel())
                    row[f"{name}_err"] = err = _rel_err(call(x, w24.values, w24.metadata, None), ref)
                    if not err <= 2 * row["dense_err"] + 1e-3:
                        row[f"{name}_wrong"] = True
                        continue
                    fn = _cycling([lambda call=call, c=c: call(x, c.values, c.metadata, None) for c in w24s])
                    # Alternating, dense-kernel-kernel-dense, so that a slow spell of the GPU and a drift land on
                    # both; each side's readings are summarised alike (the median), not the kernel's by its best.
                    t_d1, t_k1, t_k2, t_d2 = graph_ms(dense), graph_ms(fn), graph_ms(fn), graph_ms(dense)
                    row[f"{name}_ms"] = times[name] = statistics.median((t_k1, t_k2))
                    dense_times += [t_d1, t_d2]
                row["dense_ms"] = statistics.median(dense_times) if dense_times else float("nan")
                # The default path, as a user calls it: kp.sparse24.linear (memory="compact", the rule's kernel),
                # eagerly, host work included, beside F.linear, alternating.
                row["rule"] = rule = backend_for(torch.cuda.get_device_capability(index), n, m, k, row_dtype)
                user = _cycling([lambda c=c: linear(x, c) for c in w24s])
                user()
                # Paired rounds: the host's speed drifts by 10-40% within seconds (F.linear alone read 15-44 us a
                # call on rows of like kernels in one sweep at 7548a19), so the speedup is the median of each
                # round's ratio, not a ratio of medians taken apart.  Each round also reads the host's part alone
                # (the clock stops when the last call returns): where an eager reading exceeds the graph's, it says
                # whether the host or the device is behind (docs/design/0019).  In the rounds, not once after them:
                # single readings set beside medians of rounds showed a gap that paired rounds do not (0071).
                rounds = [(eager_ms(dense), eager_ms(user), host_ms(dense), host_ms(user)) for _ in range(EAGER_ROUNDS)]
                for i, name in enumerate(("dense_eager_ms", "rule_eager_ms", "dense_host_ms", "rule_host_ms")):
                    row[name] = statistics.median(r[i] for r in rounds)
                row["eager_speedup"] = statistics.median(d / r for d, r, _, _ in rounds)
                if rule == "cuda_ws":
                    row["ws_config"] = str(WsKernel().config(n, m, k, index))
                for name, t in times.items():
                    row[f"{name}_speedup"] = row["dense_ms"] / t
                if times:
                    row["best_one_layout"] = min(times, key=times.get)
                if rule in times:
                    row["speedup"] = row["dense_ms"] / times[rule]  # the rule's kernel, as a CUDA graph
                rows.append(row)
                log(f"{m:>6}x{k:<6} n={n:<5} dense {row['dense_ms'] * 1e3:8.1f} us  " + "  ".join(
                    f"{nm} {row[nm + '_speedup']:.2f}x" for nm in kernels if nm in times)
                    + "".join(f"  WRONG {nm}" for nm in kernels if row.get(nm + "_wrong")))
            # Bytes held after the calls at every n: the weight as held, and anything its calls derived from it.
            held = w24.values.nbytes + w24.metadata.nbytes + sum(w24.derived_bytes().values())
            rows.append({"m": m, "k": k, "memory": {"dense_bytes": dense_bytes, "layout": w24.layout,
                                                    "held_bytes": held, "ratio": held / dense_bytes}})
            del w, w24, ws, w24s
            torch.cuda.empty_cache()
            if done is not None:
                done(rows)
    return rows


def _ranges(rows: list[dict], key: str) -> list[str]:
    lines = []
    for label, lo, hi in RANGES:
        s = sorted(r[key] for r in rows if key in r and lo <= r["n"] <= hi)
        if s:
            lines.append(f"{label:12} min {s[0]:.2f}x  median {statistics.median(s):.2f}x  max {s[-1]:.2f}x  "
                         f"({len(s)} rows)")
    return lines


def summary(rows: list[dict], worst: int = 5) -> list[str]:
    """The sweep in a few lines: the rule's speedup by range of n (graph, then eager), the worst rows, wrong
    results, host-bound calls, bytes held."""
    timed = [r for r in rows if "speedup" in r]
    lines = ["rule's kernel vs dense, CUDA graph:"] + ["  " + s for s in _ranges(rows, "speedup")]
    lines += ["eager, host work included:"] + ["  " + s for s in _ranges(rows, "eager_speedup")]
    lines.append(f"worst {worst} rows (graph): " + "; ".join(
        f"{r['m']}x{r['k']} n={r['n']} {r['speedup']:.2f}x ({r['rule']})"
        for r in sorted(timed, key=lambda r: r["speedup"])[:worst]))
    small = [r for r in rows if "eager_speedup" in r and r["dense_eager_ms"] < 0.05]
    if small:  # host-bound calls: the host work compared
        lines.append(f"host-bound calls (dense < 50 us eager): kp.sparse24.linear / F.linear wall per call, median "
                     f"{statistics.median(r['rule_eager_ms'] / r['dense_eager_ms'] for r in small):.2f}x "
                     f"({len(small)} rows)")
    wrong = [r for r in rows if any(k.endswith("_wrong") for k in r)]
    lines.append(f"rows with a wrong kernel result: {len(wrong)}")
    ratios = [r["memory"]["ratio"] for r in rows if "memory" in r]
    if ratios:
        lines.append(f"bytes held per weight (one layout): {min(ratios):.4f}-{max(ratios):.4f}x of dense")
    return lines


def together(rows: list[dict]) -> list[str]:
    """A given model's layers (``--model``, ``--shapes``) as one: at each n, the sum of dense's times over the sum of
    the rule's, each distinct (M, K) counted once for each layer that has it (its rows' ``layers``), CUDA graph and
    eager; and the bytes all of them hold.  An n where a shape has no time (a wrong result) is said to be
    incomplete, not summed."""
    timed = [r for r in rows if "n" in r]
    count = {(r["m"], r["k"]): len(r["layers"]) for r in timed}

    def total(at: list[dict], time) -> float:
        return sum(count[r["m"], r["k"]] * time(r) for r in at)

    lines = ["the layers together, each shape counted once for each layer that has it (dense's time over the rule's):"]
    for n in sorted({r["n"] for r in timed}):
        at = [r for r in timed if r["n"] == n]
        missing = [f"{r['m']}x{r['k']}" for r in at if "speedup" not in r]
        if missing:
            lines.append(f"  n = {n}: incomplete, no time of the rule's kernel on {', '.join(missing)}")
            continue
        graph = total(at, lambda r: r["dense_ms"]) / total(at, lambda r: r["dense_ms"] / r["speedup"])
        eager = total(at, lambda r: r["dense_eager_ms"]) / total(at, lambda r: r["rule_eager_ms"])
        lines.append(f"  n = {n}: {graph:.2f}x graph, {eager:.2f}x eager")
    held = [(count.get((r["m"], r["k"]), 0), r["memory"]) for r in rows if "memory" in r]
    dense = sum(c * mem["dense_bytes"] for c, mem in held)
    if dense:
        kept = sum(c * mem["held_bytes"] for c, mem in held)
        lines.append(f"  bytes held: {kept / 2**20:.1f} MiB, dense {dense / 2**20:.1f} MiB ({kept / dense:.4f}x)")
    return lines


def facts_line(gpu: dict) -> str | None:
    """What the tile rule read of the sweep's GPU (its results file's ``gpu`` record, ``rule_facts``), in one line:
    where two GPUs of one name pick differently, this says why (docs/design/0065, 0066); None where not recorded."""
    facts = gpu.get("rule_facts")
    if not isinstance(facts, dict):
        return None if facts is None else f"the tile rule's GPU facts: {facts}"
    sizes = sorted(facts["ctas"], key=int)
    return (f"the tile rule's GPU facts ({facts['source']}): {facts['sms']} SMs; clusters of {'/'.join(sizes)} CTAs "
            f"place {'/'.join(str(facts['ctas'][s]['1']) for s in sizes)} CTAs at once, one an SM; DRAM "
            f"{facts['dram_bytes_per_s'] / 1e12:.2f} TB/s")


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """The rule's speedup against n: every shape a faint line, the median and the min over shapes bold; graph
    replay left, eager right.  Needs matplotlib (ImportError without it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    for ax, key, label in ((axes[0], "speedup", "CUDA graph"), (axes[1], "eager_speedup", "eager")):
        timed = [r for r in rows if key in r]
        for m, k in sorted({(r["m"], r["k"]) for r in timed}):
            sel = sorted((r for r in timed if (r["m"], r["k"]) == (m, k)), key=lambda r: r["n"])
            ax.plot([r["n"] for r in sel], [r[key] for r in sel], color="tab:blue", alpha=0.15, linewidth=0.8)
        ns = sorted({r["n"] for r in timed})
        by_n = [[r[key] for r in timed if r["n"] == n] for n in ns]
        ax.plot(ns, [statistics.median(v) for v in by_n], color="tab:blue", linewidth=2.5, marker="o", label="median")
        ax.plot(ns, [min(v) for v in by_n], color="tab:red", linewidth=2, marker="v", label="min over shapes")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("n (rows of x)")
        ax.set_title(f"{label}: dense F.linear time / 2:4 time")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("speedup over dense")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# The shapes a sweep can time: the sweep set (the models' attention and MLP projections, on which the kernels' rules
# were fitted), the same models' LM heads (docs/design/0052) or other public models' projections (docs/design/0057),
# both held out of those fits.
SHAPE_SETS = {"sweep set": sweep_shapes, "lm heads": lm_head_shapes, "held-out models": held_out_shapes}


def default_name(device: str, dtype: str, l2: str = "cold", shape_set: str = "sweep set") -> str:
    """``sparse24-sweep[-lm-heads|-held-out-models|-given]-<gpu>[-f16][-l2warm]`` for a GPU named ``device``
    (``torch.cuda.get_device_name``): the name's model word (h100, h200), as the committed results are named."""
    words = device.split()
    gpu = words[1].lower() if len(words) > 1 else "gpu"
    heads = "" if shape_set == "sweep set" else "-" + shape_set.replace(" ", "-")
    return (f"sparse24-sweep{heads}-{gpu}" + ("" if dtype == "bf16" else f"-{dtype}")
            + ("" if l2 == "cold" else "-l2warm"))


def shape_set_of(doc: dict) -> str:
    """A sweep JSON's shape set; the sweep set where it says none (sweeps before the LM heads were a choice)."""
    return doc.get("shape_set", "sweep set")


def _part_value(doc: dict, key: str):
    return shape_set_of(doc) if key == "shape_set" else doc.get(key)


# What a sweep's parts must share to be one sweep: one GPU model, one code version, one dtype, L2 mode and shape set
# (and, for given shapes, where they came from).
_SAME_ACROSS_PARTS = ("device", "torch", "triton", "commit", "dtype", "l2", "shape_set", "shapes_from")


def merge(parts: list[tuple[str, dict]]) -> dict:
    """One sweep from the JSON of several runs over disjoint batch sizes (``--batch``), where one run would pass a
    time limit: ``parts`` is ``[(path, doc), ...]``.  The parts must agree on ``_SAME_ACROSS_PARTS`` and time no
    (M, K, n) twice; a ValueError names the first part that does not.  Each weight keeps the largest bytes held
    after its calls in any part (the bytes after calls at every n).  ``parts`` in the result says which run timed
    which batch sizes, when; ``date`` is the last run's."""
    if len(parts) < 2:
        raise ValueError(f"merging sweeps takes two or more JSON files, got {len(parts)}")
    first_path, first = parts[0]
    timed: dict[tuple[int, int, int], str] = {}
    memory: dict[tuple[int, int], dict] = {}
    by_shape: dict[tuple[int, int], list[dict]] = {}  # each shape's timed rows, in the first part's order
    for path, doc in parts:
        missing = [key for key in ("rows", "date", "batch_sizes") if key not in doc]
        if missing:
            raise ValueError(f"{path} has no {missing[0]!r}: it is not the JSON of kernelplan bench sparse24 --sweep")
        if doc.get("cut_short"):
            raise ValueError(f"{path} is what a sweep had timed when its run ended early ({doc['cut_short']}): "
                             f"run that part again, over fewer batch sizes if it ran out of time")
        for key in _SAME_ACROSS_PARTS:
            mine, theirs = _part_value(doc, key), _part_value(first, key)
            if mine != theirs:
                raise ValueError(f"{path} has {key} {mine!r} but {first_path} has {theirs!r}: "
                                 f"a sweep's parts come from one GPU model and one commit; run the parts again")
        for row in doc["rows"]:
            if "memory" in row:
                key = (row["m"], row["k"])
                if key not in memory or row["memory"]["held_bytes"] > memory[key]["memory"]["held_bytes"]:
                    memory[key] = row
                continue
            key = (row["m"], row["k"], row["n"])
            if key in timed:
                raise ValueError(f"{path} and {timed[key]} both time {key[0]}x{key[1]} at n = {key[2]}: give each "
                                 f"part its own batch sizes (--batch)")
            timed[key] = path
            by_shape.setdefault(key[:2], []).append(row)
    dates = sorted(doc["date"] for _, doc in parts)
    merged = {k: v for k, v in first.items() if k not in ("rows", "batch_sizes", "date", "parts")}
    merged["date"] = dates[-1]
    merged["parts"] = [{"file": path, "date": doc["date"], "batch_sizes": doc["batch_sizes"]} for path, doc in parts]
    merged["rows"] = []
    for shape in dict.fromkeys([*by_shape, *memory]):  # a shape's timed rows by n, then its bytes held
        held = [memory[shape]] if shape in memory else []
        merged["rows"] += sorted(by_shape.get(shape, []), key=lambda r: r["n"]) + held
    merged["batch_sizes"] = sorted({n for _, _, n in timed})
    return merged
