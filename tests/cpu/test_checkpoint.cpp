// Checkpoints as they ship (megamoe/checkpoint.h, src/io/): the safetensors header parser against
// files that lie, config.json geometry, and every layout's loader on small synthetic checkpoints the
// tests write with the real names, dtypes and shapes:
// - the loaded MoeWeights hold exactly this rank's experts' bytes, gate rows before up rows (gpt-oss's
//   interleaved rows separated), over one file, several files with an index, or several without;
// - prepare_weights in the checkpoint's own format keeps every bit; the dequantised values are the
//   formats.h codec's;
// - bad files and tensors are errors that name the file, the tensor and the rule;
// - `megamoe check --checkpoint` runs one layer on the cpu backend against the float64 reference.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "checkpoint_writer.h"
#include "io/safetensors.h"
#include "megamoe/checkpoint.h"
#include "megamoe/weights.h"

namespace megamoe {
namespace {

using testing_ckpt::StEntry;
using testing_ckpt::SynthCheckpoint;

#define EXPECT_CONTAINS(text, part)                                                                 \
  do {                                                                                              \
    const std::string _text = (text);                                                               \
    EXPECT_NE(_text.find(part), std::string::npos) << "missing \"" << (part) << "\" in: " << _text; \
  } while (0)

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "megamoe_ckpt_XXXXXX").string();
    path_ = mkdtemp(tmpl.data()) ? tmpl : std::string();
  }
  ~TempDir() {
    std::error_code ec;
    if (!path_.empty()) std::filesystem::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// ---------------------------------------------------------------------------------------------
// safetensors header

std::vector<StEntry> two_tensors() {
  return {{"a", "F32", {2, 3}, std::vector<uint8_t>(24, 1)}, {"b.weight", "U8", {4}, {9, 8, 7, 6}}};
}

Status open_file(const std::string& path, std::unique_ptr<io::SafetensorsFile>* f) {
  return io::SafetensorsFile::open(path, f);
}

TEST(Safetensors, ReadsNamesDtypesShapesDataAndMetadata) {
  TempDir d;
  testing_ckpt::write_safetensors(d.file("x.safetensors"), two_tensors());
  std::unique_ptr<io::SafetensorsFile> f;
  ASSERT_TRUE(open_file(d.file("x.safetensors"), &f).is_ok());
  const io::StHeader& h = f->header();
  EXPECT_EQ(h.data_offset % 8, 0u);
  ASSERT_EQ(h.tensors.size(), 2u);
  const io::StTensor* b = h.find("b.weight");
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(b->dtype, io::StDtype::kU8);
  EXPECT_EQ(b->shape, std::vector<int64_t>({4}));
  EXPECT_EQ(b->begin, 24u);
  EXPECT_EQ(std::vector<uint8_t>(f->data(*b), f->data(*b) + 4), std::vector<uint8_t>({9, 8, 7, 6}));
  EXPECT_EQ(h.find("a")->shape_string(), "[2, 3]");
  EXPECT_EQ(h.find("missing"), nullptr);
  EXPECT_EQ(h.metadata.at("format"), "pt");
}

TEST(Safetensors, EveryDtypeNameRoundTripsWithItsBits) {
  for (const char* name : {"BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0", "I16", "U16", "F16", "BF16", "I32",
                           "U32", "F32", "F64", "I64", "U64", "F4", "F6_E2M3", "F6_E3M2"}) {
    io::StDtype d;
    ASSERT_TRUE(io::parse_st_dtype(name, &d)) << name;
    EXPECT_STREQ(io::to_string(d), name);
    EXPECT_GT(io::bit_size(d), 0) << name;
  }
  io::StDtype d;
  EXPECT_FALSE(io::parse_st_dtype("F8_E4M3FN", &d));
  EXPECT_EQ(io::bit_size(io::StDtype::kF4), 4);
}

// Each bad header: a file whose header is `json` (and `data_bytes` of data), and the words its error
// must contain besides the path.
struct BadHeader {
  const char* what;
  std::string json;
  size_t data_bytes;
  std::vector<std::string> words;
};

TEST(Safetensors, HeaderLiesAreErrorsNamingFileTensorAndRule) {
  const std::vector<BadHeader> cases = {
      {"not json", "{\"a\": {", 0, {"not valid JSON"}},
      {"not an object", "[1, 2]   ", 0, {"JSON object"}},
      {"unknown dtype", R"({"w":{"dtype":"F7","shape":[1],"data_offsets":[0,1]}})", 1, {"tensor w", "dtype=F7", "F8_E4M3"}},
      {"negative dim", R"({"w":{"dtype":"U8","shape":[-1],"data_offsets":[0,0]}})", 0, {"tensor w", "shape=[-1]"}},
      {"float dim", R"({"w":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", 1, {"tensor w", "integers"}},
      {"one offset", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", 1, {"tensor w", "[begin, end]"}},
      {"begin after end", R"({"w":{"dtype":"U8","shape":[0],"data_offsets":[4,2]}})", 4, {"tensor w", "begin <= end"}},
      {"size disagrees with shape x dtype", R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20,
       {"tensor w", "data_offsets=[0, 20]", "hold 20 bytes", "[2, 3] x F32 = 24 bytes"}},
      {"offsets out of range", R"({"w":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}})", 8,
       {"tensor w", "run past the end of the data (8 bytes", "header lies"}},
      {"overlap", R"({"a":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"b":{"dtype":"U8","shape":[4],"data_offsets":[6,10]}})",
       16, {"tensor b", "overlaps tensor a", "header lies"}},
      {"duplicate name", R"({"w":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"w":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
       2, {"tensor w is named twice"}},
      {"odd F4 count", R"({"w":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", 2, {"tensor w", "whole number of bytes"}},
      {"overflowing shape", R"({"w":{"dtype":"F64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8,
       {"tensor w", "2^56"}},
      {"metadata not strings", R"({"__metadata__":{"format":1}})", 0, {"__metadata__.format"}},
      {"entry not an object", R"({"w":3})", 0, {"tensor w", "must be an object"}},
  };
  TempDir d;
  for (const BadHeader& c : cases) {
    const std::string path = d.file("bad.safetensors");
    std::string json = c.json;
    while (json.size() % 8) json += ' ';
    testing_ckpt::write_raw(path, json, std::vector<uint8_t>(c.data_bytes, 0));
    std::unique_ptr<io::SafetensorsFile> f;
    const Status st = open_file(path, &f);
    EXPECT_FALSE(st.is_ok()) << c.what;
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.what;
    EXPECT_CONTAINS(st.message(), path);
    for (const std::string& w : c.words) EXPECT_CONTAINS(st.message(), w);
  }
}

TEST(Safetensors, TruncatedFilesAreErrors) {
  TempDir d;
  const std::string path = d.file("t.safetensors");
  testing_ckpt::write_safetensors(path, two_tensors());
  const auto full = std::filesystem::file_size(path);
  struct Cut {
    uintmax_t size;
    std::string words;
  };
  // Inside the data, inside the JSON, inside the 8-byte length, empty.
  for (const Cut& c : {Cut{full - 1, "run past the end of the data"}, Cut{20, "runs past the end of the file"},
                       Cut{5, "truncated: 5 bytes"}, Cut{0, "truncated: 0 bytes"}}) {
    testing_ckpt::write_safetensors(path, two_tensors());
    std::filesystem::resize_file(path, c.size);
    std::unique_ptr<io::SafetensorsFile> f;
    const Status st = open_file(path, &f);
    EXPECT_FALSE(st.is_ok()) << c.size;
    EXPECT_CONTAINS(st.message(), path);
    EXPECT_CONTAINS(st.message(), c.words);
  }
  // A header length far beyond the limit.
  std::vector<uint8_t> huge = {0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0xFF, 0x7F, '{', '}'};
  io::StHeader h;
  const Status st = io::parse_safetensors_header(huge.data(), huge.size(), huge.size(), "mem", &h);
  EXPECT_CONTAINS(st.message(), "must be at most 100000000");
}

TEST(Safetensors, MissingFileIsAnIoError) {
  std::unique_ptr<io::SafetensorsFile> f;
  const Status st = open_file("/nonexistent/dir/model.safetensors", &f);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(st.message(), "/nonexistent/dir/model.safetensors");
}

// ---------------------------------------------------------------------------------------------
// config.json

TEST(CheckpointConfig, DeepSeekQwenGptOssAndTextConfigKeys) {
  TempDir d;
  struct KeyCase {
    std::string json;
    int64_t hidden, inter, experts, top_k;
  };
  const std::vector<KeyCase> cases = {
      {R"({"hidden_size":7168,"intermediate_size":18432,"moe_intermediate_size":2048,"n_routed_experts":256,
           "num_experts_per_tok":8,"first_k_dense_replace":3,"num_hidden_layers":61})", 7168, 2048, 256, 8},
      {R"({"hidden_size":2048,"moe_intermediate_size":768,"num_experts":128,"num_experts_per_tok":8})", 2048, 768, 128, 8},
      {R"({"hidden_size":2880,"intermediate_size":2880,"num_local_experts":128,"experts_per_token":4,"swiglu_limit":7.0})",
       2880, 2880, 128, 4},
      {R"({"model_type":"x","text_config":{"hidden_size":4096,"moe_intermediate_size":1536,"num_experts":128,"num_experts_per_tok":8}})",
       4096, 1536, 128, 8},
  };
  for (const KeyCase& c : cases) {
    testing_ckpt::write_text(d.file("config.json"), c.json);
    CheckpointConfig cfg;
    ASSERT_TRUE(read_checkpoint_config(d.path(), &cfg).is_ok()) << c.json;
    EXPECT_EQ(cfg.hidden, c.hidden);
    EXPECT_EQ(cfg.intermediate, c.inter);
    EXPECT_EQ(cfg.num_experts, c.experts);
    EXPECT_EQ(cfg.top_k, c.top_k);
  }
  CheckpointConfig cfg;
  testing_ckpt::write_text(d.file("config.json"), cases[0].json);
  ASSERT_TRUE(read_checkpoint_config(d.path(), &cfg).is_ok());
  EXPECT_EQ(cfg.first_dense_layers, 3);
  EXPECT_EQ(cfg.num_layers, 61);
  EXPECT_FALSE(cfg.clamped_swiglu);
  testing_ckpt::write_text(d.file("config.json"), cases[2].json);
  ASSERT_TRUE(read_checkpoint_config(d.path(), &cfg).is_ok());
  EXPECT_TRUE(cfg.clamped_swiglu);
}

TEST(CheckpointConfig, MissingKeysNameTheFileAndKeys) {
  TempDir d;
  testing_ckpt::write_text(d.file("config.json"), R"({"hidden_size":256,"moe_intermediate_size":128,"num_experts_per_tok":2})");
  CheckpointConfig cfg;
  Status st = read_checkpoint_config(d.path(), &cfg);
  EXPECT_CONTAINS(st.message(), d.file("config.json"));
  EXPECT_CONTAINS(st.message(), "n_routed_experts or num_experts or num_local_experts");
  testing_ckpt::write_text(d.file("config.json"), R"({"hidden_size":"256"})");
  EXPECT_CONTAINS(read_checkpoint_config(d.path(), &cfg).message(), "no integer hidden_size");
  testing_ckpt::write_text(d.file("config.json"), "{ not json");
  EXPECT_CONTAINS(read_checkpoint_config(d.path(), &cfg).message(), "not valid JSON");
  std::filesystem::remove(d.file("config.json"));
  st = read_checkpoint_config(d.path(), &cfg);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_CONTAINS(st.message(), "config.json");
}

// ---------------------------------------------------------------------------------------------
// Loaders

struct LayoutCase {
  const char* name;
  CheckpointLayout layout;
  bool f32_or_f4 = false;  // kBf16: F32 weights; kNvfp4: F4 dtype
  int num_files = 1;
  bool with_index = false;
};

class LoadLayout : public ::testing::TestWithParam<LayoutCase> {};

std::vector<uint8_t> view_bytes(const TensorView& v) {
  const uint8_t* p = v.ptr<const uint8_t>();
  return std::vector<uint8_t>(p, p + v.numel() * dtype_bytes(v.dtype));
}

TEST_P(LoadLayout, ThisRanksExpertsBitForBitAndPreparedAsIs) {
  const LayoutCase c = GetParam();
  SynthCheckpoint ck;
  ck.layout = c.layout;
  ck.bf16_as_f32 = c.f32_or_f4;
  ck.nvfp4_f4_dtype = c.f32_or_f4;
  ck.build();
  TempDir d;
  ck.write(d.path(), c.num_files, c.with_index);
  const int64_t layer = 2, R = 2, r = 1;
  CheckpointExperts ex;
  const Status st = load_checkpoint_experts(d.path(), layer, R, r, 16, &ex);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  std::printf("%s\n", ex.to_string().c_str());
  EXPECT_EQ(ex.layout, c.layout);
  EXPECT_EQ(ex.geometry.hidden, ck.hidden);
  EXPECT_EQ(ex.geometry.intermediate, ck.inter);
  EXPECT_EQ(ex.geometry.num_experts, ck.experts);
  EXPECT_EQ(ex.geometry.top_k, ck.top_k);
  EXPECT_EQ(ex.geometry.ep_rank, r);
  EXPECT_EQ(static_cast<int>(ex.files.size()), c.num_files);
  const WeightFormat want_format = c.layout == CheckpointLayout::kFp8Block ? WeightFormat::kFp8Block
                                   : c.layout == CheckpointLayout::kNvfp4  ? WeightFormat::kNvfp4
                                   : c.layout == CheckpointLayout::kBf16   ? WeightFormat::kBf16
                                                                           : WeightFormat::kMxfp4;
  EXPECT_EQ(ex.format, want_format);
  EXPECT_EQ(ex.has_input_scale, c.layout == CheckpointLayout::kNvfp4);

  // The views hold experts 2 and 3 (rank 1 of 2), each expert's bytes as the writer made them.
  std::vector<uint8_t> w13, w13s, w2, w2s;
  std::vector<float> g13, g2;
  for (int64_t e = 2; e < 4; ++e) {
    const SynthCheckpoint::Expert& x = ck.expected.at(layer)[static_cast<size_t>(e)];
    w13.insert(w13.end(), x.w13.begin(), x.w13.end());
    w13s.insert(w13s.end(), x.w13_scale.begin(), x.w13_scale.end());
    w2.insert(w2.end(), x.w2.begin(), x.w2.end());
    w2s.insert(w2s.end(), x.w2_scale.begin(), x.w2_scale.end());
    g13.push_back(x.w13_global);
    g2.push_back(x.w2_global);
  }
  const MoeWeights& w = ex.weights;
  const int64_t elem_bytes = dtype_bytes(w.w13.dtype);
  ASSERT_EQ(w.w13.numel() * elem_bytes, static_cast<int64_t>(w13.size()));
  EXPECT_TRUE(view_bytes(w.w13) == w13) << "w13 bytes";
  EXPECT_TRUE(view_bytes(w.w2) == w2) << "w2 bytes";
  if (c.layout != CheckpointLayout::kBf16) {
    EXPECT_TRUE(view_bytes(w.w13_scale) == w13s) << "w13 scales";
    EXPECT_TRUE(view_bytes(w.w2_scale) == w2s) << "w2 scales";
  }
  if (c.layout == CheckpointLayout::kNvfp4) {
    ASSERT_EQ(w.w13_global_scale.numel(), 2);
    EXPECT_EQ(0, std::memcmp(w.w13_global_scale.data, g13.data(), 8));
    EXPECT_EQ(0, std::memcmp(w.w2_global_scale.data, g2.data(), 8));
  } else {
    EXPECT_FALSE(w.w13_global_scale.present());
  }

  // Prepared in its own format: the same bits; dequantised: the codec's values.
  MoeConfig config;
  config.weight_format = ex.format;
  PreparedWeights pw;
  const Status pst = prepare_weights(ex.geometry, config, ex.weights, &pw);
  ASSERT_TRUE(pst.is_ok()) << pst.to_string();
  if (c.layout != CheckpointLayout::kBf16 || !c.f32_or_f4) {
    EXPECT_TRUE(pw.w13.data == w13) << "prepared w13 must keep the checkpoint's bits";
    EXPECT_TRUE(pw.w2.data == w2);
    EXPECT_TRUE(pw.w13.scales == w13s);
    EXPECT_TRUE(pw.w2.scales == w2s);
  }
  if (c.layout == CheckpointLayout::kNvfp4) {
    EXPECT_EQ(pw.w13.global_scales, g13);
    EXPECT_EQ(pw.w2.global_scales, g2);
  }
  // And any other format from it (here fp8-block): within that format's bound of the values.
  config.weight_format = c.layout == CheckpointLayout::kFp8Block ? WeightFormat::kBf16 : WeightFormat::kFp8Block;
  PreparedWeights other;
  ASSERT_TRUE(prepare_weights(ex.geometry, config, ex.weights, &other).is_ok());
  std::vector<float> a, b;
  pw.w13.dequantize(&a);
  other.w13.dequantize(&b);
  double err = 0, ref = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    err += (double(a[i]) - b[i]) * (double(a[i]) - b[i]);
    ref += double(a[i]) * a[i];
  }
  EXPECT_LT(std::sqrt(err / ref), 1.0 / 16) << "converted to " << to_string(config.weight_format);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LoadLayout,
    ::testing::Values(LayoutCase{"DeepSeekV3Fp8", CheckpointLayout::kFp8Block},
                      LayoutCase{"DeepSeekV3Fp8_ThreeFilesIndexed", CheckpointLayout::kFp8Block, false, 3, true},
                      LayoutCase{"DeepSeekV3Fp8_TwoFilesNoIndex", CheckpointLayout::kFp8Block, false, 2, false},
                      LayoutCase{"ModelOptNvfp4", CheckpointLayout::kNvfp4},
                      LayoutCase{"ModelOptNvfp4_F4Dtype_Indexed", CheckpointLayout::kNvfp4, true, 2, true},
                      LayoutCase{"Mxfp4", CheckpointLayout::kMxfp4, false, 2, true},
                      LayoutCase{"GptOssFusedMxfp4", CheckpointLayout::kMxfp4Fused},
                      LayoutCase{"GptOssFusedMxfp4_Indexed", CheckpointLayout::kMxfp4Fused, false, 3, true},
                      LayoutCase{"Bf16", CheckpointLayout::kBf16}, LayoutCase{"F32", CheckpointLayout::kBf16, true}),
    [](const ::testing::TestParamInfo<LayoutCase>& p) { return std::string(p.param.name); });

// ---------------------------------------------------------------------------------------------
// Bad checkpoints

struct BadCheckpoint : ::testing::Test {
  SynthCheckpoint ck;
  TempDir d;
  CheckpointExperts ex;
  // Loads layer 2 on rank 1 of 2 after `edit` changed the entries; returns the error message.
  std::string load_error(const std::function<void(std::vector<StEntry>*)>& edit, int num_files = 1,
                         bool with_index = false) {
    ck.build();
    edit(&ck.entries);
    ck.write(d.path(), num_files, with_index);
    const Status st = load_checkpoint_experts(d.path(), 2, 2, 1, 16, &ex);
    EXPECT_FALSE(st.is_ok());
    return st.message();
  }
  static StEntry* find(std::vector<StEntry>* es, const std::string& name) {
    for (StEntry& e : *es)
      if (e.name == name) return &e;
    ADD_FAILURE() << "no entry " << name;
    static StEntry none;
    return &none;
  }
  static void erase(std::vector<StEntry>* es, const std::string& name) {
    for (auto it = es->begin(); it != es->end(); ++it)
      if (it->name == name) {
        es->erase(it);
        return;
      }
    ADD_FAILURE() << "no entry " << name;
  }
};

const char* kUp3 = "model.layers.2.mlp.experts.3.up_proj.weight";

TEST_F(BadCheckpoint, MissingTensorNamesItAndWhereItLooked) {
  const std::string m = load_error([](std::vector<StEntry>* es) { erase(es, kUp3); }, 2, true);
  EXPECT_CONTAINS(m, "missing tensor model.layers.2.mlp.experts.3.up_proj.weight");
  EXPECT_CONTAINS(m, "model.safetensors.index.json");
}

TEST_F(BadCheckpoint, MissingScaleOfDeepSeekFp8) {
  const std::string m = load_error(
      [](std::vector<StEntry>* es) { erase(es, "model.layers.2.mlp.experts.2.down_proj.weight_scale_inv"); });
  EXPECT_CONTAINS(m, "missing tensor model.layers.2.mlp.experts.2.down_proj.weight_scale_inv");
  EXPECT_CONTAINS(m, "128x128");
}

TEST_F(BadCheckpoint, WrongDtypeNamesFileTensorAndRule) {
  const std::string m = load_error([](std::vector<StEntry>* es) { find(es, kUp3)->dtype = "F8_E5M2"; });
  EXPECT_CONTAINS(m, d.file("model.safetensors"));
  EXPECT_CONTAINS(m, std::string("tensor ") + kUp3 + ": dtype=F8_E5M2, must be F8_E4M3 [128, 256]");
}

TEST_F(BadCheckpoint, ShapeMismatchNamesTheConfigGeometry) {
  const std::string m = load_error([](std::vector<StEntry>* es) {
    StEntry* e = find(es, kUp3);
    e->shape = {256, 128};  // transposed, same bytes
  });
  EXPECT_CONTAINS(m, std::string("tensor ") + kUp3 + ": shape=[256, 128], must be F8_E4M3 [128, 256]");
  EXPECT_CONTAINS(m, "hidden=256, intermediate=128");
}

TEST_F(BadCheckpoint, NonFiniteWeightScaleInv) {
  const std::string m = load_error([](std::vector<StEntry>* es) {
    StEntry* e = find(es, "model.layers.2.mlp.experts.2.gate_proj.weight_scale_inv");
    const float nan = std::nanf("");
    std::memcpy(e->bytes.data() + 4, &nan, 4);
  });
  EXPECT_CONTAINS(m, "gate_proj.weight_scale_inv: element 1=nan, a weight_scale_inv must be finite and >= 0");
}

TEST_F(BadCheckpoint, TruncatedShardNamesTheFile) {
  ck.build();
  ck.write(d.path(), 2, true);
  const std::string shard = d.file(SynthCheckpoint::shard_name(1, 2));
  std::filesystem::resize_file(shard, std::filesystem::file_size(shard) - 100);
  const Status st = load_checkpoint_experts(d.path(), 2, 2, 1, 16, &ex);
  EXPECT_CONTAINS(st.message(), shard);
  EXPECT_CONTAINS(st.message(), "run past the end of the data");
}

TEST_F(BadCheckpoint, IndexNamingTheWrongFile) {
  ck.build();
  ck.write(d.path(), 2, true);
  nlohmann::json index = nlohmann::json::parse(std::ifstream(d.file("model.safetensors.index.json")));
  const std::string f = index["weight_map"][kUp3];
  index["weight_map"][kUp3] = f == SynthCheckpoint::shard_name(0, 2) ? SynthCheckpoint::shard_name(1, 2)
                                                                      : SynthCheckpoint::shard_name(0, 2);
  testing_ckpt::write_text(d.file("model.safetensors.index.json"), index.dump());
  const Status st = load_checkpoint_experts(d.path(), 2, 2, 1, 16, &ex);
  EXPECT_CONTAINS(st.message(), std::string("it puts tensor ") + kUp3);
  EXPECT_CONTAINS(st.message(), "whose header has no such tensor");
  index["weight_map"][kUp3] = "../elsewhere.safetensors";
  testing_ckpt::write_text(d.file("model.safetensors.index.json"), index.dump());
  EXPECT_CONTAINS(load_checkpoint_experts(d.path(), 2, 2, 1, 16, &ex).message(), "must be the name of a file in");
}

TEST_F(BadCheckpoint, Nvfp4GateAndUpGlobalScalesMustAgree) {
  ck.layout = CheckpointLayout::kNvfp4;
  const std::string m = load_error([](std::vector<StEntry>* es) {
    StEntry* e = find(es, "model.layers.2.mlp.experts.3.up_proj.weight_scale_2");
    float v;
    std::memcpy(&v, e->bytes.data(), 4);
    v *= 2;
    std::memcpy(e->bytes.data(), &v, 4);
  });
  EXPECT_CONTAINS(m, "experts.3.up_proj.weight_scale_2: value=");
  EXPECT_CONTAINS(m, "differs from model.layers.2.mlp.experts.3.gate_proj.weight_scale_2");
  EXPECT_CONTAINS(m, "must share");
}

TEST_F(BadCheckpoint, Nvfp4BadScales) {
  ck.layout = CheckpointLayout::kNvfp4;
  std::string m = load_error([](std::vector<StEntry>* es) {
    find(es, "model.layers.2.mlp.experts.2.down_proj.weight_scale")->bytes[5] = 0x7F;  // e4m3 NaN
  });
  EXPECT_CONTAINS(m, "down_proj.weight_scale: element 5=0x7F, an e4m3 block scale must be finite and >= 0");
  m = load_error([](std::vector<StEntry>* es) {
    find(es, "model.layers.2.mlp.experts.2.down_proj.weight_scale_2")->shape = {1, 1};
  });
  EXPECT_CONTAINS(m, "weight_scale_2: shape=[1, 1], must be F32 scalar ([] or [1])");
  m = load_error([](std::vector<StEntry>* es) {
    find(es, "model.layers.2.mlp.experts.2.gate_proj.weight_scale")->dtype = "U8";
  });
  EXPECT_CONTAINS(m, "gate_proj.weight_scale: dtype=U8, must be F8_E4M3 [128, 16]");
}

TEST_F(BadCheckpoint, Mxfp4NanScaleCode) {
  ck.layout = CheckpointLayout::kMxfp4;
  const std::string m = load_error([](std::vector<StEntry>* es) {
    find(es, "model.layers.2.mlp.experts.3.gate_proj.weight_scale")->bytes[0] = 0xFF;
  });
  EXPECT_CONTAINS(m, "gate_proj.weight_scale: element 0=0xFF, an e8m0 scale must not be 0xFF (NaN)");
}

TEST_F(BadCheckpoint, GptOssBiasesAndClampedSwigluRefused) {
  ck.layout = CheckpointLayout::kMxfp4Fused;
  ck.gpt_oss_biases = true;
  std::string m = load_error([](std::vector<StEntry>*) {});
  EXPECT_CONTAINS(m, "model.layers.2.mlp.experts.gate_up_proj_bias");
  EXPECT_CONTAINS(m, "biases");
  EXPECT_CONTAINS(m, "clamped SwiGLU");
  ck.gpt_oss_biases = false;
  ck.build();
  ck.write(d.path(), 1, false);
  nlohmann::json cfg = ck.config();
  cfg["swiglu_limit"] = 7.0;
  testing_ckpt::write_text(d.file("config.json"), cfg.dump());
  m = load_checkpoint_experts(d.path(), 2, 2, 1, 16, &ex).message();
  EXPECT_CONTAINS(m, "swiglu_limit");
}

TEST_F(BadCheckpoint, GptOssFusedShape) {
  ck.layout = CheckpointLayout::kMxfp4Fused;
  const std::string m = load_error([](std::vector<StEntry>* es) {
    find(es, "model.layers.2.mlp.experts.down_proj_blocks")->shape = {4, 256, 2, 32};
  });
  EXPECT_CONTAINS(m, "down_proj_blocks: shape=[4, 256, 2, 32], must be U8 [4, 256, 4, 16]");
}

TEST_F(BadCheckpoint, DenseLayersAndRangeAndGeometry) {
  ck.build();
  ck.write(d.path(), 1, false);
  std::string m = load_checkpoint_experts(d.path(), 0, 2, 1, 16, &ex).message();
  EXPECT_CONTAINS(m, "layer=0, is a dense MLP layer (config.json first_k_dense_replace=1)");
  m = load_checkpoint_experts(d.path(), 3, 2, 1, 16, &ex).message();
  EXPECT_CONTAINS(m, "layer=3, must be in [0, num_hidden_layers=3)");
  m = load_checkpoint_experts(d.path(), 2, 3, 0, 16, &ex).message();
  EXPECT_CONTAINS(m, "num_experts=4, must be divisible by ep_size=3");
  EXPECT_CONTAINS(m, "config.json");
  // A dense layer the config does not announce.
  nlohmann::json cfg = ck.config();
  cfg.erase("first_k_dense_replace");
  testing_ckpt::write_text(d.file("config.json"), cfg.dump());
  m = load_checkpoint_experts(d.path(), 0, 2, 1, 16, &ex).message();
  EXPECT_CONTAINS(m, "is a dense MLP layer (model.layers.0.mlp.gate_proj.weight)");
}

TEST_F(BadCheckpoint, UnknownExpertDtype) {
  const std::string m = load_error([](std::vector<StEntry>* es) {
    StEntry* e = find(es, "model.layers.2.mlp.experts.2.gate_proj.weight");
    e->dtype = "I8";
  });
  EXPECT_CONTAINS(m, "experts.2.gate_proj.weight: dtype=I8, an expert weight must be F8_E4M3");
}

TEST_F(BadCheckpoint, SameTensorInTwoFilesWithoutIndex) {
  ck.build();
  ck.write(d.path(), 1, false);
  testing_ckpt::write_safetensors(d.file("extra.safetensors"),
                                  {{kUp3, "U8", {1}, {0}}});
  const std::string m = load_checkpoint_experts(d.path(), 2, 2, 1, 16, &ex).message();
  EXPECT_CONTAINS(m, std::string("tensor ") + kUp3 + " is in both");
}

// ---------------------------------------------------------------------------------------------
// megamoe check --checkpoint

struct ToolRun {
  int rc = -1;
  std::string out;
};

ToolRun run_tool(const std::string& args) {
  const std::string cmd = std::string(MEGAMOE_TOOL_PATH) + " " + args + " 2>&1";
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

class CheckCheckpoint : public ::testing::TestWithParam<CheckpointLayout> {};

TEST_P(CheckCheckpoint, CpuBackendPassesAgainstTheReference_EP2) {
  SynthCheckpoint ck;
  ck.layout = GetParam();
  ck.build();
  TempDir d;
  ck.write(d.path(), 2, true);
  const ToolRun r = run_tool("check --checkpoint " + d.path() + " --layer 2 --backend cpu --ep 2 --tokens 24");
  EXPECT_EQ(r.rc, 0) << r.out;
  EXPECT_CONTAINS(r.out, "layer 2");
  EXPECT_CONTAINS(r.out, "PASS");
}

INSTANTIATE_TEST_SUITE_P(Layouts, CheckCheckpoint,
                         ::testing::Values(CheckpointLayout::kFp8Block, CheckpointLayout::kNvfp4,
                                           CheckpointLayout::kMxfp4, CheckpointLayout::kMxfp4Fused),
                         [](const ::testing::TestParamInfo<CheckpointLayout>& p) {
                           switch (p.param) {
                             case CheckpointLayout::kFp8Block: return std::string("Fp8Block");
                             case CheckpointLayout::kNvfp4: return std::string("Nvfp4");
                             case CheckpointLayout::kMxfp4: return std::string("Mxfp4");
                             default: return std::string("GptOssMxfp4");
                           }
                         });

TEST(CheckCheckpointFlags, BadCheckpointIsAUsageErrorNamingTheFile) {
  SynthCheckpoint ck;
  ck.build();
  TempDir d;
  ck.write(d.path(), 1, false);
  ToolRun r = run_tool("check --checkpoint " + d.path() + " --layer 0 --backend cpu");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_CONTAINS(r.out, "dense MLP layer");
  r = run_tool("check --checkpoint " + d.path() + " --backend cpu");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_CONTAINS(r.out, "--layer");
  r = run_tool("check --checkpoint " + d.path() + " --preset tiny --layer 2 --backend cpu");
  EXPECT_EQ(r.rc, 2) << r.out;
  EXPECT_CONTAINS(r.out, "--preset");
}

}  // namespace
}  // namespace megamoe
