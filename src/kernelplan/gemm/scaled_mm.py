"""The fp8 GEMM backend on ``torch._scaled_mm`` (cuBLASLt's fp8 path, with rowwise scales).

It takes the nn.Linear form of the contract: ``A [m, k]`` row-major fp8 and
``B [n, k]`` with ``transb`` (which ``_scaled_mm`` reads column-major without a
copy), dequantisation scales tensor-wise or row-wise (``a`` per row of A,
``b`` per output feature), epilogue NONE or BIAS, and an f32/f16/bf16 D.
What it does not take (C, fp8 D, ``scales.out``, ``amax``, activations) is
refused with a reason, and dispatch takes the reference backend.

``alpha`` is folded into A's scales.  ``_scaled_mm`` needs k and n to be
multiples of 16: other shapes are zero-padded into fresh buffers (zeros add
nothing to the products; the pad columns of D are dropped), at the price of
copying A and B.  A tensor-wise scale beside a row-wise
one is expanded into a vector: ``_scaled_mm`` takes both or neither as
vectors.  On CPU it runs only when asked for by name (torch has a CPU
``_scaled_mm``, which is what the CPU tests use); the reference stays the
CPU default.
"""

from __future__ import annotations

import functools

import torch

from ..dtypes import dtype_info
from ..errors import Unsupported
from ..plan import Backend, PrecisionGuarantee
from .epilogue import Epilogue
from .plan import FP8_ALIGN as _ALIGN
from .plan import GemmArgs, GemmDescriptor, GemmPlan


@functools.lru_cache(maxsize=16)
def _capability(device: str) -> tuple[int, int]:
    return torch.cuda.get_device_capability(torch.device(device))


class ScaledMMGemmBackend(Backend):
    name = "scaled_mm"
    priority = 10

    def supports(self, desc: GemmDescriptor) -> str | None:
        if not desc.is_fp8:
            return f"dtype {desc.dtype}: this backend is for fp8 inputs"
        if desc.dtype == "e5m2" and (desc.b_dtype or desc.dtype) == "e5m2":
            return "A and B are both e5m2; _scaled_mm needs at least one e4m3 operand: quantise one with e4m3"
        if desc.transa or not desc.transb:
            return "it takes A [m, k] and B [n, k] (transa=False, transb=True: the nn.Linear layout)"
        if desc.epilogue not in (Epilogue.NONE.value, Epilogue.BIAS.value):
            return f"epilogue {desc.epilogue}: only none and bias are fused by _scaled_mm"
        if desc.has_c or desc.scale_out or desc.amax:
            return "C, an output scale and amax are not taken by _scaled_mm"
        if desc.d_dtype not in ("f32", "f16", "bf16"):
            return f"out_dtype {desc.d_dtype}: this backend writes f32, f16 or bf16"
        rowwise = "vector" in (desc.scale_a, desc.scale_b)
        if rowwise and desc.d_dtype != "bf16":
            return f"row-wise scales give a bf16 D in _scaled_mm, not {desc.d_dtype}: pass out_dtype=torch.bfloat16"
        if desc.epilogue == Epilogue.BIAS.value and desc.d_dtype == "f32":
            return "_scaled_mm adds no bias to an f32 D: ask for out_dtype=torch.bfloat16, or add the bias after"
        if desc.device.startswith("cuda"):
            major, minor = _capability(desc.device)
            if (major, minor) < (8, 9):
                return f"sm_{major}{minor} has no fp8 tensor cores (sm_89 or newer)"
        return None

    def priority_for(self, desc) -> int:
        # On CPU torch's _scaled_mm runs, but the reference is the CPU default: by name only there.
        return self.priority if desc.device.startswith("cuda") else -1

    def precision(self, desc: GemmDescriptor) -> PrecisionGuarantee:
        return PrecisionGuarantee(
            desc.dtype, "f32", deterministic=True, bit_stable=False,
            note="torch._scaled_mm with fp32 accumulation (use_fast_accum=False); the bias is added in the "
            "library's epilogue. On Hopper the fp8 tensor cores accumulate with about 14 mantissa bits "
            "(measured 9.8e-5 relative error in an f32 D at k=48 on an H200)",
        )

    def run(self, desc: GemmDescriptor, args: GemmArgs, workspace) -> None:
        k, n = _padded(desc.k), _padded(desc.n)
        a = _into(args.a, desc.m, k)
        b = _into(args.b, n, k)
        bias = args.bias
        sa = _scale(args.scales.a, desc.scale_a, desc.m, a.device)
        sb = _scale(args.scales.b, desc.scale_b, desc.n, a.device)
        if n != desc.n:
            bias = None if bias is None else torch.cat([bias, bias.new_zeros(n - desc.n)])
            sb = sb if sb.dim() == 0 else torch.cat([sb, sb.new_ones(n - desc.n)])
        if args.alpha != 1.0:
            sa = sa * args.alpha
        if sa.dim() != sb.dim():  # one row-wise, one tensor-wise: both as vectors
            sa = sa.reshape(()).expand(desc.m).contiguous() if sa.dim() == 0 else sa
            sb = sb.reshape(()).expand(n).contiguous() if sb.dim() == 0 else sb
        if sa.dim():
            sa, sb = sa.reshape(desc.m, 1), sb.reshape(1, n)
        try:
            out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias,
                                   out_dtype=dtype_info(desc.d_dtype).dtype, use_fast_accum=False)
        except RuntimeError as e:  # a rule of this torch build that supports() does not know
            raise Unsupported(
                f"torch._scaled_mm refused m={desc.m}, n={desc.n}, k={desc.k} ({e}); select the reference "
                f"backend with PlanPreference.only('reference')"
            ) from e
        args.d.copy_(out if n == desc.n else out[:, :desc.n])


def _padded(size: int) -> int:
    return -(-size // _ALIGN) * _ALIGN


def _into(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """``t`` as a contiguous ``[rows, cols]`` tensor, zero-padded on the right and bottom if it is smaller."""
    if tuple(t.shape) == (rows, cols):
        return t if t.is_contiguous() else t.contiguous()
    out = torch.zeros((rows, cols), dtype=t.dtype, device=t.device)
    out[: t.shape[0], : t.shape[1]].copy_(t)
    return out


def _scale(s, mode: str, length: int, device) -> torch.Tensor:
    """A float32 scale on ``device``: 0-d unless ``mode`` is "vector" (then ``[length]``); 1 for "none"."""
    if mode == "none":
        return torch.ones((), dtype=torch.float32, device=device)
    t = (s if isinstance(s, torch.Tensor) else torch.tensor(float(s))).to(device=device, dtype=torch.float32)
    return t.reshape(length) if mode == "vector" else t.reshape(())


GemmPlan.registry.register(ScaledMMGemmBackend())
