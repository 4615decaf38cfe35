"""nn modules and the bench command, end to end on CPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

import kernelplan as kp


def test_sparse24_linear_from_dense_trains_and_stays_2_4():
    torch.manual_seed(0)
    dense = torch.nn.Linear(32, 12)
    layer = kp.nn.Sparse24Linear.from_dense(dense)
    masked = kp.sparse24.prune(dense.weight.detach())
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, masked, dense.bias.detach()))
    mask = layer.to_dense() != 0
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    layer(x).square().mean().backward()
    assert layer.values.grad.norm() > 0 and layer.bias.grad.norm() > 0
    opt.step()
    w = layer.to_dense()
    assert kp.sparse24.is_sparse24(w) and not (w[~mask] != 0).any(), "the mask must stay fixed"


def test_sparse24_linear_reads_parametrized_and_replaced_tensors():
    """forward reads the module's dictionaries: a parametrization (which moves a tensor off them) and a bias set
    after construction are still what it computes with."""
    import torch.nn.utils.parametrize as parametrize

    torch.manual_seed(0)
    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(128, 32))
    x = torch.randn(5, 128)
    w = layer.to_dense().double()
    want = x.double() @ w.T + layer.bias.double()
    torch.testing.assert_close(layer(x).double(), want, rtol=1e-5, atol=1e-5)

    class Twice(torch.nn.Module):
        def forward(self, b):
            return 2 * b

    parametrize.register_parametrization(layer, "bias", Twice())
    assert "bias" not in layer._parameters
    torch.testing.assert_close(layer(x).double(), want + layer.bias.double() / 2, rtol=1e-5, atol=1e-5)
    bare = kp.nn.Sparse24Linear(layer.values.detach(), layer.metadata)
    torch.testing.assert_close(bare(x).double(), x.double() @ w.T, rtol=1e-5, atol=1e-5)
    bare.bias = torch.nn.Parameter(torch.ones(32))
    torch.testing.assert_close(bare(x).double(), x.double() @ w.T + 1, rtol=1e-5, atol=1e-5)


def test_sparse24_linear_refuses_mismatched_parts_and_unknown_pruning():
    import pytest

    layer = kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(32, 8), prune="magnitude")
    with pytest.raises(kp.InvalidProblem, match=r"prune is 'random'.*prune='magnitude'"):
        kp.nn.Sparse24Linear.from_dense(torch.nn.Linear(32, 8), prune="random")
    # The module's Sparse24Weight skips validation: a metadata buffer of the wrong shape must
    # still be caught before any kernel reads past it.
    layer.metadata = layer.metadata[:, :-1].clone()
    with pytest.raises(kp.InvalidProblem, match=r"metadata has shape \(8, 3\) but must have shape \(8, 4\)"):
        layer(torch.randn(2, 32))


def test_bench_command_runs_and_reports_correctness(tmp_path):
    env = {**os.environ, "KERNELPLAN_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-m", "kernelplan", "bench", "--json", str(tmp_path / "b.json")],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "sparse24" in out.stdout and "gated" in out.stdout and "gemm" in out.stdout
    assert " NO" not in out.stdout
    suites = json.loads((tmp_path / "b.json").read_text())["suites"]
    from kernelplan.cli import BENCH_SUITES

    assert set(suites) == {"sparse24", "gemm", "gated"} == set(BENCH_SUITES)
    memory = suites["sparse24"][0]["memory"]  # per weight: its format and the layouts its calls built
    assert memory and all(0 < held["format_bytes"] < held["dense_bytes"] for held in memory.values())
    assert "the 2:4 weight holds" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "kernelplan", "bench", "nosuch"], env=env, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "unknown suite 'nosuch'" in bad.stderr


def test_bench_bad_arguments_fail_in_one_line_before_any_work(tmp_path, capsys, monkeypatch):
    from kernelplan import cli

    ran = []
    monkeypatch.setattr("kernelplan.bench.run_bench", lambda *a, **k: ran.append(a) or 0)
    monkeypatch.setattr("kernelplan.bench.run_sweep_command", lambda *a, **k: ran.append(a) or 0)
    cases = [
        (["bench", "--device", "bogus"], "--device 'bogus' is not a device"),
        (["bench", "--device", "xla"], "runs on cpu or cuda"),
        (["bench", "--json", str(tmp_path / "missing" / "x.json")], "does not exist"),
        (["bench", "nosuch"], "unknown suite 'nosuch'"),
        (["bench", "gemm", "--sweep"], "give the suite sparse24"),
        (["bench", "sparse24", "--quick"], "belong to --sweep"),
        (["bench", "sparse24", "--l2", "warm"], "belong to --sweep"),
        (["bench", "sparse24", "--lm-heads"], "belong to --sweep"),
        (["bench", "sparse24", "--held-out"], "belong to --sweep"),
        (["bench", "sparse24", "--sweep", "--lm-heads", "--held-out"], "give one of them"),
        (["bench", "sparse24", "--sweep", "--device", "cpu"], "on a CUDA device"),
        (["bench", "sparse24", "--batch", "8"], "belong to --sweep"),
        (["bench", "sparse24", "--merge", "a.json", "b.json"], "belong to --sweep"),
        (["bench", "sparse24", "--sweep", "--batch", "8", "0"], "--batch 0: a batch size is 1 or more"),
        (["bench", "sparse24", "--sweep", "--batch", "8", "--quick"], "give one of them"),
        (["bench", "sparse24", "--sweep", "--merge", "a.json", "b.json", "--dtype", "f16"], "leave out"),
        (["bench", "sparse24", "--sweep", "--merge", "a.json", "b.json", "--lm-heads"], "leave out"),
        (["bench", "sparse24", "--sweep", "--merge", "a.json", "b.json", "--held-out"], "leave out"),
        (["bench", "gemm", "--sweep", "--merge", "a.json", "b.json"], "give the suite sparse24"),
    ]
    if not torch.cuda.is_available():
        cases.append((["bench", "--device", "cuda"], "no CUDA device"))
        cases.append((["bench", "sparse24", "--sweep"], "on a CUDA device"))
    for argv, message in cases:
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and err.count("\n") == 1
    assert ran == []


def test_bench_help_lists_the_suites(capsys):
    import pytest as _pytest

    from kernelplan import cli

    with _pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for suite in ("sparse24", "gemm", "gated", "llama"):
        assert suite in out
