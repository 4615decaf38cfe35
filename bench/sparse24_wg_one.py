"""One launch of one ``wgmma.sp`` tile, for a profiler: ``ncu python bench/sparse24_wg_one.py M K N 'WgConfig(...)'``."""

from __future__ import annotations

import sys

import torch

from kernelplan.kernels import raw_stream
from kernelplan.kernels.sparse24_sp import _tiled
from kernelplan.kernels.sparse24_wg import WgConfig, WgKernel  # noqa: F401  (WgConfig: eval of the argument)
from kernelplan.sparse24 import compress, prune


def main() -> int:
    m, k, n = map(int, sys.argv[1:4])
    cfg = eval(sys.argv[4])  # a WgConfig(...) as the tiles bench prints it
    w24 = compress(prune(torch.randn(m, k, device="cuda")).bfloat16())
    pairs, codes = _tiled(w24.values, w24.metadata)
    x = torch.randn(n, k, device="cuda").bfloat16()
    y = torch.empty(n, m, device="cuda").bfloat16()
    launch, grid = WgKernel().launch_config(cfg, n, m, "bf16", False, None, 0)
    for _ in range(3):
        launch(grid, (x.data_ptr(), pairs.data_ptr(), codes.data_ptr(), 0, y.data_ptr(), n, m, k, k, m), raw_stream(0))
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    sys.exit(main())
