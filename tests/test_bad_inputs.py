"""Bad input gives a kernelplan error naming the operand and the fix, and writes nothing (issue 27, classes 2-4)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

import kernelplan as kp
from helpers import kernelplan_cli

W = torch.randn(16, 16)
META = torch.empty(4, 8, device="meta")

CASES = {
    "linear: x a list": (lambda: kp.linear([[1.0] * 16], W), r"x is a list; it must be a torch.Tensor"),
    "linear: w a list": (lambda: kp.linear(torch.randn(2, 16), [[1.0] * 16]), r"w is a list"),
    "linear: alpha a string": (lambda: kp.linear(torch.randn(2, 16), W, alpha="2"), r"alpha is '2' \(str\)"),
    "linear: beta two elements": (lambda: kp.linear(torch.randn(2, 16), W, c=torch.ones(2, 16), beta=torch.ones(2)),
                                  r"beta is a tensor of shape \(2,\); it must be a real scalar"),
    "linear: beta without c": (lambda: kp.linear(torch.randn(2, 16), W, beta=2.0), r"beta is 2.0 but c is None"),
    "linear: out a list": (lambda: kp.linear(torch.randn(2, 16), W, out=[0.0]), r"out is a list"),
    "linear: out expanded": (lambda: kp.linear(torch.randn(2, 16), W, out=torch.empty(1, 16).expand(2, 16)),
                             r"out has shape \(2, 16\) and strides \(0, 1\).*share memory"),
    "prune: meta": (lambda: kp.sparse24.prune(META), r"w is a meta tensor .* prune reads its values"),
    "compress: meta": (lambda: kp.sparse24.compress(META), r"w is a meta tensor .* compress reads its values"),
    "quantize: meta": (lambda: kp.fp8.quantize(META), r"x is a meta tensor .* quantize reads its values"),
    "prune: bool": (lambda: kp.sparse24.prune(torch.ones(4, 8, dtype=torch.bool)), r"w has dtype torch.bool"),
    "quantize: dtype name not fp8": (lambda: kp.fp8.quantize(torch.randn(4, 8), dtype="f16"), r"dtype has dtype f16"),
    "gated: meta x, real out": (lambda: kp.gated_activation(torch.empty(2, 16, device="meta"), "swiglu",
                                                            out=torch.zeros(2, 8)), r"out is on cpu but the op runs on meta"),
    "2:4 triton by name, bf16 on CPU": (
        lambda: kp.sparse24.GemmSparse24Plan.select(
            kp.sparse24.GemmSparse24Descriptor(4, 64, 128, "bf16"), kp.plan.PlanPreference.only("triton")),
        r"triton: dtype bf16 on CPU: the Triton interpreter computes bf16 arithmetic wrongly"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_bad_input_is_refused_by_name(case):
    call, message = CASES[case]
    with pytest.raises(kp.KernelPlanError, match=message):
        call()


def test_results_at_the_edges_are_right():
    # A scale that underflowed gave 0 and then NaN for the zeros: the smallest normal scale keeps them 0.
    q = kp.fp8.quantize(torch.tensor([1e-44, 0.0]))
    assert q.scale > 0 and torch.isfinite(q.data.float()).all() and q.data.float()[1] == 0
    assert kp.fp8.quantize(torch.randn(4, 8), dtype="e4m3").data.dtype == torch.float8_e4m3fn
    for recipe in ("tensor", "rowwise"):
        assert kp.fp8.quantize(torch.empty(0, 8), recipe=recipe).data.shape == (0, 8)
    w24 = kp.sparse24.compress(torch.empty(0, 8))
    assert w24.values.shape == (0, 4) and w24.metadata.shape == (0, 1)
    x = torch.randn(2, 16)
    # beta = 0 does not read c (as cuBLASLt): NaN there stays out, on the CPU reference as on the GPU.
    torch.testing.assert_close(kp.linear(x, W, c=torch.full((2, 16), float("nan")), beta=0.0), x @ W.T)
    # c without beta is added, as torch.addmm does; it was ignored.
    torch.testing.assert_close(kp.linear(x, W, c=torch.ones(2, 16)), x @ W.T + 1)


def test_an_output_is_untouched_when_a_check_fails():
    out = torch.full((2, 16), 7.0)
    with pytest.raises(kp.KernelPlanError):
        kp.linear(torch.randn(2, 16), W, alpha="2", out=out)
    with pytest.raises(kp.KernelPlanError):
        kp.linear(torch.randn(2, 15), W, out=out)
    assert (out == 7).all()


LINEAR_MISTAKES = ["dtype", "shape", "rank", "k", "int", "bias shape", "bias dtype", "out dtype", "out shape",
                   "bias device", "out device"]


def _linear_mistake(case: str, n: int, seed: int, dev: str) -> None:
    """One generated mistake to ``kp.linear`` and ``kp.sparse24.linear``: a kernelplan error, the output untouched."""
    torch.manual_seed(seed)
    x, w, b = torch.randn(n, 64, device=dev), torch.randn(32, 64, device=dev), torch.randn(32, device=dev)
    out = torch.full((n, 32), 7.0, device=dev)
    other = "cpu" if dev != "cpu" else "meta"  # a tensor on another device than the operands
    bad = {"dtype": {"x": x.double()}, "shape": {"x": torch.randn(n, 63, device=dev)},
           "rank": {"w": torch.randn(32, 64, 1, device=dev)}, "k": {"w": torch.randn(32, 60, device=dev)},
           "int": {"x": torch.ones(n, 64, dtype=torch.int32, device=dev)}, "bias shape": {"b": b[:31]},
           "bias dtype": {"b": b.half()}, "out dtype": {"out": out.double()},
           "out shape": {"out": torch.full((n, 31), 7.0, device=dev)}, "bias device": {"b": b.to(other)},
           "out device": {"out": torch.full((n, 32), 7.0, device=other)}}[case]
    args = {"x": x, "w": w, "b": b, "out": out, **bad}
    before = args["out"].clone() if args["out"].device.type != "meta" else None
    with pytest.raises(kp.KernelPlanError):
        kp.linear(args["x"], args["w"], args["b"], out=args["out"])
    if before is not None:
        assert torch.equal(args["out"], before)
    if case in ("rank", "k", "out dtype", "out shape", "out device"):
        return
    w24 = kp.sparse24.compress(kp.sparse24.prune(w))
    with pytest.raises(kp.KernelPlanError):
        kp.sparse24.linear(args["x"], w24, args["b"])


def _gated_mistake(case: str, seed: int, dev: str) -> None:
    torch.manual_seed(seed)
    x = torch.randn(3, 16, device=dev)
    out = torch.full((3, 8), 7.0, device=dev)
    call = {"odd split": lambda: kp.gated_activation(torch.randn(3, 15, device=dev), "swiglu"),
            "kind": lambda: kp.gated_activation(x, "swish-glu"),
            "dim": lambda: kp.gated_activation(x, "swiglu", dim=2),
            "out shape": lambda: kp.gated_activation(x, "swiglu", out=out[:, :7]),
            "out dtype": lambda: kp.gated_activation(x, "swiglu", out=out.double()),
            "out overlaps x": lambda: kp.gated_activation(x, "swiglu", out=x[:, :8]),
            "int x": lambda: kp.gated_activation(torch.ones(3, 16, dtype=torch.int64, device=dev), "swiglu"),
            "quantize recipe": lambda: kp.fp8.quantize(x, recipe="blockwise"),
            "quantize int": lambda: kp.fp8.quantize(torch.ones(3, 16, dtype=torch.int32, device=dev)),
            "quantize nan": lambda: kp.fp8.quantize(torch.full((3, 16), float("nan"), device=dev))}[case]
    before = out.clone()
    with pytest.raises(kp.KernelPlanError):
        call()
    assert torch.equal(out, before)


GATED_MISTAKES = ["odd split", "kind", "dim", "out shape", "out dtype", "out overlaps x", "int x", "quantize recipe",
                  "quantize int", "quantize nan"]


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(LINEAR_MISTAKES), n=st.integers(1, 5), seed=st.integers(0, 1000))
def test_generated_bad_inputs_to_linear_and_the_2_4_linear(case, n, seed):
    _linear_mistake(case, n, seed, "cpu")


@settings(max_examples=40, deadline=None)
@given(case=st.sampled_from(GATED_MISTAKES), seed=st.integers(0, 1000))
def test_generated_bad_inputs_to_gated_and_quantize(case, seed):
    _gated_mistake(case, seed, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_same_mistakes_on_cuda_tensors_mixed_with_cpu_ones_and_across_devices():
    for case in LINEAR_MISTAKES:
        _linear_mistake(case, 3, 0, "cuda")
    for case in GATED_MISTAKES:
        _gated_mistake(case, 0, "cuda")
    if torch.cuda.device_count() > 1:  # operands on two GPUs
        with pytest.raises(kp.KernelPlanError, match="cuda:1"):
            kp.linear(torch.randn(2, 16, device="cuda:0"), torch.randn(8, 16, device="cuda:1"))


# -- checkpoints and the CLI ---------------------------------------------------


def test_checkpoints_round_trip_0_d_and_empty_tensors_and_refuse_broken_files(tmp_path):
    state = {"scalar": torch.tensor(1.5), "empty": torch.empty(0, 8), "bn.num_batches_tracked": torch.tensor(3)}
    kp.save_compressed(state, tmp_path / "a.safetensors")
    back = kp.load_compressed(tmp_path / "a.safetensors")
    assert all(torch.equal(back[k], v) for k, v in state.items())
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(16, 32)))
    kp.save_compressed({"p.values": w24.values}, tmp_path / "orphan.safetensors")
    with pytest.raises(kp.InvalidProblem, match="p.values has no p.metadata"):
        kp.load_compressed(tmp_path / "orphan.safetensors")
    for raw in (None, "-1", "x", "0"):
        meta = {"format": "kernelplan.sparse24", **({"format_version": raw} if raw is not None else {})}
        save_file({"x": torch.ones(2)}, tmp_path / "v.safetensors", metadata=meta)
        with pytest.raises(kp.InvalidProblem, match=f"format_version {raw!r}; .* positive integer"):
            kp.load_compressed(tmp_path / "v.safetensors")
    with pytest.raises(kp.InvalidProblem, match="is a directory"):
        kp.save_compressed(state, tmp_path)
    with pytest.raises(kp.InvalidProblem, match="does not exist; create it first"):
        kp.save_compressed(state, tmp_path / "missing" / "a.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "orphan.safetensors", "v.safetensors"]


def test_the_sparsify_command_refuses_to_overwrite_its_input_and_errors_in_one_line(tmp_path):
    dense = tmp_path / "d.safetensors"
    save_file({"fc.weight": torch.randn(16, 32), "bn.num_batches_tracked": torch.tensor(3)}, dense)
    original = dense.read_bytes()
    run = lambda *a: kernelplan_cli("sparsify", *a)  # noqa: E731
    for args, message in (((dense, dense), "would overwrite the dense original"),
                          ((dense, tmp_path / "missing" / "o.safetensors"), "does not exist; create it first"),
                          ((dense, tmp_path), "is a directory")):
        out = run(*args)
        assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert dense.read_bytes() == original
    ok = run(dense, tmp_path / "o.safetensors")
    assert ok.returncode == 0, ok.stderr
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]  # the atomic write left no temporary
    assert "fc.values" in kp.load_compressed(tmp_path / "o.safetensors")


def test_scales_off_the_operands_device_and_an_expanded_2_4_output_are_refused():
    from kernelplan.sparse24 import GemmSparse24Args, GemmSparse24Descriptor, GemmSparse24Plan

    xq, wq = kp.fp8.quantize(torch.randn(4, 32)), kp.fp8.quantize(torch.randn(16, 32))
    with pytest.raises(kp.InvalidProblem, match=r"scales.b is on meta but the op runs on cpu"):
        kp.linear(xq.data, wq.data, scales=kp.gemm.ScaleSet(a=xq.scale, b=wq.scale.to("meta")),
                  out_dtype=torch.float32)
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(64, 128)))
    plan = GemmSparse24Plan.select(GemmSparse24Descriptor(4, 64, 128, "f32"))
    y = torch.full((1, 64), 7.0).expand(4, 64)
    with pytest.raises(kp.InvalidProblem, match=r"y has shape \(4, 64\) and strides \(0, 1\).*share memory"):
        plan.run(GemmSparse24Args(torch.randn(4, 128), w24.values, w24.metadata, y))
    assert (y == 7).all()


@pytest.mark.parametrize("op", ["sparse24_linear", "sparse24_linear_inference"])
def test_the_sparse24_ops_called_directly_check_their_operands(op):
    """The custom ops are reachable as ``torch.ops.kernelplan.*``: a direct call's first call on its operands checks
    them as ``kp.sparse24.linear`` does (a K that does not match would send the kernels past x's rows)."""
    from kernelplan.errors import KernelPlanError

    call = getattr(torch.ops.kernelplan, op)
    w24 = kp.sparse24.compress(kp.sparse24.prune(torch.randn(32, 64)))
    x = torch.randn(3, 64)
    cases = [((torch.randn(3, 32), w24.values, w24.metadata, None, "", "compact"), r"x has shape \(3, 32\)"),
             ((x, w24.values, w24.metadata, torch.randn(5), "", "compact"), r"bias"),
             ((x, w24.values, w24.metadata[:16], None, "", "compact"), r"metadata"),
             ((x.double(), w24.values, w24.metadata, None, "", "compact"), r"x has dtype"),
             ((x, w24.values, w24.metadata, None, "bogus", "compact"), r"activation is 'bogus'"),
             ((x, w24.values, w24.metadata, None, "", "roomy"), r"memory is 'roomy'")]
    for args, message in cases:
        with pytest.raises(KernelPlanError, match=message):
            call(*args)
    torch.testing.assert_close(call(x, w24.values, w24.metadata, None, "", "compact"), x @ w24.decompress().T)
