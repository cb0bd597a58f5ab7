// Shared by every kernel family in csrc/: element types, IEEE fp32 arithmetic,
// and warp and block scans.
//
// No header is included, not even the CUDA ones: the same text compiles with
// nvcc (setup.py, CI) and with NVRTC at run time (gradcomp/ops/cuda_backend.py
// inlines this file into each source). Kernels are plain extern "C" functions
// taking raw pointers; the Python side checks shapes and dtypes.
//
// Numerics follow gradcomp/ops/reference.py bit for bit: fp16 / bf16 / fp64
// inputs are read as fp32 (round to nearest even), sums and differences are
// single fp32 operations, stores round to nearest even. fp32 arithmetic goes
// through PTX without the .ftz modifier, so subnormals survive whatever -ftz
// setting the compiler was given (CuPy's NVRTC path passes -ftz=true; torch
// never flushes).
#pragma once

namespace gradcomp {

// Enumerators rather than constants: a file that uses none of them gets no warning.
enum : unsigned {
    FULL_MASK = 0xffffffffu,
    SIGN_BIT = 0x80000000u,
    MAGNITUDE_BITS = 0x7fffffffu,
    INFINITY_BITS = 0x7f800000u,
};

// Runtime dtype codes, shared with cuda_backend.py (VALUE_CODES, INDEX_CODES).
enum DtypeCode { DTYPE_FLOAT32 = 0, DTYPE_FLOAT16 = 1, DTYPE_BFLOAT16 = 2, DTYPE_FLOAT64 = 3 };
enum IndexCode { INDEX_INT32 = 0, INDEX_INT64 = 1 };

// ----------------------------------------------------------------------------- fp32 without flushing

__device__ __forceinline__ float float_add(float a, float b) {
    float result;
    asm("add.rn.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
    return result;
}

__device__ __forceinline__ float float_subtract(float a, float b) {
    float result;
    asm("sub.rn.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
    return result;
}

__device__ __forceinline__ float float_divide(float a, float b) {
    float result;
    asm("div.rn.f32 %0, %1, %2;" : "=f"(result) : "f"(a), "f"(b));
    return result;
}

__device__ __forceinline__ float double_to_float(double value) {
    float result;
    asm("cvt.rn.f32.f64 %0, %1;" : "=f"(result) : "d"(value));
    return result;
}

__device__ __forceinline__ double float_to_double(float value) {
    double result;
    asm("cvt.f64.f32 %0, %1;" : "=d"(result) : "f"(value));
    return result;
}

// Sign and class tests on the bit pattern: a float compare may flush its operands.
__device__ __forceinline__ bool is_finite(float value) {
    return (__float_as_uint(value) & INFINITY_BITS) != INFINITY_BITS;
}

__device__ __forceinline__ float finite_or_zero(float value) { return is_finite(value) ? value : 0.0f; }

__device__ __forceinline__ float absolute(float value) {
    return __uint_as_float(__float_as_uint(value) & MAGNITUDE_BITS);
}

__device__ __forceinline__ float negate(float value) { return __uint_as_float(__float_as_uint(value) ^ SIGN_BIT); }

// `value >= 0` as IEEE compares: true for -0, false for NaN.
__device__ __forceinline__ bool non_negative(float value) {
    const unsigned bits = __float_as_uint(value);
    const unsigned magnitude = bits & MAGNITUDE_BITS;
    return magnitude <= INFINITY_BITS && ((bits & SIGN_BIT) == 0 || magnitude == 0);
}

// ----------------------------------------------------------------------------- element types
//
// Storage is what memory holds; to_float / from_float convert with round to
// nearest even; add(a, b) is torch's `a + b` in that dtype (fp32 math for the
// 16-bit types, rounded once).

struct Float32 {
    typedef float Storage;
    static constexpr bool enabled = true;
    __device__ static float to_float(float value) { return value; }
    __device__ static float from_float(float value) { return value; }
    __device__ static float add(float a, float b) { return float_add(a, b); }
};

struct Float16 {
    typedef unsigned short Storage;
    static constexpr bool enabled = true;
    __device__ static float to_float(unsigned short value) {
        float result;
        asm("cvt.f32.f16 %0, %1;" : "=f"(result) : "h"(value));
        return result;
    }
    __device__ static unsigned short from_float(float value) {
        unsigned short result;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(result) : "f"(value));
        return result;
    }
    __device__ static unsigned short add(unsigned short a, unsigned short b) {
        return from_float(float_add(to_float(a), to_float(b)));
    }
};

struct BFloat16 {
    typedef unsigned short Storage;
    static constexpr bool enabled = true;
    __device__ static float to_float(unsigned short value) { return __uint_as_float(static_cast<unsigned>(value) << 16); }
    // Integer rounding, as c10::BFloat16 does it: no flushing, any architecture.
    __device__ static unsigned short from_float(float value) {
        const unsigned bits = __float_as_uint(value);
        if ((bits & MAGNITUDE_BITS) > INFINITY_BITS) {
            return 0x7fc0;
        }
        return static_cast<unsigned short>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
    }
    __device__ static unsigned short add(unsigned short a, unsigned short b) {
        return from_float(float_add(to_float(a), to_float(b)));
    }
};

struct Float64 {
    typedef double Storage;
    static constexpr bool enabled = true;
    __device__ static float to_float(double value) { return double_to_float(value); }
    __device__ static double from_float(float value) { return float_to_double(value); }
    __device__ static double add(double a, double b) { return a + b; }
};

// The residual argument of an op called without one.
struct NoResidual {
    typedef float Storage;
    static constexpr bool enabled = false;
    __device__ static float to_float(float value) { return value; }
    __device__ static float from_float(float value) { return value; }
};

// Elements a thread loads before it uses any: 16 bytes of the input in flight.
template <class X>
__device__ constexpr int items_per_thread() {
    return sizeof(typename X::Storage) >= 8 ? 2 : (sizeof(typename X::Storage) == 4 ? 4 : 8);
}

// `x + residual` in fp32 at element i: reference.compensate, one element.
template <class X, class R>
__device__ __forceinline__ float load_compensated(const void* x, const void* residual, long long i) {
    float y = X::to_float(static_cast<const typename X::Storage*>(x)[i]);
    if constexpr (R::enabled) {
        y = float_add(y, R::to_float(static_cast<const typename R::Storage*>(residual)[i]));
    }
    return y;
}

template <class R>
__device__ __forceinline__ void store_residual(void* residual, long long i, float value) {
    if constexpr (R::enabled) {
        static_cast<typename R::Storage*>(residual)[i] = R::from_float(value);
    }
}

// Stores `value` as `dtype` (a DTYPE_* code) at `position`; returns what was stored, in fp32.
__device__ __forceinline__ float store_as(void* out, unsigned long long position, int dtype, float value) {
    switch (dtype) {
        case DTYPE_FLOAT16: {
            const unsigned short stored = Float16::from_float(value);
            static_cast<unsigned short*>(out)[position] = stored;
            return Float16::to_float(stored);
        }
        case DTYPE_BFLOAT16: {
            const unsigned short stored = BFloat16::from_float(value);
            static_cast<unsigned short*>(out)[position] = stored;
            return BFloat16::to_float(stored);
        }
        case DTYPE_FLOAT64:
            static_cast<double*>(out)[position] = float_to_double(value);
            return value;
        default:
            static_cast<float*>(out)[position] = value;
            return value;
    }
}

__device__ __forceinline__ void store_index(void* out, unsigned long long position, int dtype, long long index) {
    if (dtype == INDEX_INT64) {
        static_cast<long long*>(out)[position] = index;
    } else {
        static_cast<int*>(out)[position] = static_cast<int>(index);
    }
}

// ----------------------------------------------------------------------------- scans and sums
//
// Block-wide helpers: every thread of the block must call them (they hold
// __syncthreads), blockDim.x a multiple of 32 and at most 1024.

template <typename T>
__device__ __forceinline__ T warp_inclusive_sum(T value) {
    const unsigned lane = threadIdx.x & 31u;
#pragma unroll
    for (unsigned offset = 1; offset < 32; offset <<= 1) {
        const T other = __shfl_up_sync(FULL_MASK, value, offset);
        if (lane >= offset) {
            value += other;
        }
    }
    return value;
}

template <typename T>
__device__ __forceinline__ T warp_sum(T value) {
#pragma unroll
    for (unsigned offset = 16; offset > 0; offset >>= 1) {
        value += __shfl_xor_sync(FULL_MASK, value, offset);
    }
    return value;
}

// Sum of `value` over the threads before this one (in threadIdx order); the
// block's total in *total. scratch: 33 entries of shared memory.
template <typename T>
__device__ T block_exclusive_sum(T value, T* scratch, T* total) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = blockDim.x >> 5;
    const T inclusive = warp_inclusive_sum(value);
    if (lane == 31) {
        scratch[warp] = inclusive;
    }
    __syncthreads();
    if (warp == 0) {
        const T warp_total = lane < warps ? scratch[lane] : T(0);
        const T warp_inclusive = warp_inclusive_sum(warp_total);
        if (lane < warps) {
            scratch[lane] = warp_inclusive - warp_total;
        }
        if (lane == 31) {
            scratch[32] = warp_inclusive;
        }
    }
    __syncthreads();
    const T result = scratch[warp] + inclusive - value;
    *total = scratch[32];
    __syncthreads();  // scratch may be reused as soon as this returns
    return result;
}

// Sum of `value` over the block, in a fixed order; every thread gets it.
// scratch: 32 entries of shared memory.
template <typename T>
__device__ T block_sum(T value, T* scratch) {
    const unsigned lane = threadIdx.x & 31u;
    const unsigned warp = threadIdx.x >> 5;
    const unsigned warps = blockDim.x >> 5;
    value = warp_sum(value);
    if (lane == 0) {
        scratch[warp] = value;
    }
    __syncthreads();
    T total = T(0);
    for (unsigned w = 0; w < warps; ++w) {
        total += scratch[w];
    }
    __syncthreads();
    return total;
}

}  // namespace gradcomp

// Instantiation over dtypes, shared by every kernel family: KERNELS(NAME, TYPE)
// for each floating dtype the ops take, and KERNELS(X_NAME, X_TYPE, R_NAME,
// R_TYPE) for each residual dtype of one input dtype (R = none: no residual).
#define GRADCOMP_FOR_EVERY_FLOAT(KERNELS) \
    KERNELS(float32, Float32)             \
    KERNELS(float16, Float16)             \
    KERNELS(bfloat16, BFloat16)           \
    KERNELS(float64, Float64)

#define GRADCOMP_FOR_EVERY_RESIDUAL(KERNELS, X_NAME, X_TYPE) \
    KERNELS(X_NAME, X_TYPE, none, NoResidual)                \
    KERNELS(X_NAME, X_TYPE, float32, Float32)                \
    KERNELS(X_NAME, X_TYPE, float16, Float16)                \
    KERNELS(X_NAME, X_TYPE, bfloat16, BFloat16)              \
    KERNELS(X_NAME, X_TYPE, float64, Float64)
