"""``Sparse24Linear.weight`` (``sparse24/dense_view.py``): what model code reads off a linear layer's weight, with no
dense copy held; any op on it runs on the decompressed weight; a write is refused."""

from __future__ import annotations

import pytest
import torch

import kernelplan as kp
from helpers import compiled_graphs
from kernelplan import _checks
from kernelplan.bench.decode import weight_bytes
from kernelplan.errors import InvalidProblem
from kernelplan.sparse24.dense_view import DenseView


@pytest.fixture(autouse=True)
def _warn_afresh(monkeypatch):
    monkeypatch.setattr(_checks, "_WARNED", set())


def _layer(layout, dtype, m=48, k=128):
    dense = torch.nn.Linear(k, m).to(dtype)
    return kp.nn.Sparse24Linear.from_dense(dense, layout=layout)


@pytest.mark.parametrize("layout", ["auto", "public"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_weight_reads_like_a_dense_one_and_ops_on_it_run_on_the_decompressed_weight(layout, dtype, seed):
    layer = _layer(layout, dtype)
    held = weight_bytes(layer)
    w = layer.weight
    assert isinstance(w, DenseView) and isinstance(w, torch.Tensor) and w.requires_grad  # a function of values
    with torch.no_grad():
        assert isinstance(layer.weight, DenseView) and not layer.weight.requires_grad
    assert (w.shape, w.dtype, w.device) == ((48, 128), dtype, torch.device("cpu"))
    assert weight_bytes(layer) == held and "weight" not in layer.state_dict()
    x = torch.randn(3, 5, 128, dtype=dtype)
    want = x.double() @ layer.to_dense().double().T + layer.bias.double()
    with pytest.warns(RuntimeWarning, match="ran on the weight decompressed"):
        got = torch.nn.functional.linear(x, w, layer.bias)
    torch.testing.assert_close(got.double(), want, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5, atol=1e-2)
    torch.testing.assert_close(w.clone(), layer.to_dense(), rtol=0, atol=0)
    assert type(w.clone()) is torch.Tensor and weight_bytes(layer) == held


@pytest.mark.parametrize("layout, k", [("auto", 128), ("auto", 72), ("public", 128)])  # 72: held padded to 128
def test_an_op_on_the_weight_gives_the_kept_values_their_gradient(layout, k, seed):
    """Model code that multiplies by ``layer.weight`` while training (a tied head, a weight's own matmul) gives the
    layer's values the gradient its own forward would (before, none: the step left the layer out), in the layout
    they are held in; values that do not require grad give a view outside autograd."""
    layer = _layer(layout, torch.float64, k=k)
    x = torch.randn(5, k, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="ran on the weight decompressed"):
        torch.nn.functional.linear(x, layer.weight, layer.bias).square().sum().backward()
    through_weight = layer.values.grad.clone()
    layer.values.grad = None
    layer(x).square().sum().backward()
    torch.testing.assert_close(through_weight, layer.values.grad, rtol=1e-12, atol=1e-12)
    assert through_weight.shape == layer.values.shape and through_weight.abs().sum() > 0
    layer.values.requires_grad_(False)
    assert not layer.weight.requires_grad


def test_a_write_to_the_weight_is_refused_and_nothing_changes(seed):
    layer = _layer("auto", torch.float32)
    before = layer.values.detach().clone()
    for write in (lambda w: w.add_(1), lambda w: w.mul_(torch.rand(48, 128)), lambda w: w.copy_(torch.zeros(48, 128)),
                  lambda w: w.zero_()):
        with pytest.raises(InvalidProblem, match="would write a 2:4 layer's weight.*change layer.values"):
            write(layer.weight)
    assert torch.equal(layer.values, before)
    y = torch.zeros(48, 128)
    with pytest.warns(RuntimeWarning, match="ran on the weight decompressed"):
        y.add_(layer.weight)  # a write to another tensor that reads the weight
    torch.testing.assert_close(y, layer.to_dense(), rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["auto", "public"])
def test_scaling_the_weight_in_place_scales_the_layer_s_kept_entries(layout, seed):
    """RWKV's eval forward rescales its layers' weights with ``mul_`` and ``div_`` by a power of 2: a scalar keeps the
    weight 2:4, so the layer's values take it, its metadata unchanged, and the layer computes the scaled weight."""
    layer = _layer(layout, torch.float32)
    dense, metadata = layer.to_dense(), layer.metadata.clone()
    with torch.no_grad():
        assert layer.weight.mul_(4) is not None and layer.weight.div_(torch.tensor(8.0)) is not None
    assert torch.equal(layer.metadata, metadata)
    torch.testing.assert_close(layer.to_dense(), dense / 2, rtol=0, atol=0)
    x = torch.randn(3, 128, dtype=torch.float64)
    want = x @ (dense.double() / 2).T + layer.bias.double()
    torch.testing.assert_close(layer(x.float()).double(), want, rtol=1e-5, atol=1e-5)


def test_traced_the_weight_is_the_decompressed_weight_in_the_graph(seed):
    torch._dynamo.reset()
    layer = _layer("auto", torch.float32)
    x = torch.randn(4, 128)

    def fn(t):  # as T5's feed-forward does: the input cast to the weight's dtype, then the layer
        return layer(t.to(layer.weight.dtype)) + torch.nn.functional.linear(t, layer.weight).sum()

    with torch.no_grad():
        want = layer(x) + (x @ layer.to_dense().T).sum()
        got, graphs = compiled_graphs(fn, x)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert len(graphs) == 1
