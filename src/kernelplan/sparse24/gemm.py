"""2:4 sparse GEMM, functional level: ``Y[N, M] = X[N, K] @ W^T (+ bias) -> activation``, W in the 2:4 format.

Layered top to bottom: the plan level (``plan.py``: descriptor, args, plan and the
reference backend, re-exported here), the custom op with its autograd formula,
the functional wrapper and its inference fast path.
"""

from __future__ import annotations

import functools
import math
import weakref
from typing import Optional

import torch

from .._checks import check_tensor, choice, plain_eager
from .._ops import inference_op
from ..activations import ACTIVATIONS, GATED_EPILOGUES, GATED_GATES, epilogue_columns
from ..gated import gate_activation
from ..dtypes import dtype_info
from ..errors import InvalidProblem
from ..kernels import stream_capturing
from ..plan import Backend, dispatch_generation, memoised_select
from . import tuning
from .dispatch import MEMORY_POLICIES
from .format import Sparse24Weight, derived_from, forget_derived, output_rows
from .layout import PUBLIC, SP_LAYOUT, check_layout, k_fits, layout_of, pack_values, unpack, weight_shape
# n_bucket and rule_backend are re-exported: callers (warm.py, tests) import the plan level's names from here too.
from .plan import (SPARSE24_ACTIVATIONS, SPARSE24_EPILOGUES, GemmSparse24Args,  # noqa: F401
                   GemmSparse24Descriptor, GemmSparse24Plan, gated_reason, n_bucket, rule_backend)

# -- custom op: torch.compile-safe, autograd-aware ---------------------------


@functools.lru_cache(maxsize=4096)
def _descriptor(n, m, k, dtype, activation, has_bias, device, graph, memory) -> GemmSparse24Descriptor:
    return GemmSparse24Descriptor(n, m, k, dtype_info(dtype).name, activation or None, has_bias, str(device), graph,
                                  memory)


def _sparse24_linear_impl(
    x: torch.Tensor, values: torch.Tensor, metadata: torch.Tensor, bias: Optional[torch.Tensor], activation: str,
    memory: str,
) -> torch.Tensor:
    # The op's body, as a compiled graph or autograd runs it: through the same prepared entries as an eager call
    # (a call of a compiled model took the whole dispatch each time: bench/sparse24_compiled.py).
    key = _entry_key(x, values, bias, activation, memory)
    hit = _prepared.get(key)
    if hit is not None and hit.current(x, values, metadata, bias):
        return hit.call(x, values, metadata, bias)
    # An entry's first call checks the operands (an op can be called directly); the entry holds them to it after.
    activation, memory = _checked(x, values, metadata, bias, activation or None, memory)
    return _prepare(key, x, values, metadata, bias, activation or "", memory)


def _entry_key(x, values, bias, activation, memory) -> tuple:
    """A fast-path entry's key (``_prepared``): what is cheap to hash; ``_Entry.current`` checks the rest."""
    return id(values), x.shape, None if bias is None else id(bias), activation, memory, \
        x.is_cuda and stream_capturing()


def _reads(backend: Backend, layout: str) -> bool:
    """Whether ``backend`` runs a weight held in ``layout`` as it is (every backend reads the public format)."""
    return layout == PUBLIC or layout in getattr(backend, "layouts", (PUBLIC,))


def public_parts(values: torch.Tensor, metadata: torch.Tensor,
                 k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The public format of a weight held in the device layout, for a backend that reads only that format; ``k``:
    the logical K of a weight held padded (x's).

    Built once per weight state and kept with it (``derived_from``), counted by
    ``Sparse24Weight.derived_bytes``: under memory="compact" only where the rule
    names such a backend (f32 weights on CUDA), under "fast" for the candidates.
    """
    key = PUBLIC if k is None or k == weight_shape(values)[1] else f"{PUBLIC} k={k}"
    return derived_from(values, metadata, key, lambda v, m: unpack(v.detach(), m, k))


def _plan_for(x, values, metadata, bias, activation, memory) -> GemmSparse24Plan:
    """The dispatched plan of a call; under ``memory="fast"``, its bucket tuned first if this is its first call."""
    graph = x.is_cuda and stream_capturing()
    problem = (math.prod(x.shape[:-1]), weight_shape(values)[0], x.shape[-1], x.dtype, activation, bias is not None,
               x.device)
    desc = _descriptor(*problem, graph, memory)
    if x.is_cuda and not graph and memory == "fast" and tuning.first_of_its_bucket(desc):
        # Each candidate is timed through this very call path, host work included: a backend
        # whose launches cost more host time than its kernel saves must not win (measured: the
        # Triton path timed alone beat dense at 4096^2, n = 4, and lost 2x through the full call).
        # The same timings, kernels alone, choose for the bucket's calls recorded into CUDA graphs.
        # The candidates run on a copy of the weight: each builds its own layouts (a dense copy, a
        # tiled one, cuSPARSELt's), which would otherwise stay with the weight for as long as it
        # lives, the losers' included.  The copy and its layouts go when tuning ends.
        scratch = values.detach().clone(), metadata.clone()
        tuning.tune(desc, lambda plan: functools.partial(_bound(plan, layout_of(values)), x, *scratch, bias))
        del scratch
    plan = memoised_select(GemmSparse24Plan, desc)
    if x.is_cuda and not graph:
        _ready_for_graphs(plan, memoised_select(GemmSparse24Plan, _descriptor(*problem, True, memory)),
                          x, values, metadata, bias)
    return plan


def _bound(plan: GemmSparse24Plan, layout: str = PUBLIC):
    """``call(x, values, metadata, bias) -> y`` through ``plan`` for a weight held in ``layout``.

    The backend's bound call if it has one; for a weight in the device layout
    and a backend that reads only the public format, on ``public_parts``.
    """
    call = plan.backend.bind(plan.desc) or functools.partial(_linear_with, plan)
    return call if _reads(plan.backend, layout) else functools.partial(_on_public_parts, call)


def _on_public_parts(call, x, values, metadata, bias) -> torch.Tensor:
    return call(x, *public_parts(values, metadata, x.shape[-1]), bias)


def _linear_with(plan, x, values, metadata, bias) -> torch.Tensor:
    """One call through ``plan``: y allocated here, the args built from inputs already checked."""
    y, x2, y2 = output_rows(x, epilogue_columns(weight_shape(values)[0], plan.desc.activation))
    # linear() checked x and bias and Sparse24Weight its parts, or the custom op's schema did;
    # y is ours: the plan's own re-checks would only add host time.
    plan.run_prechecked(GemmSparse24Args(x2, values, metadata, y2, bias))
    return y


_sparse24_linear_op = torch.library.custom_op("kernelplan::sparse24_linear", mutates_args=())(_sparse24_linear_impl)


def _linear_fake(x, values, metadata, bias, activation, memory):
    return x.new_empty((*x.shape[:-1], epilogue_columns(weight_shape(values)[0], activation or None)))


_sparse24_linear_op.register_fake(_linear_fake)

# The same body as an op with no autograd formula, for calls that need none (a compiled inference graph, a tensor
# subclass under no_grad).
_sparse24_inference_op = inference_op("sparse24_linear_inference(Tensor x, Tensor values, Tensor metadata, "
                                      "Tensor? bias, str activation, str memory) -> Tensor",
                                      _sparse24_linear_impl, _linear_fake)


def _setup(ctx, inputs, output):
    x, values, metadata, bias, activation, _ = inputs
    ctx.save_for_backward(x, values, metadata, bias)
    ctx.activation = activation


def _backward(ctx, dy):
    # Recomputes the pre-activation instead of saving it: one more GEMM in
    # backward, one less [N, M] tensor kept alive between passes.
    x, values, metadata, bias = ctx.saved_tensors
    compute = dtype_info(x.dtype).compute
    # The weight as its tensors hold it; x's K columns padded to as many (a weight the device layout pads) with zeros,
    # and dx cut back to them.
    w24 = Sparse24Weight(values.to(compute), metadata, _validate=False).public()
    positions = w24.positions()  # unpacked once: for W and for the gradient gather
    w = w24.decompress(positions)
    k = x.shape[-1]
    x2 = x.reshape(-1, k).to(compute)
    if k < w.shape[1]:
        x2 = torch.nn.functional.pad(x2, (0, w.shape[1] - k))
    g = dy.reshape(-1, epilogue_columns(w.shape[0], ctx.activation or None)).to(compute)
    if ctx.activation:
        z = x2 @ w.T
        if bias is not None:
            z = z + bias.to(compute)
        gated = GATED_EPILOGUES.get(ctx.activation)
        g = gated.grad(z, g) if gated is not None else g * ACTIVATIONS[ctx.activation].grad(z)
    dx = (g @ w[:, :k]).reshape(x.shape).to(x.dtype) if ctx.needs_input_grad[0] else None
    dvalues = None
    if ctx.needs_input_grad[1]:
        # Only the stored positions get gradient: the mask stays fixed.
        dvalues = torch.gather(g.T @ x2, 1, positions).to(values.dtype)
        if layout_of(values) == SP_LAYOUT:  # the gradient in the layout the values are held in
            dvalues = pack_values(dvalues)
    dbias = g.sum(0).to(bias.dtype) if bias is not None and ctx.needs_input_grad[3] else None
    return dx, dvalues, None, dbias, None, None


_sparse24_linear_op.register_autograd(_backward, setup_context=_setup)


def linear(
    x: torch.Tensor,
    w24: Sparse24Weight,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    memory: str = "compact",
) -> torch.Tensor:
    """``activation(x @ W^T + bias)`` with ``W`` 2:4-compressed; x of any leading shape.

    Differentiable in ``x``, ``bias`` and ``w24.values`` (the mask is fixed).
    ``activation`` is None, "relu", "gelu" (erf), "gelu_tanh", "silu" or "quick_gelu" (z sigmoid(1.702 z), CLIP's).
    ``memory`` is the dispatch policy (``sparse24/dispatch.py``): "compact", the
    kernels of one device layout kept with the weight (0.5625x of its dense
    bytes), chosen by rule; or "fast", every backend timed on the first call of
    each N bucket, each keeping its own copy.
    """
    if not isinstance(w24, Sparse24Weight):
        raise InvalidProblem(
            f"w24 is a {type(w24).__name__}; it must be a Sparse24Weight: build it with "
            f"kernelplan.sparse24.compress(kernelplan.sparse24.prune(w))"
        )
    return linear_parts(x, w24.values, w24.metadata, bias, activation, memory, w24.shape[1])


def gated_linear(
    x: torch.Tensor,
    w24: Sparse24Weight,
    bias: torch.Tensor | None = None,
    kind: str = "swiglu",
    gate: str = "first",
    approximate: str = "none",
    memory: str = "compact",
) -> torch.Tensor:
    """``kernelplan.gated_activation(linear(x, w24, bias), kind, gate=gate, approximate=approximate)`` as one GEMM.

    W's rows are two halves ``[first; second]`` (M % 32 == 0); column ``c`` of the
    result, ``[..., M / 2]``, is ``act(gate) * other`` of rows ``c`` and ``M / 2 + c``,
    the gate being the half ``gate`` names: Llama's ``silu(gate_proj(x)) * up_proj(x)``
    is ``kind="swiglu", gate="first"`` with W = ``[gate_proj; up_proj]``, as in
    ``kernelplan.nn.GatedMLP``.  The GPU kernels of the one layout (``cuda_ws``,
    ``cuda_sp``) apply it in their epilogue, so the [N, M] pre-activation is never
    written; the reference computes it on CPU.  Differentiable as ``linear``.
    """
    if not isinstance(w24, Sparse24Weight):
        raise InvalidProblem(
            f"w24 is a {type(w24).__name__}; it must be a Sparse24Weight: build it with "
            f"kernelplan.sparse24.compress(kernelplan.sparse24.prune(w))"
        )
    return linear_parts(x, w24.values, w24.metadata, bias, gated_epilogue(kind, gate, approximate), memory,
                        w24.shape[1])


def gated_epilogue(kind: str, gate: str = "first", approximate: str = "none") -> str:
    """The gated epilogue's name (``activations.GATED_EPILOGUES``) of ``gated_activation``'s arguments."""
    return f"gated_{gate_activation(kind, approximate)}_{choice(gate, 'gate', GATED_GATES)}"


def linear_parts(x, values, metadata, bias=None, activation=None, memory="compact", in_features=None) -> torch.Tensor:
    """``linear`` on a weight's parts, for holders of them (``Sparse24Linear``): no Sparse24Weight built.
    ``in_features``: the weight's logical K, checked against x at an entry's first call (a weight held padded)."""
    eager = plain_eager(x, values, bias)
    if eager:
        # Inference on operands seen before: the checks below passed for exactly this entry, and its plan is the
        # one dispatch chose (the generation says the choice has not changed).  A call recorded into a CUDA graph
        # has its own choice (GemmSparse24Descriptor.graph).  The key holds what is cheap to hash; the entry checks
        # the rest, each a read of one slot (_Entry says why).
        key = _entry_key(x, values, bias, activation, memory)
        hit = _prepared.get(key)
        if hit is not None and hit.current(x, values, metadata, bias):
            return hit.call(x, values, metadata, bias)
    activation, memory = _checked(x, values, metadata, bias, activation, memory, in_features)
    if not eager:
        # Traced, the choice is made once and guarded (grad mode, each tensor's requires_grad).
        grad = torch.is_grad_enabled() and (x.requires_grad or values.requires_grad or
                                            bias is not None and bias.requires_grad)
        op = _sparse24_linear_op if grad else _sparse24_inference_op
        return op(x, values, metadata, bias, activation or "", memory)
    return _prepare(key, x, values, metadata, bias, activation or "", memory)


def _checked(x, values, metadata, bias, activation, memory, in_features=None) -> tuple[str | None, str]:
    """A call's operands checked (``linear_parts``'s, and an op's first call on them): the epilogue and the policy
    as the plan takes them.  ``in_features``: the weight's logical K where its holder knows it; else x's K may be
    any the tensors hold (a weight in the device layout holds K padded to 64: x of 4304 or 4352 columns reads a
    weight of 4352; where the holder knows K, a wrong x is named)."""
    # Parts held apart (a Sparse24Weight built with _validate=False, a module's buffers) have not
    # been matched to each other: a wrong metadata shape would send kernels past its end.
    m, held = check_layout(values, metadata)
    check_tensor(x, "x", dtype=values.dtype, device=values.device)
    k = held if in_features is None else in_features
    if x.dim() < 1 or x.shape[-1] != k and not (in_features is None and layout_of(values) == SP_LAYOUT and
                                                 k_fits(x.shape[-1], held)):
        padded = "" if k == held or in_features is None else f", held padded to {held} columns"
        raise InvalidProblem(
            f"x has shape {tuple(x.shape)}; its last dimension must equal the weight's K = {k} "
            f"(weight shape [M, K] = [{m}, {k}]{padded})"
        )
    if in_features is not None and not k_fits(in_features, held):
        raise InvalidProblem(f"in_features = {in_features}, but the weight's tensors hold {held} columns: a weight "
                             f"of K columns holds K, or in the device layout K rounded up to 64")
    if bias is not None:
        check_tensor(bias, "bias", shape=(m,), dtype=values.dtype, device=values.device)
    if activation is not None:
        activation = choice(activation, "activation", SPARSE24_EPILOGUES)
        why = gated_reason(m) if activation in GATED_EPILOGUES else None
        if why is not None:
            raise InvalidProblem(f"the gated epilogue {activation!r} pairs the weight's two halves of rows, but {why}; "
                                 f"pad each half (gate and up) to a multiple of 16 rows")
    return activation, choice(memory, "memory", MEMORY_POLICIES)


def _prepare(key, x, values, metadata, bias, activation: str, memory: str) -> torch.Tensor:
    """The first call of a fast-path ``key``: its plan dispatched, its call bound and kept (``_Entry``), and run."""
    plan = _plan_for(x, values, metadata, bias, activation, memory)
    layout = layout_of(values)
    call = _bound(plan, layout)
    if hasattr(call, "held"):  # a kernel's call bound to the weight: as held, or the layout it derived beside it
        call = call.held(values, metadata)
    if len(_prepared) >= _MAX_PREPARED:
        _prepared.clear()
        for keys in _weight_keys.values():
            keys.clear()
    _prepared[key] = _Entry(values, metadata, bias, x, plan, call)
    # The entries go with their weight: ``call`` may hold the weight's storage (a kernel bound to it, whose layout
    # is the weight itself), and a deleted model's weights stayed allocated while their entries lasted (about
    # 7 GiB of a 70B-shaped model; docs/design/0008).  One finalizer a weight, however many keys it gets.
    keys = _weight_keys.get(id(values))
    if keys is None:
        keys = _weight_keys[id(values)] = set()
        weakref.finalize(values, _forget_weight, id(values))
    keys.add(key)
    return call(x, values, metadata, bias)


def forget(values: torch.Tensor) -> None:
    """Drop what calls kept for a weight (its bound launches and derived layouts), before its ``.data`` is
    replaced: they hold the old storage, which would stay allocated until the weight's next call."""
    _forget_weight(id(values))
    forget_derived(values)


def _forget_weight(weight_id: int) -> None:
    for key in _weight_keys.pop(weight_id, ()):
        _prepared.pop(key, None)


def _ready_for_graphs(plan: GemmSparse24Plan, graphed: GemmSparse24Plan, x, values, metadata, bias) -> None:
    """Run ``graphed``, the choice made for graphs, once, eagerly, where it is not ``plan``'s backend.

    A capture may not build a weight's layouts (``derived_from``), and the
    capture's choice can differ from the eager one (GemmSparse24Descriptor.graph):
    so the first eager call with each weight, the warm-up before a capture,
    builds both.  Its output is discarded.  Once per weight, not per weight
    state: a training step would otherwise pay for a second GEMM per layer.
    """
    if graphed.backend is plan.backend:
        return
    key = (id(values), values.data_ptr(), graphed.backend.name)
    if key not in _graph_ready:
        _bound(graphed, layout_of(values))(x, values, metadata, bias)
        if len(_graph_ready) >= _MAX_PREPARED:
            _graph_ready.clear()
        _graph_ready.add(key)


_graph_ready: set = set()  # (id(values), its data pointer, backend) already run by _ready_for_graphs


class _Entry:
    """One entry of ``linear()``'s inference fast path: what its key leaves out, checked per call, and the call.

    ``call(x, values, metadata, bias) -> y`` is the plan's backend bound to its descriptor where the backend offers
    that (``Backend.bind``), or bound further to the weight (``held``): no args object, no plan, the least host work
    per call.  Slots of one object: a loop over a model's layers reads each entry cold, and a call's host work grew
    with every object it touched per weight (docs/design/0071, 0072).
    """

    __slots__ = ("values", "metadata", "bias", "ptr", "dtype", "device", "generation", "plan", "call")

    def __init__(self, values, metadata, bias, x, plan: GemmSparse24Plan, call):
        self.values, self.metadata = weakref.ref(values), weakref.ref(metadata)
        self.bias = None if bias is None else weakref.ref(bias)
        self.ptr, self.dtype, self.device = values.data_ptr(), values.dtype, x.device
        self.generation = dispatch_generation(GemmSparse24Plan)
        self.plan, self.call = plan, call

    def current(self, x, values, metadata, bias) -> bool:
        """Whether this entry runs a call on these operands: the same tensors (the data pointer too: a bound call
        holds the weight's address, and ``values.data = ...``, as Module._apply and grouped siblings do
        (nn/siblings.py), gives the same Parameter new storage), dtype and device, and no dispatch change since."""
        return self.values() is values and self.ptr == values.data_ptr() and self.metadata() is metadata and \
            (bias is None or self.bias() is bias) and x.dtype is self.dtype and values.dtype is self.dtype and \
            x.device == self.device and self.generation == dispatch_generation(GemmSparse24Plan)


# linear()'s inference fast path: (id(values), x's shape, id(bias), activation, memory, capturing) -> _Entry.
_prepared: dict = {}
_weight_keys: dict = {}  # id(values) -> its keys in _prepared, dropped with the weight (_forget_weight)


def fast_path_backends() -> list[dict]:
    """Which backend each problem on the inference fast path runs: one row per (n, m, k, dtype, graph, backend).

    Entries made before the latest dispatch change (a new measurement) are left out: no call runs them.
    """
    generation = dispatch_generation(GemmSparse24Plan)
    plans = (entry.plan for entry in _prepared.values() if entry.generation == generation)
    rows = {(p.desc.n, p.desc.m, p.desc.k, p.desc.dtype, p.desc.graph, p.sku.backend) for p in plans}
    return [dict(zip(("n", "m", "k", "dtype", "graph", "backend"), r)) for r in sorted(rows)]
_MAX_PREPARED = 4096
