// mha-bench: the encoder suite.
#include <cstdio>

#include "bench/encoder_fixture.hpp"
#include "bench/layer_fixture.hpp"
#include "mha/attention.hpp"

#include "bench_tool.hpp"

namespace mha::bench_tool {

// mha::EncoderLayer (post-norm, relu) at each encoder shape on every thread count, interleaved
// with (a) PyTorch 1.13's nn.TransformerEncoderLayer on its fused fast path, run in a child process
// (bench/torch_encoder.py --serve) pinned to the row's threads: each of its turns in measure()
// runs one forward pass there and the ratio uses PyTorch's own time of it; (b) the same layer
// composed from dnnl_sgemm, the oneDNN attention composition and plain loops; (c) on more than one
// thread, our layer on one. GFLOP/s counts 8 L E^2 + 4 L E F + 4 L^2 E per sequence.
// Then the Add & Norm's share of the attention layer at B8 L128: mha::Layer with norm = post
// against the same layer with norm = none, interleaved.
void suite_encoder(Context &ctx, const std::regex *filter, std::vector<Row> &rows) {
    std::vector<bench::EncoderShape> shapes;
    for (const auto &s : bench::encoder_shapes())
        if ((!ctx.opt.quick || s.quick) && selected(filter, "encoder/forward/" + s.str()))
            shapes.push_back(s);
    const bench::LayerShape an = bench::encoder_shapes().front().attention();  // B8 L128 E512 H8
    const bool add_norm = selected(filter, "encoder/add&norm/" + an.str());
    for (int threads : ctx.opt.threads) {
        std::unique_ptr<bench::TorchAnchor> torch;
        if (!shapes.empty()) {
            std::fprintf(stderr, "encoder: PyTorch nn.TransformerEncoderLayer, threads=%d\n", threads);
            std::vector<std::string> torch_shapes;
            for (const auto &s : shapes) torch_shapes.push_back(s.torch_str());
            torch = std::make_unique<bench::TorchAnchor>("torch_encoder.py", "MHA_TORCH_ENCODER_SCRIPT", threads, torch_shapes);
            if (!torch->ok()) std::fprintf(stderr, "encoder: PyTorch anchor skipped: %s\n", torch->why().c_str());
        }
        for (const auto &s : shapes) {
            std::fprintf(stderr, "encoder %s threads=%d\n", s.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}}), rt1(RuntimeOptions{1, {}, {}, {}});
            bench::EncoderFixture f(rt, s);
            std::vector<bench::TorchAnchor::Timing> torch_times;
            std::vector<Anchor> anchors;
            if (torch->ok())
                anchors.push_back({"PyTorch", [&] { torch_times.push_back(torch->run(s.torch_str())); }, 0, &torch_times});
            if (bench::has_dnnl()) anchors.push_back({"oneDNN", [&] { f.onednn(threads); }});
            if (threads > 1) anchors.push_back({"1 thread", [&] { f.forward(rt1); }, 1});
            Row row;
            row.suite = "encoder";
            row.name = "forward";
            row.shape = s.str();
            row.threads = threads;
            row.unit = "GFLOP/s";
            measure(ctx, row, s.flops(), [&] { f.forward(rt); }, anchors, rows);
            Row &r = rows.back();
            if (!torch_times.empty()) {
                r.extra["torch_version"] = torch->version();
                r.extra["torch_fast_path"] = torch->fast_path(s.torch_str());
                if (!torch->fast_path(s.torch_str())) r.note = "PyTorch NOT on its fused path";
            }
            if (bench::has_dnnl()) r.extra["max_abs_diff_vs_oneDNN"] = f.max_abs_diff();
            r.extra["flops_counted"] = "8 L E^2 + 4 L E F + 4 L^2 E per sequence";
        }
        if (add_norm) {
            std::fprintf(stderr, "encoder add&norm %s threads=%d\n", an.str().c_str(), threads);
            Runtime rt(RuntimeOptions{threads, {}, {}, {}});
            bench::LayerFixture f(rt, an);  // its weights; two layers over them, with and without the norm
            std::vector<float> gamma(static_cast<size_t>(an.embed)), beta(gamma.size());
            bench::fill_hashed(gamma.data(), gamma.size(), 201, 0.1f);
            for (float &g : gamma) g += 1.0f;
            bench::fill_hashed(beta.data(), beta.size(), 202, 0.1f);
            LayerConfig c;
            c.embed_dim = an.embed;
            c.num_heads = an.heads;
            LayerWeights w = LayerWeights::from_in_proj(c, f.w_in.data(), f.b_in.data(), f.w_out.data(), f.b_out.data());
            const Layer plain(rt, c, w);
            c.norm = Norm::post;
            w.norm_weight = gamma.data();
            w.norm_bias = beta.data();
            const Layer normed(rt, c, w);
            std::vector<float> out2(f.out.size());
            Row row;
            row.suite = "encoder";
            row.name = "add&norm";
            row.shape = an.str();
            row.threads = threads;
            row.unit = "GFLOP/s";
            measure(ctx, row, an.flops(), [&] { normed.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, f.out.data()); },
                    {{"no norm", [&] { plain.forward(rt, f.forward_params, f.x.data(), nullptr, nullptr, out2.data()); }}},
                    rows);
            Row &r = rows.back();
            const double none_ms = r.vs.front().second * r.ms;
            r.extra["no_norm_ms"] = none_ms;
            r.extra["add_norm_share"] = (r.ms - none_ms) / r.ms;
            char note[96];
            std::snprintf(note, sizeof note, "add&norm %.1f%% of the layer's time", 100.0 * (r.ms - none_ms) / r.ms);
            r.note = note;
        }
    }
}

} // namespace mha::bench_tool
