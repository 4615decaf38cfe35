"""The plan contract: select, reasons, preferences, sku, workspace, poisoning, nothing written on error."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch

import kernelplan as kp
from helpers import poisoned
from kernelplan.errors import InvalidProblem, Unsupported, WorkspaceTooSmall
from kernelplan.gated import GatedActivationArgs, GatedActivationBackwardArgs, GatedActivationBackwardPlan
from kernelplan.plan import Backend, PrecisionGuarantee
from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan


class FakeBackend(Backend):
    """Runs the reference math, but with its own name, priority and workspace."""

    def __init__(self, name, priority=1, refuse=None, deterministic=True, workspace=0):
        self.name, self.priority, self.refuse = name, priority, refuse
        self.deterministic, self.ws = deterministic, workspace
        self.runs = 0

    def supports(self, desc):
        return self.refuse

    def precision(self, desc):
        return PrecisionGuarantee("f32", "f32", self.deterministic, self.deterministic)

    def workspace_size(self, desc):
        return self.ws

    def run(self, desc, args, workspace):
        self.runs += 1
        GemmSparse24Plan.registry._backends["reference"].run(desc, args, workspace)


@pytest.fixture
def fakes():
    added = []

    def add(*backends):
        for b in backends:
            GemmSparse24Plan.registry.register(b)
            added.append(b.name)

    yield add
    for name in added:
        GemmSparse24Plan.registry.unregister(name)


DESC = GemmSparse24Descriptor(n=4, m=8, k=16, dtype="f32", memory="fast")


def _args(desc=DESC):
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(desc.m, desc.k)))
    return GemmSparse24Args(torch.randn(desc.n, desc.k), w24.values, w24.metadata, poisoned((desc.n, desc.m), torch.float32))


def test_reference_is_registered_first_for_every_op():
    for plan in (GemmSparse24Plan, kp.GatedActivationPlan, GatedActivationBackwardPlan, kp.GemmPlan):
        assert plan.registry.names()[0] == "reference"


def test_sku_and_precision_guarantee():
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(4, 8, 16, "bf16", activation="relu"))
    assert plan.sku == kp.Sku(op="sparse24_gemm", dtype="bf16", arch="cpu", backend="reference")
    g = plan.precision_guarantee
    assert (g.math_precision, g.accumulator, g.deterministic) == ("f32", "f32", True)
    assert GemmSparse24Plan.select(GemmSparse24Descriptor(4, 8, 16, "f64")).precision_guarantee.accumulator == "f64"
    gemm = kp.GemmPlan.select(kp.GemmDescriptor(4, 8, 16, "bf16", epilogue="gelu_bias"))
    assert gemm.sku.epilogue == "gelu_bias" and "tanh" in gemm.precision_guarantee.note


def test_run_writes_every_element_and_matches(fakes):
    args = _args()
    GemmSparse24Plan.select(DESC).run(args)
    w = kp.sparse24.Sparse24Weight(args.values, args.metadata).decompress()
    assert not torch.isnan(args.y).any()
    torch.testing.assert_close(args.y, args.x @ w.T)


def test_select_lists_every_backends_reason(fakes):
    fakes(FakeBackend("picky", refuse="n=4 is below the minimum of 16"))
    with pytest.raises(Unsupported) as info:
        GemmSparse24Plan.select(DESC, kp.PlanPreference.only("picky"))
    msg = str(info.value)
    assert "reference: not the requested backend 'picky'" in msg and "picky: n=4 is below the minimum of 16" in msg
    with pytest.raises(Unsupported, match=r"nosuch: no such backend; registered: reference, triton, triton_bfe, triton_m128, cuda_mma, cuda_sp, cuda_wg, cuda_ws, dense, cusparselt, picky"):
        GemmSparse24Plan.select(DESC, kp.PlanPreference.only("nosuch"))


def test_preferences(fakes):
    fakes(FakeBackend("fast", priority=5, deterministic=False), FakeBackend("slow", priority=1))
    assert GemmSparse24Plan.select(DESC).sku.backend == "fast"
    assert GemmSparse24Plan.select(DESC, kp.PlanPreference.deterministic_only()).sku.backend == "slow"
    assert GemmSparse24Plan.select(DESC, kp.PlanPreference.only("reference")).sku.backend == "reference"


def test_fastest_uses_measured_timings_and_they_persist(fakes):
    fakes(FakeBackend("a", priority=5), FakeBackend("b", priority=1))
    assert GemmSparse24Plan.select(DESC).sku.backend == "a"
    # A floor backend is kept unless another beats it by more than the margin.
    assert GemmSparse24Plan.remember_fastest(DESC, {"a": 0.98e-5, "b": 1e-5}, floor="b", margin=0.03) == "b"
    assert GemmSparse24Plan.remember_fastest(DESC, {"a": 0.96e-5, "b": 1e-5}, floor="b", margin=0.03) == "a"
    best = GemmSparse24Plan.remember_fastest(DESC, {"a": 3e-5, "b": 1e-5, "reference": 9e-4})
    assert best == "b" and GemmSparse24Plan.select(DESC).sku.backend == "b"
    # A new process sees the choice through the SQLite file, not the memory layer.
    from kernelplan import cache

    cache._AT_DEFAULT.pop(cache.PlanCache)
    assert GemmSparse24Plan.select(DESC).sku.backend == "b"
    with pytest.raises(InvalidProblem, match="names backends \\['zzz'\\]"):
        GemmSparse24Plan.remember_fastest(DESC, {"zzz": 1.0})


def test_a_plan_whose_backend_was_unregistered_is_in_an_invalid_state():
    backend = FakeBackend("temporary", priority=9)
    GemmSparse24Plan.registry.register(backend)
    plan = GemmSparse24Plan.select(DESC)
    GemmSparse24Plan.registry.unregister("temporary")
    args = _args()
    with pytest.raises(kp.InvalidState, match="backend 'temporary'.*select\\(desc\\) again"):
        plan.run(args)
    assert torch.isnan(args.y).all() and backend.runs == 0
    assert GemmSparse24Plan.select(DESC).sku.backend == "reference"


def test_workspace_too_small_and_stream_on_cpu(fakes):
    fakes(FakeBackend("needs_ws", priority=9, workspace=256))
    plan = GemmSparse24Plan.select(DESC)
    assert plan.workspace_size() == 256
    args = _args()
    with pytest.raises(WorkspaceTooSmall, match=r"holds 100 bytes but 256 are needed.*workspace_size\(\) = 256") as info:
        plan.run(args, workspace=torch.empty(100, dtype=torch.uint8))
    assert (info.value.needed, info.value.got) == (256, 100)
    assert torch.isnan(args.y).all(), "nothing may be written when a check fails"
    plan.run(args, workspace=torch.empty(64, dtype=torch.float32))  # 256 bytes, any dtype
    plan.run(args)  # allocated on demand
    with pytest.raises(InvalidProblem, match="streams exist only on CUDA"):
        plan.run(args, stream=object())


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda a: setattr(a, "x", a.x[:, :8]), r"x has shape \(4, 8\) but must have shape \(4, 16\)"),
        (lambda a: setattr(a, "bias", torch.randn(8)), r"bias is given but the descriptor says has_bias=False"),
        (lambda a: setattr(a, "metadata", a.metadata.int()), r"metadata has dtype torch.int32"),
        (lambda a: setattr(a, "x", a.x.double()), r"x has dtype torch.float64"),
    ],
)
def test_bad_args_raise_and_write_nothing(mutate, match):
    args = _args()
    mutate(args)
    with pytest.raises(InvalidProblem, match=match):
        GemmSparse24Plan.select(DESC).run(args)
    assert torch.isnan(args.y).all()


def test_output_too_small_is_buffer_too_small():
    args = _args()
    args.y = poisoned((2, 8), torch.float32)
    with pytest.raises(kp.BufferTooSmall, match=r"y \(shape \(2, 8\)\) holds 16 elements but 32 are needed"):
        GemmSparse24Plan.select(DESC).run(args)


def test_descriptor_checks():
    with pytest.raises(kp.MisalignedOperand, match="descriptor.k is 12"):
        GemmSparse24Plan.select(GemmSparse24Descriptor(4, 8, 12, "f32"))
    with pytest.raises(InvalidProblem, match="descriptor.n is -1"):
        GemmSparse24Plan.select(GemmSparse24Descriptor(-1, 8, 16, "f32"))
    with pytest.raises(Unsupported, match="reference: dtype e4m3"):
        GemmSparse24Plan.select(GemmSparse24Descriptor(4, 8, 16, "e4m3"))


def test_gated_plans_poison_and_refuse_aliasing():
    desc = kp.GatedActivationDescriptor("swiglu", (4, 8, 3), split_dim=1, dtype="f32", gate="first")
    x = torch.randn(4, 3, 8).transpose(1, 2)  # non-contiguous input of shape (4, 8, 3)
    y, dx, dy = poisoned((4, 4, 3), torch.float32), poisoned((4, 8, 3), torch.float32), torch.randn(4, 4, 3)
    plan, bwd = kp.GatedActivationPlan.select(desc), GatedActivationBackwardPlan.select(desc)
    assert (plan.sku.op, bwd.sku.op) == ("gated_activation", "gated_activation_backward")
    with pytest.raises(InvalidProblem, match="dx shares memory with x"):
        bwd.run(GatedActivationBackwardArgs(dy, x, x))
    with pytest.raises(InvalidProblem, match=r"y has shape \(4, 8, 3\) but must have shape \(4, 4, 3\)"):
        plan.run(GatedActivationArgs(x, dx))
    with pytest.raises(kp.BufferTooSmall, match=r"dx \(shape \(4, 4, 3\)\) holds 48 elements but 96 are needed"):
        bwd.run(GatedActivationBackwardArgs(dy, x, y))
    assert torch.isnan(dx).all() and torch.isnan(y).all(), "a failed check wrote into an output"
    plan.run(GatedActivationArgs(x, y))
    bwd.run(GatedActivationBackwardArgs(dy, x, dx))
    assert not torch.isnan(y).any() and not torch.isnan(dx).any()


def test_importing_kernelplan_never_touches_cuda():
    code = (
        "import torch\n"
        "def boom(*a, **k): raise SystemExit('CUDA queried at import')\n"
        "for name in ('is_available', 'device_count', 'get_device_capability', 'init', 'current_device', 'get_device_properties'):\n"
        "    setattr(torch.cuda, name, boom)\n"
        "import kernelplan, kernelplan.nn, kernelplan.cache, kernelplan.cli, kernelplan.bench\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_tuning_takes_the_median_of_three_rounds_and_leaves_out_refusals():
    """How sparse24 tuning turns timings into a choice, with the timer faked: no GPU needed."""
    from kernelplan.errors import KernelPlanError
    from kernelplan.sparse24.tuning import measure

    # "fast" was slow in its cold first round; "lucky" was fast once, near the host-bound edge.
    rounds = {"dense": [10.0, 10.0, 10.0], "fast": [12.0, 9.0, 9.0], "lucky": [12.0, 8.0, 11.0]}

    def bench(name):
        if name == "broken":
            raise KernelPlanError("the library refused this shape")
        return rounds[name].pop(0)

    with pytest.warns(RuntimeWarning, match="tuning x: backend broken left out: the library refused"):
        timings = measure({n: n for n in ("dense", "broken", "fast", "lucky")}, bench, what="tuning x")
    assert timings == {"dense": 10.0, "fast": 9.0, "lucky": 11.0} and not any(rounds.values())
    # The floor stays unless beaten by more than the margin.
    from kernelplan.sparse24 import backends  # noqa: F401  (registers dense and cusparselt)

    remember = GemmSparse24Plan.remember_fastest
    assert remember(DESC, {"dense": 10.0, "cusparselt": 9.8}, floor="dense", margin=0.03) == "dense"
    assert remember(DESC, {"dense": 10.0, "cusparselt": 9.0}, floor="dense", margin=0.03) == "cusparselt"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
def test_tuning_leaves_out_a_backend_whose_result_is_wrong(dtype, seed):
    """``agreeing``: results a rounding apart stay candidates, a wrong one is dropped with a warning."""
    from kernelplan.sparse24.tuning import _AGREE, agreeing, disagreement

    x, w = torch.randn(48, 512), torch.randn(300, 512)
    exact = x.double() @ w.double().T
    want = exact.to(dtype)
    # Another accumulation order, rounded on its own, with an fp32 pass after: one to two ulps away.
    other_order = (x.to(dtype).float() @ w.to(dtype).float().T).to(dtype)
    wrong_tile = want.clone()
    wrong_tile[:16, :64] = -wrong_tile[:16, :64]  # one tile's signs: the kind of error a layout bug makes

    def refused():
        raise Unsupported("the library refused")

    def oracle():
        return want

    fns = {"dense": oracle, "rounding": lambda: other_order, "tile": lambda: wrong_tile,
           "garbage": lambda: torch.randn_like(want), "refused": refused}
    tol = _AGREE[kp.dtypes.dtype_info(dtype).name]
    with pytest.warns(RuntimeWarning) as caught:
        kept = agreeing(fns, oracle, tol, "tuning x")
    assert list(kept) == ["dense", "rounding", "refused"]  # a refusal is measure's to report
    assert sorted(str(c.message).split(":")[1].strip() for c in caught) == ["backend garbage left out",
                                                                             "backend tile left out"]
    assert 0 < disagreement(other_order, want) <= tol / 2  # rounding sits well inside the tolerance
    # Non-finite outputs agree only where they sit in the same places; an all-zero oracle takes zeros only.
    nan_at_0 = want.clone()
    nan_at_0[0, 0] = float("nan")
    nan_at_1 = want.clone()
    nan_at_1[0, 1] = float("nan")
    wrong_beside_a_nan = nan_at_0.clone()
    wrong_beside_a_nan[1:, 0] = -wrong_beside_a_nan[1:, 0]
    assert disagreement(nan_at_0, nan_at_0) == 0.0 and disagreement(nan_at_1, nan_at_0) == float("inf")
    assert disagreement(wrong_beside_a_nan, nan_at_0) > 0.1
    zeros = torch.zeros(4, 4)
    assert disagreement(zeros, zeros) == 0.0 and disagreement(zeros + 1e-3, zeros) == float("inf")
    assert disagreement(zeros[:2], zeros) == float("inf")


@pytest.mark.parametrize("fast_is_right", [False, True])
def test_tuning_never_picks_a_faster_backend_whose_result_is_wrong(fakes, monkeypatch, fast_is_right):
    """``_tune`` end to end, the timers faked: the fastest candidate wins only if its result agrees with dense's."""
    import triton.testing

    import kernelplan.timing
    from kernelplan.sparse24 import tuning

    fakes(FakeBackend("fast"), FakeBackend("slower"))
    names = ("dense", "fast", "slower")
    monkeypatch.setattr(tuning, "tunable", lambda desc: [GemmSparse24Plan.registry.get(n) for n in names])
    right = torch.randn(4, 8)
    outputs = {"dense": right, "fast": right if fast_is_right else -right, "slower": right}
    seconds = {"dense": 3e-5, "fast": 1e-5, "slower": 2e-5}

    def call(plan):
        def fn():
            return outputs[plan.backend.name].clone()

        fn.seconds = seconds[plan.backend.name]
        return fn

    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, **kwargs: fn.seconds * 1e3)  # milliseconds
    monkeypatch.setattr(kernelplan.timing, "host_us_per_call", lambda fn, dev, calls: fn.seconds * 1e6 / 2)
    desc = GemmSparse24Descriptor(n=4, m=8, k=16, dtype="f32", memory="fast")  # _tune itself: tune() would refuse the CPU
    if fast_is_right:
        assert tuning._tune(desc, call, 10.0, 25.0) == "fast"
    else:
        with pytest.warns(RuntimeWarning, match="backend fast left out: its result differs from the oracle's"):
            assert tuning._tune(desc, call, 10.0, 25.0) == "slower"


def test_a_slow_spell_of_the_host_during_one_candidates_timing_does_not_decide(fakes, monkeypatch):
    """Host work is read side by side: a slow spell that falls on one candidate's turn slows all, or none.

    The timers are faked on a simulated clock: each ``do_bench`` takes 100 ms, each host burst 1 ms,
    and between 150 and 550 ms the host runs 1.6x slower.  ``fast`` has the faster kernels and less
    host work than dense's kernels take; timed in turns between ``do_bench`` runs, two of its three
    host readings fell in the spell (H200: cuda_mma's 13 us of host work read 18.9 us, and dense,
    at 18.7 us, kept the bucket).
    """
    import triton.testing

    import kernelplan.timing
    from kernelplan.sparse24 import tuning

    fakes(FakeBackend("fast"), FakeBackend("slower"))
    names = ("dense", "fast", "slower")
    monkeypatch.setattr(tuning, "tunable", lambda desc: [GemmSparse24Plan.registry.get(n) for n in names])
    kernel_s = {"dense": 18.7e-6, "fast": 11.2e-6, "slower": 15e-6}
    host_s = {"dense": 15e-6, "fast": 13e-6, "slower": 14e-6}
    clock = [0.0]
    right = torch.randn(4, 8)

    def call(plan):
        def fn():
            return right.clone()

        fn.name = plan.backend.name
        return fn

    def do_bench(fn, **kwargs):
        clock[0] += 0.1
        return kernel_s[fn.name] * 1e3

    def host_us_per_call(fn, dev, calls):
        clock[0] += 0.001
        return host_s[fn.name] * 1e6 * (1.6 if 0.15 <= clock[0] < 0.55 else 1.0)

    monkeypatch.setattr(triton.testing, "do_bench", do_bench)
    monkeypatch.setattr(kernelplan.timing, "host_us_per_call", host_us_per_call)
    desc = GemmSparse24Descriptor(n=4, m=8, k=16, dtype="f32", memory="fast")
    assert tuning._tune(desc, call, 10.0, 25.0) == "fast"
    # Where the spell covers the whole reading, it slows every candidate alike: the order holds.
    clock[0] = 0.0
    monkeypatch.setattr(kernelplan.timing, "host_us_per_call",
                        lambda fn, dev, calls: host_s[fn.name] * 1e6 * 1.6)
    desc = dataclasses.replace(desc, n=8)
    assert tuning._tune(desc, call, 10.0, 25.0) == "fast"


def test_a_tie_within_the_margin_goes_to_the_faster_kernels():
    """Host-bound calls time alike: among the backends within the margin of the fastest, ``ties`` decides."""
    from kernelplan.sparse24 import backends  # noqa: F401  (registers the GPU backends)

    remember = GemmSparse24Plan.remember_fastest
    host_bound = {"dense": 20.0, "cuda_mma": 15.2, "cuda_sp": 15.0, "triton": 15.6}
    kernels = {"dense": 18.7, "cuda_mma": 11.9, "cuda_sp": 15.0, "triton": 15.6}
    assert remember(DESC, host_bound, floor="dense", margin=0.03) == "cuda_sp"
    assert remember(DESC, host_bound, floor="dense", margin=0.03, ties=kernels) == "cuda_mma"
    # Outside the margin there is no tie: host work that costs more than the kernels save still loses.
    assert remember(DESC, {**host_bound, "cuda_mma": 15.6}, floor="dense", margin=0.03, ties=kernels) == "cuda_sp"
    # The tie beats the floor where its fastest does; else the floor stays.
    assert remember(DESC, {"dense": 15.3, "cuda_mma": 15.2, "cuda_sp": 14.8}, floor="dense", margin=0.03,
                    ties=kernels) == "cuda_mma"
    assert remember(DESC, {"dense": 15.3, "cuda_mma": 15.2, "cuda_sp": 15.0}, floor="dense", margin=0.03,
                    ties=kernels) == "dense"


def test_a_win_over_the_floor_must_hold_when_measured_again():
    """``confirmed`` with the timer faked: a challenger's win is repeated once before it counts."""
    from kernelplan.sparse24.tuning import confirmed, measure

    def run(first: dict, later: dict[str, list[float]]):
        calls = []

        def bench(name):
            calls.append(name)
            return later[name].pop(0)

        again = lambda floor, challenger: measure({floor: floor, challenger: challenger}, bench, "tuning x")  # noqa: E731
        return confirmed(first, again, floor="dense", margin=0.03), calls

    # triton_bfe won the first measurement by 10% and lost the repeat; cusparselt wins both and is kept.
    later = {"dense": [10.0] * 6, "triton_bfe": [11.0, 12.0, 11.0], "cusparselt": [9.0, 9.1, 9.0]}
    timings, calls = run({"dense": 10.0, "triton_bfe": 9.0, "cusparselt": 9.5}, later)
    assert timings == {"dense": 10.0, "triton_bfe": 11.0, "cusparselt": 9.5}
    assert calls == ["dense", "triton_bfe", "triton_bfe", "dense", "dense", "triton_bfe",
                     "dense", "cusparselt", "cusparselt", "dense", "dense", "cusparselt"]
    assert GemmSparse24Plan.remember_fastest(DESC, timings, floor="dense", margin=0.03) == "cusparselt"
    # The ratio to the floor counts within each measurement: in the repeat the floor ran faster, and the
    # challenger's 1.07x there is what it keeps.
    timings, _ = run({"dense": 10.0, "fast": 9.6}, {"dense": [9.0, 9.0, 9.0], "fast": [9.6, 9.6, 9.6]})
    assert timings == {"dense": 10.0, "fast": pytest.approx(10.0 * 9.6 / 9.0)}
    # A repeat that ran slow for both (a slow spell of the host) keeps the win: 0.91x of dense, twice.
    timings, _ = run({"dense": 10.0, "cuda_mma": 9.0}, {"dense": [15.0] * 3, "cuda_mma": [13.6] * 3})
    assert timings == {"dense": 10.0, "cuda_mma": pytest.approx(10.0 * 13.6 / 15.0)}
    assert GemmSparse24Plan.remember_fastest(DESC, timings, floor="dense", margin=0.03) == "cuda_mma"
    # A challenger refused in its repeat (measure leaves it out) is out.
    timings = confirmed({"dense": 10.0, "fast": 9.0}, lambda floor, challenger: {floor: 10.0}, floor="dense",
                        margin=0.03)
    assert timings == {"dense": 10.0, "fast": float("inf")}
    # Nothing beat the floor by the margin, or the floor won: nothing is timed again.
    for first in ({"dense": 10.0, "near": 9.8}, {"dense": 10.0, "slow": 12.0}):
        timings, calls = run(first, {})
        assert timings == first and calls == []


def test_cusparselt_refuses_f16_off_device_index_zero_with_its_reason():
    # cuSPARSELt 0.8's f16 search fails on device index 1 (sparse24/cusparselt.py): a reason, not a crash.
    from kernelplan.sparse24 import GemmSparse24Descriptor, GemmSparse24Plan

    cusparselt = GemmSparse24Plan.registry.get("cusparselt")
    reason = cusparselt.supports(GemmSparse24Descriptor(48, 256, 512, "f16", device="cuda:1"))
    assert reason is not None and "device index 1" in reason and "CUDA_VISIBLE_DEVICES" in reason
    for dtype, device in (("bf16", "cuda:1"), ("f16", "cuda:0")):
        other = cusparselt.supports(GemmSparse24Descriptor(48, 256, 512, dtype, device=device))
        assert other is None or "device index" not in other

