"""``Sparse24Linear``: an nn.Linear whose weight is held 2:4-compressed."""

from __future__ import annotations

import torch
from torch import nn

from .._checks import _is_compiling, choice
from ..errors import InvalidProblem
from ..sparse24.dispatch import MEMORY_POLICIES
from ..sparse24 import Sparse24Weight
from ..sparse24.format import prune_compress
from ..sparse24.gemm import forget, gated_epilogue, linear_parts
from ..sparse24.dense_view import dense_view
from ..sparse24.layout import PUBLIC, layout_of, pack_reason, unpack
from .siblings import SPECS, Spec, member_forward


LAYOUTS = ("auto", "public")


class Sparse24Linear(nn.Module):
    """``y = x @ W^T + bias`` with ``W`` stored as 2:4 values + metadata.

    ``values`` is a Parameter (training updates the kept weights; the mask in
    ``metadata`` stays fixed, so the weight stays 2:4); ``metadata`` is a buffer.

    ``layout="auto"`` holds the weight in the one device layout that the 2:4
    kernels read (``sparse24/layout.py``: 0.5625x of the dense bytes at 16-bit
    weights, and no other copy on the default path) wherever M % 16 == 0 (a K
    not a multiple of 64 padded to one with zero columns), else in the public
    format (0.625x); ``layout="public"`` keeps the public format.  Either
    way ``state_dict`` and checkpoints hold the public format (``values [M,
    K/2]``, ``metadata [M, K/8]``, K the layer's own): it is converted to and
    from the device layout when the module is saved and loaded.

    ``memory`` is the dispatch policy of its calls (``kernelplan.sparse24.linear``):
    "compact" (the one device layout, by rule) or "fast" (every backend timed).
    """

    # Whether the layer replaced a Hugging Face Conv1D (GPT-2's), whose checkpoints hold the weight transposed:
    # hf.save_model's dense format refuses to write such a layer (kernelplan/hf.py).
    from_conv1d = False

    def __init__(self, values: torch.Tensor, metadata: torch.Tensor, bias: torch.Tensor | None = None,
                 memory: str = "compact", layout: str = "auto", *, in_features: int | None = None,
                 _validate: bool = True):
        super().__init__()
        self.memory = choice(memory, "memory", MEMORY_POLICIES)
        layout = choice(layout, "layout", LAYOUTS)
        # Validates shapes and metadata bits, in either layout (skipped for parts compress() just built).
        # in_features: the K of parts in the device layout that hold it padded (Sparse24Weight.k).
        w24 = Sparse24Weight(values, metadata, k=in_features, _validate=_validate)
        self.out_features, self.in_features = w24.shape
        self.hold(w24, layout)
        self.bias = nn.Parameter(bias) if bias is not None else None

    def hold(self, w24: Sparse24Weight, layout: str = "auto", requires_grad: bool = True) -> None:
        """Hold ``w24`` (of this layer's shape) as ``values`` and ``metadata``, in the device layout where the shape
        packs (``layout="auto"``) or in the public format."""
        if layout == "public":
            w24 = w24.public()
        elif pack_reason(*w24.shape) is None:
            w24 = w24.packed()
        self.values = nn.Parameter(w24.values, requires_grad=requires_grad)
        self.register_buffer("metadata", w24.metadata)

    @classmethod
    def from_dense(cls, linear_module: nn.Linear, prune: str = "magnitude", layout: str = "auto") -> "Sparse24Linear":
        """Prune ``linear_module.weight`` by magnitude (2 of every 4 kept) and compress it."""
        if not isinstance(linear_module, nn.Linear):
            raise InvalidProblem(
                f"linear_module is a {type(linear_module).__name__}; from_dense takes an nn.Linear"
            )
        if prune != "magnitude":
            raise InvalidProblem(f"prune is {prune!r}; the one pruning method is prune='magnitude'")
        with torch.no_grad():
            # Straight into the layout the module holds: one pass on the GPU, no public-format copy.
            w24 = prune_compress(linear_module.weight.detach(), packed=layout == "auto")
            bias = linear_module.bias.detach().clone() if linear_module.bias is not None else None
        return cls(w24.values, w24.metadata, bias, layout=layout, in_features=w24.shape[1], _validate=False)

    @property
    def layout(self) -> str:
        """The layout the weight is held in: "sp tiled" (the device layout) or "public"."""
        return layout_of(self.values)

    @property
    def weight24(self) -> Sparse24Weight:
        """The weight as held (either layout); ``.public()`` gives the public format."""
        return Sparse24Weight(self.values, self.metadata, k=self.in_features, _validate=False)

    def to_dense(self) -> torch.Tensor:
        return self.weight24.decompress()

    @property
    def weight(self) -> torch.Tensor:
        """The weight as model code reads an nn.Linear's (``sparse24/dense_view.py``): its dense shape, dtype and
        device with no dense copy held; an op on it runs on the weight decompressed (and warns once).  Traced, the
        decompressed weight itself, as ops the compiler drops where nothing reads its values."""
        if _is_compiling():
            return self.to_dense()
        return dense_view(self.values, self.metadata, self.in_features)

    # A layer in a sibling group (nn/siblings.py) has its eager calls routed to the group; ``forward_alone`` is its
    # own GEMM.
    forward = member_forward

    def forward_alone(self, x: torch.Tensor) -> torch.Tensor:
        # Read from the module's own dictionaries: ``self.values`` and ``self.metadata`` go through
        # Module.__getattr__, a Python call each (about 4 us of the module's 28 us a call on an H100's host, where
        # the functional call on the same weight took 24: bench/sparse24_host.py).  A parametrization or a
        # subclass that moves them off those dictionaries is read through the attribute.
        params, buffers = self._parameters, self._buffers
        values = params["values"] if "values" in params else self.values
        bias = params["bias"] if "bias" in params else self.bias
        metadata = buffers["metadata"] if "metadata" in buffers else self.metadata
        return linear_parts(x, values, metadata, bias, None, self.memory, self.in_features)

    def gated(self, x: torch.Tensor, kind: str = "swiglu", gate: str = "first", approximate: str = "none"):
        """``kernelplan.gated_activation(self(x), kind, gate=gate, approximate=approximate)`` as one GEMM: the weight's
        rows are two halves, and the kernels apply the gated activation in their epilogue
        (``kernelplan.sparse24.gated_linear``).  Needs out_features % 32 == 0."""
        return self.with_epilogue(x, gated_epilogue(kind, gate, approximate))

    def with_epilogue(self, x: torch.Tensor, epilogue: str | None) -> torch.Tensor:
        """The layer's GEMM under an epilogue by name (``kernelplan.sparse24.gemm.SPARSE24_EPILOGUES``)."""
        return linear_parts(x, self.values, self.metadata, self.bias, epilogue, self.memory, self.in_features)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.bias is not None and not keep_vars and "_siblings" in self.__dict__:
            # A grouped layer's bias is a view of its group's buffer (nn/siblings.py): safetensors' save_model and
            # save_pretrained refuse tensors that share storage without covering it.
            destination[prefix + "bias"] = self.bias.detach().clone()
        if self.layout != PUBLIC:  # checkpoints hold the public format
            values = self.values if keep_vars else self.values.detach()
            destination[prefix + "values"], destination[prefix + "metadata"] = unpack(values, self.metadata,
                                                                                      self.in_features)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        # load_state_dict hands each module a shallow copy of the caller's dict: replacing entries is private.
        names = prefix + "values", prefix + "metadata"
        if self.layout != PUBLIC and all(name in state_dict for name in names):
            values, metadata = (state_dict[name] for name in names)
            if values.dim() == 2 and tuple(values.shape) == (self.out_features, self.in_features // 2):
                packed = Sparse24Weight(values, metadata).packed()  # a corrupt word is refused before it is laid out
                state_dict[names[0]], state_dict[names[1]] = packed.values, packed.metadata
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"layout={self.layout!r}, memory={self.memory!r}")


def _sibling_key(mod: Sparse24Linear) -> tuple | None:
    if mod.layout == PUBLIC:  # its rows are not whole tiles of the device layout
        return None
    return mod.in_features, mod.values.dtype, mod.values.device, mod.memory, mod.bias is None


def _sibling_call(first: Sparse24Linear, x, values, metadata, bias, epilogue: str | None = None) -> torch.Tensor:
    return linear_parts(x, values, metadata, bias, epilogue, first.memory, first.in_features)


SPECS[Sparse24Linear] = Spec(("values", "metadata"), _sibling_key, _sibling_call, forget, _sibling_call)
