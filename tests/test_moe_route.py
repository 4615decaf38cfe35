"""The MoE routing kernel (kernels/moe_route.py) against torch's stable sort, bit for bit.

On CPU it runs under the Triton interpreter on CPU tensors; on a GPU, on CUDA tensors, then inside
``Sparse24Experts``' grouped forward, against its per-expert path.
"""

from __future__ import annotations

import pytest
import torch

from kernelplan.kernels import interpreting

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(DEV == "cpu" and not interpreting(),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


def _want(ids: torch.Tensor, weights: torch.Tensor, x: torch.Tensor, experts: int, weigh: str = "outputs"):
    """What the kernel must give, by torch ops: ids outside [0, E) sort last.  Weighing the inputs, each row times
    its pair's weight (or the sigmoid of it in float32, rounded to its dtype: Llama4Router's scores) in float64,
    rounded once to x's dtype: the exact product correctly rounded, as torch's product in x's dtype is."""
    flat = ids.reshape(-1).long().cpu()
    key = torch.where((flat >= 0) & (flat < experts), flat, experts)
    ordered, order = torch.sort(key, stable=True)
    offsets = torch.searchsorted(ordered, torch.arange(experts + 1))
    xs, w = x.cpu()[order // ids.shape[1]], weights.reshape(-1).cpu()
    if weigh == "sigmoid inputs":
        w = torch.sigmoid(w.float()).to(w.dtype)
    if weigh != "outputs":
        xs = (xs.double() * w[order].double()[:, None]).to(x.dtype)
    scale = w.float() if weigh == "outputs" else torch.ones(w.shape)
    return order, offsets, xs, scale, key == experts


def _check(tokens, k, experts, h, dtype, ids_dtype=torch.int64, seed=0, row_pad=0, y_width=None, outside=(),
           weigh="outputs"):
    from kernelplan.kernels.moe_route import route

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, h + row_pad, generator=g).to(dtype)[:, :h]  # rows of stride h + row_pad
    ids = torch.randint(0, experts, (tokens, k), generator=g).to(ids_dtype)
    for (t, j), e in outside:
        ids[t, j] = e
    weights = (torch.rand(tokens, k, generator=g) * (12 if weigh == "sigmoid inputs" else 1) - 6 * (
        weigh == "sigmoid inputs")).to(dtype)  # logits of -6 .. 6 for the sigmoid
    y = torch.full((tokens * k, y_width), 7.0, dtype=dtype, device=DEV) if y_width else None
    xs, order, offsets, scale = route(ids.to(DEV), weights.to(DEV), x.to(DEV), experts, y, weigh)
    want_order, want_offsets, want_xs, want_scale, dropped = _want(ids, weights, x, experts, weigh)
    assert torch.equal(order.cpu(), want_order)
    assert offsets.dtype == torch.int32 and torch.equal(offsets.cpu().long(), want_offsets)
    routed = int(want_offsets[-1])
    got_bits, want_bits = _bits(xs.cpu()[:routed]).long(), _bits(want_xs[:routed]).long()
    if weigh == "sigmoid inputs":
        # The sigmoid's float32 rounding is not torch's (1 / (1 + exp(-w)) by Triton's exp): within four units of the
        # last place of x's dtype, where a missing sigmoid is off by a third of the value or more.
        eps = torch.finfo(dtype).eps
        torch.testing.assert_close(xs.cpu()[:routed].double(), want_xs[:routed].double(), rtol=4 * eps, atol=0)
    elif weigh != "outputs" and interpreting() and dtype == torch.bfloat16:
        # The interpreter rounds float32 to bf16 toward zero (the GPU to nearest): one unit of the last place nearer
        # zero or none, which is one less in the bits as int16 whatever the sign.
        assert torch.isin(want_bits - got_bits, torch.tensor([0, 1])).all()
    else:
        assert torch.equal(got_bits, want_bits)
    assert torch.equal(scale.cpu(), want_scale)
    if y is not None:
        y = y.cpu()
        assert (y[dropped] == 0).all() and (y[~dropped] == 7).all()  # only the dropped pairs' rows, all of each


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_route_gives_the_stable_sort_and_the_gathered_rows(dtype):
    _check(1, 2, 8, 64, dtype)  # a decode's one token
    _check(37, 8, 128, 200, dtype, seed=1, row_pad=3)  # H not a multiple of the column block, rows strided
    _check(300, 2, 8, 96, dtype, seed=2)  # 600 pairs: 19 chunks, each placed after the ones before


def test_route_with_several_summing_steps_and_column_blocks_a_program(monkeypatch):
    """Summing steps of fewer chunks than there are, and programs that copy several column blocks (the last past H)."""
    from kernelplan.kernels import moe_route

    monkeypatch.setattr(moe_route, "_PLANS", {})  # plans made under the constants below stay in this test
    monkeypatch.setattr(moe_route, "_CB", 2)  # 600 pairs, 19 chunks of 32: ten steps, the last partial
    monkeypatch.setattr(moe_route, "_PROGRAMS", 38)  # 19 chunks x 2 programs of 3 column blocks (of 5 in H)
    _check(150, 4, 16, 600, torch.bfloat16, seed=6, outside=[((7, 2), 16)], y_width=600)


@pytest.mark.parametrize("scan_bins, scan_step", [(16, 8192), (4, 16)])
def test_route_with_the_counts_summed_once_by_their_own_launch(monkeypatch, scan_bins, scan_step):
    """Past ``_SCAN_MIN_CHUNKS`` chunks, ``_scan`` sums the counts down the chunks once and ``_route`` reads them: here
    at every size, with bins split over several scan programs and chunks over several steps of each."""
    from kernelplan.kernels import moe_route

    monkeypatch.setattr(moe_route, "_PLANS", {})  # plans made under the constants below stay in this test
    monkeypatch.setattr(moe_route, "_SCAN_MIN_CHUNKS", 1)
    monkeypatch.setattr(moe_route, "_SCAN_BINS", scan_bins)
    monkeypatch.setattr(moe_route, "_SCAN_STEP", scan_step)  # (4, 16): 4 chunks a step, 19 chunks in 5 steps
    _check(300, 2, 8, 96, torch.bfloat16, seed=7, outside=[((3, 1), 8), ((9, 0), -2)], y_width=96)
    _check(1, 2, 8, 64, torch.float16)  # one chunk
    _check(70, 8, 30, 64, torch.bfloat16, seed=8)  # 32 bins: two scan programs at 16 a program


def test_route_places_ids_outside_the_experts_last_and_zeroes_their_rows_of_y():
    # The expert-parallel sentinel (E), an id far past it and a negative one; y wider than x.
    _check(9, 4, 3, 130, torch.bfloat16, outside=[((0, 3), 3), ((4, 0), 1000), ((8, 2), -1)], y_width=160)
    _check(5, 2, 6, 64, torch.float16, ids_dtype=torch.int32, outside=[((2, 1), 6)], y_width=64)


def test_route_with_many_experts_and_every_pair_on_one():
    _check(70, 8, 256, 64, torch.bfloat16, seed=3)  # DeepSeek-V3's 256 experts: 512 histogram bins
    from kernelplan.kernels.moe_route import route

    ids = torch.full((40, 4), 5, dtype=torch.int64)
    x = torch.randn(40, 32).to(torch.bfloat16)
    xs, order, offsets, _ = route(ids.to(DEV), torch.rand(40, 4).to(DEV), x.to(DEV), 8)
    assert offsets.tolist() == [0] * 6 + [160] * 3 and torch.equal(order.cpu(), torch.arange(160))
    assert torch.equal(_bits(xs.cpu()), _bits(x.repeat_interleave(4, 0)))


def test_route_of_no_tokens():
    from kernelplan.kernels.moe_route import route

    empty = torch.empty(0, 2, dtype=torch.int64, device=DEV)
    xs, order, offsets, scale = route(empty, empty.float(), torch.empty(0, 16, device=DEV), 4)
    assert xs.shape == (0, 16) and order.numel() == scale.numel() == 0 and offsets.tolist() == [0] * 5


@pytest.mark.parametrize("weigh", ["inputs", "sigmoid inputs"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_route_weighing_the_inputs_copies_each_row_times_its_weight(dtype, weigh):
    """Each copied row times its pair's weight (Llama-4's MoE scales each token's copy by its router's score, the
    sigmoid of its top logit), rounded to x's dtype as torch's product is; the scattered store's scale is then 1."""
    _check(1, 1, 16, 64, dtype, weigh=weigh)  # Scout's decode: one token, top 1
    _check(37, 2, 8, 200, dtype, seed=1, row_pad=3, weigh=weigh, outside=[((3, 1), 8)], y_width=200)
    _check(300, 1, 128, 96, dtype, seed=2, weigh=weigh)  # Maverick's 128 experts


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_route_on_the_gpu_at_prefill_sizes():
    from kernelplan.kernels import moe_route

    _check(2048, 8, 128, 2048, torch.bfloat16, seed=4, outside=[((5, 1), 128)], y_width=2048)  # 512 chunks: scanned
    _check(4097, 2, 8, 4096, torch.float16, seed=5)
    _check(20000, 8, 256, 256, torch.bfloat16, seed=9, outside=[((17, 3), -1)], y_width=256)  # 5000 chunks
    assert 2048 * 8 // moe_route._B >= moe_route._SCAN_MIN_CHUNKS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the grouped experts kernel needs an sm_90 GPU")
def test_grouped_forward_routes_as_the_per_expert_path():
    """The grouped forward against the same module one GEMM an expert (the path autograd takes), ids outside the
    experts included: at 1 and 33 tokens, and at 2100 (4200 pairs), whose counts the scan launch sums."""
    from kernelplan.kernels import moe_route

    assert 33 * 2 < moe_route._SCAN_MIN_CHUNKS * moe_route._B <= 2100 * 2
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    from kernelplan.nn import Sparse24Experts

    torch.manual_seed(0)
    cfg = MixtralConfig(hidden_size=256, intermediate_size=384, num_local_experts=6)
    dense = MixtralExperts(cfg).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in dense.parameters():
            p.normal_(0, 0.05)
    sparse = Sparse24Experts.from_experts(dense)
    for tokens in (1, 33, 2100):
        x = torch.randn(tokens, 256, device="cuda", dtype=torch.bfloat16)
        weights, index = torch.topk(torch.randn(tokens, 6, device="cuda").softmax(-1), 2, dim=-1)
        index[0, 1] = 6  # the sentinel
        index[-1, 0] = -1
        with torch.no_grad():
            grouped = sparse(x, index, weights)
        loop = sparse(x, index, weights).detach()  # autograd on: one GEMM an expert, torch's routing
        torch.testing.assert_close(grouped, loop, rtol=0, atol=2e-2 * loop.abs().max().item())


def _recorded_routes(monkeypatch):
    """route off the interpreter, each kernel's compile and launches recorded on the host: ``compiles`` gets
    (kernel, arguments as ints, constexprs, warps) for each compile, ``launches`` (kernel, grid, arguments, stream)."""
    from kernelplan.kernels import Launcher, moe_route

    compiles, launches = [], []

    def compiled(self, args, constexprs, **options):
        name = self.fn.__name__
        compiles.append((name, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args), constexprs,
                         options["num_warps"]))
        return lambda grid, ints, stream: launches.append((name, grid, ints, stream))

    monkeypatch.setattr(Launcher, "compiled", compiled)
    for launcher in (moe_route._COUNT, moe_route._SCAN, moe_route._ROUTE):
        monkeypatch.setattr(launcher, "interpreted", False)
    monkeypatch.setattr(moe_route, "raw_stream", lambda index: 7)
    monkeypatch.setattr(moe_route, "_PLANS", {})
    return moe_route.route, compiles, launches


@pytest.mark.parametrize("scanned", [False, True])
def test_a_call_signature_compiles_once_and_each_call_launches_its_own_pointers(monkeypatch, scanned):
    """The second call of a signature binds nothing: its launches are the first's but for the pointers, which are the
    call's own (the outputs it returns, its counts shared by the launches); x at another alignment compiles again."""
    from kernelplan.kernels import moe_route

    if scanned:
        monkeypatch.setattr(moe_route, "_SCAN_MIN_CHUNKS", 1)
    route, compiles, launches = _recorded_routes(monkeypatch)
    kernels = ["_count", "_scan", "_route"] if scanned else ["_count", "_route"]
    reads = []
    for call in range(3):
        g = torch.Generator().manual_seed(call)
        ids, weights = torch.randint(0, 8, (40, 2), generator=g), torch.rand(40, 2, generator=g)
        x = torch.randn(40, 24, dtype=torch.bfloat16)
        y = torch.empty(80, 32, dtype=torch.bfloat16)
        xs, order, offsets, scale = route(ids, weights, x, 8, y)
        reads.append((ids, weights, x, xs, order, offsets, scale, y))
    assert [c[0] for c in compiles] == kernels  # once, at the first call
    assert [launch[0] for launch in launches] == kernels * 3 and {launch[3] for launch in launches} == {7}
    for at, (ids, weights, x, xs, order, offsets, scale, y) in enumerate(reads):
        mine = {launch[0]: launch for launch in launches[at * len(kernels):(at + 1) * len(kernels)]}
        counts = mine["_count"][2][1]
        assert mine["_count"][2][:2] == (ids.data_ptr(), counts)
        if scanned:
            assert mine["_scan"][2][0] == counts
        assert mine["_route"][2][:9] == (ids.data_ptr(), counts, weights.data_ptr(), x.data_ptr(), xs.data_ptr(),
                                         order.data_ptr(), offsets.data_ptr(), scale.data_ptr(), y.data_ptr())
        for name, grid, ints, _ in mine.values():  # the integers and the grid as compiled: a 3-D grid
            compiled = next(c for c in compiles if c[0] == name)
            pointers = 1 if name == "_scan" else 2 if name == "_count" else 9
            assert ints[pointers:] == compiled[1][pointers:] and len(grid) == 3
        if at == 0:  # the first call launches with the pointers it compiled with
            assert all(launch[2] == next(c for c in compiles if c[0] == launch[0])[1] for launch in mine.values())
    assert launches[0][2][2:] == (40 * 2, 8)  # _count: the pairs and the experts after the two pointers
    odd = torch.randn(40, 25, dtype=torch.bfloat16)[:, 1:]  # x 2 bytes past 16-byte alignment
    route(reads[0][0], reads[0][1], odd, 8, reads[0][7])
    assert len(compiles) == 2 * len(kernels)
