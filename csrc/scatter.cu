// Sparse decoding: out[indices[j]] += values[j] for j in order, reference.scatter_add.
//
// The pairs are added in the order given (a gathered batch of W payloads: rank
// order), with no atomic add, whose order the GPU leaves open, so every rank
// decoding the same rows gets the same bits. Two kernels around a stable sort
// (torch.sort on the Python side):
//
// * scatter_keys: each pair's sort key, its index; a zero value's key is numel,
//   past every run (a zero adds nothing, and Top-K's pads would make one long
//   run at index 0); an index outside [0, numel) gets key 0.
// * scatter_add: over the pairs sorted by key, stably (each element's pairs next
//   to each other, in their order), the first pair of each run reads the
//   element, adds the run's values one after another and writes it, the only
//   thread that touches it. A pair whose index lies outside adds NaN to element
//   0: the step reads as non-finite (GradScaler skips it) instead of silently
//   wrong. No trap: a trap would end the CUDA context, and the peers of this
//   rank would wait for it until their timeout.
//
// values arrive in out's dtype (the caller converts them, as the reference's
// `values.to(out.dtype)` does); each add is torch's `a + b` in that dtype. Keys
// are int32 or int64 (key_code, IndexCode), whichever holds numel.

#include "common.cuh"

namespace gradcomp {

// Zero tests on the bit pattern: a float compare may flush a subnormal to zero.
__device__ __forceinline__ bool is_zero(float value) { return (__float_as_uint(value) & MAGNITUDE_BITS) == 0; }

__device__ __forceinline__ bool is_zero(unsigned short value) { return (value & 0x7fffu) == 0; }

__device__ __forceinline__ bool is_zero(double value) {
    return (static_cast<unsigned long long>(__double_as_longlong(value)) << 1) == 0;
}

__device__ __forceinline__ long long load_key(const void* keys, int key_code, long long j) {
    return key_code == INDEX_INT32 ? static_cast<long long>(static_cast<const int*>(keys)[j])
                                   : static_cast<const long long*>(keys)[j];
}

template <class Out, class Index>
__device__ void scatter_keys(const Index* indices, const void* values, void* keys, long long count, long long numel,
                             int key_code) {
    typedef typename Out::Storage Storage;
    const Storage* addends = static_cast<const Storage*>(values);
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
        const long long index = static_cast<long long>(indices[j]);
        const bool inside = index >= 0 && index < numel;
        const long long key = !inside ? 0 : (is_zero(addends[j]) ? numel : index);
        if (key_code == INDEX_INT32) {
            static_cast<int*>(keys)[j] = static_cast<int>(key);
        } else {
            static_cast<long long*>(keys)[j] = key;
        }
    }
}

template <class Out, class Index>
__device__ void scatter_add(const void* keys, int key_code, const long long* order, const Index* indices,
                            const void* values, void* out, long long count, long long numel) {
    typedef typename Out::Storage Storage;
    const Storage* addends = static_cast<const Storage*>(values);
    Storage* target = static_cast<Storage*>(out);
    const Storage outside = Out::from_float(__int_as_float(0x7fc00000));
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long j = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; j < count; j += stride) {
        const long long key = load_key(keys, key_code, j);
        if (key >= numel || (j > 0 && load_key(keys, key_code, j - 1) == key)) {
            continue;  // a zero value, or not the first pair of its run
        }
        Storage total = target[key];
        for (long long q = j; q < count && load_key(keys, key_code, q) == key; ++q) {
            const long long pair = order[q];
            const long long index = static_cast<long long>(indices[pair]);
            total = Out::add(total, index >= 0 && index < numel ? addends[pair] : outside);
        }
        target[key] = total;
    }
}

}  // namespace gradcomp

using namespace gradcomp;

#define GRADCOMP_SCATTER_KERNELS(OUT_NAME, OUT_TYPE, INDEX_NAME, INDEX_TYPE)                                    \
    extern "C" __global__ void __launch_bounds__(256) scatter_keys_##OUT_NAME##_##INDEX_NAME(                  \
        const INDEX_TYPE* indices, const void* values, void* keys, long long count, long long numel,            \
        int key_code) {                                                                                         \
        scatter_keys<OUT_TYPE, INDEX_TYPE>(indices, values, keys, count, numel, key_code);                      \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(256) scatter_add_##OUT_NAME##_##INDEX_NAME(                   \
        const void* keys, int key_code, const long long* order, const INDEX_TYPE* indices, const void* values, \
        void* out, long long count, long long numel) {                                                          \
        scatter_add<OUT_TYPE, INDEX_TYPE>(keys, key_code, order, indices, values, out, count, numel);           \
    }

#define GRADCOMP_SCATTER_FOR_EVERY_INDEX(OUT_NAME, OUT_TYPE)          \
    GRADCOMP_SCATTER_KERNELS(OUT_NAME, OUT_TYPE, int32, int)           \
    GRADCOMP_SCATTER_KERNELS(OUT_NAME, OUT_TYPE, int64, long long)

GRADCOMP_FOR_EVERY_FLOAT(GRADCOMP_SCATTER_FOR_EVERY_INDEX)
