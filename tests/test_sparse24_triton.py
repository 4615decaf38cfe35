"""The Triton 2:4 linear against the fp64 oracle, and dispatch by measurement.

On CPU the kernel runs under the Triton interpreter (f32, f16); on a GPU the
same tests run compiled, and ``test_gpu.py`` adds bf16, the dense backend,
graph capture and the persisted tuning.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import kernelplan as kp
from helpers import FWD_ATOL, assert_close, poisoned
from kernelplan.kernels import interpreting
from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan
from kernelplan.sparse24.gemm import n_bucket

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(
    DEV == "cpu" and not interpreting(), reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
_ACT = {None: lambda z: z, "relu": F.relu, "gelu": F.gelu, "gelu_tanh": lambda z: F.gelu(z, approximate="tanh"),
        "silu": F.silu, "quick_gelu": lambda z: z * torch.sigmoid(1.702 * z)}


def run_backend(backend, x, w, bias=None, activation=None):
    """Run one backend's plan on dense ``w`` (already 2:4), into a poisoned y; return (y, oracle, baseline)."""
    w24 = kp.sparse24.compress(w)
    n, m = x.shape[0], w.shape[0]
    desc = GemmSparse24Descriptor(n, m, w.shape[1], kp.dtypes.dtype_info(x.dtype).name, activation,
                                  bias is not None, str(x.device))
    plan = GemmSparse24Plan.select(desc, kp.PlanPreference.only(backend))
    y = poisoned((n, m), x.dtype, x.device)
    plan.run(GemmSparse24Args(x, w24.values, w24.metadata, y, bias))
    b64 = None if bias is None else bias.double()
    oracle = _ACT[activation](F.linear(x.double(), w.double(), b64))
    baseline = _ACT[activation](F.linear(x, w, bias))
    return y, oracle, baseline


CASES = [  # (n, m, k, activation, bias, x layout)
    (1, 64, 128, None, False, "contiguous"),
    (9, 48, 128, "quick_gelu", True, "contiguous"),
    (3, 70, 192, "relu", True, "contiguous"),  # odd M: masked rows
    (17, 64, 256, "gelu", True, "transposed"),  # non-contiguous x
    (5, 32, 2048, "silu", True, "contiguous"),  # K split in two: the partial-sum path
    (70, 130, 2048, "relu", True, "transposed"),  # split, over 3 M tiles and 2 N tiles: one counter each
    (65, 16, 64, "gelu_tanh", False, "strided"),  # two N tiles
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("n, m, k, activation, bias, layout", CASES, ids=[f"n{c[0]}-m{c[1]}-k{c[2]}-{c[3]}-{c[5]}" for c in CASES])
def test_triton_matches_fp64(n, m, k, activation, bias, layout, dtype, seed):
    check_backend("triton", n, m, k, activation, bias, layout, dtype)


def check_backend(backend, n, m, k, activation, bias, layout, dtype):
    """``backend`` on a fresh 2:4 weight and x of the given layout, against the fp64 oracle."""
    w = kp.sparse24.prune(torch.randn(m, k, device=DEV)).to(dtype)
    x = torch.randn(n, k, device=DEV).to(dtype)
    if layout == "transposed":
        x = x.t().contiguous().t()
    elif layout == "strided":
        x = torch.randn(n, 2 * k, device=DEV).to(dtype)[:, ::2]
    b = torch.randn(m, device=DEV).to(dtype) if bias else None
    y, oracle, baseline = run_backend(backend, x, w, b, activation)
    assert_close(y, oracle, baseline, atol=FWD_ATOL[dtype])


WIDE_CASES = [  # n > 16, K % 128 == 0: the cases triton_m128 takes
    (17, 64, 256, "gelu", True, "transposed"),  # one 128-row tile, rows past M masked
    (70, 130, 2048, "relu", True, "transposed"),  # 2 M tiles x 2 N tiles, K split: one counter each
    (33, 256, 1024, None, False, "strided"),  # 32-wide N tiles, two of them
    # A 64-wide N tile whose M tiles fill the SMs (132 on a GPU, 4 under the interpreter): no split, 8 warps.
    (40, 16896 if DEV == "cuda" else 512, 256, "silu", True, "contiguous"),
]


@pytest.mark.parametrize("n, m, k, activation, bias, layout", WIDE_CASES,
                         ids=[f"n{c[0]}-m{c[1]}-k{c[2]}-{c[3]}-{c[5]}" for c in WIDE_CASES])
def test_triton_wide_tiles_match_fp64(n, m, k, activation, bias, layout, seed):
    """triton_m128: the same kernel on 128-row tiles (f16: the variant refuses f32)."""
    check_backend("triton_m128", n, m, k, activation, bias, layout, torch.float16)


def test_triton_wide_tiles_say_where_they_do_not_apply():
    for desc, reason in ((GemmSparse24Descriptor(16, 256, 1024, "f16", device=DEV), r"n = 16 runs 16-wide N tiles"),
                         (GemmSparse24Descriptor(32, 256, 192, "f16", device=DEV), r"K = 192 is not a multiple of 128"),
                         (GemmSparse24Descriptor(32, 256, 1024, "f32", device=DEV), r"dtype f32: 128-row tiles")):
        with pytest.raises(kp.Unsupported, match="triton_m128: " + reason):
            GemmSparse24Plan.select(desc, kp.PlanPreference.only("triton_m128"))


def test_triton_wide_config_splits_k_to_2048_columns_per_program():
    from kernelplan.kernels.sparse24 import Config, config_for

    # 64 tiles of 128 rows at 8192: ~2 programs per SM on 132 SMs.
    assert config_for(64, 8192, 8192, sm_count=132, wide=True) == Config(64, 128, 128, 4, num_stages=3)
    # 224 tiles already fill the SMs, and K is still split to 2048 columns per program.
    assert config_for(32, 28672, 8192, sm_count=132, wide=True).splits == 4
    assert config_for(32, 28672, 8192, sm_count=132, wide=True).num_stages == 4
    # 64 wide, tiles that fill the SMs alone: one program per tile, 8 warps.
    assert config_for(64, 28672, 8192, sm_count=132, wide=True) == Config(64, 128, 128, 1, num_warps=8, num_stages=3)
    assert config_for(40, 16896, 256, sm_count=132, wide=True).splits == 1
    with pytest.raises(ValueError, match="16-wide"):
        config_for(16, 8192, 8192, sm_count=132, wide=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu"])
def test_bias_act_pass_in_place(activation, dtype, seed):
    """The epilogue pass cuSPARSELt's results go through: y = act(y + bias), every element, in place."""
    from kernelplan.kernels.sparse24 import bias_act_

    y = (3 * torch.randn(7, 300, device=DEV)).to(dtype)
    bias = torch.randn(300, device=DEV).to(dtype)
    for b in (bias, None):
        out = y.clone()
        bias_act_(out, b, activation)
        z = y.double() + (0 if b is None else b.double())
        baseline = _ACT[activation](y + (0 if b is None else b))
        assert_close(out, _ACT[activation](z), baseline, atol=FWD_ATOL[dtype], what=f"bias={b is not None}")


def test_split_k_path_is_taken_where_expected():
    from kernelplan.kernels.sparse24 import config_for

    cfg = config_for(5, 32, 2048, sm_count=4)  # one M tile: 256-wide K tiles, about 2 programs per SM
    assert (cfg.block_k, cfg.splits) == (256, 2)  # 8 K steps of 256: 2 splits of 4 steps each
    cfg = config_for(70, 130, 2048, sm_count=16, itemsize=4)
    assert cfg.splits > 1 and 130 > 2 * cfg.block_m and 70 > cfg.block_n  # the multi-tile split case above
    cfg = config_for(1, 8192, 8192, sm_count=132)  # 128 M tiles: 2 splits of 256-wide K steps, one wave
    assert (cfg.block_k, cfg.splits, cfg.num_stages) == (256, 2, 4)  # 16 steps a program: a fourth stage
    cfg = config_for(1, 28672, 8192, sm_count=132)  # 448 M tiles fill the SMs twice: 128-wide K tiles,
    assert (cfg.block_k, cfg.splits) == (128, 4)  # still split to 2048 columns per program
    assert config_for(64, 65536, 8192, sm_count=132).splits == 1  # 1024 tiles already fill the SMs
    # 64-wide N tiles: about two programs per SM, from 128 M tiles at 8192 rows.
    assert config_for(64, 8192, 8192, sm_count=132).splits == 2


def test_bfe_candidate_at_small_n_takes_256_wide_k_tiles_two_programs_per_sm():
    from kernelplan.kernels.sparse24 import config_for

    cfg = config_for(16, 128256, 4096, sm_count=132, bfe=True)  # 2004 M tiles fill the SMs alone
    assert (cfg.block_k, cfg.splits) == (256, 1)
    assert config_for(16, 128256, 4096, sm_count=132).block_k == 128  # where the shift cut keeps 128


def test_group_codes_rebuild_the_dense_weight(seed):
    """The derived codes, read as documented (each position's table index names its source), give back W exactly."""
    from kernelplan.kernels.sparse24 import SOURCES, code_metadata, group_indices

    w = kp.sparse24.prune(torch.randn(9, 192))
    w[0, :4] = torch.tensor([0.0, 0.0, 0.0, 1.5])  # a group with one non-zero
    w[1, :4] = 0.0  # and one with none
    w24 = kp.sparse24.compress(w)
    words = code_metadata(w24.metadata).to(torch.int64) & 0xFFFFFFFF
    assert words.shape == (192 // 64, 9, 2)
    groups = torch.arange(192 // 4)
    word = words[groups // 16, :, (groups // 8) % 2].T  # [M, groups]: word q = [q // 2, row, q % 2]
    code = (word >> (4 * (groups % 8))) & 0xF
    v0, v1 = w24.values.reshape(9, -1, 2).unbind(-1)
    source = {"v0": v0, "v1": v1, "zero": torch.zeros_like(v0)}
    dense = torch.full((9, 192 // 4, 4), float("nan"))
    for c in code.unique().tolist():
        for j, index in enumerate(group_indices(c)):
            assert 4 <= index < 8  # the table is bytes 4-7 of the lookup
            dense[..., j] = torch.where(code == c, source[SOURCES[index - 4]], dense[..., j])
    assert torch.equal(dense.reshape(9, 192), w)


def _run_ptx(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run a straight-line PTX block of the integer instructions the expansion uses (a model of PTX)."""
    regs = dict(inputs)
    u32 = 0xFFFFFFFF

    def val(op):
        op = op.strip()
        return int(op, 0) & u32 if op[0].isdigit() else regs[op]

    def prmt(a, b, c):
        src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
        out = 0
        for i in range(4):
            nib = (c >> 4 * i) & 0xF
            byte = src[nib & 7]
            if nib & 8:  # sign-replicate mode
                byte = 0xFF if byte & 0x80 else 0
            out |= byte << 8 * i
        return out

    def lop3(a, b, c, lut):
        return sum(((lut >> ((a >> i & 1) << 2 | (b >> i & 1) << 1 | (c >> i & 1))) & 1) << i for i in range(32))

    ops = {
        "mov.b32": lambda a: a,
        "shr.b32": lambda a, b: a >> b,
        "and.b32": lambda a, b: a & b,
        "add.u32": lambda a, b: (a + b) & u32,
        "mul.lo.u32": lambda a, b: (a * b) & u32,
        "bfe.u32": lambda a, pos, length: (a >> pos) & ((1 << length) - 1),
        "lop3.b32": lop3,
        "prmt.b32": prmt,
    }
    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line in "{}" or line.startswith(".reg"):
            continue
        opcode, rest = line.split(None, 1)
        dest, *operands = rest.split(",")
        regs[dest.strip()] = ops[opcode](*(val(o) for o in operands))
    return regs


@pytest.mark.parametrize("variant", ["_EXPAND_SHIFT", "_EXPAND_BFE"])
def test_expansion_ptx_builds_each_groups_dense_pairs(variant):
    """The kernel's inline PTX itself (the interpreter cannot run it), on every code in every slot of a word."""
    from kernelplan.kernels import sparse24

    asm = getattr(sparse24, variant).value
    gen = torch.Generator().manual_seed(0)
    for (p0, p1), code in sparse24.GROUP_CODES.items():
        for slot in range(8):
            noise = torch.randint(0, 8, (8,), generator=gen).tolist()  # the word's other codes
            word = sum(c << 4 * i for i, c in enumerate(noise)) & ~(0xF << 4 * slot) | code << 4 * slot
            v0, v1 = torch.randint(0, 1 << 16, (2,), generator=gen).tolist()
            out = _run_ptx(asm, {"$2": v0 | v1 << 16, "$3": word, "$4": 4 * slot})
            dense = [out["$0"] & 0xFFFF, out["$0"] >> 16, out["$1"] & 0xFFFF, out["$1"] >> 16]
            want = [v0 if j == p0 else v1 if j == p1 else 0 for j in range(4)]
            assert dense == want, (p0, p1, slot)


def test_derived_layouts_follow_in_place_changes(seed):
    from kernelplan.sparse24.format import derived_from

    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(8, 64)))
    builds = []
    build = lambda v, m: builds.append(1) or v.sum().item()  # noqa: E731
    first = derived_from(w24.values, w24.metadata, "probe", build)
    assert derived_from(w24.values, w24.metadata, "probe", build) == first and len(builds) == 1
    with torch.no_grad():
        w24.values.mul_(2)  # an optimizer step, say
    assert derived_from(w24.values, w24.metadata, "probe", build) == pytest.approx(2 * first)
    assert len(builds) == 2


@pytest.mark.parametrize("inference_part", ["values", "metadata", "both"])
def test_derived_layouts_of_inference_tensors_follow_what_can_change(inference_part, seed):
    """An inference tensor has no version counter: its layouts key on its pointer alone, while
    the other part, a normal tensor, still rebuilds them when changed in place."""
    from kernelplan.sparse24.format import derived_from

    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(8, 64)))
    with torch.inference_mode():
        frozen = {"values": w24.values.clone(), "metadata": w24.metadata.clone()}
    values = frozen["values"] if inference_part in ("values", "both") else w24.values
    metadata = frozen["metadata"] if inference_part in ("metadata", "both") else w24.metadata
    builds = []
    build = lambda v, m: builds.append(1) or (v.sum().item(), int(m.sum()))  # noqa: E731
    first = derived_from(values, metadata, "probe", build)
    assert derived_from(values, metadata, "probe", build) == first and len(builds) == 1
    if inference_part != "both":
        normal = values if inference_part == "metadata" else metadata
        with torch.no_grad():
            normal.add_(1)  # in place: its version moves
        assert derived_from(values, metadata, "probe", build) != first and len(builds) == 2


def test_unaligned_k_is_a_reason_not_an_error():
    desc = GemmSparse24Descriptor(4, 16, 72, "f32", device=DEV)
    with pytest.raises(kp.Unsupported, match=r"triton: K = 72 is not a multiple of 64"):
        GemmSparse24Plan.select(desc, kp.PlanPreference.only("triton"))
    assert GemmSparse24Plan.select(desc).sku.backend in ("reference", "dense")


def test_triton_bfe_refuses_f32_with_its_reason():
    """f32 has no PRMT expansion: triton_bfe would be triton's kernel again, timed twice by tuning."""
    desc = GemmSparse24Descriptor(4, 16, 64, "f32", device=DEV)
    with pytest.raises(kp.Unsupported, match=r"triton_bfe: dtype f32: 32-bit weights are expanded by selects"):
        GemmSparse24Plan.select(desc, kp.PlanPreference.only("triton_bfe"))
    f16 = GemmSparse24Descriptor(4, 16, 64, "f16", device=DEV)
    assert GemmSparse24Plan.select(f16, kp.PlanPreference.only("triton_bfe")).sku.backend == "triton_bfe"


def test_dispatch_remembers_per_n_bucket(seed):
    def desc(n):
        return GemmSparse24Descriptor(n, 64, 128, "f32", device=DEV, memory="fast")

    default = GemmSparse24Plan.select(desc(3)).sku.backend
    assert default == ("dense" if DEV == "cuda" else "reference")
    GemmSparse24Plan.remember_fastest(desc(3), {"reference": 1e-6, "triton": 1e-3})  # a fake timing table
    assert [n_bucket(n) for n in (3, 4, 5)] == [4, 4, 8]
    assert GemmSparse24Plan.select(desc(4)).sku.backend == "reference"  # same bucket as n=3
    assert GemmSparse24Plan.select(desc(5)).sku.backend == default  # another bucket: unmeasured
    GemmSparse24Plan.remember_fastest(desc(5), {"reference": 1e-3, "triton": 1e-6})
    assert GemmSparse24Plan.select(desc(8)).sku.backend == "triton"  # measured, it is chosen


def test_functional_path_runs_the_measured_backend_with_autograd(seed):
    w = kp.sparse24.prune(torch.randn(64, 128, device=DEV))
    w24 = kp.sparse24.compress(w)
    x = torch.randn(2, 3, 128, device=DEV, requires_grad=True)
    GemmSparse24Plan.remember_fastest(GemmSparse24Descriptor(6, 64, 128, "f32", "relu", device=DEV, memory="fast"),
                                      {"triton": 1e-6, "reference": 1e-3})
    y = kp.sparse24.linear(x, w24, activation="relu", memory="fast")
    y.sum().backward()
    x64 = x.detach().double().requires_grad_()
    F.relu(F.linear(x64, w.double())).sum().backward()
    assert_close(y, F.relu(F.linear(x64.detach(), w.double())), F.relu(F.linear(x.detach(), w)), atol=FWD_ATOL[torch.float32])
    torch.testing.assert_close(x.grad, x64.grad.float())


def test_inference_fast_path_follows_new_measurements_and_changed_operands(monkeypatch, seed):
    """Repeated inference calls skip checks and dispatch, but never outlive a new measurement or a new weight."""
    from kernelplan.sparse24 import backends  # noqa: F401  (registers the GPU backends)

    ran = []
    reference = type(GemmSparse24Plan.registry.get("reference"))
    monkeypatch.setattr(reference, "run", lambda self, *a, real=reference.run: ran.append("reference") or real(self, *a))
    import kernelplan.kernels.sparse24 as kernel  # the Triton backend's bound call launches through it

    monkeypatch.setattr(kernel.BoundLinear, "launch",
                        lambda *a, real=kernel.BoundLinear.launch: ran.append("triton") or real(*a))
    w = kp.sparse24.prune(torch.randn(64, 128, device=DEV))
    w24 = kp.sparse24.compress(w)
    x = torch.randn(5, 128, device=DEV)
    desc = GemmSparse24Descriptor(5, 64, 128, "f32", device=DEV, memory="fast")
    import kernelplan.sparse24.gemm as gemm

    checks = []
    monkeypatch.setattr(gemm, "check_tensor", lambda *a, real=gemm.check_tensor, **k: checks.append(1) or real(*a, **k))
    with torch.inference_mode():
        GemmSparse24Plan.remember_fastest(desc, {"reference": 1e-6, "triton": 1e-3})
        kp.sparse24.linear(x, w24, memory="fast")
        assert checks, "the first call checks its operands"
        checks.clear()
        kp.sparse24.linear(x, w24, memory="fast")
        assert not checks, "a repeated inference call takes the fast path"
        GemmSparse24Plan.remember_fastest(desc, {"reference": 1e-3, "triton": 1e-6})
        y = kp.sparse24.linear(x, w24, memory="fast")
        assert ran == ["reference", "reference", "triton"]
        assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[torch.float32])
        # The same Parameter converted in place (as nn.Module.to does) must not hit the old entry.
        other = kp.sparse24.compress(kp.sparse24.prune(torch.randn(64, 128, device=DEV)).double())
        with pytest.raises(kp.InvalidProblem, match=r"x has dtype torch.float32 but must have dtype torch.float64"):
            kp.sparse24.linear(x, kp.sparse24.Sparse24Weight(w24.values.data.double(), w24.metadata), memory="fast")
        w24.values.data = other.values  # same tensor object, new dtype
        with pytest.raises(kp.InvalidProblem, match=r"x has dtype torch.float32 but must have dtype torch.float64"):
            kp.sparse24.linear(x, w24, memory="fast")


def test_inference_fast_path_checks_again_what_its_key_leaves_out(seed):
    """The fast path's key is the weight's values, x's shape, the bias, the epilogue, the policy and capture; its
    entry checks the rest (metadata, x's dtype and device, the values' dtype and storage), and a call with any of
    them changed is checked as a first call is: a wrong operand raises, where the entry would have run it."""
    from kernelplan.sparse24.gemm import linear_parts

    w = kp.sparse24.prune(torch.randn(64, 128, device=DEV))
    w24, bias = kp.sparse24.compress(w), torch.randn(64, device=DEV)
    x = torch.randn(5, 128, device=DEV)
    with torch.inference_mode():
        for _ in range(2):  # the entry, then a hit
            y = linear_parts(x, w24.values, w24.metadata, bias)
        assert_close(y, F.linear(x.double(), w.double(), bias.double()), F.linear(x, w, bias),
                     atol=FWD_ATOL[torch.float32])
        with pytest.raises(kp.InvalidProblem, match="metadata"):  # another weight's metadata, half its rows
            linear_parts(x, w24.values, w24.metadata[:32].clone(), bias)
        with pytest.raises(kp.InvalidProblem, match=r"x has dtype torch.float64"):
            linear_parts(x.double(), w24.values, w24.metadata, bias)
        with pytest.raises(kp.InvalidProblem, match=r"x is on meta"):
            linear_parts(x.to("meta"), w24.values, w24.metadata, bias)
        values = w24.values.clone()
        linear_parts(x, values, w24.metadata, bias)
        values.data = values.data.view(torch.int32)  # the same storage and address, another dtype
        with pytest.raises(kp.InvalidProblem, match="int32"):
            linear_parts(x, values, w24.metadata, bias)
        y = linear_parts(x, w24.values, w24.metadata, bias)  # the first entry still stands
    assert_close(y, F.linear(x.double(), w.double(), bias.double()), F.linear(x, w, bias),
                 atol=FWD_ATOL[torch.float32])


def test_weights_made_under_inference_mode_run(seed):
    """Inference tensors have no version counter: the layouts kept with a weight must not need one."""
    with torch.inference_mode():
        w = kp.sparse24.prune(torch.randn(64, 128, device=DEV))
        x = torch.randn(5, 128, device=DEV)
        y, oracle, baseline = run_backend("triton", x, w)
    assert_close(y, oracle, baseline, atol=FWD_ATOL[torch.float32])
