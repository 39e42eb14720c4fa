// 4-bit and 8-bit weight-only linear layers on AVX512-BF16 CPUs (W4A16 and W8A16
// checkpoints: GPTQ, AWQ, compressed-tensors, GGUF's types): out = x W^T with
// W = (q - 8) * scale + offset (4 bits) or q * scale + offset (8 bits) per group of G
// input features, x and out in bfloat16, float32 accumulation.
//
// Why not ATen's int4 kernel (docs/benchmarks.md, P18): it is compute-bound (one thread
// with the weight in cache streams about 21 GB/s of nibbles; this one 52-57), and its
// time grows row by row, so prefill ran at half bfloat16's rate; this one reuses each
// loaded chunk for up to four rows and, above four rows, each broadcast of x for four
// strips, which brings prefill to the bfloat16 GEMM's rate.
//
// Layout (packed once at load, quantized_checkpoints.py): strips of 16 output columns,
// each strip's whole input contiguous as [K/8][32] 16-bit lanes (64 bytes a chunk of 8
// inputs). Nibble i of lane l of chunk t is the weight of column l / 2 and input
// 8t + 2i + l % 2, so nibble i of the 32 lanes is one `vdpbf16ps` operand (16 columns
// x 2 inputs). One `vpternlogd` turns nibble i into the bfloat16 128 + q, exactly
// ((lane >> 4i) & 0xF | 0x4300): no table, no widening. The group's products are
// summed in float32, then scaled: out += scale * acc + (offset - 136 scale) * sum(x over
// the group), the 128 + 8 the weights carry taken off with the group's sum.
// Scales and offsets: [N/16][K/G][16] float16 (half the bytes of float32: at groups of 32
// they were a third of what a step read; float16's 11 bits are within the bfloat16
// output's rounding).
//
// 8 bits: each strip's input as [K/4][64] bytes, byte b of chunk t the weight of column
// (b % 32) / 2 and input 4t + 2 (b / 32) + b % 2: each 32 bytes one `vdpbf16ps`
// operand, widened to 32-bit integers and converted (exact: q < 256 fits bfloat16's
// 8 bits), which the rows of a tile share. Up to 7 bits (Q5, Q6_K) the same layout
// decodes as 4 bits do: widened to 16 bits and ORed into the bfloat16 128 + q (exact
// below 128), three instructions for 32 weights where 8 bits take seven.
//
// float32 models (AVX2 + FMA + F16C: the CPUs without bfloat16 dot products, where
// models are served in float32): strips of 16 columns and 64-byte chunks as above, other
// lane orders; scales and offsets in float16 where the checkpoint's are exactly float16,
// else float32, and no offsets where all are zero (symmetric formats). 4 bits: a chunk is 16 32-bit lanes, lane c the 8
// nibbles of column c for the chunk's 8 inputs (nibble i: input 8t + i); shifted to bit
// 19, masked and ORed with 1.0f's exponent, nibble i of 8 lanes is 8 exact floats
// 1 + q/16 (three instructions, no conversion); out += 16 scale * acc + (offset - 24
// scale) * sum(x over the group). 8 bits (and 5 to 7): a chunk is 4 inputs x 16 columns,
// byte 16j + c the weight of column c and input 4t + j, widened and converted.
// The kernel is chosen per layer shape at load against ATen's and the dequantized weight.
// Registered as torch.ops.radixserve_cpu_int4.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include <utility>

#if defined(__AVX512BF16__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kStripCols = 16;
constexpr int kTileRows = 4;
constexpr int kWideStrips = 4;

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_INT4_F32 1
#endif

// Whether this build has a kernel for activations of ``dtype`` (bfloat16 or float32).
bool available(at::ScalarType dtype) {
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16) return true;
#endif
#if defined(RADIXSERVE_INT4_F32)


  if (dtype == at::kFloat) return true;
#endif
  return false;
}

#if defined(__AVX512BF16__)

// Rows [0, ROWS) of x (row stride lda) times STRIPS strips (their weights, scales and
// offsets strip_bytes and strip_groups apart): out[r][16 s + c]. One strip at a time
// streams the weight fastest at a few rows; at many rows (prefill) four strips share
// each broadcast of x, which one strip at a time would spend on every dot product.
// A lone strip keeps one accumulator per row and nibble: four independent chains, not
// one four times as long (a dot product's latency is several cycles; at one row it
// would pace the loop); four strips are four chains already.
template <int ROWS, int STRIPS, int BITS>
void tile(const uint16_t* x, int64_t lda, const float* xsum, int64_t groups, const uint8_t* w, int64_t strip_bytes,
          const uint16_t* scales, const uint16_t* offsets, int64_t strip_groups, int64_t group, float out_scale,
          uint16_t* out, int64_t ldc) {
  constexpr int kChains = STRIPS == 1 ? 4 : 1;
  constexpr int kOperands = BITS == 4 ? 4 : 2;  // vdpbf16ps operands (input pairs) a 64-byte chunk
  constexpr float kBias = BITS == 4 ? 136.0f : BITS == 7 ? 128.0f : 0.0f;  // what the weights carry
  constexpr int kInputs = 2 * kOperands;        // inputs a chunk
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);  // bfloat16 128.0: ORed with q < 128, it is 128 + q
  const __m512 bias = _mm512_set1_ps(kBias);
  const int64_t chunks = group / kInputs;                           // 64-byte chunks a group
  __m512 total[ROWS][STRIPS];
  for (int r = 0; r < ROWS; ++r)
    for (int s = 0; s < STRIPS; ++s) total[r][s] = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 acc[ROWS][STRIPS][kChains];
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < STRIPS; ++s)
        for (int c = 0; c < kChains; ++c) acc[r][s][c] = _mm512_setzero_ps();
    const int64_t k0 = g * group;
    for (int64_t t = 0; t < chunks; ++t) {
      __m512i v[STRIPS];
      for (int s = 0; s < STRIPS; ++s) v[s] = _mm512_loadu_si512(w + s * strip_bytes + (g * chunks + t) * 64);
      for (int i = 0; i < kOperands; ++i) {  // inputs kInputs t + 2i and kInputs t + 2i + 1
        __m512bh x_pair[ROWS];
        for (int r = 0; r < ROWS; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * lda + k0 + kInputs * t + 2 * i, sizeof pair);
          x_pair[r] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int s = 0; s < STRIPS; ++s) {
          __m512bh weights;
          if constexpr (BITS == 4) {
            // (a & b) | c in one instruction (imm 0xEA): 32 exact bfloat16 weights, 128 + q
            weights = (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v[s], 4 * i), low4, bf16_128, 0xEA);
          } else if constexpr (BITS == 7) {  // bytes 32i .. 32i + 31 below 128: widened, ORed: 128 + q
            weights = (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(_mm512_extracti64x4_epi64(v[s], i)), bf16_128);
          } else {  // bytes 32i .. 32i + 31: two sets of 16 widened, converted, packed
            const __m512i bytes = v[s];
            const __m128i low = i == 0 ? _mm512_extracti32x4_epi32(bytes, 0) : _mm512_extracti32x4_epi32(bytes, 2);
            const __m128i high = i == 0 ? _mm512_extracti32x4_epi32(bytes, 1) : _mm512_extracti32x4_epi32(bytes, 3);
            weights = _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(high)),
                                          _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(low)));
          }
          for (int r = 0; r < ROWS; ++r)
            acc[r][s][i % kChains] = _mm512_dpbf16_ps(acc[r][s][i % kChains], weights, x_pair[r]);
        }
      }
    }
    for (int s = 0; s < STRIPS; ++s) {
      const __m512 scale = _mm512_cvtph_ps(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + s * strip_groups + g * kStripCols)));
      const __m512 offset = _mm512_fnmadd_ps(
          bias, scale,
          _mm512_cvtph_ps(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(offsets + s * strip_groups + g * kStripCols))));
      for (int r = 0; r < ROWS; ++r) {
        __m512 sum = acc[r][s][0];
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][s][c]);
        total[r][s] = _mm512_fmadd_ps(sum, scale, total[r][s]);
        total[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), offset, total[r][s]);
      }
    }
  }
  const __m512 unscale = _mm512_set1_ps(out_scale);
  for (int r = 0; r < ROWS; ++r)  // round to nearest even
    for (int s = 0; s < STRIPS; ++s)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldc + s * kStripCols),
                          (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(total[r][s], unscale)));
}

using TileFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, const uint16_t*,
                        const uint16_t*, int64_t, int64_t, float, uint16_t*, int64_t);

template <int STRIPS, int BITS>
TileFn tile_for(int rows) {
  switch (rows) {
    case 1: return tile<1, STRIPS, BITS>;
    case 2: return tile<2, STRIPS, BITS>;
    case 3: return tile<3, STRIPS, BITS>;
    default: return tile<4, STRIPS, BITS>;
  }
}

template <int STRIPS>
TileFn tile_for(int rows, int64_t bits) {
  return bits == 4 ? tile_for<STRIPS, 4>(rows) : bits == 7 ? tile_for<STRIPS, 7>(rows) : tile_for<STRIPS, 8>(rows);
}

#endif  // __AVX512BF16__

#if defined(RADIXSERVE_INT4_F32)



// How far ahead of the chunk it reads the float32 path asks for the weights: the
// hardware prefetcher alone left a cold layer at two thirds of the warm rate (EPYC, AVX2).
constexpr int64_t kPrefetchBytes = 4096;

// Nibble I of each 32-bit lane of v as the float 1 + q/16: shifted to bits 19-22 (the
// top of the mantissa), the rest masked off, 1.0f's exponent ORed in.
template <int I>
inline __m256 nibble_as_float(__m256i v) {
  __m256i at19;
  if constexpr (I <= 4) {
    at19 = _mm256_slli_epi32(v, 19 - 4 * I);
  } else {
    at19 = _mm256_srli_epi32(v, 4 * I - 19);
  }
  return _mm256_castsi256_ps(
      _mm256_or_si256(_mm256_and_si256(at19, _mm256_set1_epi32(0xF << 19)), _mm256_set1_epi32(0x3F800000)));
}

// A strip's scales or offsets ([K/G][16]) in float16 or float32, or none (offsets of
// zero): float16 where the checkpoint's figures are exactly float16 (after the layer's
// power of two), so that a float32 model computes with the checkpoint's exact weights.
struct Figures {
  const void* data;
  at::ScalarType dtype;  // kHalf, kFloat, or kUndefined for none

  inline __m256 eight(int64_t index) const {
    if (dtype == at::kHalf) {
      const auto* halves = static_cast<const uint16_t*>(data) + index;
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(halves)));
    }
    if (dtype == at::kFloat) return _mm256_loadu_ps(static_cast<const float*>(data) + index);
    return _mm256_setzero_ps();
  }

  Figures strip(int64_t s, int64_t strip_groups) const {
    const int64_t bytes = dtype == at::kHalf ? 2 : 4;
    return {data == nullptr ? nullptr : static_cast<const char*>(data) + s * strip_groups * bytes, dtype};
  }
};

// Rows [0, ROWS) of x (row stride lda) times one strip of 16 columns: out[r][c], float32.
// Each row keeps CHAINS accumulators per 8 columns, so that one row's dot products are
// not one long dependency chain (an FMA's latency is several cycles).
template <int ROWS, int BITS>
struct FloatTile {
  static constexpr int kChains = ROWS == 1 ? 4 : ROWS == 2 ? 2 : 1;
  __m256 acc[ROWS][2][kChains];

  template <int I>
  inline void nibble(const float* x, int64_t lda, int64_t k, __m256i low, __m256i high) {
    const __m256 w0 = nibble_as_float<I>(low), w1 = nibble_as_float<I>(high);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * lda + k + I);
      acc[r][0][I % kChains] = _mm256_fmadd_ps(w0, xb, acc[r][0][I % kChains]);
      acc[r][1][I % kChains] = _mm256_fmadd_ps(w1, xb, acc[r][1][I % kChains]);
    }
  }

  template <std::size_t... I>
  inline void chunk_of_nibbles(const float* x, int64_t lda, int64_t k, const uint8_t* chunk,
                               std::index_sequence<I...>) {
    const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk));
    const __m256i high = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(chunk + 32));
    (nibble<static_cast<int>(I)>(x, lda, k, low, high), ...);
  }

  inline void chunk_of_bytes(const float* x, int64_t lda, int64_t k, const uint8_t* chunk) {
    for (int j = 0; j < 4; ++j) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(chunk + 16 * j));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
      for (int r = 0; r < ROWS; ++r) {
        const __m256 xb = _mm256_broadcast_ss(x + r * lda + k + j);
        acc[r][0][j % kChains] = _mm256_fmadd_ps(w0, xb, acc[r][0][j % kChains]);
        acc[r][1][j % kChains] = _mm256_fmadd_ps(w1, xb, acc[r][1][j % kChains]);
      }
    }
  }

  static void run(const float* x, int64_t lda, const float* xsum, int64_t groups, const uint8_t* w,
                  Figures scales, Figures offsets, int64_t group, float out_scale, float* out, int64_t ldc) {
    constexpr int kInputs = BITS == 4 ? 8 : 4;          // inputs a 64-byte chunk
    constexpr float kUnit = BITS == 4 ? 16.0f : 1.0f;   // 4 bits: the weights are 1 + q/16 ...
    constexpr float kBias = BITS == 4 ? 24.0f : 0.0f;   // ... for q - 8: 16 + 8 scales a sum of x
    const int64_t chunks = group / kInputs;
    FloatTile tile;
    __m256 total[ROWS][2];
    for (int r = 0; r < ROWS; ++r) total[r][0] = total[r][1] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < 2; ++h)
          for (int c = 0; c < kChains; ++c) tile.acc[r][h][c] = _mm256_setzero_ps();
      for (int64_t t = 0; t < chunks; ++t) {
        const uint8_t* chunk = w + (g * chunks + t) * 64;
        _mm_prefetch(reinterpret_cast<const char*>(chunk + kPrefetchBytes), _MM_HINT_T0);
        const int64_t k = g * group + t * kInputs;
        if constexpr (BITS == 4) {
          tile.chunk_of_nibbles(x, lda, k, chunk, std::make_index_sequence<8>{});
        } else {
          tile.chunk_of_bytes(x, lda, k, chunk);
        }
      }
      for (int h = 0; h < 2; ++h) {
        const __m256 scale = scales.eight(g * kStripCols + 8 * h);
        const __m256 offset = offsets.eight(g * kStripCols + 8 * h);
        const __m256 unit_scale = _mm256_mul_ps(scale, _mm256_set1_ps(kUnit));
        const __m256 sum_scale = _mm256_fnmadd_ps(_mm256_set1_ps(kBias), scale, offset);
        for (int r = 0; r < ROWS; ++r) {
          __m256 sum = tile.acc[r][h][0];
          for (int c = 1; c < kChains; ++c) sum = _mm256_add_ps(sum, tile.acc[r][h][c]);
          total[r][h] = _mm256_fmadd_ps(sum, unit_scale, total[r][h]);
          total[r][h] = _mm256_fmadd_ps(_mm256_set1_ps(xsum[r * groups + g]), sum_scale, total[r][h]);
        }
      }
    }
    const __m256 unscale = _mm256_set1_ps(out_scale);
    for (int r = 0; r < ROWS; ++r)
      for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * ldc + 8 * h, _mm256_mul_ps(total[r][h], unscale));
  }
};

using FloatTileFn = void (*)(const float*, int64_t, const float*, int64_t, const uint8_t*, Figures, Figures, int64_t,
                             float, float*, int64_t);

template <int BITS>
FloatTileFn float_tile_for(int rows) {
  switch (rows) {
    case 1: return FloatTile<1, BITS>::run;
    case 2: return FloatTile<2, BITS>::run;
    case 3: return FloatTile<3, BITS>::run;
    default: return FloatTile<4, BITS>::run;
  }
}

// x [M, K] float32; packed [N/16, K/8, 64] (4 bits) or [N/16, K/4, 64] (5 to 8 bits).
void linear_float(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                  const at::Tensor& offsets, int64_t group, int64_t bits, double out_scale, at::Tensor& out) {
  const int64_t m = x.size(0), k = x.size(1), strips = packed.size(0), groups = k / group;
  const auto* xp = x.data_ptr<float>();
  const int64_t lda = x.stride(0), ldc = out.stride(0);
  std::vector<float> xsum(m * groups, 0.0f);  // each row's sum over each group, for the offsets
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < group; ++i) s += xp[r * lda + g * group + i];
      xsum[r * groups + g] = s;
    }
  const auto* wp = packed.data_ptr<uint8_t>();
  const Figures sp{scales.data_ptr(), scales.scalar_type()};
  const Figures op{offsets.numel() ? offsets.data_ptr() : nullptr,
                   offsets.numel() ? offsets.scalar_type() : at::ScalarType::Undefined};
  auto* outp = out.data_ptr<float>();
  const int64_t strip_bytes = packed.size(1) * 64, strip_groups = groups * kStripCols;
  at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        (bits == 4 ? float_tile_for<4>(rows) : float_tile_for<8>(rows))(
            xp + r0 * lda, lda, xsum.data() + r0 * groups, groups, wp + s * strip_bytes, sp.strip(s, strip_groups),
            op.strip(s, strip_groups), group, static_cast<float>(out_scale), outp + r0 * ldc + s * kStripCols, ldc);
      }
  });
}

#endif  // RADIXSERVE_INT4_F32

// x [M, K] bfloat16 or float32 (unit stride along K); packed [N/16, K/8, 64] (4 bits) or
// [N/16, K/4, 64] (5 to 8 bits) uint8, in the layout of x's dtype; scales and offsets
// [N/16, K/G, 16] float16 (times 1 / out_scale: out is multiplied by it before rounding);
// out [M, N] of x's dtype, contiguous.
void linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
            int64_t group, int64_t bits, double out_scale, at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 7 || bits == 8, "int4 linear: bits must be 4, 7 or 8, not ", bits);
  const int64_t inputs_a_chunk = bits == 4 ? 8 : 4;
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (dtype == at::kBFloat16 || dtype == at::kFloat),
              "int4 linear: x must be 2-D bfloat16 or float32 with unit stride along in features");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.size(2) == 64,
              "int4 linear: the weight must be packed [N/16, K/8 or K/4, 64] uint8");
  const int64_t m = x.size(0), k = x.size(1), strips = packed.size(0), groups = k / group;
  TORCH_CHECK(group % inputs_a_chunk == 0 && k % group == 0 && packed.size(1) * inputs_a_chunk == k,
              "int4 linear: x has ", k, " in features, the weight ", packed.size(1) * inputs_a_chunk,
              " in groups of ", group);
  // float16 figures for bfloat16 x; float16 or float32 for float32 x, whose offsets may be empty (all zero)
  const auto figures_dtype_ok = [&](const at::Tensor& t) {
    return t.scalar_type() == at::kHalf || (dtype == at::kFloat && t.scalar_type() == at::kFloat);
  };
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK((t == &offsets && dtype == at::kFloat && t->numel() == 0) ||
                    (t->is_contiguous() && figures_dtype_ok(*t) && t->dim() == 3 && t->size(0) == strips &&
                     t->size(1) == groups && t->size(2) == kStripCols),
                "int4 linear: scales and offsets must be [N/16, K/G, 16] float16 (or float32, and offsets empty, "
                "for float32 x)");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == dtype && out.size(0) == m &&
                  out.size(1) == strips * kStripCols,
              "int4 linear: out must be contiguous [M, N] of x's dtype");
  TORCH_CHECK(available(dtype), "radixserve_cpu_int4.linear: this build has no kernel for ", dtype,
              " (bfloat16 needs AVX512-BF16; float32 AVX2, FMA and F16C)");
  if (m == 0) return;
#if defined(RADIXSERVE_INT4_F32)


  if (dtype == at::kFloat) {
    linear_float(x, packed, scales, offsets, group, bits, out_scale, out);
    return;
  }
#endif
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const int64_t lda = x.stride(0), ldc = out.stride(0);
  // Each row's sum over each group, for the offsets: [M, K/G] float32.
  std::vector<float> xsum(m * groups, 0.0f);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t g = 0; g < groups; ++g) {
      float s = 0.0f;
      for (int64_t i = 0; i < group; ++i) {
        const uint32_t bits = static_cast<uint32_t>(xp[r * lda + g * group + i]) << 16;
        float value;
        std::memcpy(&value, &bits, sizeof value);
        s += value;
      }
      xsum[r * groups + g] = s;
    }
  const auto* wp = packed.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr());
  const auto* op = reinterpret_cast<const uint16_t*>(offsets.data_ptr());
  auto* outp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t strip_bytes = packed.size(1) * 64, strip_groups = groups * kStripCols;  // 16 columns x K weights
  // More rows than one tile: four strips at a time, the rest one at a time.
  const int64_t per_task = m > kTileRows ? kWideStrips : 1;
  at::parallel_for(0, (strips + per_task - 1) / per_task, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t first = t * per_task, last = std::min(strips, first + per_task);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        const bool wide = last - first == kWideStrips;
        for (int64_t s = first; s < last; s += wide ? kWideStrips : 1)
          (wide ? tile_for<kWideStrips>(rows, bits) : tile_for<1>(rows, bits))(
              xp + r0 * lda, lda, xsum.data() + r0 * groups, groups, wp + s * strip_bytes, strip_bytes,
              sp + s * strip_groups, op + s * strip_groups, strip_groups, group, static_cast<float>(out_scale),
              outp + r0 * ldc + s * kStripCols, ldc);
      }
    }
  });
#endif
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_int4, m) {
  m.def("available(ScalarType dtype) -> bool", &available);
  m.def(
      "linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int bits, float out_scale, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_int4, CPU, m) { m.impl("linear", &linear); }
