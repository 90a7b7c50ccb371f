// gemm_weights.h — weight preparation for the grouped GEMM: w13 reordered for the SwiGLU epilogue, nvfp4
// weights expanded to bf16, and mxfp4 weights laid out for the register-fragment expansion (below).
//
// The FC1 epilogue computes h = silu(gate) * up inside one 256-column tile, so each tile must hold
// 128 gate rows and the 128 up rows of the same intermediate columns. prepare_w13_for_swiglu()
// reorders w13 [E, 2I, K] (rows [0, I) gate, [I, 2I) up, as weights.h defines it) into
//   prepared rows [256 j, 256 j + 128)       = gate rows [128 j, 128 j + 128)
//   prepared rows [256 j + 128, 256 j + 256) = up rows   [I + 128 j, I + 128 j + 128)
// and its 128x128 block scales [E, 2I/128, K/128] the same way (block 2j = gate block j,
// 2j+1 = up block I/128 + j), so every 128-row block keeps exactly one scale per K block.
// Host code; element size is a parameter (1 for e4m3, 2 for bf16); data is moved, never rounded.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace megamoe::gemm {

// src/dst: [E, 2I, K] elements of elem_bytes; intermediate = I (a multiple of 128).
void prepare_w13_for_swiglu(const uint8_t* src, int64_t num_experts, int64_t intermediate, int64_t k,
                            int64_t elem_bytes, uint8_t* dst);
// src/dst: fp32 [E, 2I/128, K/128].
void prepare_w13_scales_for_swiglu(const float* src, int64_t num_experts, int64_t intermediate, int64_t k,
                                   float* dst);
// The prepared row that holds original w13 row r (r in [0, 2I)).
int64_t swiglu_prepared_row(int64_t r, int64_t intermediate);

// ---- nvfp4 weights for the bf16 GEMM (docs/GEMM.md, "nvfp4, the first step") ----
//
// e2m1 code x e4m3 block scale as bf16. Exact: the product has at most 6 significant bits (e2m1 2,
// e4m3 4) and lies in [2^-10, 2688] (0 and the signs aside), inside bf16's 8 significant bits and
// range, so the fp32 product converts without rounding. The per-expert fp32 global scale stays out
// of the result: it is exact in neither bf16 nor e4m3, and the layer applies it in fp32 (FC1's
// accumulators, FC2's row weights). packed [E, N, K/2] (element 2i in the low nibble), scales
// [E, N, K/16] e4m3 -> out [E, N, K] bf16 bits; K a multiple of 16.
void expand_nvfp4_to_bf16(const uint8_t* packed, const uint8_t* scales, int64_t num_experts, int64_t n, int64_t k,
                          uint16_t* out);
// One layer's nvfp4 experts (weights.h's layout: w13 [E, 2I, H] and w2 [E, H, I] packed codes + e4m3
// scales per 1x16) as the bf16 GEMM's weights: both expanded (expand_nvfp4_to_bf16), w13's rows
// then reordered for the SwiGLU epilogue (prepare_w13_for_swiglu). bf16 bits [E, 2I, H] and [E, H, I].
void prepare_nvfp4_expert_bf16(const uint8_t* w13_packed, const uint8_t* w13_scales, const uint8_t* w2_packed,
                               const uint8_t* w2_scales, int64_t num_experts, int64_t hidden, int64_t intermediate,
                               std::vector<uint16_t>* w13_bf16, std::vector<uint16_t>* w2_bf16);

// ---- nvfp4 weights as the grouped GEMM reads them (docs/GEMM.md, "nvfp4 in the pipeline") ----
//
// FP4 stays FP4 in HBM: the math warpgroups expand each e2m1 code times its e4m3 block scale into a bf16
// wgmma A register (fmt::fp4_word_to_bf16x2_pow120, then one bf16 multiply by the scale): exact, the
// values expand_nvfp4_to_bf16 gives. Per expert, K block of 128 and slab of 64 weight rows, one piece of
// kNvfp4SlabBytes:
//   bytes [0, 4096): the codes, two halves of 2048 (half j: k16 steps 4j .. 4j + 3). Thread t of the
//     warpgroup (warp w = t / 32, lane l, q = l % 4, fragment row m0 = 16 w + l / 4) reads 16 bytes at
//     2048 j + 16 t: the words (fmt::pack_fp4_word) {steps 4j, 4j+1 row m0; the same row m0 + 8; steps
//     4j+2, 4j+3 row m0; the same row m0 + 8}. The word of (steps s, s + 1, row r; s even) holds code e of
//     column 16 (s + e / 4) + 2q + (e % 2) + 8 ((e / 2) % 2): its four bf16x2 results are the A registers
//     a0 / a2 (row m0) or a1 / a3 (row m0 + 8) of k16 steps s and s + 1.
//   bytes [4096, 4608): the block scale of each (row, k16 step) [64 rows][8 steps], an e4m3 code with
//     sign 0: a negative scale's sign is folded into its 16 codes (exact), a NaN scale is refused.
// Pieces are ordered [E][K / 128][N / 64]. The per-expert fp32 global scale stays outside the codes (as
// for the bf16 path: FC1's scaled SwiGLU, FC2's row weights); the image starts with them.
constexpr int64_t kNvfp4BlockK = 128;
constexpr int64_t kNvfp4SlabCodeBytes = 4096;
constexpr int64_t kNvfp4SlabBytes = kNvfp4SlabCodeBytes + 64 * 8;

struct Nvfp4GemmWeights {
  int64_t num_experts = 0, n = 0, k = 0;
  std::vector<uint8_t> slabs;         // [E][K/128][N/64][kNvfp4SlabBytes]
  std::vector<float> global_scales;   // [E]
};

// The device image of `w` (what GroupedGemmArgs::b points at for dtype nvfp4): the global scales, zero
// padding to a multiple of 128 bytes, then the pieces.
constexpr int64_t nvfp4_pieces_offset(int64_t num_experts) { return (num_experts * 4 + 127) / 128 * 128; }
std::vector<uint8_t> device_image(const Nvfp4GemmWeights& w);

// packed [E, N, K/2] (element 2i in the low nibble), scales [E, N, K/16] e4m3 and global_scales [E], in
// GEMM row order (w13 reordered for the SwiGLU epilogue already). N a multiple of 64, K of 128. False
// (and *bad = the index of the first such scale) when a block scale is NaN.
bool prepare_nvfp4_for_gemm(const uint8_t* packed, const uint8_t* scales, const float* global_scales,
                            int64_t num_experts, int64_t n, int64_t k, Nvfp4GemmWeights* out, int64_t* bad);

// One layer's nvfp4 experts (weights.h's layout) as the GEMM's two device images: w13's code and scale
// rows reordered for the SwiGLU epilogue, then both through prepare_nvfp4_for_gemm. False with
// *what naming the matrix and the scale index of a NaN block scale.
bool prepare_nvfp4_expert_images(const uint8_t* w13_packed, const uint8_t* w13_scales, const float* w13_global,
                                 const uint8_t* w2_packed, const uint8_t* w2_scales, const float* w2_global,
                                 int64_t num_experts, int64_t hidden, int64_t intermediate,
                                 std::vector<uint8_t>* w13_image, std::vector<uint8_t>* w2_image, std::string* what);

// The bf16 bits the GEMM computes with for element (expert e, row, column) of `w`, read back through
// the fragment layout and the word expansion (what the device does): expand_nvfp4_to_bf16's.
uint16_t nvfp4_gemm_bf16(const Nvfp4GemmWeights& w, int64_t e, int64_t row, int64_t col);

// ---- mxfp4 weights as the grouped GEMM reads them (docs/GEMM.md, "FP4 weights") ----
//
// The math warpgroup expands e2m1 codes straight into wgmma's register A fragments, so the codes are
// stored in the order the fragments take them. Per expert, K block (128) and slab of 64 weight rows,
// one piece of kFp4SlabBytes:
//   bytes [0, 4096): the codes. Thread t of the warpgroup (warp w = t / 32, lane l, q = l % 4, fragment
//     row m0 = 16 w + l / 4) reads 16 bytes at j * 2048 + 16 t for j = 0, 1: the fragment words
//     (fmt::pack_fp4_word) {step 2j row m0, step 2j row m0 + 8, step 2j+1 row m0, step 2j+1 row m0 + 8}.
//     The word of (step s, row r) holds the codes of columns 32 s + 4 q + e (code e, e < 4) and
//     32 s + 16 + 4 q + e - 4 (e >= 4): its fmt::fp4_word_to_e4m3 halves are the A registers a0 / a2
//     (row m0) or a1 / a3 (row m0 + 8) of k32 step s.
//   bytes [4096, 4352): the shift of each (row, step) [64 rows][4 steps] as the byte offset of its
//     8-byte table row: 8 * (d - kMxfp4MinShift), d = fmt::mxfp4_e4m3_shift(code, cmax of the row's
//     128 x 128 block).
// Pieces are ordered [E][K / 128][N / 64], so a tile's BLOCK_N / 64 pieces of one K block are one
// contiguous copy. block_scales [E, N/128, K/128] fp32: fmt::mxfp4_e4m3_block_scale(cmax), applied
// like an fp8-block weight scale.
constexpr int64_t kFp4SlabRows = 64;
constexpr int64_t kFp4SlabCodeBytes = 4096;
constexpr int64_t kFp4SlabBytes = kFp4SlabCodeBytes + kFp4SlabRows * 4;

struct Mxfp4GemmWeights {
  int64_t num_experts = 0, n = 0, k = 0;
  std::vector<uint8_t> slabs;        // [E][K/128][N/64][kFp4SlabBytes]
  std::vector<float> block_scales;   // [E, N/128, K/128]
};

// The device image of `w` (what GroupedGemmArgs::b points at for dtype mxfp4): the block scales, zero
// padding to a multiple of 128 bytes, then the pieces (16-byte aligned for the bulk copies).
constexpr int64_t mxfp4_pieces_offset(int64_t num_experts, int64_t n, int64_t k) {
  return (num_experts * (n / 128) * (k / 128) * 4 + 127) / 128 * 128;
}
std::vector<uint8_t> device_image(const Mxfp4GemmWeights& w);

// packed [E, N, K/2] (element 2i in the low nibble) and scales [E, N, K/32] e8m0, in GEMM row order
// (a w13 reordered for the SwiGLU epilogue already: prepare_w13_for_swiglu on the packed rows and on
// the scale rows). N a multiple of 128, K of 128.
void prepare_mxfp4_for_gemm(const uint8_t* packed, const uint8_t* scales, int64_t num_experts, int64_t n, int64_t k,
                            Mxfp4GemmWeights* out);

// One layer's mxfp4 experts (weights.h's layout: w13 [E, 2I, H] and w2 [E, H, I] packed codes + e8m0
// scales per 1x32) as the GEMM's two device images: w13's code and scale rows reordered for the
// SwiGLU epilogue (prepare_w13_for_swiglu), then both through prepare_mxfp4_for_gemm. I a multiple of
// 128, H of 128.
void prepare_mxfp4_expert_images(const uint8_t* w13_packed, const uint8_t* w13_scales, const uint8_t* w2_packed,
                                 const uint8_t* w2_scales, int64_t num_experts, int64_t hidden, int64_t intermediate,
                                 std::vector<uint8_t>* w13_image, std::vector<uint8_t>* w2_image);

// Where element (expert e, row, column) of `w` lives: the first byte of its fragment word, its code's
// index in the word (fmt::fp4_word_code), and the byte of its shift index.
struct Fp4ElementPlace {
  int64_t word_byte;
  int code;
  int64_t shift_byte;
};
Fp4ElementPlace mxfp4_gemm_place(const Mxfp4GemmWeights& w, int64_t e, int64_t row, int64_t col);

// The e4m3 code the GEMM computes with for that element, read back through the fragment layout and
// the word expansion (what the device does): with the block scale, fmt::mxfp4_to_fp8_128x128's.
uint8_t mxfp4_gemm_e4m3(const Mxfp4GemmWeights& w, int64_t e, int64_t row, int64_t col);

}  // namespace megamoe::gemm
