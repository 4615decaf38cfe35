"""LoRA adapters (PEFT) on kernelplan's 2:4 layers: fine-tune a sparsified model with its 2:4 weights frozen.

PEFT wraps only the layer types it knows (``nn.Linear``, ``Conv1D`` ...), so ``get_peft_model`` refuses a
``Sparse24Linear``.  ``kp.nn.lora(config)`` registers the layer in a ``LoraConfig`` (PEFT's ``_register_custom_module``,
an API PEFT marks experimental): the adapter adds ``scaling * B(A(dropout(x)))`` to the layer's own output, so the
frozen weight runs on its 2:4 kernels and PEFT's adapters, dropout, ``disable_adapter``, ``unload`` and adapter
checkpoints work as they do on a dense layer.

Merging plain LoRA is refused.  ``B @ A`` is dense: added to a 2:4 weight it makes the layer dense (the memory and
speed 2:4 bought are gone), and cut to the weight's mask it is no longer the function that was trained.  Keep the
adapter unmerged (two GEMMs of rank r beside the 2:4 one), or ``unload()`` it.  PEFT merges layer by layer, so in a
model whose adapters also sit on dense layers, those before the first 2:4 one in module order are merged (exactly:
the model's function is unchanged) when the refusal comes.

``masked=True`` trains the update cut to the weight's mask, ``(scaling * B @ A) * mask``, as sparsity-preserving
fine-tuning does: the adapted layer stays a 2:4 layer, and merging adds the update to the kept values
(docs/design/0043).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import InvalidProblem
from ..sparse24.format import Sparse24Weight
from ..sparse24.layout import PUBLIC
from .sparse24_linear import Sparse24Linear

_CLASSES: dict[bool, type] = {}

MERGE_REFUSED = (
    "a LoRA adapter on a 2:4 layer cannot be merged: B @ A is dense, so merged into the 2:4 weight it would make the "
    "layer dense (its memory and speed lost), and cut to the weight's 2:4 mask it would change the function that was "
    "trained. Keep the adapter unmerged (model(...) runs the 2:4 GEMM and the adapter's two rank-r GEMMs), drop it "
    "with unload(), or train with kp.nn.lora(config, masked=True), whose update stays on the mask and merges exactly")


def _masked_delta(a: torch.Tensor, b: torch.Tensor, scaling: float, mask: torch.Tensor) -> torch.Tensor:
    """The masked update ``(scaling * B @ A) * mask`` ``[M, K]``, in the adapters' dtype."""
    return (b @ a) * scaling * mask


class _MaskedUpdate(torch.autograd.Function):
    """``x @ ((scaling * B @ A) * mask).T``, whose backward forms the masked update again and nothing else: kept for
    the backward, each layer's ``[M, K]`` update would stay until then (235 MB for a 4096 x 14336 layer in float32),
    and ``torch.utils.checkpoint`` (until 0045) recomputed the product with x as well, a GEMM of the layer's size."""

    @staticmethod
    def forward(ctx, x, a, b, scaling, layer):
        ctx.scaling, ctx.layer = scaling, layer
        ctx.save_for_backward(x, a, b)
        return F.linear(x, _masked_delta(a, b, scaling, layer.weight24.mask()))

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        x, a, b = ctx.saved_tensors
        grad = grad.to(a.dtype)  # the output's dtype under autocast; the adapters' otherwise
        mask = ctx.layer.weight24.mask()  # decoded once from the metadata, for both products
        gx = grad @ _masked_delta(a, b, ctx.scaling, mask) if ctx.needs_input_grad[0] else None
        # d loss / d (B @ A): the gradient of the update, on the mask, scaled
        gd = (grad.reshape(-1, grad.shape[-1]).T @ x.reshape(-1, x.shape[-1]).to(a.dtype)) * mask * ctx.scaling
        return (gx.to(x.dtype) if gx is not None else None), b.T @ gd, gd @ a.T, None, None


def _lora_linear(masked: bool) -> type:
    """PEFT's LoRA ``Linear`` around a ``Sparse24Linear``, made on first use: PEFT is imported only here."""
    if masked in _CLASSES:
        return _CLASSES[masked]
    from peft.tuners.lora.layer import Linear
    from peft.tuners.tuners_utils import check_adapters_to_merge

    class Sparse24LoraLinear(Linear):
        """PEFT's LoRA ``Linear`` whose base layer is a ``Sparse24Linear``: its forward is PEFT's (the base layer's
        output plus the adapters'); merging is refused (kernelplan/nn/adapters.py)."""

        def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
            # PEFT reads the device and dtype off ``base_layer.weight``, which a 2:4 layer did not have (the adapters
            # stayed on the CPU in float32 under a GPU model); placed by the values, as the GPU test checks.
            values = self.get_base_layer().values
            super()._move_adapter_to_device_of_base_layer(adapter_name, device if device is not None
                                                          else values.device)
            for name in self.adapter_layer_names + self.other_param_names:
                layer = getattr(self, name, None)
                if isinstance(layer, nn.ModuleDict) and adapter_name in layer:
                    layer[adapter_name] = layer[adapter_name].to(dtype=values.dtype)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            raise InvalidProblem(f"{MERGE_REFUSED} (layer {self.base_layer!r})")

        def get_delta_weight(self, adapter):
            raise InvalidProblem(f"{MERGE_REFUSED} (layer {self.base_layer!r})")

    class Sparse24MaskedLoraLinear(Sparse24LoraLinear):
        """LoRA whose update is ``(scaling * B @ A) * mask``, the 2:4 weight's own mask: the adapted layer is a 2:4
        layer, and merging adds the update to the kept values exactly (the mask and the layout stay)."""

        def get_delta_weight(self, adapter):
            return _masked_delta(self.lora_A[adapter].weight, self.lora_B[adapter].weight, self.scaling[adapter],
                                 self.get_base_layer().weight24.mask())

        def forward(self, x, *args, **kwargs):
            self._check_forward_args(x, *args, **kwargs)
            if kwargs.pop("adapter_names", None) is not None:
                raise InvalidProblem("adapter_names= (a different adapter per sample) is not supported on a masked 2:4 "
                                     "LoRA layer: set the adapter with model.set_adapter(name)")
            if self.disable_adapters and self.merged:
                self.unmerge()
            result = self.base_layer(x, *args, **kwargs)
            if self.disable_adapters or self.merged:
                return result
            for name in self.active_adapters:
                if name in self.lora_A:
                    xin = self.lora_dropout[name](self._cast_input_dtype(x, self.lora_A[name].weight.dtype))
                    update = _MaskedUpdate.apply(xin, self.lora_A[name].weight, self.lora_B[name].weight,
                                                 self.scaling[name], self.get_base_layer())
                    result = result + update.to(result.dtype)
            return result

        def _add_to_kept(self, adapter: str, sign: int, safe: bool) -> None:
            layer = self.get_base_layer()
            w = layer.weight24.public()
            with torch.no_grad():
                kept = torch.gather(self.get_delta_weight(adapter), 1, w.positions())
                values = (w.values.to(kept.dtype) + sign * kept).to(w.values.dtype)
                if safe and not values.isfinite().all():
                    raise InvalidProblem(f"merging adapter {adapter!r} into {layer!r} gives non-finite weights; "
                                         f"nothing was merged")
                merged = Sparse24Weight(values, w.metadata, _validate=False)
                layer.values.copy_(merged.values if layer.layout == PUBLIC else merged.packed().values)

        def merge(self, safe_merge: bool = False, adapter_names=None) -> None:
            for name in check_adapters_to_merge(self, adapter_names):
                if name in self.lora_A:
                    self._add_to_kept(name, 1, safe_merge)
                    self.merged_adapters.append(name)

        def unmerge(self) -> None:
            while self.merged_adapters:
                name = self.merged_adapters.pop()
                if name in self.lora_A:
                    self._add_to_kept(name, -1, False)

    for cls in (Sparse24LoraLinear, Sparse24MaskedLoraLinear):
        # Pickled by name: the module's __getattr__ below makes them on an unpickling process's first use.
        cls.__module__, cls.__qualname__ = __name__, cls.__name__
    _CLASSES.update({False: Sparse24LoraLinear, True: Sparse24MaskedLoraLinear})
    return _CLASSES[masked]


def __getattr__(name: str):
    if name in ("Sparse24LoraLinear", "Sparse24MaskedLoraLinear"):
        return _lora_linear(name == "Sparse24MaskedLoraLinear")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lora(config, masked: bool = False):
    """``config`` (a ``peft.LoraConfig``) with ``Sparse24Linear`` registered, so ``get_peft_model`` adapts 2:4 layers.

    ``masked=False``: PEFT's LoRA, ``scaling * B @ A`` added whole; merging is refused.  ``masked=True``: the update is
    cut to each weight's 2:4 mask as it trains, so the adapted layers stay 2:4 and ``merge_and_unload()`` folds the
    adapters into the kept values exactly, giving back plain ``Sparse24Linear`` layers.  Its training forward forms
    the masked update densely, ``[M, K]`` in the adapters' dtype, one layer at a time, and the backward forms it
    again rather than keeping it.
    ``target_modules`` names the layers as it names linear layers (``["q_proj", "v_proj"]``); PEFT's ``"all-linear"``
    matches ``nn.Linear`` only.  The registration (and ``masked``) is not saved in ``adapter_config.json``: to load an
    adapter, pass ``config=kp.nn.lora(LoraConfig.from_pretrained(path), masked=...)`` to ``PeftModel.from_pretrained``.
    """
    try:
        from peft import LoraConfig
    except ImportError as e:
        raise InvalidProblem("kernelplan.nn.lora adapts PEFT's LoRA, and PEFT is not installed: "
                             "pip install peft") from e
    if not isinstance(config, LoraConfig):
        raise InvalidProblem(f"config is a {type(config).__name__}; lora() takes a peft.LoraConfig, for example "
                             f"kp.nn.lora(LoraConfig(r=16, target_modules=['q_proj', 'v_proj']))")
    init = config.init_lora_weights
    if not (isinstance(init, bool) or init == "gaussian"):
        raise InvalidProblem(f"config has init_lora_weights={init!r}; that initialization reads or rewrites the dense "
                             f"weight (its SVD, QR or a quantization of it), which a 2:4 layer does not hold: use "
                             f"True (PEFT's default), False or 'gaussian'")
    if getattr(config, "use_dora", False):
        raise InvalidProblem("config has use_dora=True; DoRA normalizes by the norm of W + B @ A, a dense weight, "
                             "which a 2:4 layer does not form: use plain LoRA (use_dora=False)")
    if not isinstance(masked, bool):
        raise InvalidProblem(f"masked is {masked!r}; pass True (the update cut to the 2:4 mask, mergeable) or False")
    if masked and getattr(config, "lora_bias", False):
        raise InvalidProblem("config has lora_bias=True; a masked 2:4 LoRA merges into the kept weights alone: use "
                             "lora_bias=False, or masked=False")
    config._register_custom_module({Sparse24Linear: _lora_linear(masked)})
    return config
