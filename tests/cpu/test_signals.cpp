// The modular comparison every signal wait uses (kernels::cell_position, sm90_signals.cuh), on the
// host: the dispatch cell (launches << 32, G shares per launch summing to 2^32) and the combine cell
// (epoch << 20 | bound) around their wraps, 2^32 and 2^44 launches. The GPU side runs forwards from
// cells seeded at 2^32 - 2 (tests/gpu/test_transport.cpp, EpochWrap).
#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/common/sm90_signals.cuh"
#include "kernels/transport/sm90_launch.h"

namespace megamoe {
namespace kernels {
namespace {

// What dispatch_kernel's last CTA waits for: epoch e's window [progress(e), progress(e + 1)).
CellPosition dispatch_wait(uint64_t seen, uint64_t epoch) {
  return cell_position(seen, dispatch_progress(epoch), dispatch_progress(epoch + 1) - dispatch_progress(epoch));
}
// What a combine waiter of epoch e needing `bound` waits for: [progress(e, bound), progress(e + 1, 0)).
CellPosition combine_wait(uint64_t seen, uint64_t epoch, uint64_t bound) {
  return cell_position(seen, combine_progress(epoch, bound), combine_progress(epoch + 1, 0) - combine_progress(epoch, bound));
}

constexpr uint64_t k2To32 = uint64_t(1) << 32;

TEST(SignalCells, DispatchWaitIsModularAcrossTheWrapAt2To32Launches) {
  for (uint64_t e = k2To32 - 3; e <= k2To32 + 2; ++e) {
    SCOPED_TRACE(e);
    EXPECT_EQ(dispatch_wait(dispatch_progress(e), e), CellPosition::kReady);
    EXPECT_EQ(dispatch_wait(dispatch_progress(e - 1), e), CellPosition::kBehind);  // previous launch complete
    EXPECT_EQ(dispatch_wait(dispatch_progress(e - 1) + 1, e), CellPosition::kBehind);  // one share of e in
    EXPECT_EQ(dispatch_wait(dispatch_progress(e) - 1, e), CellPosition::kBehind);  // all shares but one
    EXPECT_EQ(dispatch_wait(dispatch_progress(e) + 5, e), CellPosition::kReady);  // a peer's next shares
    EXPECT_EQ(dispatch_wait(dispatch_progress(e + 1), e), CellPosition::kAhead);  // a peer a launch ahead
    EXPECT_EQ(dispatch_wait(dispatch_progress(e + 3), e), CellPosition::kAhead);
  }
  // The comparison the wait made before it was modular (lo <= seen < hi) rejects the last epoch
  // before the wrap: its hi is 0. The modular one above accepts it.
  const uint64_t e = k2To32 - 1, lo = dispatch_progress(e), hi = dispatch_progress(e + 1);
  EXPECT_EQ(hi, 0u);
  EXPECT_FALSE(lo <= dispatch_progress(e) && dispatch_progress(e) < hi);
}

TEST(SignalCells, DispatchCellRunningForwardsThroughTheWrapIsReadyExactlyOnce) {
  // One source, G = 7 CTAs per launch: shares 2^32 - 6, then six 1s (dispatch_kernel's split).
  uint64_t cell = dispatch_progress(k2To32 - 2);
  for (uint64_t e = k2To32 - 1; e <= k2To32 + 1; ++e) {
    const uint64_t shares[7] = {k2To32 - 6, 1, 1, 1, 1, 1, 1};
    for (int i = 0; i < 7; ++i) {
      EXPECT_EQ(dispatch_wait(cell, e), CellPosition::kBehind) << "epoch " << e << " share " << i;
      cell += shares[(i + 3) % 7];  // any arrival order
    }
    EXPECT_EQ(dispatch_wait(cell, e), CellPosition::kReady) << "epoch " << e;
    EXPECT_EQ(dispatch_wait(cell, e - 1), CellPosition::kAhead) << "epoch " << e;
  }
}

TEST(SignalCells, CombineWaitIsModularAcrossTheWrapAt2To44Launches) {
  const uint64_t wrap = uint64_t(1) << (64 - kCombineBoundBits);
  for (uint64_t e : {uint64_t(5), k2To32 - 1, k2To32, wrap - 2, wrap - 1, wrap, wrap + 1}) {
    SCOPED_TRACE(e);
    EXPECT_EQ(combine_wait(combine_progress(e, kCombineAllRows), e, kCombineAllRows), CellPosition::kReady);
    EXPECT_EQ(combine_wait(combine_progress(e, 40), e, 40), CellPosition::kReady);
    EXPECT_EQ(combine_wait(combine_progress(e, 41), e, 40), CellPosition::kReady);  // a later group's bound
    EXPECT_EQ(combine_wait(combine_progress(e, 39), e, 40), CellPosition::kBehind);  // an earlier group's
    EXPECT_EQ(combine_wait(combine_progress(e - 1, kCombineAllRows), e, 1), CellPosition::kBehind);
    EXPECT_EQ(combine_wait(combine_progress(e + 1, 0), e, kCombineAllRows), CellPosition::kAhead);
    EXPECT_EQ(combine_wait(combine_progress(e + 1, 3), e, 3), CellPosition::kAhead);
  }
}

TEST(SignalCells, WindowsOfOneAreExactMatches) {
  EXPECT_EQ(cell_position(7, 7, 1), CellPosition::kReady);
  EXPECT_EQ(cell_position(6, 7, 1), CellPosition::kBehind);
  EXPECT_EQ(cell_position(8, 7, 1), CellPosition::kAhead);
  EXPECT_EQ(cell_position(0, ~uint64_t(0), 1), CellPosition::kAhead);  // the wrap of the whole range
  EXPECT_EQ(cell_position(~uint64_t(0), 0, 1), CellPosition::kBehind);
}

}  // namespace
}  // namespace kernels
}  // namespace megamoe
