"""kernelplan: fast GPU primitives for PyTorch behind one plan-based surface.

Importing kernelplan never touches CUDA; GPU-only dependencies load lazily.
"""

__version__ = "0.1.0"

from . import errors, sparse24  # noqa: E402
from .errors import (  # noqa: E402
    BufferTooSmall,
    InvalidProblem,
    InvalidState,
    KernelPlanError,
    MisalignedOperand,
    Unsupported,
    WorkspaceTooSmall,
)
from .plan import Plan, PlanPreference, PrecisionGuarantee, Sku  # noqa: E402
