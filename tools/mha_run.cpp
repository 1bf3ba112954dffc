// mha-run: runs a PyTorch nn.MultiheadAttention(batch_first=True) layer's weights on .npy tensors.
// Every input is read and checked before the layer runs; outputs are written only when everything
// succeeded, each through a temporary file, so a failure leaves no output behind.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "cli_args.hpp"
#include "io/npy.hpp"
#include "io/torch_mha.hpp"
#include "mha/layer.hpp"

using namespace mha;

namespace {

struct Inputs {
    int64_t B = 0, Lq = 0, Lk = 0;
    std::vector<float> query, key, value;
    io::Mask mask;
};

Inputs read_inputs(const cli::RunOptions &o, int64_t E, int64_t kdim, int64_t vdim) {
    Inputs in;
    const io::Array q = io::read_npy(o.query);
    if (q.shape.size() != 3) throw io::FileError(o.query + ": expected shape [B, Lq, " + std::to_string(E) + "], found " + q.shape_str());
    in.B = q.shape[0];
    in.Lq = q.shape[1];
    in.query = io::to_floats(o.query, q, {-1, -1, E});
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
    in.mask = io::from_torch_masks(in.B, in.Lq, in.Lk, kpm, am);
    return in;
}

int run(const cli::RunOptions &o) {
    const io::MhaWeights w = io::load_mha_weights(io::StateDict(o.weights, o.prefix), o.num_heads);
    const LayerConfig &c = w.config;
    const int64_t E = c.embed_dim;
    if (E % o.num_heads != 0)
        throw cli::UsageError("--num-heads " + std::to_string(o.num_heads) + " does not divide embed_dim " + std::to_string(E));
    const LayerWeights lw = w.view();
    const LayerConfig rc = c.resolved();
    const Inputs in = read_inputs(o, E, rc.kdim, rc.vdim);

    Runtime rt(RuntimeOptions{o.threads, {}, {}, {}});
    const Layer layer(rt, c, lw);
    LayerForward p;
    p.batch = in.B;
    p.q_len = in.Lq;
    p.kv_len = in.Lk;
    p.causal = o.causal;
    if (!in.mask.allowed.empty()) {
        p.mask = in.mask.allowed.data();
        p.mask_batch_stride = in.mask.batch_stride;
        p.mask_row_stride = in.mask.row_stride;
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
