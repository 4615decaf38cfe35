// What every 2:4 CUDA C++ kernel shares: types, dtype conversion, the activations.
// Needs the variant's #defines IS_BF16, DT, ACT, GATED and the ACT_* codes (kernels/sparse24_mma.py, defines).
#pragma once
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float to_f32(u16 v) {
#if IS_BF16
    return __uint_as_float(((u32)v) << 16);
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
#endif
}

__device__ __forceinline__ u16 from_f32(float v) {
    u16 h; asm("cvt.rn." DT ".f32 %0, %1;" : "=h"(h) : "f"(v)); return h;
}

// The first of K's `ksteps` 64-column steps that slice z of `parts` runs; slice z runs up to the next slice's first.
// The slices' lengths are at most one apart where `parts` does not divide `ksteps` (sparse24_ws.k_slices, its
// Python twin): cuda_ws splits K over a cluster's CTAs by it, cuda_sp over a CTA's warps.
__device__ __forceinline__ int k_slice_begin(int ksteps, int z, int parts) { return ksteps * z / parts; }

// erfc(x) for x >= 0 as t exp(-x^2 + P(t)), t = 1 / (1 + x / 2), P of degree 5: the fit the Triton kernels take for
// 16-bit results (kernels/activations.py, _normal_cdf), fractional error under 6.4e-5, and the outputs here are 16-bit.
// With the fast exponential and division, gelu's relative error is under 7e-5 over z in [-12, 12] (emulated in fp32
// with these constants on the CPU: tests/test_cuda_sources.py), 1/7 of f16's rounding.  CUDA's erfcf took the erf
// GELU epilogue to 0.68-0.95x of the plain GEMM then a separate F.gelu at n >= 256 (sparse24-activated-h100.json at
// 904d322): about 40 dependent instructions an element, run after the K loop by the consumer warpgroups alone
// (docs/design/0026).
__device__ __forceinline__ float erfc_nonneg(float x) {
    const float t = __fdividef(1.f, fmaf(0.5f, x, 1.f));
    float p = fmaf(t, 0.188243911f, -0.591878194f);
    p = fmaf(p, t, 0.348378325f);
    p = fmaf(p, t, 0.316067287f);
    p = fmaf(p, t, 1.004743856f);
    p = fmaf(p, t, -1.265576611f);
    return t * __expf(fmaf(-x, x, p));
}

// kernelplan.activations, in fp32: gelu by erfc (of -z / sqrt 2, direct where it is positive: the left tail keeps
// its relative accuracy), gelu_tanh as z * sigmoid(2u) (accurate in the left tail).  The logistic ones by the fast
// exponential and division (__expf, __fdividef: relative errors near 1e-6, under the 16-bit output's rounding),
// which took the gated epilogue's SwiGLU from about 20 instructions an element to a few: the epilogue runs after
// the K loop, beside no MMA, in sparse24_ws.cu (docs/design/0025).  Past z = -87 exp(-z) is infinite and
// __fdividef gives 0, the limit.
__device__ __forceinline__ float activate(float z) {
#if ACT == ACT_IDENTITY
    return z;
#elif ACT == ACT_RELU
    return z > 0.f ? z : 0.f;
#elif ACT == ACT_GELU
    const float x = -z * 0.70710678118654752f, e = erfc_nonneg(fabsf(x));
    return z * 0.5f * (x >= 0.f ? e : 2.f - e);
#elif ACT == ACT_GELU_TANH
    float u = 0.79788456080286536f * (z + 0.044715f * z * z * z);
    return __fdividef(z, 1.f + __expf(-2.f * u));
#elif ACT == ACT_SILU
    return __fdividef(z, 1.f + __expf(-z));
#elif ACT == ACT_SIGMOID
    return __fdividef(1.f, 1.f + __expf(-z));
#elif ACT == ACT_QUICK_GELU
    return __fdividef(z, 1.f + __expf(-1.702f * z));
#else
#error "an activation with no CUDA form here"
#endif
}

// Gated: a column of y from its sums of W's rows c (first) and M / 2 + c (second): the gate's act times the other,
// the gate being the half GATED names (1: first, 2: second; kernelplan.gated_activation's gate=).
__device__ __forceinline__ float gate2(float first, float second) {
#if GATED == 2
    return activate(second) * first;
#else
    return activate(first) * second;
#endif
}

// A column of y from its sums: act(z) of one (v[0]); gated, of W's two halves (v[0], v[1]: gate2).
template <int R>
__device__ __forceinline__ float epilogue(const float (&v)[R][8], int j) {
    if constexpr (R == 1) {
        return activate(v[0][j]);
    } else {
        return gate2(v[0][j], v[1][j]);
    }
}
