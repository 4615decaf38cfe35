"""OpInfo-style tables (after thunder's): per op, sample inputs and error inputs.

A sample carries the call's args and an fp64 oracle; the same-dtype torch
composite is the baseline the tolerance is measured against.  An error input
carries the call, the exception type and a regex its message must match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import kernelplan as kp
from kernelplan.errors import InvalidProblem, Unsupported


@dataclass
class Sample:
    desc: str
    args: tuple
    kwargs: dict = field(default_factory=dict)


@dataclass
class ErrorInput:
    desc: str
    call: Callable[[], object]
    exc: type
    match: str


@dataclass
class OpInfo:
    name: str
    op: Callable
    reference: Callable  # the same math as a torch composite: run in fp64 it is the oracle
    samples: Callable[[str, torch.dtype], list[Sample]]
    errors: Callable[[str], list[ErrorInput]]
    dtypes: tuple = (torch.float64, torch.float32, torch.float16, torch.bfloat16)
    differentiable: tuple = (0,)  # arg positions with gradients


def _noncontig(t: torch.Tensor) -> torch.Tensor:
    """Same values, transposed storage: a non-contiguous view."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2) if t.dim() >= 2 else t[::1]


def _strided(shape, dtype, device):
    """Every other element of a bigger buffer along the last dim."""
    big = torch.randn(*shape[:-1], shape[-1] * 2, device=device).to(dtype)
    return big[..., ::2]


# -- sparse24.linear ---------------------------------------------------------

_ACT64 = {
    None: lambda z: z,
    "relu": F.relu,
    "gelu": F.gelu,
    "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
    "silu": F.silu,
    "quick_gelu": lambda z: z * torch.sigmoid(1.702 * z),
}


def _sparse24_reference(x, w24, bias=None, activation=None):
    return _ACT64[activation](F.linear(x, w24.decompress().to(x.dtype), bias))


def _sparse24_samples(device, dtype):
    out = []
    cases = [
        ("2-D", (7, 24), 12, None, False),
        ("3-D", (2, 3, 16), 5, "relu", True),
        ("n=1", (1, 64), 8, "gelu", True),
        ("non-contiguous x", (9, 32), 6, "silu", True),
        ("strided x", (4, 40), 3, "gelu_tanh", False),
        ("3-D, CLIP's GELU", (2, 2, 24), 7, "quick_gelu", True),
        ("empty n", (0, 16), 4, None, True),
    ]
    for desc, xshape, m, act, has_bias in cases:
        k = xshape[-1]
        w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(m, k, device=device).to(dtype)))
        if desc == "strided x":
            x = _strided(xshape, dtype, device)
        else:
            x = torch.randn(xshape, device=device).to(dtype)
            x = _noncontig(x) if desc == "non-contiguous x" else x
        bias = torch.randn(m, device=device).to(dtype) if has_bias else None
        out.append(Sample(f"{desc} act={act} bias={has_bias}", (x, w24), {"bias": bias, "activation": act}))
    return out


def _sparse24_errors(device):
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(4, 16, device=device)))
    x = torch.randn(3, 16, device=device)
    return [
        ErrorInput("K mismatch", lambda: kp.sparse24.linear(torch.randn(3, 8), w24), InvalidProblem, r"x has shape \(3, 8\).*K = 16"),
        ErrorInput("dtype mismatch", lambda: kp.sparse24.linear(x.half(), w24), InvalidProblem, r"x has dtype torch.float16.*float32"),
        ErrorInput("bias shape", lambda: kp.sparse24.linear(x, w24, torch.randn(5)), InvalidProblem, r"bias has shape \(5,\).*\(4,\)"),
        ErrorInput("activation", lambda: kp.sparse24.linear(x, w24, activation="tanh"), InvalidProblem, r"activation is 'tanh'.*'relu'"),
        ErrorInput("dense weight", lambda: kp.sparse24.linear(x, torch.randn(4, 16)), InvalidProblem, r"w24 is a Tensor.*compress"),
    ]


# -- gated_activation --------------------------------------------------------

_GATE64 = {"glu": torch.sigmoid, "reglu": F.relu, "swiglu": F.silu, "geglu": F.gelu}


def _gated_reference(x, kind, dim=-1, gate="second", approximate="none"):
    a, b = x.chunk(2, dim=dim)
    act = (lambda z: F.gelu(z, approximate="tanh")) if approximate == "tanh" else _GATE64[kind]
    return act(a) * b if gate == "first" else a * act(b)


def _gated_samples(device, dtype):
    out = []
    shapes = [
        ("2-D last dim", (8, 16), -1),
        ("3-D middle dim", (3, 6, 5), 1),
        ("4-D first dim", (4, 3, 2, 5), 0),
        ("odd sizes", (7, 2, 9), 1),
        ("rank 8", (1, 2, 1, 2, 3, 1, 2, 4), 7),
        ("1-D", (10,), 0),
        ("empty", (0, 6), -1),
    ]
    for i, (desc, shape, dim) in enumerate(shapes):
        kind = ("glu", "reglu", "swiglu", "geglu")[i % 4]
        x = torch.randn(shape, device=device).to(dtype)
        for gate in ("second", "first"):
            out.append(Sample(f"{desc} {kind} gate={gate}", (x, kind), {"dim": dim, "gate": gate}))
    x = torch.randn(6, 8, device=device).to(dtype)
    out.append(Sample("transposed input", (x.t(), "swiglu"), {"dim": 0, "gate": "first"}))
    out.append(Sample("strided input", (_strided((5, 12), dtype, device), "geglu"), {"dim": -1, "approximate": "tanh"}))
    out.append(Sample("geglu tanh gate=first", (torch.randn(4, 10, device=device).to(dtype), "geglu"),
                      {"dim": 1, "gate": "first", "approximate": "tanh"}))
    return out


def _gated_errors(device):
    x = torch.randn(4, 6, device=device)
    ga, gab = kp.gated_activation, kp.gated_activation_backward
    return [
        ErrorInput("odd split", lambda: ga(torch.randn(4, 5), "swiglu"), InvalidProblem, r"size 5 along split_dim 1.*odd"),
        ErrorInput("rank > 8", lambda: ga(torch.randn([1] * 9 + [2]), "glu"), Unsupported, r"rank 10.*rank <= 8"),
        ErrorInput("rank 0", lambda: ga(torch.tensor(1.0), "glu", dim=0), InvalidProblem, r"x is 0-d"),
        ErrorInput("dim out of range", lambda: ga(x, "glu", dim=2), InvalidProblem, r"dim is 2.*rank 2"),
        ErrorInput("bad kind", lambda: ga(x, "swish"), InvalidProblem, r"kind is 'swish'"),
        ErrorInput("bad gate", lambda: ga(x, "glu", gate="left"), InvalidProblem, r"gate is 'left'"),
        ErrorInput("tanh on swiglu", lambda: ga(x, "swiglu", approximate="tanh"), InvalidProblem, r"only geglu"),
        ErrorInput("int dtype", lambda: ga(torch.ones(4, 6, dtype=torch.int32), "glu"), InvalidProblem, r"x has dtype torch.int32"),
        ErrorInput("dy shape", lambda: gab(torch.randn(4, 6), x, "glu"), InvalidProblem, r"dy has shape \(4, 6\).*\(4, 3\)"),
        ErrorInput("dy dtype", lambda: gab(torch.randn(4, 3).double(), x, "glu"), InvalidProblem, r"dy has dtype torch.float64"),
    ]


# -- linear (GEMM with epilogue) ---------------------------------------------


def _linear_reference(x, w, bias=None, epilogue=None, **kw):
    z = F.linear(x, w) * kw.get("alpha", 1.0)
    if kw.get("c") is not None:
        z = z + kw.get("beta", 0.0) * kw["c"]
    if bias is not None:
        z = z + bias
    ep = kp.Epilogue.parse(epilogue or ("bias" if bias is not None else "none"))
    act = ep.spec.activation
    return {"identity": z, "relu": F.relu(z), "gelu_tanh": F.gelu(z, approximate="tanh")}[act]


def _linear_samples(device, dtype):
    out = []
    eps = ["none", "bias", "relu", "relu_bias", "gelu", "gelu_bias"]
    shapes = [("2-D", (6, 16), 10), ("3-D", (2, 3, 24), 7), ("non-contiguous", (5, 8), 9), ("odd", (3, 13), 11)]
    for i, ep in enumerate(eps):
        desc, xshape, n = shapes[i % len(shapes)]
        x = torch.randn(xshape, device=device).to(dtype)
        x = _noncontig(x) if desc == "non-contiguous" else x
        w = torch.randn(n, xshape[-1], device=device).to(dtype)
        bias = torch.randn(n, device=device).to(dtype) if "bias" in ep else None
        out.append(Sample(f"{desc} {ep}", (x, w, bias, ep)))
    x = torch.randn(4, 12, device=device).to(dtype)
    w = torch.randn(6, 12, device=device).to(dtype)
    c = torch.randn(4, 6, device=device).to(dtype)
    out.append(Sample("alpha, beta, C", (x, w, None, "none"), {"alpha": 0.5, "beta": -2.0, "c": c}))
    return out


def _linear_errors(device):
    x, w = torch.randn(4, 8, device=device), torch.randn(6, 8, device=device)
    buf = torch.randn(4, 8, device=device)
    return [
        ErrorInput("shape mismatch", lambda: kp.linear(x, torch.randn(6, 7)), InvalidProblem, r"x has shape \(4, 8\) and w \(6, 7\)"),
        ErrorInput("bad epilogue", lambda: kp.linear(x, w, epilogue="swish"), InvalidProblem, r"epilogue is 'swish'"),
        ErrorInput("bias without bias epilogue", lambda: kp.linear(x, w, torch.randn(6), "gelu"), InvalidProblem, r"bias was given"),
        ErrorInput("bias missing", lambda: kp.linear(x, w, None, "gelu_bias"), InvalidProblem, r"bias is None"),
        ErrorInput("aux missing for dgelu", lambda: kp.linear(x, w, None, "dgelu"), InvalidProblem, r"aux is None"),
        ErrorInput("aux dtype", lambda: kp.linear(x, w, None, "drelu", aux=torch.ones(4, 6)), InvalidProblem, r"aux has dtype torch.float32.*torch.bool"),
        ErrorInput("D aliases A", lambda: kp.linear(buf, w, out=buf[:, :6]), InvalidProblem, r"D shares memory with A"),
        ErrorInput("C shape", lambda: kp.linear(x, w, c=torch.randn(4, 5), beta=1.0), InvalidProblem, r"c has shape \(4, 5\)"),
        ErrorInput("mixed dtypes", lambda: kp.linear(x, w.double()), InvalidProblem, r"A is f32, B is f64"),
        ErrorInput("scales on bf16", lambda: kp.linear(x, w, scales=kp.ScaleSet(a=2.0)), InvalidProblem, r"scales were given for a f32 GEMM"),
        ErrorInput("wrong ScaleSet shape", lambda: kp.linear(x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn), out_dtype=torch.float32,
                   scales=kp.ScaleSet(a=torch.ones(3))), InvalidProblem, r"scales.a has shape \(3,\).*length 4"),
        ErrorInput("fp8 with f32", lambda: kp.linear(x.to(torch.float8_e4m3fn), w), InvalidProblem, r"A is e4m3 but B is f32"),
    ]


OPS = [
    OpInfo("sparse24.linear", kp.sparse24.linear, _sparse24_reference, _sparse24_samples, _sparse24_errors,
           dtypes=(torch.float64, torch.float32, torch.float16, torch.bfloat16), differentiable=(0,)),
    OpInfo("gated_activation", kp.gated_activation, _gated_reference, _gated_samples, _gated_errors, differentiable=(0,)),
    OpInfo("linear", kp.linear, _linear_reference, _linear_samples, _linear_errors, differentiable=(0, 1, 2)),
]
