// Sparse decoding: out[indices[j]] += values[j], reference.scatter_add.
//
// values arrive in out's dtype (the caller converts them, as the reference's
// `values.to(out.dtype)` does) and each add is one atomic read-modify-write in
// that dtype: fp32 and fp64 with the hardware atomics, fp16 and bf16 with a
// compare-and-swap on the aligned 32-bit word that holds the element, the sum
// rounded once like torch's `a + b`. Repeated indices are summed in no fixed
// order. An index outside [0, numel) is never written; its value is dropped
// and element 0 becomes NaN, so that the step reads as non-finite (GradScaler
// skips it) instead of silently wrong. No trap: a trap would end the CUDA
// context, and the peers of this rank would wait for it until their timeout.
// A gathered batch of W payloads is one call on the flattened (W * k) indices
// and values.

#include "common.cuh"

namespace gradcomp {

__device__ __forceinline__ void atomic_add(float* address, float value) { atomicAdd(address, value); }

__device__ __forceinline__ void atomic_add(double* address, double value) { atomicAdd(address, value); }

template <class T>
__device__ __forceinline__ void atomic_add_16_bits(unsigned short* address, unsigned short value) {
    const unsigned long long where = reinterpret_cast<unsigned long long>(address);
    unsigned* word = reinterpret_cast<unsigned*>(where & ~3ull);
    const unsigned shift = (where & 2ull) != 0 ? 16u : 0u;
    unsigned observed = *word;
    unsigned expected;
    do {
        expected = observed;
        const unsigned short current = static_cast<unsigned short>(expected >> shift);
        const unsigned short sum = T::add(current, value);
        const unsigned replacement = (expected & ~(0xffffu << shift)) | (static_cast<unsigned>(sum) << shift);
        observed = atomicCAS(word, expected, replacement);
    } while (observed != expected);
}

template <class Out, class Index>
__device__ void scatter_add(const Index* indices, const void* values, void* out, long long count, long long numel) {
    typedef typename Out::Storage Storage;
    const Storage* addends = static_cast<const Storage*>(values);
    Storage* target = static_cast<Storage*>(out);
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
        const long long index = static_cast<long long>(indices[j]);
        if (index < 0 || index >= numel) {
            target[0] = Out::from_float(__int_as_float(0x7fc00000));
            continue;
        }
        if constexpr (sizeof(Storage) == 2) {
            atomic_add_16_bits<Out>(target + index, addends[j]);
        } else {
            atomic_add(target + index, addends[j]);
        }
    }
}

}  // namespace gradcomp

using namespace gradcomp;

#define GRADCOMP_SCATTER_ADD_KERNEL(OUT_NAME, OUT_TYPE, INDEX_NAME, INDEX_TYPE)                                \
    extern "C" __global__ void __launch_bounds__(256) scatter_add_##OUT_NAME##_##INDEX_NAME(                   \
        const INDEX_TYPE* indices, const void* values, void* out, long long count, long long numel) {          \
        scatter_add<OUT_TYPE, INDEX_TYPE>(indices, values, out, count, numel);                                 \
    }

#define GRADCOMP_SCATTER_ADD_FOR_EVERY_INDEX(OUT_NAME, OUT_TYPE)          \
    GRADCOMP_SCATTER_ADD_KERNEL(OUT_NAME, OUT_TYPE, int32, int)           \
    GRADCOMP_SCATTER_ADD_KERNEL(OUT_NAME, OUT_TYPE, int64, long long)

GRADCOMP_FOR_EVERY_FLOAT(GRADCOMP_SCATTER_ADD_FOR_EVERY_INDEX)
