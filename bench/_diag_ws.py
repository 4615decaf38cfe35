import torch
from cuda.bindings import driver as cu
from kernelplan.kernels.sparse24_ws import WsConfig, _launcher, _deepest
torch.cuda.init()
for (bn, wm, cm, kc) in [(256,2,1,1),(256,2,2,1),(256,2,4,1),(256,2,1,2),(256,1,2,1),(128,2,2,1),(256,2,2,2)]:
    cfg = _deepest(bn, wm, cm, kc)
    launch = _launcher(cfg, "bf16", False, None, 0)
    conf = cu.CUlaunchConfig()
    conf.gridDimX, conf.gridDimY, conf.gridDimZ = 16, 64, kc
    conf.blockDimX, conf.blockDimY, conf.blockDimZ = cfg.threads, 1, 1
    conf.sharedMemBytes = cfg.shared
    attr = cu.CUlaunchAttribute()
    attr.id = cu.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION
    attr.value.clusterDim.x, attr.value.clusterDim.y, attr.value.clusterDim.z = 1, cm, kc
    conf.attrs = [attr] if cm * kc > 1 else []
    conf.numAttrs = len(conf.attrs)
    err, n = cu.cuOccupancyMaxActiveClusters(launch.function, conf)
    print(cfg, "max active clusters", err, n, "CTAs", n * cm * kc if not err else None)
