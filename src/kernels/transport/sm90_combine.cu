// Launchers of the combine kernels.
#include <algorithm>
#include <atomic>
#include <string>

#include "core/cuda_check.h"
#include "kernels/common/pdl.cuh"
#include "kernels/transport/sm90_combine.cuh"
#include "kernels/transport/sm90_launch.h"

namespace megamoe {
namespace kernels {

namespace {
// A cooperative launch (every CTA co-resident), with programmatic dependent launch when `pdl` and
// the runtime takes both attributes together (else without it, decided once per process).
template <typename... KernelArgs, typename... Args>
cudaError_t launch_cooperative(void (*kernel)(KernelArgs...), int grid, int block, cudaStream_t stream, bool pdl,
                               Args... args) {
  static std::atomic<bool> pdl_refused{false};
  cudaLaunchAttribute attrs[2];
  attrs[0].id = cudaLaunchAttributeCooperative;
  attrs[0].val.cooperative = 1;
  attrs[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attrs[1].val.programmaticStreamSerializationAllowed = 1;
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(static_cast<unsigned>(grid));
  cfg.blockDim = dim3(static_cast<unsigned>(block));
  cfg.stream = stream;
  cfg.attrs = attrs;
  cfg.numAttrs = pdl && !pdl_refused.load() ? 2 : 1;
  cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, static_cast<KernelArgs>(args)...);
  if (err != cudaSuccess && err != cudaErrorCooperativeLaunchTooLarge && cfg.numAttrs == 2) {
    cudaGetLastError();
    pdl_refused.store(true);
    cfg.numAttrs = 1;
    err = cudaLaunchKernelEx(&cfg, kernel, static_cast<KernelArgs>(args)...);
  }
  // A runtime that takes no cooperative launch here (capture of one, say): the plain launch, the
  // grid still capped at the occupancy limit.
  if (err != cudaSuccess && err != cudaErrorCooperativeLaunchTooLarge) {
    cudaGetLastError();
    attrs[0] = attrs[1];
    cfg.numAttrs = pdl ? 1 : 0;
    err = cudaLaunchKernelEx(&cfg, kernel, static_cast<KernelArgs>(args)...);
  }
  if (err != cudaSuccess) cudaGetLastError();
  return err;
}

template <typename InT, bool kOwner>
cudaError_t send_as_mode(const TransportArgs& args, const void* out, int ctas, int parts, cudaStream_t stream) {
  const InT* in = static_cast<const InT*>(out);
  const bool pdl = use_pdl(args);
  switch (args.layout.params.combine_format) {
    case kWsMxfp8:
      return launch_pdl(combine_send_kernel<kWsMxfp8, InT, kOwner>, ctas, kCombineThreads, 0, stream, pdl, args, in, parts);
    case kWsNvfp4:
      return launch_pdl(combine_send_kernel<kWsNvfp4, InT, kOwner>, ctas, kCombineThreads, 0, stream, pdl, args, in, parts);
    default:
      return launch_pdl(combine_send_kernel<kWsBf16, InT, kOwner>, ctas, kCombineThreads, 0, stream, pdl, args, in, parts);
  }
}

template <typename InT>
cudaError_t send_as(const TransportArgs& args, const void* out, int ctas, int parts, cudaStream_t stream) {
  return args.layout.params.owner_reduce ? send_as_mode<InT, true>(args, out, ctas, parts, stream)
                                         : send_as_mode<InT, false>(args, out, ctas, parts, stream);
}

template <bool kOwner>
cudaError_t reduce_as(const TransportArgs& args, const int32_t* topk_ids, uint16_t* y, int ctas, int parts,
                      cudaStream_t stream) {
  const bool pdl = use_pdl(args);
  switch (args.layout.params.combine_format) {
    case kWsMxfp8:
      return launch_pdl(combine_reduce_kernel<kWsMxfp8, kOwner>, ctas, kCombineThreads, 0, stream, pdl, args, topk_ids, y, parts);
    case kWsNvfp4:
      return launch_pdl(combine_reduce_kernel<kWsNvfp4, kOwner>, ctas, kCombineThreads, 0, stream, pdl, args, topk_ids, y, parts);
    default:
      return launch_pdl(combine_reduce_kernel<kWsBf16, kOwner>, ctas, kCombineThreads, 0, stream, pdl, args, topk_ids, y, parts);
  }
}

// Parts per row (or token) of `rounds` rounds: enough work items (row or token, part) to reach
// items_wanted at small T (decode: 8 bf16 rows of 28 rounds at T = 1 become 7 parts of 4 rounds); 1
// when rows alone reach it.
int row_parts(int64_t rows, int64_t items_wanted, int64_t rounds, int64_t max_parts) {
  const int64_t want = (items_wanted + std::max<int64_t>(rows, 1) - 1) / std::max<int64_t>(rows, 1);
  return static_cast<int>(std::max<int64_t>(1, std::min({want, std::max<int64_t>(rounds, 1), max_parts})));
}

// The send's shape, shared by the two-kernel and the fused path: parts to give ~2 (row, part) items
// per warp of 2 CTAs per SM, and as many CTAs as give each of T * k rows' items (about what a rank
// owns) a warp, at most 2 per SM. Sized by this launch's T, not the pool's capacity: sized by T_max,
// a decode step in a large pool would run 2 CTAs per SM that each fence and take a ticket for a few
// rows, and a small pool (T_max = T = 1) would give a quantised wire's 56 items 32 warps (globaltimer
// stamps: the mxfp8 send 7.2 us at 1 token on 2 CTAs).
struct SendShape {
  int ctas, parts;
};
SendShape send_shape(const TransportArgs& args, int64_t sms) {
  const int64_t warps_per_cta = kCombineThreads / 32;
  // rows this rank's tokens have: one per slot, or with the owner reduce one per owner rank touched
  const int64_t per_token = args.layout.params.owner_reduce ? std::min<int64_t>(args.top_k(), args.sig.num_ranks) : args.top_k();
  const int64_t rows = args.num_tokens * per_token;
  SendShape sh;
  // At most 7 parts (a bf16 part of 4 rounds: one step of kCombineLoadRounds at H = 7168), or, for an
  // owner-reduced bf16 row, parts of one kOwnerSendStepRounds step each: its lanes load every slot.
  const int64_t rounds = combine_send_rounds(args.layout.params.combine_format, args.layout.params.hidden);
  const bool owner_bf16 = args.layout.params.owner_reduce && args.layout.params.combine_format == kWsBf16;
  sh.parts = row_parts(rows, 2 * sms * warps_per_cta * 2, rounds,
                       owner_bf16 ? std::max<int64_t>(1, rounds / kOwnerSendStepRounds) : 7);
  sh.ctas = static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>((rows * sh.parts + warps_per_cta - 1) / warps_per_cta, 2 * sms)));
  return sh;
}

// Parts per token of the reduce: ~2048 (token, part) items at small T (decode spreads a token over
// many warps).
int reduce_parts(const TransportArgs& args) {
  return row_parts(args.num_tokens, 2048, combine_reduce_rounds(args.layout.params.combine_format, args.layout.params.hidden), 64);
}

template <int kFormat, typename InT, bool kOwner>
Status launch_fused(const TransportArgs& args, const InT* in, const int32_t* topk_ids, uint16_t* y, int64_t want_ctas,
                    CombineShape shape, bool cooperative, cudaStream_t stream) {
  // Co-residency (see combine_kernel): at most what the SMs hold at once.
  int device = 0, sms = 0;
  MEGAMOE_CUDA_CHECK(cudaGetDevice(&device));
  MEGAMOE_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  static const int per_sm = [] {  // one architecture per process
    int n = 0;
    return cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, combine_kernel<kFormat, InT, kOwner>, kCombineThreads, 0) == cudaSuccess ? n : 1;
  }();
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want_ctas, static_cast<int64_t>(sms) * std::max(per_sm, 1))));
  if (ctas < 2) shape.groups = 1;  // groups need a sending and a reducing CTA
  shape.reducers = shape.groups > 1 ? std::max(1, ctas / 8) : 0;
  // Cooperative: the grid starts only once every CTA has an SM (a kernel on another stream cannot
  // leave some of them waiting for SMs that the others spin on), or is refused. Shared device: plain,
  // want_ctas is within the rank's budget (launch_combine's caller shapes for half of it).
  const cudaError_t err =
      cooperative ? launch_cooperative(combine_kernel<kFormat, InT, kOwner>, ctas, kCombineThreads, stream, use_pdl(args),
                                       args, in, topk_ids, y, shape)
                  : launch_pdl(combine_kernel<kFormat, InT, kOwner>, dim3(static_cast<unsigned>(ctas)),
                               dim3(kCombineThreads), 0, stream, use_pdl(args), args, in, topk_ids, y, shape);
  if (err == cudaErrorCooperativeLaunchTooLarge)
    return Status(StatusCode::kUnavailable,
                  "the one-kernel combine needs its " + std::to_string(ctas) + " CTAs resident at once on cuda:" +
                      std::to_string(device) + ", which cannot hold them (refused rather than risk a deadlock)");
  MEGAMOE_CUDA_CHECK(err);
  return Status::ok();
}

template <typename InT, bool kOwner>
Status fused_as_mode(const TransportArgs& args, const void* out, const int32_t* topk_ids, uint16_t* y, int64_t want_ctas,
                CombineShape shape, bool coop, cudaStream_t stream) {
  const InT* in = static_cast<const InT*>(out);
  switch (args.layout.params.combine_format) {
    case kWsMxfp8: return launch_fused<kWsMxfp8, InT, kOwner>(args, in, topk_ids, y, want_ctas, shape, coop, stream);
    case kWsNvfp4: return launch_fused<kWsNvfp4, InT, kOwner>(args, in, topk_ids, y, want_ctas, shape, coop, stream);
    default: return launch_fused<kWsBf16, InT, kOwner>(args, in, topk_ids, y, want_ctas, shape, coop, stream);
  }
}

template <typename InT>
Status fused_as(const TransportArgs& args, const void* out, const int32_t* topk_ids, uint16_t* y, int64_t want_ctas,
                CombineShape shape, bool coop, cudaStream_t stream) {
  return args.layout.params.owner_reduce ? fused_as_mode<InT, true>(args, out, topk_ids, y, want_ctas, shape, coop, stream)
                                         : fused_as_mode<InT, false>(args, out, topk_ids, y, want_ctas, shape, coop, stream);
}
}  // namespace

Status launch_combine_send(const TransportArgs& args, const void* expert_out, bool out_is_fp32, int num_sms,
                           cudaStream_t stream) {
  const SendShape sh = send_shape(args, std::max(num_sms, 1));
  MEGAMOE_CUDA_CHECK(out_is_fp32 ? send_as<float>(args, expert_out, sh.ctas, sh.parts, stream)
                                 : send_as<uint16_t>(args, expert_out, sh.ctas, sh.parts, stream));
  return Status::ok();
}

Status launch_combine_reduce(const TransportArgs& args, const int32_t* topk_ids, uint16_t* y, int num_sms,
                             cudaStream_t stream) {
  const int64_t sms = std::max(num_sms, 1), T = args.num_tokens, warps_per_cta = kCombineThreads / 32;
  const int parts = reduce_parts(args);
  const int ctas = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((T * parts + warps_per_cta - 1) / warps_per_cta, 2 * sms)));
  MEGAMOE_CUDA_CHECK(args.layout.params.owner_reduce ? reduce_as<true>(args, topk_ids, y, ctas, parts, stream)
                                                     : reduce_as<false>(args, topk_ids, y, ctas, parts, stream));
  return Status::ok();
}

Status launch_combine(const TransportArgs& args, const void* expert_out, bool out_is_fp32, const int32_t* topk_ids,
                      uint16_t* y, int groups, int num_sms, bool cooperative, cudaStream_t stream) {
  const int64_t sms = std::max(num_sms, 1), T = args.num_tokens, warps_per_cta = kCombineThreads / 32;
  CombineShape shape{};
  shape.groups = std::max(1, std::min(groups, kMaxCombineGroups));
  // One group: the send's shape (as launch_combine_send), widened when the reduce wants more CTAs.
  // Groups: every SM twice (senders and reducers).
  const SendShape sh = send_shape(args, sms);
  shape.send_parts = sh.parts;
  shape.reduce_parts = reduce_parts(args);
  const int64_t reduce_ctas = std::min<int64_t>((T * shape.reduce_parts + warps_per_cta - 1) / warps_per_cta, 2 * sms);
  const int64_t want = shape.groups > 1 ? 2 * sms : std::max<int64_t>(sh.ctas, reduce_ctas);
  if (out_is_fp32) return fused_as<float>(args, expert_out, topk_ids, y, want, shape, cooperative, stream);
  return fused_as<uint16_t>(args, expert_out, topk_ids, y, want, shape, cooperative, stream);
}

}  // namespace kernels
}  // namespace megamoe
