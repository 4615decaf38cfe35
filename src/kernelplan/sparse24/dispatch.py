"""Which 2:4 kernel runs a problem: a rule you can read, from (GPU, M, K, n, dtype, epilogue); no timing.

Two memory policies (``GemmSparse24Descriptor.memory``):

* ``"compact"`` (the default): only kernels of the one device layout, ``sp tiled``
  (``kernels/sparse24_sp.py``, 0.5625x of the dense bytes), chosen by ``backend_for``.
  No call tunes, and no weight gets a second layout.
* ``"fast"``: every backend is a candidate, each with its own layout (a dense copy,
  cuSPARSELt's buffer, ``cuda_mma``'s tiles), and the first call of each N bucket
  times them (``tuning.tune``).  Speed over memory: up to 3.3x of the dense bytes
  per weight were measured in v1 (docs/design/0001).

The measurements behind the rule: ``bench/results/sparse24-ws-tiles-h100.json`` and
``-h200.json`` (the warp-specialized ``wgmma.sp`` tiles, from which ``kernels/sparse24_ws_rule.py``'s
``ws_config`` is fitted by ``tools/fit_ws_rule.py``) and ``bench/results/sparse24-sweep-h100.json`` (the kernels
of the layout against dense over the sweep set); docs/design/0002-0005 say what
they showed.
"""

from __future__ import annotations

from .layout import padded_k

MEMORY_POLICIES = ("compact", "fast")
LAYOUT_DTYPES = ("f16", "bf16")  # the sparse tensor cores' operand types

# What the layout's kernels need of a GPU.  mma.sp (cuda_sp, cuda_mma) is sm_80's and later's.  wgmma.sp, the copy
# engine's tensor maps and clusters (cuda_ws, cuda_wg, the grouped experts' kernel) are compiled for sm_90a, whose
# arch-specific instructions run on compute capability 9.0 alone, not on later GPUs.
MMA_SP_CAPABILITY = (8, 0)
SM90A_CAPABILITY = (9, 0)


def runs_mma_sp(capability: tuple[int, int]) -> bool:
    """Whether a GPU of ``capability`` runs ``mma.sp`` (the sparse tensor cores of sm_80 and later)."""
    return capability >= MMA_SP_CAPABILITY


def runs_sm90a(capability: tuple[int, int] | None) -> bool:
    """Whether a GPU of ``capability`` runs sm_90a code (``wgmma.sp``, tensor maps, clusters): 9.0 alone."""
    return capability == SM90A_CAPABILITY

# Hopper at n <= SP_MAX_N_HOPPER: mma.sp (cuda_sp) for tall weights, M >= SP_MIN_M_HOPPER (and K >= SP_TALL_MIN_K,
# below), and for wide ones of few rows, K >= SP_WIDE_K_OVER_M x M with M <= SP_WIDE_MAX_M; else cuda_ws.  From
# every cuda_sp tile and cuda_ws's first 4 timed over the sweep set at n = 1, 8 and 16 in one process each
# (sparse24-small-n-h{100,200}.json, 6365b46; docs/design/0042), with cuda_sp's tile by sp_config's rule for n <= 16:
# * at n = 16 cuda_ws won on 36 (H100) and 39 (H200) of 43 shapes, by up to 1.42x; cuda_sp by 1.07x at most;
# * at n <= 8 on the tall weights cuda_sp ran 0.97-1.11x of cuda_ws's speed on the H200, 0.95-1.04x on the H100;
# * at n <= 8 on wide weights of few rows, whose 64-row warpgroup tiles fill under half of the SMs (M <= 4096 is 64
#   CTAs or fewer) over a long K, cuda_sp's K slices won by 1.04-1.25x (768x3072, 3072x8192, 3584x14336,
#   4096x14336, 3584x18944); 1024x4096 went 1.06x faster on the H100 and 1.05x slower on the H200.
# Over the 129 rows, against the boundary before (M >= 9216 at n <= 16, the older sp tile rule), the time
# went to 0.986x (H100) and 0.986x (H200) of it, geometric mean.
#
# Past that table, wide weights at n <= 16 got a cuda_ws tile of their own (ws_config: K split over a cluster of 4
# CTAs), which beat cuda_sp at n <= 8 on those of 1024 rows or fewer, by 1.01-1.25x (H100) and 1.20-1.48x (H200),
# and ran 0.87-1.00x (H100) and 0.69-1.00x (H200) of its speed on those of 3072 to 4096 rows
# (sparse24-small-n-wide-split-h{100,200}.json, b69c688; docs/design/0047).  Since the rule also weighs that split
# with two 64-row blocks of W a CTA (docs/design/0061), cuda_ws beat cuda_sp at n <= 8 on 3072x8192 (1.15x) and the
# held-out 2304x9216 and 2560x10240 (1.22-1.28x), and ran 0.96-1.03x of it on 3584x18944 and 0.94x on 4096x14336
# (sparse24-small-n-split-wm-h200.json, -held-out-h200.json, fa624d0): cuda_sp keeps the wide weights of more than
# SP_WIDE_MIN_M rows, where that tile's grid, 4 CTAs a 128 rows, passes the 120 SMs that clusters of 4 place on.
#
# Tall weights take cuda_sp only where K is over SP_TALL_MIN_K: read from the sweeps, which time both backends'
# rule tiles side by side (docs/design/0060; tools/fit_backend_rule.py reads them).  On the sweep set's tall weights
# at n <= 8, cuda_sp was faster by a geometric mean of 1.05-1.08x (by n and dtype) where K is 4608-8192, and ran
# 0.98-1.00x of cuda_ws where K is 3072-4096 (H200, 1662b90).  With cuda_ws at K <= 4096 the 10 moved rows of the
# sweep set ran 1.011x (bf16) and 1.012x (f16) faster on the H200 at 1662b90, 0.998x at 22b6c20, 1.026x and 1.020x
# on the H100 (dcb9e08, d3d2493); the held-out models' 14, tall weights of K 896-2560 the sweep set does not have,
# 1.077x (up to 1.27x; 69a1c17), and read again under the bound, 1.065x against dense (bfa4f0a).
SP_MAX_N_HOPPER = 8
SP_MIN_M_HOPPER = 9216
SP_TALL_MIN_K = 4160  # K past 4096, in 64-column steps
SP_WIDE_MIN_M = 3840
SP_WIDE_MAX_M = 4096
SP_WIDE_K_OVER_M = 2.5


def wide_weight(m: int, k: int) -> bool:
    """A weight of few rows over a long K (K >= 2.5 M, M <= 4096): the down projections of the sweep set's MLPs and
    BERT / GPT-2's, whose row tiles alone fill under half of the SMs."""
    return m <= SP_WIDE_MAX_M and k >= SP_WIDE_K_OVER_M * m


# The kernels' rules read n only through the tiles of x it makes, and every tile of x they weigh is a multiple of
# N_GRAIN rows (cuda_ws: 16 to 256 in steps of 16; cuda_sp: 8, 16, 32 and 64), as is SP_MAX_N_HOPPER.  So over each
# run n = 8 j + 1 ... 8 j + 8 the backend and its tile stay the same (tests/test_sparse24_dispatch.py checks it).
N_GRAIN = 8


def rule_points(n_max: int) -> list[int]:
    """One n of each run of n in 1 ... n_max over which ``backend_for`` and ``config_for`` pick one kernel and tile:
    every multiple of ``N_GRAIN`` below n_max, and n_max.  What ``kp.warmup`` compiles so that no n up to n_max
    compiles at its first call."""
    return [*range(N_GRAIN, n_max, N_GRAIN), n_max]


def layout_reason(capability: tuple[int, int] | None, k: int, dtype: str) -> str | None:
    """Why the one device layout's kernels cannot run a weight, or None if they can."""
    if capability is None:
        return "the device is not a CUDA GPU: the layout's kernels are CUDA C++"
    if not runs_mma_sp(capability):
        return f"compute capability {capability[0]}.{capability[1]}: mma.sp needs 8.0 or newer"
    if dtype not in LAYOUT_DTYPES:
        return f"dtype {dtype}: the sparse tensor cores take {' and '.join(LAYOUT_DTYPES)}"
    return None  # a K not a multiple of 64 is held padded (layout.padded_k)


def backend_for(capability: tuple[int, int] | None, n: int, m: int, k: int, dtype: str) -> str:
    """The backend of the ``compact`` policy for one call: a pure function, no GPU touched.

    * the one layout where its kernels run: ``cuda_ws`` (``wgmma.sp``, warp-specialized) on Hopper,
      except at n <= 8 on weights of 9216 rows or more and K over 4096, or on wide ones (``wide_weight``) of more
      than 3840 rows; else ``cuda_sp``
      (``mma.sp``; on Ampere and Ada at every n, in chunks of 64 rows of x past 64);
    * else the Triton kernel on CUDA, which reads the public format itself
      (f32 weights), and the reference on CPU.

    The epilogue (bias, activation) is fused by every one of them and does not
    change the choice.  The tile within the kernel is the kernel's own rule
    (``config_for``).
    """
    if capability is None:
        return "reference"
    if layout_reason(capability, k, dtype) is None:
        k = padded_k(k)  # the kernels run the layout's K
        if runs_sm90a(capability):
            tall = m >= SP_MIN_M_HOPPER and k >= SP_TALL_MIN_K
            sp = n <= SP_MAX_N_HOPPER and (tall or m > SP_WIDE_MIN_M and wide_weight(m, k))
            return "cuda_sp" if sp else "cuda_ws"
        return "cuda_sp"
    return "triton"


def config_for(backend: str, n: int, m: int, k: int, sms: int, gated: bool = False, gpu=None):
    """The tile configuration ``backend`` runs (n, M, K) with on a GPU of ``sms`` SMs: the kernels' own rules.
    ``gated``: under a gated epilogue, which ``cuda_ws`` runs on fewer tiles (``gated_tile``); ``cuda_sp``'s are
    all gated-capable.  ``gpu``: what ``cuda_ws``'s rule reads of the GPU (``kernels.gpu_facts``); None, the model
    of a GPU of ``sms`` SMs.  A K not a multiple of 64 is the layout's padded K (``layout.padded_k``)."""
    k = padded_k(k)
    if backend == "cuda_ws":
        from ..kernels.sparse24_ws_rule import ws_config

        return ws_config(n, m, k, sms, gated, gpu=gpu)
    if backend == "cuda_wg":
        from ..kernels.sparse24_wg import wg_config

        return wg_config(n, m, k, sms)
    if backend == "cuda_sp":
        from ..kernels.sparse24_sp import MAX_N, sp_config

        return sp_config(min(n, MAX_N), m, k, sms)
    raise ValueError(f"backend {backend!r} has no tile rule here; its kernel module chooses")
