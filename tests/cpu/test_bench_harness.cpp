// The bench harness of the tool (tools/megamoe/bench_harness.h): the one median, the flush marker
// among CUPTI records, the row printer's text, the CSV text and the floor fields.
#include <gtest/gtest.h>

#include "bench_harness.h"

namespace megamoe::tool {
namespace {

TEST(BenchHarness, SummaryMedianOfOddAndEvenCounts) {
  const Summary odd = summarize({5, 1, 3});
  EXPECT_EQ(odd.n, 3);
  EXPECT_DOUBLE_EQ(odd.median, 3);
  EXPECT_DOUBLE_EQ(odd.min, 1);
  EXPECT_DOUBLE_EQ(odd.max, 5);
  const Summary even = summarize({4, 1, 3, 10});
  EXPECT_DOUBLE_EQ(even.median, 3.5);  // the mean of the two middle samples
  EXPECT_DOUBLE_EQ(even.max, 10);
  const Summary none = summarize({});
  EXPECT_EQ(none.n, 0);
  EXPECT_DOUBLE_EQ(none.median, 0);
}

TEST(BenchHarness, FlushSpansAreTheBigMemsetOrTheReadKernel) {
  EXPECT_TRUE(is_flush_span(DeviceSpan{true, "", 0, 1, static_cast<uint64_t>(kL2FlushBytes)}));
  EXPECT_FALSE(is_flush_span(DeviceSpan{true, "", 0, 1, 4096}));  // a library's own memset
  EXPECT_TRUE(is_flush_span(DeviceSpan{false, "_ZN7megamoe4gemm11read_kernelEPK5uint4lPj", 0, 1, 0}));
  EXPECT_FALSE(is_flush_span(DeviceSpan{false, "sm90_grouped_gemm_kernel", 0, 1, 0}));
}

TEST(BenchHarness, RowPrinterAlignsFormatsAndMarksMissingFields) {
  const RowPrinter p({{"name", "name", -6},
                      {"tokens", "T", 4, "%lld"},
                      {"", "|"},
                      {"us", "us", 7, "%.1f"},
                      {"json_only", ""},
                      {"cmd", "command", 0, "%s", "  "}},
                     "  ", "# ");
  EXPECT_EQ(p.header(), "# name      T |      us  command");
  const nlohmann::json rec = {{"name", "ab"}, {"tokens", 16}, {"us", 12.345}, {"cmd", "x y"}, {"json_only", 1}};
  EXPECT_EQ(p.row(rec), "  ab       16 |    12.3  x y");
  EXPECT_EQ(p.row({{"name", "ab"}}), "  ab        - |       -  -");
}

TEST(BenchHarness, CsvQuotesTextAndLeavesMissingFieldsEmpty) {
  const std::vector<nlohmann::json> records = {{{"a", 1}, {"b", 2.5}, {"c", "x,y"}},
                                               {{"a", 2}, {"c", "say \"hi\""}}};
  EXPECT_EQ(csv_text({"a", "b", "c"}, records), "a,b,c\n1,2.500000,\"x,y\"\n2,,\"say \"\"hi\"\"\"\n");
}

TEST(BenchHarness, DottedKeysReadNestedFields) {
  const nlohmann::json rec = {{"tokens", 8}, {"dispatch_us", summary_json(summarize({3, 1, 2}))}};
  const RowPrinter p({{"tokens", "T", 2, "%lld"}, {"dispatch_us.median", "d", 5, "%.1f"}, {"dispatch_us.none", "x", 2}});
  EXPECT_EQ(p.row(rec), " 8   2.0  -");
  EXPECT_EQ(csv_text({"tokens", "dispatch_us.max"}, {rec}), "tokens,dispatch_us.max\n8,3.000000\n");
}

TEST(BenchHarness, FloorFieldsAndSummaryFields) {
  nlohmann::json r;
  set_floor(&r, 150, 100, "hbm");
  EXPECT_DOUBLE_EQ(r["floor_us"].get<double>(), 100);
  EXPECT_DOUBLE_EQ(r["time_over_floor"].get<double>(), 1.5);
  EXPECT_EQ(r["floor_bound"], "hbm");
  nlohmann::json z;
  set_floor(&z, 150, 0);
  EXPECT_FALSE(z.contains("time_over_floor"));  // no floor, no ratio
  set_summary(&z, summarize({1, 2, 3}), "dispatch_");
  EXPECT_DOUBLE_EQ(z["dispatch_median_us"].get<double>(), 2);
  EXPECT_DOUBLE_EQ(z["dispatch_max_us"].get<double>(), 3);
}

TEST(BenchHarness, FlushOnTheCpuIsANoOp) {
  EXPECT_TRUE(flush_l2(Device(), nullptr, FlushMode::kMemset).is_ok());
  EXPECT_TRUE(flush_l2(Device(), nullptr, FlushMode::kRead).is_ok());
}

}  // namespace
}  // namespace megamoe::tool
