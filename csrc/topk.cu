// Top-K by magnitude with fused error feedback: reference.topk_select(exact=True)
// except for the order of the output, which is by ascending index here.
//
// Selection is a radix select on keys: the fp32 bit pattern of |y|, y = x + residual,
// with NaN mapped to +inf's pattern (reference.selection_magnitude). Keys of
// non-negative floats order like the floats, so the k-th largest key T is the
// k-th largest magnitude. T is fixed one digit at a time, most significant first
// (bits 30..20, 19..10, 9..0; bit 31 is always clear):
//
//   topk_histogram (pass p)  counts the digit p of every key whose higher digits
//                            match T so far, per block in shared memory, then
//                            adds the block's counts into a global histogram;
//   topk_choose_digit        (one block) walks that histogram from the top digit
//                            down and keeps the digit where the k-th largest
//                            falls, and how many of the k are still to be found
//                            inside it.
//
// After three passes T is exact and `need` says how many keys equal to T must
// be taken: every key above T is selected, and of the ties at T the `need` of
// lowest index (the rule that makes the output unique). No pass reads the whole
// input more than once, there is no host sync, and the output has exactly k
// entries.
//
// Each block of the histogram and compaction kernels owns one contiguous chunk
// of the input. The last histogram pass also writes, per chunk, how many of its
// keys lie at or above each last digit; topk_plan_chunks turns those into each
// chunk's output offset and its share of the ties (prefix sums over chunks),
// and topk_compact writes values and indices in index order, with block-wide
// scans inside each tile, and writes the residual in the same pass:
// y everywhere except at selected entries, where it keeps what rounding the
// value to the payload dtype lost; non-finite entries become 0.

#include "common.cuh"

namespace gradcomp {

constexpr int TOPK_THREADS = 512;         // histogram and compaction blocks
constexpr int TOPK_CHOOSE_THREADS = 1024;  // the one-block kernels
constexpr int TOPK_FIRST_BINS = 2048;      // bits 30..20 (key >> 20 is at most 0x7f8)
constexpr int TOPK_LAST_BINS = 1024;       // bits 19..10, then 9..0
constexpr int TOPK_SUFFIX_ENTRIES = TOPK_LAST_BINS + 1;

__device__ __forceinline__ int digit_shift(int pass) { return pass == 0 ? 20 : (pass == 1 ? 10 : 0); }
__device__ __forceinline__ int digit_bins(int pass) { return pass == 0 ? TOPK_FIRST_BINS : TOPK_LAST_BINS; }

// |y| as an ordered key; NaN counts as +inf, like reference.selection_magnitude.
__device__ __forceinline__ unsigned magnitude_key(float y) {
    const unsigned magnitude = __float_as_uint(y) & MAGNITUDE_BITS;
    return magnitude > INFINITY_BITS ? INFINITY_BITS : magnitude;
}

// counts[digit] += 1 for each lane with `counted`. Called by all 32 lanes.
// A warp whose counted lanes share one digit (a run of zeros, say) adds once.
__device__ __forceinline__ void count_digit(unsigned* counts, unsigned digit, bool counted) {
    const unsigned active = __ballot_sync(FULL_MASK, counted);
    if (active == 0) {
        return;
    }
    const int leader = __ffs(active) - 1;
    const unsigned leader_digit = __shfl_sync(FULL_MASK, digit, leader);
    const unsigned same = __ballot_sync(FULL_MASK, counted && digit == leader_digit);
    if (same == active) {
        if (static_cast<int>(threadIdx.x & 31u) == leader) {
            atomicAdd(&counts[digit], static_cast<unsigned>(__popc(same)));
        }
    } else if (counted) {
        atomicAdd(&counts[digit], 1u);
    }
}

// out[j] = above + (counted keys of the chunk whose last digit is >= j), j in
// [0, 1024]; out[1024] = above. The compaction plan reads two entries of it.
__device__ void write_chunk_suffix(const unsigned* counts, unsigned above, unsigned* out, unsigned* scratch) {
    const int per_thread = TOPK_LAST_BINS / static_cast<int>(blockDim.x);
    const int highest = TOPK_LAST_BINS - 1 - static_cast<int>(threadIdx.x) * per_thread;
    unsigned own = 0;
    for (int q = 0; q < per_thread; ++q) {
        own += counts[highest - q];
    }
    unsigned total;
    unsigned running = above + block_exclusive_sum(own, scratch, &total);
    for (int q = 0; q < per_thread; ++q) {
        running += counts[highest - q];
        out[highest - q] = running;
    }
    if (threadIdx.x == 0) {
        out[TOPK_LAST_BINS] = above;
    }
}

template <class X, class R>
__device__ void topk_histogram(const void* x, const void* residual, const unsigned long long* state,
                               unsigned long long* histogram, unsigned* chunk_suffix, long long numel,
                               long long chunk, int pass) {
    constexpr int ITEMS = items_per_thread<X>();
    __shared__ unsigned counts[TOPK_FIRST_BINS];
    __shared__ unsigned above;
    __shared__ unsigned scratch[33];
    const int shift = digit_shift(pass);
    const int bins = digit_bins(pass);
    // Keys take part when their digits above this pass's equal T's so far
    // (pass 0: bits above 30, always zero).
    const int match_shift = pass == 0 ? 31 : shift + 10;
    const unsigned prefix = pass == 0 ? 0u : static_cast<unsigned>(state[0]);
    for (int j = threadIdx.x; j < bins; j += blockDim.x) {
        counts[j] = 0;
    }
    if (threadIdx.x == 0) {
        above = 0;
    }
    __syncthreads();

    const long long begin = static_cast<long long>(blockIdx.x) * chunk;
    const long long end = begin + chunk < numel ? begin + chunk : numel;
    const long long stride = static_cast<long long>(blockDim.x);
    for (long long tile = begin; tile < end; tile += ITEMS * stride) {
        float y[ITEMS];
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            const long long i = tile + q * stride + threadIdx.x;
            y[q] = i < end ? load_compensated<X, R>(x, residual, i) : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            const bool valid = tile + q * stride + threadIdx.x < end;
            const unsigned key = magnitude_key(y[q]);
            const bool counted = valid && (key >> match_shift) == (prefix >> match_shift);
            count_digit(counts, (key >> shift) & static_cast<unsigned>(bins - 1), counted);
            if (pass == 2) {
                const unsigned higher = __ballot_sync(FULL_MASK, valid && (key >> 10) > (prefix >> 10));
                if ((threadIdx.x & 31u) == 0 && higher != 0) {
                    atomicAdd(&above, static_cast<unsigned>(__popc(higher)));
                }
            }
        }
    }
    __syncthreads();

    for (int j = threadIdx.x; j < bins; j += blockDim.x) {
        if (counts[j] != 0) {
            atomicAdd(&histogram[j], static_cast<unsigned long long>(counts[j]));
        }
    }
    if (pass == 2) {
        write_chunk_suffix(counts, above, chunk_suffix + static_cast<long long>(blockIdx.x) * TOPK_SUFFIX_ENTRIES,
                           scratch);
    }
}

template <class X, class R>
__device__ void topk_compact(const void* x, void* residual, const unsigned long long* state,
                             const unsigned long long* plan, void* values, int value_dtype, void* indices,
                             int index_dtype, long long numel, long long chunk, long long k) {
    constexpr int ITEMS = items_per_thread<X>();
    __shared__ unsigned scratch[33];
    const unsigned threshold = static_cast<unsigned>(state[0]);
    const unsigned long long start = plan[3 * blockIdx.x];
    const unsigned long long taken = plan[3 * blockIdx.x + 1];
    const unsigned long long ties = plan[3 * blockIdx.x + 2];
    // Only the chunk where the ties run out ranks them; elsewhere all or none are taken.
    const bool partial = taken != 0 && taken != ties;
    const bool take_ties = taken != 0;

    const long long begin = static_cast<long long>(blockIdx.x) * chunk;
    const long long end = begin + chunk < numel ? begin + chunk : numel;
    unsigned long long written = 0;
    unsigned long long ties_seen = 0;
    // Thread t holds elements t * ITEMS .. t * ITEMS + ITEMS - 1 of each tile, so
    // that thread order is index order for the scans.
    for (long long tile = begin; tile < end; tile += static_cast<long long>(ITEMS) * blockDim.x) {
        const long long first = tile + static_cast<long long>(threadIdx.x) * ITEMS;
        float y[ITEMS];
        bool selected[ITEMS];
        bool tie[ITEMS];
        unsigned tie_count = 0;
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            y[q] = first + q < end ? load_compensated<X, R>(x, residual, first + q) : 0.0f;
        }
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            const bool valid = first + q < end;
            const unsigned key = magnitude_key(y[q]);
            tie[q] = valid && key == threshold;
            selected[q] = valid && (key > threshold || (tie[q] && take_ties));
            tie_count += tie[q] ? 1u : 0u;
        }
        if (partial) {
            unsigned tile_ties;
            unsigned long long rank = ties_seen + block_exclusive_sum(tie_count, scratch, &tile_ties);
#pragma unroll
            for (int q = 0; q < ITEMS; ++q) {
                if (tie[q]) {
                    selected[q] = rank < taken;
                    ++rank;
                }
            }
            ties_seen += tile_ties;
        }
        unsigned count = 0;
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            count += selected[q] ? 1u : 0u;
        }
        unsigned tile_selected;
        unsigned long long position = start + written + block_exclusive_sum(count, scratch, &tile_selected);
#pragma unroll
        for (int q = 0; q < ITEMS; ++q) {
            const long long i = first + q;
            if (i >= end) {
                continue;
            }
            float kept = finite_or_zero(y[q]);
            // The guard only matters if the counts were inconsistent: never write past k.
            if (selected[q] && position < static_cast<unsigned long long>(k)) {
                const float sent = store_as(values, position, value_dtype, y[q]);
                store_index(indices, position, index_dtype, i);
                kept = finite_or_zero(float_subtract(y[q], sent));
                ++position;
            }
            store_residual<R>(residual, i, kept);
        }
        written += tile_selected;
    }
}

}  // namespace gradcomp

using namespace gradcomp;

// After pass `pass`: state[0] = T's digits fixed so far, state[1] = how many of
// the k are still to be found among the keys that match them.
extern "C" __global__ void __launch_bounds__(TOPK_CHOOSE_THREADS)
    topk_choose_digit(const unsigned long long* histogram, unsigned long long* state, long long k, int pass) {
    __shared__ unsigned long long scratch[33];
    const int shift = digit_shift(pass);
    const int bins = digit_bins(pass);
    const unsigned long long prefix = pass == 0 ? 0ull : state[0];
    const unsigned long long remaining = pass == 0 ? static_cast<unsigned long long>(k) : state[1];
    // Thread 0 owns the highest digits, so an exclusive sum counts the keys above.
    const int per_thread = bins / static_cast<int>(blockDim.x);
    const int highest = bins - 1 - static_cast<int>(threadIdx.x) * per_thread;
    unsigned long long own = 0;
    for (int q = 0; q < per_thread; ++q) {
        own += histogram[highest - q];
    }
    unsigned long long total;
    unsigned long long above = block_exclusive_sum(own, scratch, &total);
    for (int q = 0; q < per_thread; ++q) {
        const unsigned long long count = histogram[highest - q];
        // Exactly one digit satisfies this: the counts add up to at least `remaining`.
        if (above < remaining && remaining <= above + count) {
            state[0] = prefix | (static_cast<unsigned long long>(highest - q) << shift);
            state[1] = remaining - above;
        }
        above += count;
    }
}

// plan[3c] = where chunk c's output starts, plan[3c + 1] = how many of its ties
// at T it takes, plan[3c + 2] = how many ties it has. Ties go to the lowest
// indices: to the chunks in order, until `need` are taken.
extern "C" __global__ void __launch_bounds__(TOPK_CHOOSE_THREADS)
    topk_plan_chunks(const unsigned* chunk_suffix, const unsigned long long* state, unsigned long long* plan,
                     int chunks) {
    __shared__ unsigned long long scratch[33];
    const unsigned digit = static_cast<unsigned>(state[0]) & (TOPK_LAST_BINS - 1);
    const unsigned long long need = state[1];
    unsigned long long ties_before = 0;
    unsigned long long selected_before = 0;
    for (int base = 0; base < chunks; base += blockDim.x) {
        const int c = base + static_cast<int>(threadIdx.x);
        unsigned long long greater = 0;
        unsigned long long ties = 0;
        if (c < chunks) {
            const unsigned* suffix = chunk_suffix + static_cast<long long>(c) * TOPK_SUFFIX_ENTRIES;
            greater = suffix[digit + 1];
            ties = suffix[digit] - suffix[digit + 1];
        }
        unsigned long long tile_ties;
        const unsigned long long earlier_ties = ties_before + block_exclusive_sum(ties, scratch, &tile_ties);
        const unsigned long long wanted = earlier_ties < need ? need - earlier_ties : 0ull;
        const unsigned long long taken = wanted < ties ? wanted : ties;
        unsigned long long tile_selected;
        const unsigned long long start =
            selected_before + block_exclusive_sum(greater + taken, scratch, &tile_selected);
        if (c < chunks) {
            plan[3 * c] = start;
            plan[3 * c + 1] = taken;
            plan[3 * c + 2] = ties;
        }
        ties_before += tile_ties;
        selected_before += tile_selected;
    }
}

// One histogram and one compaction kernel per (input dtype, residual dtype):
// topk_histogram_<x>_<residual>, topk_compact_<x>_<residual>, residual "none"
// when the op has no error feedback.
#define GRADCOMP_TOPK_KERNELS(X_NAME, X_TYPE, R_NAME, R_TYPE)                                                  \
    extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_histogram_##X_NAME##_##R_NAME(             \
        const void* x, const void* residual, const unsigned long long* state, unsigned long long* histogram,   \
        unsigned* chunk_suffix, long long numel, long long chunk, int pass) {                                  \
        topk_histogram<X_TYPE, R_TYPE>(x, residual, state, histogram, chunk_suffix, numel, chunk, pass);       \
    }                                                                                                          \
    extern "C" __global__ void __launch_bounds__(TOPK_THREADS) topk_compact_##X_NAME##_##R_NAME(               \
        const void* x, void* residual, const unsigned long long* state, const unsigned long long* plan,        \
        void* values, int value_dtype, void* indices, int index_dtype, long long numel, long long chunk,       \
        long long k) {                                                                                         \
        topk_compact<X_TYPE, R_TYPE>(x, residual, state, plan, values, value_dtype, indices, index_dtype,      \
                                     numel, chunk, k);                                                         \
    }

#define GRADCOMP_TOPK_FOR_EVERY_RESIDUAL(X_NAME, X_TYPE) \
    GRADCOMP_FOR_EVERY_RESIDUAL(GRADCOMP_TOPK_KERNELS, X_NAME, X_TYPE)

GRADCOMP_FOR_EVERY_FLOAT(GRADCOMP_TOPK_FOR_EVERY_RESIDUAL)
