// mha-run: runs a PyTorch nn.MultiheadAttention(batch_first=True) layer's weights on .npy tensors.
// Every input is read and checked before the layer runs; outputs are written only when everything
// succeeded, each through a temporary file, so a failure leaves no output behind.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.hpp"
#include "io/npy.hpp"
#include "io/safetensors.hpp"
#include "mha/layer.hpp"

using namespace mha;
namespace fs = std::filesystem;

namespace {

// A layer's state_dict tensors, from a directory of .npy files or a .safetensors file.
class WeightSource {
public:
    WeightSource(const std::string &path, const std::string &prefix) : path_(path), prefix_(prefix) {
        if (path.ends_with(".safetensors")) {
            st_ = io::SafeTensors::read(path);
        } else if (!fs::is_directory(path)) {
            throw io::FileError(path + ": expected a directory of .npy files or a .safetensors file, found " +
                                (fs::exists(path) ? "another kind of file" : "nothing (missing)"));
        }
    }
    bool has(const std::string &key) const {
        return st_ ? st_->contains(prefix_ + key) : fs::exists(fs::path(path_) / (key + ".npy"));
    }
    std::string where(const std::string &key) const {
        return st_ ? path_ + " [" + prefix_ + key + "]" : (fs::path(path_) / (key + ".npy")).string();
    }
    // The tensor as float32 with this shape (-1 = any), or an error naming the file.
    std::vector<float> floats(const std::string &key, const std::vector<int64_t> &shape) const {
        if (!has(key)) throw io::FileError(where(key) + ": missing (expected " + describe(shape) + " float32)");
        return io::to_floats(where(key), array(key), shape);
    }
    io::Array array(const std::string &key) const {
        return st_ ? st_->get(prefix_ + key) : io::read_npy(where(key));
    }
    static std::string describe(const std::vector<int64_t> &shape) {
        std::string s = "[";
        for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + (shape[i] < 0 ? std::string("*") : std::to_string(shape[i]));
        return s + "]";
    }

private:
    std::string path_, prefix_;
    std::optional<io::SafeTensors> st_;
};

struct Inputs {
    int64_t B = 0, Lq = 0, Lk = 0, E = 0, kdim = 0, vdim = 0;
    std::vector<float> query, key, value;
    std::vector<uint8_t> mask;  // ours: nonzero = may attend
    int64_t mask_batch_stride = 0, mask_row_stride = 0;
};

Inputs read_inputs(const cli::RunOptions &o, int64_t E, int64_t kdim, int64_t vdim) {
    Inputs in;
    const io::Array q = io::read_npy(o.query);
    if (q.shape.size() != 3) throw io::FileError(o.query + ": expected shape [B, Lq, " + std::to_string(E) + "], found " + q.shape_str());
    in.B = q.shape[0];
    in.Lq = q.shape[1];
    in.query = io::to_floats(o.query, q, {-1, -1, E});
    in.kdim = kdim;
    in.vdim = vdim;
    if (o.key.empty()) {
        if (kdim != E || vdim != E)
            throw io::FileError(o.weights + ": the weights take keys of width " + std::to_string(kdim) + " and values of width " +
                                std::to_string(vdim) + ", so --key and --value are needed");
        in.Lk = in.Lq;
    } else {
        const io::Array k = io::read_npy(o.key);
        if (k.shape.size() != 3) throw io::FileError(o.key + ": expected shape [B, Lk, kdim], found " + k.shape_str());
        in.Lk = k.shape[1];
        in.key = io::to_floats(o.key, k, {in.B, in.Lk, kdim});
        in.value = io::to_floats(o.value, io::read_npy(o.value), {in.B, in.Lk, vdim});
    }
    std::vector<uint8_t> kpm, am;
    if (!o.key_padding_mask.empty()) kpm = io::to_bools(o.key_padding_mask, io::read_npy(o.key_padding_mask), {in.B, in.Lk});
    if (!o.attn_mask.empty()) am = io::to_bools(o.attn_mask, io::read_npy(o.attn_mask), {in.Lq, in.Lk});
    // PyTorch's masks (nonzero = not allowed) become ours, in the most compact form that holds them.
    if (!kpm.empty() && am.empty()) {
        in.mask.resize(kpm.size());
        for (size_t i = 0; i < kpm.size(); ++i) in.mask[i] = !kpm[i];
        in.mask_batch_stride = in.Lk;
    } else if (kpm.empty() && !am.empty()) {
        in.mask.resize(am.size());
        for (size_t i = 0; i < am.size(); ++i) in.mask[i] = !am[i];
        in.mask_row_stride = in.Lk;
    } else if (!kpm.empty()) {
        in.mask.resize(static_cast<size_t>(in.B * in.Lq * in.Lk));
        for (int64_t b = 0; b < in.B; ++b)
            for (int64_t i = 0; i < in.Lq; ++i)
                for (int64_t j = 0; j < in.Lk; ++j)
                    in.mask[static_cast<size_t>((b * in.Lq + i) * in.Lk + j)] =
                        !kpm[static_cast<size_t>(b * in.Lk + j)] && !am[static_cast<size_t>(i * in.Lk + j)];
        in.mask_batch_stride = in.Lq * in.Lk;
        in.mask_row_stride = in.Lk;
    }
    return in;
}

int run(const cli::RunOptions &o) {
    const WeightSource w(o.weights, o.prefix);
    for (const char *unsupported : {"bias_k", "bias_v"})
        if (w.has(unsupported))
            throw io::FileError(w.where(unsupported) + ": add_bias_kv is not supported (expected no bias_k / bias_v)");
    const io::Array ow = w.array("out_proj.weight");
    if (ow.shape.size() != 2 || ow.shape[0] != ow.shape[1])
        throw io::FileError(w.where("out_proj.weight") + ": expected shape [E, E], found " + ow.shape_str());
    const int64_t E = ow.shape[0];
    if (E % o.num_heads != 0)
        throw cli::UsageError("--num-heads " + std::to_string(o.num_heads) + " does not divide embed_dim " + std::to_string(E));
    const auto out_w = io::to_floats(w.where("out_proj.weight"), ow, {E, E});
    const auto out_b = w.has("out_proj.bias") ? w.floats("out_proj.bias", {E}) : std::vector<float>{};
    const auto in_b = w.has("in_proj_bias") ? w.floats("in_proj_bias", {3 * E}) : std::vector<float>{};
    LayerConfig c;
    c.embed_dim = E;
    c.num_heads = o.num_heads;
    std::vector<float> in_w, qw, kw, vw;
    LayerWeights lw;
    if (w.has("in_proj_weight")) {
        in_w = w.floats("in_proj_weight", {3 * E, E});
        lw = LayerWeights::from_in_proj(c, in_w.data(), in_b.empty() ? nullptr : in_b.data(), out_w.data(),
                                        out_b.empty() ? nullptr : out_b.data());
    } else {
        qw = w.floats("q_proj_weight", {E, E});
        const io::Array ka = w.array("k_proj_weight"), va = w.array("v_proj_weight");
        if (ka.shape.size() != 2 || va.shape.size() != 2)
            throw io::FileError(w.where("k_proj_weight") + ": expected shape [E, kdim], found " + ka.shape_str());
        c.kdim = ka.shape[1];
        c.vdim = va.shape[1];
        kw = io::to_floats(w.where("k_proj_weight"), ka, {E, c.kdim});
        vw = io::to_floats(w.where("v_proj_weight"), va, {E, c.vdim});
        lw.q_weight = qw.data();
        lw.k_weight = kw.data();
        lw.v_weight = vw.data();
        lw.out_weight = out_w.data();
        if (!in_b.empty()) {
            lw.q_bias = in_b.data();
            lw.k_bias = in_b.data() + E;
            lw.v_bias = in_b.data() + 2 * E;
        }
        lw.out_bias = out_b.empty() ? nullptr : out_b.data();
    }
    const LayerConfig rc = c.resolved();
    const Inputs in = read_inputs(o, E, rc.kdim, rc.vdim);

    Runtime rt(RuntimeOptions{o.threads, {}, {}, {}});
    const Layer layer(rt, c, lw);
    LayerForward p;
    p.batch = in.B;
    p.q_len = in.Lq;
    p.kv_len = in.Lk;
    p.causal = o.causal;
    if (!in.mask.empty()) {
        p.mask = in.mask.data();
        p.mask_batch_stride = in.mask_batch_stride;
        p.mask_row_stride = in.mask_row_stride;
    }
    std::vector<float> out(static_cast<size_t>(in.B * in.Lq * E));
    std::vector<float> weights(o.attn_weights.empty() ? 0 : static_cast<size_t>(in.B * o.num_heads * in.Lq * in.Lk));
    if (!weights.empty()) p.weights = weights.data();
    std::vector<double> ms;
    for (int r = 0; r < o.repeat; ++r) {
        const auto t0 = std::chrono::steady_clock::now();
        layer.forward(rt, p, in.query.data(), in.key.empty() ? nullptr : in.key.data(),
                      in.value.empty() ? nullptr : in.value.data(), out.data());
        ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
        if (o.repeat > 1 && !o.json) std::printf("run %d: %.3f ms\n", r + 1, ms.back());
    }

    if (!o.out.empty()) io::write_npy(o.out, {in.B, in.Lq, E}, out.data());
    if (!o.attn_weights.empty()) {
        if (o.average_attn_weights) {
            const int64_t H = o.num_heads, per = in.Lq * in.Lk;
            std::vector<float> avg(static_cast<size_t>(in.B * per));
            for (int64_t b = 0; b < in.B; ++b)
                for (int64_t x = 0; x < per; ++x) {
                    double s = 0;
                    for (int64_t h = 0; h < H; ++h) s += weights[static_cast<size_t>((b * H + h) * per + x)];
                    avg[static_cast<size_t>(b * per + x)] = static_cast<float>(s / static_cast<double>(H));
                }
            io::write_npy(o.attn_weights, {in.B, in.Lq, in.Lk}, avg.data());
        } else {
            io::write_npy(o.attn_weights, {in.B, o.num_heads, in.Lq, in.Lk}, weights.data());
        }
    }

    std::vector<double> sorted = ms;
    std::sort(sorted.begin(), sorted.end());
    const double best = sorted.front(), median = sorted[sorted.size() / 2];
    const double gflops = layer.flops(p) / (best * 1e-3) * 1e-9;
    if (o.json) {
        nlohmann::json j = {{"best_ms", best}, {"median_ms", median}, {"gflops", gflops}, {"threads", rt.num_threads()},
                            {"runs_ms", ms}, {"batch", in.B}, {"q_len", in.Lq}, {"kv_len", in.Lk},
                            {"embed_dim", E}, {"num_heads", o.num_heads}, {"isa", std::string(isa_name(rt.isa()))}};
        std::printf("%s\n", j.dump().c_str());
    } else {
        std::printf("mha-run: B %ld, Lq %ld, Lk %ld, E %ld, H %ld on %d thread%s: best %.3f ms, median %.3f ms, %.1f GFLOP/s\n",
                    static_cast<long>(in.B), static_cast<long>(in.Lq), static_cast<long>(in.Lk), static_cast<long>(E),
                    static_cast<long>(o.num_heads), rt.num_threads(), rt.num_threads() > 1 ? "s" : "", best, median, gflops);
    }
    return 0;
}

} // namespace

int main(int argc, char **argv) {
    try {
        const cli::RunOptions o = cli::parse_run_args(cli::args_of(argc, argv));
        if (o.help) {
            std::fputs(cli::kRunUsage, stdout);
            return 0;
        }
        return run(o);
    } catch (const cli::UsageError &e) {
        std::fprintf(stderr, "mha-run: %s\n\n%s", e.what(), cli::kRunUsage);
        return 2;
    } catch (const io::FileError &e) {
        std::fprintf(stderr, "mha-run: %s\n", e.what());
        return 2;
    } catch (const Error &e) {
        std::fprintf(stderr, "mha-run: %s\n", e.what());
        return e.status() == Status::invalid_argument || e.status() == Status::unsupported ? 2 : 1;
    } catch (const std::exception &e) {
        std::fprintf(stderr, "mha-run: %s\n", e.what());
        return 1;
    }
}
