// Runs one of the built tools (its path in an environment variable that meson test sets) and
// returns its exit code and output.
#pragma once

#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>

#include <doctest/doctest.h>

namespace mha::test {

struct ToolResult {
    int code = -1;
    std::string output;  // stdout, then stderr if asked
};

// `env_var` names the binary (e.g. MHA_RUN); `prefix` goes before it (environment settings).
inline ToolResult run_tool(const char *env_var, const std::string &args, bool with_stderr = true,
                           const std::string &prefix = "") {
    const char *exe = std::getenv(env_var);
    REQUIRE_MESSAGE(exe, env_var << " must name the tool's binary (meson test sets it)");
    ToolResult r;
    FILE *p = popen((prefix + " " + exe + " " + args + (with_stderr ? " 2>&1" : " 2>/dev/null")).c_str(), "r");
    REQUIRE(p);
    char buf[4096];
    for (size_t n; (n = fread(buf, 1, sizeof buf, p)) > 0;) r.output.append(buf, n);
    const int status = pclose(p);
    r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    return r;
}

// A scratch directory removed at the end of the scope.
struct TempDir {
    std::filesystem::path path =
        std::filesystem::temp_directory_path() / ("mha_tool_test_" + std::to_string(getpid()) + "_" + std::to_string(rand()));
    TempDir() { std::filesystem::create_directories(path); }
    ~TempDir() { std::filesystem::remove_all(path); }
    std::string operator/(const std::string &name) const { return (path / name).string(); }
};

// Quoted for the shell.
inline std::string shell_quote(const std::filesystem::path &p) {
    std::string s(1, '\'');
    s += p.string();
    s += '\'';
    return s;
}

} // namespace mha::test
