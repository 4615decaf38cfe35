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
``-h200.json`` (the warp-specialized ``wgmma.sp`` tiles, from which ``kernels/sparse24_ws.py``'s
``ws_config`` is fitted by ``tools/fit_ws_rule.py``) and ``bench/results/sparse24-sweep-h100.json`` (the kernels
of the layout against dense over the sweep set); docs/design/0002-0005 say what
they showed.
"""

from __future__ import annotations

MEMORY_POLICIES = ("compact", "fast")
LAYOUT_DTYPES = ("f16", "bf16")  # the sparse tensor cores' operand types

# Hopper at n <= SP_MAX_N_HOPPER: mma.sp (cuda_sp) only for tall weights, M >= SP_MIN_M_HOPPER; else
# cuda_ws.  From the sweeps at n = 1 and 16 (sparse24-sweep-h100.json at 3b1d11c, sparse24-sweep-h200.json at
# 509782c, 43 shapes each): cuda_sp took 0.85-0.98x of cuda_ws's time on the weights of 9216 rows and more, on both
# GPUs, and 1.1-1.7x on nearly every shorter one (768-1024-wide layers: 1.1-1.7x; 3584x3584: 1.23-1.68x); below
# 9216 rows it won by more than 5% on 2 of 68 rows (H100: 8192x4608 n = 1, 0.92x; 6144x4096 n = 1, 0.96x), on the
# H200 on none.  Past n = 16 the warpgroup kernel's wider N tiles win everywhere (docs/design/0005).
SP_MAX_N_HOPPER = 16
SP_MIN_M_HOPPER = 9216


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
    if capability < (8, 0):
        return f"compute capability {capability[0]}.{capability[1]}: mma.sp needs 8.0 or newer"
    if dtype not in LAYOUT_DTYPES:
        return f"dtype {dtype}: the sparse tensor cores take {' and '.join(LAYOUT_DTYPES)}"
    if k % 64:
        return f"K = {k} is not a multiple of 64, the layout's column step"
    return None


def backend_for(capability: tuple[int, int] | None, n: int, m: int, k: int, dtype: str) -> str:
    """The backend of the ``compact`` policy for one call: a pure function, no GPU touched.

    * the one layout where its kernels run: ``cuda_ws`` (``wgmma.sp``, warp-specialized) on Hopper,
      except at n <= 16 on weights of 9216 rows or more; else ``cuda_sp``
      (``mma.sp``; on Ampere and Ada at every n, in chunks of 64 rows of x past 64);
    * else the Triton kernel on CUDA, which reads the public format itself
      (f32 weights, K not a multiple of 64), and the reference on CPU.

    The epilogue (bias, activation) is fused by every one of them and does not
    change the choice.  The tile within the kernel is the kernel's own rule
    (``config_for``).
    """
    if capability is None:
        return "reference"
    if layout_reason(capability, k, dtype) is None:
        if capability == (9, 0):
            return "cuda_sp" if n <= SP_MAX_N_HOPPER and m >= SP_MIN_M_HOPPER else "cuda_ws"
        return "cuda_sp"
    return "triton"


def config_for(backend: str, n: int, m: int, k: int, sms: int, gated: bool = False):
    """The tile configuration ``backend`` runs (n, M, K) with on a GPU of ``sms`` SMs: the kernels' own rules.
    ``gated``: under a gated epilogue, which ``cuda_ws`` runs on fewer tiles (``gated_tile``); ``cuda_sp``'s are
    all gated-capable."""
    if backend == "cuda_ws":
        from ..kernels.sparse24_ws import ws_config

        return ws_config(n, m, k, sms, gated)
    if backend == "cuda_wg":
        from ..kernels.sparse24_wg import wg_config

        return wg_config(n, m, k, sms)
    if backend == "cuda_sp":
        from ..kernels.sparse24_sp import MAX_N, sp_config

        return sp_config(min(n, MAX_N), m, k, sms)
    raise ValueError(f"backend {backend!r} has no tile rule here; its kernel module chooses")
