// Scaled sign with fused error feedback, and its decoder: reference.sign_compress
// and reference.sign_decompress.
//
// Per block of `block` elements, scale = mean |y| (y = x + residual), one bit per
// element (1 where y >= 0, so -0 gives 1 and NaN 0), residual <- y - (+-scale),
// zero where that is not finite. Bits are packed 8 a byte, element i in byte
// i / 8 at bit i % 8: a warp ballot over 32 consecutive elements gives 4 bytes.
//
// The block sum behind the scale is added in fp64 in a fixed order and rounded
// once, so it is deterministic and within an ulp or two of any fp32 order torch
// may use; signs depend on y only and are bit-exact.
//
// When `block` is a multiple of 8 every byte of signs lies inside one block, and
// sign_compress_* does everything in one kernel: one CUDA block per sign block,
// first the sum, then the bits and the residual (the second read of the block
// comes from L2). Otherwise sign_scales_* writes the scales and sign_encode_*
// the bits and residuals, element-wise.

#include "common.cuh"

namespace gradcomp {

constexpr int SIGN_MAX_THREADS = 256;

// mean |y| over [start, end), computed by the whole block; every thread gets it.
template <class X, class R>
__device__ float sign_block_scale(const void* x, const void* residual, long long start, long long end) {
    __shared__ double scratch[32];
    double sum = 0.0;
    for (long long i = start + threadIdx.x; i < end; i += blockDim.x) {
        sum += float_to_double(absolute(load_compensated<X, R>(x, residual, i)));
    }
    sum = block_sum(sum, scratch);
    return float_divide(double_to_float(sum), static_cast<float>(end - start));
}

// Bit and residual of element i (when `valid`), the byte of its 8 lanes written by
// the first of them. Called by all 32 lanes of a warp, whose lane 0 holds an
// element index that is a multiple of 8.
template <class X, class R>
__device__ __forceinline__ void encode_sign(const void* x, void* residual, unsigned char* signs, long long i,
                                            bool valid, float scale) {
    const float y = valid ? load_compensated<X, R>(x, residual, i) : 0.0f;
    const bool positive = valid && non_negative(y);
    if (valid) {
        store_residual<R>(residual, i, finite_or_zero(float_subtract(y, positive ? scale : negate(scale))));
    }
    const unsigned bits = __ballot_sync(FULL_MASK, positive);
    const unsigned lane = threadIdx.x & 31u;
    if (valid && (lane & 7u) == 0) {
        signs[i >> 3] = static_cast<unsigned char>(bits >> lane);
    }
}

template <class X, class R>
__device__ void sign_compress(const void* x, void* residual, unsigned char* signs, float* scales, long long numel,
                              long long block, long long blocks) {
    for (long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        const long long start = b * block;
        const long long end = start + block < numel ? start + block : numel;
        const float scale = sign_block_scale<X, R>(x, residual, start, end);
        if (threadIdx.x == 0) {
            scales[b] = scale;
        }
        // start is a multiple of 8, blockDim.x of 32: each warp's lane 0 starts a byte.
        for (long long tile = start; tile < end; tile += blockDim.x) {
            const long long i = tile + threadIdx.x;
            encode_sign<X, R>(x, residual, signs, i, i < end, scale);
        }
    }
}

template <class X, class R>
__device__ void sign_scales(const void* x, const void* residual, float* scales, long long numel, long long block,
                            long long blocks) {
    for (long long b = blockIdx.x; b < blocks; b += gridDim.x) {
        const long long start = b * block;
        const long long end = start + block < numel ? start + block : numel;
        const float scale = sign_block_scale<X, R>(x, residual, start, end);
        if (threadIdx.x == 0) {
            scales[b] = scale;
        }
    }
}

// Index of the block holding element i: a 32-bit division where it fits.
__device__ __forceinline__ long long block_of(long long i, long long block, bool narrow) {
    return narrow ? static_cast<long long>(static_cast<unsigned>(i) / static_cast<unsigned>(block)) : i / block;
}

template <class X, class R>
__device__ void sign_encode(const void* x, void* residual, unsigned char* signs, const float* scales,
                            long long numel, long long block) {
    const bool narrow = numel <= 0xffffffffll && block <= 0xffffffffll;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long tile = static_cast<long long>(blockIdx.x) * blockDim.x; tile < numel; tile += stride) {
        const long long i = tile + threadIdx.x;
        const bool valid = i < numel;
        const float scale = valid ? scales[block_of(i, block, narrow)] : 0.0f;
        encode_sign<X, R>(x, residual, signs, i, valid, scale);
    }
}

template <class Out>
__device__ void sign_decompress(const unsigned char* signs, const float* scales, void* out, long long numel,
                                long long block, int accumulate) {
    typedef typename Out::Storage Storage;
    Storage* target = static_cast<Storage*>(out);
    const bool narrow = numel <= 0xffffffffll && block <= 0xffffffffll;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
        const float scale = scales[block_of(i, block, narrow)];
        const bool positive = ((signs[i >> 3] >> (i & 7)) & 1) != 0;
        const float value = positive ? scale : negate(scale);
        target[i] = accumulate ? Out::add(target[i], Out::from_float(value)) : Out::from_float(value);
    }
}

}  // namespace gradcomp

using namespace gradcomp;

#define GRADCOMP_SIGN_KERNELS(X_NAME, X_TYPE, R_NAME, R_TYPE)                                                  \
    extern "C" __global__ void __launch_bounds__(SIGN_MAX_THREADS) sign_compress_##X_NAME##_##R_NAME(          \
        const void* x, void* residual, unsigned char* signs, float* scales, long long numel, long long block,  \
        long long blocks) {                                                                                    \
        sign_compress<X_TYPE, R_TYPE>(x, residual, signs, scales, numel, block, blocks);                       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(SIGN_MAX_THREADS) sign_scales_##X_NAME##_##R_NAME(            \
        const void* x, const void* residual, float* scales, long long numel, long long block, long long blocks) { \
        sign_scales<X_TYPE, R_TYPE>(x, residual, scales, numel, block, blocks);                                \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(SIGN_MAX_THREADS) sign_encode_##X_NAME##_##R_NAME(            \
        const void* x, void* residual, unsigned char* signs, const float* scales, long long numel,             \
        long long block) {                                                                                     \
        sign_encode<X_TYPE, R_TYPE>(x, residual, signs, scales, numel, block);                                 \
    }

#define GRADCOMP_SIGN_FOR_EVERY_RESIDUAL(X_NAME, X_TYPE) \
    GRADCOMP_FOR_EVERY_RESIDUAL(GRADCOMP_SIGN_KERNELS, X_NAME, X_TYPE)

GRADCOMP_FOR_EVERY_FLOAT(GRADCOMP_SIGN_FOR_EVERY_RESIDUAL)

#define GRADCOMP_SIGN_DECOMPRESS_KERNEL(OUT_NAME, OUT_TYPE)                                                    \
    extern "C" __global__ void __launch_bounds__(SIGN_MAX_THREADS) sign_decompress_##OUT_NAME(                 \
        const unsigned char* signs, const float* scales, void* out, long long numel, long long block,          \
        int accumulate) {                                                                                      \
        sign_decompress<OUT_TYPE>(signs, scales, out, numel, block, accumulate);                               \
    }

GRADCOMP_FOR_EVERY_FLOAT(GRADCOMP_SIGN_DECOMPRESS_KERNEL)
