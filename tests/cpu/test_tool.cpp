// The `megamoe` command-line tool, run as a subprocess (MEGAMOE_TOOL_PATH): info, flag and value
// errors, presets (gpt-oss-120b refused without --pad), check against the float64 reference, the
// --dump files (parsed back and recomputed here), bench rows with their JSON and CSV, the per-rank
// weight generation (the same weights for any EP size) and the host-memory limit (--max-host-gb).
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "core/device.h"
#include "megamoe/formats.h"
#include "megamoe/layer.h"
#include "megamoe/weights.h"
#include "megamoe/workspace.h"
#include "reference/problem.h"
#include "reference/reference_moe.h"

namespace {

struct ToolRun {
  int rc = -1;
  std::string out;  // stdout, plus stderr when merged
};

// Runs the tool with `args` (a shell fragment). A tool killed by a signal gives rc >= 128.
ToolRun run_tool(const std::string& args, bool merge_stderr = true) {
  const std::string cmd = std::string(MEGAMOE_TOOL_PATH) + " " + args + (merge_stderr ? " 2>&1" : " 2>/dev/null");
  ToolRun r;
  FILE* pipe = popen(cmd.c_str(), "r");
  if (!pipe) return r;
  char buf[4096];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), pipe)) > 0) r.out.append(buf, n);
  const int status = pclose(pipe);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + (WIFSIGNALED(status) ? WTERMSIG(status) : 0);
  return r;
}

bool contains(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// A failure the tool handled: a message and one of its documented exit codes, never a crash.
void expect_refused(const ToolRun& r, int rc, const std::vector<std::string>& words) {
  EXPECT_EQ(r.rc, rc) << r.out;
  for (const std::string& w : words) EXPECT_TRUE(contains(r.out, w)) << "missing '" << w << "' in:\n" << r.out;
}

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "megamoe_tool_XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A parsed .npy v1.0 file.
struct Npy {
  std::string descr;
  bool fortran_order = true;
  std::vector<int64_t> shape;
  std::string data;
};

// Parses the header independently of the tool's writer; fails the test on any format violation.
Npy parse_npy(const std::string& path) {
  Npy a;
  const std::string raw = read_file(path);
  EXPECT_GE(raw.size(), 10u) << path;
  if (raw.size() < 10) return a;
  EXPECT_EQ(raw.substr(0, 6), std::string("\x93NUMPY", 6)) << path;
  EXPECT_EQ(raw[6], 1) << path << ": major version";
  EXPECT_EQ(raw[7], 0) << path << ": minor version";
  const size_t header_len = static_cast<uint8_t>(raw[8]) | (static_cast<size_t>(static_cast<uint8_t>(raw[9])) << 8);
  EXPECT_EQ((10 + header_len) % 64, 0u) << path << ": data must start on a 64-byte boundary";
  const std::string header = raw.substr(10, header_len);
  EXPECT_EQ(header.back(), '\n') << path;
  auto field = [&](const std::string& key) -> std::string {
    const size_t at = header.find("'" + key + "': ");
    EXPECT_NE(at, std::string::npos) << path << ": no key " << key << " in " << header;
    return at == std::string::npos ? std::string() : header.substr(at + key.size() + 4);
  };
  const std::string d = field("descr");
  a.descr = d.substr(1, d.find('\'', 1) - 1);
  a.fortran_order = field("fortran_order").rfind("True", 0) == 0;
  const std::string s = field("shape");
  const std::string inner = s.substr(1, s.find(')') - 1);
  std::stringstream ss(inner);
  std::string item;
  while (std::getline(ss, item, ','))
    if (item.find_first_not_of(' ') != std::string::npos) a.shape.push_back(std::stoll(item));
  a.data = raw.substr(10 + header_len);
  return a;
}

int64_t numel(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

template <typename T>
std::vector<T> as(const Npy& a) {
  std::vector<T> v(a.data.size() / sizeof(T));
  std::memcpy(v.data(), a.data.data(), v.size() * sizeof(T));
  return v;
}

double parse_after(const std::string& s, const std::string& key) {
  const size_t at = s.find(key);
  return at == std::string::npos ? NAN : std::atof(s.c_str() + at + key.size());
}

// ---- info ----

TEST(Tool, Info_PrintsBuildDevicesAndNccl) {
  const ToolRun r = run_tool("info");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* w : {"megamoe 0", "build:", "CUDA toolkit", "sm_90a", "CUDA devices:", "NCCL", "tiny"})
    EXPECT_TRUE(contains(r.out, w)) << w << "\n" << r.out;
}

TEST(Tool, Info_DeepseekV3_EP8_WorkspaceMatchesLayout) {
  const ToolRun r = run_tool("info --preset deepseek-v3 --ep 8 --tokens 128");
  ASSERT_EQ(r.rc, 0) << r.out;
  for (const char* w : {"hidden=7168", "auto ->", "reason:", "recv_tokens", "intermediate_scales", "MiB"})
    EXPECT_TRUE(contains(r.out, w)) << w << "\n" << r.out;
  megamoe::MoeGeometry g{7168, 2048, 256, 8, 8, 0, 128};
  const megamoe::WorkspaceLayout l = megamoe::WorkspaceLayout::make(megamoe::workspace_params(g, megamoe::MoeConfig()));
  // "  total   <bytes>  (<MiB> MiB, ...)"
  const size_t at = r.out.find("\n  total");
  ASSERT_NE(at, std::string::npos) << r.out;
  EXPECT_EQ(std::atoll(r.out.c_str() + at + 8), l.total_bytes) << r.out.substr(at, 120);
  for (int i = 0; i < megamoe::WorkspaceLayout::kNumRegions; ++i)
    EXPECT_TRUE(contains(r.out, megamoe::WorkspaceLayout::region_formula(i))) << i;
}

// With mxfp4 weights: the routed layer's prefill expansion, its scratch per workspace key (deepseek-v3
// at EP8, T_max 8192: 32 experts x 2I x H e4m3 = 896 MiB), none when T_max's bucket stays below the
// threshold, off by the knob, and a bad knob's message instead of a number.
TEST(Tool, Info_Mxfp4_PrintsThePrefillExpansionScratch) {
  const std::string base = "info --preset deepseek-v3 --ep 8 --weight-format mxfp4 ";
  ToolRun r = run_tool(base + "--tokens 8192");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "routed mxfp4 prefill expansion: from 256 rows per expert")) << r.out;
  EXPECT_TRUE(contains(r.out, "scratch per workspace key 896.000 MiB (32 of 32 experts per chunk)")) << r.out;
  r = run_tool(base + "--tokens 64");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "none here (T_max's bucket: 24 rows), no scratch")) << r.out;
  ASSERT_EQ(setenv("MEGAMOE_MXFP4_EXPAND_ROWS", "off", 1), 0);
  r = run_tool(base + "--tokens 8192");
  EXPECT_TRUE(contains(r.out, "routed mxfp4 prefill expansion: off (MEGAMOE_MXFP4_EXPAND_ROWS=off)")) << r.out;
  ASSERT_EQ(setenv("MEGAMOE_MXFP4_EXPAND_ROWS", "some", 1), 0);
  r = run_tool(base + "--tokens 8192");
  EXPECT_TRUE(contains(r.out, "MEGAMOE_MXFP4_EXPAND_ROWS='some', must be 'off' or a positive integer")) << r.out;
  ASSERT_EQ(unsetenv("MEGAMOE_MXFP4_EXPAND_ROWS"), 0);
  r = run_tool("info --preset deepseek-v3 --ep 8 --tokens 8192");  // fp8-block: no such line
  EXPECT_FALSE(contains(r.out, "prefill expansion")) << r.out;
  EXPECT_FALSE(contains(r.out, "decode tiles")) << r.out;
}

// The decode GEMMs' CTAs per SM (no GPU here: an H200's 132 SMs): deepseek-v3 EP1 (256 experts) runs
// FC2 at two from 4 tokens (32 rows: 30 experts x 28 n-blocks) and FC1 from 6; EP8's 32 experts never
// reach 5 FC1 tiles per SM (at most 512); the knob forces it, a bad value prints the rule.
TEST(Tool, Info_Mxfp4_PrintsTheDecodeTilesCtasPerSm) {
  ToolRun r = run_tool("info --preset deepseek-v3 --weight-format mxfp4 --tokens 128");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "routed mxfp4 decode tiles (16 rows up to T = 128): two CTAs per SM for FC1 from T = 6, "
                              "FC2 from T = 4 (5 expected tiles per SM on 132 SMs"))
      << r.out;
  r = run_tool("info --preset deepseek-v3 --ep 8 --weight-format mxfp4 --tokens 128");
  EXPECT_TRUE(contains(r.out, "(16 rows up to T = 39): two CTAs per SM for FC1 never, FC2 from T = 6")) << r.out;
  ASSERT_EQ(setenv("MEGAMOE_GEMM_FP4_CTAS_PER_SM", "1", 1), 0);
  r = run_tool("info --preset deepseek-v3 --weight-format mxfp4 --tokens 128");
  EXPECT_TRUE(contains(r.out, "routed mxfp4 decode tiles: 1 CTA(s) per SM (MEGAMOE_GEMM_FP4_CTAS_PER_SM=1)")) << r.out;
  ASSERT_EQ(setenv("MEGAMOE_GEMM_FP4_CTAS_PER_SM", "4", 1), 0);
  r = run_tool("info --preset deepseek-v3 --weight-format mxfp4 --tokens 128");
  EXPECT_TRUE(contains(r.out, "MEGAMOE_GEMM_FP4_CTAS_PER_SM='4', must be 1 or 2")) << r.out;
  ASSERT_EQ(unsetenv("MEGAMOE_GEMM_FP4_CTAS_PER_SM"), 0);
}

// ---- flag and value errors ----

TEST(Tool, BadFlag_NonZeroWithMessage) {
  expect_refused(run_tool("info --no-such-flag"), 2, {"--no-such-flag"});
  expect_refused(run_tool(""), 2, {"subcommand"});
  expect_refused(run_tool("check --preset tiny"), 2, {"--backend"});
}

TEST(Tool, BadValues_NameFlagValueAndRule) {
  expect_refused(run_tool("check --preset tiny --backend cpu --ep abc"), 2, {"--ep", "abc", "integer"});
  expect_refused(run_tool("check --preset tiny --backend gpu"), 2, {"--backend", "gpu", "cpu"});
  expect_refused(run_tool("check --preset tiny --backend cpu --ep 3"), 2, {"--ep", "16", "divisible"});
  expect_refused(run_tool("check --preset tiny --backend cpu --weight-format fp6"), 2, {"--weight-format", "fp6"});
  expect_refused(run_tool("check --preset tiny --backend cpu --routing zipf"), 2, {"--routing", "zipf"});
  expect_refused(run_tool("check --preset tiny --backend cpu --combine-dtype nvfp4 --in-kernel-fc2-reduce"), 2,
                 {"in_kernel_fc2_reduce", "bf16"});
  expect_refused(run_tool("check --preset tiny --backend cpu --owner-reduce --in-kernel-fc2-reduce"), 2,
                 {"owner_reduce=on", "--owner-reduce", "--in-kernel-fc2-reduce", "pick one"});
  expect_refused(run_tool("check --preset tiny --backend cpu --owner-reduce --no-owner-reduce"), 2,
                 {"--owner-reduce", "--no-owner-reduce"});
  expect_refused(run_tool("bench --preset tiny --backend cpu --tokens 1,,4"), 2, {"--tokens", "1,,4"});
  expect_refused(run_tool("bench --preset tiny --backend cpu --iters -3"), 2, {"--iters"});
  // bench-gemm's flags are checked before it looks for a GPU
  expect_refused(run_tool("bench-gemm --schedule roundrobin"), 2, {"--schedule", "roundrobin", "dynamic", "static"});
  expect_refused(run_tool("bench-gemm --block-m 96"), 2, {"--block-m", "96", "64", "128"});
  expect_refused(run_tool("bench-gemm --block-n 192"), 2, {"--block-n", "192", "256"});
  expect_refused(run_tool("bench-gemm --num-sms 0"), 2, {"--num-sms", "0"});
  expect_refused(run_tool("bench-gemm --flush none"), 2, {"--flush", "none", "memset", "read"});
  expect_refused(run_tool("bench-gemm --weight-format mxfp4 --fp4-math-wg 3"), 2, {"--fp4-math-wg", "3"});
  expect_refused(run_tool("bench-gemm --fp4-math-wg 2"), 2, {"--fp4-math-wg", "2", "--weight-format mxfp4", "fp8-block"});
  expect_refused(run_tool("bench-transport --combine-groups 9"), 2, {"--combine-groups", "9", "0 to 8"});
  expect_refused(run_tool("bench-transport --x fp4"), 2, {"--x", "fp4", "bf16", "fp8"});
  // bench-link's flags are checked before it looks for two GPUs
  expect_refused(run_tool("bench-link --paths store,warp"), 2, {"--paths", "warp", "store", "ce-lsa", "handshake-grid"});
  expect_refused(run_tool("bench-link --chunk 1000"), 2, {"--chunk", "1000", "multiple of 16"});
  expect_refused(run_tool("bench-link --stages 0"), 2, {"--stages", "0"});
  expect_refused(run_tool("bench-link --paths handshake --handshakes 0"), 2, {"--handshakes", "0"});
  expect_refused(run_tool("bench-link --paths tma --tma-warps 8 --stages 8 --chunk 16384"), 2,
                 {"--tma-warps", "--stages", "--chunk", "shared memory", "232448"});
  expect_refused(run_tool("bench-link --paths staged --staged-warps 16 --chunk 8192"), 2,
                 {"--staged-warps", "--chunk", "262144", "232448"});
}

// One process per rank (megamoe launch) needs a GPU backend: the cpu backend's ranks share host
// memory. Each launched process refuses with the rule, and launch passes the exit code on.
TEST(Tool, Launched_CpuBackend_RefusedWithTheRule) {
  const std::string tool = MEGAMOE_TOOL_PATH;
  for (const char* cmd : {"check --preset tiny --backend cpu --ep 2 --tokens 4",
                          "bench --preset tiny --backend cpu --ep 2 --tokens 4 --iters 1"})
    expect_refused(run_tool("launch -n 2 -- " + tool + " " + cmd), 2,
                   {"backend=cpu", "one process per rank needs a GPU backend", "without megamoe launch"});
}

TEST(Tool, UnknownPreset_ListsPresets) {
  expect_refused(run_tool("check --preset llama-moe --backend cpu"), 2, {"llama-moe", "deepseek-v3", "tiny"});
  expect_refused(run_tool("info --preset llama-moe"), 2, {"llama-moe"});
}

TEST(Tool, GptOss120b_RefusedWithoutPad_Names2880And128) {
  expect_refused(run_tool("check --preset gpt-oss-120b --backend cpu"), 2, {"2880", "128", "--pad"});
  expect_refused(run_tool("info --preset gpt-oss-120b"), 2, {"2880", "128", "--pad"});
}

TEST(Tool, GptOss120b_Padded_ChecksOnCpuWithFewExperts) {
  const ToolRun r = run_tool("check --preset gpt-oss-120b --backend cpu --pad --experts 4 --tokens 4");
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "hidden=2944")) << r.out;
  EXPECT_TRUE(contains(r.out, "intermediate=2944")) << r.out;
  EXPECT_TRUE(contains(r.out, "PASS")) << r.out;
}

// ---- check ----

void expect_check_passes(const std::string& args, int num_ranks) {
  const ToolRun r = run_tool("check --preset tiny --backend cpu " + args);
  ASSERT_EQ(r.rc, 0) << r.out;
  const double rel = parse_after(r.out, "overall: rel_l2 ");
  const double bound = parse_after(r.out, "bound rel_l2 <= ");
  std::printf("[ tool ] check %s: rel_l2 %.4e, bound %.4g\n", args.c_str(), rel, bound);
  EXPECT_GT(rel, 1e-4) << "fp8 roundings leave a visible error; zero means nothing was compared";
  EXPECT_LE(rel, bound);
  EXPECT_TRUE(contains(r.out, "overall:") && contains(r.out, "PASS")) << r.out;
  for (int rank = 0; rank < num_ranks; ++rank)
    EXPECT_TRUE(contains(r.out, "\n" + std::to_string(rank) + " ")) << "no row for rank " << rank << "\n" << r.out;
}

TEST(Tool, Check_Tiny_Cpu_EP1) { expect_check_passes("--ep 1 --tokens 32", 1); }
TEST(Tool, Check_Tiny_Cpu_EP2) { expect_check_passes("--ep 2 --tokens 32", 2); }
TEST(Tool, Check_Tiny_Cpu_EP2_Dropped_Nvfp4Combine) {
  expect_check_passes("--ep 2 --tokens 16 --routing dropped --combine-dtype nvfp4 --weight-format mxfp8", 2);
}

TEST(Tool, Check_Tiny_Cpu_EP4_Dropped_OwnerReduce_Mxfp8Combine) {
  expect_check_passes("--ep 4 --tokens 16 --routing dropped --owner-reduce --combine-dtype mxfp8", 4);
}

TEST(Tool, Check_GpuBackend_FailsWithTheLayersReason) {
  const megamoe::MoeGeometry g{512, 256, 16, 4, 1, 0, 64};
  const megamoe::MoeConfig c;
  for (const char* b : {"mega", "routed"}) {
    const megamoe::Status gate =
        std::string(b) == "mega" ? megamoe::mega_capability(g, c) : megamoe::routed_capability(g, c);
    if (gate.is_ok()) {
      std::printf("[ tool ] backend %s is available here; nothing to refuse\n", b);
      continue;
    }
    const ToolRun r = run_tool(std::string("check --preset tiny --backend ") + b);
    EXPECT_EQ(r.rc, 3) << r.out;
    EXPECT_TRUE(contains(r.out, std::string("backend=") + b + " is unavailable: " + gate.message())) << r.out;
    EXPECT_FALSE(contains(r.out, "PASS")) << r.out;
  }
}

TEST(Tool, Check_HostMemoryRefusal_NamesBytesAndSuggestsExperts) {
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  // deepseek-v3 on the cpu backend needs ~101 GB; a host where 60% of RAM covers that would run it.
  if (physical * 0.6 > 110e9) GTEST_SKIP() << "this host has enough memory to run deepseek-v3 on the cpu backend";
  expect_refused(run_tool("check --preset deepseek-v3 --backend cpu"), 2,
                 {"deepseek-v3", "needs about 101.", "bytes", "60% of the memory this machine reports", "MemTotal",
                  "--max-host-gb G (G >= 102)", "--experts N shrinks it", "tiny"});
}

// ---- host memory: the estimate, the limit, --max-host-gb ----

TEST(Tool, MaxHostGb_Validated) {
  for (const char* cmd : {"check --preset tiny --backend cpu", "bench --preset tiny --backend cpu --iters 1"})
    for (const char* bad : {"abc", "0", "-1", "nan", "inf", "2e6", "5GB", "''"})
      expect_refused(run_tool(std::string(cmd) + " --max-host-gb " + bad), 2,
                     {"--max-host-gb", "positive number of GB"});
  // A positive number, fractions included: tiny needs about 57 MB.
  const ToolRun r = run_tool("check --preset tiny --backend cpu --tokens 4 --max-host-gb 0.5");
  EXPECT_EQ(r.rc, 0) << r.out;
}

// Not host dependent: the limit comes from --max-host-gb. deepseek-v3 on the cpu backend at EP1 needs
// the fp32 source 45.1 GB + fp8-block 11.3 GB + the cpu backend's fp32 copy 45.1 GB (+ inputs).
TEST(Tool, MaxHostGb_RefusalSaysNeededSeenAndHowToShrink) {
  for (const char* cmd : {"check --preset deepseek-v3 --backend cpu", "bench --preset deepseek-v3 --backend cpu --tokens 1"}) {
    const ToolRun r = run_tool(std::string(cmd) + " --max-host-gb 10");
    expect_refused(r, 2,
                   {"deepseek-v3 needs about 101.", "of host memory at its peak", "fp32 source slices", "45.10 GB",
                    "prepared (fp8-block) 11.28 GB", "fp32 working copy", "above the limit of 10.00 GB",
                    "set by --max-host-gb 10", "MemTotal in /proc/meminfo", "raise it to at least 102",
                    "--experts N shrinks it (--experts ", "tiny"});
  }
  // A GPU backend has no fp32 working copy but a staging copy for the upload (bench refuses before any
  // case runs, so this needs no GPU).
  expect_refused(run_tool("bench --preset deepseek-v3 --backend routed --ep 2 --tokens 1 --max-host-gb 10"), 2,
                 {"needs about 63.", "all 2 rank(s) 45.10 GB", "GPU upload staging", "above the limit of 10.00 GB"});
}

// The suggested --experts N is the largest multiple of --ep that fits the limit: N runs, N + ep does not.
TEST(Tool, MaxHostGb_SuggestedExpertsFitAndOneMoreDoesNot) {
  const std::string base = "check --preset tiny --backend cpu --ep 2 --tokens 4 --max-host-gb 0.04";
  const ToolRun refused = run_tool(base);
  ASSERT_EQ(refused.rc, 2) << refused.out;
  const size_t at = refused.out.find("(--experts ");
  ASSERT_NE(at, std::string::npos) << refused.out;
  const int n = std::atoi(refused.out.c_str() + at + 11);
  ASSERT_GE(n, 4) << refused.out;
  ASSERT_LT(n, 16) << refused.out;
  EXPECT_EQ(n % 2, 0) << "a multiple of --ep";
  const ToolRun fits = run_tool(base + " --experts " + std::to_string(n));
  EXPECT_EQ(fits.rc, 0) << fits.out;
  EXPECT_TRUE(contains(fits.out, "PASS")) << fits.out;
  expect_refused(run_tool(base + " --experts " + std::to_string(n + 2)), 2, {"needs about", "--max-host-gb 0.04"});
}

TEST(Tool, Check_DumpAbove4GiB_Refused) {
  TempDir dir;
  const std::string d = dir.path() + "/dump";
  expect_refused(run_tool("check --preset mixtral-8x7b --backend cpu --dump " + d), 2, {"--dump", "4 GiB", "bytes"});
  EXPECT_FALSE(std::filesystem::exists(d));
}

// ---- dump ----

TEST(Tool, Check_Dump_Tiny_EP2_NpyFilesAndMetaAgreeWithReference) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const std::string d = dir.path() + "/dump";
  const ToolRun r = run_tool("check --preset tiny --backend cpu --ep 2 --tokens 8 --seed 7 --dump " + d);
  ASSERT_EQ(r.rc, 0) << r.out;

  const nlohmann::json meta = nlohmann::json::parse(read_file(d + "/meta.json"));
  const auto& geo = meta.at("geometry");
  for (const char* k : {"hidden", "intermediate", "num_experts", "top_k", "ep_size", "max_tokens_per_rank"})
    EXPECT_TRUE(geo.contains(k)) << k;
  for (const char* k : {"backend", "weight_format", "dispatch_format", "combine_dtype", "in_kernel_fc2_reduce",
                        "owner_reduce", "owner_reduce_in_use", "pow2_scales"})
    EXPECT_TRUE(meta.at("config").contains(k)) << k;
  EXPECT_EQ(meta.at("formats").at("intermediate_format"), "fp8-block");
  EXPECT_EQ(meta.at("seed"), 7);
  EXPECT_EQ(meta.at("tokens_per_rank"), nlohmann::json({8, 8}));
  const int64_t H = geo.at("hidden"), I = geo.at("intermediate"), E = geo.at("num_experts"), k = geo.at("top_k");
  ASSERT_EQ(H, 512);
  ASSERT_EQ(E, 16);

  // Every listed file: a valid .npy whose header matches the listing and whose size matches the shape.
  std::vector<std::string> names;
  for (const auto& f : meta.at("files")) {
    const std::string name = f.at("name");
    names.push_back(name);
    const Npy a = parse_npy(d + "/" + name);
    EXPECT_EQ(a.descr, f.at("descr").get<std::string>()) << name;
    EXPECT_FALSE(a.fortran_order) << name;
    EXPECT_EQ(a.shape, f.at("shape").get<std::vector<int64_t>>()) << name;
    const int64_t item = a.descr == "<f4" || a.descr == "<i4" ? 4 : a.descr == "<u2" ? 2 : 1;
    EXPECT_EQ(static_cast<int64_t>(a.data.size()), numel(a.shape) * item) << name;
    if (a.descr == "<f4") {
      for (float v : as<float>(a)) ASSERT_TRUE(std::isfinite(v)) << name;
    }
  }
  for (const char* n : {"w13_f32.npy", "w2_f32.npy", "w13_q.npy", "w13_scale.npy", "w2_q.npy", "w2_scale.npy",
                        "rank0/x_f32.npy", "rank1/y_f32.npy", "rank1/x_bf16.npy", "rank0/topk_ids.npy",
                        "rank0/topk_weights.npy"})
    EXPECT_NE(std::find(names.begin(), names.end(), n), names.end()) << n;

  const Npy w13 = parse_npy(d + "/w13_f32.npy"), w2 = parse_npy(d + "/w2_f32.npy");
  EXPECT_EQ(w13.shape, (std::vector<int64_t>{E, 2 * I, H}));
  EXPECT_EQ(w2.shape, (std::vector<int64_t>{E, H, I}));
  const std::vector<float> w13f = as<float>(w13), w2f = as<float>(w2);

  // The raw fp8-block tensors dequantise to exactly the fp32 weights the dump says the layer used.
  const Npy q = parse_npy(d + "/w13_q.npy"), s = parse_npy(d + "/w13_scale.npy");
  EXPECT_EQ(s.shape, (std::vector<int64_t>{E, 2 * I / 128, H / 128}));
  const std::vector<uint8_t> qv = as<uint8_t>(q);
  const std::vector<float> sv = as<float>(s);
  std::vector<float> deq(static_cast<size_t>(2 * I * H));
  for (int64_t e = 0; e < E; ++e) {
    megamoe::fmt::dequantize_fp8_128x128(qv.data() + e * 2 * I * H, sv.data() + e * (2 * I / 128) * (H / 128), 2 * I,
                                         H, deq.data());
    ASSERT_EQ(0, std::memcmp(deq.data(), w13f.data() + e * 2 * I * H, deq.size() * 4)) << "expert " << e;
  }

  // y_f32 against the float64 reference recomputed from the dumped x, ids, weights: the rel-L2 the
  // tool printed (meta results) and the bound.
  megamoe::MoeGeometry g{H, I, E, k, 2, 0, 8};
  for (int rank = 0; rank < 2; ++rank) {
    const std::string p = d + "/rank" + std::to_string(rank) + "/";
    const Npy x = parse_npy(p + "x_f32.npy"), ids = parse_npy(p + "topk_ids.npy"), w = parse_npy(p + "topk_weights.npy"),
              y = parse_npy(p + "y_f32.npy"), xb = parse_npy(p + "x_bf16.npy");
    EXPECT_EQ(x.shape, (std::vector<int64_t>{8, H}));
    EXPECT_EQ(xb.shape, (std::vector<int64_t>{8, H}));
    EXPECT_EQ(ids.shape, (std::vector<int64_t>{8, k}));
    EXPECT_EQ(y.shape, (std::vector<int64_t>{8, H}));
    const std::vector<float> xv = as<float>(x), yv = as<float>(y);
    // x_f32 is x after the fp8-block dispatch: close to the bf16 input, not equal to it.
    const std::vector<uint16_t> xbv = as<uint16_t>(xb);
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < xv.size(); ++i) {
      const double v = megamoe::fmt::bf16_to_float(xbv[i]);
      diff2 += (xv[i] - v) * (xv[i] - v);
      ref2 += v * v;
    }
    EXPECT_GT(std::sqrt(diff2 / ref2), 1e-3);
    EXPECT_LT(std::sqrt(diff2 / ref2), 0.05);
    std::vector<double> ref(static_cast<size_t>(8 * H));
    megamoe::reference::reference_moe(g, 8, xv.data(), as<int32_t>(ids).data(), as<float>(w).data(), w13f.data(),
                                      w2f.data(), ref.data());
    const double rel = megamoe::reference::rel_l2(yv.data(), ref.data(), 8 * H);
    const double printed = meta.at("results").at("ranks").at(rank).at("rel_l2");
    EXPECT_NEAR(rel, printed, 1e-9 + 1e-6 * printed) << "rank " << rank;
    EXPECT_LE(rel, meta.at("results").at("bound_rel_l2").get<double>());
    EXPECT_GT(rel, 1e-4);
  }
}

// ---- per-rank weight generation ----

// Weights are generated per (seed, global expert, matrix): the dumped weights are the same bytes
// whatever the EP size, so EP1 and EP2 runs of one seed compute with the same experts.
TEST(Tool, Check_Dump_EP1_EP2_EP4_IdenticalWeights) {
  TempDir dir;
  ASSERT_FALSE(dir.path().empty());
  const char* files[] = {"w13_f32.npy", "w2_f32.npy", "w13_q.npy", "w13_scale.npy", "w2_q.npy", "w2_scale.npy"};
  std::vector<std::string> ep1;
  for (int ep : {1, 2, 4}) {
    const std::string d = dir.path() + "/ep" + std::to_string(ep);
    const ToolRun r = run_tool("check --preset tiny --backend cpu --tokens 4 --seed 11 --ep " + std::to_string(ep) +
                               " --dump " + d);
    ASSERT_EQ(r.rc, 0) << r.out;
    for (size_t i = 0; i < std::size(files); ++i) {
      const std::string bytes = read_file(d + "/" + files[i]);
      ASSERT_GT(bytes.size(), 128u) << files[i];
      if (ep == 1)
        ep1.push_back(bytes);
      else
        EXPECT_TRUE(bytes == ep1[i]) << files[i] << " differs between --ep 1 and --ep " << ep;
    }
  }
  // Another seed gives other weights.
  const std::string d = dir.path() + "/seed12";
  ASSERT_EQ(run_tool("check --preset tiny --backend cpu --tokens 4 --seed 12 --dump " + d).rc, 0);
  EXPECT_FALSE(read_file(d + "/w13_f32.npy") == ep1[0]);
}

// The generator itself: a rank's slice equals the same experts of the whole problem, for any thread
// count (thread ranges cut pairs of the polar method at odd offsets); distinct (expert, matrix)
// streams; N(0, 1/K) statistics.
TEST(Tool, Generator_SliceAndThreadCountDoNotChangeWeights) {
  const megamoe::MoeGeometry g{512, 256, 16, 4, 4, 0, 8};
  const int64_t H = 512, I = 256, w13_elems = 2 * I * H, w2_elems = H * I;
  const megamoe::reference::MoeProblem p = megamoe::reference::make_random_problem(g, 5, {3, 0, 2, 1});
  ASSERT_EQ(static_cast<int64_t>(p.w13.size()), 16 * w13_elems);
  for (int threads : {1, 3, 7}) {
    for (int64_t rank = 0; rank < 4; ++rank) {
      const megamoe::reference::ExpertWeights w = megamoe::reference::make_rank_weights(g, 5, rank, threads);
      ASSERT_EQ(w.first_expert, rank * 4);
      ASSERT_EQ(w.num_experts, 4);
      ASSERT_EQ(0, std::memcmp(w.w13.data(), p.w13.data() + rank * 4 * w13_elems, w.w13.size() * 4))
          << "rank " << rank << ", " << threads << " threads";
      ASSERT_EQ(0, std::memcmp(w.w2.data(), p.w2.data() + rank * 4 * w2_elems, w.w2.size() * 4))
          << "rank " << rank << ", " << threads << " threads";
    }
  }
  // An odd slice (experts 5..7) on 5 threads.
  const megamoe::reference::ExpertWeights odd = megamoe::reference::make_expert_weights(g, 5, 5, 3, 5);
  EXPECT_EQ(0, std::memcmp(odd.w13.data(), p.w13.data() + 5 * w13_elems, odd.w13.size() * 4));
  EXPECT_EQ(0, std::memcmp(odd.w2.data(), p.w2.data() + 5 * w2_elems, odd.w2.size() * 4));
  // Streams differ between experts and between w13 and w2; statistics of N(0, 1/K).
  EXPECT_NE(0, std::memcmp(p.w13.data(), p.w13.data() + w13_elems, 4096));
  EXPECT_NE(0, std::memcmp(p.w13.data(), p.w2.data(), 4096));
  auto moments = [](const float* v, int64_t n, double* mean, double* var) {
    double s = 0, q = 0;
    for (int64_t i = 0; i < n; ++i) {
      s += v[i];
      q += static_cast<double>(v[i]) * v[i];
    }
    *mean = s / n;
    *var = q / n - *mean * *mean;
  };
  double mean = 0, var = 0;
  moments(p.w13.data(), static_cast<int64_t>(p.w13.size()), &mean, &var);
  std::printf("[ tool ] w13: mean %.3e, var * H %.4f\n", mean, var * H);
  EXPECT_LT(std::fabs(mean), 3e-4);
  EXPECT_NEAR(var * H, 1.0, 0.01);
  moments(p.w2.data(), static_cast<int64_t>(p.w2.size()), &mean, &var);
  EXPECT_NEAR(var * I, 1.0, 0.01);
  // Inputs: rank r's first T tokens do not depend on how many follow.
  const megamoe::reference::RankInputs a = megamoe::reference::make_rank_inputs(g, 5, 2, 2, megamoe::reference::Routing::kUniform, 1);
  const megamoe::reference::RankInputs b = megamoe::reference::make_rank_inputs(g, 5, 2, 9, megamoe::reference::Routing::kUniform, 4);
  EXPECT_TRUE(std::equal(a.x_bf16.begin(), a.x_bf16.end(), b.x_bf16.begin()));
  EXPECT_TRUE(std::equal(a.topk_ids.begin(), a.topk_ids.end(), b.topk_ids.begin()));
  EXPECT_TRUE(a.x_bf16 == p.ranks[2].x_bf16);
  EXPECT_TRUE(a.topk_ids == p.ranks[2].topk_ids);
}

// bench builds its later cases from the first case's prepared weights, handed back to
// MoeLayer::create as an e4m3 (fp8-block) or bf16 source: the layer must keep them bit for bit.
TEST(Tool, PreparedWeights_AsSource_PrepareToTheSameBytes) {
  const megamoe::MoeGeometry g{512, 256, 16, 4, 2, 1, 8};
  const megamoe::reference::ExpertWeights src = megamoe::reference::make_rank_weights(g, 3, 1);
  for (megamoe::WeightFormat f : {megamoe::WeightFormat::kFp8Block, megamoe::WeightFormat::kBf16}) {
    for (bool pow2 : {false, true}) {
      if (pow2 && f != megamoe::WeightFormat::kFp8Block) continue;
      megamoe::MoeConfig c;
      c.weight_format = f;
      c.dispatch_format = f == megamoe::WeightFormat::kBf16 ? megamoe::DispatchFormat::kBf16 : megamoe::DispatchFormat::kFp8Block;
      c.pow2_scales = pow2;
      megamoe::PreparedWeights first, again;
      ASSERT_TRUE(megamoe::prepare_weights(g, c, src.view(), &first).is_ok());
      auto data = [](const megamoe::QuantizedTensor& t) {
        return megamoe::TensorView(const_cast<uint8_t*>(t.data.data()), t.data_dtype(), {t.num_experts, t.rows, t.cols});
      };
      auto scales = [](const megamoe::QuantizedTensor& t) {
        return megamoe::TensorView(const_cast<uint8_t*>(t.scales.data()), megamoe::DType::kFloat32,
                                   {t.num_experts, t.rows / 128, t.cols / 128});
      };
      megamoe::MoeWeights views;
      views.w13 = data(first.w13);
      views.w2 = data(first.w2);
      if (f == megamoe::WeightFormat::kFp8Block) {
        views.w13_scale = scales(first.w13);
        views.w2_scale = scales(first.w2);
      }
      const megamoe::Status st = megamoe::prepare_weights(g, c, views, &again);
      ASSERT_TRUE(st.is_ok()) << st.message();
      EXPECT_TRUE(again.w13.data == first.w13.data && again.w2.data == first.w2.data) << megamoe::to_string(f);
      EXPECT_TRUE(again.w13.scales == first.w13.scales && again.w2.scales == first.w2.scales) << megamoe::to_string(f);
    }
  }
}

// ---- bench ----

// --layers N: the rows say so, the times are per layer, the command reproduces it, and a bad N is
// refused naming the flag.
TEST(Tool, Bench_Layers_PerLayerRowsAndCommand) {
  TempDir dir;
  const std::string json = dir.path() + "/layers.json";
  const ToolRun r = run_tool("bench --preset tiny --backend cpu --layers 3 --tokens 4 --iters 2 --warmup 1 --json " + json,
                             /*merge_stderr=*/false);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "--layers 3: each timed forward runs 3 layers")) << r.out;
  const nlohmann::json j = nlohmann::json::parse(read_file(json));
  ASSERT_EQ(j.at("rows").size(), 1u);
  EXPECT_EQ(j.at("rows")[0].at("layers"), 3);
  EXPECT_GT(j.at("rows")[0].at("median_us").get<double>(), 0);
  EXPECT_TRUE(contains(j.at("rows")[0].at("command").get<std::string>(), "--layers 3"));
  expect_refused(run_tool("bench --preset tiny --backend cpu --layers 0 --tokens 4"), 2, {"--layers", "0"});
}

TEST(Tool, Bench_Tiny_Cpu_RowsJsonCsvAndReproducingCommand) {
  TempDir dir;
  const std::string json = dir.path() + "/bench.json", csv = dir.path() + "/bench.csv";
  const ToolRun r = run_tool("bench --preset tiny --backend cpu --ep 2 --tokens 1,8 --iters 3 --warmup 1 --json " +
                                 json + " --csv " + csv,
                             /*merge_stderr=*/false);
  ASSERT_EQ(r.rc, 0) << r.out;
  EXPECT_TRUE(contains(r.out, "CPU wall time")) << r.out;
  EXPECT_TRUE(contains(r.out, "per rank")) << r.out;

  const nlohmann::json j = nlohmann::json::parse(read_file(json));
  ASSERT_EQ(j.at("rows").size(), 2u);
  std::string command;
  for (size_t i = 0; i < 2; ++i) {
    const auto& row = j.at("rows")[i];
    EXPECT_EQ(row.at("backend"), "cpu");
    EXPECT_EQ(row.at("tokens"), i == 0 ? 1 : 8);
    const double med = row.at("median_us"), mn = row.at("min_us"), mx = row.at("max_us");
    EXPECT_GT(mn, 0);
    EXPECT_LE(mn, med);
    EXPECT_LE(med, mx);
    EXPECT_GT(row.at("floor_us").get<double>(), 0);
    EXPECT_GT(row.at("tflops_per_rank").get<double>(), 0);
    EXPECT_GT(row.at("time_over_floor").get<double>(), 1) << "a CPU is not faster than the H200 floor";
    command = row.at("command");
    EXPECT_TRUE(contains(r.out, command)) << "the table prints each row's command";
  }
  const std::string csv_text = read_file(csv);
  EXPECT_EQ(std::count(csv_text.begin(), csv_text.end(), '\n'), 3) << csv_text;
  EXPECT_EQ(csv_text.rfind("backend,resolved,tokens,", 0), 0u) << csv_text;
  EXPECT_TRUE(contains(csv_text, "median_us")) << csv_text;

  // The second case builds from the first case's prepared weights; each rank generated its own slice.
  const ToolRun merged = run_tool("bench --preset tiny --backend cpu --ep 2 --tokens 1,8 --iters 1 --warmup 0");
  ASSERT_EQ(merged.rc, 0) << merged.out;
  EXPECT_TRUE(contains(merged.out, "each rank generates its 12.58 MB")) << merged.out;
  EXPECT_TRUE(contains(merged.out, "weights from the first case's prepared copy")) << merged.out;

  // The printed command reproduces the row.
  ASSERT_EQ(command.rfind("megamoe bench ", 0), 0u) << command;
  const ToolRun again = run_tool(command.substr(std::string("megamoe ").size()));
  EXPECT_EQ(again.rc, 0) << again.out;
  EXPECT_TRUE(contains(again.out, "\ncpu ")) << again.out;
}

// The NVLink bytes of the bench model (NVL_GB/s * R * median) recomputed from the inputs bench
// generates: dispatch rows per (token, remote rank) in both modes; combine rows per remote (token,
// slot), or with --owner-reduce per (token, remote owner rank).
TEST(Tool, Bench_OwnerReduce_OneCombineRowPerRemoteOwner_EP2) {
  TempDir dir;
  const std::string base = "bench --preset tiny --backend cpu --ep 2 --tokens 8 --input-sets 1 --iters 1 --warmup 0";
  const ToolRun slot = run_tool(base + " --json " + dir.path() + "/slot.json", /*merge_stderr=*/false);
  const ToolRun owner = run_tool(base + " --owner-reduce --json " + dir.path() + "/owner.json", false);
  ASSERT_EQ(slot.rc, 0) << slot.out;
  ASSERT_EQ(owner.rc, 0) << owner.out;
  EXPECT_TRUE(contains(owner.out, ", owner reduce;")) << owner.out;
  const nlohmann::json js = nlohmann::json::parse(read_file(dir.path() + "/slot.json"));
  const nlohmann::json jo = nlohmann::json::parse(read_file(dir.path() + "/owner.json"));
  EXPECT_EQ(js.at("config").at("owner_reduce"), "auto");  // a bf16 wire: per slot
  EXPECT_EQ(js.at("config").at("owner_reduce_in_use"), false);
  EXPECT_EQ(jo.at("config").at("owner_reduce"), "on");
  EXPECT_EQ(jo.at("config").at("owner_reduce_in_use"), true);
  const std::string command = jo.at("rows")[0].at("command");
  EXPECT_TRUE(contains(command, " --owner-reduce")) << command;
  EXPECT_FALSE(contains(js.at("rows")[0].at("command").get<std::string>(), "--owner-reduce"));

  const int64_t R = 2, T = 8, H = 512, k = 4, El = 8;
  const megamoe::MoeGeometry g{H, 256, 16, k, R, 0, T};
  const double dispatch_row = H + H / 128 * 4 + megamoe::token_meta_bytes(k), combine_row = 2 * H;
  double want_slot = 0, want_owner = 0;
  for (int64_t r = 0; r < R; ++r) {
    const megamoe::reference::RankInputs in = megamoe::reference::make_rank_inputs(g, 1, r, T);
    for (int64_t t = 0; t < T; ++t) {
      std::vector<bool> owns(R, false);
      for (int64_t j = 0; j < k; ++j) {
        const int32_t e = in.topk_ids[t * k + j];
        if (e < 0) continue;
        owns[e / El] = true;
        if (e / El != r) want_slot += combine_row;
      }
      for (int64_t d = 0; d < R; ++d) {
        if (!owns[d] || d == r) continue;
        want_slot += dispatch_row;
        want_owner += dispatch_row + combine_row;
      }
    }
  }
  auto link_bytes = [&](const nlohmann::json& j) {
    const auto& row = j.at("rows")[0];
    return row.at("nvlink_gbps_per_rank").get<double>() * 1e9 * R * row.at("median_us").get<double>() * 1e-6;
  };
  std::printf("[ tool ] NVLink bytes per forward: per slot %.0f, owner reduce %.0f\n", link_bytes(js), link_bytes(jo));
  EXPECT_NEAR(link_bytes(js), want_slot, 1e-6 * want_slot);
  EXPECT_NEAR(link_bytes(jo), want_owner, 1e-6 * want_owner);
  EXPECT_LT(want_owner, want_slot) << "top-4 of 16 experts on 2 ranks: most tokens have several remote slots per rank";
}

TEST(Tool, Bench_Default_FirstLineSaysCpuOnTinyWithoutDevice) {
  std::string reason;
  if (megamoe::cuda_device_count(&reason) > 0)
    GTEST_SKIP() << "a CUDA device is present: the default bench runs deepseek-v3 with backend auto";
  const ToolRun r = run_tool("bench", /*merge_stderr=*/false);
  ASSERT_EQ(r.rc, 0) << r.out;
  const std::string first = r.out.substr(0, r.out.find('\n'));
  EXPECT_TRUE(contains(first, "no CUDA device")) << first;
  EXPECT_TRUE(contains(first, "cpu backend on the tiny preset")) << first;
  EXPECT_TRUE(contains(r.out, "preset tiny")) << r.out;
}

TEST(Tool, Bench_UnavailableBackend_RowSaysWhyAndExitNonZero) {
  const megamoe::MoeGeometry g{512, 256, 16, 4, 1, 0, 2};
  if (megamoe::mega_capability(g, megamoe::MoeConfig()).is_ok()) GTEST_SKIP() << "the mega backend is available here";
  const ToolRun r = run_tool("bench --preset tiny --backend cpu,mega --tokens 2 --iters 1 --warmup 0", false);
  EXPECT_EQ(r.rc, 3) << r.out;
  EXPECT_TRUE(contains(r.out, "not run: backend=mega is unavailable")) << r.out;
  EXPECT_TRUE(contains(r.out, "\ncpu ")) << "the cpu case still runs\n" << r.out;
}

}  // namespace
