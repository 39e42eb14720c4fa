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
// The kernel is chosen per layer shape at load against ATen's and the dequantized weight.
// Registered as torch.ops.radixserve_cpu_int4.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kStripCols = 16;
constexpr int kTileRows = 4;
constexpr int kWideStrips = 4;

bool available() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
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

// x [M, K] bfloat16 (unit stride along K); packed [N/16, K/8, 64] (4 bits) or
// [N/16, K/4, 64] (8 bits) uint8; scales and offsets [N/16, K/G, 16] float16 (times
// 1 / out_scale: out is multiplied by it before rounding); out [M, N] bfloat16, contiguous.
void linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
            int64_t group, int64_t bits, double out_scale, at::Tensor& out) {
  TORCH_CHECK(bits == 4 || bits == 7 || bits == 8, "int4 linear: bits must be 4, 7 or 8, not ", bits);
  const int64_t inputs_a_chunk = bits == 4 ? 8 : 4;
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "int4 linear: x must be 2-D bfloat16 with unit stride along in features");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.size(2) == 64,
              "int4 linear: the weight must be packed [N/16, K/8 or K/4, 64] uint8");
  const int64_t m = x.size(0), k = x.size(1), strips = packed.size(0), groups = k / group;
  TORCH_CHECK(group % inputs_a_chunk == 0 && k % group == 0 && packed.size(1) * inputs_a_chunk == k,
              "int4 linear: x has ", k, " in features, the weight ", packed.size(1) * inputs_a_chunk,
              " in groups of ", group);
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kHalf && t->dim() == 3 && t->size(0) == strips &&
                    t->size(1) == groups && t->size(2) == kStripCols,
                "int4 linear: scales and offsets must be [N/16, K/G, 16] float16");
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == at::kBFloat16 && out.size(0) == m &&
                  out.size(1) == strips * kStripCols,
              "int4 linear: out must be contiguous [M, N] bfloat16");
  if (m == 0) return;
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
#else
  TORCH_CHECK(false, "radixserve_cpu_int4.linear: this build has no kernel (it needs AVX512-BF16)");
#endif
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_int4, m) {
  m.def("available() -> bool", &available);
  m.def(
      "linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, int bits, float out_scale, "
      "Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_int4, CPU, m) { m.impl("linear", &linear); }
