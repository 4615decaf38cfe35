"""LoRA adapters (PEFT) on kernelplan's 2:4 layers: fine-tune a sparsified model with its 2:4 weights frozen.

PEFT wraps only the layer types it knows (``nn.Linear``, ``Conv1D`` ...), so ``get_peft_model`` refuses a
``Sparse24Linear``.  ``kp.nn.lora(config)`` registers the layer in a ``LoraConfig`` (PEFT's ``_register_custom_module``,
an API PEFT marks experimental): the adapter adds ``scaling * B(A(dropout(x)))`` to the layer's own output, so the
frozen weight runs on its 2:4 kernels and PEFT's adapters, dropout, ``disable_adapter``, ``unload`` and adapter
checkpoints work as they do on a dense layer.

Merging is refused.  ``B @ A`` is dense: added to a 2:4 weight it makes the layer dense (the memory and speed 2:4
bought are gone), and cut to the weight's mask it is no longer the function that was trained.  Keep the adapter
unmerged (two GEMMs of rank r beside the 2:4 one), or ``unload()`` it.  PEFT merges layer by layer, so in a model
whose adapters also sit on dense layers, those before the first 2:4 one in module order are merged (exactly: the
model's function is unchanged) when the refusal comes.
"""

from __future__ import annotations

from torch import nn

from ..errors import InvalidProblem
from .sparse24_linear import Sparse24Linear

_CLASS: type | None = None

MERGE_REFUSED = (
    "a LoRA adapter on a 2:4 layer cannot be merged: B @ A is dense, so merged into the 2:4 weight it would make the "
    "layer dense (its memory and speed lost), and cut to the weight's 2:4 mask it would change the function that was "
    "trained. Keep the adapter unmerged (model(...) runs the 2:4 GEMM and the adapter's two rank-r GEMMs), or drop it "
    "with unload()")


def _lora_linear() -> type:
    """PEFT's LoRA ``Linear`` around a ``Sparse24Linear``, made on first use: PEFT is imported only here."""
    global _CLASS
    if _CLASS is None:
        from peft.tuners.lora.layer import Linear

        class Sparse24LoraLinear(Linear):
            """PEFT's LoRA ``Linear`` whose base layer is a ``Sparse24Linear``: its forward is PEFT's (the base layer's
            output plus the adapters'); merging is refused (kernelplan/nn/adapters.py)."""

            def _move_adapter_to_device_of_base_layer(self, adapter_name: str, device=None) -> None:
                # PEFT reads the device and dtype off ``base_layer.weight``, which a 2:4 layer does not have: left
                # alone, the adapters would stay on the CPU in float32 under a GPU model.
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

        # Pickled by name: the module's __getattr__ below makes it on an unpickling process's first use.
        Sparse24LoraLinear.__module__, Sparse24LoraLinear.__qualname__ = __name__, "Sparse24LoraLinear"
        _CLASS = Sparse24LoraLinear
    return _CLASS


def __getattr__(name: str):
    if name == "Sparse24LoraLinear":
        return _lora_linear()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def lora(config):
    """``config`` (a ``peft.LoraConfig``) with ``Sparse24Linear`` registered, so ``get_peft_model`` adapts 2:4 layers.

    ``target_modules`` names them as it names linear layers (``["q_proj", "v_proj"]``); PEFT's ``"all-linear"``
    matches ``nn.Linear`` only.  The registration is not saved in ``adapter_config.json``: to load an adapter, pass
    ``config=kp.nn.lora(LoraConfig.from_pretrained(path))`` to ``PeftModel.from_pretrained``.
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
    config._register_custom_module({Sparse24Linear: _lora_linear()})
    return config
