// What the 2:4 kernels share from sm_80 on: shared-memory loads (ld.shared, ldmatrix) and cp.async staging.
// Needs common.cuh (u32) first.
#pragma once

__device__ __forceinline__ uint4 lds4(u32 addr) {
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

__device__ __forceinline__ u32 lds1(u32 addr) {
    u32 v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(addr));
    return v;
}

// Four 8 x 8 matrices of 16-bit values: lane 8 q + i gives the address of row i of matrix q (16 bytes), and register
// q gets this lane's pair of matrix q (row lane / 4, columns 2 (lane % 4) and + 1).  Read at `base + 16 lane` from
// the device layout's values (sparse24/layout.py), it is the lane's mma.sp A fragment of one k32.
__device__ __forceinline__ uint4 ldsm4(u32 addr) {
    uint4 v;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(addr));
    return v;
}

// 16 bytes global -> shared; zero-filled where !ok.
__device__ __forceinline__ void cp16(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(ok ? 16 : 0));
}

__device__ __forceinline__ void cp4(u32 dst, const void *src, bool ok) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" :: "r"(dst), "l"(src), "r"(ok ? 4 : 0));
}

template <int PENDING>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;" :: "n"(PENDING)); }
