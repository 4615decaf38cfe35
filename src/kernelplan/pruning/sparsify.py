"""``sparsify``: replace a model's linear layers with 2:4 ``Sparse24Linear`` ones, pruned by magnitude, Wanda or SparseGPT."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from .._checks import choice, class_name
from ..errors import InvalidProblem
from ..hf import check_markable, mark_config
from ..nn.experts import Sparse24Experts, experts_reason, experts_speed_reason
from ..nn.siblings import fuse_siblings
from ..nn.sparse24_linear import Sparse24Linear
from ..sparse24.format import COMPRESS_K, SPARSE24_DTYPES, Sparse24Weight, compress, prune_compress
from ..sparse24.layout import PUBLIC, TILE_K, TILE_M, packed_shapes, padded_k
from . import calibrate, methods
from .experts import calibrate_experts


@dataclass
class SparsifyReport:
    converted: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)  # layer name -> why it stayed dense
    bytes_before: int = 0  # weights of the converted layers, dense
    bytes_after: int = 0  # the same layers, as held
    method: str = "magnitude"
    errors: dict[str, float] = field(default_factory=dict)  # layer -> relative output error on calibration inputs
    seconds: dict[str, float] = field(default_factory=dict)  # calibration's wall time by phase (device drained)
    transposed: list[str] = field(default_factory=list)  # converted layers whose weight was stored [in, out]
    uncalibrated: dict[str, list[int]] = field(default_factory=dict)  # experts module -> experts no token reached
    # Converted layers held in the device layout with K padded to its 64-column step (sparse24/layout.py), each with
    # the bytes the padding holds (in bytes_after).
    padded: dict[str, int] = field(default_factory=dict)
    # Converted layers held in the public format (out_features not a multiple of the layout's 16-row tile), each with
    # the bytes of the copy in the device layout, rows padded, that the GPU kernels derive beside it at its first call
    # there (not in bytes_after: it is made on a GPU, by a call).
    derived_on_gpu: dict[str, int] = field(default_factory=dict)

    def summary(self) -> str:
        saved = self.bytes_before - self.bytes_after
        lines = [f"converted {len(self.converted)} layers by {self.method}: {self.bytes_before / 2**20:.2f} MiB -> "
                 f"{self.bytes_after / 2**20:.2f} MiB ({saved / 2**20:.2f} MiB saved)"]
        if self.seconds:
            lines.append("calibration seconds: " + ", ".join(f"{k} {v:.2f}" for k, v in self.seconds.items()))
        if self.errors:
            lines.append("relative output error on the calibration inputs, ||X(W - W')^T||^2 / ||XW^T||^2:")
            lines += [f"  {name}: {err:.4f}" for name, err in self.errors.items()]
        if self.transposed:
            lines.append(f"read as stored [in, out] (Hugging Face's Conv1D, GPT-2's) and written as the linear layer's "
                         f"[out, in]: {', '.join(self.transposed)}")
        lines += [f"pruned by magnitude, no calibration token routed to them: {name} experts "
                  f"{', '.join(map(str, ids))}" for name, ids in self.uncalibrated.items()]
        if self.padded:
            lines.append(f"held with in_features padded to a multiple of {TILE_K} (zero columns, "
                         f"{sum(self.padded.values()) / 2**10:.1f} KiB of the bytes above): {', '.join(self.padded)}")
        if self.derived_on_gpu:
            lines.append(f"held in the public format (out_features not a multiple of {TILE_M}): on a GPU the kernels "
                         f"derive a copy in the device layout beside each at its first call, "
                         f"{sum(self.derived_on_gpu.values()) / 2**10:.1f} KiB more than the bytes above: "
                         f"{', '.join(self.derived_on_gpu)}")
        lines += [f"skipped {name}: {why}" for name, why in self.skipped.items()]
        if self.method == "magnitude" and self.converted:
            lines.append(MAGNITUDE_NOTE)
        return "\n".join(lines)


# Said with every magnitude report: the pruning looked at no data, and on a pretrained LLM that costs most of its
# accuracy (bench/results/accuracy-smollm2-cpu.json, docs/design/0023).
MAGNITUDE_NOTE = ("note: magnitude pruning does not look at the layers' inputs, and pretrained LLMs lose most of their "
                  "accuracy to it (SmolLM2-135M: held-out perplexity 18.4 -> 2092, docs/design/0023). With "
                  "calibration token ids (kp.sparsify(..., calibration=ids), or `kernelplan sparsify MODEL_DIR OUT "
                  "--calibration FILE`), SparseGPT or Wanda keep far more; check with kp.evaluate or --eval")


def eligibility(weight: torch.Tensor) -> str | None:
    """Why a 2-D weight cannot be stored 2:4, or None if it can."""
    from ..dtypes import dtype_info

    info = dtype_info(weight.dtype) if weight.is_floating_point() else None
    if info is None or info.name not in SPARSE24_DTYPES:
        return f"dtype {weight.dtype} is not one of {SPARSE24_DTYPES}"
    if weight.dim() != 2:
        return f"weight has {weight.dim()} dims; only 2-D weights are pruned"
    if weight.shape[1] % COMPRESS_K:
        return f"in_features={weight.shape[1]} is not a multiple of {COMPRESS_K}"
    return None


def is_conv1d(mod: nn.Module) -> bool:
    """Whether ``mod`` is Hugging Face's ``Conv1D`` (GPT-2's projections): ``x @ weight + bias`` with ``weight``
    ``[in, out]``, a linear layer whose weight is stored transposed.  Told by its name and fields, so transformers is
    not imported."""
    weight = getattr(mod, "weight", None)
    return type(mod).__name__ == "Conv1D" and hasattr(mod, "nf") and isinstance(weight, torch.Tensor) and \
        weight.dim() == 2


def as_linear(conv: nn.Module) -> nn.Linear:
    """The ``nn.Linear`` that computes what a ``Conv1D`` does: its weight transposed (a copy), its bias the same
    Parameter."""
    k, m = conv.weight.shape
    linear = nn.Linear(k, m, bias=conv.bias is not None, device=conv.weight.device, dtype=conv.weight.dtype)
    with torch.no_grad():
        linear.weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=conv.weight.requires_grad)
    if conv.bias is not None:
        linear.bias = conv.bias
    linear.train(conv.training)
    linear.from_conv1d = True  # carried to its Sparse24Linear (_replace)
    return linear


# nn.Linear subclasses whose own forward is a linear layer's: x @ W^T + b, written out.  Any other subclass with a
# forward of its own stays dense: Phi-MoE's and Llama-4's routers are nn.Linear subclasses that return their top-k,
# which a Sparse24Linear in their place would drop (docs/design/0079).
LINEAR_FORWARDS = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


# Linear layers whose weight their parent's code reads directly, by the parent's class: Mamba-1's mixers pass x_proj's,
# dt_proj's and out_proj's weights to mamba_ssm's fused kernel, and multiply by dt_proj's weight without it.  A 2:4
# layer would give them its weight decompressed on every call (a dense copy, sparse24/dense_view.py): they stay dense.
DIRECT_WEIGHT_READS = {
    "transformers.models.mamba.modeling_mamba.MambaMixer": ("x_proj", "dt_proj", "out_proj"),
    "transformers.models.falcon_mamba.modeling_falcon_mamba.FalconMambaMixer": ("x_proj", "dt_proj", "out_proj"),
    "transformers.models.jamba.modeling_jamba.JambaMambaMixer": ("dt_proj",),
    # F.multi_head_attention_forward multiplies by out_proj.weight itself: SigLIP's pooling head, CLIP-style heads,
    # encoders built on torch's own attention.
    "torch.nn.modules.activation.MultiheadAttention": ("out_proj",),
    # The DETR family's mask head convolves the keys with k_proj's weight as a 1 x 1 kernel.
    "transformers.models.detr.modeling_detr.DetrMHAttentionMap": ("k_proj",),
    "transformers.models.conditional_detr.modeling_conditional_detr.ConditionalDetrMHAttentionMap": ("k_proj",),
    "transformers.models.maskformer.modeling_maskformer.MaskFormerDetrMHAttentionMap": ("k_proj",),
    "transformers.models.dab_detr.modeling_dab_detr.DabDetrMHAttentionMap": ("k_linear",),
}


def _read_directly(model: nn.Module, name: str) -> str | None:
    """The class of the parent whose code reads the weight of the layer at ``name`` directly (``DIRECT_WEIGHT_READS``),
    else None."""
    parent, _, child = name.rpartition(".")
    owner = class_name(model.get_submodule(parent))
    return owner if child in DIRECT_WEIGHT_READS.get(owner, ()) else None


def _router_of(model: nn.Module, name: str, layer: nn.Linear) -> str | None:
    """The MoE block whose tokens the linear layer at ``name`` routes (its name), else None.

    Some families' routers are nn.Linear layers: DBRX's ``router.layer`` and Hunyuan-MoE's ``gate.wg`` (an output an
    expert), Qwen2-MoE's and Qwen3-Next's ``shared_expert_gate`` (one output).  Pruned, they would change which
    experts each token reaches and how much of the shared expert it takes, to save an E x H weight's bytes; the
    other families' routers are weights of router modules of their own, which stay dense.  Told by where they sit
    and their shape: under a module with a child named ``experts`` (as its child or grandchild), outside that child
    and the shared experts, with at most an eighth as many outputs as inputs (a shared MLP has more)."""
    if layer.out_features * 8 > layer.in_features:
        return None
    parts = name.split(".")
    for up in (1, 2):
        if len(parts) <= up:
            break
        block = ".".join(parts[:-up])
        if "experts" in model.get_submodule(block)._modules:
            return None if parts[-up] in ("experts", "shared_expert", "shared_experts") else block
    return None


def _own_forward(layer: nn.Module) -> str | None:
    """The class of an nn.Linear subclass with a forward of its own not in ``LINEAR_FORWARDS``, else None."""
    if not isinstance(layer, nn.Linear) or type(layer).forward is nn.Linear.forward:
        return None
    name = class_name(layer)
    return None if name in LINEAR_FORWARDS else name


def _owner(p: torch.Tensor) -> tuple:
    return ("meta", id(p)) if p.is_meta else (p.data_ptr(), tuple(p.shape))


def _three_d(module: nn.Module) -> list[str]:
    """The names of ``module``'s own floating-point Parameters of 3 dims (a MoE layer's experts, stacked)."""
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 3 and p.is_floating_point()]


def _two_d_experts(module: nn.Module) -> list[str]:
    """The names of ``module``'s own 2-D floating-point Parameters where its class is named for experts (DBRX's
    ``DbrxExpertGLU``: ``w1``, ``v1``, ``w2`` of ``[E I, H]``), else none."""
    if "expert" not in type(module).__name__.lower():
        return []
    return [name for name, p in module.named_parameters(recurse=False) if p.dim() == 2 and p.is_floating_point()]


def _select(model: nn.Module, filter_fn, prune_output: bool, report: SparsifyReport,
            experts: list | None = None, policy: str = "auto",
            experts_dense: str | None = None) -> list[tuple[str, nn.Linear]]:
    """The linear layers to prune; every other layer that could have been goes to ``report.skipped`` with why.
    Experts modules of 3-D weights (``nn/experts.py``) to hold 2:4 under ``policy`` (sparsify's ``experts``) go to
    ``experts``; where the caller holds none (``experts`` None), to ``report.skipped``, with ``experts_dense`` (then
    required) as the reason."""
    owners: dict[tuple, list[str]] = {}  # parameter storage -> the names that hold it, ties included
    for pname, p in model.named_parameters(remove_duplicate=False):
        if p.numel():  # (a model built on the meta device has no storage: a tie is one Parameter there)
            owners.setdefault(_owner(p), []).append(pname)
    get_output = getattr(model, "get_output_embeddings", None)
    output = get_output() if callable(get_output) else None
    chosen = []
    for name, layer in list(model.named_modules()):  # a list: chosen Conv1Ds are swapped on the way
        if isinstance(layer, nn.Embedding):
            report.skipped[name] = "an embedding table: a lookup, not a matmul, so 2:4 neither shrinks its reads nor speeds it"
            continue
        conv = is_conv1d(layer)
        if _three_d(layer) and not isinstance(layer, nn.modules.conv._ConvNd):
            _select_experts(name, layer, filter_fn, report, experts, policy, experts_dense)
            continue
        if not isinstance(layer, nn.Linear) and not conv:
            stacked = _two_d_experts(layer)
            if stacked:  # reported, not silently left: they are most of the model's weights
                report.skipped[name] = (f"a {class_name(layer)} holds its experts as 2-D weights "
                                        f"({', '.join(stacked)}), neither linear layers nor transformers' 3-D "
                                        f"experts, so kernelplan cannot tell how its forward reads them; they stay "
                                        f"dense")
            continue
        if not name:
            report.skipped["<model>"] = "the model itself is an nn.Linear: use Sparse24Linear.from_dense(model)"
            continue
        if filter_fn is not None and not filter_fn(name, layer):
            report.skipped[name] = "filtered out by filter_fn"
            continue
        own = _own_forward(layer)
        if own is not None:
            report.skipped[name] = (f"a {own}: an nn.Linear subclass with a forward of its own (a router's top-k, an "
                                    f"extra input), which a Sparse24Linear in its place would drop")
            continue
        block = _router_of(model, name, layer) if not conv else None
        if block is not None:
            report.skipped[name] = (f"a router of the MoE block {block} ({layer.out_features} x {layer.in_features}): "
                                    f"pruned, it would change which experts each token reaches; it stays dense, as "
                                    f"other families' routers do")
            continue
        reader = _read_directly(model, name)
        if reader is not None:
            report.skipped[name] = (f"its parent, a {reader}, reads its weight directly (a fused kernel's operand, "
                                    f"a matmul of its own), which a 2:4 layer would give it decompressed on every call")
            continue
        w = layer.weight
        tied = [o for o in owners.get(_owner(w), []) if o != f"{name}.weight"]
        if tied:
            report.skipped[name] = (f"its weight is tied to {', '.join(tied)}: pruning it would prune those too, "
                                    f"or break the tie")
            continue
        if not prune_output and (layer is output or (output is None and name.rpartition(".")[2] == "lm_head")):
            report.skipped[name] = "the output projection (LM head) stays dense by default: prune_output=True prunes it"
            continue
        reason = eligibility(layer.weight.t() if conv else layer.weight)
        if reason is not None:
            report.skipped[name] = reason
            continue
        if conv:  # pruned as the linear layer it is: groups of 4 along its inputs, as nn.Linear's
            layer = as_linear(layer)
            parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
            setattr(parent, name.rpartition(".")[2], layer)
        chosen.append((name, layer))
    return chosen


def _select_experts(name: str, layer: nn.Module, filter_fn, report: SparsifyReport, experts: list | None,
                    policy: str, experts_dense: str | None) -> None:
    if filter_fn is not None and not filter_fn(name, layer):
        report.skipped[name] = "filtered out by filter_fn"
        return
    reason = experts_reason(layer)
    if reason is None and experts_dense is not None:
        report.skipped[name] = experts_dense
        return
    if reason is None and policy == "none":
        reason = "experts='none'"
    if reason is None and policy == "auto":
        reason = experts_speed_reason(layer)
    if reason is not None:
        report.skipped[name] = f"{reason}; its 3-D weights ({', '.join(_three_d(layer))}) stay dense"
        return
    experts.append((name, layer))


def _drain(items: list) -> Iterator:
    """Each of ``items``, removed from the list as it is taken: a dense layer replaced is then referenced by nothing,
    and freed.  Iterated whole, the list held every dense layer until ``sparsify`` returned, so a model sparsified on
    the GPU peaked at the dense model plus the whole 2:4 one (docs/design/0046)."""
    items.reverse()
    while items:
        yield items.pop()


def _replace_experts(model: nn.Module, name: str, layer: nn.Module, report: SparsifyReport,
                     pruned: dict | None = None) -> None:
    sparse = Sparse24Experts.from_experts(layer, pruned)
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    setattr(parent, name.rpartition(".")[2], sparse)
    report.converted.append(name)
    report.bytes_before += sum(p.numel() * p.element_size() for p in layer.parameters(recurse=False) if p.dim() == 3)
    report.bytes_after += sum(m.values.nbytes + m.metadata.nbytes for m in [*sparse.first, *sparse.down])


def _replace(model: nn.Module, name: str, layer: nn.Linear, w24: Sparse24Weight, report: SparsifyReport) -> None:
    with torch.no_grad():
        bias = layer.bias.detach().clone() if layer.bias is not None else None
    sparse = Sparse24Linear(w24.values, w24.metadata, bias, in_features=w24.shape[1], _validate=False)
    if getattr(layer, "from_conv1d", False):
        sparse.from_conv1d = True
    parent = model.get_submodule(name.rpartition(".")[0]) if "." in name else model
    setattr(parent, name.rpartition(".")[2], sparse)
    report.converted.append(name)
    held = sparse.values.nbytes + sparse.metadata.nbytes  # as held: the device layout's 0.5625x
    if sparse.layout != PUBLIC and padded_k(layer.in_features) != layer.in_features:
        report.padded[name] = held - held * layer.in_features // padded_k(layer.in_features)
    elif sparse.layout == PUBLIC:
        (rows, steps, _), (_, _, words) = packed_shapes(-(-layer.out_features // TILE_M) * TILE_M, layer.in_features)
        report.derived_on_gpu[name] = rows * steps * (512 * sparse.values.element_size() + 4 * words)
    report.bytes_before += layer.weight.numel() * layer.weight.element_size()
    report.bytes_after += held


def sparsify(
    model: nn.Module, filter_fn: Callable[[str, nn.Linear], bool] | None = None, progress: bool = True,
    prune_output: bool = False, *, method: str | None = None, calibration=None, blocks=None, report: bool = False,
    batch_size: int = 8, blocksize: int = 128, damp: float = 0.01, fuse: bool = True, experts: str = "auto",
) -> SparsifyReport:
    """Replace every eligible ``nn.Linear`` of ``model`` (and Hugging Face ``Conv1D``: GPT-2's, pruned along its
    inputs as a linear layer is) in place with a 2:4 ``Sparse24Linear``.

    A MoE layer's experts stored as 3-D weights (transformers 5's experts modules: Mixtral, Qwen-MoE, OLMoE,
    DeepSeek, gpt-oss ...; Llama-4's, which run every token through every expert) can become a ``Sparse24Experts``,
    each expert's projections pruned by ``method``: with calibration, on the tokens the router sends it
    (``pruning/experts.py``; an expert no token reached is pruned by magnitude and named in the report's
    ``uncalibrated``).
    ``experts``: "auto" (the default) does so where the grouped kernel runs them (weights on a Hopper GPU: each
    projection one launch over every expert) or where each expert holds at least ``EXPERTS_MIN_BYTES`` (256 MiB:
    Mixtral's do; Phi-3.5-MoE's, Qwen3-MoE's and DeepSeek's do not), since elsewhere they run one GEMM per expert,
    slower than transformers' grouped GEMM for all but large experts (nn/experts.py says what was measured); "all"
    wherever it can; "none" never.  Experts left dense are in the report, with why.

    ``method``: "magnitude" (the default without ``calibration``), "wanda" or
    "sparsegpt" (the default with it); see ``kernelplan/pruning/methods.py``.
    ``calibration`` is token ids ``[N, S]`` (run ``batch_size`` sequences at a
    time) or a list of model inputs.  With it, the model's blocks
    (``calibrate.find_blocks``, or ``blocks=``: a dotted name or a list of
    modules) are pruned in order, each on the outputs of the pruned blocks
    before it; layers outside the blocks (an LM head with ``prune_output``) are
    pruned last, on a pass of the whole pruned model.  ``report=True`` adds
    each layer's relative output error on its calibration inputs to the report.

    ``fuse`` (the default) lets sibling layers that read one input (q/k/v,
    gate/up) run as one GEMM at inference, their weights laid end to end in one
    copy (``kernelplan.nn.fuse_siblings``), and gated MLPs apply their activation
    in that GEMM's epilogue (``kernelplan.nn.gated_siblings``), and Llama-4's MoE layers send each token to the
    experts its router chose alone (``kernelplan.nn.moe_routes``); the state_dict is the same.

    Memory: each dense layer is freed once it is replaced (calibrated, once its block is), so sparsifying needs the
    dense model plus about one layer's 2:4 weights, not the two models side by side (a Mixtral-8x7B-sized model of two
    layers on an H200: 1.59 GB over its 6.33 GB, ``bench/results/hf-from-pretrained-mixtral-h200.json``).

    Skipped, with the reason in the report: layers ``filter_fn`` rejects;
    embedding tables; layers whose weight is shared with another parameter (a
    tied LM head: pruning it would break the tie, or prune the embeddings too);
    and, unless ``prune_output``, the model's output projection
    (``get_output_embeddings()`` of a Hugging Face model, else a layer named
    ``lm_head``), whose pruning harms accuracy most and which is not where 2:4
    speeds a model up; a MoE block's routers that are linear layers (DBRX's,
    Hunyuan-MoE's, Qwen-MoE's shared expert gate), whose pruning would change
    which experts tokens reach; modules of weights kernelplan cannot read
    (experts held as 2-D weights, as DBRX's).
    """
    from tqdm.auto import tqdm

    if not isinstance(model, nn.Module):
        raise InvalidProblem(f"model is a {type(model).__name__}; sparsify takes an nn.Module")
    check_markable(model)
    method = choice(method if method is not None else ("magnitude" if calibration is None else "sparsegpt"),
                    "method", methods.METHODS)
    if calibration is None and (method != "magnitude" or report):
        why = f"method={method!r} scores weights by the layers' inputs" if method != "magnitude" else \
            "report=True measures each layer's error on its inputs"
        raise InvalidProblem(f"{why}, and no calibration= was given: pass token ids [N, S] from text like the "
                             f"model's (for example 128 sequences of 2048 tokens), or use method='magnitude'")
    out = SparsifyReport(method=method)
    policy = choice(experts, "experts", ("auto", "all", "none"))
    held: list[tuple[str, nn.Module]] = []
    chosen = _select(model, filter_fn, prune_output, out, held, policy)
    if calibration is None:
        for name, layer in tqdm(_drain(held), desc="sparsify (experts)", total=len(held),
                                disable=not progress or not held):
            _replace_experts(model, name, layer, out)
        for name, layer in tqdm(_drain(chosen), desc="sparsify", total=len(chosen),
                                disable=not progress or len(chosen) < 8):
            _replace(model, name, layer, prune_compress(layer.weight.detach(), packed=True), out)
        return _finished(model, fuse, out)

    data = calibrate.batches(calibration, batch_size)
    full = method == "sparsegpt" or report
    clock = _Clock(next((p.device for p in model.parameters()), torch.device("cpu")), out.seconds)

    def prune_layers(layers: list[tuple[str, nn.Linear]], run: Callable[[], None]) -> None:
        with clock("statistics"):
            groups = _gather(layers, run, full)
        for names, stats in groups:
            group = [dict(layers)[n] for n in names]
            if not stats.tokens:
                raise InvalidProblem(f"{names[0]} did not run on the calibration data, so it cannot be scored; "
                                     f"leave it out with filter_fn, or pass calibration that reaches it")
            with clock("prune"), torch.no_grad():
                pruned = _prune_group(method, group, stats, blocksize, damp)
                w24s = []
                for name, layer, w in zip(names, group, pruned):
                    if report:
                        out.errors[name] = methods.relative_error(layer.weight, w, stats)
                    w24s.append(compress(w, packed=True))
            for name, layer, w24 in zip(names, group, w24s):
                _replace(model, name, layer, w24, out)

    def prune_experts(modules: list[tuple[str, nn.Module]], run: Callable[[], None]) -> None:
        """Each experts module on the tokens ``run()`` routes to each expert (``pruning/experts.py``), after the
        block's linear layers: its inputs then come through the pruned attention, as the next block's will."""
        for name, module in modules:
            if method == "magnitude" and not report:  # nothing to gather
                _replace_experts(model, name, module, out)
                continue
            with clock("experts"):
                pruned, unreached, errors = calibrate_experts(module, method, run, report, blocksize, damp)
            if unreached:
                out.uncalibrated[name] = unreached
            out.errors.update({f"{name}.{part} (mean over experts)": err for part, err in errors.items()})
            _replace_experts(model, name, module, out, pruned)

    if chosen or held:
        _, blocks = calibrate.resolve_blocks(model, blocks)
        owner = {id(m): i for i, block in enumerate(blocks) for m in block.modules()}
        per_block = [[(n, l) for n, l in chosen if owner.get(id(l)) == i] for i in range(len(blocks))]
        experts_in = [[(n, m) for n, m in held if owner.get(id(m)) == i] for i in range(len(blocks))]
        outside = [(n, l) for n, l in chosen if id(l) not in owner]
        experts_outside = [(n, m) for n, m in held if id(m) not in owner]
        chosen.clear()  # each dense layer referenced once from here on, by its block's list, cleared as it is pruned
        held.clear()
        with torch.no_grad(), clock("capture"):
            inputs = calibrate.capture_inputs(model, blocks, data)
        bar = lambda it: tqdm(it, desc=f"sparsify ({method})", unit="layer", disable=not progress)  # noqa: E731

        def prune_block(i: int, block: nn.Module, dense_pass: Callable[[], None]) -> None:
            # The block's lists handed over, so its dense layers are freed as they are replaced, not at the end.
            layers, per_block[i] = per_block[i], []
            prune_layers(layers, dense_pass)
            del layers
            modules, experts_in[i] = experts_in[i], []
            prune_experts(modules, dense_pass)

        with torch.no_grad():
            calibrate.run_blocks(blocks, inputs, prune_block, bar, lambda: clock("forward"))
        whole = lambda: calibrate.model_pass(model, data)  # noqa: E731
        if outside:
            prune_layers(outside, whole)
        prune_experts(experts_outside, whole)
    return _finished(model, fuse, out)


def _finished(model: nn.Module, fuse: bool, report: SparsifyReport) -> SparsifyReport:
    """The converted model's last steps: its config records kernelplan's format (``hf.mark_config``), then its
    sibling layers are grouped (``fuse``)."""
    if report.converted:
        mark_config(model)
    if fuse:
        fuse_siblings(model)
    return report


class _Clock:
    """``with clock(phase):`` adds the phase's wall seconds to ``seconds[phase]``, the device drained at both ends."""

    def __init__(self, device: torch.device, seconds: dict[str, float]):
        self.device, self.seconds = device, seconds

    @contextlib.contextmanager
    def __call__(self, phase: str):
        sync = torch.cuda.synchronize if self.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            sync()
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0


def _stats_for(layer: nn.Linear, full: bool) -> methods.InputStats:
    return methods.InputStats(layer.in_features, layer.weight.device, full,
                              torch.float64 if layer.weight.dtype == torch.float64 else torch.float32)


def _gather(layers: list[tuple[str, nn.Linear]], run: Callable[[], None],
            full: bool) -> list[tuple[list[str], methods.InputStats]]:
    """Run the calibration pass with hooks on ``layers``; their input statistics, one per group of layers that
    read the same input tensor on every call (q/k/v, gate/up): the group's statistics are gathered once."""
    stats = {name: _stats_for(layer, full) for name, layer in layers}
    leaders: dict[str, set[str]] = {name: set() for name, _ in layers}
    last: list = [None, None, None]  # the input the previous hooked layer read, its version, and whose stats have it

    def hook(name):
        def record(mod, inp, res):
            x = inp[0]
            if last[0] is x and last[1] == x._version:
                leaders[name].add(last[2])
                return
            leaders[name].add(name)
            stats[name].add(x)
            last[:] = x, x._version, name
        return record

    try:
        _hooked(run, [(layer, hook(name)) for name, layer in layers])
    finally:
        last[:] = None, None, None
    if any(len(who) > 1 for who in leaders.values()):  # a layer shared its input on some calls only
        return _gather_alone(layers, run, full)
    groups: dict[str, list[str]] = {}
    for name, who in leaders.items():
        groups.setdefault(next(iter(who)) if who else name, []).append(name)
    return [(names, stats[lead]) for lead, names in groups.items()]


def _gather_alone(layers, run, full):
    stats = {name: _stats_for(layer, full) for name, layer in layers}
    _hooked(run, [(layer, lambda mod, inp, res, s=stats[name]: s.add(inp[0])) for name, layer in layers])
    return [([name], stats[name]) for name, _ in layers]


def _hooked(run: Callable[[], None], hooks: list[tuple[nn.Module, Callable]]) -> None:
    """``run()`` without gradients, with each forward hook on its module; the hooks are removed however it ends."""
    handles = [module.register_forward_hook(fn) for module, fn in hooks]
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()


def _prune_group(method: str, group: list[nn.Linear], stats: methods.InputStats, blocksize: int,
                 damp: float) -> list[torch.Tensor]:
    """Each layer's pruned weight.  SparseGPT treats rows independently given H, so layers that share their
    input statistics are solved as one stacked weight: one Cholesky and one column sweep for q/k/v."""
    if method != "sparsegpt" or len({layer.weight.dtype for layer in group}) > 1:
        return [methods.prune(method, layer.weight, stats, blocksize, damp) for layer in group]
    stacked = methods.sparsegpt(torch.cat([layer.weight.detach() for layer in group]), stats, blocksize, damp)
    return list(stacked.split([layer.out_features for layer in group]))
