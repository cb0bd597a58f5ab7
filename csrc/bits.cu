// Packing of 1, 2 and 4-bit codes: reference.pack_bits and reference.unpack_bits.
//
// Element i lives in byte i / (8 / bits) at bit offset (i % (8 / bits)) * bits;
// codes must be below 2**bits. One thread per output byte (pack) or per output
// code (unpack), grid-stride loops.

extern "C" __global__ void __launch_bounds__(256)
    pack_bits(const unsigned char* codes, unsigned char* packed, long long numel, long long nbytes, int bits) {
    const int per_byte = 8 / bits;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long byte = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; byte < nbytes;
         byte += stride) {
        const long long first = byte * per_byte;
        unsigned packed_byte = 0;
        for (int q = 0; q < per_byte; ++q) {
            if (first + q < numel) {
                packed_byte |= static_cast<unsigned>(codes[first + q]) << (q * bits);
            }
        }
        packed[byte] = static_cast<unsigned char>(packed_byte);
    }
}

extern "C" __global__ void __launch_bounds__(256)
    unpack_bits(const unsigned char* packed, unsigned char* codes, long long numel, int bits) {
    const int per_byte = 8 / bits;
    const unsigned mask = (1u << bits) - 1u;
    const long long stride = static_cast<long long>(gridDim.x) * blockDim.x;
    for (long long i = static_cast<long long>(blockIdx.x) * blockDim.x + threadIdx.x; i < numel; i += stride) {
        const unsigned byte = packed[i / per_byte];
        codes[i] = static_cast<unsigned char>((byte >> ((i % per_byte) * bits)) & mask);
    }
}
