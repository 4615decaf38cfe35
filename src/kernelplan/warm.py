"""``kp.warmup``: a model's 2:4 kernels compiled and its dispatch settled before its first request.

For every ``Sparse24Linear`` of the model:

1. the kernel the dispatch rule names (``sparse24/dispatch.py``) and its tile
   configuration for every n up to the largest batch size asked for (``every_n``; else for those batch sizes
   alone), compiled by NVRTC in threads, distinct kernels at once (NVRTC is thread-safe) or read from the disk
   cache (``kernels/kernel_cache.py``).  The rule picks one tile for each run of 8 n (``dispatch.rule_points``),
   and a layer has 5-39 distinct tiles up to n = 2048 (median 24 over the sweep set's 43 shapes, 132 SMs):
   a serving loop's batch sizes then never compile;
2. at every batch size asked for, one call of the layer on zeros, under ``torch.inference_mode``: the
   kernel is loaded, its launch prepared, and the layer's inference fast path
   filled, so that a later call of the same shape compiles, tunes and builds nothing.
   (Under ``memory="fast"`` that first call is where the bucket is tuned.)

The same for each sibling group (``kp.nn.fuse_siblings``) that has settled, that is after the model's first
pass: one GEMM of all its layers' rows; for each gated MLP's GEMM (``kp.nn.gated_siblings``) whose group has
settled, or that needs none (Phi-3's): its rows with the gated epilogue; and for each MLP with one activation
(``kp.nn.activated``): its first layer with the activation in the epilogue.  A group that has not settled yet builds
its kernel on its first call.  A MoE layer's experts (``kp.nn.Sparse24Experts``) that run on the grouped kernel get
each of its tiles for both projections (the tile follows the rows each expert gets, whatever the batch size), in
place of their per-expert layers, which only autograd calls there.

Returns one row per (layer shape, batch size): the kernel, its configuration, the
speedup over dense the sweeps measured on this kind of GPU (``sparse24/expected.py``), and the
compile phase's kernels and seconds (all layers together).
"""

from __future__ import annotations

import concurrent.futures
import time

import torch

from .errors import InvalidProblem
from .nn.experts import Sparse24Experts
from .nn.sparse24_linear import Sparse24Linear

DEFAULT_BATCH_SIZES = (1, 16, 128, 2048)


def _variant(layer: Sparse24Linear, n: int):
    """``(backend, config, compile)`` of the rule's kernel for ``layer`` at n rows; compile is None off CUDA."""
    from .dtypes import dtype_info
    from .sparse24 import GemmSparse24Plan
    from .sparse24.gemm import _descriptor, rule_backend

    dev = layer.values.device
    epilogue = getattr(layer, "epilogue", None)
    desc = _descriptor(n, layer.out_features, layer.in_features, layer.values.dtype, epilogue, layer.bias is not None,
                       dev, False, layer.memory)
    backend = rule_backend(desc)
    kernel = getattr(GemmSparse24Plan.registry.get(backend), "kernel", None)
    if dev.type != "cuda" or kernel is None or layer.memory != "compact":
        return backend, None, None
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    cfg, compile_ = kernel().compile_for(n, layer.out_features, layer.in_features, dtype_info(layer.values.dtype).name,
                                         layer.bias is not None, epilogue, index)
    return backend, cfg, compile_


def _expected(layer: Sparse24Linear, n: int):
    """The sweeps' speedup for this layer's shape at n on this GPU; None off CUDA or on a GPU never swept."""
    from .dtypes import dtype_info
    from .sparse24.expected import expected

    dev = layer.values.device
    if dev.type != "cuda" or layer.memory != "compact":
        return None
    return expected(torch.cuda.get_device_name(dev), dtype_info(layer.values.dtype).name, layer.out_features,
                    layer.in_features, n)


def _groups(layers: list[Sparse24Linear]) -> list:
    """The sibling groups of these layers (``kp.nn.fuse_siblings``) settled so far, each once."""
    from .nn.siblings import siblings_of

    out = {}
    for layer in layers:
        siblings = siblings_of(layer)
        for g in (siblings.groups or ()) if siblings is not None else ():
            out.setdefault(id(g), g)
    return list(out.values())


class _GroupShape:
    """A sibling group as ``_variant`` and ``_expected`` read a layer: one GEMM of all its members' rows."""

    def __init__(self, group):
        first = group.members[0]
        self.values, self.in_features, self.memory = first.values, first.in_features, first.memory
        self.out_features = sum(group.rows)
        self.bias = first.bias


class _RouteShape:
    """A routed module's GEMM with an epilogue (``nn/routes.py``: a gated MLP's gate and up rows with the gated
    epilogue, or an MLP's first layer with its activation) as ``_variant`` reads a layer."""

    def __init__(self, route):
        first, self.out_features, self.epilogue = route.epilogue_layer()
        self.values, self.in_features, self.memory = first.values, first.in_features, first.memory
        self.bias = first.bias
        self.route = route


def warmup(model: torch.nn.Module, batch_sizes=DEFAULT_BATCH_SIZES, progress: bool = True,
           threads: int = 8, every_n: bool = True, tune: bool = False) -> list[dict]:
    """Compile every kernel and settle every dispatch choice of ``model``'s 2:4 layers at ``batch_sizes``, and of
    their sibling groups settled so far, gated MLPs' included (a group settles on the model's first pass: warm up
    after it to warm the groups' GEMMs too).  With ``every_n``, the kernels of every n up to the largest batch size
    are compiled too, so that no call of up to that many rows compiles.  With ``tune`` (opt-in), the tile of the
    kernel the rule runs (``cuda_ws``, or ``cuda_sp``) for each GEMM at each of ``batch_sizes`` is tuned first
    (``sparse24/tiles.py``: timed, or read back from the plan cache), and each row says what it kept (``tile``:
    "rule", or the gain of the tile kept over it)."""
    from .nn.routes import route_of
    from .sparse24.dispatch import rule_points

    from tqdm.auto import tqdm

    if not isinstance(model, torch.nn.Module):
        raise InvalidProblem(f"model is a {type(model).__name__}; warmup takes an nn.Module")
    sizes = sorted({int(n) for n in batch_sizes})
    if not sizes or sizes[0] < 1:
        raise InvalidProblem(f"batch_sizes is {tuple(batch_sizes)}; give positive numbers of rows, "
                             "such as (1, 16, 128)")
    grouped = [m for m in model.modules() if isinstance(m, Sparse24Experts) and
               m.runs_grouped(m.first[0].values.device, m.first[0].values.dtype)]
    per_expert = {id(layer) for m in grouped for layer in (*m.first, *m.down)}
    layers = [m for m in model.modules() if isinstance(m, Sparse24Linear) and id(m) not in per_expert]
    groups = _groups(layers)
    # Routed modules ready to run their epilogue's GEMM: gated MLPs of settled groups or of Phi-3's one layer, MLPs
    # with one activation.
    routed = [_RouteShape(r) for r in filter(None, map(route_of, model.modules())) if r.ready()]
    rows, compiles, seen = {}, {}, set()
    compile_at = sorted(set(sizes) | set(rule_points(sizes[-1]))) if every_n else sizes
    gemms = layers + [_GroupShape(g) for g in groups] + routed
    tuned = _tune(gemms, sizes) if tune else {}
    for layer in gemms:
        epilogue = getattr(layer, "epilogue", None)  # a routed module's GEMM's; a layer's own GEMM has none
        for n in compile_at:
            key = (layer.out_features, layer.in_features, str(layer.values.dtype), layer.bias is not None, n, epilogue)
            if key in seen:
                continue
            seen.add(key)
            backend, cfg, compile_ = _variant(layer, n)
            if n in sizes:
                # The sweeps measured the plain GEMM: one with an epilogue's expected speedup is not theirs to give.
                rows[key] = {"m": key[0], "k": key[1], "dtype": key[2], "bias": key[3], "n": n, "backend": backend,
                             "config": str(cfg) if cfg is not None else "-",
                             "expected": _expected(layer, n) if epilogue is None else None}
                if epilogue is not None:
                    rows[key]["epilogue"] = epilogue
                choice = tuned.get((key[0], key[1], epilogue, n))
                if choice is not None and choice.tile is not None:
                    rows[key]["tile"] = tile_note(choice)
            if compile_ is not None:
                compiles.setdefault((backend, str(cfg), key[2], key[3], epilogue), compile_)
    from .kernels.sparse24_grouped import grouped_load, grouped_variants  # kernels: imported where a GPU is used

    loads = {}  # the grouped kernels' variants, by what loading one takes
    for mod in grouped:
        values = mod.first[0].values
        index = values.get_device()
        for m, k, bias, epilogue, scatter in mod.grouped_gemms():
            for cfg, compile_ in grouped_variants(m, values.dtype, bias, epilogue, scatter):
                key = ("grouped", m, k, str(values.dtype), bias, cfg.bn, epilogue, scatter, mod.num_experts)
                rows.setdefault(key, {"m": m, "k": k, "dtype": key[3], "bias": bias, "n": cfg.bn, "backend": "grouped",
                                      "config": f"{cfg}, {mod.num_experts} experts, n rows an expert"
                                                f"{', scattered' * scatter}",
                                      "expected": None, **({"epilogue": epilogue} if epilogue else {})})
                compiles.setdefault(("grouped", str(cfg), key[3], bias, epilogue, scatter), compile_)
                loads[(cfg, values.dtype, bias, epilogue, index, scatter)] = None
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(max(1, threads)) as pool:
        futures = [pool.submit(c) for c in compiles.values()]
        for f in tqdm(concurrent.futures.as_completed(futures), total=len(futures), desc="compile",
                      disable=not progress or not futures):
            f.result()
    compiled_s = time.perf_counter() - t0
    for load in loads:
        grouped_load(*load)
    with torch.inference_mode():
        for mod in grouped:
            mod.warm_routing()
        for layer in tqdm(layers, desc="warm up", disable=not progress or len(layers) < 2):
            p = layer.values
            for n in sizes:
                # Alone: a call through the module would show its sibling group a pass where no two layers read
                # one input (nn/siblings.py).
                layer.forward_alone(torch.zeros(n, layer.in_features, dtype=p.dtype, device=p.device))
        for g in groups:
            p = g.members[0].values
            for n in sizes:
                g.warm(torch.zeros(n, g.members[0].in_features, dtype=p.dtype, device=p.device))
        for shape in routed:  # the routed modules' GEMMs (nn/routes.py): their own kernel variants
            p = shape.values
            for n in sizes:
                shape.route.epilogue_gemm(torch.zeros(n, shape.in_features, dtype=p.dtype, device=p.device))
    for row in rows.values():
        row["compile_s"], row["compiled"] = compiled_s, len(compiles)  # the compile phase, all kernels together
    return list(rows.values())


def tile_note(choice) -> str:
    """What tuning kept, in a few words: "rule", or the kept tile's gain over the rule's; "(stored)" where it was
    read back from the plan cache."""
    kept = "rule" if choice.tile == choice.rule else \
        f"{choice.gain:.3f}x over the rule's" if choice.gain is not None else "not the rule's"
    return kept + (" (stored)" if choice.source == "stored" else "")


def _tune(shapes: list, sizes: list[int]) -> dict:
    """``{(M, K, epilogue, n): TileChoice}`` of the compact-policy GEMMs among ``shapes`` on CUDA, tuned by device
    and dtype (``tiles.tune_tiles``)."""
    from .sparse24.tiles import tune_tiles

    by_device: dict = {}
    for shape in shapes:
        dev = shape.values.device
        if dev.type == "cuda" and shape.memory == "compact":
            by_device.setdefault((dev, shape.values.dtype), {})[
                (shape.out_features, shape.in_features, getattr(shape, "epilogue", None))] = None
    out = {}
    for (dev, dtype), gemms in by_device.items():
        for choice, (m, k, epilogue, n) in zip(
                tune_tiles(list(gemms), sizes, device=dev, dtype=dtype),
                [(*g, n) for g in gemms for n in sizes]):
            out[(m, k, epilogue, n)] = choice
    return out


def table(rows: list[dict]) -> str:
    """The rows as a text table: shape, n, kernel, expected speedup over dense, configuration.

    A ``~`` marks a speedup read from the nearest measured shape or n (the footnote says which);
    ``-`` where no sweep of this GPU and dtype exists.
    """
    head = f"{'M x K':>15} {'dtype':>15} {'n':>6}  {'kernel':<10} {'expected vs dense':<31} config"
    lines, notes = [head], {}
    for r in rows:
        e = r.get("expected")
        mark = ""
        if e is not None and e.basis != "measured":
            mark = notes.setdefault(e.basis, f"[{len(notes) + 1}]")
        gated = f" ({r['epilogue']})" if r.get("epilogue") else ""
        tile = f" [tuned: {r['tile']}]" if r.get("tile") else ""
        lines.append(f"{r['m']:>7} x {r['k']:<5} {r['dtype']:>15} {r['n']:>6}  {r['backend']:<10} "
                     f"{(str(e) + mark) if e is not None else '-':<31} {r['config']}{gated}{tile}")
    sources = sorted({r["expected"].source for r in rows if r.get("expected") is not None})
    if sources:
        lines.append("expected: the rule's kernel over F.linear as measured by " + "; ".join(sources))
    lines += [f"  {mark} {basis}" for basis, mark in notes.items()]
    return "\n".join(lines)
