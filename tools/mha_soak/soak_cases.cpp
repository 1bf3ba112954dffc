#include "soak_cases.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <random>

namespace mha::soak {
namespace {

using Rng = std::mt19937_64;

int64_t uniform(Rng &g, int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
bool coin(Rng &g, double p) { return std::uniform_real_distribution<double>(0, 1)(g) < p; }

// Inputs live as long as the shared objects; a case holds plain pointers into them.
template <class T>
T *keep(Shared &s, std::vector<T> v) {
    auto p = std::make_shared<std::vector<T>>(std::move(v));
    s.keep.push_back(p);
    return p->data();
}

float *random_floats(Shared &s, Rng &g, int64_t n) {
    std::vector<float> v(static_cast<size_t>(std::max<int64_t>(n, 1)));
    std::uniform_real_distribution<float> d(-1.0f, 1.0f);
    for (auto &x : v) x = d(g);
    return keep(s, std::move(v));
}

void require(mha_status st, const char *what) {
    if (st != MHA_OK) {
        std::fprintf(stderr, "mha-soak: %s failed: %s\n", what, mha_last_error());
        std::exit(2);
    }
}

// The shared layer: E 64, 4 query heads over 2 KV heads of 16, post-norm, with biases.
constexpr int64_t kE = 64, kH = 4, kKVH = 2, kD = 16, kFfn = 96;

mha_layer_config layer_config() {
    mha_layer_config c{};
    c.embed_dim = kE;
    c.num_heads = kH;
    c.num_kv_heads = kKVH;
    c.head_dim = c.value_dim = kD;
    c.norm = MHA_NORM_POST;
    return c;
}

mha_layer_weights layer_weights(Shared &s, Rng &g) {
    mha_layer_weights w{};
    w.q_weight = random_floats(s, g, kH * kD * kE);
    w.k_weight = random_floats(s, g, kKVH * kD * kE);
    w.v_weight = random_floats(s, g, kKVH * kD * kE);
    w.out_weight = random_floats(s, g, kE * kH * kD);
    w.q_bias = random_floats(s, g, kH * kD);
    w.out_bias = random_floats(s, g, kE);
    return w;
}

// Ragged offsets of n sequences of 0..max_len rows each.
int64_t *offsets(Shared &s, Rng &g, int64_t n, int64_t max_len) {
    std::vector<int64_t> o{0};
    for (int64_t i = 0; i < n; ++i) o.push_back(o.back() + uniform(g, 0, max_len));
    return keep(s, std::move(o));
}

Case named(std::string name, size_t out_size) {
    Case c;
    c.name = std::move(name);
    c.out_size = out_size;
    return c;
}

Case sgemm_case(Shared &s, Rng &g) {
    const int64_t m = uniform(g, 1, 150), n = uniform(g, 1, 150), k = uniform(g, 1, 150);
    const char ta = coin(g, 0.5) ? 'T' : 'N', tb = coin(g, 0.5) ? 'T' : 'N';
    const int64_t lda = (ta == 'N' ? k : m) + uniform(g, 0, 3), ldb = (tb == 'N' ? n : k) + uniform(g, 0, 3),
                  ldc = n + uniform(g, 0, 3);
    const float *a = random_floats(s, g, (ta == 'N' ? m : k) * lda), *b = random_floats(s, g, (tb == 'N' ? k : n) * ldb);
    const float *c0 = random_floats(s, g, m * ldc);
    const float beta = coin(g, 0.5) ? 0.0f : 0.5f;
    Case c = named("sgemm", static_cast<size_t>(m * ldc));
    c.call = [=, rt = s.rt](std::vector<float> &out, int64_t) {
        std::copy(c0, c0 + m * ldc, out.begin());
        return mha_sgemm(rt, ta, tb, m, n, k, 0.75f, a, lda, b, ldb, beta, out.data(), ldc);
    };
    return c;
}

Case softmax_case(Shared &s, Rng &g) {
    const int64_t rows = uniform(g, 1, 64), cols = uniform(g, 1, 300), ld = cols + uniform(g, 0, 5);
    const float *x = random_floats(s, g, rows * ld);
    Case c = named("softmax", static_cast<size_t>(rows * ld));
    c.call = [=, rt = s.rt](std::vector<float> &out, int64_t) { return mha_softmax(rt, rows, cols, x, ld, out.data(), ld); };
    return c;
}

Case attention_case(Shared &s, Rng &g) {
    mha_attention_params p{};
    p.batch = uniform(g, 1, 3);
    p.q_len = coin(g, 0.3) ? 1 : uniform(g, 1, 80);  // decode-shaped calls too
    p.kv_len = coin(g, 0.5) ? p.q_len : uniform(g, 1, 120);
    p.num_kv_heads = uniform(g, 1, 2);
    p.num_heads = p.num_kv_heads * uniform(g, 1, 2);
    p.head_dim = 8 * uniform(g, 1, 3);
    p.value_dim = 8 * uniform(g, 1, 2);
    p.causal = coin(g, 0.5);
    if (coin(g, 0.4)) {
        std::vector<int32_t> lens(static_cast<size_t>(p.batch));
        for (auto &l : lens) l = static_cast<int32_t>(uniform(g, 0, p.kv_len));
        p.kv_valid_lens = keep(s, std::move(lens));
    }
    if (coin(g, 0.3)) {
        std::vector<uint8_t> mask(static_cast<size_t>(p.q_len * p.kv_len));
        for (auto &m : mask) m = coin(g, 0.8);
        p.mask = keep(s, std::move(mask));
        p.mask_row_stride = p.kv_len;
    }
    const bool weights = coin(g, 0.3);
    const size_t out_n = static_cast<size_t>(p.batch * p.q_len * p.num_heads * p.value_dim);
    const size_t w_n = weights ? static_cast<size_t>(p.batch * p.num_heads * p.q_len * p.kv_len) : 0;
    const float *q = random_floats(s, g, p.batch * p.q_len * p.num_heads * p.head_dim),
                *k = random_floats(s, g, p.batch * p.kv_len * p.num_kv_heads * p.head_dim),
                *v = random_floats(s, g, p.batch * p.kv_len * p.num_kv_heads * p.value_dim);
    Case c = named(weights ? "attention+weights" : "attention", out_n + w_n);
    // The params are copied per call: many host threads run one case at once, each into its own
    // out (ThreadSanitizer caught a shared, mutable p.weights here).
    c.call = [=, rt = s.rt](std::vector<float> &out, int64_t) {
        mha_attention_params call_p = p;
        call_p.weights = w_n ? out.data() + out_n : nullptr;
        return mha_attention(rt, &call_p, q, k, v, out.data());
    };
    return c;
}

Case varlen_case(Shared &s, Rng &g) {
    mha_varlen_params p{};
    p.num_seqs = uniform(g, 1, 4);
    p.q_offsets = offsets(s, g, p.num_seqs, 50);
    p.kv_offsets = coin(g, 0.5) ? p.q_offsets : offsets(s, g, p.num_seqs, 70);
    p.num_kv_heads = uniform(g, 1, 2);
    p.num_heads = p.num_kv_heads * 2;
    p.head_dim = p.value_dim = 16;
    p.causal = coin(g, 0.5);
    const int64_t tq = p.q_offsets[p.num_seqs], tk = p.kv_offsets[p.num_seqs];
    const float *q = random_floats(s, g, tq * p.num_heads * 16), *k = random_floats(s, g, tk * p.num_kv_heads * 16),
                *v = random_floats(s, g, tk * p.num_kv_heads * 16);
    Case c = named("attention_varlen", static_cast<size_t>(std::max<int64_t>(1, tq * p.num_heads * 16)));
    c.call = [=, rt = s.rt](std::vector<float> &out, int64_t) { return mha_attention_varlen(rt, &p, q, k, v, out.data()); };
    return c;
}

Case layer_case(Shared &s, Rng &g, bool encoder) {
    mha_layer_forward_params p{};
    p.batch = uniform(g, 1, 2);
    p.q_len = uniform(g, 1, 48);
    p.causal = coin(g, 0.5);
    if (coin(g, 0.3)) {
        std::vector<int32_t> lens(static_cast<size_t>(p.batch));
        for (auto &l : lens) l = static_cast<int32_t>(uniform(g, 1, p.q_len));
        p.kv_valid_lens = keep(s, std::move(lens));
    }
    const float *x = random_floats(s, g, p.batch * p.q_len * kE);
    Case c = named(encoder ? "encoder_forward" : "layer_forward", static_cast<size_t>(p.batch * p.q_len * kE));
    if (encoder)
        c.call = [=, rt = s.rt, l = s.encoder](std::vector<float> &out, int64_t) {
            return mha_encoder_layer_forward(rt, l, &p, x, out.data());
        };
    else
        c.call = [=, rt = s.rt, l = s.layer](std::vector<float> &out, int64_t) {
            return mha_layer_forward(rt, l, &p, x, nullptr, nullptr, out.data());
        };
    return c;
}

Case layer_varlen_case(Shared &s, Rng &g, bool encoder) {
    const int64_t n = uniform(g, 1, 4), *off = offsets(s, g, n, 40);
    const int causal = coin(g, 0.5);
    const float *x = random_floats(s, g, off[n] * kE);
    Case c = named(encoder ? "encoder_forward_varlen" : "layer_forward_varlen", static_cast<size_t>(std::max<int64_t>(1, off[n] * kE)));
    if (encoder)
        c.call = [=, rt = s.rt, l = s.encoder](std::vector<float> &out, int64_t) {
            return mha_encoder_layer_forward_varlen(rt, l, n, off, causal, x, out.data());
        };
    else
        c.call = [=, rt = s.rt, l = s.layer](std::vector<float> &out, int64_t) {
            return mha_layer_forward_varlen(rt, l, n, off, causal, x, out.data());
        };
    return c;
}

// A generation: prefill a prompt through the cached layer, decode token by token, fork the
// sequence and attend over the fork, read some cached rows back, release both. Every output is
// compared; the sequence ids are the call's own.
Case generation_case(Shared &s, Rng &g) {
    const int64_t prompt = uniform(g, 1, 70), steps = uniform(g, 1, 6);
    const float *x = random_floats(s, g, (prompt + steps) * kE), *q = random_floats(s, g, kH * kD);
    const size_t out_n = static_cast<size_t>((prompt + steps) * kE), att_n = kH * kD, read_n = 2 * kKVH * kD;
    Case c = named("generation", out_n + att_n + read_n + 2);
    c.call = [=, rt = s.rt, l = s.layer, cache = s.cache](std::vector<float> &out, int64_t base) {
        const int64_t seq = base, fork = base + 1;
        mha_layer_cached_params p{};
        p.num_seqs = 1;
        p.seq_ids = &seq;
        p.causal = 1;
        mha_status st = MHA_OK;
        int64_t pos = 0;
        for (int64_t step = -1; step < steps && st == MHA_OK; ++step) {
            const int64_t n = step < 0 ? prompt : 1, off[2] = {0, n};
            p.q_offsets = off;
            st = mha_layer_forward_cached(rt, l, cache, &p, x + pos * kE, out.data() + pos * kE);
            pos += n;
        }
        if (st == MHA_OK) st = mha_kv_cache_fork(cache, seq, fork);
        if (st == MHA_OK) {
            mha_cached_params cp{};
            const int64_t qoff[2] = {0, 1};
            cp.num_seqs = 1;
            cp.seq_ids = &fork;
            cp.q_offsets = qoff;
            cp.num_heads = kH;
            cp.causal = 1;
            st = mha_attention_cached(rt, cache, &cp, q, out.data() + out_n);
        }
        int64_t len = 0;
        if (st == MHA_OK) st = mha_kv_cache_seq_len(cache, fork, &len);
        if (st == MHA_OK) {
            out[out_n + att_n + read_n] = static_cast<float>(len);
            st = mha_kv_cache_read(cache, fork, len - 1, 1, out.data() + out_n + att_n, out.data() + out_n + att_n + kKVH * kD);
        }
        // Release what exists, whatever happened above, so a failure never leaks the cache's blocks.
        int64_t ignored = 0;
        if (mha_kv_cache_seq_len(cache, fork, &ignored) == MHA_OK && mha_kv_cache_release(cache, fork) != MHA_OK) st = MHA_INTERNAL;
        if (mha_kv_cache_seq_len(cache, seq, &ignored) == MHA_OK && mha_kv_cache_release(cache, seq) != MHA_OK) st = MHA_INTERNAL;
        out[out_n + att_n + read_n + 1] = static_cast<float>(st);
        return st;
    };
    return c;
}

// Building objects while others serve: a layer from PyTorch's in_proj layout, one forward, and
// the cache queries that take no sequence.
Case build_case(Shared &s, Rng &g) {
    const int64_t E = 32, H = 2, L = uniform(g, 1, 20);
    const float *in_w = random_floats(s, g, 3 * E * E), *in_b = random_floats(s, g, 3 * E),
                *out_w = random_floats(s, g, E * E), *x = random_floats(s, g, L * E);
    Case c = named("layer_create+forward", static_cast<size_t>(L * E + 3));
    c.call = [=, rt = s.rt, cache = s.cache](std::vector<float> &out, int64_t) {
        mha_layer_config lc{};
        lc.embed_dim = E;
        lc.num_heads = H;
        mha_layer_weights w{};
        mha_status st = mha_layer_weights_from_in_proj(&lc, in_w, in_b, out_w, nullptr, &w);
        mha_layer *layer = nullptr;
        if (st == MHA_OK) st = mha_layer_create(rt, &lc, &w, &layer);
        mha_layer_forward_params p{};
        p.batch = 1;
        p.q_len = L;
        if (st == MHA_OK) st = mha_layer_forward(rt, layer, &p, x, nullptr, nullptr, out.data());
        mha_layer_destroy(layer);
        mha_kv_cache_config cfg{};
        uint64_t bytes = 0, scratch = 0;
        if (st == MHA_OK) st = mha_kv_cache_get_config(cache, &cfg);
        if (st == MHA_OK) st = mha_kv_cache_bytes(cache, &bytes);
        if (st == MHA_OK) st = mha_runtime_scratch_bytes(rt, &scratch);
        out[L * E] = static_cast<float>(cfg.block_tokens);
        out[L * E + 1] = static_cast<float>(bytes);
        out[L * E + 2] = scratch > 0 ? 1.0f : 0.0f;
        return st;
    };
    return c;
}

// Bad input of many kinds: each must fail with its status and a message, and write nothing.
Case bad_case(Shared &s, Rng &g) {
    const float *x = random_floats(s, g, 200 * 2 * kKVH * kD);
    const int kind = static_cast<int>(uniform(g, 0, 7));
    Case c = named("bad input " + std::to_string(kind), 64 * 64);
    c.call = [=, rt = s.rt, l = s.layer, cache = s.cache, tiny = s.tiny_cache](std::vector<float> &out, int64_t base) {
        mha_status st = MHA_OK;
        switch (kind) {
        case 0: st = mha_sgemm(rt, 'N', 'N', 8, 8, 8, 1.0f, x, 7, x, 8, 0.0f, out.data(), 8); break;  // lda < k
        case 1: st = mha_softmax(rt, -1, 8, x, 8, out.data(), 8); break;
        case 2: {
            mha_attention_params p{};
            p.batch = p.q_len = p.kv_len = 4;
            p.num_heads = 3;
            p.num_kv_heads = 2;  // 3 heads over 2 KV heads
            p.head_dim = p.value_dim = 8;
            st = mha_attention(rt, &p, x, x, x, out.data());
            break;
        }
        case 3: {
            mha_layer_forward_params p{};
            p.batch = 1;
            p.q_len = 8;
            st = mha_layer_forward(rt, l, &p, nullptr, nullptr, nullptr, out.data());  // NULL query
            break;
        }
        case 4: st = mha_kv_cache_append(rt, tiny, base, 200, x, x); break;  // more tokens than the cache holds
        case 5: {
            const int64_t unknown = base, off[2] = {0, 1};
            mha_cached_params p{};
            p.num_seqs = 1;
            p.seq_ids = &unknown;
            p.q_offsets = off;
            p.num_heads = kH;
            st = mha_attention_cached(rt, cache, &p, x, out.data());  // a sequence the cache does not hold
            break;
        }
        case 6: st = mha_kv_cache_read(cache, base, 0, 1, out.data(), nullptr); break;
        default: {
            const int64_t off[3] = {0, 5, 3};  // decreasing offsets
            st = mha_layer_forward_varlen(rt, l, 2, off, 0, x, out.data());
            break;
        }
        }
        if (st != MHA_OK && mha_last_error()[0] == '\0') return MHA_INTERNAL;  // a failure without a message
        return st;
    };
    return c;
}

} // namespace

Shared make_shared_objects(int runtime_threads, uint64_t seed) {
    Shared s;
    Rng g(seed ^ 0x5eed);
    require(mha_runtime_create(runtime_threads, &s.rt), "mha_runtime_create");
    const mha_layer_config lc = layer_config();
    const mha_layer_weights lw = layer_weights(s, g);
    require(mha_layer_create(s.rt, &lc, &lw, &s.layer), "mha_layer_create");
    mha_encoder_config ec{};
    ec.attention = lc;
    ec.attention.norm = MHA_NORM_PRE;
    ec.ffn_dim = kFfn;
    ec.activation = MHA_ACT_GELU;
    mha_encoder_weights ew{};
    ew.attention = layer_weights(s, g);
    ew.linear1_weight = random_floats(s, g, kFfn * kE);
    ew.linear1_bias = random_floats(s, g, kFfn);
    ew.linear2_weight = random_floats(s, g, kE * kFfn);
    require(mha_encoder_layer_create(s.rt, &ec, &ew, &s.encoder), "mha_encoder_layer_create");
    mha_kv_cache_config cc{};
    cc.num_kv_heads = kKVH;
    cc.head_dim = cc.value_dim = kD;
    cc.max_tokens = 64 * 1024;  // every host thread's two sequences of at most 76 tokens, many times over
    require(mha_kv_cache_create(s.rt, &cc, &s.cache), "mha_kv_cache_create");
    cc.max_tokens = 1;  // one block
    require(mha_kv_cache_create(s.rt, &cc, &s.tiny_cache), "mha_kv_cache_create (tiny)");
    return s;
}

void destroy_shared_objects(Shared &s) {
    mha_kv_cache_destroy(s.tiny_cache);
    mha_kv_cache_destroy(s.cache);
    mha_encoder_layer_destroy(s.encoder);
    mha_layer_destroy(s.layer);
    mha_runtime_destroy(s.rt);
    s = Shared{};
}

std::vector<Case> make_cases(Shared &s, size_t count, uint64_t seed) {
    Rng g(seed);
    std::vector<Case> cases;
    for (size_t i = 0; i < count; ++i) {
        switch (i % 11) {
        case 0: cases.push_back(sgemm_case(s, g)); break;
        case 1: cases.push_back(softmax_case(s, g)); break;
        case 2: cases.push_back(attention_case(s, g)); break;
        case 3: cases.push_back(varlen_case(s, g)); break;
        case 4: cases.push_back(layer_case(s, g, false)); break;
        case 5: cases.push_back(layer_case(s, g, true)); break;
        case 6: cases.push_back(layer_varlen_case(s, g, coin(g, 0.5))); break;
        case 7: cases.push_back(generation_case(s, g)); break;
        case 8: cases.push_back(build_case(s, g)); break;
        case 9: cases.push_back(bad_case(s, g)); break;
        default: cases.push_back(attention_case(s, g)); break;
        }
    }
    return cases;
}

} // namespace mha::soak
