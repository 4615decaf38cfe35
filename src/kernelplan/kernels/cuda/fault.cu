// A kernel that writes where no allocation is: the device worker's fault drill (runtime FaultRequest
// "illegal_address").  The launch fails with CUDA_ERROR_ILLEGAL_ADDRESS, which poisons the context for good.
extern "C" __global__ void kp_write_out_of_bounds(int *p) { p[threadIdx.x] = 1; }
