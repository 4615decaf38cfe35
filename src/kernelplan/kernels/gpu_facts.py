"""What ``cuda_ws``'s tile rule (``sparse24_ws``) knows of a GPU beyond its SM count: the CTAs it runs at once in
thread-block clusters, and its DRAM bandwidth.

A cluster's CTAs are placed inside one GPC, and a GPC's SMs are not a multiple of every cluster size, so clusters of
3 or 4 CTAs fill fewer than all SMs: on an H200 of 132 SMs, 39 clusters of 3 (117 SMs) and 30 of 4 (120) at one CTA
an SM (bench/results/sparse24-cluster-slots-h200.json, docs/design/0063).  Which TPCs are fused off varies from chip
to chip, so on a device the counts are the driver's: ``cuOccupancyMaxActiveClusters`` over an empty kernel
(``cuda/cluster_probe.cu``) whose dynamic shared memory lets 1-4 CTAs share an SM, asked once a device
(``device_facts``, docs/design/0065).  The DRAM bandwidth, the driver's memory clock and bus width, sets the bytes a
grid must keep in flight to stream a weight (``sparse24_ws_rule.with_ring``, docs/design/0066).  ``GpuFacts.model`` is
the rule's estimate where no device is asked: the tables, tools and tests on CPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..errors import KernelPlanError

SIZES = (2, 3, 4, 8)  # the cluster sizes the 2:4 tiles launch (cm x kc: sparse24_ws_rule.ws_candidates)
PER_SM = (1, 2, 3, 4)  # CTAs an SM holds at once, as its shared memory allows (sparse24_ws_rule.resident)
# The SMs of 132 that clusters of 3, and of 4 or more, place on at one CTA an SM (an H200, sparse24-cluster-slots-
# h200.json): ``model`` scales them to other SM counts.
_MODEL_OF_132 = {2: 132, 3: 117, 4: 120, 8: 120}
# An H200's DRAM bytes a second (3201 MHz, 6016 bits, two transfers a clock: sparse24-cluster-slots-h200.json's gpu
# record), an SM's share of which ``model`` gives each SM.
_MODEL_DRAM_OF_132 = 3_201_000e3 * 6016 * 2 / 8


@dataclass(frozen=True)
class GpuFacts:
    """CTAs resident at once in clusters of each of ``SIZES``, at each of ``PER_SM`` CTAs an SM; DRAM bandwidth."""

    sms: int
    ctas: tuple[tuple[int, ...], ...]  # ctas[SIZES.index(size)][PER_SM.index(per_sm)]
    dram_bytes_per_s: float
    source: str  # "driver" (asked of a device) or "model"

    def at(self, size: int, per_sm: int = 1) -> int:
        """CTAs that clusters of ``size`` CTAs, ``per_sm`` of them an SM, run at once: a grid's wave."""
        if per_sm not in PER_SM:
            raise ValueError(f"per_sm = {per_sm}: the slots are known for {PER_SM} CTAs an SM")
        if size == 1:
            return self.sms * per_sm
        if size not in SIZES:
            raise ValueError(f"size = {size}: the slots are known for clusters of 1 and {SIZES} CTAs")
        return self.ctas[SIZES.index(size)][PER_SM.index(per_sm)]

    @classmethod
    def model(cls, sms: int) -> "GpuFacts":
        """The rule's estimate for a GPU of ``sms`` SMs that no one asked: the H200's cluster SMs at one CTA an SM,
        scaled to ``sms``, times the CTAs an SM holds; the H200's DRAM bandwidth an SM."""
        ctas = tuple(tuple(r * (sms * _MODEL_OF_132[s] // 132) for r in PER_SM) for s in SIZES)
        return cls(sms, ctas, _MODEL_DRAM_OF_132 * sms / 132, "model")

    def to_json(self) -> dict:
        return {"sms": self.sms, "source": self.source, "dram_bytes_per_s": self.dram_bytes_per_s,
                "ctas": {str(s): dict(zip(map(str, PER_SM), row)) for s, row in zip(SIZES, self.ctas)}}


@functools.lru_cache(maxsize=64)
def model_facts(sms: int) -> GpuFacts:
    """``GpuFacts.model(sms)``, made once an SM count (the rule asks it for every tile it weighs)."""
    return GpuFacts.model(sms)


def max_active_clusters(fn, grid: tuple, threads: int, shared: int, cluster: int | None = None) -> int:
    """The driver's count of clusters of kernel ``fn`` resident at once (``cuOccupancyMaxActiveClusters``), launched
    as ``grid`` of ``threads`` with ``shared`` bytes of dynamic shared memory; ``cluster``: the CTAs a cluster along
    x, where the kernel does not fix them itself (``__cluster_dims__``)."""
    from cuda.bindings import driver as cu

    config = cu.CUlaunchConfig()
    config.gridDimX, config.gridDimY, config.gridDimZ = grid
    config.blockDimX, config.blockDimY, config.blockDimZ = threads, 1, 1
    config.sharedMemBytes = shared
    config.numAttrs = 0
    if cluster is not None:
        attribute = cu.CUlaunchAttribute()
        attribute.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
        attribute.value.clusterDim.x, attribute.value.clusterDim.y, attribute.value.clusterDim.z = cluster, 1, 1
        config.attrs, config.numAttrs = [attribute], 1
    err, clusters = cu.cuOccupancyMaxActiveClusters(fn, config)
    if err:
        raise KernelPlanError(f"cuOccupancyMaxActiveClusters (grid {grid}, {threads} threads, {shared} bytes of shared "
                              f"memory, clusters of {cluster or 'the kernel'}) failed: {err.name}")
    return clusters


@functools.lru_cache(maxsize=None)
def device_facts(device_index: int) -> GpuFacts:
    """The driver's ``GpuFacts`` of CUDA device ``device_index`` (sm_90 and later: clusters are Hopper's)."""
    from cuda.bindings import driver as cu

    from . import on_device
    from .nvrtc import cuda_source, device_attribute, function

    sms = device_attribute(device_index, "MULTIPROCESSOR_COUNT")
    per_sm_bytes = device_attribute(device_index, "MAX_SHARED_MEMORY_PER_MULTIPROCESSOR")
    reserved = device_attribute(device_index, "RESERVED_SHARED_MEMORY_PER_BLOCK")
    dram = device_attribute(device_index, "MEMORY_CLOCK_RATE") * 1e3 * device_attribute(
        device_index, "GLOBAL_MEMORY_BUS_WIDTH") * 2 / 8  # kHz, bits: two transfers a clock
    fn = function(cuda_source("cluster_probe.cu"), "kp_cluster_probe", device_index)
    largest = per_sm_bytes - reserved
    with on_device(device_index):  # the probe's function belongs to that device's context
        err, = cu.cuFuncSetAttribute(fn, cu.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                                     largest)
        if err:
            raise KernelPlanError(f"the cluster probe cannot have {largest} bytes of shared memory on "
                                  f"cuda:{device_index}: {err.name}")
        # per_sm CTAs of this much shared memory fit an SM, per_sm + 1 do not
        ctas = tuple(tuple(size * max_active_clusters(fn, (size * sms, 1, 1), 128, per_sm_bytes // per_sm - reserved,
                                                      size) for per_sm in PER_SM) for size in SIZES)
    return GpuFacts(sms, ctas, dram, "driver")
