// An empty kernel that the driver's occupancy query places in clusters (kernels/gpu_facts.py): the cluster
// size comes from the query's launch attribute, the CTAs an SM holds from its dynamic shared memory.
extern "C" __global__ void kp_cluster_probe() {}
