// Knob cache: JSON round trip, the max_tokens bucket rule, tolerant loading, atomic save and the
// process-wide cache behind MEGAMOE_KNOB_CACHE.
#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/env.h"
#include "megamoe/knobs.h"

namespace megamoe {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

KnobKey h200_key(int64_t max_tokens) {
  KnobKey k;
  k.device_name = "NVIDIA H200";
  k.weight_format = WeightFormat::kFp8Block;
  k.dispatch_format = DispatchFormat::kFp8Block;
  k.combine_dtype = CombineDtype::kBf16;
  k.ep_size = 8;
  k.hidden = 7168;
  k.intermediate = 2048;
  k.num_experts = 256;
  k.top_k = 8;
  k.max_tokens = max_tokens;
  return k;
}

KnobEntry make_entry(int32_t block_m, int32_t block_n, int32_t num_sms, int64_t crossover, double us,
                     const std::string& note, int32_t combine_groups = 0) {
  KnobEntry e;
  e.knobs.block_m = block_m;
  e.knobs.block_n = block_n;
  e.knobs.num_sms = num_sms;
  e.knobs.combine_groups = combine_groups;
  e.mega_max_tokens_per_rank = crossover;
  e.measured_us = us;
  e.note = note;
  return e;
}

void expect_entry_eq(const KnobEntry& want, const std::optional<KnobEntry>& got) {
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(want.knobs, got->knobs) << "want " << want.knobs.to_string() << " got " << got->knobs.to_string();
  EXPECT_EQ(want.mega_max_tokens_per_rank, got->mega_max_tokens_per_rank);
  EXPECT_EQ(want.measured_us, got->measured_us);
  EXPECT_EQ(want.note, got->note);
}

// One valid entry as JSON, for hand-written files.
json entry_json(const KnobKey& k, const KnobEntry& e) {
  return json{{"device", k.device_name},
              {"weight_format", to_string(k.weight_format)},
              {"dispatch_format", to_string(k.dispatch_format)},
              {"combine_dtype", to_string(k.combine_dtype)},
              {"ep_size", k.ep_size},
              {"hidden", k.hidden},
              {"intermediate", k.intermediate},
              {"num_experts", k.num_experts},
              {"top_k", k.top_k},
              {"max_tokens", k.max_tokens},
              {"knobs",
               {{"block_m", e.knobs.block_m},
                {"block_n", e.knobs.block_n},
                {"num_sms", e.knobs.num_sms},
                {"combine_groups", e.knobs.combine_groups}}},
              {"mega_max_tokens_per_rank", e.mega_max_tokens_per_rank},
              {"measured_us", e.measured_us},
              {"note", e.note}};
}

class KnobCacheTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::string tmpl = (fs::temp_directory_path() / "megamoe_knobs_XXXXXX").string();
    ASSERT_NE(::mkdtemp(tmpl.data()), nullptr);
    dir_ = tmpl;
  }
  void TearDown() override {
    std::error_code ec;
    fs::remove_all(dir_, ec);
  }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  void write_text(const std::string& p, const std::string& text) const {
    std::ofstream out(p, std::ios::binary | std::ios::trunc);
    out << text;
    ASSERT_TRUE(out.good()) << p;
  }

  std::string read_text(const std::string& p) const {
    std::ifstream in(p, std::ios::binary);
    std::ostringstream buf;
    buf << in.rdbuf();
    return buf.str();
  }

  std::set<std::string> dir_listing(const fs::path& d) const {
    std::set<std::string> names;
    for (const auto& e : fs::directory_iterator(d)) names.insert(e.path().filename().string());
    return names;
  }

  fs::path dir_;
};

// ---- round trip ----

TEST_F(KnobCacheTest, RoundTrip_SaveLoad_PreservesEveryField) {
  KnobCache cache;
  KnobKey a = h200_key(128);
  KnobKey b = h200_key(4096);
  b.weight_format = WeightFormat::kNvfp4;
  b.dispatch_format = DispatchFormat::kBf16;
  b.combine_dtype = CombineDtype::kMxfp8;
  KnobKey c = h200_key(0);
  c.device_name = "NVIDIA H100 80GB HBM3";
  c.ep_size = 1;
  c.combine_dtype = CombineDtype::kNvfp4;
  KnobEntry ea = make_entry(64, 128, 0, 256, 41.123456789012345, "autotune \"decode\" \u00b5s\n");
  KnobEntry eb = make_entry(128, 256, 132, 0, 1234.5, "", /*combine_groups=*/4);
  eb.knobs.gemm_cluster = 2;
  KnobEntry ec = make_entry(0, 0, 66, 1024, 0.1, "cpu-side note");
  cache.put(a, ea);
  cache.put(b, eb);
  cache.put(c, ec);
  ASSERT_EQ(cache.size(), 3u);

  const std::string p = path("knobs.json");
  Status st = cache.save(p);
  ASSERT_TRUE(st.is_ok()) << st.to_string();

  std::string warning = "stale";
  KnobCache loaded = KnobCache::load(p, &warning);
  EXPECT_EQ(warning, "");
  ASSERT_EQ(loaded.size(), 3u);
  expect_entry_eq(ea, loaded.lookup(a));
  expect_entry_eq(eb, loaded.lookup(b));
  expect_entry_eq(ec, loaded.lookup(c));

  // The file follows the documented schema.
  json doc = json::parse(read_text(p));
  EXPECT_EQ(doc["version"], KnobCache::kVersion);
  ASSERT_EQ(doc["entries"].size(), 3u);
  bool found_a = false;
  for (const json& e : doc["entries"]) {
    if (e["max_tokens"] != 128) continue;
    found_a = true;
    EXPECT_EQ(e["device"], "NVIDIA H200");
    EXPECT_EQ(e["weight_format"], "fp8-block");
    EXPECT_EQ(e["dispatch_format"], "fp8-block");
    EXPECT_EQ(e["combine_dtype"], "bf16");
    EXPECT_EQ(e["ep_size"], 8);
    EXPECT_EQ(e["hidden"], 7168);
    EXPECT_EQ(e["intermediate"], 2048);
    EXPECT_EQ(e["num_experts"], 256);
    EXPECT_EQ(e["top_k"], 8);
    EXPECT_EQ(e["knobs"]["block_m"], 64);
    EXPECT_EQ(e["knobs"]["block_n"], 128);
    EXPECT_EQ(e["knobs"]["num_sms"], 0);
    EXPECT_EQ(e["knobs"]["combine_groups"], 0);
    EXPECT_EQ(e["knobs"]["gemm_cluster"], 0);
    EXPECT_EQ(e["mega_max_tokens_per_rank"], 256);
  }
  EXPECT_TRUE(found_a);
}

TEST_F(KnobCacheTest, RoundTrip_EmptyCache) {
  const std::string p = path("empty.json");
  ASSERT_TRUE(KnobCache().save(p).is_ok());
  std::string warning = "stale";
  KnobCache loaded = KnobCache::load(p, &warning);
  EXPECT_EQ(warning, "");
  EXPECT_EQ(loaded.size(), 0u);
}

TEST_F(KnobCacheTest, Put_SameKeyReplaces_OtherBucketKept) {
  KnobCache cache;
  cache.put(h200_key(128), make_entry(64, 128, 0, 0, 10.0, "first"));
  cache.put(h200_key(128), make_entry(128, 256, 0, 0, 9.0, "second"));
  cache.put(h200_key(256), make_entry(128, 128, 0, 0, 12.0, "other bucket"));
  EXPECT_EQ(cache.size(), 2u);
  expect_entry_eq(make_entry(128, 256, 0, 0, 9.0, "second"), cache.lookup(h200_key(128)));
}

TEST_F(KnobCacheTest, MakeKnobKey_TakesShapeFromGeometryAndFormatsFromConfig) {
  MoeGeometry g;
  g.hidden = 4096;
  g.intermediate = 1536;
  g.num_experts = 128;
  g.top_k = 6;
  g.ep_size = 4;
  g.ep_rank = 3;
  g.max_tokens_per_rank = 512;
  MoeConfig c;
  c.weight_format = WeightFormat::kMxfp8;
  c.dispatch_format = DispatchFormat::kBf16;
  c.combine_dtype = CombineDtype::kNvfp4;
  KnobKey k = make_knob_key("NVIDIA H200", g, c);
  EXPECT_EQ(k.device_name, "NVIDIA H200");
  EXPECT_EQ(k.weight_format, WeightFormat::kMxfp8);
  EXPECT_EQ(k.dispatch_format, DispatchFormat::kBf16);
  EXPECT_EQ(k.combine_dtype, CombineDtype::kNvfp4);
  EXPECT_EQ(k.ep_size, 4);
  EXPECT_EQ(k.hidden, 4096);
  EXPECT_EQ(k.intermediate, 1536);
  EXPECT_EQ(k.num_experts, 128);
  EXPECT_EQ(k.top_k, 6);
  EXPECT_EQ(k.max_tokens, 512);
  // The rank does not enter the key: every rank finds the same tuning.
  EXPECT_EQ(make_knob_key("NVIDIA H200", g.for_rank(0), c), k);
  EXPECT_EQ(k.to_string(),
            "KnobKey(device=NVIDIA H200, weight_format=mxfp8, dispatch_format=bf16, combine_dtype=nvfp4, "
            "ep_size=4, hidden=4096, intermediate=1536, num_experts=128, top_k=6, max_tokens=512)");
}

// ---- the bucket rule ----

// Buckets 64, 256, 1024 of the H200 shape, fenced by neighbouring shapes (ordered just before and
// just after it) whose buckets lie in between, so a lookup that strays across shapes is caught.
class KnobCacheBucketTest : public KnobCacheTest {
 protected:
  void SetUp() override {
    KnobCacheTest::SetUp();
    for (int64_t t : {64, 256, 1024}) cache_.put(h200_key(t), entry_for(t));
    KnobKey before = h200_key(0);
    before.top_k = 7;
    KnobKey after = h200_key(0);
    after.top_k = 9;
    for (int64_t t : {1, 100, 300, 2048, 100000}) {
      before.max_tokens = t;
      after.max_tokens = t;
      cache_.put(before, make_entry(64, 64, 1, 0, 1.0, "fence before"));
      cache_.put(after, make_entry(64, 64, 2, 0, 2.0, "fence after"));
    }
  }
  static KnobEntry entry_for(int64_t bucket) {
    return make_entry(bucket <= 64 ? 64 : 128, 128, 0, bucket, static_cast<double>(bucket),
                      "bucket " + std::to_string(bucket));
  }
  KnobCache cache_;
};

TEST_F(KnobCacheBucketTest, ExactBucket) {
  for (int64_t t : {64, 256, 1024}) expect_entry_eq(entry_for(t), cache_.lookup(h200_key(t)));
}

TEST_F(KnobCacheBucketTest, SmallestBucketAtLeastTokens) {
  expect_entry_eq(entry_for(64), cache_.lookup(h200_key(0)));
  expect_entry_eq(entry_for(64), cache_.lookup(h200_key(1)));
  expect_entry_eq(entry_for(256), cache_.lookup(h200_key(65)));
  expect_entry_eq(entry_for(256), cache_.lookup(h200_key(100)));
  expect_entry_eq(entry_for(1024), cache_.lookup(h200_key(257)));
  expect_entry_eq(entry_for(1024), cache_.lookup(h200_key(1023)));
}

TEST_F(KnobCacheBucketTest, LargestBucketBelowWhenAllAreSmaller) {
  expect_entry_eq(entry_for(1024), cache_.lookup(h200_key(1025)));
  expect_entry_eq(entry_for(1024), cache_.lookup(h200_key(1 << 20)));
}

TEST_F(KnobCacheBucketTest, SingleBucketServesEveryTokenCount) {
  KnobCache one;
  one.put(h200_key(256), entry_for(256));
  for (int64_t t : {0, 1, 255, 256, 257, 100000}) expect_entry_eq(entry_for(256), one.lookup(h200_key(t)));
}

TEST_F(KnobCacheBucketTest, EmptyCacheHasNoMatch) { EXPECT_FALSE(KnobCache().lookup(h200_key(64)).has_value()); }

// One other key field differs -> no entry, whatever the bucket.
struct FieldCase {
  const char* name;
  void (*mutate)(KnobKey*);
};

class KnobCacheNoMatchTest : public KnobCacheBucketTest, public ::testing::WithParamInterface<FieldCase> {};

TEST_P(KnobCacheNoMatchTest, OtherKeyFieldDiffers) {
  for (int64_t t : {0, 64, 100, 256, 1024, 5000}) {
    KnobKey k = h200_key(t);
    GetParam().mutate(&k);
    ASSERT_FALSE(k.same_shape(h200_key(t)));
    EXPECT_FALSE(cache_.lookup(k).has_value()) << k.to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(
    Lookup, KnobCacheNoMatchTest,
    ::testing::Values(
        FieldCase{"DeviceName", [](KnobKey* k) { k->device_name = "NVIDIA H100 80GB HBM3"; }},
        FieldCase{"DeviceNamePrefix", [](KnobKey* k) { k->device_name = "NVIDIA H20"; }},
        FieldCase{"WeightFormat", [](KnobKey* k) { k->weight_format = WeightFormat::kMxfp8; }},
        FieldCase{"DispatchFormat", [](KnobKey* k) { k->dispatch_format = DispatchFormat::kBf16; }},
        FieldCase{"CombineDtype", [](KnobKey* k) { k->combine_dtype = CombineDtype::kNvfp4; }},
        FieldCase{"EpSize", [](KnobKey* k) { k->ep_size = 4; }},
        FieldCase{"Hidden", [](KnobKey* k) { k->hidden = 4096; }},
        FieldCase{"Intermediate", [](KnobKey* k) { k->intermediate = 1536; }},
        FieldCase{"NumExperts", [](KnobKey* k) { k->num_experts = 128; }},
        FieldCase{"TopK", [](KnobKey* k) { k->top_k = 6; }}),
    [](const ::testing::TestParamInfo<FieldCase>& info) { return std::string(info.param.name); });

// ---- tolerant loading ----

TEST_F(KnobCacheTest, Load_MissingFile_EmptyWithWarning) {
  const std::string p = path("no/such/knobs.json");
  std::string warning;
  KnobCache cache = KnobCache::load(p, &warning);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_NE(warning.find(p), std::string::npos) << warning;
  EXPECT_NE(warning.find("does not exist"), std::string::npos) << warning;
  EXPECT_EQ(KnobCache::load(p).size(), 0u);  // no warning pointer: still fine
}

TEST_F(KnobCacheTest, Load_PathIsDirectory_EmptyWithWarning) {
  const std::string p = path("a_directory");
  fs::create_directory(p);
  std::string warning;
  KnobCache cache = KnobCache::load(p, &warning);
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_NE(warning.find(p), std::string::npos) << warning;
  EXPECT_NE(warning.find("directory"), std::string::npos) << warning;
}

TEST_F(KnobCacheTest, Load_WrongVersion_EmptyWithWarning) {
  json entries = json::array({entry_json(h200_key(128), make_entry(64, 128, 0, 0, 1.0, ""))});
  for (const json& version : {json(2), json(0), json("1"), json(1.5), json(nullptr)}) {
    const std::string p = path("version.json");
    write_text(p, json{{"version", version}, {"entries", entries}}.dump());
    std::string warning;
    KnobCache cache = KnobCache::load(p, &warning);
    EXPECT_EQ(cache.size(), 0u) << version.dump();
    EXPECT_NE(warning.find("version=" + version.dump()), std::string::npos) << warning;
  }
  const std::string p = path("no_version.json");
  write_text(p, json{{"entries", entries}}.dump());
  std::string warning;
  EXPECT_EQ(KnobCache::load(p, &warning).size(), 0u);
  EXPECT_NE(warning.find("version=<missing>"), std::string::npos) << warning;
}

struct CorruptCase {
  const char* name;
  std::string text;
  const char* warning_has;
};

class KnobCacheCorruptTest : public KnobCacheTest, public ::testing::WithParamInterface<CorruptCase> {};

TEST_P(KnobCacheCorruptTest, EmptyWithWarningNoThrow) {
  const std::string p = path("corrupt.json");
  write_text(p, GetParam().text);
  std::string warning;
  KnobCache cache;
  EXPECT_NO_THROW(cache = KnobCache::load(p, &warning));
  EXPECT_EQ(cache.size(), 0u);
  EXPECT_NE(warning.find(p), std::string::npos) << warning;
  EXPECT_NE(warning.find(GetParam().warning_has), std::string::npos) << warning;
}

std::string valid_file_text() {
  json doc{{"version", 1},
           {"entries", json::array({entry_json(h200_key(128), make_entry(64, 128, 0, 0, 1.0, "x")),
                                    entry_json(h200_key(256), make_entry(128, 128, 0, 0, 2.0, "y"))})}};
  return doc.dump(2);
}

INSTANTIATE_TEST_SUITE_P(
    Load, KnobCacheCorruptTest,
    ::testing::Values(
        CorruptCase{"EmptyFile", "", "not valid JSON"},
        CorruptCase{"Truncated", valid_file_text().substr(0, valid_file_text().size() / 2), "not valid JSON"},
        CorruptCase{"Garbage", "\x01\x02knobs\xff", "not valid JSON"},
        CorruptCase{"TopLevelArray", "[1, 2, 3]", "must be an object"},
        CorruptCase{"TopLevelString", "\"knobs\"", "must be an object"},
        CorruptCase{"EntriesMissing", "{\"version\": 1}", "entries=<missing>"},
        CorruptCase{"EntriesObject", "{\"version\": 1, \"entries\": {}}", "must be an array"},
        CorruptCase{"EntriesString", "{\"version\": 1, \"entries\": \"none\"}", "must be an array"},
        CorruptCase{"EntryNotObject", "{\"version\": 1, \"entries\": [42]}", "entry 0"},
        CorruptCase{"EntryEmptyObject", "{\"version\": 1, \"entries\": [{}]}", "device is missing"}),
    [](const ::testing::TestParamInfo<CorruptCase>& info) { return std::string(info.param.name); });

// Each field broken in its own way: the entry is skipped, the warning names the index and field.
struct BadFieldCase {
  const char* name;
  const char* field;  // the field the warning must name
  void (*mutate)(json*);
};

class KnobCacheBadEntryTest : public KnobCacheTest, public ::testing::WithParamInterface<BadFieldCase> {};

TEST_P(KnobCacheBadEntryTest, SkippedWhileGoodEntriesLoad) {
  const KnobEntry good0 = make_entry(64, 128, 0, 128, 5.0, "good 0");
  const KnobEntry good2 = make_entry(128, 256, 0, 0, 7.0, "good 2");
  json bad = entry_json(h200_key(512), make_entry(64, 64, 0, 0, 6.0, "bad"));
  GetParam().mutate(&bad);
  json doc{{"version", 1},
           {"entries", json::array({entry_json(h200_key(64), good0), bad, entry_json(h200_key(4096), good2)})}};
  const std::string p = path("mixed.json");
  write_text(p, doc.dump(2));

  std::string warning;
  KnobCache cache = KnobCache::load(p, &warning);
  EXPECT_EQ(cache.size(), 2u);
  expect_entry_eq(good0, cache.lookup(h200_key(64)));
  expect_entry_eq(good2, cache.lookup(h200_key(4096)));
  // 512 falls to the smallest bucket >= it: the bad entry is not there.
  expect_entry_eq(good2, cache.lookup(h200_key(512)));
  EXPECT_NE(warning.find("entry 1"), std::string::npos) << warning;
  EXPECT_NE(warning.find(GetParam().field), std::string::npos) << warning;
  EXPECT_EQ(warning.find("entry 0"), std::string::npos) << warning;
  EXPECT_EQ(warning.find("entry 2"), std::string::npos) << warning;
}

INSTANTIATE_TEST_SUITE_P(
    Load, KnobCacheBadEntryTest,
    ::testing::Values(
        BadFieldCase{"BadWeightFormatName", "weight_format", [](json* e) { (*e)["weight_format"] = "fp9-block"; }},
        BadFieldCase{"BadDispatchFormatName", "dispatch_format", [](json* e) { (*e)["dispatch_format"] = "mxfp8"; }},
        BadFieldCase{"BadCombineDtypeName", "combine_dtype", [](json* e) { (*e)["combine_dtype"] = "FP8"; }},
        BadFieldCase{"EnumNotString", "combine_dtype", [](json* e) { (*e)["combine_dtype"] = 0; }},
        BadFieldCase{"DeviceNotString", "device", [](json* e) { (*e)["device"] = 7; }},
        BadFieldCase{"DeviceMissing", "device", [](json* e) { e->erase("device"); }},
        BadFieldCase{"NegativeEpSize", "ep_size", [](json* e) { (*e)["ep_size"] = -8; }},
        BadFieldCase{"ZeroEpSize", "ep_size", [](json* e) { (*e)["ep_size"] = 0; }},
        BadFieldCase{"NegativeHidden", "hidden", [](json* e) { (*e)["hidden"] = -7168; }},
        BadFieldCase{"NegativeIntermediate", "intermediate", [](json* e) { (*e)["intermediate"] = -1; }},
        BadFieldCase{"NegativeNumExperts", "num_experts", [](json* e) { (*e)["num_experts"] = -256; }},
        BadFieldCase{"NegativeTopK", "top_k", [](json* e) { (*e)["top_k"] = -8; }},
        BadFieldCase{"NegativeMaxTokens", "max_tokens", [](json* e) { (*e)["max_tokens"] = -1; }},
        BadFieldCase{"MaxTokensString", "max_tokens", [](json* e) { (*e)["max_tokens"] = "512"; }},
        BadFieldCase{"MaxTokensFractional", "max_tokens", [](json* e) { (*e)["max_tokens"] = 512.5; }},
        BadFieldCase{"HiddenHuge", "hidden", [](json* e) { (*e)["hidden"] = UINT64_MAX; }},
        BadFieldCase{"KnobsMissing", "knobs", [](json* e) { e->erase("knobs"); }},
        BadFieldCase{"KnobsNotObject", "knobs", [](json* e) { (*e)["knobs"] = "fast"; }},
        BadFieldCase{"KnobsBlockMInvalid", "knobs", [](json* e) { (*e)["knobs"]["block_m"] = 96; }},
        BadFieldCase{"KnobsBlockNInvalid", "knobs", [](json* e) { (*e)["knobs"]["block_n"] = 100; }},
        BadFieldCase{"KnobsNegativeNumSms", "knobs.num_sms", [](json* e) { (*e)["knobs"]["num_sms"] = -1; }},
        BadFieldCase{"KnobsBlockMOverflow", "knobs.block_m", [](json* e) { (*e)["knobs"]["block_m"] = 1LL << 40; }},
        BadFieldCase{"KnobsCombineGroupsTooMany", "combine_groups", [](json* e) { (*e)["knobs"]["combine_groups"] = 9; }},
        BadFieldCase{"KnobsGemmClusterThree", "gemm_cluster", [](json* e) { (*e)["knobs"]["gemm_cluster"] = 3; }},
        BadFieldCase{"NegativeCrossover", "mega_max_tokens_per_rank",
                     [](json* e) { (*e)["mega_max_tokens_per_rank"] = -5; }},
        BadFieldCase{"KnobsTileOrderThree", "gemm_tile_order", [](json* e) { (*e)["knobs"]["gemm_tile_order"] = 3; }},
        BadFieldCase{"OwnerReduceName", "owner_reduce", [](json* e) { (*e)["owner_reduce"] = "sometimes"; }},
        BadFieldCase{"BackendUsNotObject", "backend_us", [](json* e) { (*e)["backend_us"] = 3.0; }},
        BadFieldCase{"BackendUsUnknownBackend", "backend_us.fused", [](json* e) { (*e)["backend_us"]["fused"] = 3.0; }},
        BadFieldCase{"BackendUsNegative", "backend_us.mega", [](json* e) { (*e)["backend_us"]["mega"] = -3.0; }},
        BadFieldCase{"NegativeMeasuredUs", "measured_us", [](json* e) { (*e)["measured_us"] = -1.0; }},
        BadFieldCase{"MeasuredUsString", "measured_us", [](json* e) { (*e)["measured_us"] = "fast"; }},
        BadFieldCase{"NoteNotString", "note", [](json* e) { (*e)["note"] = json::array(); }}),
    [](const ::testing::TestParamInfo<BadFieldCase>& info) { return std::string(info.param.name); });

TEST_F(KnobCacheTest, Load_OptionalFieldsDefault) {
  json e = entry_json(h200_key(128), make_entry(0, 0, 0, 0, 0.0, ""));
  e.erase("mega_max_tokens_per_rank");
  e.erase("measured_us");
  e.erase("note");
  e["knobs"] = json{{"block_m", 64}};
  const std::string p = path("sparse.json");
  write_text(p, json{{"version", 1}, {"entries", json::array({e})}}.dump());
  std::string warning;
  KnobCache cache = KnobCache::load(p, &warning);
  EXPECT_EQ(warning, "");
  expect_entry_eq(make_entry(64, 0, 0, 0, 0.0, ""), cache.lookup(h200_key(128)));
}

TEST_F(KnobCacheTest, Load_DuplicateKey_LaterWinsWithWarning) {
  json doc{{"version", 1},
           {"entries", json::array({entry_json(h200_key(128), make_entry(64, 128, 0, 0, 1.0, "first")),
                                    entry_json(h200_key(128), make_entry(128, 128, 0, 0, 2.0, "second"))})}};
  const std::string p = path("dup.json");
  write_text(p, doc.dump());
  std::string warning;
  KnobCache cache = KnobCache::load(p, &warning);
  EXPECT_EQ(cache.size(), 1u);
  expect_entry_eq(make_entry(128, 128, 0, 0, 2.0, "second"), cache.lookup(h200_key(128)));
  EXPECT_NE(warning.find("entry 1 repeats the key of entry 0"), std::string::npos) << warning;
}

// ---- atomic save ----

TEST_F(KnobCacheTest, Save_ReplacesExistingFile_LeavesNoTempFiles) {
  const std::string p = path("knobs.json");
  write_text(p, "old contents that are not even JSON");
  KnobCache cache;
  cache.put(h200_key(128), make_entry(64, 128, 0, 0, 3.0, "new"));
  ASSERT_TRUE(cache.save(p).is_ok());
  EXPECT_EQ(dir_listing(dir_), std::set<std::string>{"knobs.json"});
  std::string warning;
  KnobCache loaded = KnobCache::load(p, &warning);
  EXPECT_EQ(warning, "");
  expect_entry_eq(make_entry(64, 128, 0, 0, 3.0, "new"), loaded.lookup(h200_key(128)));

  // Saving again (a smaller cache) replaces, never appends.
  ASSERT_TRUE(KnobCache().save(p).is_ok());
  EXPECT_EQ(KnobCache::load(p).size(), 0u);
  EXPECT_EQ(dir_listing(dir_), std::set<std::string>{"knobs.json"});
  EXPECT_EQ(fs::status(p).permissions() & fs::perms::others_read, fs::perms::others_read);
}

TEST_F(KnobCacheTest, Save_CreatesMissingDirectories) {
  const std::string p = path("a/b/c/knobs.json");
  KnobCache cache;
  cache.put(h200_key(64), make_entry(64, 64, 0, 0, 1.0, ""));
  Status st = cache.save(p);
  ASSERT_TRUE(st.is_ok()) << st.to_string();
  EXPECT_EQ(dir_listing(dir_ / "a/b/c"), std::set<std::string>{"knobs.json"});
  EXPECT_EQ(KnobCache::load(p).size(), 1u);
}

TEST_F(KnobCacheTest, Save_ParentIsAFile_IoErrorNamingPath) {
  write_text(path("plain_file"), "x");
  const std::string p = path("plain_file/knobs.json");
  Status st = KnobCache().save(p);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find(p), std::string::npos) << st.message();
}

TEST_F(KnobCacheTest, Save_TargetIsADirectory_IoErrorAndNoTempFileLeft) {
  const std::string p = path("taken");
  fs::create_directory(p);
  write_text(p + "/keep", "x");  // non-empty: rename over it must fail
  Status st = KnobCache().save(p);
  EXPECT_EQ(st.code(), StatusCode::kIoError);
  EXPECT_NE(st.message().find(p), std::string::npos) << st.message();
  EXPECT_EQ(dir_listing(dir_), std::set<std::string>{"taken"});
}

// ---- the process-wide cache ----

class ProcessKnobCacheTest : public KnobCacheTest {
 protected:
  void SetUp() override {
    KnobCacheTest::SetUp();
    if (const char* v = std::getenv("MEGAMOE_KNOB_CACHE")) saved_ = v;
  }
  void TearDown() override {
    if (saved_) ::setenv("MEGAMOE_KNOB_CACHE", saved_->c_str(), 1);
    else ::unsetenv("MEGAMOE_KNOB_CACHE");
    reload_env_knobs();
    reset_process_knob_cache();
    KnobCacheTest::TearDown();
  }
  static void use_env(const std::string& value) {
    ::setenv("MEGAMOE_KNOB_CACHE", value.c_str(), 1);
    reload_env_knobs();
    reset_process_knob_cache();
  }
  std::optional<std::string> saved_;
};

TEST_F(ProcessKnobCacheTest, PathIsHonoured_AndResetRereads) {
  const std::string p = path("process.json");
  KnobCache cache;
  cache.put(h200_key(128), make_entry(64, 128, 0, 512, 4.0, "process"));
  cache.put(h200_key(1024), make_entry(128, 256, 0, 512, 40.0, "process big"));
  ASSERT_TRUE(cache.save(p).is_ok());

  use_env(p);
  EXPECT_EQ(env_knobs().knob_cache_path, p);
  const KnobCache& process = process_knob_cache();
  EXPECT_EQ(process.size(), 2u);
  expect_entry_eq(make_entry(64, 128, 0, 512, 4.0, "process"), process.lookup(h200_key(100)));
  EXPECT_EQ(&process_knob_cache(), &process);  // loaded once: the same object

  // The file changes; the process cache keeps what it loaded until reset.
  KnobCache one;
  one.put(h200_key(64), make_entry(64, 64, 0, 0, 1.0, "replaced"));
  ASSERT_TRUE(one.save(p).is_ok());
  EXPECT_EQ(process_knob_cache().size(), 2u);
  reset_process_knob_cache();
  EXPECT_EQ(process_knob_cache().size(), 1u);
  expect_entry_eq(make_entry(64, 64, 0, 0, 1.0, "replaced"), process_knob_cache().lookup(h200_key(100)));
}

TEST_F(ProcessKnobCacheTest, Off_GivesEmptyCache) {
  const std::string p = path("present.json");
  KnobCache cache;
  cache.put(h200_key(128), make_entry(64, 128, 0, 0, 4.0, ""));
  ASSERT_TRUE(cache.save(p).is_ok());
  use_env(p);
  ASSERT_EQ(process_knob_cache().size(), 1u);

  use_env("off");
  EXPECT_TRUE(env_knobs().knob_cache_off);
  EXPECT_EQ(process_knob_cache().size(), 0u);
  EXPECT_FALSE(process_knob_cache().lookup(h200_key(128)).has_value());
}

TEST_F(ProcessKnobCacheTest, MissingOrCorruptFile_GivesEmptyCache) {
  use_env(path("never_written.json"));
  EXPECT_EQ(process_knob_cache().size(), 0u);
  const std::string p = path("corrupt.json");
  write_text(p, "{\"version\": 1, \"entries\": [");
  use_env(p);
  EXPECT_EQ(process_knob_cache().size(), 0u);
}

// ---- apply_tuned_knobs: the cache fills what the caller left to the heuristic ----

MoeGeometry tuned_geometry(int64_t max_tokens) {
  MoeGeometry g;
  g.hidden = 7168;
  g.intermediate = 2048;
  g.num_experts = 256;
  g.top_k = 8;
  g.ep_size = 2;
  g.max_tokens_per_rank = max_tokens;
  return g;
}

KnobCache cache_with_tuned_entry() {
  KnobCache cache;
  KnobEntry e;
  e.knobs.block_m = 64;
  e.knobs.block_n = 256;
  e.knobs.num_sms = 120;
  e.knobs.combine_groups = 8;
  e.knobs.gemm_cluster = 1;
  cache.put(make_knob_key("NVIDIA H200", tuned_geometry(128), MoeConfig{}), e);
  return cache;
}

TEST(ApplyTunedKnobs, FillsHeuristicFieldsFromTheBucket) {
  std::string note;
  const MoeConfig out =
      apply_tuned_knobs(MoeConfig{}, tuned_geometry(100), "NVIDIA H200", cache_with_tuned_entry(), &note);
  EXPECT_EQ(out.knobs.block_m, 64);  // bucket 128 is the smallest >= 100
  EXPECT_EQ(out.knobs.block_n, 256);
  EXPECT_EQ(out.knobs.num_sms, 120);
  EXPECT_EQ(out.knobs.combine_groups, 8);
  EXPECT_EQ(out.knobs.gemm_cluster, 1);
  EXPECT_NE(note.find("block_m=64"), std::string::npos) << note;
  EXPECT_NE(note.find("gemm_cluster=1"), std::string::npos) << note;
  EXPECT_NE(note.find("combine_groups=8"), std::string::npos) << note;
}

TEST(ApplyTunedKnobs, CallerSetFieldsWin) {
  MoeConfig c;
  c.knobs.block_m = 128;
  const MoeConfig out = apply_tuned_knobs(c, tuned_geometry(128), "NVIDIA H200", cache_with_tuned_entry());
  EXPECT_EQ(out.knobs.block_m, 128);
  EXPECT_EQ(out.knobs.block_n, 256);
}

TEST(ApplyTunedKnobs, NoEntryLeavesTheConfigAlone) {
  std::string note = "stale";
  MoeConfig c;
  c.combine_dtype = CombineDtype::kMxfp8;  // another key: no entry
  const MoeConfig out = apply_tuned_knobs(c, tuned_geometry(128), "NVIDIA H200", cache_with_tuned_entry(), &note);
  EXPECT_TRUE(out.knobs == c.knobs);
  EXPECT_TRUE(note.empty()) << note;
  const MoeConfig other_device = apply_tuned_knobs(MoeConfig{}, tuned_geometry(128), "NVIDIA H100", cache_with_tuned_entry());
  EXPECT_EQ(other_device.knobs.block_m, 0);
}

// ---- the fields megamoe tune writes ----

TEST_F(KnobCacheTest, RoundTrip_TunedFields) {
  KnobEntry e = make_entry(32, 128, 0, kMegaNever, 41.5, "megamoe tune");
  e.knobs.gemm_tile_order = 2;
  e.owner_reduce = OwnerReduce::kOn;
  e.backend_us = {{"routed", 41.5}, {"mega", 50.25}};
  KnobCache cache;
  cache.put(h200_key(128), e);
  const std::string p = path("tuned.json");
  ASSERT_TRUE(cache.save(p).is_ok());
  const json doc = json::parse(read_text(p));
  EXPECT_EQ(doc["entries"][0]["knobs"]["gemm_tile_order"], 2);
  EXPECT_EQ(doc["entries"][0]["owner_reduce"], "on");
  EXPECT_EQ(doc["entries"][0]["mega_max_tokens_per_rank"], -1);
  std::string warning;
  const std::optional<KnobEntry> got = KnobCache::load(p, &warning).lookup(h200_key(128));
  EXPECT_EQ(warning, "");
  expect_entry_eq(e, got);
  EXPECT_EQ(got->owner_reduce, OwnerReduce::kOn);
  EXPECT_EQ(got->backend_us, e.backend_us);
}

MoeGeometry h200_geometry(int64_t max_tokens) {
  return MoeGeometry{7168, 2048, 256, 8, 8, 0, max_tokens};
}

TEST(ApplyTunedKnobs, OwnerReduceOnlyWhereTheConfigLeavesItToAuto) {
  KnobCache cache;
  KnobEntry e;
  e.owner_reduce = OwnerReduce::kOn;
  cache.put(h200_key(128), e);
  std::string note;
  EXPECT_EQ(apply_tuned_knobs(MoeConfig{}, h200_geometry(128), "NVIDIA H200", cache, &note).owner_reduce,
            OwnerReduce::kOn);
  EXPECT_NE(note.find("owner_reduce=on"), std::string::npos) << note;
  MoeConfig off;
  off.owner_reduce = OwnerReduce::kOff;  // the caller's choice stays
  EXPECT_EQ(apply_tuned_knobs(off, h200_geometry(128), "NVIDIA H200", cache).owner_reduce, OwnerReduce::kOff);
  MoeConfig in_kernel;
  in_kernel.in_kernel_fc2_reduce = true;  // on is refused with it
  EXPECT_EQ(apply_tuned_knobs(in_kernel, h200_geometry(128), "NVIDIA H200", cache).owner_reduce, OwnerReduce::kAuto);
}

TEST(MegaThreshold, InForceAndWhereItCameFrom) {
  KnobCache cache;
  KnobEntry measured;
  measured.mega_max_tokens_per_rank = 256;
  measured.note = "megamoe tune 2026-12-01";
  cache.put(h200_key(128), measured);
  KnobEntry never;
  never.mega_max_tokens_per_rank = kMegaNever;
  KnobKey other = h200_key(128);
  other.combine_dtype = CombineDtype::kMxfp8;
  cache.put(other, never);

  MegaThreshold t = mega_threshold_in_force(h200_geometry(100), MoeConfig{}, "NVIDIA H200", cache);
  EXPECT_EQ(t.value, 256);
  EXPECT_TRUE(t.from_cache);
  EXPECT_NE(t.source.find("measured crossover"), std::string::npos) << t.source;
  EXPECT_NE(t.source.find("2026-12-01"), std::string::npos) << t.source;

  MoeConfig mx;
  mx.combine_dtype = CombineDtype::kMxfp8;
  t = mega_threshold_in_force(h200_geometry(100), mx, "NVIDIA H200", cache);
  EXPECT_EQ(t.value, 0);  // never mega
  EXPECT_NE(t.source.find("never mega"), std::string::npos) << t.source;

  MoeConfig set;
  set.mega_max_tokens_per_rank = 64;  // the caller's value wins
  t = mega_threshold_in_force(h200_geometry(100), set, "NVIDIA H200", cache);
  EXPECT_EQ(t.value, 64);
  EXPECT_FALSE(t.from_cache);
  EXPECT_NE(t.source.find("set by the caller"), std::string::npos) << t.source;

  t = mega_threshold_in_force(h200_geometry(100), MoeConfig{}, "NVIDIA H100", cache);
  EXPECT_EQ(t.value, kDefaultMegaMaxTokensPerRank);
  EXPECT_NE(t.source.find("no knob cache entry"), std::string::npos) << t.source;
  t = mega_threshold_in_force(h200_geometry(100), MoeConfig{}, "", cache);
  EXPECT_NE(t.source.find("no CUDA device"), std::string::npos) << t.source;
}

}  // namespace
}  // namespace megamoe
