// NcclBootstrap::from_env: what `megamoe launch` (or an engine's launcher) sets, read through the one
// place that reads MEGAMOE_* variables. Needs no GPU: it parses and validates only.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <string>

#include "core/env.h"
#include "megamoe/comm.h"

namespace megamoe {
namespace {

class Bootstrap : public ::testing::Test {
 protected:
  void SetUp() override { clear(); }
  void TearDown() override { clear(); }
  static void clear() {
    for (const char* v : {"MEGAMOE_RANK", "MEGAMOE_WORLD_SIZE", "MEGAMOE_LOCAL_RANK", "MEGAMOE_NCCL_ID_FILE",
                          "MEGAMOE_NCCL_ID"})
      unsetenv(v);
    reload_env_knobs();
  }
  static Status read(NcclBootstrap* b) {
    reload_env_knobs();
    return NcclBootstrap::from_env(b);
  }
};

TEST_F(Bootstrap, ReadsWhatLaunchSets) {
  setenv("MEGAMOE_RANK", "1", 1);
  setenv("MEGAMOE_WORLD_SIZE", "2", 1);
  setenv("MEGAMOE_LOCAL_RANK", "3", 1);
  setenv("MEGAMOE_NCCL_ID_FILE", "/tmp/megamoe-id", 1);
  NcclBootstrap b;
  ASSERT_TRUE(read(&b).is_ok());
  EXPECT_EQ(b.rank, 1);
  EXPECT_EQ(b.world_size, 2);
  EXPECT_EQ(b.device, 3);
  EXPECT_EQ(b.id_file, "/tmp/megamoe-id");
  EXPECT_TRUE(b.id_hex.empty());
}

TEST_F(Bootstrap, LocalRankDefaultsToTheRank) {
  setenv("MEGAMOE_RANK", "0", 1);
  setenv("MEGAMOE_WORLD_SIZE", "4", 1);
  const std::string id(NcclBootstrap::kIdHexDigits, 'a');
  setenv("MEGAMOE_NCCL_ID", id.c_str(), 1);
  NcclBootstrap b;
  ASSERT_TRUE(read(&b).is_ok());
  EXPECT_EQ(b.device, -1);  // -1 = use the rank as the CUDA ordinal
  EXPECT_EQ(b.id_hex, id);
}

TEST_F(Bootstrap, MissingRankIsNamed) {
  setenv("MEGAMOE_WORLD_SIZE", "2", 1);
  setenv("MEGAMOE_NCCL_ID_FILE", "/tmp/x", 1);
  NcclBootstrap b;
  Status st = read(&b);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("MEGAMOE_RANK=unset"), std::string::npos) << st.message();
}

TEST_F(Bootstrap, MalformedValueIsNamed) {
  setenv("MEGAMOE_RANK", "one", 1);
  setenv("MEGAMOE_WORLD_SIZE", "2", 1);
  setenv("MEGAMOE_NCCL_ID_FILE", "/tmp/x", 1);
  NcclBootstrap b;
  Status st = read(&b);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("MEGAMOE_RANK=one"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("non-negative integer"), std::string::npos) << st.message();
}

TEST_F(Bootstrap, NoIdSourceIsRefused) {
  setenv("MEGAMOE_RANK", "0", 1);
  setenv("MEGAMOE_WORLD_SIZE", "2", 1);
  NcclBootstrap b;
  Status st = read(&b);
  ASSERT_FALSE(st.is_ok());
  EXPECT_NE(st.message().find("MEGAMOE_NCCL_ID_FILE"), std::string::npos) << st.message();
}

// from_values() takes the variables as strings: each bad value is refused naming its variable, the
// value and the rule; no sign, space, suffix, NUL or out-of-range count slips through strtol's leniency.
TEST(BootstrapValues, BadValuesAreRefusedByName) {
  const std::string hex(NcclBootstrap::kIdHexDigits, 'c');
  const struct {
    NcclBootstrap::EnvValues v;
    const char* named;
  } cases[] = {
      {{"+1", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK=+1"},
      {{" 1", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK= 1"},
      {{"1 ", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK=1 "},
      {{"-0", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK=-0"},
      {{"0x1", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK=0x1"},
      {{std::string("1\0", 2) + "9", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK=1\\x009"},
      {{"0", "1048577", "", "/tmp/x", ""}, "MEGAMOE_WORLD_SIZE=1048577"},
      {{"0", "99999999999", "", "/tmp/x", ""}, "MEGAMOE_WORLD_SIZE=99999999999"},
      {{"0", "0", "", "/tmp/x", ""}, "MEGAMOE_WORLD_SIZE=0, must be >= 1"},
      {{"2", "2", "", "/tmp/x", ""}, "MEGAMOE_RANK=2, must be below MEGAMOE_WORLD_SIZE=2"},
      {{"0", "2", "-1", "/tmp/x", ""}, "MEGAMOE_LOCAL_RANK=-1"},
      {{"0", "2", "", "", "ab"}, "MEGAMOE_NCCL_ID=ab, must be 256 hex digits"},
      {{"0", "2", "", "", hex.substr(1) + "g"}, "MEGAMOE_NCCL_ID="},
      {{"0", "2", "", "", ""}, "MEGAMOE_NCCL_ID_FILE=unset"},
  };
  for (const auto& c : cases) {
    NcclBootstrap b;
    b.rank = 42;
    const Status st = NcclBootstrap::from_values(c.v, &b);
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << c.named;
    EXPECT_NE(st.message().find(c.named), std::string::npos) << st.message();
    EXPECT_EQ(b.rank, 42) << "a refused parse leaves *out as it was";
  }
  NcclBootstrap b;
  ASSERT_TRUE(NcclBootstrap::from_values({"007", "8", "0", "", hex}, &b).is_ok());
  EXPECT_EQ(b.rank, 7);
  EXPECT_EQ(b.world_size, 8);
  EXPECT_EQ(b.device, 0);
  EXPECT_EQ(b.id_hex, hex);
}

// The launched processes' host barrier bound (tools/megamoe nccl_barrier): its own variable, longer
// than the wait bound by default, a bad value ignored (with a warning) rather than taken.
TEST_F(Bootstrap, BarrierTimeoutIsReadApartFromTheWaitBound) {
  unsetenv("MEGAMOE_BARRIER_TIMEOUT_MS");
  reload_env_knobs();
  EXPECT_EQ(env_knobs().barrier_timeout_ms, 120000);
  EXPECT_GT(env_knobs().barrier_timeout_ms, env_knobs().wait_timeout_ms);
  setenv("MEGAMOE_BARRIER_TIMEOUT_MS", "2500", 1);
  reload_env_knobs();
  EXPECT_EQ(env_knobs().barrier_timeout_ms, 2500);
  for (const char* bad : {"0", "-5", "12ms", "x"}) {
    setenv("MEGAMOE_BARRIER_TIMEOUT_MS", bad, 1);
    reload_env_knobs();
    EXPECT_EQ(env_knobs().barrier_timeout_ms, 120000) << bad;
  }
  unsetenv("MEGAMOE_BARRIER_TIMEOUT_MS");
  reload_env_knobs();
}

}  // namespace
}  // namespace megamoe

namespace megamoe {
namespace {

// adopt_nccl_comm() refuses what it must before touching the communicator.
TEST(AdoptNcclComm, NullCommunicatorIsRefusedByName) {
  std::shared_ptr<Communicator> comm;
  const Status st = adopt_nccl_comm(nullptr, 0, &comm);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("nccl_comm=null"), std::string::npos) << st.message();
  EXPECT_NE(st.message().find("first collective"), std::string::npos) << st.message();
  EXPECT_FALSE(comm);
  EXPECT_EQ(adopt_nccl_comm(nullptr, 0, nullptr).code(), StatusCode::kInvalidArgument);
}

TEST(AdoptNcclComm, WithoutADeviceTheCommunicatorIsNeverRead) {
  int n = 0;
  if (cudaGetDeviceCount(&n) == cudaSuccess && n > 0) GTEST_SKIP() << "a CUDA device is present";
  cudaGetLastError();
  std::shared_ptr<Communicator> comm;
  int not_a_comm = 0;  // would crash if dereferenced as an ncclComm_t
  const Status st = adopt_nccl_comm(&not_a_comm, 0, &comm);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.to_string();
  EXPECT_FALSE(comm);
}

}  // namespace
}  // namespace megamoe
