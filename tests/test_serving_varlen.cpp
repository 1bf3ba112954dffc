// Ragged attention (mha_attention_varlen) against the double reference (see serving_util.hpp).
#include <doctest/doctest.h>

#include "serving_util.hpp"

using namespace mha;
using namespace serving_test;

namespace {

// (queries, keys) per sequence: no queries, queries and no keys, length 1, Lq < Lk, Lq > Lk
// (causal rows that see nothing), no keys and no queries, and one past a default key tile.
const std::pair<int64_t, int64_t> kRagged[] = {{3, 11}, {0, 5},   {4, 0},   {1, 1},     {1, 17}, {9, 9},
                                               {0, 0},  {13, 30}, {20, 20}, {6, 3},     {17, 270}, {2, 40}};

struct VarlenCase {
    const char *what;
    Shape s;
    bool causal;
    float scale;
};

const VarlenCase kVarlenCases[] = {
    {"MHA", {4, 4, 16, 16}, false, 0},
    {"MHA causal", {4, 4, 16, 16}, true, 0},
    {"GQA 8/2 causal", {8, 2, 32, 32}, true, 0},
    {"GQA 8/2, scale 0.3", {8, 2, 32, 32}, false, 0.3f},
    {"MQA, Dv != Dqk", {4, 1, 16, 24}, false, 0},
    {"MQA causal, Dv < Dqk", {4, 1, 24, 8}, true, 0},
    {"odd head dims 13/7", {2, 1, 13, 7}, false, 0},
    {"odd head dims 13/7, GQA 6/3, causal", {6, 3, 13, 7}, true, 0},
    {"head dims past a register tile", {2, 2, 65, 33}, true, 0},
};

} // namespace

TEST_CASE("varlen: ragged batches against the double reference, every ISA, default and tiny tiles, 1 and 2 threads") {
    for (const Setup &su : varlen_setups()) {
        Rt r1(1, su), r2(2, su);
        for (const VarlenCase &vc : kVarlenCases) {
            CAPTURE(su.name);
            CAPTURE(vc.what);
            const Shape &s = vc.s;
            Ragged rg(s);
            std::vector<SeqData> seqs;
            uint32_t seed = 100;
            for (auto [nq, nk] : kRagged) {
                seqs.emplace_back(s, nq, nk, seed += 3);
                rg.add(seqs.back());
            }
            const size_t n = sz(rg.total_q() * s.o_row()), pad = 37;
            std::vector<float> out(n + pad, test::kSentinel);
            rg.run(r1, vc.causal, out.data(), vc.scale);
            CHECK_MESSAGE(all_sentinel(out, n), "written past total_q rows");
            for (size_t i = 0; i < seqs.size(); ++i) {
                const SeqData &d = seqs[i];
                const float *got = out.data() + rg.qo[i] * s.o_row();
                const std::string what = "sequence " + std::to_string(i) + " (" + std::to_string(d.Lq) + " queries, " +
                                         std::to_string(d.Lk) + " keys)";
                close_to(got, reference(s, d.Lq, d.Lk, vc.causal, d.q.data(), d.k.data(), d.v.data(), vc.scale), what);
                if (d.Lq > 0 && d.Lk == 0)
                    for (int64_t j = 0; j < d.Lq * s.o_row(); ++j) REQUIRE(got[j] == 0.0f);
                // The same bits as mha_attention on the sequence alone.
                if (d.Lq > 0 && d.Lk > 0)
                    same_rows(got, dense(r2, s, d.Lq, d.Lk, vc.causal, d.q.data(), d.k.data(), d.v.data(), vc.scale).data(),
                              d.Lq, s.o_row(), what + " vs mha_attention alone");
            }
            std::vector<float> out2(n + pad, test::kSentinel);
            rg.run(r2, vc.causal, out2.data(), vc.scale);
            CHECK(all_sentinel(out2, n));
            same_rows(out2.data(), out.data(), rg.total_q(), s.o_row(), "2 threads vs 1 thread");
        }
    }
}

TEST_CASE("varlen: nothing to do (no sequences, or none with queries) writes nothing") {
    Rt rt(2, best_default());
    const Shape s{4, 2, 8, 8};
    Ragged rg(s);
    std::vector<float> out(64, test::kSentinel);
    rg.run(rt, true, out.data());  // num_seqs = 0
    CHECK(all_sentinel(out));
    for (int64_t nk : {0, 5, 300}) rg.add(SeqData(s, 0, nk, 9));
    rg.run(rt, true, out.data());
    rg.run(rt, false, out.data());
    CHECK(all_sentinel(out));
}
