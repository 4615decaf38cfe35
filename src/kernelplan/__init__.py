"""kernelplan: fast GPU primitives for PyTorch behind one plan-based surface.

Importing kernelplan never touches CUDA; GPU-only dependencies load lazily.
"""

__version__ = "0.1.0"

from . import dtypes, errors, sparse24  # noqa: E402
from .errors import (  # noqa: E402
    BufferTooSmall,
    InvalidProblem,
    InvalidState,
    KernelPlanError,
    MisalignedOperand,
    Unsupported,
    WorkspaceTooSmall,
)
from .gated import (  # noqa: E402
    GatedActivationArgs,
    GatedActivationBackwardArgs,
    GatedActivationBackwardPlan,
    GatedActivationDescriptor,
    GatedActivationPlan,
    gated_activation,
    gated_activation_backward,
)
from .gemm import Epilogue, GemmArgs, GemmDescriptor, GemmPlan, ScaleSet, linear  # noqa: E402
from .plan import Plan, PlanPreference, PrecisionGuarantee, Sku  # noqa: E402
from . import fp8, hf, nn  # noqa: E402
from .checkpoint import load_compressed, save_compressed  # noqa: E402
from .pruning import evaluate, sparsify  # noqa: E402
from .warm import warmup  # noqa: E402

__all__ = [
    "__version__",
    "dtypes",
    "errors",
    "sparse24",
    "nn",
    "fp8",
    "hf",
    "sparsify",
    "evaluate",
    "warmup",
    "save_compressed",
    "load_compressed",
    "KernelPlanError",
    "InvalidProblem",
    "Unsupported",
    "MisalignedOperand",
    "WorkspaceTooSmall",
    "BufferTooSmall",
    "InvalidState",
    "gated_activation",
    "gated_activation_backward",
    "GatedActivationDescriptor",
    "GatedActivationArgs",
    "GatedActivationBackwardArgs",
    "GatedActivationPlan",
    "GatedActivationBackwardPlan",
    "Epilogue",
    "ScaleSet",
    "linear",
    "GemmArgs",
    "GemmDescriptor",
    "GemmPlan",
    "Plan",
    "PlanPreference",
    "PrecisionGuarantee",
    "Sku",
]
