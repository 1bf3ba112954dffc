// The compiled core of the Python package `mha`: numpy arrays in and out of the C++ API, errors
// as Python exceptions, the GIL released during every call into the library.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "mha/attention.hpp"
#include "mha/encoder.hpp"
#include "mha/error.hpp"
#include "mha/gemm.hpp"
#include "mha/layer.hpp"
#include "mha/runtime.hpp"
#include "mha/serving.hpp"
#include "mha/softmax.hpp"

namespace py = pybind11;
using FloatArray = py::array_t<float, py::array::c_style>;

namespace {

// The process-wide runtime, created on first use with all cores.
std::shared_ptr<mha::Runtime> default_runtime() {
    static std::mutex m;
    static std::shared_ptr<mha::Runtime> rt;
    std::lock_guard lock(m);
    if (!rt) rt = std::make_shared<mha::Runtime>();
    return rt;
}

mha::Runtime &runtime_or_default(const std::shared_ptr<mha::Runtime> &rt, std::shared_ptr<mha::Runtime> &keep) {
    keep = rt ? rt : default_runtime();
    return *keep;
}

// A float32, C-contiguous array from obj, or (copy=True) a converted copy; anything else raises
// TypeError (dtype) or ValueError (layout) naming the argument.
FloatArray f32(const py::handle &obj, const char *name, bool copy) {
    if (!py::isinstance<py::array>(obj))
        throw py::type_error(std::string(name) + " must be a numpy array of float32, got " +
                             std::string(py::str(py::type::of(obj).attr("__name__"))));
    auto a = py::reinterpret_borrow<py::array>(obj);
    const bool is_f32 = a.dtype().is(py::dtype::of<float>());
    const bool contiguous = (a.flags() & py::array::c_style) != 0;
    if (is_f32 && contiguous) return py::reinterpret_borrow<FloatArray>(a);
    if (copy) {
        auto converted = py::array_t<float, py::array::c_style | py::array::forcecast>::ensure(a);
        if (!converted) throw py::error_already_set();
        return py::reinterpret_borrow<FloatArray>(converted);
    }
    if (!is_f32)
        throw py::type_error(std::string(name) + " must have dtype float32, got " + std::string(py::str(a.dtype())) +
                             " (pass copy=True to convert)");
    throw py::value_error(std::string(name) + " must be C-contiguous (pass copy=True to copy it)");
}

// The output: `out` if given (float32, C-contiguous, of the expected shape, written in place), else
// a new array.
FloatArray output(const py::object &out, const char *name, const std::vector<py::ssize_t> &shape) {
    if (out.is_none()) return FloatArray(shape);
    FloatArray o = f32(out, name, false);
    if (std::vector<py::ssize_t>(o.shape(), o.shape() + o.ndim()) != shape) {
        std::string want = "(";
        for (size_t i = 0; i < shape.size(); ++i) want += (i ? ", " : "") + std::to_string(shape[i]);
        throw py::value_error(std::string(name) + " must have shape " + want + ")");
    }
    if (!o.writeable()) throw py::value_error(std::string(name) + " is read-only");
    return o;
}

void ndim(const py::array &a, const char *name, int n, const char *layout) {
    if (a.ndim() != n)
        throw py::value_error(std::string(name) + " must be " + std::to_string(n) + "-D " + layout + ", got " +
                              std::to_string(a.ndim()) + "-D");
}

// int64 or int32 offsets / ids as a contiguous int64 vector.
std::vector<int64_t> ints(const py::object &obj, const char *name) {
    try {
        auto a = py::array_t<int64_t, py::array::c_style | py::array::forcecast>::ensure(obj);
        if (!a || a.ndim() != 1) throw py::value_error("");
        return std::vector<int64_t>(a.data(), a.data() + a.size());
    } catch (const py::error_already_set &) {
        throw py::value_error(std::string(name) + " must be a 1-D array of integers");
    }
}

float scale_of(const py::object &scale) { return scale.is_none() ? 0.0f : scale.cast<float>(); }

// A boolean or uint8 mask of shape [B, Lq, Lk], [B, 1, Lk], [1, Lq, Lk] or [Lq, Lk] (broadcast
// dimensions get stride 0); nonzero = may attend.
struct Mask {
    py::array_t<uint8_t, py::array::c_style> data;
    int64_t batch_stride = 0, row_stride = 0;
};
std::optional<Mask> mask_of(const py::object &obj, int64_t B, int64_t Lq, int64_t Lk) {
    if (obj.is_none()) return std::nullopt;
    auto raw = py::array::ensure(obj);
    if (!raw) throw py::type_error("mask must be a numpy array of bool or uint8");
    if (!raw.dtype().is(py::dtype::of<bool>()) && !raw.dtype().is(py::dtype::of<uint8_t>()))
        throw py::type_error("mask must have dtype bool or uint8 (nonzero = may attend), got " +
                             std::string(py::str(raw.dtype())));
    Mask m;
    m.data = py::array_t<uint8_t, py::array::c_style>::ensure(raw.attr("view")(py::dtype::of<uint8_t>()));
    const auto shape = std::vector<int64_t>(raw.shape(), raw.shape() + raw.ndim());
    auto bad = [&] {
        return py::value_error("mask must have shape (B, Lq, Lk), (B, 1, Lk), (1, Lq, Lk) or (Lq, Lk) with B = " +
                               std::to_string(B) + ", Lq = " + std::to_string(Lq) + ", Lk = " + std::to_string(Lk));
    };
    if (shape.size() == 2) {
        if (shape[0] != Lq || shape[1] != Lk) throw bad();
        m.row_stride = Lk;
    } else if (shape.size() == 3) {
        if ((shape[0] != B && shape[0] != 1) || (shape[1] != Lq && shape[1] != 1) || shape[2] != Lk) throw bad();
        m.batch_stride = shape[0] == 1 ? 0 : shape[1] * Lk;
        m.row_stride = shape[1] == 1 ? 0 : Lk;
    } else {
        throw bad();
    }
    return m;
}

std::vector<py::ssize_t> shape4(int64_t a, int64_t b, int64_t c, int64_t d) { return {a, b, c, d}; }

mha::Norm norm_of(const std::string &s) {
    if (s == "none") return mha::Norm::none;
    if (s == "post") return mha::Norm::post;
    if (s == "pre") return mha::Norm::pre;
    throw py::value_error("norm must be 'none', 'post' or 'pre', got '" + s + "'");
}

// A packed B with the runtime it was packed for, kept alive and used by matmul.
struct PyPackedB {
    std::shared_ptr<mha::Runtime> rt;
    std::unique_ptr<mha::SgemmPackedB> b;
};
// Keeps the layers' runtime alive with them.
struct PyLayer {
    std::shared_ptr<mha::Runtime> rt;
    std::unique_ptr<mha::Layer> layer;
};
struct PyEncoder {
    std::shared_ptr<mha::Runtime> rt;
    std::unique_ptr<mha::EncoderLayer> layer;
};
struct PyCache {
    std::shared_ptr<mha::Runtime> rt;
    std::unique_ptr<mha::KVCache> cache;
};

const float *ptr(const std::optional<FloatArray> &a) { return a ? a->data() : nullptr; }

// The layer's forward on numpy arrays (shared by Layer and EncoderLayer's masks).
mha::LayerForward forward_params(int64_t B, int64_t Lq, int64_t Lk, bool causal, const std::optional<Mask> &mask,
                                 const py::array_t<int32_t, py::array::c_style> *valid) {
    mha::LayerForward f;
    f.batch = B;
    f.q_len = Lq;
    f.kv_len = Lk;
    f.causal = causal;
    if (mask) {
        f.mask = mask->data.data();
        f.mask_batch_stride = mask->batch_stride;
        f.mask_row_stride = mask->row_stride;
    }
    if (valid) f.kv_valid_lens = valid->data();
    return f;
}

// The score modifiers (window, softcap, ALiBi slopes, sinks) with the arrays they point into.
// alibi_slopes and sinks: None or 1-D float32 arrays of num_heads (anything else raises TypeError or
// ValueError naming the argument, as every array does); the values themselves (a negative window, a
// NaN cap, ...) are the library's to refuse, as ValueError naming the field (variant.window, ...).
struct Variant {
    mha::AttentionVariant v;
    std::optional<FloatArray> slopes, sinks;
};
Variant variant_of(int64_t window, float softcap, const py::object &slopes, const py::object &sinks,
                   int64_t num_heads, bool copy) {
    Variant r;
    auto per_head = [&](const py::object &o, const char *name) -> std::optional<FloatArray> {
        if (o.is_none()) return std::nullopt;
        FloatArray a = f32(o, name, copy);
        if (a.ndim() != 1 || a.shape(0) != num_heads)
            throw py::value_error(std::string(name) + " must have shape (num_heads,) = (" + std::to_string(num_heads) +
                                  ",)");
        return a;
    };
    r.slopes = per_head(slopes, "alibi_slopes");
    r.sinks = per_head(sinks, "sinks");
    r.v.window = window;
    r.v.softcap = softcap;
    r.v.alibi_slopes = r.slopes ? r.slopes->data() : nullptr;
    r.v.sink_logits = r.sinks ? r.sinks->data() : nullptr;
    return r;
}

mha::DType dtype_of(const std::string &s) {
    if (s == "f32") return mha::DType::f32;
    if (s == "bf16") return mha::DType::bf16;
    if (s == "i8") return mha::DType::i8;
    throw py::value_error("dtype must be 'f32', 'bf16' or 'i8', got '" + s + "'");
}

const char *dtype_name(mha::DType d) {
    switch (d) {
    case mha::DType::f32: return "f32";
    case mha::DType::bf16: return "bf16";
    case mha::DType::i8: return "i8";
    }
    return "?";
}

std::optional<py::array_t<int32_t, py::array::c_style>> valid_of(const py::object &obj, int64_t B) {
    if (obj.is_none()) return std::nullopt;
    auto a = py::array_t<int32_t, py::array::c_style | py::array::forcecast>::ensure(obj);
    if (!a || a.ndim() != 1 || a.shape(0) != B)
        throw py::value_error("valid_lens must be a 1-D array of " + std::to_string(B) + " integers");
    return a;
}

} // namespace

PYBIND11_MODULE(_mha, m) {
    m.doc() = "mha: SIMD-optimized CPU multi-head attention (the compiled core; see the package mha)";

    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const mha::Error &e) {
            switch (e.status()) {
            case mha::Status::invalid_argument: PyErr_SetString(PyExc_ValueError, e.what()); return;
            case mha::Status::out_of_memory: PyErr_SetString(PyExc_MemoryError, e.what()); return;
            case mha::Status::unsupported: PyErr_SetString(PyExc_NotImplementedError, e.what()); return;
            default: PyErr_SetString(PyExc_RuntimeError, e.what()); return;
            }
        }
    });

    py::class_<mha::Runtime, std::shared_ptr<mha::Runtime>>(m, "Runtime",
        "Threads (a task arena of `threads`, 0 = all cores), the tile config and scratch. Many Python "
        "threads may call one runtime at once.")
        .def(py::init([](int threads, const py::object &tile_config) {
                 mha::RuntimeOptions o;
                 o.num_threads = threads;
                 if (!tile_config.is_none()) o.tile_config_path = py::str(tile_config);
                 return std::make_shared<mha::Runtime>(o);
             }),
             py::arg("threads") = 0, py::arg("tile_config") = py::none())
        .def_property_readonly("isa", [](const mha::Runtime &r) { return std::string(mha::isa_name(r.isa())); })
        .def_property_readonly("threads", &mha::Runtime::num_threads)
        .def_property_readonly("scratch_bytes", &mha::Runtime::scratch_bytes)
        .def("__repr__", [](const mha::Runtime &r) {
            return "mha.Runtime(threads=" + std::to_string(r.num_threads()) + ", isa='" + std::string(mha::isa_name(r.isa())) + "')";
        });
    m.def("default_runtime", &default_runtime, "The process-wide runtime (all cores), created on first use.");

    m.def(
        "sgemm",
        [](const py::object &a_, const py::object &b_, bool trans_a, bool trans_b, float alpha, float beta,
           const py::object &c_, const std::shared_ptr<mha::Runtime> &runtime, bool copy) {
            std::shared_ptr<mha::Runtime> keep;
            mha::Runtime &rt = runtime_or_default(runtime, keep);
            FloatArray a = f32(a_, "a", copy), b = f32(b_, "b", copy);
            ndim(a, "a", 2, "(m, k), or (k, m) with trans_a");
            ndim(b, "b", 2, "(k, n), or (n, k) with trans_b");
            const int64_t m_ = trans_a ? a.shape(1) : a.shape(0), k = trans_a ? a.shape(0) : a.shape(1);
            const int64_t kb = trans_b ? b.shape(1) : b.shape(0), n = trans_b ? b.shape(0) : b.shape(1);
            if (k != kb) throw py::value_error("a and b do not chain: op(a) is " + std::to_string(m_) + " x " +
                                               std::to_string(k) + ", op(b) is " + std::to_string(kb) + " x " +
                                               std::to_string(n));
            if (c_.is_none() && beta != 0.0f) throw py::value_error("beta != 0 needs c");
            FloatArray c = output(c_, "c", {m_, n});
            const float *ap = a.data(), *bp = b.data();
            float *cp = c.mutable_data();
            const int64_t lda = a.shape(1), ldb = b.shape(1);
            {
                py::gil_scoped_release nogil;
                mha::sgemm(rt, trans_a ? mha::Trans::T : mha::Trans::N, trans_b ? mha::Trans::T : mha::Trans::N, m_, n, k,
                           alpha, ap, lda, bp, ldb, beta, cp, n);
            }
            return c;
        },
        py::arg("a"), py::arg("b"), py::kw_only(), py::arg("trans_a") = false, py::arg("trans_b") = false,
        py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f, py::arg("c") = py::none(), py::arg("runtime") = nullptr,
        py::arg("copy") = false, "C = alpha op(a) op(b) + beta C (c is written in place when given).");

    py::class_<PyPackedB>(m, "PackedB",
        "op(b) (k x n) packed once for the runtime's GEMM microkernel, for many products against it (a "
        "weight): b is (k, n), or (n, k) with trans_b (nn.Linear's weight: PackedB(w, trans_b=True)). The "
        "packed copy is tied to its runtime's ISA and tile config, which matmul uses.")
        .def(py::init([](const py::object &b_, bool trans_b, const std::shared_ptr<mha::Runtime> &runtime, bool copy) {
                 PyPackedB p;
                 mha::Runtime &rt = runtime_or_default(runtime, p.rt);
                 FloatArray b = f32(b_, "b", copy);
                 ndim(b, "b", 2, "(k, n), or (n, k) with trans_b");
                 const int64_t k = trans_b ? b.shape(1) : b.shape(0), n = trans_b ? b.shape(0) : b.shape(1);
                 const float *bp = b.data();
                 {
                     py::gil_scoped_release nogil;
                     p.b = std::make_unique<mha::SgemmPackedB>(rt, trans_b ? mha::Trans::T : mha::Trans::N, k, n, bp,
                                                               b.shape(1));
                 }
                 return p;
             }),
             py::arg("b"), py::kw_only(), py::arg("trans_b") = false, py::arg("runtime") = nullptr,
             py::arg("copy") = false)
        .def_property_readonly("k", [](const PyPackedB &p) { return p.b->k(); })
        .def_property_readonly("n", [](const PyPackedB &p) { return p.b->n(); })
        .def_property_readonly("nbytes", [](const PyPackedB &p) { return p.b->bytes(); })
        .def(
            "matmul",
            [](const PyPackedB &p, const py::object &a_, bool trans_a, float alpha, float beta, const py::object &c_,
               bool copy) {
                FloatArray a = f32(a_, "a", copy);
                ndim(a, "a", 2, "(m, k), or (k, m) with trans_a");
                const int64_t m_ = trans_a ? a.shape(1) : a.shape(0), k = trans_a ? a.shape(0) : a.shape(1);
                if (k != p.b->k())
                    throw py::value_error("a and the packed b do not chain: op(a) is " + std::to_string(m_) + " x " +
                                          std::to_string(k) + ", b is " + std::to_string(p.b->k()) + " x " +
                                          std::to_string(p.b->n()));
                if (c_.is_none() && beta != 0.0f) throw py::value_error("beta != 0 needs c");
                FloatArray c = output(c_, "c", {m_, p.b->n()});
                const float *ap = a.data();
                float *cp = c.mutable_data();
                const int64_t lda = a.shape(1), n = p.b->n();
                {
                    py::gil_scoped_release nogil;
                    mha::sgemm(*p.rt, trans_a ? mha::Trans::T : mha::Trans::N, m_, alpha, ap, lda, *p.b, beta, cp, n);
                }
                return c;
            },
            py::arg("a"), py::kw_only(), py::arg("trans_a") = false, py::arg("alpha") = 1.0f, py::arg("beta") = 0.0f,
            py::arg("c") = py::none(), py::arg("copy") = false,
            "C = alpha op(a) b + beta C on the packed b's runtime: the bits of sgemm(a, b) (c is written in place "
            "when given).");

    m.def(
        "softmax",
        [](const py::object &x_, const py::object &out_, const std::shared_ptr<mha::Runtime> &runtime, bool copy) {
            std::shared_ptr<mha::Runtime> keep;
            mha::Runtime &rt = runtime_or_default(runtime, keep);
            FloatArray x = f32(x_, "x", copy);
            ndim(x, "x", 2, "(rows, cols)");
            FloatArray y = output(out_, "out", {x.shape(0), x.shape(1)});
            const float *xp = x.data();
            float *yp = y.mutable_data();
            const int64_t rows = x.shape(0), cols = x.shape(1);
            {
                py::gil_scoped_release nogil;
                mha::softmax(rt, rows, cols, xp, cols, yp, cols);
            }
            return y;
        },
        py::arg("x"), py::kw_only(), py::arg("out") = py::none(), py::arg("runtime") = nullptr, py::arg("copy") = false,
        "Row softmax of a 2-D array (-inf gives 0; a row of only -inf gives zeros).");

    m.def(
        "attention",
        [](const py::object &q_, const py::object &k_, const py::object &v_, bool causal, const py::object &mask_,
           const py::object &valid_, const py::object &scale, int64_t window, float softcap,
           const py::object &alibi_slopes, const py::object &sinks, bool need_weights, const py::object &out_,
           const std::shared_ptr<mha::Runtime> &runtime, bool copy) -> py::object {
            std::shared_ptr<mha::Runtime> keep;
            mha::Runtime &rt = runtime_or_default(runtime, keep);
            FloatArray q = f32(q_, "q", copy), k = f32(k_, "k", copy), v = f32(v_, "v", copy);
            ndim(q, "q", 4, "(batch, q_len, num_heads, head_dim)");
            ndim(k, "k", 4, "(batch, kv_len, num_kv_heads, head_dim)");
            ndim(v, "v", 4, "(batch, kv_len, num_kv_heads, value_dim)");
            mha::AttentionParams p;
            p.batch = q.shape(0);
            p.q_len = q.shape(1);
            p.num_heads = q.shape(2);
            p.head_dim = q.shape(3);
            p.kv_len = k.shape(1);
            p.num_kv_heads = k.shape(2);
            p.value_dim = v.shape(3);
            if (k.shape(0) != p.batch || v.shape(0) != p.batch || v.shape(1) != p.kv_len || v.shape(2) != p.num_kv_heads ||
                k.shape(3) != p.head_dim)
                throw py::value_error("q, k and v do not agree: k must be (batch, kv_len, num_kv_heads, head_dim) and v "
                                      "(batch, kv_len, num_kv_heads, value_dim) for q (batch, q_len, num_heads, head_dim)");
            p.scale = scale_of(scale);
            p.causal = causal;
            const Variant variant = variant_of(window, softcap, alibi_slopes, sinks, p.num_heads, copy);
            p.variant = variant.v;
            const auto mask = mask_of(mask_, p.batch, p.q_len, p.kv_len);
            if (mask) {
                p.mask = mask->data.data();
                p.mask_batch_stride = mask->batch_stride;
                p.mask_row_stride = mask->row_stride;
            }
            const auto valid = valid_of(valid_, p.batch);
            if (valid) p.kv_valid_lens = valid->data();
            FloatArray out = output(out_, "out", shape4(p.batch, p.q_len, p.num_heads, p.value_dim));
            std::optional<FloatArray> weights;
            if (need_weights) {
                weights.emplace(shape4(p.batch, p.num_heads, p.q_len, p.kv_len));
                p.weights = weights->mutable_data();
            }
            const float *qp = q.data(), *kp = k.data(), *vp = v.data();
            float *op = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                mha::attention(rt, p, qp, kp, vp, op);
            }
            if (weights) return py::make_tuple(out, *weights);
            return py::object(std::move(out));
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::kw_only(), py::arg("causal") = false, py::arg("mask") = py::none(),
        py::arg("valid_lens") = py::none(), py::arg("scale") = py::none(), py::arg("window") = 0,
        py::arg("softcap") = 0.0f, py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(),
        py::arg("need_weights") = false, py::arg("out") = py::none(), py::arg("runtime") = nullptr,
        py::arg("copy") = false,
        "Fused attention on the C ABI's layouts: q (B, Lq, H, D), k (B, Lk, Hkv, D), v (B, Lk, Hkv, Dv) -> out "
        "(B, Lq, H, Dv), or (out, weights (B, H, Lq, Lk)) with need_weights. Score modifiers (query i at "
        "position p = i + Lk - Lq, key j at j): window W > 0 keeps keys j > p - W; softcap C > 0 gives "
        "s = C tanh(s / C); alibi_slopes (H,) adds slope[h] (j - p); sinks (H,) adds exp(sink[h] - max) to "
        "each row's softmax denominator. out may be q itself (Dv == D, without need_weights).");

    m.def(
        "attention_varlen",
        [](const py::object &q_, const py::object &k_, const py::object &v_, const py::object &q_offsets,
           const py::object &kv_offsets, bool causal, const py::object &scale, int64_t window, float softcap,
           const py::object &alibi_slopes, const py::object &sinks, const py::object &out_,
           const std::shared_ptr<mha::Runtime> &runtime, bool copy) {
            std::shared_ptr<mha::Runtime> keep;
            mha::Runtime &rt = runtime_or_default(runtime, keep);
            FloatArray q = f32(q_, "q", copy), k = f32(k_, "k", copy), v = f32(v_, "v", copy);
            ndim(q, "q", 3, "(total_q, num_heads, head_dim)");
            ndim(k, "k", 3, "(total_kv, num_kv_heads, head_dim)");
            ndim(v, "v", 3, "(total_kv, num_kv_heads, value_dim)");
            const auto qo = ints(q_offsets, "q_offsets"), ko = ints(kv_offsets, "kv_offsets");
            if (qo.empty() || qo.size() != ko.size())
                throw py::value_error("q_offsets and kv_offsets must have num_seqs + 1 entries each");
            if (qo.back() != q.shape(0) || ko.back() != k.shape(0) || v.shape(0) != k.shape(0))
                throw py::value_error("q_offsets[-1] must be q's rows and kv_offsets[-1] k's and v's rows");
            mha::VarlenParams p;
            p.num_seqs = static_cast<int64_t>(qo.size()) - 1;
            p.q_offsets = qo.data();
            p.kv_offsets = ko.data();
            p.num_heads = q.shape(1);
            p.head_dim = q.shape(2);
            p.num_kv_heads = k.shape(1);
            p.value_dim = v.shape(2);
            if (k.shape(2) != p.head_dim || v.shape(1) != p.num_kv_heads)
                throw py::value_error("k must be (total_kv, num_kv_heads, head_dim) and v (total_kv, num_kv_heads, value_dim)");
            p.scale = scale_of(scale);
            p.causal = causal;
            const Variant variant = variant_of(window, softcap, alibi_slopes, sinks, p.num_heads, copy);
            p.variant = variant.v;
            FloatArray out = output(out_, "out", {q.shape(0), p.num_heads, p.value_dim});
            const float *qp = q.data(), *kp = k.data(), *vp = v.data();
            float *op = out.mutable_data();
            {
                py::gil_scoped_release nogil;
                mha::attention_varlen(rt, p, qp, kp, vp, op);
            }
            return out;
        },
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("q_offsets"), py::arg("kv_offsets"), py::kw_only(),
        py::arg("causal") = false, py::arg("scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0f,
        py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("out") = py::none(),
        py::arg("runtime") = nullptr, py::arg("copy") = false,
        "Ragged attention: sequence s owns rows q_offsets[s]:q_offsets[s+1] of q and out and "
        "kv_offsets[s]:kv_offsets[s+1] of k and v; no padding. window, softcap, alibi_slopes and sinks as in "
        "attention, with positions per sequence.");

    py::class_<PyCache>(m, "KVCache",
        "The paged KV cache, every block allocated at creation. dtype: 'f32', or 'i8' (each token's K and V "
        "rows stored per KV head as int8 with one fp32 scale; read() returns the widened values); 'bf16' "
        "raises NotImplementedError for now. window W > 0 releases blocks outside every future window of W "
        "(attention over the cache must then use window <= W).")
        .def(py::init([](int64_t num_kv_heads, int64_t head_dim, int64_t value_dim, int64_t max_tokens,
                         int64_t block_tokens, const std::string &dtype, int64_t window,
                         const std::shared_ptr<mha::Runtime> &runtime) {
                 PyCache c;
                 mha::Runtime &rt = runtime_or_default(runtime, c.rt);
                 mha::KVCacheConfig cfg;
                 cfg.num_kv_heads = num_kv_heads;
                 cfg.head_dim = head_dim;
                 cfg.value_dim = value_dim;
                 cfg.max_tokens = max_tokens;
                 cfg.block_tokens = block_tokens;
                 cfg.dtype = dtype_of(dtype);
                 cfg.window = window;
                 c.cache = std::make_unique<mha::KVCache>(rt, cfg);
                 return c;
             }),
             py::arg("num_kv_heads"), py::arg("head_dim"), py::arg("value_dim"), py::arg("max_tokens"), py::kw_only(),
             py::arg("block_tokens") = 0, py::arg("dtype") = "f32", py::arg("window") = 0,
             py::arg("runtime") = nullptr)
        .def("append", [](PyCache &c, int64_t seq_id, const py::object &k_, const py::object &v_, bool copy) {
                 const auto &cfg = c.cache->config();
                 FloatArray k = f32(k_, "k", copy), v = f32(v_, "v", copy);
                 ndim(k, "k", 3, "(n_tokens, num_kv_heads, head_dim)");
                 ndim(v, "v", 3, "(n_tokens, num_kv_heads, value_dim)");
                 if (k.shape(1) != cfg.num_kv_heads || k.shape(2) != cfg.head_dim || v.shape(0) != k.shape(0) ||
                     v.shape(1) != cfg.num_kv_heads || v.shape(2) != cfg.value_dim)
                     throw py::value_error("k must be (n, num_kv_heads, head_dim) and v (n, num_kv_heads, value_dim) with "
                                           "the cache's dims");
                 const float *kp = k.data(), *vp = v.data();
                 const int64_t n = k.shape(0);
                 py::gil_scoped_release nogil;
                 c.cache->append(seq_id, n, kp, vp);
             }, py::arg("seq_id"), py::arg("k"), py::arg("v"), py::kw_only(), py::arg("copy") = false)
        .def("fork", [](PyCache &c, int64_t src, int64_t dst) { c.cache->fork(src, dst); }, py::arg("src_seq"),
             py::arg("dst_seq"))
        .def("release", [](PyCache &c, int64_t seq) { c.cache->release(seq); }, py::arg("seq_id"))
        .def("seq_len", [](const PyCache &c, int64_t seq) { return c.cache->seq_len(seq); }, py::arg("seq_id"))
        .def("__contains__", [](const PyCache &c, int64_t seq) { return c.cache->contains(seq); })
        .def_property_readonly("free_tokens", [](const PyCache &c) { return c.cache->free_tokens(); })
        .def_property_readonly("bytes", [](const PyCache &c) { return c.cache->bytes(); })
        .def_property_readonly("block_tokens", [](const PyCache &c) { return c.cache->config().block_tokens; })
        .def_property_readonly("dtype", [](const PyCache &c) { return std::string(dtype_name(c.cache->config().dtype)); })
        .def_property_readonly("window", [](const PyCache &c) { return c.cache->config().window; })
        .def("read", [](const PyCache &c, int64_t seq, int64_t start, const py::object &n_) {
                 const auto &cfg = c.cache->config();
                 const int64_t n = n_.is_none() ? c.cache->seq_len(seq) - start : n_.cast<int64_t>();
                 if (n < 0) throw py::value_error("n_tokens = " + std::to_string(n) + " is negative");
                 FloatArray k({n, cfg.num_kv_heads, cfg.head_dim}), v({n, cfg.num_kv_heads, cfg.value_dim});
                 c.cache->read(seq, start, n, k.mutable_data(), v.mutable_data());
                 return py::make_tuple(k, v);
             }, py::arg("seq_id"), py::arg("start") = 0, py::arg("n_tokens") = py::none())
        .def("attention", [](const PyCache &c, const py::object &q_, const py::object &seq_ids,
                             const py::object &q_offsets, bool causal, const py::object &scale, int64_t window,
                             float softcap, const py::object &alibi_slopes, const py::object &sinks,
                             const py::object &out_, const std::shared_ptr<mha::Runtime> &runtime, bool copy) {
                 std::shared_ptr<mha::Runtime> keep = runtime ? runtime : c.rt;
                 FloatArray q = f32(q_, "q", copy);
                 ndim(q, "q", 3, "(total_q, num_heads, head_dim)");
                 const auto ids = ints(seq_ids, "seq_ids"), qo = ints(q_offsets, "q_offsets");
                 if (qo.size() != ids.size() + 1) throw py::value_error("q_offsets must have len(seq_ids) + 1 entries");
                 if (qo.back() != q.shape(0)) throw py::value_error("q_offsets[-1] must be q's rows");
                 if (q.shape(2) != c.cache->config().head_dim)
                     throw py::value_error("q's head_dim must be the cache's " + std::to_string(c.cache->config().head_dim));
                 mha::CachedParams p;
                 p.num_seqs = static_cast<int64_t>(ids.size());
                 p.seq_ids = ids.data();
                 p.q_offsets = qo.data();
                 p.num_heads = q.shape(1);
                 p.scale = scale_of(scale);
                 p.causal = causal;
                 const Variant variant = variant_of(window, softcap, alibi_slopes, sinks, p.num_heads, copy);
                 p.variant = variant.v;
                 FloatArray out = output(out_, "out", {q.shape(0), q.shape(1), c.cache->config().value_dim});
                 const float *qp = q.data();
                 float *op = out.mutable_data();
                 {
                     py::gil_scoped_release nogil;
                     mha::attention_cached(*keep, *c.cache, p, qp, op);
                 }
                 return out;
             }, py::arg("q"), py::arg("seq_ids"), py::arg("q_offsets"), py::kw_only(), py::arg("causal") = false,
             py::arg("scale") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0f,
             py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("out") = py::none(),
             py::arg("runtime") = nullptr, py::arg("copy") = false,
             "Attention over the cache: sequence s's q rows q_offsets[s]:q_offsets[s+1] are its last cached tokens. "
             "window, softcap, alibi_slopes and sinks as in attention (a token's position: its index in its "
             "sequence).");

    py::class_<PyLayer>(m, "Layer",
        "The multi-head attention layer (PyTorch's nn.Linear weight layout). window, softcap, alibi_slopes and "
        "sinks: the attention's score modifiers, as in attention (the arrays are copied). rope_dims > 0 rotates "
        "the first rope_dims of every q and k head after their projection by position * rope_position_scale * "
        "rope_theta^(-2d/rope_dims) (0 = the defaults: theta 10000, scale 1); pairs (x[d], x[d + dims/2]) as "
        "rotate_half, or adjacent pairs with rope_interleaved.")
        .def(py::init([](int64_t embed_dim, int64_t num_heads, const py::object &q_weight, const py::object &k_weight,
                         const py::object &v_weight, const py::object &out_weight, const py::object &q_bias,
                         const py::object &k_bias, const py::object &v_bias, const py::object &out_bias,
                         int64_t num_kv_heads, int64_t head_dim, int64_t value_dim, int64_t kdim, int64_t vdim,
                         const std::string &norm, float norm_eps, const py::object &norm_weight,
                         const py::object &norm_bias, int64_t window, float softcap, const py::object &alibi_slopes,
                         const py::object &sinks, int64_t rope_dims, float rope_theta, bool rope_interleaved,
                         float rope_position_scale, const std::shared_ptr<mha::Runtime> &runtime) {
                 PyLayer l;
                 mha::Runtime &rt = runtime_or_default(runtime, l.rt);
                 mha::LayerConfig c;
                 c.embed_dim = embed_dim;
                 c.num_heads = num_heads;
                 c.num_kv_heads = num_kv_heads;
                 c.head_dim = head_dim;
                 c.value_dim = value_dim;
                 c.kdim = kdim;
                 c.vdim = vdim;
                 c.norm = norm_of(norm);
                 c.norm_eps = norm_eps;
                 c.rope.dims = rope_dims;
                 c.rope.theta = rope_theta;
                 c.rope.interleaved = rope_interleaved;
                 c.rope.position_scale = rope_position_scale;
                 const mha::LayerConfig r = c.resolved();
                 // Copied by the layer when it is built; kept alive until then.
                 const Variant variant = variant_of(window, softcap, alibi_slopes, sinks, r.num_heads, true);
                 c.variant = variant.v;
                 auto weight = [&](const py::object &o, const char *name, int64_t rows, int64_t cols) {
                     FloatArray a = f32(o, name, true);
                     if (a.ndim() != 2 || a.shape(0) != rows || a.shape(1) != cols)
                         throw py::value_error(std::string(name) + " must have shape (" + std::to_string(rows) + ", " +
                                               std::to_string(cols) + ")");
                     return a;
                 };
                 auto vec = [&](const py::object &o, const char *name, int64_t n) -> std::optional<FloatArray> {
                     if (o.is_none()) return std::nullopt;
                     FloatArray a = f32(o, name, true);
                     if (a.ndim() != 1 || a.shape(0) != n)
                         throw py::value_error(std::string(name) + " must have shape (" + std::to_string(n) + ",)");
                     return a;
                 };
                 const auto wq = weight(q_weight, "q_weight", r.num_heads * r.head_dim, r.embed_dim);
                 const auto wk = weight(k_weight, "k_weight", r.num_kv_heads * r.head_dim, r.kdim);
                 const auto wv = weight(v_weight, "v_weight", r.num_kv_heads * r.value_dim, r.vdim);
                 const auto wo = weight(out_weight, "out_weight", r.embed_dim, r.num_heads * r.value_dim);
                 const auto bq = vec(q_bias, "q_bias", r.num_heads * r.head_dim);
                 const auto bk = vec(k_bias, "k_bias", r.num_kv_heads * r.head_dim);
                 const auto bv = vec(v_bias, "v_bias", r.num_kv_heads * r.value_dim);
                 const auto bo = vec(out_bias, "out_bias", r.embed_dim);
                 const auto nw = vec(norm_weight, "norm_weight", r.embed_dim), nb = vec(norm_bias, "norm_bias", r.embed_dim);
                 mha::LayerWeights w;
                 w.q_weight = wq.data();
                 w.k_weight = wk.data();
                 w.v_weight = wv.data();
                 w.out_weight = wo.data();
                 w.q_bias = ptr(bq);
                 w.k_bias = ptr(bk);
                 w.v_bias = ptr(bv);
                 w.out_bias = ptr(bo);
                 w.norm_weight = ptr(nw);
                 w.norm_bias = ptr(nb);
                 l.layer = std::make_unique<mha::Layer>(rt, c, w);
                 return l;
             }),
             py::arg("embed_dim"), py::arg("num_heads"), py::kw_only(), py::arg("q_weight"), py::arg("k_weight"),
             py::arg("v_weight"), py::arg("out_weight"), py::arg("q_bias") = py::none(), py::arg("k_bias") = py::none(),
             py::arg("v_bias") = py::none(), py::arg("out_bias") = py::none(), py::arg("num_kv_heads") = 0,
             py::arg("head_dim") = 0, py::arg("value_dim") = 0, py::arg("kdim") = 0, py::arg("vdim") = 0,
             py::arg("norm") = "none", py::arg("norm_eps") = 0.0f, py::arg("norm_weight") = py::none(),
             py::arg("norm_bias") = py::none(), py::arg("window") = 0, py::arg("softcap") = 0.0f,
             py::arg("alibi_slopes") = py::none(), py::arg("sinks") = py::none(), py::arg("rope_dims") = 0,
             py::arg("rope_theta") = 0.0f, py::arg("rope_interleaved") = false, py::arg("rope_position_scale") = 0.0f,
             py::arg("runtime") = nullptr)
        .def("forward", [](const PyLayer &l, const py::object &query_, const py::object &key_, const py::object &value_,
                           bool causal, const py::object &mask_, const py::object &valid_, bool need_weights,
                           const py::object &out_, const std::shared_ptr<mha::Runtime> &runtime, bool copy) -> py::object {
                 std::shared_ptr<mha::Runtime> keep = runtime ? runtime : l.rt;
                 const auto &c = l.layer->config();
                 FloatArray query = f32(query_, "query", copy);
                 ndim(query, "query", 3, "(batch, q_len, embed_dim)");
                 if (key_.is_none() != value_.is_none()) throw py::value_error("pass both key and value, or neither");
                 std::optional<FloatArray> key, value;
                 if (!key_.is_none()) {
                     key = f32(key_, "key", copy);
                     value = f32(value_, "value", copy);
                     ndim(*key, "key", 3, "(batch, kv_len, kdim)");
                     ndim(*value, "value", 3, "(batch, kv_len, vdim)");
                 }
                 const int64_t B = query.shape(0), Lq = query.shape(1), Lk = key ? key->shape(1) : Lq;
                 if (query.shape(2) != c.embed_dim)
                     throw py::value_error("query's last dimension must be embed_dim = " + std::to_string(c.embed_dim));
                 if (key && (key->shape(0) != B || value->shape(0) != B || value->shape(1) != Lk ||
                             key->shape(2) != c.kdim || value->shape(2) != c.vdim))
                     throw py::value_error("key must be (batch, kv_len, kdim) and value (batch, kv_len, vdim)");
                 const auto mask = mask_of(mask_, B, Lq, Lk);
                 const auto valid = valid_of(valid_, B);
                 mha::LayerForward f = forward_params(B, Lq, Lk, causal, mask, valid ? &*valid : nullptr);
                 FloatArray out = output(out_, "out", {B, Lq, c.embed_dim});
                 std::optional<FloatArray> weights;
                 if (need_weights) {
                     weights.emplace(shape4(B, c.num_heads, Lq, Lk));
                     f.weights = weights->mutable_data();
                 }
                 const float *qp = query.data(), *kp = ptr(key), *vp = ptr(value);
                 float *op = out.mutable_data();
                 {
                     py::gil_scoped_release nogil;
                     l.layer->forward(*keep, f, qp, kp, vp, op);
                 }
                 if (weights) return py::make_tuple(out, *weights);
                 return py::object(std::move(out));
             }, py::arg("query"), py::arg("key") = py::none(), py::arg("value") = py::none(), py::kw_only(),
             py::arg("causal") = false, py::arg("mask") = py::none(), py::arg("valid_lens") = py::none(),
             py::arg("need_weights") = false, py::arg("out") = py::none(), py::arg("runtime") = nullptr,
             py::arg("copy") = false,
             "query (B, Lq, E) [, key (B, Lk, kdim), value (B, Lk, vdim)] -> out (B, Lq, E), or (out, weights "
             "(B, H, Lq, Lk)) with need_weights. key = value = None: self-attention.")
        .def_property_readonly("embed_dim", [](const PyLayer &l) { return l.layer->config().embed_dim; })
        .def_property_readonly("num_heads", [](const PyLayer &l) { return l.layer->config().num_heads; });

    py::class_<PyEncoder>(m, "EncoderLayer",
        "nn.TransformerEncoderLayer (batch_first, eval) from its state_dict (a dict of numpy arrays).")
        .def(py::init([](int64_t embed_dim, int64_t num_heads, int64_t ffn_dim, const py::dict &state,
                         const std::string &activation, bool norm_first, float norm_eps, const std::string &prefix,
                         const std::shared_ptr<mha::Runtime> &runtime) {
                 PyEncoder e;
                 mha::Runtime &rt = runtime_or_default(runtime, e.rt);
                 mha::EncoderConfig c;
                 c.attention.embed_dim = embed_dim;
                 c.attention.num_heads = num_heads;
                 c.attention.norm = norm_first ? mha::Norm::pre : mha::Norm::post;
                 c.attention.norm_eps = norm_eps;
                 c.ffn_dim = ffn_dim;
                 if (activation == "relu")
                     c.activation = mha::Activation::relu;
                 else if (activation == "gelu")
                     c.activation = mha::Activation::gelu;
                 else
                     throw py::value_error("activation must be 'relu' or 'gelu', got '" + activation + "'");
                 std::vector<FloatArray> held;
                 auto get = [&](const char *key, bool required, std::vector<int64_t> shape) -> const float * {
                     const std::string name = prefix + key;
                     if (!state.contains(name)) {
                         if (required) throw py::key_error("state dict lacks '" + name + "'");
                         return nullptr;
                     }
                     FloatArray a = f32(state[py::str(name)], name.c_str(), true);
                     if (std::vector<int64_t>(a.shape(), a.shape() + a.ndim()) != shape)
                         throw py::value_error("'" + name + "' has the wrong shape");
                     held.push_back(a);
                     return a.data();
                 };
                 const int64_t E = embed_dim, F = ffn_dim;
                 mha::EncoderWeights w;
                 w.attention = mha::LayerWeights::from_in_proj(c.attention, get("self_attn.in_proj_weight", true, {3 * E, E}),
                                                               get("self_attn.in_proj_bias", false, {3 * E}),
                                                               get("self_attn.out_proj.weight", true, {E, E}),
                                                               get("self_attn.out_proj.bias", false, {E}));
                 w.attention.norm_weight = get("norm1.weight", false, {E});
                 w.attention.norm_bias = get("norm1.bias", false, {E});
                 w.linear1_weight = get("linear1.weight", true, {F, E});
                 w.linear1_bias = get("linear1.bias", false, {F});
                 w.linear2_weight = get("linear2.weight", true, {E, F});
                 w.linear2_bias = get("linear2.bias", false, {E});
                 w.norm2_weight = get("norm2.weight", false, {E});
                 w.norm2_bias = get("norm2.bias", false, {E});
                 e.layer = std::make_unique<mha::EncoderLayer>(rt, c, w);
                 return e;
             }),
             py::arg("embed_dim"), py::arg("num_heads"), py::arg("ffn_dim"), py::arg("state_dict"), py::kw_only(),
             py::arg("activation") = "relu", py::arg("norm_first") = false, py::arg("norm_eps") = 1e-5f,
             py::arg("prefix") = "", py::arg("runtime") = nullptr)
        .def("forward", [](const PyEncoder &e, const py::object &x_, bool causal, const py::object &mask_,
                           const py::object &valid_, const py::object &out_, const std::shared_ptr<mha::Runtime> &runtime,
                           bool copy) {
                 std::shared_ptr<mha::Runtime> keep = runtime ? runtime : e.rt;
                 FloatArray x = f32(x_, "x", copy);
                 ndim(x, "x", 3, "(batch, len, embed_dim)");
                 const int64_t B = x.shape(0), L = x.shape(1), E = e.layer->config().attention.embed_dim;
                 if (x.shape(2) != E) throw py::value_error("x's last dimension must be embed_dim = " + std::to_string(E));
                 const auto mask = mask_of(mask_, B, L, L);
                 const auto valid = valid_of(valid_, B);
                 const mha::LayerForward f = forward_params(B, L, L, causal, mask, valid ? &*valid : nullptr);
                 FloatArray out = output(out_, "out", {B, L, E});
                 const float *xp = x.data();
                 float *op = out.mutable_data();
                 {
                     py::gil_scoped_release nogil;
                     e.layer->forward(*keep, f, xp, op);
                 }
                 return out;
             }, py::arg("x"), py::kw_only(), py::arg("causal") = false, py::arg("mask") = py::none(),
             py::arg("valid_lens") = py::none(), py::arg("out") = py::none(), py::arg("runtime") = nullptr,
             py::arg("copy") = false, "x (B, L, E) -> out (B, L, E).");
}
