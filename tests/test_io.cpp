// The .npy and .safetensors readers of the tools: good files (the PyTorch golden data), round
// trips, and corrupted files, including a fuzz pass of truncations and flipped bytes that must
// each give a FileError or a consistent array, never a crash or an out-of-bounds read.
#include <doctest/doctest.h>

#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <random>
#include <string>

#include "io/npy.hpp"
#include "io/safetensors.hpp"

using namespace mha::io;
namespace fs = std::filesystem;

namespace {

const fs::path kData = fs::path(MHA_TEST_DATA) / "layer";

std::vector<uint8_t> bytes_of(const std::string &s) { return std::vector<uint8_t>(s.begin(), s.end()); }

std::vector<uint8_t> npy_with_header(const std::string &dict, size_t data_bytes) {
    std::string h = dict;
    h += std::string((64 - (10 + h.size() + 1) % 64) % 64, ' ') + "\n";
    std::string f = "\x93NUMPY";
    f += '\x01';
    f += '\x00';
    f += static_cast<char>(h.size() & 0xff);
    f += static_cast<char>(h.size() >> 8);
    f += h;
    f += std::string(data_bytes, '\0');
    return bytes_of(f);
}

std::vector<uint8_t> safetensors_with(const std::string &header, size_t data_bytes) {
    std::string f(8, '\0');
    const uint64_t n = header.size();
    for (int i = 0; i < 8; ++i) f[static_cast<size_t>(i)] = static_cast<char>(n >> (8 * i));
    f += header;
    f.append(data_bytes, '\0');
    return bytes_of(f);
}

template <class Fn>
std::string error_of(Fn &&fn) {
    try {
        fn();
    } catch (const FileError &e) {
        return e.what();
    }
    return "";
}

} // namespace

TEST_CASE("npy: the golden files read with their dtypes and shapes") {
    const Array q = read_npy((kData / "self" / "query.npy").string());
    CHECK(q.dtype == "<f4");
    CHECK(q.shape == std::vector<int64_t>{2, 5, 16});
    CHECK(to_floats("q", q, {2, -1, 16}).size() == 160);
    const Array kpm = read_npy((kData / "key_padding" / "key_padding_mask.npy").string());
    CHECK(kpm.dtype == "|b1");
    const auto m = to_bools("kpm", kpm, {2, 5});
    CHECK(m[0] == 0);
    CHECK(m[9] == 1);  // the second sequence's last two keys are padding
    CHECK(error_of([&] { to_floats("kpm", kpm, {2, 5}); }).find("expected dtype float32") != std::string::npos);
    CHECK(error_of([&] { to_floats("q", q, {2, 5, 17}); }).find("expected shape [2, 5, 17], found [2, 5, 16]") !=
          std::string::npos);
    CHECK(error_of([&] { to_floats("q", q, {10, 16}); }).find("expected shape") != std::string::npos);
}

TEST_CASE("npy: write then read back, 1-D to 3-D; a failed write leaves no file") {
    const std::string p = (fs::temp_directory_path() / ("mha_npy_" + std::to_string(getpid()) + ".npy")).string();
    for (std::vector<int64_t> shape : {std::vector<int64_t>{5}, {3, 4}, {2, 1, 3}, {0, 4}}) {
        std::vector<float> v(static_cast<size_t>(shape.size() == 1 ? 5 : shape[0] * shape[1] * (shape.size() > 2 ? shape[2] : 1)));
        for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<float>(i) * 0.5f - 1.0f;
        write_npy(p, shape, v.data());
        const Array a = read_npy(p);
        CHECK(a.shape == shape);
        CHECK(to_floats("p", a, shape) == v);
    }
    std::remove(p.c_str());
    const std::string bad = "/nonexistent_dir/x.npy";
    CHECK(error_of([&] { float x = 0; write_npy(bad, {1}, &x); }).find(bad) != std::string::npos);
    CHECK_FALSE(fs::exists(bad));
}

TEST_CASE("npy: corrupted files name the file, the expectation and what was found") {
    CHECK(error_of([] { read_npy("/nonexistent/q.npy"); }).find("/nonexistent/q.npy: cannot open") != std::string::npos);
    CHECK(error_of([] { parse_npy("t.npy", bytes_of("hello, world")); }).find("t.npy: expected a .npy file") !=
          std::string::npos);
    CHECK(error_of([] { parse_npy("t.npy", bytes_of("")); }).find("found 0 bytes") != std::string::npos);
    const std::string good = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
    CHECK_NOTHROW(parse_npy("t", npy_with_header(good, 24)));
    CHECK(error_of([&] { parse_npy("t", npy_with_header(good, 20)); }).find("needs 24 bytes of data, found 20") !=
          std::string::npos);
    CHECK(error_of([&] { parse_npy("t", npy_with_header(good, 28)); }).find("found 28") != std::string::npos);
    CHECK(error_of([] {
              parse_npy("t", npy_with_header("{'descr': '<c8', 'fortran_order': False, 'shape': (2,), }", 16));
          }).find("unsupported dtype '<c8'") != std::string::npos);
    CHECK(error_of([] {
              parse_npy("t", npy_with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (2,), }", 8));
          }).find("fortran_order") != std::string::npos);
    CHECK(error_of([] { parse_npy("t", npy_with_header("{'descr': '<f4', 'fortran_order': False}", 0)); })
              .find("no 'shape'") != std::string::npos);
    CHECK(error_of([] {
              parse_npy("t", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999999999999,), }", 0));
          }).find("overflows") != std::string::npos);
    CHECK(error_of([] {
              parse_npy("t", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296), }", 0));
          }).find("overflows") != std::string::npos);
    CHECK(error_of([] {
              parse_npy("t", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (a, b), }", 0));
          }).find("not a tuple of integers") != std::string::npos);
    auto lying = npy_with_header(good, 24);
    lying[8] = 0xff;  // header length past the end of the file
    lying[9] = 0xff;
    CHECK(error_of([&] { parse_npy("t", lying); }).find("truncated") != std::string::npos);
    auto v9 = npy_with_header(good, 24);
    v9[6] = 9;
    CHECK(error_of([&] { parse_npy("t", v9); }).find("version 1, 2 or 3, found 9") != std::string::npos);
}

TEST_CASE("npy fuzz: every truncation and random byte flips give an error or a consistent array") {
    const auto file = read_file((kData / "self" / "weights" / "in_proj_weight.npy").string());
    int errors = 0;
    for (size_t n = 0; n < file.size(); ++n) {
        const std::vector<uint8_t> cut(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n));
        errors += !error_of([&] { parse_npy("cut", cut); }).empty();
    }
    CHECK(errors == static_cast<int>(file.size()));  // every strict prefix is refused
    std::mt19937 gen(42);
    for (int round = 0; round < 3000; ++round) {
        auto bad = file;
        const int flips = 1 + round % 4;
        for (int f = 0; f < flips; ++f) bad[gen() % std::min<size_t>(bad.size(), 140)] = static_cast<uint8_t>(gen());
        try {
            const Array a = parse_npy("fuzz", bad);
            int64_t esize = a.dtype == "|b1" || a.dtype == "|u1" || a.dtype == "|i1" ? 1 : a.dtype.back() == '8' ? 8 : 4;
            REQUIRE(static_cast<int64_t>(a.bytes.size()) == a.count() * esize);
        } catch (const FileError &) {
        }
    }
}

TEST_CASE("safetensors: the golden file holds the same tensors as the .npy directory") {
    const SafeTensors st = SafeTensors::read((kData / "cross_kdim_vdim" / "weights.safetensors").string());
    int n = 0;
    for (const auto &key : st.keys()) {
        CAPTURE(key);
        REQUIRE(key.rfind("attn.", 0) == 0);
        const Array a = st.get(key);
        const Array b = read_npy((kData / "cross_kdim_vdim" / "weights" / (key.substr(5) + ".npy")).string());
        CHECK(a.dtype == b.dtype);
        CHECK(a.shape == b.shape);
        CHECK(a.bytes == b.bytes);
        ++n;
    }
    CHECK(n == 6);
    CHECK(st.contains("attn.k_proj_weight"));
    CHECK(error_of([&] { st.get("attn.nope"); }).find("no tensor \"attn.nope\"") != std::string::npos);
}

TEST_CASE("safetensors: a header that lies about its offsets, and other corruption, is refused") {
    auto err = [](const std::string &header, size_t data) {
        return error_of([&] { SafeTensors::parse("w.st", safetensors_with(header, data)); });
    };
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})", 8).empty());
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 16]}})", 8).find("lie outside the 8 bytes") !=
          std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [8, 4]}})", 8).find("lie outside") != std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}})", 8).find("needs 3 x 4 bytes") !=
          std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}, "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}})", 8)
              .find("overlap") != std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}})", 8).find("not a size") != std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [4294967296, 4294967296, 4294967296], "data_offsets": [0, 8]}})", 8)
              .find("overflows") != std::string::npos);
    CHECK(err(R"({"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}})", 8).find("unsupported dtype C64") !=
          std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [2]}})", 8).find("data_offsets") != std::string::npos);
    CHECK(err(R"({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0]}})", 8).find("[begin, end]") != std::string::npos);
    CHECK(err(R"({"a": )", 8).find("not valid JSON") != std::string::npos);
    CHECK(err(R"([1, 2])", 8).find("not a JSON object") != std::string::npos);
    auto huge = safetensors_with("{}", 0);
    huge[7] = 0x7f;  // header length far past the end
    CHECK(error_of([&] { SafeTensors::parse("w.st", huge); }).find("truncated") != std::string::npos);
    CHECK(error_of([] { SafeTensors::parse("w.st", {1, 2, 3}); }).find("found 3 bytes") != std::string::npos);
    CHECK(error_of([] { SafeTensors::read("/nonexistent/w.safetensors"); }).find("cannot open") != std::string::npos);
}

TEST_CASE("safetensors fuzz: truncations and flipped bytes never crash") {
    const auto file = read_file((kData / "self" / "weights.safetensors").string());
    for (size_t n = 0; n < file.size(); n += n < 600 ? 1 : 97) {
        const std::vector<uint8_t> cut(file.begin(), file.begin() + static_cast<std::ptrdiff_t>(n));
        // A cut inside the header or the data is always detected: the offsets cover the whole file.
        CHECK_FALSE(error_of([&] { SafeTensors::parse("cut", cut); }).empty());
    }
    std::mt19937 gen(7);
    for (int round = 0; round < 3000; ++round) {
        auto bad = file;
        for (int f = 0; f <= round % 3; ++f) bad[gen() % std::min<size_t>(bad.size(), 600)] = static_cast<uint8_t>(gen());
        try {
            const SafeTensors st = SafeTensors::parse("fuzz", bad);
            for (const auto &k : st.keys()) {
                const Array a = st.get(k);
                REQUIRE(a.bytes.size() <= bad.size());
            }
        } catch (const FileError &) {
        }
    }
}
