"""What ``cuda_ws``'s rule knows of a GPU (``kernels/gpu_facts.py``): the clusters it runs at once, which the rule
counts waves by, and its DRAM bandwidth; the model on CPU, the driver's on a GPU (docs/design/0065, 0066)."""

from __future__ import annotations

import dataclasses

import pytest

from helpers import sm90
from kernelplan.bench.shapes import sweep_shapes
from kernelplan.kernels.gpu_facts import PER_SM, SIZES, GpuFacts
from kernelplan.kernels.sparse24_ws_rule import _deepest, grid_ctas, push_pays, resident, ws_config

gpu = pytest.mark.gpu


def _with(size: int, per_sm: int, ctas: int, sms: int = 132) -> GpuFacts:
    """The model of ``sms`` SMs, but clusters of ``size`` place ``ctas`` CTAs at ``per_sm`` an SM."""
    model = GpuFacts.model(sms)
    rows = [list(row) for row in model.ctas]
    rows[SIZES.index(size)][PER_SM.index(per_sm)] = ctas
    return dataclasses.replace(model, ctas=tuple(map(tuple, rows)), source="test")


def test_the_model_is_the_h200s_clusters_scaled_to_the_sms():
    """sparse24-cluster-slots-h200.json at one CTA an SM: 66 clusters of 2, 39 of 3, 30 of 4, 15 of 8."""
    here = GpuFacts.model(132)
    assert [here.at(s) for s in (1, 2, 3, 4, 8)] == [132, 132, 117, 120, 120]
    assert (here.at(1, 3), here.at(3, 3), here.at(4, 2)) == (396, 351, 240)
    assert [GpuFacts.model(78).at(s) for s in (2, 3, 4)] == [78, 69, 70]


@pytest.mark.parametrize("size, per_sm", [(5, 1), (16, 1), (3, 0), (2, 5)])
def test_slots_refuse_the_sizes_and_ctas_an_sm_they_do_not_hold(size, per_sm):
    with pytest.raises(ValueError, match="the slots are known for"):
        GpuFacts.model(132).at(size, per_sm)


@pytest.mark.parametrize("sms", [78, 132])
def test_the_rule_without_slots_is_the_rule_with_the_model(sms):
    for m, k in sweep_shapes():
        for n in (1, 8, 16, 32, 128, 1024):
            assert ws_config(n, m, k, sms) == ws_config(n, m, k, sms, gpu=GpuFacts.model(sms)), (m, k, n)


def test_the_rule_refuses_facts_of_another_sm_count():
    """The waves would count one GPU's SMs and another's cluster slots."""
    with pytest.raises(ValueError, match="sms = 132, but the GPU facts given are of a GPU of 78 SMs"):
        ws_config.__wrapped__(64, 4096, 4096, 132, gpu=GpuFacts.model(78))


def test_the_rule_counts_waves_by_the_slots_it_is_given():
    """4608 rows at n = 8: 36 clusters of 3 (108 CTAs) fit the model's 117 SMs in one wave; on a chip whose clusters
    of 3 place on 105 SMs they take two, and the rule keeps the split over 2 (72 CTAs)."""
    model = ws_config(8, 4608, 4096, 132)
    assert (model.kc, grid_ctas(model, 8, 4608, 132)) == (3, 108)
    fewer = ws_config(8, 4608, 4096, 132, gpu=_with(3, 1, 105))
    assert (fewer.kc, grid_ctas(fewer, 8, 4608, 132)) == (2, 72)


def test_the_push_pays_by_the_slots_it_is_given():
    """4096x14336 at n = 16: 64 clusters of 4 of 64 x 32 fit one wave at three CTAs an SM (360) and not at two, with
    the pushed sums' buffer (240 in the model); where two an SM place 256, the push pays (docs/design/0050)."""
    tile = _deepest(32, 1, 1, 4)
    assert resident(tile) == 2 and not push_pays(tile, 16, 4096, 132)
    assert push_pays(tile, 16, 4096, 132, _with(4, 2, 256))


def test_the_ws_kernel_picks_with_its_devices_slots(monkeypatch):
    """On a device the rule counts the driver's slots, not the model's (WsKernel.config)."""
    import kernelplan.kernels.sparse24_ws as ws

    monkeypatch.setattr(ws, "sm_count", lambda index: 132)
    monkeypatch.setattr(ws, "device_facts", lambda index: _with(3, 1, 105))
    assert ws.WsKernel().config(8, 4608, 4096, 0).kc == 2
    monkeypatch.setattr(ws, "device_facts", lambda index: GpuFacts.model(132))
    assert ws.WsKernel().config(8, 4608, 4096, 0).kc == 3


@gpu
@sm90
def test_the_probes_slots_are_the_ws_kernels_own():
    """The empty probe kernel, at the CTAs an SM a tile holds, places as many clusters as the tile's compiled kernel
    (``cuOccupancyMaxActiveClusters`` of each), for the K splits over 2, 3, 4 and 8 of one and two 64-row blocks."""
    import torch

    from kernelplan.kernels.gpu_facts import device_facts, max_active_clusters
    from kernelplan.kernels.sparse24_ws import WsKernel
    from kernelplan.kernels.sparse24_ws_rule import with_push

    slots, sms = device_facts(0), torch.cuda.get_device_properties(0).multi_processor_count
    assert slots.source == "driver" and slots.sms == sms
    for size in SIZES:
        row = [slots.at(size, r) for r in PER_SM]
        assert row == sorted(row) and 0 < row[0] <= sms and all(c % size == 0 for c in row), (size, row)
    for bn, kc in ((16, 2), (24, 3), (32, 4), (64, 8)):
        for wm in (1, 2):
            cfg = with_push(_deepest(bn, wm, 1, kc), 8, 4096, sms)
            launch, grid = WsKernel().launch_config(cfg, 8, 4096, "bf16", False, None, 0)
            kernel = kc * max_active_clusters(launch.function, grid, cfg.threads, launch.shared)
            assert kernel == slots.at(kc, resident(cfg)), (cfg, kernel, slots.at(kc, resident(cfg)))


@gpu
@sm90
def test_the_ws_kernel_on_a_gpu_picks_with_the_drivers_slots():
    import torch

    from kernelplan.kernels.gpu_facts import device_facts
    from kernelplan.kernels.sparse24_ws import WsKernel

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for n, m, k in ((8, 4608, 4096), (16, 3584, 3584), (8, 5120, 4096), (256, 4096, 14336)):
        assert WsKernel().config(n, m, k, 0) == ws_config(n, m, k, sms, gpu=device_facts(0))
