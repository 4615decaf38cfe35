"""Sibling projections that read one input (q/k/v, gate/up) run as one GEMM on their weights laid end to end.

``fuse_siblings(model)`` gives each module's candidate children one ``Siblings``: the 2:4 linears (``SPECS``)
that could share a GEMM, with the same in_features, dtype, device, layout, memory policy and bias or none.
Which of them do read one input is watched, not guessed from names: on the first pass each runs alone and
the input each reads is noted, by identity and version (as ``sparsify`` groups layers for calibration).  A pass
ends when every candidate has been called or one is called again.  Candidates that read the same tensor one after
another become a group; a candidate that reads its own input (an attention's o_proj beside q/k/v) stays alone.  A
pass where no two candidates read one tensor (each called on its own) settles nothing, and the watch goes on; so
does one where layers were called on their own before the model's first pass began (``kp.warmup`` calls each
layer alone, outside the watch).  A pass that began with a stray call of a middle layer can group fewer layers
than the model's passes share (k and v without q): every result is still the layer's own.

A group lays its members' weights end to end in one buffer, and each member's tensors become views of its
rows: one copy, as before.  The first member called runs the GEMM of all of them; each other member takes
its columns of that output while its input is the same tensor, unchanged, and no member's weight changed.
Where that does not hold, or x has more than ``GROUP_MAX_ROWS`` rows, the call runs alone, on the member's own
view:
* under autograd (each member's gradient is its own);
* for an x the member refuses, so that the error names its own weight;
* inside a CUDA graph capture until the group's GEMM has run once outside one, and while the buffer must be
  rebuilt: ``.to()``, ``load_state_dict(assign=True)`` or a deep copy left the members off it, and the next call
  outside a capture lays them out again;
* for good, once a group's members stop reading one input (a cross-attention's k/v): ``broken``.

Gated MLPs (gate_proj/up_proj/down_proj/act_fn) are routed as well, to their group's GEMM with the activation in
its epilogue (``gated_siblings.py``; counted as "gated"), and so are MLPs with one activation, to their first
layer's GEMM with the activation in its epilogue (``activated.py``), and Llama-4's MoE layers to their chosen experts
alone (``moe_routes.py``).  ``Siblings.stats`` counts the calls of each
kind, so what ran is never a guess.  Under torch.compile each member
is its own op, as without a group, and is not counted.  A member's eager calls reach its group through its class's
``forward`` (``member_forward``), which hands them to the call ``_route`` set; its own GEMM is ``forward_alone``.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from .._checks import _is_compiling, plain_eager
from ..kernels import stream_capturing


@dataclass(frozen=True)
class Spec:
    """How one kind of linear module joins a group."""

    parts: tuple[str, ...]  # its weight's tensors, rows first (dim 0 runs along the output features)
    key: Callable[[nn.Module], tuple | None]  # what members must share; None where the module cannot join
    call: Callable  # (first member, x, *parts, bias) -> y of every member's rows
    forget: Callable[[torch.Tensor], None] = lambda t: None  # drop what calls kept for a part, before its .data goes
    # (first member, x, *parts, bias, epilogue) -> act(gate) * other of two members' rows (activations.GATED_EPILOGUES),
    # or None where the kind of module has no gated epilogue (nn/gated_siblings.py)
    gated: Callable | None = None


# Rows of x (tokens) up to which a group runs as one GEMM.  Over the sweep set's q/k/v and gate/up (H200, bf16,
# sparse24-siblings-sweep-h200.json), one GEMM against separate ones: median 1.52x at n = 1, 1.25-1.32x at n = 16-256,
# 1.08x at 512 and 1.03x at 2048.  Past 256 the model lost more than that: the members' outputs are strided views
# of the group's, and the elementwise work after them (SwiGLU's, the attention's) ran slower on them (a 512-token
# prefill of a Qwen2.5-7B-sized Llama: 2.69 ms grouped, 2.54 ms not; sparse24-model-h200.json, 0024).
GROUP_MAX_ROWS = 256

# Each kind of module that can join a group, by type: Sparse24Linear registers itself (nn/sparse24_linear.py).
SPECS: dict[type, Spec] = {}


def fuse_siblings(model: nn.Module) -> list["Siblings"]:
    """Give every module's candidate children (see the module's docstring) a ``Siblings`` that watches them;
    returns them.  Children already in one are left as they are.  Idempotent."""
    out = []
    for parent in model.modules():
        if getattr(parent, "kp_no_siblings", False):  # children that never read one input (nn/experts.py)
            continue
        by_key: dict[tuple, list[tuple[str, nn.Module]]] = {}
        for name, child in parent.named_children():
            spec = SPECS.get(type(child))
            key = spec.key(child) if spec is not None and "_siblings" not in child.__dict__ else None
            if key is not None:
                by_key.setdefault((type(child), *key), []).append((name, child))
        for members in by_key.values():
            if len(members) > 1:
                out.append(Siblings([m for _, m in members], [n for n, _ in members]))
    from .activated import route_activated_mlps
    from .gated_siblings import route_gated_mlps
    from .moe_routes import route_every_token_moes

    route_gated_mlps(model)
    route_activated_mlps(model)  # after: a gated MLP's three layers are not an activated MLP's one or two
    route_every_token_moes(model)
    return out


def _route(mod: nn.Module, call) -> None:
    """Eager calls of ``mod`` go to ``call``: kept in the instance's __dict__ as ``_siblings``, not as a submodule (no
    state_dict entries, no second visit by modules()), and read by the kind's own ``forward`` (``member_forward``)."""
    mod.__dict__["_siblings"] = call


def member_forward(mod: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A ``SPECS`` kind's ``forward``: its group's call where it has one and the call is eager, else its own GEMM.

    Not an instance ``forward``, which Module.__call__ would find before the class's: dynamo guards everything a
    traced call reads, and a route read that way (a partial of a group's method, the group, its members) added ~15
    guards a layer, among them identity checks evaluated in Python.  Under reduce-overhead on an H200 that host work
    made a decode step of a 4-layer Qwen2.5-7B-sized model 13-23% slower at batch 1 and 32 than the same model with
    no groups, on the same kernels (docs/design/0078).  Here a traced call reads nothing of the route."""
    if not _is_compiling():  # first: traced, the instance's dict is not read at all (60 ns a call, eager)
        call = mod.__dict__.get("_siblings")
        if call is not None:
            return call(x)
    return mod.forward_alone(x)


def siblings_of(mod: nn.Module) -> "Siblings | None":
    """The ``Siblings`` a module is a candidate of, or None."""
    call = mod.__dict__.get("_siblings")
    if call is None:
        return None
    owner = call.func.__self__
    return owner if isinstance(owner, Siblings) else owner.owner


class Siblings:
    """A module's candidate children (``fuse_siblings``): watched on the first pass, then run by group."""

    def __init__(self, members: list[nn.Module], names: list[str]):
        self.members, self.names = members, names
        self.groups: list[_Group] | None = None  # None while watching
        self.stats = {"alone": 0, "fused": 0, "taken": 0}
        self._leader: dict[int, int] = {}  # watching: member -> the first member that read its input, this pass
        self._last: tuple | None = None  # watching: (weakref to the last input, its version, its reader)
        for i, mod in enumerate(members):
            _route(mod, functools.partial(self._watch, i))

    def __repr__(self) -> str:
        groups = "watching" if self.groups is None else [[self.names[i] for i in g.index] for g in self.groups]
        return f"Siblings({self.names}, groups={groups}, stats={self.stats})"

    def __getstate__(self) -> dict:
        # What a pass left behind is not state (weak references neither pickle nor copy): watching starts over.
        return {**self.__dict__, "_leader": {}, "_last": None}

    def _watch(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.stats["alone"] += 1
        y = self.members[i].forward_alone(x)
        if type(x) is not torch.Tensor:  # a tensor subclass (FakeTensor, DTensor) is no input to watch
            return y
        if i in self._leader:  # a member's second call: the pass is over
            self._settle()
            if self.groups is not None:
                return y
            # Still watching (the pass showed no two layers reading one tensor): this call opens the next pass.
        last, version = self._last, _version(x)
        same = last is not None and last[0]() is x and last[1] == version
        self._leader[i] = self._leader[last[2]] if same else i
        self._last = (weakref.ref(x), version, i)
        if len(self._leader) == len(self.members):
            self._settle()
        return y

    def _settle(self) -> None:
        classes: dict[int, list[int]] = {}
        for i, lead in self._leader.items():  # in call order
            classes.setdefault(lead, []).append(i)
        self._leader, self._last = {}, None
        if all(len(index) == 1 for index in classes.values()):
            # A pass where no two read one tensor (each layer called on its own, as a warm-up does) says nothing
            # of the model's passes: watch the next.
            return
        self.groups = [_Group(self, index) for index in classes.values() if len(index) > 1]
        grouped = {i: (g, pos) for g in self.groups for pos, i in enumerate(g.index)}
        for i, mod in enumerate(self.members):
            g, pos = grouped.get(i, (None, None))
            _route(mod, functools.partial(g.forward, pos) if g else functools.partial(self._alone, i))

    def _alone(self, i: int, x: torch.Tensor) -> torch.Tensor:
        self.stats["alone"] += 1
        return self.members[i].forward_alone(x)


def _version(t: torch.Tensor | None):
    return None if t is None or t.is_inference() else t._version


def _read(slot):
    holder, name = slot
    return holder[name] if type(holder) is dict else getattr(holder, name)


class _Group:
    """Members that read one input, in the order they were called; their rows laid end to end in that order."""

    def __init__(self, owner: Siblings, index: list[int]):
        self.owner, self.index = owner, index
        self.members = [owner.members[i] for i in index]
        self.parts = (*SPECS[type(self.members[0])].parts, "bias")
        # Where each member tensor is read from: the module's own dictionaries (Module.__getattr__ was 3 of every
        # 4 us of a group's host work, cProfile on the CPU), or the module for a bias of None (a plain attribute).
        self.slots = [[(mod._parameters, n) if n in mod._parameters else (mod._buffers, n) if n in mod._buffers
                       else (mod, n) for n in self.parts] for mod in self.members]
        self.flat = [slot for member in self.slots for slot in member]
        self.rows = [m.out_features for m in self.members]
        self.offsets = [sum(self.rows[:p]) for p in range(len(self.rows))]
        self.broken = False
        self.warmed = False  # the group's GEMM has run outside a capture since its buffers were laid out
        self.gated_warmed: set = set()  # the gated epilogues (gated_siblings.py) that have, likewise
        self.fused: list | None = None  # per part and the bias: its buffer, or None (no bias)
        self.addresses: list | None = None  # each member tensor's data pointer in the buffers, as laid out
        self.pending: tuple | None = None  # (weakref to x, x's version, y, members served (bits), their versions)
        self._all = (1 << len(index)) - 1

    def __getstate__(self) -> dict:
        return {**self.__dict__, "pending": None}

    @property
    def spec(self) -> Spec:
        return SPECS[type(self.members[0])]

    def _versions(self, slots) -> list:
        # Called only where every tensor is a view of the buffers: never an inference tensor, whose version raises.
        return [t._version for t in map(_read, slots) if t is not None]

    def forward(self, pos: int, x: torch.Tensor) -> torch.Tensor:
        stats = self.owner.stats
        pending = self.pending
        if pending is not None:
            px, version, y, served, versions = pending
            # Right while x is the same tensor, unchanged, and this member's weight is unchanged since.
            if px() is x and version == _version(x) and not served >> pos & 1 and \
                    versions[pos] == self._versions(self.slots[pos]):
                served |= 1 << pos
                self.pending = None if served == self._all else (px, version, y, served, versions)
                stats["taken"] += 1
                return y.narrow(-1, self.offsets[pos], self.rows[pos])
            self.pending = None
            if served != self._all:  # a member did not take its columns: they no longer read one input
                self.broken = True
        mod = self.members[pos]
        # An x the layer refuses runs alone, so that the error names the layer's own weight, not the group's.
        if self.broken or x.dim() == 0 or x.shape[-1] != mod.in_features or x.numel() > GROUP_MAX_ROWS * x.shape[-1] \
                or not plain_eager(x, *map(_read, self.slots[pos])):
            stats["alone"] += 1
            return mod.forward_alone(x)
        capturing = x.is_cuda and stream_capturing()
        if self._off_buffers():
            if capturing:
                stats["alone"] += 1
                return mod.forward_alone(x)
            self._lay_out()
        # In a capture only once the group's GEMM has run eagerly: its first call builds what a capture may not
        # (the kernel for its shape; sparse24.gemm's _ready_for_graphs).
        if capturing and not self.warmed:
            stats["alone"] += 1
            return mod.forward_alone(x)
        y = self.spec.call(self.members[0], x, *self.fused)
        self.warmed = self.warmed or not capturing
        stats["fused"] += 1
        self.pending = (weakref.ref(x), _version(x), y, 1 << pos, [self._versions(slots) for slots in self.slots])
        return y.narrow(-1, self.offsets[pos], self.rows[pos])

    def gated(self, x: torch.Tensor, epilogue: str, capturing: bool | None = None) -> torch.Tensor | None:
        """The two members' GEMM on x under a gated epilogue (``activations.GATED_EPILOGUES``: the first member's rows
        the first half), for ``gated_siblings.py``; None where it cannot run now, for the same reasons a member's
        call would run alone (and any number of rows of x: its output is contiguous, not a view)."""
        if self.broken or x.dim() == 0 or x.shape[-1] != self.members[0].in_features or \
                not plain_eager(x, *map(_read, self.flat)):
            return None
        if capturing is None:  # a caller that asked already passes it (nn/routes.py): a CUDA call each time
            capturing = x.is_cuda and stream_capturing()
        if self._off_buffers():
            if capturing:
                return None
            self._lay_out()
        if capturing and epilogue not in self.gated_warmed:
            return None
        y = self.spec.gated(self.members[0], x, *self.fused, epilogue)
        if not capturing:
            self.gated_warmed.add(epilogue)
        self.owner.stats["gated"] = self.owner.stats.get("gated", 0) + 1
        return y

    def _addresses(self) -> list:
        return [None if t is None else t.data_ptr() for t in map(_read, self.flat)]

    def _off_buffers(self) -> bool:
        """Whether a member's tensors are not where ``_lay_out`` put them (or were never laid out)."""
        return self._addresses() != self.addresses

    def warm(self, x: torch.Tensor) -> None:
        """The group's GEMM once on ``x``, its buffers laid out first if they must be (``kp.warmup``)."""
        if self.broken or x.is_cuda and stream_capturing():
            return
        if self._off_buffers():
            self._lay_out()
        self.spec.call(self.members[0], x, *self.fused)
        self.warmed = True

    def _lay_out(self) -> None:
        """One buffer per part (and the bias), the members' rows end to end; each member's tensors become views
        (the same Parameter objects: an optimizer keeps its reference)."""
        fused = []
        with torch.no_grad(), torch.inference_mode(False):
            for j, name in enumerate(self.parts):
                own = [_read(slots[j]) for slots in self.slots]
                if own[0] is None:
                    fused.append(None)
                    continue
                buffer = torch.cat([t.detach() for t in own])
                row = 0
                for mod, t in zip(self.members, own):
                    view = buffer.narrow(0, row, t.shape[0])
                    row += t.shape[0]
                    self.spec.forget(t)  # what earlier calls kept holds the old storage
                    if name in mod._parameters:
                        mod._parameters[name].data = view
                    else:
                        mod._buffers[name] = view
                fused.append(buffer)
        self.fused, self.pending, self.warmed, self.gated_warmed = fused, None, False, set()
        self.addresses = self._addresses()
