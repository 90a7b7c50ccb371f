// Launchers of the dispatch and expert-pool kernels.
#include <algorithm>

#include "core/cuda_check.h"
#include "kernels/common/pdl.cuh"
#include "kernels/transport/sm90_dispatch.cuh"
#include "kernels/transport/sm90_expert_pool.cuh"
#include "kernels/transport/sm90_launch.h"

namespace megamoe {
namespace kernels {

namespace {
template <int kMode>
Status launch_dispatch_mode(const TransportArgs& args, DispatchShape shape, int grid, const void* x,
                            const float* x_scale, const int32_t* topk_ids, const float* topk_weights,
                            cudaStream_t stream) {
  MEGAMOE_CUDA_CHECK(launch_pdl(dispatch_kernel<kMode>, grid, kDispatchThreads, 0, stream,
                                use_pdl(args), args, shape, x, x_scale, topk_ids, topk_weights));
  return Status::ok();
}
}  // namespace

Status launch_dispatch(const TransportArgs& args, int mode, const void* x, const float* x_scale,
                       const int32_t* topk_ids, const float* topk_weights, int num_sms, cudaStream_t stream) {
  const int64_t T = args.num_tokens, H = args.layout.params.hidden;
  // Shape: about 2 CTAs per SM; a CTA ranks up to 512 tokens; small T splits each row into parts so
  // that every warp of a CTA has work (decode: T <= 128 gives one token per CTA, 14 warps per token
  // at H = 7168; prefill: T = 8192 gives 32 tokens per CTA, one part each).
  const int64_t want_ctas = 2 * static_cast<int64_t>(std::max(num_sms, 1));
  DispatchShape shape;
  shape.tokens_per_cta =
      static_cast<int>(std::min<int64_t>(std::max<int64_t>((T + want_ctas - 1) / want_ctas, 1), kMaxTokensPerCta));
  const int grid = static_cast<int>(std::max<int64_t>(1, (T + shape.tokens_per_cta - 1) / shape.tokens_per_cta));
  const int64_t chunks = (mode == kFp8ToBf16 || mode == kBf16Copy) ? H / 8 : H / 16;
  const int64_t rounds = std::max<int64_t>(1, (chunks + 31) / 32);
  shape.parts = static_cast<int>(std::min<int64_t>(std::max(2 * kDispatchWarps / shape.tokens_per_cta, 1), rounds));
  switch (mode) {
    case kBf16ToFp8: return launch_dispatch_mode<kBf16ToFp8>(args, shape, grid, x, x_scale, topk_ids, topk_weights, stream);
    case kFp8Copy: return launch_dispatch_mode<kFp8Copy>(args, shape, grid, x, x_scale, topk_ids, topk_weights, stream);
    case kBf16Copy: return launch_dispatch_mode<kBf16Copy>(args, shape, grid, x, x_scale, topk_ids, topk_weights, stream);
    default: return launch_dispatch_mode<kFp8ToBf16>(args, shape, grid, x, x_scale, topk_ids, topk_weights, stream);
  }
}

Status launch_expert_pool(const TransportArgs& args, int num_sms, cudaStream_t stream,
                          const float* pool_weight_scale) {
  const int64_t R = args.sig.num_ranks;
  const int64_t rank_warps = R * args.num_chunks();
  const int rank_ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rank_warps + 7) / 8, 8 * num_sms)));
  const int64_t k = args.top_k();
  const bool pdl = use_pdl(args);
  if (k <= 4) MEGAMOE_CUDA_CHECK(launch_pdl(pool_rank_kernel<4>, rank_ctas, 256, 0, stream, pdl, args));
  else if (k <= 8) MEGAMOE_CUDA_CHECK(launch_pdl(pool_rank_kernel<8>, rank_ctas, 256, 0, stream, pdl, args));
  else MEGAMOE_CUDA_CHECK(launch_pdl(pool_rank_kernel<kMaxTopK>, rank_ctas, 256, 0, stream, pdl, args));
  const int64_t offset_warps = kPoolOffsetsThreads / 32;
  const int offsets_ctas = static_cast<int>(std::max<int64_t>(
      1, std::min<int64_t>((args.experts_per_rank() + offset_warps - 1) / offset_warps, 2 * num_sms)));
  MEGAMOE_CUDA_CHECK(launch_pdl(pool_offsets_kernel, offsets_ctas, kPoolOffsetsThreads, 0, stream, pdl, args));
  // Warps cover the received rows and the padding rows (up to E_l * (BM - 1), zeroed here): sized by
  // the larger, so a small T with many padded expert segments does not zero megabytes on one CTA.
  const int64_t rows = std::max<int64_t>(R * args.t_max(), args.layout.pool_rows);
  const int scatter_ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((rows + 7) / 8, 4 * num_sms)));
  if (pool_weight_scale != nullptr)
    MEGAMOE_CUDA_CHECK(
        launch_pdl(pool_scatter_scaled_kernel, scatter_ctas, 256, 0, stream, pdl, args, pool_weight_scale));
  else
    MEGAMOE_CUDA_CHECK(launch_pdl(pool_scatter_kernel, scatter_ctas, 256, 0, stream, pdl, args));
  return Status::ok();
}

}  // namespace kernels
}  // namespace megamoe
