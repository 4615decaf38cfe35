"""The README's performance table, generated from ``bench/results/*.json``.

``python tools/readme_table.py`` rewrites the block between the README's
``perf-table`` markers; ``tests/test_readme.py`` fails when the two disagree.
Every figure in the table is a median or a range over the rows of one results
file, named with its device and commit.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
README = ROOT / "README.md"
DEFAULT_MODEL = "qwen2.5-7b-as-llama"  # bench/sparse24_model.py's default: issue 26's model
BEGIN, END = "<!-- perf-table:begin (tools/readme_table.py) -->", "<!-- perf-table:end -->"

# 2:4 linear rows by batch size (tokens per call), the ranges users ask about.
N_RANGES = (("n = 1-16", 1, 16), ("n = 32-64", 32, 64), ("n = 128-512", 128, 512), ("n >= 1024", 1024, 1 << 30))


def _load(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _span(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{statistics.median(values):.2f}x ({min(values):.2f}-{max(values):.2f}x)"


def _source(doc: dict, name: str) -> str:
    return f"{doc['device']} at {doc['commit']} (`bench/results/{name}.json`)"


def sparse24_rows(name: str) -> list[str]:
    doc = _load(name)
    if doc is None:
        return []
    rows = [r for r in doc["suites"]["sparse24"] if "speedup" in r]
    shapes = sorted({(r["m"], r["k"]) for r in rows})
    cells = [_span([r["speedup"] for r in rows if lo <= r["n"] <= hi]) for _, lo, hi in N_RANGES]
    what = f"2:4 linear, v1 tuned (now `memory=\"fast\"`), {rows[0]['dtype'].replace('torch.', '')}, {len(shapes)} shapes"
    return [f"| {what} | " + " | ".join(cells) + f" | {_source(doc, name)} |"]


def _calls(doc: dict) -> str:
    """How many back-to-back calls one eager reading spans, from the sweep's timing note."""
    import re

    found = re.search(r"of (\d+) back-to-back", doc.get("timing", ""))
    return f"; {found.group(1)} calls a reading" if found else ""


def sweep_rows(name: str) -> list[str]:
    """The default 2:4 path (memory="compact", the rule's kernel of the one layout) over the sweep set."""
    doc = _load(name)
    if doc is None:
        return []
    rows = [r for r in doc["rows"] if "speedup" in r]
    heads = doc.get("shape_set") == "lm heads"  # held out of every rule's fit (0052)
    shapes = len({(r["m"], r["k"]) for r in rows})
    ns = len({r["n"] for r in rows})
    dt = doc["dtype"]
    l2 = {"cold": "weights read from DRAM (L2 cold)", "warm": "one weight called over and over (L2 warm)"}[
        doc.get("l2", "warm")]  # sweeps before the l2 field timed one weight: warm
    graph = [_span([r["speedup"] for r in rows if lo <= r["n"] <= hi]) for _, lo, hi in N_RANGES]
    eager = [_span([r["eager_speedup"] for r in rows if lo <= r["n"] <= hi and "eager_speedup" in r])
             for _, lo, hi in N_RANGES]
    what = f"{shapes} sweep shapes"
    held = "held in the device layout alone, 0.5625x bytes"
    if heads:  # the odd vocabularies are held public with a padded copy derived (0052), and cuBLAS runs them slowly
        ratios = [r["memory"]["ratio"] for r in doc["rows"] if "memory" in r]
        held = f"{min(ratios):.4g}-{max(ratios):.4g}x bytes, the most for the odd vocabularies"
        odd = [r["speedup"] for r in rows if r["m"] % 8]
        what = f"{shapes} LM heads held out of the rules' fits" + (
            f" (at the odd vocabularies, whose dense calls cuBLAS runs slowly, {min(odd):.2f}-{max(odd):.2f}x)"
            if odd else "")
    if doc.get("shape_set") == "held-out models":  # other public models' projections, held out too (0057)
        what = f"{shapes} projections of other public models (0.5-12B), outside the sweep set the rule was fitted on"
    if doc.get("shape_set") == "given" and name.startswith("sparse24-sweep-padded-k"):  # K the layout pads (0083)
        ratios = [r["memory"]["ratio"] for r in doc["rows"] if "memory" in r]
        held = f"K padded to 64 in the device layout, {min(ratios):.4g}-{max(ratios):.4g}x bytes"
        what = (f"{shapes} public layers whose K is not a multiple of 64 (SigLIP-so400m's fc2, K = 4304; K = 96 "
                f"and 160 as in Swin-T's and ConvNeXt-T's first stage and Mamba's dt_proj, which kp.sparsify keeps "
                f"dense)")
    return [f"| 2:4 linear, default ({held}), {dt}, {what} x {ns} n, "
            f"{l2}, CUDA graph | "
            + " | ".join(graph) + f" | {_source(doc, name)} |",
            f"| the same, eager (host work included{_calls(doc)}) | " + " | ".join(eager) + f" | {_source(doc, name)} |"]


def newest_rows() -> list[str]:
    """Per GPU and dtype, the sweep set's cells each at its newest reading: the sweeps and their parts merged as
    ``tools/expected_table.py`` merges them for ``kp.warmup`` (a part run again after a rule changed replaces the
    older reading of its n), the LM heads left out; then, where sweeps read them, the held-out models' projections
    (shapes no rule was fitted on) merged alike."""
    from expected_table import tables

    from kernelplan.bench.shapes import held_out_shapes, sweep_shapes

    sets = (("sweep set", "sweep shapes", {f"{m}x{k}" for m, k in sweep_shapes()}),
            ("held-out models", "projections of other public models (0.5-12B), outside the sweep set the rule was "
             "fitted on", {f"{m}x{k}" for m, k in held_out_shapes()}))
    out = []
    for t in sorted(tables(RESULTS)["tables"], key=lambda t: (t["dtype"], t["gpu"])):
        docs = {src["file"]: _load(src["file"].removesuffix(".json")) for src in t["sources"]}
        for shape_set, what, shapes in sets:
            cells = [c for shape, rows in t["shapes"].items() if shape in shapes for c in rows]
            files = [f for f, doc in docs.items() if doc.get("shape_set", "sweep set") == shape_set
                     or doc.get("shape_set") == "given" and {f"{r['m']}x{r['k']}" for r in doc["rows"]} & shapes]
            if not cells or not files:
                continue
            commits = list(dict.fromkeys(docs[f]["commit"] for f in files))
            ratios = [r["memory"]["ratio"] for f in files for r in docs[f]["rows"] if "memory" in r
                      and f"{r['m']}x{r['k']}" in shapes]
            ns = len({n for n, _, _ in cells})
            graph = [_span([g for n, g, _ in cells if lo <= n <= hi]) for _, lo, hi in N_RANGES]
            eager = [_span([e for n, _, e in cells if lo <= n <= hi and e is not None]) for _, lo, hi in N_RANGES]
            where = (f"{t['gpu']}, {len(files)} sweep files at {', '.join(commits)} (`sparse24/expected.json`'s "
                     f"sources)")
            held = ("bytes held not recorded" if not ratios else f"{min(ratios):.4g}x bytes"
                    if min(ratios) == max(ratios) else f"{min(ratios):.4g}-{max(ratios):.4g}x bytes")
            count = len({shape for shape in t["shapes"] if shape in shapes})
            out += [f"| **2:4 linear, default ({held}), {t['dtype']}, {count} {what} x {ns} n, "
                    f"each at its newest reading**, weights read from DRAM (L2 {t['l2']}), CUDA graph | "
                    + " | ".join(graph) + f" | {where} |",
                    "| the same, eager | " + " | ".join(eager) + f" | {where} |"]
    return out


def _ungrouped(row: dict) -> str:
    """What grouping q/k/v and gate/up (kp.nn.fuse_siblings) gave, where the bench timed the model without it."""
    if "graph_speedup_unfused" not in row:
        return ""
    return (f" ({row['graph_speedup_unfused']:.2f}x ungrouped, {row['graph_speedup_vs_dense_fused']:.2f}x against "
            f"dense grouped alike)")


def _by_n(rows: list[dict], cell) -> str:
    """``n = N <cell>`` for each n of a sweep's rows, ``cell(median)`` given the median of a key over that n's rows."""
    return "; ".join(f"n = {n} " + cell(lambda key: statistics.median([r[key] for r in rows if r["n"] == n]))
                     for n in sorted({r["n"] for r in rows}))


def _epilogue_spans(rows: list[dict]) -> str:
    """Per n, an epilogue sweep's median speedup over dense and the epilogue's median gain."""
    return _by_n(rows, lambda med: f"{med('speedup'):.2f}x (epilogue {med('epilogue_gain'):.2f}x)")


def _experts_note(doc: dict, name: str) -> str:
    """Per token count, the grouped 2:4 experts against transformers' ``grouped_mm`` over every MoE config timed."""
    rows = doc["rows"]
    configs = ", ".join(f"{m} ({r['experts']} x {r['hidden']} -> {r['intermediate']}, top {r['top_k']})"
                        for m, r in {r["model"]: r for r in rows}.items())
    by_tokens = _by_tokens(rows)
    held = {round(r["held_bytes"] / r["dense_bytes"], 4) for r in rows}
    fused = ""
    if "sparse24_unfused" in rows[0]["graph_ms"]:
        gain = {t: [r["graph_ms"]["sparse24_unfused"] / r["graph_ms"]["sparse24"] for r in rows if r["tokens"] == t]
                for t in sorted({r["tokens"] for r in rows})}
        fused = ("; the gating in the first launch's epilogue over the gating between the launches, CUDA graph, median "
                 "by tokens: " + ", ".join(f"{t} {statistics.median(g):.2f}x" for t, g in gain.items()))
    return (f"- 2:4 MoE experts (`kp.nn.Sparse24Experts`, each projection one grouped launch) against transformers' "
            f"`grouped_mm` on the same pruned weights, over {len({r['model'] for r in rows})} configs' routed "
            f"experts ({configs}), random routing, median (min) by tokens, CUDA graph / eager: {by_tokens}{fused}; "
            f"bytes {'-'.join(f'{b:.4f}' for b in sorted(held))}x, {_source(doc['meta'], name)}.")


def _moe_model_note(doc: dict, name: str) -> str:
    """Whole MoE models, sparsified against dense, by case; their weights and GPU memory."""
    models = []
    for m in doc["models"]:
        cases = "; ".join(f"{r['case']} {r['graph_speedup']:.2f}x graph, {r['eager_speedup']:.2f}x eager" + (
            f" (routed to the chosen experts; 2:4 alone, every expert on every token as transformers' module runs "
            f"them: {r['graph_speedup_unrouted']:.2f}x, "
            f"{r['eager_speedup_unrouted']:.2f}x)" if "graph_speedup_unrouted" in r else "") for r in m["rows"])
        gib = {k: v / 2**30 for k, v in m["gpu_memory_bytes"].items()}
        models.append(f"{m['model']} ({m['layers']} layers): {cases}; weights {m['sparse_over_dense_bytes']:.3f}x of "
                      f"dense (experts {m['experts_bytes']['sparse'] / m['experts_bytes']['dense']:.4f}x, embeddings "
                      f"and LM head dense), GPU memory held {gib['sparse']:.2f} against {gib['dense']:.2f} GiB")
    dense = "Llama-4's module, `torch.bmm`" if all(m["model"].startswith("Llama-4") for m in doc["models"]) else \
        "transformers' `grouped_mm`"
    return ("- 2:4 MoE models (`bench/sparse24_moe_model.py`, published configs' sizes, random weights), sparsified "
            f"against dense (experts on {dense}): " + "; ".join(models) +
            f"; {_source(doc['meta'], name)}.")


def _moe_route_note(doc: dict, name: str) -> str:
    """The routing kernel (each chunk size timed) over the torch ops' routing, by pairs: graph time and host work."""
    rows = doc["rows"]
    ways = [w for w in rows[0]["graph_us"] if w != "torch"]

    def span(values: list[float]) -> str:
        low, high = f"{min(values):.2f}", f"{max(values):.2f}"
        return f"{low}x" if low == high else f"{low}-{high}x"

    cells = []
    for pairs in sorted({r["pairs"] for r in rows}):
        at = [r for r in rows if r["pairs"] == pairs]
        cells.append(f"{pairs} pairs " + ", ".join(
            f"{w}: {span([r['graph_over_torch'][w] for r in at])} graph, "
            f"{span([r['host_us'][w] / r['host_us']['torch'] for r in at])} host" for w in ways))
    models = sorted({r["model"] for r in rows})
    equal = all(all(r["bitwise_equal"].values()) for r in rows)
    return (f"- MoE routing kernel (`kernels/moe_route.py`; bN: chunks of N pairs; scan: the counts summed by a third "
            f"launch) over the torch ops' "
            f"routing in one experts call ({', '.join(models)}), one process, by (token, k) pairs: " + "; ".join(cells)
            + f"; outputs {'bit for bit equal' if equal else 'NOT all equal'}, {_source(doc['meta'], name)}.")


def _moe_route_bound_note(doc: dict, name: str) -> str:
    """The routing's bound plans against the older module's launches: host work of route alone and of an experts
    call, and the experts call's wall time."""
    rows = doc["rows"]

    def span(part: str, key: str) -> str:
        ratios = [r[key]["bound"] / r[key]["launcher"] for r in rows if r["part"] == part]
        return f"{min(ratios):.2f}-{max(ratios):.2f}x (median {statistics.median(ratios):.2f}x)"

    def models(part: str) -> str:
        at = [r for r in rows if r["part"] == part]
        return (f"{', '.join(sorted({r['model'] for r in at}))} at "
                f"{', '.join(str(t) for t in sorted({r['tokens'] for r in at}))} tokens")

    equal = all(r["equal"] for r in rows)
    return (f"- MoE routing's host work, each call signature's launches bound once (`moe_route._Plan`) over each "
            f"launch keyed by its arguments (`Launcher`), one process: `route` alone {span('route', 'host_us')} "
            f"({models('route')}); an eager `Sparse24Experts` call's host work {span('module', 'host_us')}, its wall "
            f"time {span('module', 'wall_us')} ({models('module')}); outputs "
            f"{'bit for bit equal' if equal else 'NOT all equal'}, {_source(doc['meta'], name)}.")


def _every_token_note(doc: dict, name: str) -> str:
    """Experts that run every token through every expert (Llama-4's), 2:4 against the dense module, by config and
    token count: CUDA graph / eager, and the host work of an eager call."""
    cells = []
    for model in dict.fromkeys(r["model"] for r in doc["rows"]):
        at = [r for r in doc["rows"] if r["model"] == model]
        shape = f"{at[0]['experts']} x {at[0]['hidden']} -> {at[0]['intermediate']}"
        cells.append(f"{model} ({shape}): " + ", ".join(
            f"{r['tokens']} token{'s' * (r['tokens'] != 1)} {r['graph_speedup']:.2f}x / {r['speedup']:.2f}x"
            for r in at))
    host = [r["host_us"]["sparse24"] / r["host_us"]["dense"] for r in doc["rows"]]
    held = {round(r["held_bytes"] / r["dense_bytes"], 4) for r in doc["rows"]}
    grouped = all(r["grouped"] for r in doc["rows"])
    return (f"- 2:4 experts that run every token through every expert (Llama-4's `Llama4TextExperts`, as "
            f"`kp.nn.Sparse24Experts`: one grouped launch a projection{'' if grouped else ' where it ran'}) against "
            f"the dense module (`torch.bmm`) on the same pruned weights, CUDA graph / eager: " + "; ".join(cells) +
            f"; an eager call's host work {min(host):.2f}-{max(host):.2f}x of dense's; bytes "
            f"{'-'.join(f'{b:.4f}' for b in sorted(held))}x, {_source(doc['meta'], name)}.")


def _fits_note(doc: dict, name: str) -> str:
    """A model on one GPU, dense and sparsified (``bench/sparse24_70b_memory.py --model``): its weights, whether each
    fits, and the decode step of each that does."""
    meta, s = doc["meta"], doc["sparse"]

    def model(which: str) -> str:
        d = doc[which]
        if not d["fits"]:
            return f"{which} does not fit ({d['allocated_when_it_failed_gib']:.1f} GiB allocated when it failed)"
        step = f", decode step at batch 1, CUDA graph, {d['decode_step_ms']:.1f} ms" if "decode_step_ms" in d else \
            f", decode step {d.get('decode_step', 'not run')}"
        return (f"{which} holds {d['weight_gib']:.1f} GiB of weights{step}, {d['free_after_step_gib']:.1f} GiB free "
                f"after it ({d['kv_tokens_that_fit_in_free']:,} more tokens of KV cache)")

    return (f"- 2:4, {meta['model']} ({meta['layers']} layers, its experts as `kp.nn.Sparse24Experts`) on one GPU of "
            f"{s['device_total_gib']:.1f} GiB: weights {s['dense_weight_gib']:.1f} GiB dense; {model('sparse')}; "
            f"{model('dense')}, {_source(meta, name)}.")


def _vision_note(doc: dict, before: dict | None) -> str:
    """A vision tower dense against sparsified (``bench/sparse24_vision.py``), and the same bench before its fc2's K
    was padded (0083), where that layer ran on the reference."""
    def cells(d: dict) -> str:
        return ", ".join(f"{r['images']} image{'s' * (r['images'] > 1)} {r['graph_speedup']:.2f}x graph / "
                         f"{r['eager_speedup']:.2f}x eager" for r in d["rows"])

    meta = doc["meta"]
    line = (f"- 2:4, {meta['model']} ({meta['layers']} layers, fc2's K = 4304 held padded to 4352): {cells(doc)}; "
            f"weights {doc['sparse_over_dense_bytes']:.3f}x of dense")
    if "host" in doc:
        host = doc["host"]["host_ms"]
        line += f"; host work of one image's forward {host['sparse']:.2f} ms against dense's {host['dense']:.2f}"
    line += f", {_source(meta, 'sparse24-vision-h200')}"
    if before:
        line += (f". Before (fc2 on the reference, decompressed at every call): {cells(before)}, "
                 f"{_source(before['meta'], 'sparse24-vision-before-h200')}")
    return line + "."


def _by_tokens(rows: list[dict]) -> str:
    def cell(values: list[float]) -> str:
        return f"{statistics.median(values):.2f}x ({min(values):.2f}x)"

    def at(t: int, key: str) -> str:
        return cell([r[key] for r in rows if r["tokens"] == t])

    return "; ".join(f"{t} token{'s' * (t != 1)} {at(t, 'graph_speedup_vs_grouped_mm')} / "
                     f"{at(t, 'speedup_vs_grouped_mm')}" for t in sorted({r["tokens"] for r in rows}))


def _tile_tuning_note(doc: dict, name: str) -> str:
    s, meta = doc["summary"], doc["meta"]
    changed = [r for r in doc["rows"] if "gain" in r]
    lost = sum(r["gain"] < 1 for r in changed)
    shapes = len({(r["m"], r["k"]) for r in doc["rows"]})
    return (f"- 2:4, opt-in tile tuning (`kp.sparse24.tune_tiles`, the first {meta['top']} tiles of the kernel the rule "
            f"runs) over "
            f"{shapes} sweep-set shapes at n = {', '.join(map(str, meta['batch']))}: another tile kept on "
            f"{s['changed']} of {s['tuned']} problems; timed again afresh, the kept tile over the rule's, median "
            f"{s['gain_median']:.3f}x ({s['gain_min']:.3f}-{s['gain_max']:.3f}x, {lost} under 1); over all "
            f"{s['tuned']}, mean {s['mean_gain_over_tuned']:.3f}x; tuning took {s['tune_s']:.0f} s, "
            f"{_source(meta, name)}.")


def _held_out_models() -> list[str]:
    """The model families held out of issue 26's model (bench/sparse24_model.py --model): a bullet, then a table."""
    from model_bound import bound

    names = sorted(p.stem for p in RESULTS.glob("sparse24-model-*.json")
                   if not p.stem.startswith("sparse24-model-host-")  # bench/sparse24_model_host.py's host profiles
                   and json.loads(p.read_text())["meta"].get("architecture", DEFAULT_MODEL) != DEFAULT_MODEL)
    if not names:
        return []
    cases = [r["case"] for r in _load(names[0])["rows"]]
    lines = ["- 2:4 on model families held out of the model above (`bench/sparse24_model.py --model`: each family's "
             "transformers class at its published sizes, 4 layers, random weights), sparsified against dense: CUDA "
             "graph / eager, and in brackets the 2:4 layers' own speedup in the profiled eager step "
             "(`tools/model_bound.py`); weights held over dense's, embeddings dense:", "",
             "| model | " + " | ".join(cases) + " | weights | measured on |",
             "|---|" + "---|" * (len(cases) + 2)]
    for name in names:
        doc = _load(name)
        cells = []
        for r in doc["rows"]:
            own = f" ({bound(r, 1.3, 2.0)['sparse_layers_speedup']:.2f}x)" if "device_ms_by_kernel" in r else ""
            cells.append(f"{r['graph_speedup']:.2f}x / {r['eager_speedup']:.2f}x{own}")
        head = "head pruned" if doc["head_pruned"] else "head tied, dense"
        lines.append(f"| {doc['meta']['model']} | " + " | ".join(cells) +
                     f" | {doc['sparse_over_dense_bytes']:.3f}x, {head} | {_source(doc['meta'], name)} |")
    return lines + [""]


def _compiled_note(doc: dict, name: str) -> str:
    """bench/sparse24_compiled.py: the model's steps, dense and sparse both compiled in one mode, and the op's call."""
    meta = doc["meta"]
    steps = [r for r in doc["rows"] if r["part"] == "model" and "ms" in r]
    held = next(r for r in doc["rows"] if r.get("case") == "weight bytes")
    cases = "; ".join(f"{r['case']} {r['compiled_speedup']:.2f}x ({r['ms']['sparse compiled']:.2f} against "
                      f"{r['ms']['dense compiled']:.2f} ms a step; not compiled {r['eager_speedup']:.2f}x"
                      + (f"; sparsified with `fuse=False` {r['unfused_compiled_speedup']:.2f}x"
                         if "unfused_compiled_speedup" in r else "") + ")"
                      for r in steps)
    layer = [r for r in doc["rows"] if r["part"] == "layer"]
    op = ("; `kernelplan::sparse24_linear` (the op's autograd form) called alone "
          + ", ".join(f"{r['us_per_call']['kernelplan::sparse24_linear']:.1f} us" for r in layer)
          + f" a call ({layer[0]['m']}x{layer[0]['k']} at n = " + ", ".join(str(r["n"]) for r in layer) + ")") \
        if layer else ""
    context = meta.get("context", "inference_mode")
    return (f"- 2:4 under `torch.compile` (mode \"{meta['mode']}\", under `torch.{context}`, "
            f"`bench/sparse24_compiled.py`), Llama with Qwen2.5-7B sizes ({meta['layers']} layers), sparsified "
            f"against dense, both compiled: {cases}{op}; "
            f"weights {held['sparse_over_dense']:.3f}x of dense, {_source(meta, name)}.")


def sparse24_notes() -> list[str]:
    """The 2:4 model, conversion and host-work results, one line each."""
    lines = []
    for name in ("sparse24-model-h100", "sparse24-model-h200", "sparse24-model-tall-k-h200",
                 "sparse24-model-small-n-split-h200", "sparse24-model-split3-ab1-h200", "sparse24-model-rules-0067-h200",
                 "sparse24-model-one-x-h200", "sparse24-model-y16-h200", "sparse24-model-pp-ties-h200",
                 "sparse24-model-direct-call-h200", "sparse24-model-fast-entry-h200", "sparse24-model-whole-k-h200",
                 "sparse24-model-tuned-h100", "sparse24-model-tuned-h200"):
        model = _load(name)
        if model:
            cases = "; ".join(f"{r['case']} {r['graph_speedup']:.2f}x graph{_ungrouped(r)}, "
                              f"{r['eager_speedup']:.2f}x eager" for r in model["rows"])
            tuned = f", its tiles tuned first (`kp.warmup(tune=True)`, {model['tune_s']:.0f} s)" \
                if model["meta"].get("tuned") else ""
            lines.append(f"- 2:4, {model['meta']['model']} ({model['meta']['layers']} layers), sparsified{tuned}, "
                         f"against dense: {cases}; weights {model['sparse_over_dense_bytes']:.3f}x of dense "
                         f"(embeddings dense, the LM head pruned too), {_source(model['meta'], name)}.")
    lines += _held_out_models()
    lines += [_compiled_note(doc, name) for name in ("sparse24-compiled-default-h200",
                                                     "sparse24-compiled-inference-op-inference_mode-h200",
                                                     "sparse24-compiled-inference-op-no_grad-h200",
                                                     "sparse24-compiled-reduce-overhead-h200") if (doc := _load(name))]
    for name in ("sparse24-experts-h100", "sparse24-experts-h200"):
        doc = _load(name)
        if doc and "graph_ms" in doc["rows"][0]:
            lines.append(_experts_note(doc, name))
    for names, note in ((("sparse24-tile-tuning-h100", "sparse24-tile-tuning-h200", "sparse24-tile-tuning-top16-h100",
                          "sparse24-tile-tuning-top16-h200", "sparse24-tile-tuning-small-n-h100"), _tile_tuning_note),
                        (("sparse24-moe-model-h100", "sparse24-moe-model-h200", "sparse24-moe-model-llama4-h200"),
                         _moe_model_note),
                        (("sparse24-moe-route-h200", "sparse24-moe-route-chunks-h200", "sparse24-moe-route-scan-h200"),
                         _moe_route_note),
                        (("sparse24-moe-route-bound-h200",), _moe_route_bound_note),
                        (("sparse24-experts-every-token-h200",), _every_token_note)):
        lines += [note(doc, name) for name in names if (doc := _load(name))]
    for name in ("sparse24-siblings-sweep-h100", "sparse24-siblings-sweep-h200"):
        sweep = _load(name)
        if sweep:
            rows = sweep["rows"]
            spans = _by_n(rows, lambda med: f"{med('sparse_grouping_gain'):.2f}x (2:4 over dense, both grouped, "
                                            f"{med('grouped_speedup'):.2f}x)")
            lines.append(f"- 2:4, sibling layers as one GEMM (`kp.nn.fuse_siblings`) over the sweep set's "
                         f"{len({(r['k'], tuple(r['parts'])) for r in rows})} q/k/v and gate/up groups, CUDA graph, "
                         f"separate GEMMs' time over one GEMM's, median: {spans}, {_source(sweep['meta'], name)}.")
    for name in ("sparse24-gated-sweep-h100", "sparse24-gated-sweep-h200"):
        sweep = _load(name)
        if sweep:
            rows = sweep["rows"]
            spans = _epilogue_spans(rows)
            lines.append(f"- 2:4 gate/up with the gated epilogue (`kp.sparse24.gated_linear`, SwiGLU) over the sweep "
                         f"set's {len({(r['k'], r['h']) for r in rows})} gated MLP shapes, CUDA graph, median against "
                         f"dense as Hugging Face runs it (two `F.linear`, then `silu(g) * u`), and the epilogue's gain "
                         f"over the grouped 2:4 GEMM then `kp.gated_activation`: {spans}, "
                         f"{_source(sweep['meta'], name)}.")
    for name in ("sparse24-activated-h100", "sparse24-activated-h200"):
        doc = _load(name)
        if doc:
            for act in ("gelu", "gelu_tanh"):
                rows = [r for r in doc["rows"] if r["act"] == act]
                spans = _epilogue_spans(rows)
                lines.append(f"- 2:4 up projection with {act} in the epilogue (`kp.nn.activated`'s route) over the sweep "
                             f"set's {len({(r['m'], r['k']) for r in rows})} MLP up shapes with bias, CUDA graph, median "
                             f"against dense as Hugging Face runs it (`F.linear`, then `F.gelu`), and the epilogue's gain "
                             f"over the 2:4 GEMM then `F.gelu`: {spans}, {_source(doc['meta'], name)}.")
            for model in dict.fromkeys(r["model"] for r in doc["models"]):
                cases = [r for r in doc["models"] if r["model"] == model and "batch" in r]
                held = next(r for r in doc["models"] if r["model"] == model and "weight_bytes" in r)
                cells = "; ".join(f"{r['batch']}x{r['seq']} tokens {r['graph_speedup']:.2f}x graph "
                                  f"({r['graph_speedup_unrouted']:.2f}x unrouted), {r['eager_speedup']:.2f}x eager"
                                  for r in cases)
                bytes_ = held["weight_bytes"]
                host = held.get("mlp_call_us", {}).get("host_us")
                mlp = (f"; host work of one MLP's eager call at {'x'.join(map(str, held['mlp_call_tokens']))} tokens "
                       f"{host['sparse']:.1f} us routed, {host['sparse unrouted']:.1f} us unrouted, {host['dense']:.1f} "
                       f"us dense" if host else "")
                lines.append(f"- 2:4, {model} (random weights) sparsified against dense, its MLPs routed: {cells}{mlp}; "
                             f"weights {bytes_['sparse'] / bytes_['dense']:.3f}x of dense, {_source(doc['meta'], name)}.")
    big = _load("sparse24-70b-memory-h200")
    if big:
        d, s = big["dense"], big["sparse"]
        lines.append(f"- 2:4, a Llama-3-70B-shaped model (80 layers, random bf16 weights) on one GPU of "
                     f"{s['device_total_gib']:.1f} GiB: weights {d['dense_weight_gib']:.1f} GiB dense, "
                     f"{s['weight_gib']:.1f} GiB sparsified; free after a decode step {d['free_after_step_gib']:.1f} "
                     f"against {s['free_after_step_gib']:.1f} GiB ({d['kv_tokens_that_fit_in_free']:,} against "
                     f"{s['kv_tokens_that_fit_in_free']:,} more tokens of KV cache); decode step at batch 1, CUDA "
                     f"graph, {d['decode_step_ms']:.1f} ms dense, {s['decode_step_ms']:.1f} ms sparse "
                     f"({d['decode_step_ms'] / s['decode_step_ms']:.2f}x; the models in turn, they do not fit together), "
                     f"{_source(big['meta'], 'sparse24-70b-memory-h200')}.")
    scout = _load("sparse24-llama4-scout-memory-h200")
    if scout:
        lines.append(_fits_note(scout, "sparse24-llama4-scout-memory-h200"))
    vision = _load("sparse24-vision-h200")
    if vision:
        lines.append(_vision_note(vision, _load("sparse24-vision-before-h200")))
    for gpu in ("h100", "h200"):
        convert = _load(f"sparse24-convert-{gpu}")
        if convert:
            big = [r for r in convert["rows"] if r["m"] * r["k"] >= 2**26]
            ops = ", ".join(f"{op.replace('_', ' ')} {min(r[op]['of_copy'] for r in big):.2f}-"
                            f"{max(r[op]['of_copy'] for r in big):.2f}x"
                            for op in ("pack", "unpack", "compress", "prune", "prune_compress_packed", "from_dense")
                            if op in big[0])
            lines.append(f"- 2:4 conversions on the GPU, whole calls (the host's wait on the refusal flag included), "
                         f"of the copy bandwidth, layers of 64M weights and up: {ops}, "
                         f"{_source(convert['meta'], f'sparse24-convert-{gpu}')}.")
        blocks = _load(f"sparse24-convert-blocks-{gpu}")
        if blocks:
            big = [r for r in blocks["rows"] if r["m"] * r["k"] >= 2**26]
            best = lambda part: [max(v["kernel_of_copy"] for v in r[part].values()) for r in big]  # noqa: E731
            lines.append(f"- 2:4 conversion kernels alone (`bench/sparse24_convert_blocks.py`, launched back to back), "
                         f"of the copy bandwidth, layers of 64M weights and up, best block: dense straight into the "
                         f"device layout {_span(best('tiled'))}, into the public format {_span(best('public'))}, "
                         f"{_source(blocks['meta'], f'sparse24-convert-blocks-{gpu}')}.")
    rate = _load("wgmma-rate-h100")
    if rate:
        pick = lambda **want: next(r for r in rate["rows"] if all(r[k] == v for k, v in want.items()))
        alone = pick(sparse=1, ni=256, chains=1, wgs=2, reload=0, copy=0)
        dense = pick(sparse=0, ni=256, chains=1, wgs=2, reload=0, copy=0)["fma_per_cycle"]
        cells = ", ".join(f"{pick(sparse=1, ni=ni, wgs=2, chains=1, reload=1, sets=2, copy=0, fresh_b=1)['fma_per_cycle'] / dense:.2f}x"
                          f" / {pick(sparse=1, ni=ni, wgs=2, chains=1, reload=4, copy=0)['fma_per_cycle'] / dense:.2f}x"
                          f" at {ni} rows of x" for ni in (64, 128, 256))
        lines.append(f"- The ceiling of a 2:4 kernel's main loop (`bench/wgmma_rate.py`): `wgmma.sp` alone runs "
                     f"{alone['fma_per_cycle'] / dense:.2f}x dense `wgmma`'s multiply-adds a cycle; with its A "
                     f"fragments read from shared memory into registers each step (the kernels before d9ce76a) / "
                     f"with A read by the instruction from shared memory (the kernels since): {cells} a step "
                     f"(docs/design/0012, 0013), {_source(rate['meta'], 'wgmma-rate-h100')}.")
    clocks = _load("sparse24-clocks-h100")
    if clocks:
        rows = clocks["rows"]
        span = lambda key: f"{min(r[key] for r in rows):.0f}-{max(r[key] for r in rows):.0f}"
        lines.append(f"- The 2:4 kernel (`cuda_ws`) and dense `F.linear` each replayed back to back for a second "
                     f"(`bench/sparse24_clocks.py`, {len(rows)} problems at n = 256-4096): SM clock dense "
                     f"{span('dense_mhz')} MHz, 2:4 {span('sparse_mhz')} MHz; power dense {span('dense_watts')} W, "
                     f"2:4 {span('sparse_watts')} W; speedup in time {_span([r['speedup'] for r in rows])}, in cycles "
                     f"{_span([r['cycle_speedup'] for r in rows])}, {_source(clocks['meta'], 'sparse24-clocks-h100')}.")
    for name in ("sparse24-host-h100", "sparse24-host-768-n256-h100"):
        host = _load(name)
        if host:
            size, n = host["meta"]["size"], host["meta"].get("n", 1)
            cells = ", ".join(f"{fn} {t:.1f} us" for fn, t in host["no_grad"].items())
            lines.append(f"- Host work of one eager call ({size}x{size} bf16, n = {n}, `torch.no_grad`): {cells}, "
                         f"{_source(host['meta'], name)}.")
    weights = _load("sparse24-host-weights-h200")
    if weights:
        lines.append(_host_weights_note(weights, "sparse24-host-weights-h200"))
    return lines


def _host_weights_note(doc: dict, name: str) -> str:
    """Host work of an eager call against torch's, with one weight and with a loop over many, by call."""
    rows = doc["rows"]
    counts = sorted({r["weights"] for r in rows})
    spans = []
    for ours, theirs in (("kp.sparse24.linear", "F.linear"), ("Sparse24Linear", "nn.Linear")):
        by = {w: _span([r[ours] / r[theirs] for r in rows if r["weights"] == w]) for w in counts}
        spans.append(f"`{ours}` over `{theirs}` " + ", ".join(f"{v} with {w} weight{'s' * (w > 1)}"
                                                               for w, v in by.items()))
    shapes = ", ".join(sorted({f"{r['m']}x{r['k']}" for r in rows}))
    ns = ", ".join(str(n) for n in sorted({r["n"] for r in rows}))
    return (f"- Host work of one eager call as a loop cycles over one weight or many, as a model's layers are called "
            f"(`bench/sparse24_host_weights.py`; {shapes}; n = {ns}; bf16, no bias), ours over torch's, medians of "
            f"rounds: " + "; ".join(spans) + f", {_source(doc['meta'], name)}.")


def _spread(doc: dict) -> tuple[float, float]:
    """The median and the largest of a pretrained-model result's per-layer input spreads."""
    values = sorted(doc["input_spread"].values())
    return values[len(values) // 2], values[-1]


def pruning_notes() -> list[str]:
    """Perplexity of the trained test model and of a pretrained decoder by pruning method, a pretrained encoder's
    embeddings, and calibration time of an 8B-shaped layer."""
    lines = []
    acc = _load("accuracy-h100")
    if acc:
        rows = {r["model"]: r for r in acc["rows"]}
        cells = "; ".join(f"{m} {r['perplexity']:.3f} ({r['increase']:+.3f})" for m, r in rows.items())
        lines.append(f"- Pruning to 2:4, held-out perplexity per byte of the trained byte-level Llama "
                     f"(`kernelplan bench accuracy`): {cells}, {_source(acc['meta'], 'accuracy-h100')}.")
        if acc.get("outlier_rows"):
            rows = {r["model"]: r for r in acc["outlier_rows"]}
            cells = "; ".join(f"{m} {r['increase']:+.3f}" for m, r in rows.items() if m != "dense")
            plain, spread = acc["rows"][0]["input_spread_median"], rows["dense"]["input_spread_median"]
            lines.append(f"- The same model with outlier features folded into its norm gains (same function, dense "
                         f"{rows['dense']['perplexity']:.3f}; layers' input spread, max/median column norm, median "
                         f"{plain:.1f} -> {spread:.1f}), increase over dense: {cells} "
                         f"(`bench/accuracy_table.py`, `accuracy.fold_outliers`).")
    for name in ("accuracy-lora-cpu", "accuracy-lora-h200"):
        lora = _load(name)
        if not lora:
            continue
        meta, rows = lora["meta"], lora["rows"]
        dense = rows[0]

        def cell(r: dict) -> str:
            merged = f", merged {r['after_merge']:.3f}" if "after_merge" in r else ""
            return (f"{r['model']} {r['lora']} {r['perplexity']:.3f} -> {r['after_lora']:.3f}{merged} (over dense "
                    f"{r['gap_before']:+.3f} -> {r['gap_after']:+.3f})")

        seconds = {v: statistics.median(r["train_seconds"] for r in rows[1:] if r["lora"] == v)
                   for v in dict.fromkeys(r["lora"] for r in rows[1:])}
        lines.append(f"- LoRA on the pruned model (`kp.nn.lora`, `bench/accuracy_lora.py`): the same byte-level Llama, "
                     f"{meta['steps']} steps of rank {meta['rank']} on every projection, batches of {meta['batch']} "
                     f"({dense['lora_parameters']:,} adapter parameters), its 2:4 weights frozen; masked: the update "
                     f"cut to the 2:4 mask and merged into the 2:4 weights afterwards. Held-out perplexity on the "
                     f"first {meta['held_out_bytes']:,} bytes; the dense model trained alike {dense['perplexity']:.3f} "
                     f"-> {dense['after_lora']:.3f}: {'; '.join(cell(r) for r in rows[1:])}; training, median a "
                     f"run: {', '.join(f'{v} {t:.0f} s' for v, t in seconds.items())}, {_source(meta, name)}.")
    moe = _load("accuracy-moe-h200")
    if moe:
        rows = moe["rows"]
        cfg = moe["config"]

        def cells(experts: str) -> str:
            return "; ".join(f"{r['model']} {r['perplexity']:.3f} ({r['increase']:+.3f})" for r in rows
                             if r["experts"] == experts)

        lines.append(f"- Pruning a trained MoE to 2:4, a byte-level Mixtral ({cfg['num_hidden_layers']} layers of "
                     f"{cfg['num_local_experts']} experts, top {cfg['num_experts_per_tok']}; trained "
                     f"{moe['train_log'][-1]['step']} steps here), held-out perplexity per byte "
                     f"(`bench/accuracy_moe.py`), dense {rows[0]['perplexity']:.3f}: experts pruned too "
                     f"(each on the tokens routed to it), {cells('all')}; attention only, {cells('none')}; "
                     f"{_source(moe['meta'], 'accuracy-moe-h200')}.")
    pre = _load("accuracy-minilm-cpu")
    if pre:
        res, meta, (median, _) = pre["methods"], pre["meta"], _spread(pre)
        cells = "; ".join(f"{m} {r['cosine']:.3f}, retrieval {r['retrieval']:.3f}" for m, r in res.items()
                          if m != "dense")
        lines.append(f"- Pruning a real pretrained model to 2:4, all-MiniLM-L6-v2 (22M parameters, 36 linear layers, "
                     f"input spread median {median:.1f}), {meta['held_out_windows']} held-out "
                     f"windows of {meta['seq']} tokens (`bench/accuracy_pretrained.py`): cosine of the embeddings to "
                     f"dense's and retrieval of each window's second half from its first (dense "
                     f"{res['dense']['retrieval']:.3f}, standard error about {res['dense']['retrieval_se']:.3f}): "
                     f"{cells}, {_source(meta, 'accuracy-minilm-cpu')}.")
    smol = _load("accuracy-smollm2-cpu")
    if smol:
        res, meta, (median, most) = smol["methods"], smol["meta"], _spread(smol)
        cells = "; ".join(f"{m} {r['perplexity']:.1f} ({r['increase']:+.1f})" for m, r in res.items())
        lines.append(f"- Pruning a real pretrained decoder to 2:4, SmolLM2-135M-Instruct (the Q4_1 GGUF on PyPI, "
                     f"dequantized; 210 linear layers, input spread median {median:.1f}, max "
                     f"{most:.0f}), held-out perplexity on {meta['held_out_windows']} windows of {meta['seq']} "
                     f"tokens, {meta['calibration_windows']} calibration windows (`bench/accuracy_smollm.py`): "
                     f"{cells}, {_source(meta, 'accuracy-smollm2-cpu')}.")
    layer = _load("sparsify-layer-h100")
    if layer:
        cells = "; ".join(f"{r['method']} {r['run']} {r['seconds']:.1f} s" for r in layer["rows"])
        lines.append(f"- Calibrated pruning of one Llama-3-8B-shaped layer, {layer['meta']['sequences']} sequences "
                     f"of {layer['meta']['seq']} tokens (`bench/sparsegpt_layer.py`): {cells}, "
                     f"{_source(layer['meta'], 'sparsify-layer-h100')}.")
    cmp = _load("llmcompressor-compare-cpu")
    if cmp:
        cells = "; ".join(f"{m}: perplexity {r['kernelplan_perplexity']:.4f} against {r['llmcompressor_perplexity']:.4f}, "
                          f"{r['mask_agreement_mean']:.1%} of the mask kept alike" for m, r in cmp["methods"].items())
        lines.append(f"- Beside llm-compressor {cmp['llmcompressor']} on the trained test model, same "
                     f"{cmp['calibration_windows']} calibration windows (`bench/compare_llmcompressor.py`): {cells}, "
                     f"{cmp['device']} at {cmp['commit']} (`bench/results/llmcompressor-compare-cpu.json`).")
    stream = _load("sparsify-stream-cpu")
    if stream:
        lines.append(f"- `kernelplan sparsify IN.safetensors OUT.safetensors` on a {stream['file_bytes'] / 2**30:.1f} GiB "
                     f"bf16 file ({stream['layers']} layers): peak RSS {stream['stream_peak_rss_bytes'] / 2**30:.2f} "
                     f"GiB, a tensor at a time, against {stream['whole_peak_rss_bytes'] / 2**30:.2f} GiB loading the "
                     f"file whole (`bench/sparsify_stream_rss.py`), {stream['device']} ({stream['cpu_count']} CPUs) at "
                     f"{stream['commit']} (`bench/results/sparsify-stream-cpu.json`).")
    return lines


def runtime_notes() -> list[str]:
    """The device runtime's round trips (CPU workers on a 2-core machine and on a GPU host, GPU workers) and a 2:4
    linear through it."""
    lines = []
    for name in ("runtime-cpu", "runtime-cpu-host", "runtime-gpu"):
        doc = _load(name)
        if not doc:
            continue
        line = (f"- Device runtime (`kernelplan.runtime`), a tiny request's round trip: one at a time "
                f"{doc['tiny_one_at_a_time_us']:.0f} us, pipelined 64 deep {doc['tiny_pipelined_64_us']:.0f} us a "
                f"request (a bare pipe to an echo process: {doc['raw_pipe_one_at_a_time_us']:.0f} and "
                f"{doc['raw_pipe_pipelined_64_us']:.0f} us)")
        s = doc.get("sparse24")
        if s:
            line += (f"; a 2:4 linear at n = 16 on 8192x8192 bf16 through it, 64 in flight: "
                     f"{s['runtime_over_direct']:.2f}x of direct calls' throughput, {s['prepared_over_direct']:.2f}x "
                     f"prepared" + (f", {s['rebuilt_over_direct']:.2f}x with a new request object each call"
                                    if "rebuilt_over_direct" in s else ""))
        lines.append(line + f", {doc['device']} ({doc['cpu_count']} CPUs) at {doc['commit']} (`bench/results/{name}.json`).")
    return lines


def table() -> str:
    head = ["| op | " + " | ".join(label for label, _, _ in N_RANGES) + " | measured on |",
            "|---|" + "---|" * len(N_RANGES) + "---|"]
    body = newest_rows()
    # Then each file as it was measured: the full sweeps (12 n) of both GPUs (f6ca3b0, 0044), then their n <= 16 part again, bf16 and f16, under today's
    # rule (0047: wide weights' K-split tile; bf16 with 0050's kernel, f16 at d3d2493, 0048), and their n = 32-512
    # part again (0051's rule, a0f610c), and their n >= 1024 part after the pushed sums (87515b0, 0052; the H200's
    # n = 1024 and 2048), then the LM heads at n <= 512 and the H200's at n = 1024-2048 (0053), then n = 256-2048
    # again under 0054's multicast rule and the rest of the heads' n (1e71ed3), then the H200's f16 at n = 32-2048
    # (0055) and 4096-8192 (0056), the held-out models (0057, 0059), and the H200's n = 32-512 under the floor on a
    # step (b050ae4, 0059; f16 at 175e4e8), then the H200's n <= 16 and n >= 1024 under today's rule and kernels
    # (1662b90, 0060; f16 to n = 2048) and the held-out models' n <= 8 under the tall weights' K bound (bfa4f0a,
    # 0060), then n <= 16 of the sweep set (bf16, f16) and the held-out models under the small-n K splits (dff7c60,
    # 0061), and so on by record (the later files' names say which); the bf16 quick sweeps (4f17378) stay in results/.
    for name in ("sparse24-sweep-h200", "sparse24-sweep-h100", "sparse24-sweep-small-n-h200",
                 "sparse24-sweep-small-n-h100", "sparse24-sweep-mid-n-h200", "sparse24-sweep-mid-n-h100",
                 "sparse24-sweep-large-n-h200", "sparse24-sweep-large-n-h100",
                 "sparse24-sweep-lm-heads-h200", "sparse24-sweep-lm-heads-h100",
                 "sparse24-sweep-unicast-h200", "sparse24-sweep-unicast-h100", "sparse24-sweep-unicast-n512-h100",
                 "sparse24-sweep-lm-heads-large-n-h200", "sparse24-sweep-lm-heads-large-n-h100",
                 "sparse24-sweep-lm-heads-xl-n-h200", "sparse24-sweep-held-out-models-h200",
                 "sparse24-sweep-held-out-tall-k-h200",
                 "sparse24-sweep-floor-mid-n-h200", "sparse24-sweep-uneven-k-small-n-h200",
                 "sparse24-sweep-uneven-k-large-n-h200", "sparse24-sweep-uneven-k-xl-n-h200",
                 "sparse24-sweep-small-n-split-h200", "sparse24-sweep-held-out-small-n-split-h200",
                 "sparse24-sweep-small-n-split3-h200", "sparse24-sweep-held-out-small-n-split3-h200",
                 "sparse24-sweep-small-n-small-grid-h200", "sparse24-sweep-held-out-small-n-small-grid-h200",
                 "sparse24-sweep-small-n-slots-h200", "sparse24-sweep-small-n-deep-ring-h200",
                 "sparse24-sweep-held-out-small-n-deep-ring-h200", "sparse24-sweep-wide-k-splits-h200",
                 "sparse24-sweep-wide-k-splits-n32-64-h200", "sparse24-sweep-held-out-mid-n-h200",
                 "sparse24-sweep-held-out-large-n-h200", "sparse24-sweep-one-x-n128-h200",
                 "sparse24-sweep-held-out-one-x-n128-h200", "sparse24-sweep-pp-ties-n128-1024-h200",
                 "sparse24-sweep-held-out-pp-ties-n128-1024-h200", "sparse24-sweep-y16-cut-short-h200",
                 "sparse24-sweep-y16-n256-2048-h200", "sparse24-sweep-pp-ties-192-n128-512-h200",
                 "sparse24-sweep-held-out-pp-ties-192-n128-512-h200", "sparse24-sweep-n4096-8192-h200",
                 "sparse24-sweep-host-path-h200", "sparse24-sweep-fast-entry-h200",
                 "sparse24-sweep-held-out-fast-entry-h200", "sparse24-sweep-held-out-fast-entry-n64-4096-h200",
                 "sparse24-sweep-padded-k-h200", "sparse24-sweep-padded-k-h200-f16",
                 "sparse24-sweep-h100-l2warm", "sparse24-sweep-h200-l2warm",
                 "sparse24-sweep-h200-f16-quick", "sparse24-sweep-h100-f16-quick", "sparse24-sweep-small-n-f16-h200",
                 "sparse24-sweep-small-n-f16-h100", "sparse24-sweep-f16-mid-h200", "sparse24-sweep-f16-large-n-h200",
                 "sparse24-sweep-f16-floor-mid-n-h200", "sparse24-sweep-f16-uneven-k-small-n-h200",
                 "sparse24-sweep-f16-uneven-k-large-n-h200", "sparse24-sweep-f16-small-n-split-h200",
                 "sparse24-sweep-f16-small-n-split3-h200", "sparse24-sweep-f16-small-n-deep-ring-h200",
                 "sparse24-sweep-f16-wide-k-splits-h200", "sparse24-sweep-f16-wide-k-splits-n32-64-h200",
                 "sparse24-sweep-f16-one-x-n128-h200", "sparse24-sweep-f16-pp-ties-n128-1024-h200",
                 "sparse24-sweep-f16-y16-h200", "sparse24-sweep-f16-pp-ties-192-n256-512-h200",
                 "sparse24-sweep-f16-n4096-8192-h200", "sparse24-sweep-f16-fast-entry-cut-short-h200",
                 "sparse24-sweep-h100-f16-l2warm",
                 "sparse24-sweep-h200-f16-l2warm"):
        body += sweep_rows(name)
    for name in ("sparse24-h200", "sparse24-h100", "sparse24-h200-f16"):
        body += sparse24_rows(name)
    lines = head + body + [""] + sparse24_notes()
    lines += pruning_notes()
    lines += runtime_notes()
    gated = _load("gated-h200")
    if gated:
        rows = gated["suites"]["gated"]
        fwd = [r["of_copy"] for r in rows if r.get("direction") == "fwd"]
        both = [r["of_copy"] for r in rows if r.get("direction") == "fwd+bwd"]
        lines.append(f"- Gated activations (GLU, ReGLU, SwiGLU, GeGLU): forward at {min(fwd):.0%}-{max(fwd):.0%} "
                     f"and forward+backward at {min(both):.0%}-{max(both):.0%} of the copy bandwidth, "
                     f"{_source(gated, 'gated-h200')}.")
    gemm = _load("gemm-h200")
    if gemm:
        fp8 = [r["torch_ms"] / r["kp_ms"] for r in gemm["suites"]["gemm"]
               if str(r.get("case", "")).startswith("fp8 rowwise") and r.get("dtype") == "bfloat16"]
        if fp8:
            lines.append(f"- fp8 row-wise linear: {min(fp8):.2f}-{max(fp8):.2f}x of the bf16 `F.linear` at "
                         f"8192^3, {_source(gemm, 'gemm-h200')}.")
    return "\n".join(lines).rstrip() + "\n"


def readme_block(text: str) -> str:
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    return text[start:stop].strip("\n") + "\n"


def main() -> int:
    text = README.read_text()
    start, stop = text.index(BEGIN) + len(BEGIN), text.index(END)
    README.write_text(text[:start] + "\n" + table() + text[stop:])
    print(f"wrote the performance table into {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
