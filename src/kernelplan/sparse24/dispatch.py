"""Which 2:4 kernel runs a problem: a rule you can read, from (GPU, M, K, n, dtype, epilogue); no timing.

Two memory policies (``GemmSparse24Descriptor.memory``):

* ``"compact"`` (the default): only kernels of the one device layout, ``sp tiled``
  (``kernels/sparse24_sp.py``, 0.5625x of the dense bytes), chosen by ``backend_for``.
  No call tunes, and no weight gets a second layout.
* ``"fast"``: every backend is a candidate, each with its own layout (a dense copy,
  cuSPARSELt's buffer, ``cuda_mma``'s tiles), and the first call of each N bucket
  times them (``backends.tune``).  Speed over memory: up to 3.3x of the dense bytes
  per weight were measured in v1 (docs/design/0001).

The measurements behind the rule: ``bench/results/sparse24-ws-tiles-h100.json``
(the warp-specialized ``wgmma.sp`` tiles, from which ``kernels/sparse24_ws.py``'s
``ws_config`` is fitted) and ``bench/results/sparse24-sweep-h100.json`` (the kernels
of the layout against dense over the sweep set); docs/design/0002-0005 say what
they showed.
"""

from __future__ import annotations

MEMORY_POLICIES = ("compact", "fast")
LAYOUT_DTYPES = ("f16", "bf16")  # the sparse tensor cores' operand types

# mma.sp for n up to here on Hopper: at n <= 16 it ran the sweep set at a median 1.61x of dense on an
# H100, wgmma.sp's 64-row instruction at 1.44x (docs/design/0002); past 16 the warpgroup kernel's wider
# N tiles win (1.13-1.90x at n = 32-64 on the large sweep shapes, sparse24-wg-tiles-h100.json).
SP_MAX_N_HOPPER = 16


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


def backend_for(capability: tuple[int, int] | None, n: int, k: int, dtype: str) -> str:
    """The backend of the ``compact`` policy for one call: a pure function, no GPU touched.

    * the one layout where its kernels run: ``cuda_ws`` (``wgmma.sp``, warp-specialized) on Hopper
      past n = 16, else ``cuda_sp`` (``mma.sp``; on Ampere and Ada at every n,
      in chunks of 64 rows of x past 64);
    * else the Triton kernel on CUDA, which reads the public format itself
      (f32 weights, K not a multiple of 64), and the reference on CPU.

    The epilogue (bias, activation) is fused by every one of them and does not
    change the choice.  M does not either: the tile within the kernel depends on
    it (``config_for``), not the kernel.
    """
    if capability is None:
        return "reference"
    if layout_reason(capability, k, dtype) is None:
        return "cuda_ws" if capability == (9, 0) and n > SP_MAX_N_HOPPER else "cuda_sp"
    return "triton"


def config_for(backend: str, n: int, m: int, k: int, sms: int):
    """The tile configuration ``backend`` runs (n, M, K) with on a GPU of ``sms`` SMs: the kernels' own rules."""
    if backend == "cuda_ws":
        from ..kernels.sparse24_ws import ws_config

        return ws_config(n, m, k, sms)
    if backend == "cuda_wg":
        from ..kernels.sparse24_wg import wg_config

        return wg_config(n, m, k, sms)
    if backend == "cuda_sp":
        from ..kernels.sparse24_sp import MAX_N, sp_config

        return sp_config(min(n, MAX_N), m, k, sms)
    raise ValueError(f"backend {backend!r} has no tile rule here; its kernel module chooses")
