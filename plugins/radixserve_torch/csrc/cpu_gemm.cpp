// bfloat16 linear layers on CPUs with AVX512-BF16: out = x W^T (+ bias), float32
// accumulation, one rounding to bfloat16 at the end.
//
// Why not oneDNN: on the decode batches of a serving step (1-128 rows) every weight
// comes from DRAM once per step, and oneDNN's product on a packed weight reaches
// only about half the memory bandwidth at 1-8 rows and 55-70% of the large-matmul
// rate at 32-64 rows on such cold weights (docs/benchmarks.md, P5). Here each thread
// streams its share of the weight exactly once per call, in the order it is stored,
// and uses every weight vector for up to six rows of x before it moves on.
//
// The weight is packed once at load time (pack_weight): strips of 16 output
// columns, each strip [K/2][16][2], so one 64-byte load holds, for 16 columns, the
// two weights that multiply one pair of x values; `vdpbf16ps` with that pair
// broadcast accumulates both products into the 16 float32 column sums. A register
// tile is up to 6 rows x 4 strips (24 accumulators); threads split the strips.
// Registered as torch.ops.radixserve_cpu_gemm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kStripCols = 16;
constexpr int kTileRows = 6;
constexpr int kTileStrips = 4;

bool compiled_with_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// [N, K] row-major -> [N/16, K/2, 16, 2]: element (strip s, pair p, column c, half h)
// is W[16 s + c][2 p + h].
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16, "pack_weight: a 2-D bfloat16 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kStripCols == 0 && k % 2 == 0, "pack_weight: out features a multiple of 16, in features even");
  return weight.contiguous().view({n / kStripCols, kStripCols, k / 2, 2}).permute({0, 2, 1, 3}).contiguous();
}

#if defined(__AVX512BF16__)

inline __m512bh broadcast_pair(const uint16_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return (__m512bh)_mm512_set1_epi32(v);
}

inline __m512 load_bias(const uint16_t* bias) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

// Rows [0, ROWS) of x (row stride lda) times strips [0, STRIPS) of the packed
// weight (strip stride `strip_stride` elements), over all `pairs` pairs of K.
template <int ROWS, int STRIPS>
void tile(const uint16_t* x, int64_t lda, const uint16_t* w, int64_t strip_stride, int64_t pairs,
          const uint16_t* bias, uint16_t* out, int64_t ldc, const uint16_t* prefetch) {
  __m512 acc[ROWS][STRIPS];
  for (int r = 0; r < ROWS; ++r)
    for (int s = 0; s < STRIPS; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t p = 0; p < pairs; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * 2 * kStripCols), _MM_HINT_T1);
    __m512bh b[STRIPS];
    for (int s = 0; s < STRIPS; ++s)
      b[s] = (__m512bh)_mm512_loadu_si512(w + s * strip_stride + p * 2 * kStripCols);
    for (int r = 0; r < ROWS; ++r) {
      const __m512bh a = broadcast_pair(x + r * lda + 2 * p);
      for (int s = 0; s < STRIPS; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], a, b[s]);
    }
  }
  for (int s = 0; s < STRIPS; ++s) {
    const __m512 bv = bias != nullptr ? load_bias(bias + s * kStripCols) : _mm512_setzero_ps();
    for (int r = 0; r < ROWS; ++r) {
      const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][s], bv));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + r * ldc + s * kStripCols), (__m256i)rounded);
    }
  }
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, int64_t, const uint16_t*, uint16_t*,
                        int64_t, const uint16_t*);

template <int ROWS>
constexpr TileFn tile_for_strips(int strips) {
  return strips == 1 ? tile<ROWS, 1> : strips == 2 ? tile<ROWS, 2> : strips == 3 ? tile<ROWS, 3> : tile<ROWS, 4>;
}

TileFn tile_for(int rows, int strips) {
  switch (rows) {
    case 1: return tile_for_strips<1>(strips);
    case 2: return tile_for_strips<2>(strips);
    case 3: return tile_for_strips<3>(strips);
    case 4: return tile_for_strips<4>(strips);
    case 5: return tile_for_strips<5>(strips);
    default: return tile_for_strips<6>(strips);
  }
}

#endif  // __AVX512BF16__

// x [M, K] (unit stride along K), packed [N/16, K/2, 16, 2], bias [N] or none,
// out [M, N] contiguous.
void linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
#if defined(__AVX512BF16__)
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "linear: x must be 2-D with unit stride along in features");
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 && packed.scalar_type() == at::kBFloat16 &&
                  out.scalar_type() == at::kBFloat16, "linear: bfloat16 only");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kStripCols && packed.size(3) == 2,
              "linear: the weight must come from pack_weight");
  const int64_t m = x.size(0), k = x.size(1), strips = packed.size(0), pairs = packed.size(1);
  TORCH_CHECK(2 * pairs == k, "linear: x has ", k, " in features, the weight ", 2 * pairs);
  TORCH_CHECK(out.is_contiguous() && out.size(0) == m && out.size(1) == strips * kStripCols, "linear: out shape");
  const uint16_t* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kBFloat16 && bias->is_contiguous() && bias->numel() == strips * kStripCols,
                "linear: bias must be a contiguous bfloat16 [out features]");
    bias_ptr = reinterpret_cast<const uint16_t*>(bias->data_ptr());
  }
  if (m == 0) return;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t lda = x.stride(0), ldc = out.stride(0), strip_stride = pairs * 2 * kStripCols;
  const int64_t groups = (strips + kTileStrips - 1) / kTileStrips;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t s0 = g * kTileStrips;
      const int ns = static_cast<int>(std::min<int64_t>(kTileStrips, strips - s0));
      const int64_t next_strips = g + 1 < g1 ? std::min<int64_t>(kTileStrips, strips - s0 - kTileStrips) : 0;
      const uint16_t* w = wp + s0 * strip_stride;
      const uint16_t* b = bias_ptr != nullptr ? bias_ptr + s0 * kStripCols : nullptr;
      for (int64_t r0 = 0, t = 0; r0 < m; r0 += kTileRows, ++t) {
        const int nr = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
        // While this group's weight is reused from L2, tile t pulls strip t of the next group there.
        const uint16_t* prefetch = t < next_strips ? w + (kTileStrips + t) * strip_stride : w;
        tile_for(nr, ns)(xp + r0 * lda, lda, w, strip_stride, pairs, b, op + r0 * ldc + s0 * kStripCols, ldc,
                         prefetch);
      }
    }
  });
#else
  TORCH_CHECK(false, "radixserve_cpu_gemm.linear: built without AVX512-BF16");
#endif
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_gemm, m) {
  m.def("supported() -> bool", &compiled_with_avx512_bf16);
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_gemm, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("linear", &linear);
}
