// 4-bit weight-only linear layers on AVX512-BF16 CPUs (W4A16 checkpoints: GPTQ, AWQ,
// compressed-tensors): out = x W^T with W = (q - 8) * scale + offset per group of G
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
// summed in float32, then scaled: out += scale * acc + offset * sum(x over the group),
// where the packer folded the 128 + 8 into the offset (offset - 136 scale).
// Scales and offsets: [N/16][K/G][16] float32.
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
template <int ROWS, int STRIPS>
void tile(const uint16_t* x, int64_t lda, const float* xsum, int64_t groups, const uint8_t* w, int64_t strip_bytes,
          const float* scales, const float* offsets, int64_t strip_groups, int64_t group, uint16_t* out,
          int64_t ldc) {
  constexpr int kChains = STRIPS == 1 ? 4 : 1;
  const __m512i low4 = _mm512_set1_epi16(0x000F);
  const __m512i bf16_128 = _mm512_set1_epi16(0x4300);  // bfloat16 128.0: ORed with q < 128, it is 128 + q
  const int64_t chunks = group / 8;                     // 64-byte chunks a group
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
      for (int i = 0; i < 4; ++i) {  // nibble i: inputs 8t + 2i and 8t + 2i + 1
        __m512bh x_pair[ROWS];
        for (int r = 0; r < ROWS; ++r) {
          int32_t pair;
          std::memcpy(&pair, x + r * lda + k0 + 8 * t + 2 * i, sizeof pair);
          x_pair[r] = (__m512bh)_mm512_set1_epi32(pair);
        }
        for (int s = 0; s < STRIPS; ++s) {
          // (a & b) | c in one instruction (imm 0xEA): 32 exact bfloat16 weights, 128 + q
          const __m512bh weights =
              (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi16(v[s], 4 * i), low4, bf16_128, 0xEA);
          for (int r = 0; r < ROWS; ++r)
            acc[r][s][i % kChains] = _mm512_dpbf16_ps(acc[r][s][i % kChains], weights, x_pair[r]);
        }
      }
    }
    for (int s = 0; s < STRIPS; ++s) {
      const __m512 scale = _mm512_loadu_ps(scales + s * strip_groups + g * kStripCols);
      const __m512 offset = _mm512_loadu_ps(offsets + s * strip_groups + g * kStripCols);
      for (int r = 0; r < ROWS; ++r) {
        __m512 sum = acc[r][s][0];
        for (int c = 1; c < kChains; ++c) sum = _mm512_add_ps(sum, acc[r][s][c]);
        total[r][s] = _mm512_fmadd_ps(sum, scale, total[r][s]);
        total[r][s] = _mm512_fmadd_ps(_mm512_set1_ps(xsum[r * groups + g]), offset, total[r][s]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r)  // round to nearest even
    for (int s = 0; s < STRIPS; ++s)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldc + s * kStripCols),
                          (__m256i)_mm512_cvtneps_pbh(total[r][s]));
}

using TileFn = void (*)(const uint16_t*, int64_t, const float*, int64_t, const uint8_t*, int64_t, const float*,
                        const float*, int64_t, int64_t, uint16_t*, int64_t);

template <int STRIPS>
TileFn tile_for(int rows) {
  switch (rows) {
    case 1: return tile<1, STRIPS>;
    case 2: return tile<2, STRIPS>;
    case 3: return tile<3, STRIPS>;
    default: return tile<4, STRIPS>;
  }
}

#endif  // __AVX512BF16__

// x [M, K] bfloat16 (unit stride along K); packed [N/16, K/8, 64] uint8; scales and
// offsets [N/16, K/G, 16] float32; out [M, N] bfloat16, contiguous.
void linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& offsets,
            int64_t group, at::Tensor& out) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && x.scalar_type() == at::kBFloat16,
              "int4 linear: x must be 2-D bfloat16 with unit stride along in features");
  TORCH_CHECK(packed.dim() == 3 && packed.is_contiguous() && packed.scalar_type() == at::kByte && packed.size(2) == 64,
              "int4 linear: the weight must be packed [N/16, K/8, 64] uint8");
  const int64_t m = x.size(0), k = x.size(1), strips = packed.size(0), groups = k / group;
  TORCH_CHECK(group % 8 == 0 && k % group == 0 && packed.size(1) * 8 == k, "int4 linear: x has ", k,
              " in features, the weight ", packed.size(1) * 8, " in groups of ", group);
  for (const at::Tensor* t : {&scales, &offsets})
    TORCH_CHECK(t->is_contiguous() && t->scalar_type() == at::kFloat && t->dim() == 3 && t->size(0) == strips &&
                    t->size(1) == groups && t->size(2) == kStripCols,
                "int4 linear: scales and offsets must be [N/16, K/G, 16] float32");
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
  const float* sp = scales.data_ptr<float>();
  const float* op = offsets.data_ptr<float>();
  auto* outp = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t strip_bytes = packed.size(1) * 64, strip_groups = groups * kStripCols;  // 16 columns x K nibbles
  // More rows than one tile: four strips at a time, the rest one at a time.
  const int64_t per_task = m > kTileRows ? kWideStrips : 1;
  at::parallel_for(0, (strips + per_task - 1) / per_task, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t first = t * per_task, last = std::min(strips, first + per_task);
      for (int64_t r0 = 0; r0 < m; r0 += kTileRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        const bool wide = last - first == kWideStrips;
        for (int64_t s = first; s < last; s += wide ? kWideStrips : 1)
          (wide ? tile_for<kWideStrips>(rows) : tile_for<1>(rows))(
              xp + r0 * lda, lda, xsum.data() + r0 * groups, groups, wp + s * strip_bytes, strip_bytes,
              sp + s * strip_groups, op + s * strip_groups, strip_groups, group, outp + r0 * ldc + s * kStripCols, ldc);
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
  m.def("linear(Tensor x, Tensor packed, Tensor scales, Tensor offsets, int group, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_int4, CPU, m) { m.impl("linear", &linear); }
