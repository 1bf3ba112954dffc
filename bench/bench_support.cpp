#include "bench/bench_support.hpp"

#include "mha/runtime.hpp"
#include "mha/softmax.hpp"

#include <cpuid.h>
#include <fcntl.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <numeric>
#include <random>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <thread>

#include <nlohmann/json.hpp>

#ifdef MHA_HAVE_DNNL
#include <dnnl.h>
#include <omp.h>

#include <dnnl.hpp>
#endif
#include <cmath>
#ifdef MHA_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace mha::bench {

double fma_gflops_avx512(int64_t iters);
double fma_gflops_avx2(int64_t iters);
float read_sum_avx512(const float *x, int64_t n);
float read_sum_avx2(const float *x, int64_t n);
double k_loop_gflops_avx512(const char *kernel, int64_t reps, int64_t kc, const float *a, const float *b);
double k_loop_gflops_avx2(const char *kernel, int64_t reps, int64_t kc, const float *a, const float *b);

std::string GemmShape::str() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + " " + ta + tb;
}

const std::vector<GemmShape> &gemm_shapes() {
    static const std::vector<GemmShape> shapes = {
        {"square", 'N', 'N', 256, 256, 256, false},
        {"square", 'N', 'N', 512, 512, 512, false},
        {"square", 'N', 'N', 1024, 1024, 1024, true},
        {"square", 'N', 'N', 2048, 2048, 2048, false},
        {"attn QK^T", 'N', 'T', 512, 512, 64, true},
        {"attn PV", 'N', 'N', 512, 64, 512, true},
        {"attn QK^T", 'N', 'T', 2048, 2048, 64, false},
        {"attn PV", 'N', 'N', 2048, 64, 2048, false},
        {"proj QKV", 'N', 'T', 4096, 1536, 512, false},
        {"proj out", 'N', 'T', 4096, 512, 512, true},
        // A few rows against a weight matrix (a decode step's tokens): B streams from L3 and the
        // kernels' strips are short.
        {"few rows", 'N', 'T', 1, 1536, 512, false},
        {"few rows", 'N', 'N', 4, 1536, 512, false},
        // 8 tokens against a weight stored N x K, as PyTorch's are: B^T transposed in registers
        // (macro_bt_rows; see gemm/transpose_variant.hpp for its transposes).
        {"few rows", 'N', 'T', 8, 1536, 512, false},
        {"few rows", 'N', 'T', 16, 1536, 512, false},
        {"few rows", 'N', 'T', 32, 1536, 512, false},
        {"few rows", 'N', 'N', 16, 1536, 512, false},
        // A few strips against a large B stored K x N: read in place, once from memory (see
        // gemm::in_place_rows).
        {"few rows", 'N', 'N', 32, 2000, 1000, false},
        {"few rows", 'N', 'N', 64, 1536, 512, false},
        // One token against a 4096 -> 1024 weight stored K x N: B's rows 4 KiB apart, which the
        // strip reads in chunks of depth (see sgemm_sup).
        {"few rows", 'N', 'N', 1, 1024, 4096, false},
        // 16 and 32 tokens against a 1024 x 1024 weight stored K x N: B's rows 4 KiB apart, read
        // in chunks of depth by every strip at once (see gemm::chunked_rows).
        {"few rows", 'N', 'N', 16, 1024, 1024, false},
        {"few rows", 'N', 'N', 32, 1024, 1024, false},
        // Small products against B^T: a head's Q K^T at L64 D64 (B^T small enough for the usual
        // paths) and 16 rows against a 128 x 128 weight stored N x K (B^T read in place against
        // A^T's packed panel; see gemm::sgemm_bt).
        {"small NT", 'N', 'T', 64, 64, 64, false},
        {"small NT", 'N', 'T', 16, 128, 128, false},
        // A weight packed once (SgemmPackedB) for every product against it: the projection and a
        // decode step's tokens, against the same products packing B per call.
        {"packed B", 'N', 'T', 4096, 1536, 512, false, true},
        {"packed B", 'N', 'T', 16, 1536, 512, false, true},
        {"packed B", 'N', 'T', 1, 1536, 512, false, true},
    };
    return shapes;
}

std::string SoftmaxShape::str() const { return std::to_string(rows) + "x" + std::to_string(cols); }

const std::vector<SoftmaxShape> &softmax_shapes() {
    static const std::vector<SoftmaxShape> shapes = {
        {1024, 128, true}, {512, 512, true}, {64, 4096, true}, {8, 32768, false}};
    return shapes;
}

void scalar_softmax(int64_t rows, int64_t cols, const float *x, float *y) {
    for (int64_t r = 0; r < rows; ++r) {
        const float *xr = x + r * cols;
        float *yr = y + r * cols;
        float m = xr[0];
        for (int64_t c = 1; c < cols; ++c) m = std::max(m, xr[c]);
        float s = 0;
        for (int64_t c = 0; c < cols; ++c) s += yr[c] = std::exp(xr[c] - m);
        for (int64_t c = 0; c < cols; ++c) yr[c] /= s;
    }
}

#ifdef MHA_HAVE_DNNL
struct DnnlSoftmax::Impl {
    dnnl::engine engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream stream{engine};
    dnnl::softmax_forward prim;
    dnnl::memory src, dst;
    int threads = 1;
};

DnnlSoftmax::DnnlSoftmax(int64_t rows, int64_t cols, const float *x, float *y, int threads) : impl_(new Impl) {
    impl_->threads = threads;
    omp_set_num_threads(threads);
    const dnnl::memory::desc md({rows, cols}, dnnl::memory::data_type::f32, dnnl::memory::format_tag::ab);
    const dnnl::softmax_forward::desc d(dnnl::prop_kind::forward_inference, md, 1);
    impl_->prim = dnnl::softmax_forward(dnnl::softmax_forward::primitive_desc(d, impl_->engine));
    impl_->src = dnnl::memory(md, impl_->engine, const_cast<float *>(x));
    impl_->dst = dnnl::memory(md, impl_->engine, y);
}

DnnlSoftmax::~DnnlSoftmax() { delete impl_; }

void DnnlSoftmax::run() {
    omp_set_num_threads(impl_->threads);
    impl_->prim.execute(impl_->stream, {{DNNL_ARG_SRC, impl_->src}, {DNNL_ARG_DST, impl_->dst}});
    impl_->stream.wait();
}
#else
struct DnnlSoftmax::Impl {};
DnnlSoftmax::DnnlSoftmax(int64_t, int64_t, const float *, float *, int) { std::abort(); }
DnnlSoftmax::~DnnlSoftmax() = default;
void DnnlSoftmax::run() { std::abort(); }
#endif

std::string AttentionShape::str() const {
    return "L" + std::to_string(len) + " H" + std::to_string(heads) + " D" + std::to_string(dim) + (causal ? " causal" : "");
}

const std::vector<AttentionShape> &attention_shapes() {
    static const std::vector<AttentionShape> shapes = [] {
        std::vector<AttentionShape> v;
        for (int64_t len : {128, 512, 2048, 4096})
            for (int64_t dim : {64, 128})
                for (bool causal : {false, true})
                    v.push_back({1, len, 8, dim, causal, (len == 512 || len == 2048) && dim == 64});
        return v;
    }();
    return shapes;
}

std::string LayerShape::str() const {
    return "B" + std::to_string(batch) + " L" + std::to_string(len) + " E" + std::to_string(embed) + " H" +
           std::to_string(heads);
}

std::string LayerShape::torch_str() const {
    return "B" + std::to_string(batch) + ",L" + std::to_string(len) + ",E" + std::to_string(embed) + ",H" +
           std::to_string(heads);
}

double LayerShape::flops() const {
    const double B = static_cast<double>(batch), L = static_cast<double>(len), E = static_cast<double>(embed);
    return B * (4.0 * 2.0 * L * E * E + 4.0 * L * L * E);
}

const std::vector<LayerShape> &layer_shapes() {
    static const std::vector<LayerShape> shapes = {
        {8, 128, 512, 8, true}, {4, 512, 512, 8, false}, {1, 2048, 512, 8, true}};
    return shapes;
}

void dnnl_layer(int threads, const LayerShape &s, const float *x, const float *w_in, const float *b_in,
                const float *w_out, const float *b_out, float *out, std::vector<float> &scratch,
                std::vector<float> &scores) {
    const int64_t T = s.batch * s.len, E = s.embed;
    scratch.resize(static_cast<size_t>(4 * T * E));
    float *q = scratch.data(), *k = q + T * E, *v = k + T * E, *o = v + T * E;
    auto linear = [&](const float *in, const float *w, const float *b, float *y) {
        dnnl_sgemm(threads, 'N', 'T', T, E, E, 1.0f, in, E, w, E, 0.0f, y, E);
        for (int64_t t = 0; t < T; ++t)
            for (int64_t e = 0; e < E; ++e) y[t * E + e] += b[e];
    };
    linear(x, w_in, b_in, q);
    linear(x, w_in + E * E, b_in + E, k);
    linear(x, w_in + 2 * E * E, b_in + 2 * E, v);
    dnnl_attention(threads, 256, s.batch, s.len, s.heads, E / s.heads, false, q, k, v, o, scores);
    linear(o, w_out, b_out, out);
}

std::vector<double> torch_layer_ms(int threads, const std::vector<LayerShape> &shapes, double budget_s,
                                   std::string *why) {
    std::string script = MHA_BENCH_DIR "/torch_layer.py";  // the source tree, else the installed copy
    if (access(script.c_str(), R_OK) != 0) script = MHA_DATA_DIR "/torch_layer.py";
    if (const char *env = std::getenv("MHA_TORCH_SCRIPT")) script = env;
    if (access("/usr/bin/python3", X_OK) != 0 || access(script.c_str(), R_OK) != 0) {
        *why = "no /usr/bin/python3 or no " + script;
        return {};
    }
    // Its thread counts pinned before torch loads (the script sets them too when they are unset).
    const std::string n = std::to_string(threads);
    std::string cmd = "OMP_NUM_THREADS=" + n + " OPENBLAS_NUM_THREADS=" + n + " MKL_NUM_THREADS=" + n +
                      " /usr/bin/python3 '" + script + "' --threads " + n + " --budget " + std::to_string(budget_s);
    for (const auto &s : shapes) cmd += " " + s.torch_str();
    cmd += " 2>/dev/null";
    FILE *pipe = popen(cmd.c_str(), "r");
    if (!pipe) {
        *why = "cannot run " + cmd;
        return {};
    }
    std::string text;
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, pipe)) > 0;) text.append(buf, n);
    const int rc = pclose(pipe);
    // The script prints one JSON object: {"torch": ..., "threads": N, "ms": {"<shape>": ms, ...}}.
    const auto j = nlohmann::json::parse(text, nullptr, false);
    std::vector<double> ms;
    for (const auto &s : shapes) {
        if (rc != 0 || j.is_discarded() || !j.contains("ms") || !j["ms"].contains(s.torch_str())) {
            *why = "PyTorch not available (python3-torch missing?)";
            return {};
        }
        ms.push_back(j["ms"][s.torch_str()].get<double>());
    }
    return ms;
}

std::string EncoderShape::str() const {
    return "B" + std::to_string(batch) + " L" + std::to_string(len) + " E" + std::to_string(embed) + " H" +
           std::to_string(heads) + " F" + std::to_string(ffn);
}

std::string EncoderShape::torch_str() const {
    return "B" + std::to_string(batch) + ",L" + std::to_string(len) + ",E" + std::to_string(embed) + ",H" +
           std::to_string(heads) + ",F" + std::to_string(ffn);
}

double EncoderShape::flops() const {
    const double B = static_cast<double>(batch), L = static_cast<double>(len), E = static_cast<double>(embed),
                 F = static_cast<double>(ffn);
    return B * (8.0 * L * E * E + 4.0 * L * E * F + 4.0 * L * L * E);
}

const std::vector<EncoderShape> &encoder_shapes() {
    static const std::vector<EncoderShape> shapes = {{8, 128, 512, 8, 2048, true}, {1, 2048, 512, 8, 2048, false}};
    return shapes;
}

#ifdef MHA_HAVE_DNNL
// glibc malloc settings of the PyTorch anchor's process (see spawn below): the caller's, else ours.
static std::vector<std::string> torch_malloc_env() {
    std::vector<std::string> out;
    for (const char *kv : {"MALLOC_MMAP_THRESHOLD_=1073741824", "MALLOC_TRIM_THRESHOLD_=4294967296"}) {
        const std::string name(kv, std::strchr(kv, '=') - kv);
        const char *own = std::getenv(name.c_str());
        out.push_back(own ? name + "=" + own : std::string(kv));
    }
    return out;
}

namespace {

// y[t] = LayerNorm(a[t] (+ b[t])) over rows of E, two passes per row; b may be NULL.
void add_layer_norm(int threads, int64_t T, int64_t E, const float *a, const float *b, const float *w,
                    const float *bias, float eps, float *y) {
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        const float *ar = a + t * E, *br = b ? b + t * E : nullptr;
        float *yr = y + t * E;
        float sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += yr[e] = ar[e] + (br ? br[e] : 0.0f);
        const float mean = sum / static_cast<float>(E);
        float sq = 0;
        for (int64_t e = 0; e < E; ++e) sq += (yr[e] - mean) * (yr[e] - mean);
        const float rstd = 1.0f / std::sqrt(sq / static_cast<float>(E) + eps);
        for (int64_t e = 0; e < E; ++e) yr[e] = (yr[e] - mean) * rstd * w[e] + bias[e];
    }
}

// y = x W^T (+ bias, then the activation; + the residual r when r is not NULL), W [n, k].
void linear(int threads, int64_t T, int64_t n, int64_t k, const float *x, const float *w, const float *bias,
            int act, const float *r, float *y) {
    dnnl_sgemm(threads, 'N', 'T', T, n, k, 1.0f, x, k, w, k, 0.0f, y, n);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t t = 0; t < T; ++t) {
        float *yr = y + t * n;
        for (int64_t j = 0; j < n; ++j) {
            float v = yr[j] + bias[j];
            if (act == 1) v = std::max(v, 0.0f);
            if (act == 2) v = 0.5f * v * (1.0f + std::erf(v * 0.70710678118654752f));
            yr[j] = r ? v + r[t * n + j] : v;
        }
    }
}

} // namespace

void dnnl_encoder_layer(int threads, const EncoderShape &s, bool gelu, bool norm_first, float eps, const float *x,
                        const EncoderTensors &w, float *out, DnnlEncoderScratch &sc) {
    const int64_t T = s.batch * s.len, E = s.embed, F = s.ffn;
    const int act = gelu ? 2 : 1;
    sc.attn.resize(static_cast<size_t>(T * E));
    sc.y.resize(static_cast<size_t>(T * E));
    sc.h.resize(static_cast<size_t>(T * F));
    const LayerShape ls = s.attention();
    if (!norm_first) {  // y = LN1(x + SA(x)), out = LN2(y + FFN(y))
        dnnl_layer(threads, ls, x, w.w_in, w.b_in, w.w_out, w.b_out, sc.attn.data(), sc.layer, sc.scores);
        add_layer_norm(threads, T, E, x, sc.attn.data(), w.norm1_w, w.norm1_b, eps, sc.y.data());
        linear(threads, T, F, E, sc.y.data(), w.w1, w.b1, act, nullptr, sc.h.data());
        linear(threads, T, E, F, sc.h.data(), w.w2, w.b2, 0, sc.y.data(), sc.attn.data());
        add_layer_norm(threads, T, E, sc.attn.data(), nullptr, w.norm2_w, w.norm2_b, eps, out);
    } else {  // y = x + SA(LN1(x)), out = y + FFN(LN2(y))
        sc.normed.resize(static_cast<size_t>(T * E));
        add_layer_norm(threads, T, E, x, nullptr, w.norm1_w, w.norm1_b, eps, sc.normed.data());
        dnnl_layer(threads, ls, sc.normed.data(), w.w_in, w.b_in, w.w_out, w.b_out, sc.attn.data(), sc.layer, sc.scores);
#pragma omp parallel for num_threads(threads) schedule(static)
        for (int64_t i = 0; i < T * E; ++i) sc.y[static_cast<size_t>(i)] = x[i] + sc.attn[static_cast<size_t>(i)];
        add_layer_norm(threads, T, E, sc.y.data(), nullptr, w.norm2_w, w.norm2_b, eps, sc.normed.data());
        linear(threads, T, F, E, sc.normed.data(), w.w1, w.b1, act, nullptr, sc.h.data());
        linear(threads, T, E, F, sc.h.data(), w.w2, w.b2, 0, sc.y.data(), out);
    }
}
#else
void dnnl_encoder_layer(int, const EncoderShape &, bool, bool, float, const float *, const EncoderTensors &, float *,
                        DnnlEncoderScratch &) {
    std::abort();
}
#endif

TorchAnchor::TorchAnchor(const char *script_name, const char *env_override, int threads,
                         const std::vector<std::string> &shapes) {
    std::string script = std::string(MHA_BENCH_DIR "/") + script_name;  // the source tree, else the installed copy
    if (access(script.c_str(), R_OK) != 0) script = std::string(MHA_DATA_DIR "/") + script_name;
    if (const char *env = std::getenv(env_override)) script = env;
    if (access("/usr/bin/python3", X_OK) != 0 || access(script.c_str(), R_OK) != 0) {
        why_ = "no /usr/bin/python3 or no " + script;
        return;
    }
    std::vector<std::string> args = {"/usr/bin/python3", script, "--threads", std::to_string(threads), "--serve"};
    for (const auto &s : shapes) args.push_back(s);
    std::vector<char *> argv;
    for (auto &a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // The child's environment: ours, with its thread counts pinned before torch loads.
    const std::string n = std::to_string(threads);
    std::vector<std::string> env_strings;
    for (char **e = environ; *e; ++e) {
        const std::string kv = *e;
        const std::string name = kv.substr(0, kv.find('='));
        if (name != "OMP_NUM_THREADS" && name != "OPENBLAS_NUM_THREADS" && name != "MKL_NUM_THREADS") env_strings.push_back(kv);
    }
    for (const char *name : {"OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"})
        env_strings.push_back(std::string(name) + "=" + n);
    if (!std::getenv("OMP_WAIT_POLICY")) env_strings.push_back("OMP_WAIT_POLICY=PASSIVE");
    // PyTorch at its best: glibc's malloc (read once, at the child's start) keeps freed memory
    // instead of unmapping it, so a call's intermediates are not page-faulted in again on every
    // call (see torch_anchor.py: B8 L128 E512 ran 19-20 ms a call without this, 14 ms with it).
    for (const std::string &kv : torch_malloc_env())
        if (!std::getenv(kv.substr(0, kv.find('=')).c_str())) env_strings.push_back(kv);
    std::vector<char *> envp;
    for (auto &e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);

    int in[2], out[2];  // in: our writes -> its stdin; out: its stdout -> our reads
    if (pipe2(in, O_CLOEXEC) != 0) {
        why_ = "pipe failed";
        return;
    }
    if (pipe2(out, O_CLOEXEC) != 0) {
        close(in[0]), close(in[1]);
        why_ = "pipe failed";
        return;
    }
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_adddup2(&fa, in[0], 0);
    posix_spawn_file_actions_adddup2(&fa, out[1], 1);
    posix_spawn_file_actions_addopen(&fa, 2, "/dev/null", O_WRONLY, 0);
    pid_t pid = -1;
    const int rc = posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), envp.data());
    posix_spawn_file_actions_destroy(&fa);
    close(in[0]);
    close(out[1]);
    if (rc != 0) {
        close(in[1]), close(out[0]);
        why_ = "cannot run /usr/bin/python3";
        return;
    }
    pid_ = pid;
    std::signal(SIGPIPE, SIG_IGN);  // a child that died answers with EOF, not a signal
    to_ = fdopen(in[1], "w");
    from_ = fdopen(out[0], "r");
    // The first line: {"ready": true, "torch": ..., "fast_path": {...}} once every layer is built.
    std::string line;
    char buf[4096];
    while (from_ && std::fgets(buf, sizeof buf, from_)) {
        line += buf;
        if (!line.empty() && line.back() == '\n') break;
    }
    const auto j = nlohmann::json::parse(line, nullptr, false);
    if (j.is_discarded() || !j.is_object() || !j.value("ready", false)) {
        why_ = "PyTorch not available (python3-torch missing?)";
        return;
    }
    version_ = j.value("torch", "");
    if (j.contains("fast_path"))
        for (const auto &[k, v] : j["fast_path"].items()) fast_[k] = v.get<bool>();
    ok_ = true;
}

TorchAnchor::~TorchAnchor() {
    if (to_) {
        std::fputs("quit\n", to_);
        std::fclose(to_);
    }
    if (from_) std::fclose(from_);
    if (pid_ > 0) {
        int status = 0;
        waitpid(pid_, &status, 0);
    }
}

bool TorchAnchor::fast_path(const std::string &shape) const {
    const auto it = fast_.find(shape);
    return it != fast_.end() && it->second;
}

TorchAnchor::Timing TorchAnchor::run(const std::string &shape) {
    if (!ok_) throw std::runtime_error("PyTorch anchor: " + why_);
    char buf[256];
    if (std::fprintf(to_, "%s\n", shape.c_str()) < 0 || std::fflush(to_) != 0 || !std::fgets(buf, sizeof buf, from_)) {
        ok_ = false;
        why_ = "the PyTorch script stopped answering";
        throw std::runtime_error("PyTorch anchor: " + why_);
    }
    // "<wall ms> <cpu ms>"
    Timing t;
    char *end = nullptr;
    t.ms = std::strtod(buf, &end);
    t.cpu_ms = std::strtod(end, nullptr);
    return t;
}

std::string DecodeShape::str() const {
    return "B" + std::to_string(batch) + " Lk" + std::to_string(kv_len) + " H" + std::to_string(heads) + "/" +
           std::to_string(kv_heads) + " D" + std::to_string(dim);
}

const std::vector<DecodeShape> &decode_shapes() {
    static const std::vector<DecodeShape> shapes = {
        {1, 1024, 32, 8, 128, true}, {1, 4096, 32, 8, 128, true}, {4, 4096, 32, 8, 128, false},
        {16, 4096, 32, 8, 128, true}};
    return shapes;
}

namespace {

uint64_t splitmix64(uint64_t &state) {
    uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

} // namespace

const std::vector<int64_t> &serving_prompt_lens() {
    static const std::vector<int64_t> lens = [] {
        uint64_t state = 0x5e1f13;
        std::vector<int64_t> v;
        for (int i = 0; i < 8; ++i) {
            const double u = static_cast<double>(splitmix64(state) >> 11) * 0x1p-53;
            v.push_back(static_cast<int64_t>(64.0 * std::pow(32.0, u) + 0.5));
        }
        *std::min_element(v.begin(), v.end()) = 64;
        *std::max_element(v.begin(), v.end()) = 2048;
        return v;
    }();
    return lens;
}

std::string ServingHeads::str() const {
    return "H" + std::to_string(heads) + (kv_heads == heads ? "" : "/" + std::to_string(kv_heads)) + " D" +
           std::to_string(dim);
}

const std::vector<ServingHeads> &serving_prefill_heads() {
    static const std::vector<ServingHeads> shapes = {{8, 8, 64, true}, {32, 8, 128, false}};
    return shapes;
}

std::string ContinuousShape::str() const {
    return std::to_string(prefills) + "x" + std::to_string(chunk) + "@" + std::to_string(prefill_cached) + "+" +
           std::to_string(decodes) + "x1@" + std::to_string(decode_cached) + " " + heads.str();
}

const ContinuousShape &serving_continuous_shape() {
    static const ContinuousShape shape = {2, 512, 1024, 30, 2048, {32, 8, 128, true}};
    return shape;
}

double causal_pairs(int64_t q, int64_t kv) {
    const double Q = static_cast<double>(q), K = static_cast<double>(kv);
    return Q * (K - Q) + Q * (Q + 1) / 2;
}

void fill_hashed(float *x, size_t n, uint64_t seed, float scale) {
    for (size_t i = 0; i < n; ++i) {
        uint64_t state = seed * 0x100000001B3ull + i;
        const double u = static_cast<double>(splitmix64(state) >> 40) * 0x1p-24;  // [0, 1)
        x[i] = static_cast<float>((2.0 * u - 1.0) * scale);
    }
}

void dnnl_attention(int threads, int64_t block_rows, int64_t batch, int64_t len, int64_t heads, int64_t dim,
                    bool causal, const float *q, const float *k, const float *v, float *out, std::vector<float> &scores) {
    static mha::Runtime softmax_rt(mha::RuntimeOptions{1, {}, {}, {}});
    const int64_t rows_per = block_rows ? block_rows : len, ld = heads * dim;
    const float scale = 1.0f / std::sqrt(static_cast<float>(dim));
    scores.resize(static_cast<size_t>(rows_per * len));
    for (int64_t b = 0; b < batch; ++b)
        for (int64_t h = 0; h < heads; ++h) {
            const float *qh = q + b * len * ld + h * dim, *kh = k + b * len * ld + h * dim, *vh = v + b * len * ld + h * dim;
            float *oh = out + b * len * ld + h * dim;
            for (int64_t i0 = 0; i0 < len; i0 += rows_per) {
                const int64_t rows = std::min(rows_per, len - i0);
                // With blocks, causal rows [i0, i0 + rows) need keys [0, i0 + rows) only.
                const int64_t keys = causal && block_rows ? i0 + rows : len;
                dnnl_sgemm(threads, 'N', 'T', rows, keys, dim, scale, qh + i0 * ld, ld, kh, ld, 0.0f, scores.data(), keys);
                if (causal)
                    for (int64_t r = 0; r < rows; ++r)
                        for (int64_t j = i0 + r + 1; j < keys; ++j) scores[static_cast<size_t>(r * keys + j)] = -INFINITY;
                mha::softmax(softmax_rt, rows, keys, scores.data(), keys, scores.data(), keys);
                dnnl_sgemm(threads, 'N', 'N', rows, dim, keys, 1.0f, scores.data(), keys, vh, ld, 0.0f, oh + i0 * ld, ld);
            }
        }
}

namespace {

// Runs fn(t) on `threads` threads at once, this one and threads - 1 new ones, and returns the sum
// of what they return. This thread takes a share rather than waiting for the others to join: when
// it waited, it could resume on the other core, and the call timed right after the probe found
// its caches cold. Xeon (model 207), sgemm n^3 on a 2-thread and a 1-thread runtime (the same
// one-thread code below the thresholds) beside the 2-thread FMA probe, 400 rounds in shuffled
// order, 1-thread time / 2-thread time: n = 32 0.59-0.93, 64 0.96-0.98, 96 0.90-0.98 with the
// probe on two new threads; 0.98-0.99, 0.98-1.01 and 1.00-1.02 with this thread taking a share.
template <class Fn>
double sum_over_threads(int threads, const Fn &fn) {
    if (threads == 1) return fn(0);
    std::vector<double> per(static_cast<size_t>(threads));
    std::vector<std::thread> pool;
    for (int t = 1; t < threads; ++t) pool.emplace_back([&, t] { per[static_cast<size_t>(t)] = fn(t); });
    per[0] = fn(0);
    for (auto &th : pool) th.join();
    double sum = 0;
    for (double x : per) sum += x;
    return sum;
}

template <class Fn>
double median_of_five(const Fn &fn) {
    std::vector<double> runs;
    for (int rep = 0; rep < 5; ++rep) runs.push_back(fn());
    std::sort(runs.begin(), runs.end());
    return runs[runs.size() / 2];
}

// GFLOP/s of `threads` threads each running `iters` rounds of the FMA probe.
double fma_probe_run(int threads, int64_t iters) {
    const bool avx512 = cpu_supports(Isa::avx512);
    return sum_over_threads(threads, [&](int) { return avx512 ? fma_gflops_avx512(iters) : fma_gflops_avx2(iters); });
}

} // namespace

double measure_fma_peak_gflops(int threads) {
    fma_probe_run(1, 1 << 22);  // warm up the wide units
    return median_of_five([&] { return fma_probe_run(threads, 1 << 23); });
}

double fma_probe_gflops(int threads) { return fma_probe_run(threads, 1 << 19); }

double k_loop_gflops(Isa isa, const char *kernel, int64_t reps, int64_t kc, const float *a, const float *b) {
    return isa == Isa::avx512 ? k_loop_gflops_avx512(kernel, reps, kc, a, b) : k_loop_gflops_avx2(kernel, reps, kc, a, b);
}

// One pass of `threads` threads each streaming its share of a 256 MiB buffer, far past any L3
// here (allocated on first use and kept).
double read_probe_gbs(int threads) {
    static std::vector<float> buf(size_t{64} << 20, 1.0f);
    const int64_t per = static_cast<int64_t>(buf.size()) / threads;
    const bool avx512 = cpu_supports(Isa::avx512);
    const auto t0 = std::chrono::steady_clock::now();
    const double total = sum_over_threads(threads, [&](int t) {
        const float *x = buf.data() + t * per;
        return static_cast<double>(avx512 ? read_sum_avx512(x, per) : read_sum_avx2(x, per));
    });
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    volatile double sink = total;  // keeps the reads
    (void)sink;
    return static_cast<double>(per * threads) * sizeof(float) / s * 1e-9;
}

double measure_read_bandwidth_gbs(int threads) {
    read_probe_gbs(threads);  // first touch of the buffer
    return median_of_five([&] { return read_probe_gbs(threads); });
}

void ensure_anchor_environment(char **argv) {
    // Idle anchor threads must not spin on the cores the next measurement uses: OpenBLAS's pool
    // otherwise busy-waits for about 2^28 cycles after each call, and libgomp (oneDNN) spins too.
    bool changed = false;
    auto set_default = [&](const char *name, const char *value) {
        if (!std::getenv(name)) {
            setenv(name, value, 1);
            changed = true;
        }
    };
#ifdef MHA_HAVE_OPENBLAS
    // Debian's OpenBLAS misdetects these CPUs; name the kernel set the CPU can run (SkylakeX's
    // kernels are AVX-512 and die with SIGILL on a CPU without it, such as AMD Zen 3).
    set_default("OPENBLAS_CORETYPE", __builtin_cpu_supports("avx512f") ? "SkylakeX" : "Haswell");
    set_default("OPENBLAS_THREAD_TIMEOUT", "4");
#endif
#ifdef MHA_HAVE_DNNL
    set_default("OMP_WAIT_POLICY", "PASSIVE");
#endif
    if (changed) execv("/proc/self/exe", argv);  // returns only on failure: run on as we are
}

std::string anchor_environment() {
    std::string out;
    for (const char *name : {"OPENBLAS_CORETYPE", "OPENBLAS_THREAD_TIMEOUT", "OMP_WAIT_POLICY"})
        if (const char *v = std::getenv(name)) out += std::string(out.empty() ? "" : " ") + name + "=" + v;
    for (const std::string &kv : torch_malloc_env()) out += " " + kv;  // (PyTorch's process)
    return out;
}

Machine machine() {
    Machine m;
    m.cpu = cpu_model_name();
    m.caches = detect_cache_sizes();
    m.hardware_threads = std::thread::hardware_concurrency();
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (__get_cpuid(0, &a, &b, &c, &d)) {
        char v[13] = {};
        std::memcpy(v, &b, 4);
        std::memcpy(v + 4, &d, 4);
        std::memcpy(v + 8, &c, 4);
        m.vendor = v;
    }
    m.family = m.caches.family;  // the display family (base + extended from 15 on)
    if (__get_cpuid(1, &a, &b, &c, &d)) {  // the display model, as Linux (and lscpu) compose it
        const int model = static_cast<int>((a >> 4) & 0xf);
        m.model = m.family >= 6 ? model | static_cast<int>((a >> 12) & 0xf0) : model;
    }
    return m;
}

bool has_dnnl() {
#ifdef MHA_HAVE_DNNL
    return true;
#else
    return false;
#endif
}

bool has_openblas() {
#ifdef MHA_HAVE_OPENBLAS
    return true;
#else
    return false;
#endif
}

void dnnl_sgemm(int threads, char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha, const float *a,
                int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
#ifdef MHA_HAVE_DNNL
    omp_set_num_threads(threads);
    ::dnnl_sgemm(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);  // row-major, like ours
#else
    (void)threads, (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b,
        (void)ldb, (void)beta, (void)c, (void)ldc;
    std::abort();
#endif
}

void openblas_sgemm(int threads, char ta, char tb, int64_t m, int64_t n, int64_t k, float alpha,
                    const float *a, int64_t lda, const float *b, int64_t ldb, float beta, float *c, int64_t ldc) {
#ifdef MHA_HAVE_OPENBLAS
    openblas_set_num_threads(threads);
    cblas_sgemm(CblasRowMajor, ta == 'N' ? CblasNoTrans : CblasTrans, tb == 'N' ? CblasNoTrans : CblasTrans,
                static_cast<int>(m), static_cast<int>(n), static_cast<int>(k), alpha, a, static_cast<int>(lda), b,
                static_cast<int>(ldb), beta, c, static_cast<int>(ldc));
#else
    (void)threads, (void)ta, (void)tb, (void)m, (void)n, (void)k, (void)alpha, (void)a, (void)lda, (void)b,
        (void)ldb, (void)beta, (void)c, (void)ldc;
    std::abort();
#endif
}

namespace {

double process_cpu_seconds() {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

} // namespace

std::vector<double> time_interleaved(const std::vector<std::function<void()>> &fns, double budget_s, int min_reps,
                                     std::vector<double> *cpu_per_wall, const std::function<void()> &before) {
    using clock = std::chrono::steady_clock;
    for (const auto &fn : fns) fn();  // warm-up
    std::vector<std::vector<double>> t(fns.size());
    std::vector<double> cpu(fns.size(), 0.0), wall(fns.size(), 0.0);
    std::vector<size_t> order(fns.size());
    std::iota(order.begin(), order.end(), size_t{0});
    std::mt19937 rng(12345);
    const auto start = clock::now();
    for (int rep = 0; rep < min_reps || (std::chrono::duration<double>(clock::now() - start).count() < budget_s && rep < 1000);
         ++rep)
        // Each round runs the functions in a new (seeded) order, so none always runs right after the
        // same other one: a short call right after the multi-thread probe started about 8 us late on
        // Zen 3 (the first of a row was measured at 0.18x the same call placed elsewhere), and a
        // rotation would keep that neighbour.
        for (std::shuffle(order.begin(), order.end(), rng); size_t i : order) {
            if (before) before();
            const double c0 = process_cpu_seconds();
            const auto t0 = clock::now();
            fns[i]();
            const double dt = std::chrono::duration<double>(clock::now() - t0).count();
            cpu[i] += process_cpu_seconds() - c0;
            wall[i] += dt;
            t[i].push_back(dt);
        }
    if (cpu_per_wall) {
        cpu_per_wall->clear();
        for (size_t i = 0; i < fns.size(); ++i) cpu_per_wall->push_back(wall[i] > 0 ? cpu[i] / wall[i] : 0.0);
    }
    std::vector<double> medians;
    for (auto &v : t) {
        std::sort(v.begin(), v.end());
        medians.push_back(v[v.size() / 2]);
    }
    return medians;
}

double time_median(const std::function<void()> &fn, double budget_s, int min_reps) {
    return time_interleaved({fn}, budget_s, min_reps)[0];
}

double time_median_after(const std::function<void()> &before, const std::function<void()> &fn, double budget_s,
                         int min_reps) {
    using clock = std::chrono::steady_clock;
    before();
    fn();  // warm-up
    std::vector<double> t;
    const auto start = clock::now();
    while (static_cast<int>(t.size()) < min_reps ||
           (std::chrono::duration<double>(clock::now() - start).count() < budget_s && t.size() < 1000)) {
        before();
        const auto t0 = clock::now();
        fn();
        t.push_back(std::chrono::duration<double>(clock::now() - t0).count());
    }
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
}

} // namespace mha::bench
