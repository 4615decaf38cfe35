"""``Sparse24Experts``: a mixture-of-experts layer's experts, each expert's projections held 2:4.

Transformers 5 stores a MoE layer's experts as one module of 3-D weights (Mixtral, Qwen2/3-MoE, OLMoE, DeepSeek,
gpt-oss ...: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``, or ``up_proj`` where there is no gate), with
the flags its ``use_experts_implementation`` decorator sets: ``has_gate``, ``has_bias``, ``is_transposed``
(``[E, in, out]``), ``has_post_expert_norm``.  Its forward takes ``(hidden_states [T, H], top_k_index [T, k],
top_k_weights [T, k])``.  Those are nn.Parameters, not nn.Linear modules, so ``sparsify`` finds them here
(``experts_reason``) and replaces the module with a ``Sparse24Experts`` of the same forward: one ``Sparse24Linear``
per expert and projection, pruned along its inputs.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .._checks import _is_compiling, class_name
from ..errors import InvalidProblem
from ..sparse24.format import Sparse24Weight, compress, prune_compress
from ..sparse24.layout import PUBLIC, TILE_K, gpu_kernels, pack_reason, packed_shapes
from ..sparse24.gemm import forget
from . import experts_ops
from .sparse24_linear import Sparse24Linear

# The flags transformers' use_experts_implementation sets on an experts module.  Releases before 5.2x set fewer of
# them (5.17: not all four); one that is missing is read off the module's weights, is_transposed excepted.
FLAGS = ("has_gate", "has_bias", "is_transposed", "has_post_expert_norm")


# Experts modules without those flags whose forward kernelplan knows, by class name -> their flags.  Each runs every
# token through every expert: forward(hidden_states [E T, H]) takes expert e's T rows at e T, and gives its outputs in
# the same rows.  Llama-4's MoE repeats its tokens E times, each copy scaled by the router's score for that expert
# (zero where the expert was not chosen), and sums the E outputs of a token.
EVERY_TOKEN = {"transformers.models.llama4.modeling_llama4.Llama4TextExperts": {
    "has_gate": True, "is_transposed": True, "has_bias": False, "has_post_expert_norm": False}}


def runs_every_token(module: nn.Module) -> bool:
    """Whether ``module``'s forward runs every token through every expert (``EVERY_TOKEN``)."""
    return class_name(module) in EVERY_TOKEN


def _flags(module: nn.Module) -> dict[str, bool] | None:
    """The module's flags, or None where it has no is_transposed (no sign of the decorator)."""
    known = EVERY_TOKEN.get(class_name(module))
    if known is not None:
        return dict(known)
    if not hasattr(module, "is_transposed"):
        return None
    has_gate = getattr(module, "has_gate", isinstance(getattr(module, "gate_up_proj", None), torch.Tensor))
    first = "gate_up_proj" if has_gate else "up_proj"
    return {"has_gate": has_gate, "is_transposed": bool(module.is_transposed),
            "has_bias": getattr(module, "has_bias", isinstance(getattr(module, first + "_bias", None), torch.Tensor)),
            "has_post_expert_norm": getattr(module, "has_post_expert_norm", False)}


def _default_gate(module: nn.Module, gate_up: torch.Tensor) -> torch.Tensor:
    """Transformers' default gating: the first half of the columns through the activation, times the second."""
    gate, up = gate_up.chunk(2, dim=-1)
    return module.act_fn(gate) * up


def _parts(has_gate: bool) -> tuple[str, str]:
    return ("gate_up_proj" if has_gate else "up_proj"), "down_proj"


def parts_of(module: nn.Module) -> tuple[str, str]:
    """The names of an experts module's two projections (``experts_reason`` accepts it)."""
    return _parts(_flags(module)["has_gate"])


def expert_weight(module: nn.Module, name: str, e: int) -> torch.Tensor:
    """Expert ``e``'s weight of projection ``name`` as a linear layer's ``[out, in]`` (a view)."""
    w = getattr(module, name)[e]
    return w.t() if _flags(module)["is_transposed"] else w


def expert_bias(module: nn.Module, name: str) -> torch.Tensor | None:
    """Projection ``name``'s biases ``[E, out]``, or None where the experts have none."""
    return getattr(module, name + "_bias", None) if _flags(module)["has_bias"] else None


def source_activation(module: nn.Module):
    """What an experts module does between its projections, as a function of the first one's output: its own
    gating (``_apply_gate``, transformers' default where the class has none), or its activation without a gate."""
    if not _flags(module)["has_gate"]:
        return module.act_fn
    gate = getattr(type(module), "_apply_gate", None) or _default_gate
    return lambda h: gate(module, h)


def experts_reason(module: nn.Module) -> str | None:
    """Why ``module`` is not an experts module that ``Sparse24Experts.from_experts`` reads, or None if it is."""
    flags = _flags(module)
    if flags is None:
        # Not "its experts": a module of 3-D weights may hold none (RWKV's time_mix vectors [1, 1, H], Recurrent
        # Gemma's block-diagonal gates).
        return ("a module of 3-D weights without transformers' use_experts_implementation flags (is_transposed, "
                "has_gate, has_bias) nor a class kernelplan knows as experts (EVERY_TOKEN), so kernelplan cannot "
                "tell how its forward reads them")
    if not hasattr(module, "act_fn") and not (flags["has_gate"] and "_apply_gate" in vars(type(module))):
        return "it has no act_fn, and no gating of its own (_apply_gate) that would not need one"
    if getattr(module, "_is_expert_parallel", False):
        return "it is sharded by expert parallelism: each rank holds part of the experts"
    first, down = _parts(flags["has_gate"])
    weights = [getattr(module, name, None) for name in (first, down)]
    if not all(isinstance(w, torch.Tensor) and w.dim() == 3 for w in weights):
        return f"it has no 3-D {first} and {down} weights"
    if weights[0].shape[0] != weights[1].shape[0]:
        return f"{first} holds {weights[0].shape[0]} experts and {down} {weights[1].shape[0]}"
    from ..pruning.sparsify import eligibility

    for name, w in zip((first, down), weights):
        reason = eligibility(w[0].t() if flags["is_transposed"] else w[0])
        if reason is not None:
            return f"{name}: {reason}"
    return None


# kp.sparsify(experts="auto") holds a MoE layer's experts 2:4 where the grouped kernel runs them (on a Hopper GPU:
# each projection one launch over every expert), or where each expert holds at least this many dense bytes.
# Elsewhere (the CPU, other GPUs, autograd) they run one GEMM per expert, and each expert costs its host work, where
# transformers' grouped_mm runs all experts in one call.  One GEMM an expert against grouped_mm, eager, 1-2048
# tokens, ten published configs (bench/results/sparse24-experts-h100.json and -h200.json, 9dab382):
# * Mixtral-8x22B (576 MiB an expert) 1.05-2.05x, Mixtral-8x7B (336 MiB) 0.87-1.65x;
# * Phi-3.5-MoE (150 MiB) 0.61-1.22x; 84 MiB and less (DeepSeek-V3 ... Qwen3-30B-A3B) 0.06-1.19x.
EXPERTS_MIN_BYTES = 256 << 20


def experts_speed_reason(module: nn.Module) -> str | None:
    """Why holding ``module``'s experts 2:4 would slow its layer down, or None: they are on a GPU the grouped
    kernel runs them on, or each is large enough for a GEMM of its own.  ``module`` is one ``experts_reason``
    accepts."""
    from ..kernels.sparse24_grouped import grouped_reason

    weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
    count, w = weights[0].shape[0], weights[0]
    each = sum(p.numel() * p.element_size() for p in weights) // count
    if each >= EXPERTS_MIN_BYTES:
        return None
    shapes = [tuple(expert_weight(module, name, 0).shape) for name in parts_of(module)]
    capability = torch.cuda.get_device_capability(w.device) if w.is_cuda else None
    why = next((r for m, k in shapes if (r := grouped_reason(capability, m, k, count, w.dtype))), None)
    if why is None:
        return None
    return (f"each of its {count} experts holds {each / 2**20:.1f} MiB, under {EXPERTS_MIN_BYTES >> 20} MiB, and the "
            f"grouped kernel cannot run them here ({why}): one GEMM per expert, each with its host work, ran "
            f"0.06-1.22x of transformers' grouped_mm for experts of 150 MiB and less on an H100 and an H200 "
            f"(bench/results/sparse24-experts-h100.json); sparsify on the GPU, or experts='all' for the memory "
            f"(0.5625x) anyway")


class ExpertSpan:
    """One projection's experts in the device layout end to end, one storage a part (the grouped kernel's W, which
    ``Sparse24Experts._span`` then finds whole), each expert written into its rows as it is made.  No expert's own
    device layout is held beside the span: that was a MoE load's peak (docs/design/0045) and a GPU ``sparsify``'s
    (0046).  Where the GPU conversion kernels do not run (the CPU) or the shape does not pack, there is no span: each
    expert is made in storage of its own, and ``Sparse24Experts._span`` joins them."""

    def __init__(self, count: int, shape: tuple[int, int], like: torch.Tensor):
        self.count, self.shape, self.dtype, self.device = count, tuple(shape), like.dtype, like.device
        # The grouped kernel reads K in whole 64-column steps: experts of another K are not padded, and stay in the
        # public format (grouped_reason).
        self.kernels = gpu_kernels(like) if pack_reason(*shape) is None and not shape[1] % TILE_K else None
        self.parts = None  # allocated by the first expert written: where all come laid out, never

    @classmethod
    def of(cls, experts: nn.Module, name: str) -> "ExpertSpan":
        """The span of ``experts``' projection ``name``, in the dtype and on the device of its dense weights."""
        first = expert_weight(experts, name, 0)
        return cls(getattr(experts, name).shape[0], first.shape, first)

    def _rows(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        (rv, *v), (rm, *m) = packed_shapes(*self.shape)
        if self.parts is None:
            self.parts = (torch.empty((self.count * rv, *v), dtype=self.dtype, device=self.device),
                          torch.empty((self.count * rm, *m), dtype=torch.int32, device=self.device))
        return self.parts[0][e * rv:(e + 1) * rv], self.parts[1][e * rm:(e + 1) * rm]

    def _fits(self, e: int, w) -> bool:
        """Whether expert ``e``'s weight ``w`` goes into the span: there is one, ``e`` has rows in it, and ``w`` has its
        shape, dtype and device (what does not is made apart, and refused or joined by the caller)."""
        return self.kernels is not None and 0 <= e < self.count and tuple(w.shape) == self.shape and \
            w.dtype == self.dtype and w.device == self.device

    def laid_out(self, e: int, w: Sparse24Weight) -> Sparse24Weight:
        """``w``, expert ``e``'s weight in the public format, converted into its rows; ``w`` itself where there is no
        span or ``w`` is laid out already or of another shape or dtype (the layer then lays itself out)."""
        if not self._fits(e, w) or w.layout != PUBLIC:
            return w
        tv, tm = self._rows(e)
        self.kernels.pack_into(w.values.detach().contiguous(), w.metadata.contiguous(), tv, tm)
        return Sparse24Weight(tv, tm, _validate=False)

    def compressed(self, e: int, w: torch.Tensor, prune: bool) -> Sparse24Weight:
        """``compress(w, packed=True)`` (``prune``: ``prune_compress``) of expert ``e``'s dense weight, in its rows.
        Where there is no span, or the kernel refuses ``w``, the torch ops' (which name what they refuse)."""
        if self._fits(e, w):
            tv, tm = self._rows(e)
            rows = w if w.stride(-1) == 1 else w.contiguous()
            if self.kernels.compress_tiled(rows, prune=prune, out=(tv, tm)) is not None:
                return Sparse24Weight(tv, tm, _validate=False)
        return (prune_compress if prune else compress)(w, packed=not w.shape[-1] % TILE_K)


def _meta_skeleton(module: nn.Module) -> nn.Module:
    """``module`` without its memory: a shallow copy whose own parameters and buffers are meta tensors of their
    shapes, its children the same objects.  ``Sparse24Experts.to_dense_module`` fills it again."""
    skeleton = copy.copy(module)
    skeleton._parameters = {k: None if v is None else nn.Parameter(torch.empty_like(v, device="meta"), v.requires_grad)
                            for k, v in module._parameters.items()}
    skeleton._buffers = {k: None if v is None else torch.empty_like(v, device="meta")
                         for k, v in module._buffers.items()}
    skeleton._modules = dict(module._modules)
    # accelerate's hooks (a device_map's) replace an instance's forward with one bound to that instance: kept, the
    # dense module given back would run the source's weights, not its own.
    for name in ("forward", "_old_forward", "_hf_hook"):
        skeleton.__dict__.pop(name, None)
    return skeleton


# What the routing weights of ``Sparse24Experts.routed`` scale, besides each pair's output ("outputs", transformers'
# top-k experts): each pair's input, by the weight itself or by the sigmoid of it in float32 rounded to its dtype
# (Llama-4's router's scores, from its top logits: Llama4Router.forward) -> that scale, by torch ops.  The routing
# kernel's table of the same names (kernels/moe_route.py's WEIGHINGS) does it as it copies the rows.
INPUT_WEIGHTS = {"inputs": lambda w: w, "sigmoid inputs": lambda w: torch.sigmoid(w.float()).to(w.dtype)}


def _combine(out: torch.Tensor, order: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """Rows sorted by expert (``out``) back in their (token, k) pairs' order, each times its routing weight (none
    where the weights scaled the inputs)."""
    pairs = torch.empty_like(out)
    pairs[order] = out
    return pairs if weights is None else pairs * weights.reshape(-1, 1).to(pairs.dtype)


def _after_load(module: "Sparse24Experts", incompatible_keys) -> None:
    module._lay_out()  # load_state_dict(assign=True) gave the experts new tensors


def _addresses(head: Sparse24Linear, tail: Sparse24Linear) -> tuple[int, ...]:
    """Where the first and last experts' values, metadata and biases are: a span is laid out again where they moved."""
    if head.bias is None:
        return head.values.data_ptr(), tail.values.data_ptr(), head.metadata.data_ptr(), tail.metadata.data_ptr()
    return (head.values.data_ptr(), tail.values.data_ptr(), head.metadata.data_ptr(), tail.metadata.data_ptr(),
            head.bias.data_ptr(), tail.bias.data_ptr())


class _Experts(nn.ModuleList):
    """One projection's per-expert layers.  Each reads its own tokens, so they are never siblings of one GEMM:
    ``fuse_siblings`` leaves them out."""

    kp_no_siblings = True

    def __init__(self, layers: list[Sparse24Linear], name: str):
        super().__init__(layers)
        self.kp_name = name  # "first" or "down": the key of its span in Sparse24Experts._spans


class Sparse24Experts(nn.Module):
    """The forward of a transformers experts module (see the module docstring), on 2:4 weights.

    ``first[e]`` is expert ``e``'s gate/up projection (``up_proj`` where the experts have no gate) and ``down[e]`` its
    down projection, each a ``Sparse24Linear`` that runs the rows of x routed to the expert.  The gating is the
    source module's own ``_apply_gate`` (gpt-oss clamps and interleaves), with its activation and scalar attributes
    carried over.  ``every_token``: the forward is an ``EVERY_TOKEN`` module's, ``forward(hidden_states [E T, H])``,
    each expert's T rows in turn, with no routing.
    """

    def __init__(self, first: list[Sparse24Linear], down: list[Sparse24Linear], act_fn: nn.Module | None,
                 has_gate: bool = True, gate=None, post_expert_norm: nn.Module | None = None,
                 every_token: bool = False, **attributes):
        super().__init__()
        if len(first) != len(down) or not first:
            raise InvalidProblem(f"first has {len(first)} experts and down {len(down)}; both need the same count, "
                                 f"at least one")
        self.first, self.down = _Experts(first, "first"), _Experts(down, "down")
        self._out = down[0].out_features  # read by every grouped call: once here, not through the ModuleList
        self.act_fn = act_fn
        self.post_expert_norm = post_expert_norm
        self.has_gate = has_gate
        self.every_token = every_token
        self.num_experts = len(first)
        self.is_transposed = False  # how the source held its weights: dense_parts writes them so
        self._gate = gate if gate is not None else _default_gate
        for name, value in attributes.items():
            setattr(self, name, value)
        self._epilogue = self._first_epilogue()
        self._spans: dict = {}  # "first" / "down" -> (its layers' addresses, their tensors end to end): _span
        self._runs: dict = {}  # (device, dtype) -> whether the grouped kernel runs this module there: _grouped
        self._bound_cache: dict = {}  # (device, dtype) -> 0 .. E: _bounds
        self._lay_out()
        self.register_load_state_dict_post_hook(_after_load)

    def _lay_out(self) -> None:
        """One copy of each projection's weights, the experts' tensors views of it (``_span``), and whether the
        grouped kernel runs the module where its weights are: after building, moving and loading, so that a traced
        forward finds both made (it cannot read addresses)."""
        self._runs.clear()
        for layers in (self.first, self.down):
            self._span(layers)
        w = self.first[0].values
        self.runs_grouped(w.device, w.dtype)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        self._lay_out()  # .to(), .cuda(), .half() ... gave each expert a storage of its own
        return out

    def _first_epilogue(self) -> str | None:
        """The kernels' epilogue that computes what comes between the projections, or None: the gated one for
        transformers' default gating (gate columns first), the activation where there is no gate.  The first
        projection then runs its GEMM and the gating as one call (one launch over every expert on the grouped
        kernel; two calls fewer an expert on the others)."""
        from ..sparse24.plan import gated_reason
        from .gated_siblings import activation_of

        if self.act_fn is None or self.first[0].layout != "sp tiled":
            return None
        activation = activation_of(self.act_fn)
        if activation is None or not self.has_gate:
            return activation
        default = getattr(self._gate, "__name__", "") in ("_default_apply_gate", "_default_gate")
        if not default or not getattr(self, "is_concatenated", True) or \
                gated_reason(self.first[0].out_features) is not None:
            return None
        return f"gated_{activation}_first"

    @classmethod
    def from_experts(cls, experts: nn.Module, pruned: dict | None = None, consume: bool = False) -> "Sparse24Experts":
        """Prune each expert's projections by magnitude (2 of every 4 along their inputs) and compress them; or, with
        ``pruned`` (``{projection name: [Sparse24Weight of each expert]}``, as ``pruning/experts.py`` calibrates
        them), hold those.  ``consume``: ``pruned``'s lists may be changed in place, each expert's weight dropped as
        it is laid out (the loaders pass their checkpoint tensors so, which are then freed one by one)."""
        reason = experts_reason(experts)
        if reason is not None:
            raise InvalidProblem(f"experts is a {type(experts).__name__} that cannot be held 2:4: {reason}")
        flags = _flags(experts)
        layers = []
        for name in _parts(flags["has_gate"]):
            count = getattr(experts, name).shape[0]
            biases = expert_bias(experts, name)
            given = None if pruned is None else pruned[name] if consume else list(pruned[name])
            span = ExpertSpan(count, given[0].shape, given[0].values) if given is not None else \
                ExpertSpan.of(experts, name)
            built = []
            for e in range(count):
                with torch.no_grad():
                    if given is not None:  # each entry replaced as it is laid out: consumed, it is freed now
                        w24 = given[e] = span.laid_out(e, given[e])
                    else:
                        w24 = span.compressed(e, expert_weight(experts, name, e).detach(), prune=True)
                    bias = biases[e].detach().clone() if biases is not None else None
                built.append(Sparse24Linear(w24.values, w24.metadata, bias, in_features=w24.shape[1], _validate=False))
            layers.append(built)
        # Scalars the source's gating may read (gpt-oss: alpha, limit), and its config.
        skip = set(FLAGS) | {"training", "num_experts"}
        attributes = {k: v for k, v in vars(experts).items() if not k.startswith("_") and k not in skip and
                      (v is None or isinstance(v, (bool, int, float, str)) or k == "config")}
        gate = getattr(type(experts), "_apply_gate", None)
        norm = experts.post_expert_norm if flags["has_post_expert_norm"] else None
        act = getattr(experts, "act_fn", None)
        out = cls(layers[0], layers[1], act, flags["has_gate"], gate, norm, runs_every_token(experts), **attributes)
        out.is_transposed = flags["is_transposed"]
        out.__dict__["_dense_skeleton"] = _meta_skeleton(experts)  # not a child: no state, moved with nothing
        return out.train(experts.training)

    def to_dense_module(self) -> nn.Module:
        """The transformers experts module this was built from (``from_experts``), holding the pruned weights
        (``dense_parts``) where it held its dense ones, on their device and in their dtype: what
        ``model.dequantize()`` puts back.  Refused where it was not built from one."""
        skeleton = self.__dict__.get("_dense_skeleton")
        if skeleton is None:
            raise InvalidProblem("this Sparse24Experts was not built from a transformers experts module "
                                 "(Sparse24Experts.from_experts), so there is no module to give back: write its "
                                 "pruned weights with kp.hf.save_model(model, path, format='dense')")
        parts = self.dense_parts()
        held = {k: tuple(v.shape) for k, v in skeleton._parameters.items() if v is not None}
        kept = {k: tuple(parts[k].shape) for k in held if k in parts}
        buffers = [k for k, v in skeleton._buffers.items() if v is not None]
        if kept != held or buffers:
            raise InvalidProblem(f"the {type(skeleton).__name__} this was built from holds {held} and buffers "
                                 f"{buffers}, and the 2:4 experts give back {kept}: write the pruned weights with "
                                 f"kp.hf.save_model(model, path, format='dense')")
        dense = copy.copy(skeleton)
        dense._parameters = {k: None if v is None else nn.Parameter(parts[k], v.requires_grad)
                             for k, v in skeleton._parameters.items()}
        dense._modules = dict(skeleton._modules)
        return dense.train(self.training)

    def dense_parts(self) -> dict[str, torch.Tensor]:
        """The pruned weights as the transformers module holds them, by its names: ``gate_up_proj`` (or
        ``up_proj``), ``down_proj`` and their ``_bias``, 3-D (``[E, out, in]``, or ``[E, in, out]`` where the
        source was transposed).  What ``hf.save_model(format="dense")`` writes."""
        return self._stacked(dense=True)

    def stacked_parts(self) -> dict[str, torch.Tensor]:
        """The 2:4 weights stacked as ``hf.save_model(format="kernelplan")`` writes them: ``{part}.values [E, M, K/2]``
        and ``{part}.metadata [E, M, K/8]`` (the public format, each expert's projection ``[out, in]``) by the
        transformers module's names, and its ``_bias`` tensors."""
        return self._stacked(dense=False)

    def _stacked(self, dense: bool) -> dict[str, torch.Tensor]:
        out = {}
        for name, layers in zip(_parts(self.has_gate), (self.first, self.down)):
            if dense:
                weights = [m.to_dense() for m in layers]
                out[name] = torch.stack([w.t() for w in weights] if self.is_transposed else weights)
            else:
                public = [m.weight24.public() for m in layers]
                out[name + ".values"] = torch.stack([w.values.detach() for w in public])
                out[name + ".metadata"] = torch.stack([w.metadata for w in public])
            if layers[0].bias is not None:
                out[name + "_bias"] = torch.stack([m.bias.detach() for m in layers])
        return out

    def _span(self, layers: _Experts) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The projection's values, metadata and biases, every expert's end to end (the grouped kernel's W: the
        device layout of the stacked rows), as views of one storage each.  Where ``.to()``, a deep copy or
        ``load_state_dict(assign=True)`` gave the experts storages of their own, they are laid out again here."""
        name = layers.kp_name
        hit = self._spans.get(name)
        if _is_compiling():  # made by _lay_out: a traced forward cannot compare addresses
            return hit[1]
        if hit is not None and hit[0] == _addresses(*hit[2]):
            return hit[1]
        head, tail, count = layers[0], layers[-1], len(layers)
        spans = []
        for i in range(2 if head.bias is None else 3):  # values, metadata (, biases)
            tensors = [(m.values, m.metadata, m.bias)[i] for m in layers]
            first = tensors[0]
            storage = first.untyped_storage()
            # Every expert checked, not the ends alone: a span with a refused expert's rows left unused (ExpertSpan)
            # has its ends in place and a middle expert elsewhere.
            if all(t.untyped_storage().data_ptr() == storage.data_ptr() and t.is_contiguous() and
                   t.data_ptr() == first.data_ptr() + e * first.nbytes for e, t in enumerate(tensors)):
                span = first.new_empty(0).set_(storage, first.storage_offset(), (count * first.shape[0],
                                                                                  *first.shape[1:]), first.stride())
            else:
                span = torch.cat([t.detach() for t in tensors])
                for e, t in enumerate(tensors):
                    if i == 0:
                        forget(t)  # what calls kept for the expert's old storage
                    t.data = span[e * first.shape[0]:(e + 1) * first.shape[0]]
            spans.append(span)
        spans = (spans[0], spans[1], spans[2].view(count, -1) if head.bias is not None else None)
        self._spans[name] = (_addresses(head, tail), spans, (head, tail))  # after any move
        return spans

    def _grouped(self, x: torch.Tensor) -> bool:
        """Whether this call runs each projection as one grouped launch (``kernels/sparse24_grouped.py``): on
        Hopper, without autograd (the grouped kernel has no backward), for weights it reads."""
        return not torch.is_grad_enabled() and self.runs_grouped(x.device, x.dtype)

    def runs_grouped(self, device: torch.device, dtype: torch.dtype) -> bool:
        """Whether calls without autograd on ``device`` in ``dtype`` run on the grouped kernel."""
        runs = self._runs.get((device, dtype))
        if runs is None:  # the shapes are the module's: one verdict per device and dtype (_lay_out clears them)
            from ..kernels.sparse24_grouped import grouped_reason

            if device.type != "cuda" or self.first[0].layout != "sp tiled":
                runs = False
            else:
                capability = torch.cuda.get_device_capability(device)
                runs = all(grouped_reason(capability, m.out_features, m.in_features, self.num_experts, dtype) is None
                           for m in (self.first[0], self.down[0]))
            self._runs[device, dtype] = runs
        return runs

    def grouped_gemms(self) -> list[tuple[int, int, bool, str | None, bool]]:
        """``(M, K, bias, epilogue, scatter)`` of each projection's grouped launch: the kernels ``kp.warmup``
        builds."""
        first, down = self.first[0], self.down[0]
        gemms = [(first.out_features, first.in_features, first.bias is not None, self._epilogue, False),
                 (down.out_features, down.in_features, down.bias is not None, None,
                  self.post_expert_norm is None and not self.every_token)]
        if self.every_token and self.post_expert_norm is None:  # its MoE layer's routed calls (nn/moe_routes.py)
            gemms.append((down.out_features, down.in_features, down.bias is not None, None, True))
        return gemms

    def warm_routing(self) -> None:
        """Compile the grouped forward's routing kernels for this module's shapes, as ``kp.warmup`` does: routing
        weights in the experts' dtype and in float32 (routers give either), for a decode's pairs and for as many as
        take the counts' own summing launch (``_SCAN_MIN_CHUNKS``): one variant of each for every token count.  An
        ``every_token`` module's are its MoE layer's routed calls' (``nn/moe_routes.py``), which scale the inputs by
        the sigmoid of the router's logits."""
        from ..kernels import moe_route

        weigh = "sigmoid inputs" if self.every_token else "outputs"
        w = self.first[0].values
        many = moe_route._SCAN_MIN_CHUNKS * moe_route._B
        x = torch.zeros(many, self.first[0].in_features, dtype=w.dtype, device=w.device)
        y = x.new_empty(many, self._out) if self.post_expert_norm is None else None
        for pairs in (1, many):
            ids = torch.zeros(pairs, 1, dtype=torch.int64, device=w.device)
            for dtype in (w.dtype, torch.float32):
                moe_route.route(ids, torch.ones(pairs, 1, dtype=dtype, device=w.device), x[:pairs], self.num_experts,
                                y[:pairs] if y is not None else None, weigh)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor | None = None,
                top_k_weights: torch.Tensor | None = None) -> torch.Tensor:
        routing = top_k_index is not None or top_k_weights is not None
        if self.every_token and not routing:
            return self._every_token_forward(hidden_states)
        if self.every_token or top_k_index is None or top_k_weights is None:
            given = "routing (top_k_index and top_k_weights)" if self.every_token else \
                f"top_k_index {None if top_k_index is None else tuple(top_k_index.shape)} and top_k_weights " \
                f"{None if top_k_weights is None else tuple(top_k_weights.shape)}"
            want = "hidden_states [E T, H] alone (each expert's T rows in turn)" if self.every_token else \
                "hidden_states [T, H] with top_k_index and top_k_weights [T, k], as transformers' experts modules do"
            raise InvalidProblem(f"these experts were given {given}: they take {want}")
        return self.routed(hidden_states, top_k_index, top_k_weights)

    def routed(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
               weigh: str = "outputs") -> torch.Tensor:
        """The experts on routed tokens, as transformers' top-k experts modules take them: each of ``hidden_states
        [T, H]`` through its ``top_k_index [T, k]`` experts, their outputs weighted by ``top_k_weights`` and summed.
        ``forward`` for a top-k module; for an ``every_token`` one, the route of its MoE layer (``nn/moe_routes.py``),
        which sends each token to the experts its router chose alone.  With ``weigh`` a key of ``INPUT_WEIGHTS``, the
        weights scale each pair's input instead (Llama-4's MoE: each token's copy by its router's score)."""
        if hidden_states.dim() != 2 or top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape or \
                top_k_index.shape[0] != hidden_states.shape[0]:
            raise InvalidProblem(
                f"hidden_states {tuple(hidden_states.shape)}, top_k_index {tuple(top_k_index.shape)} and "
                f"top_k_weights {tuple(top_k_weights.shape)}: the experts take hidden_states [T, H] and routing "
                f"[T, k] of the same T, as transformers' experts modules do")
        if weigh != "outputs" and weigh not in INPUT_WEIGHTS:
            raise InvalidProblem(f"weigh {weigh!r}: the routing weights scale the experts' outputs (\"outputs\") or "
                                 f"their inputs ({', '.join(map(repr, INPUT_WEIGHTS))})")
        tokens, k = top_k_index.shape
        if self._grouped(hidden_states):
            pairs = self._grouped_forward(hidden_states, top_k_index, top_k_weights, weigh)
        else:
            x, order, offsets = self._sorted_pairs(hidden_states, top_k_index)
            weights = top_k_weights
            if weigh != "outputs":  # as the module's product: in x's dtype, or promoted and rounded back to it
                x = (x * INPUT_WEIGHTS[weigh](weights.reshape(-1))[order, None]).to(x.dtype)
                weights = None
            pairs = _combine(self._per_expert(x, offsets[1:].tolist()), order, weights)
        if k == 1:  # each token's one pair is its row: no sum of one term (a launch and a buffer)
            return pairs.to(hidden_states.dtype)
        return pairs.view(tokens, k, pairs.shape[1]).sum(dim=1).to(hidden_states.dtype)

    def _every_token_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """An ``EVERY_TOKEN`` module's forward: expert e's rows of ``hidden [E T, H]`` are ``e T .. (e + 1) T``, the
        output's the same.  The grouped kernel's offsets are then ``0, T, 2 T ...``: one launch a projection."""
        experts = self.num_experts
        width = self.first[0].in_features
        if hidden.dim() != 2 or hidden.shape[1] != width or hidden.shape[0] % experts:
            raise InvalidProblem(f"hidden_states {tuple(hidden.shape)}: these {experts} experts take [E T, {width}], "
                                 f"each expert's T rows in turn (E = {experts}), as {type(self).__name__}'s source "
                                 f"module did")
        tokens = hidden.shape[0] // experts
        if self._grouped(hidden) and tokens:
            _, grouped_linear = self._grouped_ops(_is_compiling())
            if hidden.stride(1) != 1:
                hidden = hidden.contiguous()
            offsets = torch.arange(0, (experts + 1) * tokens, tokens, dtype=torch.int32, device=hidden.device)
            h = self._grouped_first(grouped_linear, hidden, offsets)
            return self._norm(grouped_linear(h.contiguous(), *self._span(self.down), offsets, experts, None))
        return self._per_expert(hidden, [tokens * (e + 1) for e in range(experts)])

    def _sorted_pairs(self, hidden: torch.Tensor, index: torch.Tensor):
        """``(x, order, offsets)`` by torch ops: the (token, expert) pairs by expert (``order``), so that each expert's
        rows of ``x`` are one contiguous block starting at ``offsets[e]`` (int32 ``[E + 1]``).  Ids outside the
        experts (transformers' expert-parallel sentinel is E) sort last and add nothing, as in its eager loop, and
        as the routing kernel places them."""
        ids = index.reshape(-1)
        sorted_ids, order = torch.sort(torch.where(ids < 0, self.num_experts, ids), stable=True)
        # Where each expert's rows start, found in the sorted ids (no bincount, whose output length waits on the
        # device for the largest id).
        offsets = torch.searchsorted(sorted_ids, self._bounds(sorted_ids), out_int32=True)
        x = hidden.index_select(0, torch.div(order, index.shape[1], rounding_mode="floor"))
        return x, order, offsets

    def _bounds(self, ids: torch.Tensor) -> torch.Tensor:
        """``0 .. E`` on ids' device and in their dtype, made once: what ``searchsorted`` looks up."""
        key = (ids.device, ids.dtype)
        bounds = self._bound_cache.get(key)
        if bounds is None:
            bounds = self._bound_cache[key] = torch.arange(self.num_experts + 1, device=ids.device, dtype=ids.dtype)
        return bounds

    def _grouped_forward(self, hidden: torch.Tensor, index: torch.Tensor, weights: torch.Tensor,
                         weigh: str) -> torch.Tensor:
        """Each projection as one launch over every expert's rows.  Returns each (token, k) pair's weighted output,
        in the pairs' order ``[T k, H]``.  The routing weights scale the outputs in the down launch's store, or the
        inputs as the routing kernel copies them (``weigh``).

        The routing (the pairs sorted by expert, the offsets, the rows of x) is the routing kernel's launches
        (``kernels/moe_route.py``), in place of six torch ops: at a decode's sizes an eager call is host work, and an
        experts call's graph time with the kernel was 0.76-0.98x of the same with the ops at 64-65536 pairs (H200,
        bench/results/sparse24-moe-route-scan-h200.json, docs/design/0036)."""
        traced = _is_compiling()
        route, grouped_linear = self._grouped_ops(traced)
        experts = self.num_experts
        if hidden.stride(1) != 1:
            hidden = hidden.contiguous()
        # Each row stored where its pair goes, times its routing weight, by the down launch: no reordering and
        # weighting passes over [T k, H] after it.  The rows of pairs outside the experts (the sentinel's) no launch
        # writes: the routing kernel zeroes them.
        scatter = self.post_expert_norm is None
        pairs = hidden.new_empty(index.numel(), self._out) if scatter else None
        x, order, offsets, scale = route(index.contiguous(), weights.contiguous(), hidden, experts, pairs, weigh)
        h = self._grouped_first(grouped_linear, x, offsets)
        down = self._span(self.down)
        if scatter:
            if traced:
                experts_ops.grouped_linear_scatter(h.contiguous(), *down, offsets, experts, pairs, order, scale)
                return pairs
            return grouped_linear(h.contiguous(), *down, offsets, experts, scatter=(pairs, order, scale))
        out = self._norm(grouped_linear(h.contiguous(), *down, offsets, experts, None))
        unrouted = torch.arange(out.shape[0], device=out.device) >= offsets[experts:]  # rows no launch wrote
        return _combine(out.masked_fill(unrouted[:, None], 0), order, weights if weigh == "outputs" else None)

    @staticmethod
    def _grouped_ops(traced: bool):
        """``(route, grouped_linear)``: ``traced`` (the caller's ``_is_compiling()``), the kernels as ops a compiled
        graph holds (experts_ops), not raw launches that break it."""
        if traced:
            return experts_ops.moe_route, experts_ops.grouped_linear
        from ..kernels.moe_route import route
        from ..kernels.sparse24_grouped import grouped_linear

        return route, grouped_linear

    def _grouped_first(self, grouped_linear, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """The first projection's grouped launch on x's rows by expert, through the gating: in the launch's epilogue
        where it has one (no [S, 2I] pass), else as the module's own ops after it."""
        if self._epilogue is not None:
            return grouped_linear(x, *self._span(self.first), offsets, self.num_experts, self._epilogue)
        return self._activate(grouped_linear(x, *self._span(self.first), offsets, self.num_experts, None))

    def _activate(self, h: torch.Tensor) -> torch.Tensor:
        """The first projection's output through the gating (or, without a gate, the activation)."""
        return self._gate(self, h) if self.has_gate else self.act_fn(h)

    def _norm(self, out: torch.Tensor) -> torch.Tensor:
        return self.post_expert_norm(out) if self.post_expert_norm is not None else out

    def _per_expert(self, x: torch.Tensor, ends: list[int]) -> torch.Tensor:
        """Each expert's rows through its own layers (the CPU, autograd, GPUs the grouped kernel does not run on)."""
        out = x.new_zeros(x.shape[0], self.down[0].out_features)
        start = 0
        traced = _is_compiling()
        for e, end in enumerate(ends):
            if traced:  # the ends are unbacked sizes there: what they are bounded by, and no branch on them
                torch._check(start <= end)
                torch._check(end <= x.shape[0])
            if traced or end > start:
                if self._epilogue is not None and not torch.is_grad_enabled():
                    h = self.first[e].with_epilogue(x[start:end], self._epilogue)
                else:
                    h = self._activate(self.first[e](x[start:end]))
                out[start:end] = self._norm(self.down[e](h))
            start = end
        return out

    def extra_repr(self) -> str:
        return (f"num_experts={self.num_experts}, in_features={self.first[0].in_features}, "
                f"intermediate={self.down[0].in_features}, has_gate={self.has_gate}, "
                f"bias={self.first[0].bias is not None}{', every_token=True' * self.every_token}")
