"""The 2:4 dispatch rule (sparse24/dispatch.py): a pure function, checked on CPU over the sweep set."""

from __future__ import annotations

import pytest

from kernelplan.bench.shapes import BATCH_SIZES, sweep_shapes
from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan
from kernelplan.sparse24.dispatch import (MEMORY_POLICIES, N_GRAIN, backend_for, config_for, layout_reason, rule_points,
                                         runs_mma_sp, runs_sm90a)

HOPPER, AMPERE, ADA, TURING = (9, 0), (8, 0), (8, 9), (7, 5)
BLACKWELL, SM_120 = (10, 0), (12, 0)


# The sweep set's wide weights of few rows that mma.sp runs at n <= 8 on Hopper (K >= 2.5 M, 3840 < M <= 4096),
# besides the weights of 9216 rows or more and K over 4096.
WIDE_SP = {(4096, 14336)}
# The sweep set's layers whose cuda_ws tile at n <= 16 splits K over 4 CTAs with 32 rows of x, by the rule's cost
# (docs/design/0061): one 64-row block of W a CTA up to 1920 rows, two past it; and 1024x1024, whose grid by cost is
# under a quarter of the SMs (0064).
SMALL_N_SPLIT = {(768, 3072): 1, (1024, 4096): 1, (3072, 3072): 2, (3072, 8192): 2, (3584, 3584): 2, (3584, 4096): 2,
                 (3584, 14336): 2, (3584, 18944): 2, (1024, 1024): 1}
# ... over 3 CTAs with 24 rows of x: where that grid runs more CTAs than the pick without it (0063), and 768x768, the
# small grid whose 12 steps of K do not split over 4 (0064).
SMALL_N_SPLIT3 = {(4608, 3584): 2, (4608, 4096): 2, (4608, 36864): 2, (768, 768): 1}


def test_tall_weights_take_mma_sp_only_past_4096_columns():
    # The held-out models' tall weights (K 896-2560) ran cuda_ws faster at n <= 8 (docs/design/0060).
    for m, k in ((9728, 896), (22016, 2048), (28672, 4096), (28672, 4160), (73728, 4608)):
        for n in (1, 5, 8, 9):
            want = "cuda_sp" if n <= 8 and k > 4096 else "cuda_ws"
            assert backend_for(HOPPER, n, m, k, "bf16") == want, (m, k, n)
            assert backend_for(AMPERE, n, m, k, "bf16") == "cuda_sp"


def test_the_table_over_the_sweep_set():
    for (m, k) in sweep_shapes():
        for n in BATCH_SIZES + (3, 9, 17, 65, 1000):
            for dtype in ("bf16", "f16"):
                sp = n <= 8 and (m >= 9216 and k > 4096 or (m, k) in WIDE_SP)  # the sweeps' n <= 8 rows
                assert backend_for(HOPPER, n, m, k, dtype) == ("cuda_sp" if sp else "cuda_ws"), (m, k, n)
                tile = config_for("cuda_ws", n, m, k, 132)
                if n <= 16:  # past it the rule's cost may pick the same tile
                    split, split3 = ((tile.bn, tile.cm, tile.kc) == form for form in ((32, 1, 4), (24, 1, 3)))
                    assert (split and tile.wm) == SMALL_N_SPLIT.get((m, k), False), (m, k, n)
                    assert (split3 and tile.wm) == SMALL_N_SPLIT3.get((m, k), False), (m, k, n)
                gated = config_for("cuda_ws", n, m, k, 132, gated=True)
                assert gated.wm % 2 == 0 and (n > 16 or gated.bn == 16), (m, k, n)  # no split tile timed gated
                for gpu in (AMPERE, ADA):
                    assert backend_for(gpu, n, m, k, dtype) == "cuda_sp"  # mma.sp at every n, chunks past 64
            assert backend_for(None, n, m, k, "bf16") == "reference"
            assert backend_for(HOPPER, n, m, k, "f32") == "triton"  # no f32 sparse tensor cores
            assert backend_for(TURING, n, m, k, "f16") == "triton"


def test_sm90a_code_runs_on_hopper_alone_and_mma_sp_from_ampere_on():
    # sm_90a's arch-specific instructions (wgmma.sp, tensor maps, clusters) do not run on later GPUs: there, and on
    # Ampere and Ada, the one layout runs on mma.sp, whatever n.
    assert [runs_sm90a(c) for c in (TURING, AMPERE, ADA, HOPPER, BLACKWELL, SM_120, None)] == [
        False, False, False, True, False, False, False]
    assert [runs_mma_sp(c) for c in (TURING, AMPERE, ADA, HOPPER, BLACKWELL, SM_120)] == [
        False, True, True, True, True, True]
    for gpu in (BLACKWELL, SM_120):
        assert {backend_for(gpu, n, 4096, 4096, "bf16") for n in (1, 64, 4096)} == {"cuda_sp"}


def test_layout_reasons_name_what_is_missing():
    assert "8.0 or newer" in layout_reason(TURING, 128, "f16")
    assert "f16 and bf16" in layout_reason(HOPPER, 128, "f32")
    assert "not a CUDA GPU" in layout_reason(None, 128, "bf16")
    assert layout_reason(HOPPER, 128, "bf16") is None


@pytest.mark.parametrize("k", [72, 96, 4304])
def test_a_k_off_the_layouts_step_runs_the_layouts_kernels_as_its_padded_k(k):
    """K not a multiple of 64 is held padded to one (layout.padded_k): the layout's kernels run it, by the rule of
    the padded K, on every GPU they run on (the Triton kernel, which reads the public format, needs K % 64 == 0)."""
    padded = -(-k // 64) * 64
    assert layout_reason(HOPPER, k, "bf16") is None and layout_reason(AMPERE, k, "f16") is None
    for n in (1, 8, 9, 64, 4096):
        for m in (128, 1152, 9216):
            assert backend_for(HOPPER, n, m, k, "bf16") == backend_for(HOPPER, n, m, padded, "bf16")
            assert backend_for(AMPERE, n, m, k, "bf16") == "cuda_sp"
            for backend in ("cuda_ws", "cuda_sp"):
                assert config_for(backend, n, m, k, 132) == config_for(backend, n, m, padded, 132)


def test_configs_come_from_the_kernels_rules():
    from kernelplan.kernels.sparse24_wg import wg_config

    assert config_for("cuda_wg", 256, 4096, 4096, 132) == wg_config(256, 4096, 4096, 132)
    assert config_for("cuda_sp", 4, 4096, 4096, 132) is not None
    with pytest.raises(ValueError, match="no tile rule"):
        config_for("dense", 4, 64, 64, 132)


def test_the_rule_picks_one_kernel_and_tile_over_each_run_of_n_grain_n():
    """What ``kp.warmup`` relies on to compile every n up to a batch size from ``rule_points``: over n = 8 j + 1 ...
    8 j + 8 the backend and its tile do not change, on Hopper and Ampere, plain and gated, for layers of every
    kind of the sweep set (short K, where the narrow tiles of x join the rule, and long)."""
    shapes = [(768, 768), (2304, 768), (1024, 4096), (4096, 4096), (3584, 18944), (28672, 4096), (57344, 8192)]
    for capability, sms in (((9, 0), 132), ((9, 0), 114), ((8, 0), 108)):
        for m, k in shapes:
            for gated in (False, True):
                def pick(n):
                    backend = backend_for(capability, n, m, k, "bf16")
                    return backend, config_for(backend, n, m, k, sms, gated)

                for n in range(1, 530):
                    end = -(-n // N_GRAIN) * N_GRAIN
                    assert pick(n) == pick(end), (capability, sms, m, k, gated, n)


@pytest.mark.parametrize("n_max", [1, 7, 8, 9, 16, 300, 2048])
def test_rule_points_hold_one_n_of_each_run_up_to_n_max(n_max):
    points = rule_points(n_max)
    assert points == sorted(set(points)) and points[-1] == n_max
    # each n up to n_max has a point in its own run (the run's end, or n_max in the last)
    assert {min(-(-n // N_GRAIN) * N_GRAIN, n_max) for n in range(1, n_max + 1)} == set(points)


def test_compact_is_the_default_and_memory_is_checked():
    assert GemmSparse24Descriptor(1, 64, 128, "bf16").memory == "compact" == MEMORY_POLICIES[0]
    import kernelplan as kp

    with pytest.raises(kp.InvalidProblem, match="memory"):
        GemmSparse24Plan.select(GemmSparse24Descriptor(1, 64, 128, "bf16", memory="small"))


def test_compact_on_cpu_runs_the_reference_without_tuning(monkeypatch):
    import torch

    import kernelplan as kp
    from kernelplan.sparse24 import tuning

    monkeypatch.setattr(tuning, "tune", lambda *a, **k: pytest.fail("compact dispatch must not tune"))
    w = kp.sparse24.prune(torch.randn(64, 128))
    y = kp.sparse24.linear(torch.randn(3, 128), kp.sparse24.compress(w))
    assert y.shape == (3, 64)
    with pytest.raises(kp.InvalidProblem, match="memory"):
        kp.sparse24.linear(torch.randn(3, 128), kp.sparse24.compress(w), memory="small")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_compact_default_path_holds_one_layout_and_matches_fp64(dtype):
    """kp.sparse24.linear at n = 1, 64, 256, 4096 (bias, silu): the rule's kernels, one derived layout of 0.5625x."""
    import torch
    import torch.nn.functional as F

    import kernelplan as kp
    from helpers import FWD_ATOL, assert_close
    from kernelplan.sparse24.gemm import fast_path_backends

    dt = getattr(torch, dtype)
    cap = torch.cuda.get_device_capability()
    w = kp.sparse24.prune(torch.randn(1000, 4096, device="cuda")).to(dt)
    w24 = kp.sparse24.compress(w)
    b = torch.randn(1000, device="cuda").to(dt)
    for n in (1, 64, 256, 4096):
        x = torch.randn(n, 4096, device="cuda").to(dt)
        y = kp.sparse24.linear(x, w24, b, "silu")
        assert_close(y, F.silu(F.linear(x.double(), w.double(), b.double())), F.silu(F.linear(x, w, b)),
                     atol=FWD_ATOL[dt])
    ran = {r["backend"] for r in fast_path_backends() if r["m"] == 1000}
    assert ran <= {"cuda_sp", "cuda_ws"} and ("cuda_ws" in ran) == (cap == (9, 0))
    held = w24.derived_bytes()
    assert list(held) == ["sp tiled"] and held["sp tiled"] == 1008 * 4096 * 2 * 9 // 16  # rows padded to 16


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("layout", ["public", "device"])
def test_repeated_eager_calls_follow_updates_and_x_layouts(layout):
    """Eager calls repeated on one weight take the direct launch (keyed by x's shape): an in-place update of the
    values, a non-contiguous x and an x whose rows are not 16-byte aligned, of the same shape, are each computed as
    they are; the public format's derived layout is rebuilt after the update."""
    import torch
    import torch.nn.functional as F

    import kernelplan as kp
    from helpers import FWD_ATOL, assert_close

    dt = torch.bfloat16
    for n in (1, 64, 256):  # cuda_sp, and cuda_ws's tiles on Hopper
        w = kp.sparse24.prune(torch.randn(256, 512, device="cuda")).to(dt)
        w24 = kp.sparse24.compress(w)
        w24 = w24.packed() if layout == "device" else w24
        x = torch.randn(n, 512, device="cuda").to(dt)
        with torch.no_grad():
            for _ in range(3):
                y = kp.sparse24.linear(x, w24)
            assert_close(y, F.linear(x.double(), w.double()), F.linear(x, w), atol=FWD_ATOL[dt], what=f"n={n}")
            w24.values.mul_(-1)
            y = kp.sparse24.linear(x, w24)
            assert_close(y, F.linear(x.double(), -w.double()), F.linear(x, -w), atol=FWD_ATOL[dt],
                         what=f"n={n} after an in-place update")
            strided = torch.randn(512, n, device="cuda").to(dt).t()
            offset = torch.randn(n * 512 + 1, device="cuda").to(dt)[1:].view(n, 512)
            for name, xi in (("non-contiguous", strided), ("rows off 16 bytes", offset)):
                y = kp.sparse24.linear(xi, w24)
                assert_close(y, F.linear(xi.double(), -w.double()), F.linear(xi, -w), atol=FWD_ATOL[dt],
                             what=f"n={n} {name}")


def test_the_sparse24_modules_import_each_other_without_a_cycle():
    """Issue 26: the 2:4 dispatch is layered, the plan level (``plan.py``) below the backends, the "fast" policy's
    tuning and the functional layer; no module imports one that imports it back, at module level or inside a
    function."""
    import ast
    import pathlib

    import kernelplan.sparse24 as package

    folder = pathlib.Path(package.__file__).parent
    names = {f.stem for f in folder.glob("*.py")} - {"__init__"}
    graph = {}
    for name in names:
        deps = set()
        for node in ast.walk(ast.parse((folder / f"{name}.py").read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                deps |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        graph[name] = deps & names
    assert not graph["plan"] & {"gemm", "backends", "tuning", "cusparselt"}, graph["plan"]

    def reach(start, seen):
        for dep in graph[start]:
            assert dep != start and dep not in seen, f"import cycle: {' -> '.join([*seen, start, dep])}"
            reach(dep, [*seen, start])

    for name in sorted(names):
        reach(name, [])
