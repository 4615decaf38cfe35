"""The 2:4 format: pruning rules, the documented bit layout, and round trips."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kernelplan as kp
from kernelplan.errors import InvalidProblem, MisalignedOperand
from kernelplan.sparse24 import Sparse24Weight, compress, is_sparse24, prune


def test_metadata_bits_of_a_hand_built_row():
    # group 0 keeps cols 1,3 -> byte 0b1101 = 0x0D; group 1 keeps 0,2 -> 0b1000 = 0x08
    # group 2 keeps only col 2 -> positions (0, 2) -> 0x08; group 3 is empty -> (0, 1) -> 0x04
    w = torch.tensor([[0, 1.0, 0, 2.0, 3.0, 0, 4.0, 0, 0, 0, 5.0, 0, 0, 0, 0, 0]])
    w24 = compress(w)
    assert w24.metadata.dtype == torch.int16 and tuple(w24.metadata.shape) == (1, 2)
    assert w24.metadata.tolist() == [[0x0D | (0x08 << 8), 0x08 | (0x04 << 8)]]
    assert w24.values.tolist() == [[1.0, 2.0, 3.0, 4.0, 0.0, 5.0, 0.0, 0.0]]
    assert torch.equal(w24.decompress(), w)


def test_prune_keeps_two_largest_and_breaks_ties_to_the_lower_index():
    w = torch.tensor([[1.0, -1.0, 1.0, 1.0, -3.0, 3.0, 0.5, -4.0]])
    assert prune(w).tolist() == [[1.0, -1.0, 0.0, 0.0, -3.0, 0.0, 0.0, -4.0]]


def test_prune_with_a_given_mask_and_its_errors():
    w = torch.randn(4, 8)
    mask = torch.zeros(4, 8, dtype=torch.bool)
    mask[:, 2] = mask[:, 3] = True
    assert torch.equal(prune(w, mask=mask), torch.where(mask, w, 0.0))
    mask[0, 0] = True
    with pytest.raises(InvalidProblem, match="more than 2 of 4"):
        prune(w, mask=mask)
    with pytest.raises(InvalidProblem, match="mask has dtype"):
        prune(w, mask=mask.float())


def test_prune_refuses_nan_and_misaligned_k():
    with pytest.raises(InvalidProblem, match="NaN"):
        prune(torch.tensor([[float("nan"), 1.0, 2.0, 3.0]]))
    with pytest.raises(MisalignedOperand, match=r"K = shape\[-1\] = 6.*multiple of 4"):
        prune(torch.randn(2, 6))


def test_prune_works_on_any_leading_shape_and_dtype():
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        w = torch.randn(2, 3, 16).to(dtype)
        p = prune(w)
        assert p.shape == w.shape and p.dtype == dtype and is_sparse24(p)
        assert ((p != 0).reshape(2, 3, 4, 4).sum(-1) == 2).all()


def test_compress_names_the_first_offending_row_and_group():
    w = prune(torch.randn(5, 16))
    w[3, 9] = w[3, 10] = w[3, 11] = w[3, 8] = 1.0
    with pytest.raises(InvalidProblem, match=r"row 3, group 2 \(columns 8..11\) has 4 non-zeros"):
        compress(w)


def test_compress_needs_k_multiple_of_8_and_2d():
    with pytest.raises(MisalignedOperand, match=r"K = shape\[-1\] = 12.*multiple of 8.*16"):
        compress(prune(torch.randn(4, 12)))
    with pytest.raises(InvalidProblem, match="2-D weight"):
        compress(torch.zeros(2, 2, 8))
    with pytest.raises(InvalidProblem, match="dtype torch.int32"):
        compress(torch.zeros(2, 8, dtype=torch.int32))


def test_constructor_rejects_corrupt_metadata():
    w24 = compress(prune(torch.randn(3, 16)))
    bad = w24.metadata.clone()
    bad[1, 1] = 0x0E | (0x07 << 8)  # high byte: pos0=3, pos1=1, not ascending
    with pytest.raises(InvalidProblem, match=r"metadata\[1, 1\] = 0x070e"):
        Sparse24Weight(w24.values, bad)
    with pytest.raises(InvalidProblem, match=r"\[M, K/2\] and \[M, K/8\]"):
        Sparse24Weight(w24.values, w24.metadata[:, :1])


def test_derived_layouts_are_cached_until_values_change():
    w24 = compress(prune(torch.randn(4, 16)))
    builds = []
    build = lambda w: builds.append(1) or w.values.sum()  # noqa: E731
    w24.derived("layout", build)
    w24.derived("layout", build)
    assert len(builds) == 1
    with torch.no_grad():
        w24.values.add_(1.0)  # an optimizer step: the layout must be rebuilt
    w24.derived("layout", build)
    assert len(builds) == 2


def test_derived_bytes_counts_each_copy_once_and_not_the_weight_itself():
    w24 = compress(prune(torch.randn(64, 128)))
    assert w24.derived_bytes() == {}

    class Launch:  # a layout object holding a copy that is also a layout of its own
        def __init__(self, copy):
            self.copy = copy

    dense = w24.derived("dense", lambda w: w.decompress())
    w24.derived("launch", lambda w: Launch(dense))
    w24.derived("pairs", lambda w: w.values.view(torch.int32))  # a view of values: no bytes of its own
    w24.derived("tiled", lambda w: (w.values.t().contiguous(), w.metadata.clone(), "host"))
    assert w24.derived_bytes() == {"dense": 64 * 128 * 4, "tiled": 64 * 64 * 4 + 64 * 16 * 2}


@st.composite
def sparse24_tensors(draw):
    m = draw(st.integers(1, 6))
    k = 8 * draw(st.integers(1, 4))
    # Each group: a subset of at most 2 positions, values from a small set incl. ties and -0.0
    vals = st.sampled_from([0.0, -0.0, 1.0, -1.0, 2.5, -7.0, 1e-3, 3e4])
    rows = []
    for _ in range(m):
        row = []
        for _ in range(k // 4):
            keep = draw(st.lists(st.integers(0, 3), max_size=2, unique=True))
            group = [0.0] * 4
            for p in keep:
                group[p] = draw(vals)
            row += group
        rows.append(row)
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64]))
    return torch.tensor(rows, dtype=dtype)


@settings(max_examples=150, deadline=None)
@given(sparse24_tensors())
def test_compress_decompress_is_identity_and_bits_follow_the_layout(w):
    assert is_sparse24(w)
    w24 = compress(w)
    assert torch.equal(w24.decompress(), w)
    assert w24.values.shape == (w.shape[0], w.shape[1] // 2) and w24.metadata.shape == (w.shape[0], w.shape[1] // 8)
    words = w24.metadata.to(torch.int64)
    for r in range(w.shape[0]):
        for g in range(w.shape[1] // 4):
            byte = (int(words[r, g // 2]) >> (8 * (g % 2))) & 0xFF
            pos0, pos1 = byte & 0x3, (byte >> 2) & 0x3
            assert byte >> 4 == 0 and pos0 < pos1
            group = w[r, 4 * g : 4 * g + 4]
            nz = [i for i in range(4) if group[i] != 0]
            assert set(nz) <= {pos0, pos1}
            assert w24.values[r, 2 * g] == group[pos0] and w24.values[r, 2 * g + 1] == group[pos1]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 4), st.integers(0, 2**31 - 1))
def test_prune_then_compress_round_trips_random_dense(m, k8, s):
    w = torch.randn(m, 8 * k8, generator=torch.Generator().manual_seed(s))
    p = prune(w)
    assert torch.equal(kp.sparse24.compress(p).decompress(), p)
    # pruning kept the two largest magnitudes of each group
    kept = p.reshape(m, -1, 4).abs().sum(-1)
    top2 = w.reshape(m, -1, 4).abs().topk(2, dim=-1).values.sum(-1)
    assert torch.allclose(kept, top2)
