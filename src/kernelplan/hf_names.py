"""How a checkpoint's keys name a model's modules, for both of kernelplan's loaders (``hf.load_model`` and the
``from_pretrained`` quantizer, ``hf_quantizer.py``).

* **transformers' renames.** transformers 5 saves some models under their original checkpoint's names and renames
  them back as it loads (Mixtral's ``mlp`` is saved as ``block_sparse_moe``): the renamings of its weight conversion
  mapping.  ``checkpoint_renamer`` applies the same ones, so a 2:4 layer written by ``save_pretrained`` is found in
  the model that config.json builds.  transformers 4 has no such mapping.
* **Experts held per expert.** A ``Sparse24Experts``' state_dict (``save_pretrained`` of a sparsified MoE model)
  holds expert ``e``'s layers as ``<experts>.first.<e>`` and ``<experts>.down.<e>``, ``values``, ``metadata`` and
  ``bias``; ``kp.hf.save_model`` stacks them under the experts module's own names (``gate_up_proj.values
  [E, M, K/2]``).  ``per_expert`` maps the first to the second, and ``stack_experts`` gathers an experts module's
  keys, checking that every expert is there.
"""

from __future__ import annotations

import re
from typing import Callable

from torch import nn

from .errors import InvalidProblem

# Sparse24Experts' children (nn/experts.py): expert e's first and down projections are <list>.<e>.
EXPERT_LISTS = ("first", "down")
_PER_EXPERT = re.compile(r"^(?P<module>.+)\.(?P<list>first|down)\.(?P<e>\d+)$")


def checkpoint_renamer(model: nn.Module) -> Callable[[str], str]:
    """A checkpoint key -> the key transformers' loader gives it in ``model`` (its conversion mapping's renamings;
    the key itself where transformers has none).  Converters (which stack or split tensors) are not applied: they
    act on dense ``.weight`` keys, which kernelplan's 2:4 keys never are."""
    try:  # transformers 5 (its source notes that PEFT calls get_model_conversion_mapping: API changes are coordinated)
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightRenaming, rename_source_key
    except ImportError:
        return lambda key: key
    renamings = [t for t in get_model_conversion_mapping(model) if isinstance(t, WeightRenaming)]
    if not renamings:
        return lambda key: key
    return lambda key: rename_source_key(key, renamings, [])[0]


def rename_prefix(rename: Callable[[str], str], prefix: str) -> str:
    """The renamed prefix of a 2:4 layer: renamed as its ``values`` key is, as the loader renames that."""
    return rename(prefix + ".values").removesuffix(".values")


def per_expert(model: nn.Module, prefix: str) -> tuple[str, str, int] | None:
    """``(experts module, projection, e)`` where ``prefix`` is ``<experts>.first.<e>`` or ``<experts>.down.<e>`` and
    the model holds an experts module at ``<experts>`` (its projections are ``parts_of`` it, in that order); else
    None."""
    from .nn.experts import experts_reason, parts_of

    found = _PER_EXPERT.match(prefix)
    if found is None:
        return None
    try:
        module = model.get_submodule(found["module"])
    except AttributeError:
        return None
    if experts_reason(module) is not None:
        return None
    return found["module"], parts_of(module)[EXPERT_LISTS.index(found["list"])], int(found["e"])


def stack_experts(module_name: str, by_expert: dict[int, object], count: int) -> list:
    """``by_expert`` ({e: item}) as a list in expert order, refused unless it holds every expert ``0 .. count - 1``
    of the experts module ``module_name`` (``<experts>.<projection>``)."""
    if sorted(by_expert) != list(range(count)):
        have = sorted(by_expert)
        raise InvalidProblem(f"{module_name}: the checkpoint holds 2:4 layers of experts {have[:8]}"
                             f"{' ...' if len(have) > 8 else ''} ({len(have)}), and the model built from config.json "
                             f"has {count} experts there; a checkpoint holds every expert of a projection, or none")
    return [by_expert[e] for e in range(count)]
