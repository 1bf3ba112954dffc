// Subnormal floats flushed to zero on the calling thread for a scope (MXCSR's FTZ and DAZ bits,
// which govern SSE, AVX and AVX-512 alike), the caller's mode restored at its end.
//
// The attention's probabilities reach down to FLT_MIN (its exps are 0 below that), and P V's
// chains that start from zero, the rescaled accumulators and the products against small values
// then fall below it: on Intel cores every FMA that reads or writes a subnormal takes a microcode
// assist of about a hundred cycles. Xeon (AMX, avx512_fp16), 1 thread, L2048 H8 D64 with ALiBi
// (whose far keys' probabilities are that small): 0.68-0.70x the plain call before, 0.95-0.97x
// after. AMD's cores take subnormals at full speed (0.97-0.98x there before).
#pragma once

#include <xmmintrin.h>

namespace mha::simd {

class FlushDenormals {
public:
    FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtzDaz); }
    ~FlushDenormals() { _mm_setcsr(saved_); }
    FlushDenormals(const FlushDenormals &) = delete;
    FlushDenormals &operator=(const FlushDenormals &) = delete;

private:
    static constexpr unsigned kFtzDaz = 0x8040;  // bit 15: flush to zero; bit 6: denormals are zero
    unsigned saved_;
};

} // namespace mha::simd
