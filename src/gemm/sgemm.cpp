// The blocked GEMM driver (Goto & van de Geijn 2008; the BLIS five-loop structure), its
// small-problem path, and the public entry point.
#include <tbb/parallel_for.h>

#include <algorithm>

#include "gemm/sgemm_validate.hpp"
#include "mha/gemm.hpp"
#include "runtime/runtime_state.hpp"

namespace mha {
namespace gemm {
namespace {

using detail::RuntimeState;

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t round_up(int64_t a, int64_t b) { return ceil_div(a, b) * b; }

// A matrix operand as the kernels see it: element (i, j) = p[i * rs + j * cs].
struct Operand {
    const float *p;
    int64_t rs, cs;
    const float *at(int64_t i, int64_t j) const { return p + i * rs + j * cs; }
};

struct Output {
    float *p;
    int64_t ld;
    float alpha, beta;
};

// Runs `fn(item)` for item in [0, count) on the arena the caller is in; one task per item.
template <class Fn>
void parallel_items(int64_t count, const Fn &fn) {
    if (count == 1) return fn(int64_t{0});
    tbb::parallel_for(tbb::blocked_range<int64_t>(0, count, 1),
                      [&](const tbb::blocked_range<int64_t> &r) {
                          for (int64_t i = r.begin(); i != r.end(); ++i) fn(i);
                      },
                      tbb::simple_partitioner());
}

// Splits [0, count) into at most `chunks` contiguous ranges and runs fn(begin, end) on each.
template <class Fn>
void parallel_chunks(int64_t count, int64_t chunks, const Fn &fn) {
    chunks = std::max<int64_t>(1, std::min(chunks, count));
    const int64_t per = ceil_div(count, chunks);
    parallel_items(ceil_div(count, per), [&](int64_t i) { fn(i * per, std::min(count, (i + 1) * per)); });
}

// The packed path: five loops around the microkernel. Threads split the JC block's IC and JR
// ranges, never PC, so every element of C sums its products in the same order for any thread count.
void sgemm_packed(RuntimeState &s, int64_t m, int64_t n, int64_t k, Operand a, Operand b, Output c) {
    const SgemmKernel &uk = *s.sgemm;
    const int64_t MR = uk.mr, NR = uk.nr, T = s.num_threads;
    const TileConfig &t = s.tiles;
    const int64_t kc_max = std::min(k, t.kc);
    const int64_t nc_max = std::min(round_up(n, NR), t.nc);
    // MC only sizes the work items (rows start at multiples of MR either way), so it may follow the
    // thread count: round the number of IC blocks up to a multiple of T so the threads finish together.
    int64_t n_ic = ceil_div(m, t.mc);
    n_ic = std::min(ceil_div(m, MR), round_up(n_ic, T));
    const int64_t mc = round_up(ceil_div(m, n_ic), MR);
    n_ic = ceil_div(m, mc);

    const int64_t a_size = mc * kc_max;
    auto scratch = s.pool.borrow(static_cast<size_t>(kc_max * nc_max + s.slots * a_size));
    float *bp = scratch.data(), *a_packs = bp + kc_max * nc_max;
    for (int64_t jc = 0; jc < n; jc += t.nc) {                   // JC: NC columns of B
        const int64_t nc = std::min(t.nc, n - jc);
        const int64_t n_jr = ceil_div(nc, NR);
        // With fewer IC blocks than threads, also split the JR panels.
        const int64_t jr_split = n_ic >= T ? 1 : std::min(n_jr, ceil_div(T, n_ic));
        const int64_t jr_per = ceil_div(n_jr, jr_split);
        for (int64_t pc = 0; pc < k; pc += t.kc) {               // PC: KC depth; pack B
            const int64_t kc = std::min(t.kc, k - pc);
            parallel_chunks(n_jr, T, [&](int64_t jr0, int64_t jr1) {
                const int64_t j0 = jr0 * NR, cols = std::min(nc, jr1 * NR) - j0;
                uk.pack_b(cols, kc, b.at(pc, jc + j0), b.cs, b.rs, bp + j0 * kc);
            });
            const float beta = pc == 0 ? c.beta : 1.0f;
            parallel_items(n_ic * jr_split, [&](int64_t item) {   // IC: MC rows of A; pack A
                const int64_t ic = item / jr_split * mc, mcur = std::min(mc, m - ic);
                const int64_t jr0 = item % jr_split * jr_per, jr1 = std::min(n_jr, jr0 + jr_per);
                if (jr0 >= jr1) return;
                float *ap = a_packs + RuntimeState::this_thread_slot() * a_size;
                uk.pack_a(mcur, kc, a.at(ic, pc), a.rs, a.cs, ap);
                // JR and IR run inside the ISA's translation unit.
                uk.macro_packed(mcur, nc, kc, jr0, jr1, ap, bp, c.p + ic * c.ld + jc, c.ld, c.alpha, beta);
            });
        }
    }
}

// The small-problem path (after BLIS's "sup"): A is read where it lies, and B too when its columns
// are contiguous; only B^T and the edge panels are packed. The depth is not blocked.
void sgemm_sup(RuntimeState &s, int64_t m, int64_t n, int64_t k, Operand a, Operand b, Output c) {
    const SgemmKernel &uk = *s.sgemm;
    const int64_t MR = uk.mr, NR = uk.nr, T = s.num_threads;
    // The k x NC block of B takes the footprint the tiles give the packed A block (half of L2).
    const int64_t nc_blk = std::clamp(s.tiles.mc * s.tiles.kc / k / NR * NR, NR, round_up(n, NR));
    const bool b_direct = b.cs == 1;
    const int64_t n_ir = ceil_div(m, MR);

    auto scratch = s.pool.borrow(static_cast<size_t>(k * nc_blk));
    float *bp = scratch.data();
    for (int64_t jc = 0; jc < n; jc += nc_blk) {                   // JC: a block of B that stays in L2
        const int64_t nc = std::min(nc_blk, n - jc);
        const int64_t n_jr = ceil_div(nc, NR);
        const int64_t edge_nr = nc % NR;
        if (!b_direct)
            parallel_chunks(n_jr, T, [&](int64_t jr0, int64_t jr1) {
                const int64_t j0 = jr0 * NR, cols = std::min(nc, jr1 * NR) - j0;
                uk.pack_b(cols, k, b.at(0, jc + j0), b.cs, b.rs, bp + j0 * k);
            });
        else if (edge_nr)  // only the panel cut by the edge: reading it in place would overrun B
            uk.pack_b(edge_nr, k, b.at(0, jc + (n_jr - 1) * NR), b.cs, b.rs, bp + (n_jr - 1) * NR * k);

        const int64_t ir_split = std::min(n_ir, 4 * T);
        const int64_t jr_split = n_ir >= T ? 1 : std::min(n_jr, ceil_div(T, n_ir));
        const int64_t ir_per = ceil_div(n_ir, ir_split), jr_per = ceil_div(n_jr, jr_split);
        parallel_items(ir_split * jr_split, [&](int64_t item) {
            const int64_t ir0 = item / jr_split * ir_per, ir1 = std::min(n_ir, ir0 + ir_per);
            const int64_t jr0 = item % jr_split * jr_per, jr1 = std::min(n_jr, jr0 + jr_per);
            if (ir0 >= ir1 || jr0 >= jr1) return;
            const int64_t i0 = ir0 * MR, rows = std::min(m, ir1 * MR) - i0;
            uk.macro_sup(SupArgs{rows, nc, k, jr0, jr1, a.at(i0, 0), a.rs, a.cs, b_direct ? b.at(0, jc) : nullptr,
                                 b.rs, bp, c.p + i0 * c.ld + jc, c.ld, c.alpha, c.beta});
        });
    }
}

// C = beta * C, for k == 0 or alpha == 0 (A and B are not read, as in BLAS).
void scale_c(int64_t m, int64_t n, float beta, float *c, int64_t ldc) {
    for (int64_t i = 0; i < m; ++i) {
        float *row = c + i * ldc;
        if (beta == 0.0f)
            std::fill(row, row + n, 0.0f);
        else
            for (int64_t j = 0; j < n; ++j) row[j] *= beta;
    }
}

} // namespace

void check_sgemm_args(Trans transa, Trans transb, int64_t m, int64_t n, int64_t k, const float *a,
                      int64_t lda, const float *b, int64_t ldb, const float *c, int64_t ldc) {
    auto check_trans = [](const char *name, Trans t) {
        if (t != Trans::N && t != Trans::T)
            invalid_argument(std::string(name) + " must be 'N' or 'T', got '" + std::string(1, static_cast<char>(t)) + "'");
    };
    check_trans("transa", transa);
    check_trans("transb", transb);
    check_size("m", m);
    check_size("n", n);
    check_size("k", k);
    const bool ta = transa == Trans::T, tb = transb == Trans::T;
    const bool reads_ab = m > 0 && n > 0;  // with m or n zero, nothing is computed
    check_matrix("a", "lda", a, ta ? k : m, ta ? m : k, lda, reads_ab);
    check_matrix("b", "ldb", b, tb ? n : k, tb ? k : n, ldb, reads_ab);
    check_matrix("c", "ldc", c, m, n, ldc);
}

} // namespace gemm

void sgemm(Runtime &rt, Trans transa, Trans transb, int64_t m, int64_t n, int64_t k, float alpha,
           const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
    using namespace gemm;
    check_sgemm_args(transa, transb, m, n, k, a, lda, b, ldb, c, ldc);
    if (m == 0 || n == 0) return;
    if (k == 0 || alpha == 0.0f) return scale_c(m, n, beta, c, ldc);
    auto &s = rt.state();
    const Operand A = transa == Trans::N ? Operand{a, lda, 1} : Operand{a, 1, lda};
    const Operand B = transb == Trans::N ? Operand{b, ldb, 1} : Operand{b, 1, ldb};
    const Output C{c, ldc, alpha, beta};
    const bool sup = (n <= s.tiles.sup_max_n || k <= s.tiles.sup_max_k) && k <= 8192;
    s.arena.execute([&] { sup ? sgemm_sup(s, m, n, k, A, B, C) : sgemm_packed(s, m, n, k, A, B, C); });
}

} // namespace mha
