// Linear layers on AVX-512 CPUs: out = x W^T (+ bias) in bfloat16 (with
// AVX512-BF16) or float32, float32 accumulation, one rounding at the end; and in
// float32 on AVX2 CPUs (with FMA and F16C), whose weights may be packed in bfloat16 or
// float16 where that holds them exactly (linear_avx2, below).
//
// Why not oneDNN: on the decode batches of a serving step (1-128 rows) every weight
// comes from DRAM once per step, and oneDNN's product on a packed weight reaches
// only about half the memory bandwidth at 1-8 rows and 55-70% of the large-matmul
// rate at 32-64 rows on such cold weights (docs/benchmarks.md, P5). Here each thread
// streams its share of the weight exactly once per call, in the order it is stored,
// and uses every weight vector for up to six rows of x before it moves on.
//
// The weight is packed once at load time (pack_weight) into strips of 16 output
// columns, each strip [K/G][16][G]: one 64-byte load holds, for 16 columns, the G
// weights that multiply one group of G x values. bfloat16: G = 2, and `vdpbf16ps`
// with the pair of x values broadcast accumulates both products into the 16 float32
// column sums; float32: G = 1 and an FMA. A register tile is up to 6 rows x 4 strips
// (24 accumulators); threads split the strips; while a tile reuses its strips from
// L2, it prefetches the next tile's strips there.
//
// linear_silu_and_mul serves an MLP's fused gate/up projection (gate rows, then up
// rows): a tile takes up to two gate strips and their up strips, and its epilogue
// writes silu(gate) * up, so the projection (twice the result's width, tens of MB
// at prefill sizes) is never written and read back by a separate op.
//
// With AMX (a build for a CPU with AMX-BF16, enabled at load time: set_amx), bfloat16
// products of kAmxMinRows rows or more run on tile instructions instead: the same
// packed strips are AMX's B operand as they lie (a strip's 16 steps of 16 columns x 2
// are one 16 x 64-byte tile), and a 32-row x 2-strip block keeps its four float32 sums
// in tiles over all of K (amx_linear, below).
// Registered as torch.ops.radixserve_cpu_gemm.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "cpu_amx.h"
#include "cpu_paged_common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define RADIXSERVE_GEMM_AVX2 1
#endif

#if defined(__AVX512F__) || defined(RADIXSERVE_GEMM_AVX2)
#include <immintrin.h>
#endif

namespace {

using radixserve_cpu_paged::round_to;
using radixserve_cpu_paged::silu_mul;

constexpr int64_t kStripCols = 16;
constexpr int kTileRows = 6;
constexpr int kTileStrips = 4;

int64_t group_size(at::ScalarType dtype) { return dtype == at::kBFloat16 ? 2 : 1; }

// The dtypes this build has a kernel for (the ISA it was compiled for, -march=native).
std::vector<std::string> dtypes() {
  std::vector<std::string> out;
#if defined(__AVX512F__) || defined(RADIXSERVE_GEMM_AVX2)
  out.push_back("float32");
#endif
#if defined(__AVX512BF16__)
  out.push_back("bfloat16");
#endif
  return out;
}

// [N, K] row-major -> [N/16, K/G, 16, G]: element (strip s, group p, column c, j)
// is W[16 s + c][G p + j].
at::Tensor pack_weight(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && (weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat),
              "pack_weight: a 2-D bfloat16 or float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1), g = group_size(weight.scalar_type());
  TORCH_CHECK(n % kStripCols == 0 && k % g == 0, "pack_weight: out features a multiple of 16",
              g == 2 ? ", in features even" : "");
  return weight.contiguous().view({n / kStripCols, kStripCols, k / g, g}).permute({0, 2, 1, 3}).contiguous();
}

// A tile's strips (w) and their biases (b, unless null): up to kTileStrips, or in
// GATED half as many gate strips, each with the up strip `cols` strips further on.
template <typename T, typename B, bool GATED>
int strips_of_group(const T* wp, const B* bias, int64_t first, int64_t cols, int64_t strip_stride,
                    const T** w, const B** b) {
  constexpr int64_t per_group = GATED ? kTileStrips / 2 : kTileStrips;
  const int n = static_cast<int>(std::min<int64_t>(per_group, cols - first));
  for (int i = 0; i < n; ++i)
    for (int half = 0; half < (GATED ? 2 : 1); ++half) {
      const int64_t strip = first + i + half * cols;
      w[i + half * n] = wp + strip * strip_stride;
      if (b != nullptr) b[i + half * n] = bias != nullptr ? bias + strip * kStripCols : nullptr;
    }
  return GATED ? 2 * n : n;
}

// One thread's group of strips: the tile's strips w with their biases b (ns of them),
// the strips the thread's next group will read (next_strips of them: prefetched to L2
// while this group's are reused), and the group's first output column.
template <typename T, typename B>
struct StripGroup {
  const T* w[kTileStrips];
  const B* b[kTileStrips];
  const T* next[kTileStrips];
  int ns, next_strips;
  int64_t first_col;
};

// Splits the packed weight's output columns into groups of up to kTileStrips strips (gated:
// half as many gate strips, each with its up strip), spreads the groups over the threads
// and calls body(group) for each, in order within a thread.
template <typename T, typename B, bool GATED, typename Body>
void for_each_group(const T* wp, const B* bias, int64_t strips, int64_t strip_stride, const Body& body) {
  const int64_t cols = GATED ? strips / 2 : strips;  // strips that give output columns
  const int64_t per_group = GATED ? kTileStrips / 2 : kTileStrips;
  const int64_t groups = (cols + per_group - 1) / per_group;
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      StripGroup<T, B> group;
      group.ns = strips_of_group<T, B, GATED>(wp, bias, g * per_group, cols, strip_stride, group.w, group.b);
      group.next_strips = g + 1 < g1 ? strips_of_group<T, B, GATED>(wp, nullptr, (g + 1) * per_group, cols,
                                                                    strip_stride, group.next, nullptr)
                                     : 0;
      group.first_col = g * per_group * kStripCols;
      body(group);
    }
  });
}

#if defined(__AVX512F__)

struct Float32 {
  using T = float;
  using Model = float;
  using Vec = __m512;
  static constexpr int64_t kGroup = 1;
  static Vec load_w(const T* p) { return _mm512_loadu_ps(p); }
  static Vec broadcast_x(const T* p) { return _mm512_set1_ps(*p); }
  static __m512 fma(__m512 acc, Vec x, Vec w) { return _mm512_fmadd_ps(x, w, acc); }
  static __m512 load16(const T* p) { return _mm512_loadu_ps(p); }
  static void store16(T* p, __m512 v) { _mm512_storeu_ps(p, v); }
};

#if defined(__AVX512BF16__)
struct BFloat16 {
  using T = uint16_t;
  using Model = c10::BFloat16;
  using Vec = __m512bh;
  static constexpr int64_t kGroup = 2;
  static Vec load_w(const T* p) { return (__m512bh)_mm512_loadu_si512(p); }
  static Vec broadcast_x(const T* p) {
    int32_t v;
    std::memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32(v);
  }
  static __m512 fma(__m512 acc, Vec x, Vec w) { return _mm512_dpbf16_ps(acc, x, w); }
  static __m512 load16(const T* p) {
    const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
  }
  static void store16(T* p, __m512 v) {  // round to nearest even
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
  }
};
#endif

// Rows [0, ROWS) of x (row stride lda) times the STRIPS packed strips at w[0..STRIPS),
// over all `steps` groups of K; bias[s] is strip s's bias (16 values) or null.
// Plain: strip s goes to out columns [16 s, 16 s + 16). GATED: the first half of the
// strips are gate columns and the second half the matching up columns, and gate
// strip s gets silu(gate) * up in out columns [16 s, 16 s + 16), each rounded as the
// separate linear and silu_and_mul would round it.
template <typename E, int ROWS, int STRIPS, bool GATED>
void tile(const typename E::T* x, int64_t lda, const typename E::T* const* w, int64_t steps,
          const typename E::T* const* bias, typename E::T* out, int64_t ldc, const typename E::T* prefetch) {
  constexpr int64_t step_len = E::kGroup * kStripCols;  // elements of one strip per step: 64 bytes
  __m512 acc[ROWS][STRIPS];
  for (int r = 0; r < ROWS; ++r)
    for (int s = 0; s < STRIPS; ++s) acc[r][s] = _mm512_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * step_len), _MM_HINT_T1);
    typename E::Vec b[STRIPS];
    for (int s = 0; s < STRIPS; ++s) b[s] = E::load_w(w[s] + p * step_len);
    for (int r = 0; r < ROWS; ++r) {
      const typename E::Vec a = E::broadcast_x(x + r * lda + E::kGroup * p);
      for (int s = 0; s < STRIPS; ++s) acc[r][s] = E::fma(acc[r][s], a, b[s]);
    }
  }
  __m512 bv[STRIPS];
  for (int s = 0; s < STRIPS; ++s) bv[s] = bias[s] != nullptr ? E::load16(bias[s]) : _mm512_setzero_ps();
  if constexpr (GATED) {
    constexpr int kGates = STRIPS / 2;
    using M = typename E::Model;
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < kGates; ++s) {
        alignas(64) float gate[kStripCols], up[kStripCols];
        _mm512_store_ps(gate, _mm512_add_ps(acc[r][s], bv[s]));
        _mm512_store_ps(up, _mm512_add_ps(acc[r][kGates + s], bv[kGates + s]));
        M* o = reinterpret_cast<M*>(out + r * ldc + s * kStripCols);
#pragma omp simd
        for (int c = 0; c < kStripCols; ++c) o[c] = silu_mul<M>(round_to<M>(gate[c]), round_to<M>(up[c]));
      }
  } else {
    for (int s = 0; s < STRIPS; ++s)
      for (int r = 0; r < ROWS; ++r) E::store16(out + r * ldc + s * kStripCols, _mm512_add_ps(acc[r][s], bv[s]));
  }
}

template <typename E>
using TileFn = void (*)(const typename E::T*, int64_t, const typename E::T* const*, int64_t,
                        const typename E::T* const*, typename E::T*, int64_t, const typename E::T*);

template <typename E, int ROWS, bool GATED>
TileFn<E> tile_for_strips(int strips) {
  if constexpr (GATED) return strips == 2 ? tile<E, ROWS, 2, true> : tile<E, ROWS, 4, true>;
  return strips == 1 ? tile<E, ROWS, 1, false> : strips == 2 ? tile<E, ROWS, 2, false>
                     : strips == 3 ? tile<E, ROWS, 3, false> : tile<E, ROWS, 4, false>;
}

template <typename E, bool GATED>
TileFn<E> tile_for(int rows, int strips) {
  switch (rows) {
    case 1: return tile_for_strips<E, 1, GATED>(strips);
    case 2: return tile_for_strips<E, 2, GATED>(strips);
    case 3: return tile_for_strips<E, 3, GATED>(strips);
    case 4: return tile_for_strips<E, 4, GATED>(strips);
    case 5: return tile_for_strips<E, 5, GATED>(strips);
    default: return tile_for_strips<E, 6, GATED>(strips);
  }
}

template <typename E, bool GATED>
void linear_impl(const at::Tensor& x, const at::Tensor& packed, const typename E::T* bias, at::Tensor& out) {
  using T = typename E::T;
  const int64_t m = x.size(0), strips = packed.size(0), steps = packed.size(1);
  const auto* xp = reinterpret_cast<const T*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const T*>(packed.data_ptr());
  auto* op = reinterpret_cast<T*>(out.data_ptr());
  const int64_t lda = x.stride(0), ldc = out.stride(0), strip_stride = steps * E::kGroup * kStripCols;
  for_each_group<T, T, GATED>(wp, bias, strips, strip_stride, [&](const StripGroup<T, T>& group) {
    for (int64_t r0 = 0, t = 0; r0 < m; r0 += kTileRows, ++t) {
      const int nr = static_cast<int>(std::min<int64_t>(kTileRows, m - r0));
      // While this group's weight is reused from L2, tile t pulls strip t of the next group there.
      const T* prefetch = t < group.next_strips ? group.next[t] : group.w[0];
      tile_for<E, GATED>(nr, group.ns)(xp + r0 * lda, lda, group.w, steps, group.b, op + r0 * ldc + group.first_col,
                                       ldc, prefetch);
    }
  });
}

#endif  // __AVX512F__

#if defined(RADIXSERVE_AMX)

// AMX bfloat16 products. A tile is 16 rows of 64 bytes; tdpbf16ps multiplies a 16 x 32
// bfloat16 tile of x (16 rows, 32 in features) by a 16 x (16 x 2) tile of packed weight
// (16 in-feature pairs of 16 columns: 16 steps of a strip, contiguous) into a 16 x 16
// float32 tile. A block is 32 rows x 2 strips: tiles 0-3 the sums (rows 0-15 / 16-31 x
// strip 0 / 1), 4-5 the two row halves of x, 6-7 the two strips' weights; each pair of
// weight loads feeds four products.
namespace amx {

using radixserve_amx::configure_tiles;

constexpr int64_t kBlockRows = 32;
constexpr int64_t kStepK = 32;                        // in features per tile product
constexpr int64_t kTileElems = kBlockRows * kStepK;  // one step of a block's rows of x: two tiles
// From this many rows a product takes the tiles (docs/benchmarks.md, P17: below it the
// AVX-512 tiles, which stream the weight once for up to 6 rows at a time, are as fast
// or faster; from 16 rows the tiles are 2-7x faster).
constexpr int64_t kMinRows = 12;
// A thread copies a chunk of rows of x into tile order, as many as fit kChunkBytes
// (in L2 beside the weight; up to kMaxChunkRows), and multiplies them by each of its
// pairs of strips in turn, kChunkK in features at a time; the blocks' sums wait in L1
// between the pieces of K. Each chunk reads the thread's share of the weight again, so
// the chunk is as large as L2 allows (at 1,024 rows and K 1,024: 256-row chunks ran
// 1.05x as fast as 128-row ones; 512 rows at K 2,816, 1.4 MiB, 0.7x). Pieces of K of
// 256 and 512 in features, which keep a pair's piece in L1, ran no faster.
constexpr int64_t kChunkBytes = 768 << 10;
constexpr int64_t kMaxChunkRows = 256;
constexpr int64_t kChunkK = 1024;

// The first `rows` rows of x (row stride lda, k in features) in tile order, zeros past
// the last row: block b's step s is at dst + (b * k / 32 + s) * kTileElems, 32 rows of
// 32 in features (64 bytes each), so that every tile load reads 1 KiB in a row. Loaded
// from x itself, a tile's 16 rows lie K * 2 bytes apart, a power of two for most
// models, and map to the same few L1 sets.
void pack_rows(const uint16_t* x, int64_t lda, int64_t rows, int64_t k, uint16_t* dst) {
  const int64_t steps = k / kStepK, blocks = (rows + kBlockRows - 1) / kBlockRows;
  for (int64_t b = 0; b < blocks; ++b)
    for (int64_t r = 0; r < kBlockRows; ++r) {
      const int64_t row = b * kBlockRows + r;
      uint16_t* out = dst + b * steps * kTileElems + r * kStepK;
      if (row >= rows) {
        for (int64_t st = 0; st < steps; ++st) std::memset(out + st * kTileElems, 0, kStepK * sizeof(uint16_t));
        continue;
      }
      const uint16_t* in = x + row * lda;
      for (int64_t st = 0; st < steps; ++st)
        _mm512_storeu_si512(out + st * kTileElems, _mm512_loadu_si512(in + st * kStepK));
    }
}

// A block's rows (packed by pack_rows: a) times strips w0 and w1 (w1 null: one strip)
// over in features [k0, k1), added to the sums in c (resume) or to zero, which are left
// in c: [32 rows][32 columns] float32, strip 0 in columns 0-15.
void block(const uint16_t* a, const uint16_t* w0, const uint16_t* w1, int64_t k0, int64_t k1, bool resume, float* c) {
  constexpr int64_t kRow = 64;  // bytes of a tile row: 32 bfloat16 of x, or one step of a strip
  constexpr int64_t kRowBytes = kBlockRows * sizeof(float);
  if (resume) {
    _tile_loadd(0, c, kRowBytes);
    _tile_loadd(1, c + 16, kRowBytes);
    _tile_loadd(2, c + 16 * kBlockRows, kRowBytes);
    _tile_loadd(3, c + 16 * kBlockRows + 16, kRowBytes);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  const uint16_t* ap = a + k0 / kStepK * kTileElems;
  if (w1 != nullptr) {
    for (int64_t p = k0; p < k1; p += kStepK, ap += kTileElems) {
      _tile_loadd(4, ap, kRow);
      _tile_loadd(5, ap + kTileElems / 2, kRow);
      _tile_loadd(6, w0 + p * kStripCols, kRow);
      _tile_loadd(7, w1 + p * kStripCols, kRow);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  } else {
    for (int64_t p = k0; p < k1; p += kStepK, ap += kTileElems) {
      _tile_loadd(4, ap, kRow);
      _tile_loadd(5, ap + kTileElems / 2, kRow);
      _tile_loadd(6, w0 + p * kStripCols, kRow);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(2, 5, 6);
    }
  }
  _tile_stored(0, c, kRowBytes);
  _tile_stored(1, c + 16, kRowBytes);
  _tile_stored(2, c + 16 * kBlockRows, kRowBytes);
  _tile_stored(3, c + 16 * kBlockRows + 16, kRowBytes);
}

// Whether a product of m rows of k in features takes the tiles.
bool takes(int64_t m, int64_t k) { return radixserve_amx::enabled && m >= kMinRows && k % kStepK == 0; }

// 16 sums plus bias, rounded once to bfloat16 (as the AVX-512 tiles' store16).
inline void store_row(c10::BFloat16* out, const float* sums, __m512 bias) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(_mm512_loadu_ps(sums), bias)));
}

// x [M, K] times the packed strips, as checked_linear's contract, on tiles. Work is
// split over the threads by pairs of strips (plain: strips 2i and 2i+1, a last one
// alone; gated: gate strip i and its up strip); the epilogue rounds as the AVX-512
// tiles do (sum + bias rounded once; gated: gate and up rounded, then silu_mul).
template <bool GATED>
void linear(const at::Tensor& x, const at::Tensor& packed, const c10::BFloat16* bias, at::Tensor& out) {
  using M = c10::BFloat16;
  const int64_t m = x.size(0), k = x.size(1), strips = packed.size(0);
  const int64_t lda = x.stride(0), ldc = out.stride(0), strip_stride = k * kStripCols;
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* op = reinterpret_cast<M*>(out.data_ptr());
  const int64_t pairs = GATED ? strips / 2 : (strips + 1) / 2;
  at::parallel_for(0, pairs, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    // This thread's chunk of x in tile order, 64-byte aligned: a tile row that straddles
    // two cache lines costs two loads.
    thread_local std::vector<uint16_t> buffer;
    const int64_t chunk_rows_max =
        std::clamp(kChunkBytes / (k * 2) / kBlockRows * kBlockRows, kBlockRows, kMaxChunkRows);
    buffer.resize(chunk_rows_max * k + 32);
    uint16_t* rows = buffer.data() + (64 - reinterpret_cast<uintptr_t>(buffer.data()) % 64) % 64 / 2;
    alignas(64) float sums[kMaxChunkRows / kBlockRows][kBlockRows * kBlockRows];
    for (int64_t chunk = 0; chunk < m; chunk += chunk_rows_max) {
      const int64_t chunk_rows = std::min(chunk_rows_max, m - chunk);
      const int64_t blocks = (chunk_rows + kBlockRows - 1) / kBlockRows;
      pack_rows(xp + chunk * lda, lda, chunk_rows, k, rows);
      for (int64_t pair = p0; pair < p1; ++pair) {
        // The pair's strips: s0 and s1 (none: -1), their columns 16 s0 and 16 s1 on.
        const int64_t s0 = GATED ? pair : 2 * pair;
        const int64_t s1 = GATED ? pair + strips / 2 : (2 * pair + 1 < strips ? 2 * pair + 1 : -1);
        const uint16_t* w0 = wp + s0 * strip_stride;
        const uint16_t* w1 = s1 >= 0 ? wp + s1 * strip_stride : nullptr;
        for (int64_t k0 = 0; k0 < k; k0 += kChunkK)
          for (int64_t b = 0; b < blocks; ++b)
            block(rows + b * k / kStepK * kTileElems, w0, w1, k0, std::min(k, k0 + kChunkK), k0 > 0, sums[b]);
        alignas(64) float b0[kStripCols] = {}, b1[kStripCols] = {};
        for (int64_t j = 0; bias != nullptr && j < kStripCols; ++j) {
          b0[j] = bias[s0 * kStripCols + j];
          if (s1 >= 0) b1[j] = bias[s1 * kStripCols + j];
        }
        const __m512 bias0 = _mm512_load_ps(b0), bias1 = _mm512_load_ps(b1);
        for (int64_t r = 0; r < chunk_rows; ++r) {
          const float* c = sums[r / kBlockRows] + r % kBlockRows * kBlockRows;
          M* o = op + (chunk + r) * ldc;
          if constexpr (GATED) {
            M* g = o + pair * kStripCols;
#pragma omp simd
            for (int j = 0; j < kStripCols; ++j)
              g[j] = silu_mul<M>(round_to<M>(c[j] + b0[j]), round_to<M>(c[16 + j] + b1[j]));
          } else {
            store_row(o + s0 * kStripCols, c, bias0);
            if (s1 >= 0) store_row(o + s1 * kStripCols, c + 16, bias1);
          }
        }
      }
    }
    _tile_release();
  });
}

}  // namespace amx

#endif  // RADIXSERVE_AMX

#if defined(RADIXSERVE_GEMM_AVX2)

// float32 x and out on AVX2 (+ FMA, F16C): the weight packed as above (G = 1) in float32,
// or in bfloat16 or float16 where those hold the model's float32 weights exactly (a 16-bit
// checkpoint served in float32, as on CPUs without bfloat16 dot products): half the
// bytes a decode step reads, widened exactly in registers. A strip's 16 columns are two
// 8-lane halves.
struct WeightsFloat32 {
  using T = float;
  static __m256 load8(const T* p) { return _mm256_loadu_ps(p); }
};
struct WeightsBFloat16 {
  using T = uint16_t;
  static __m256 load8(const T* p) {
    const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
  }
};
struct WeightsFloat16 {
  using T = uint16_t;
  static __m256 load8(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
};

// Up to three rows: 16 ymm registers hold 3 rows x 2 strips x 2 halves of accumulators
// and the strips' four weight vectors (one row takes four strips: eight chains).
constexpr int kAvx2TileRows = 3;

// Rows [0, ROWS) of x times STRIPS strips, as tile() above (GATED alike), float32 out.
// Accumulator (row r, strip s, half h) of a tile_avx2 of STRIPS strips.
template <int STRIPS>
constexpr int at(int r, int s, int h) {
  return (r * STRIPS + s) * 2 + h;
}

template <typename W, int ROWS, int STRIPS, bool GATED>
void tile_avx2(const float* x, int64_t lda, const typename W::T* const* w, int64_t steps, const float* const* bias,
               float* out, int64_t ldc, const typename W::T* prefetch) {
  // Flat: GCC kept a [ROWS][STRIPS][2] array in memory, stored at every step.
  __m256 acc[ROWS * STRIPS * 2];
  for (int r = 0; r < ROWS; ++r)
    for (int s = 0; s < STRIPS; ++s) acc[at<STRIPS>(r, s, 0)] = acc[at<STRIPS>(r, s, 1)] = _mm256_setzero_ps();
  for (int64_t p = 0; p < steps; ++p) {
    _mm_prefetch(reinterpret_cast<const char*>(prefetch + p * kStripCols), _MM_HINT_T1);
    __m256 b[STRIPS][2];
    for (int s = 0; s < STRIPS; ++s) {
      b[s][0] = W::load8(w[s] + p * kStripCols);
      b[s][1] = W::load8(w[s] + p * kStripCols + 8);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * lda + p);
      for (int s = 0; s < STRIPS; ++s)
        for (int h = 0; h < 2; ++h) acc[at<STRIPS>(r, s, h)] = _mm256_fmadd_ps(a, b[s][h], acc[at<STRIPS>(r, s, h)]);
    }
  }
  static const float kNoBias[kStripCols] = {};
  for (int s = 0; s < STRIPS; ++s) {
    const float* bs = bias[s] != nullptr ? bias[s] : kNoBias;
    for (int h = 0; h < 2; ++h) {
      const __m256 bv = _mm256_loadu_ps(bs + 8 * h);
      for (int r = 0; r < ROWS; ++r) acc[at<STRIPS>(r, s, h)] = _mm256_add_ps(acc[at<STRIPS>(r, s, h)], bv);
    }
  }
  if constexpr (GATED) {
    // The sums go to memory once, in a loop as unrolled as the main one's: storing
    // them strip by strip inside the silu loop kept acc on the stack, and GCC stored
    // all twelve accumulators at every step (the fused gate/up ran at half linear's rate).
    alignas(32) float sums[ROWS * STRIPS * kStripCols];
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < STRIPS; ++s)
        for (int h = 0; h < 2; ++h) _mm256_store_ps(sums + at<STRIPS>(r, s, h) * 8, acc[at<STRIPS>(r, s, h)]);
    constexpr int kGates = STRIPS / 2;
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < kGates; ++s) {
        const float* gate = sums + at<STRIPS>(r, s, 0) * 8;
        const float* up = sums + at<STRIPS>(r, kGates + s, 0) * 8;
        float* o = out + r * ldc + s * kStripCols;
#pragma omp simd
        for (int c = 0; c < kStripCols; ++c) o[c] = silu_mul<float>(gate[c], up[c]);
      }
  } else {
    for (int r = 0; r < ROWS; ++r)
      for (int s = 0; s < STRIPS; ++s)
        for (int h = 0; h < 2; ++h) _mm256_storeu_ps(out + r * ldc + s * kStripCols + 8 * h, acc[at<STRIPS>(r, s, h)]);
  }
}

template <typename W>
using Avx2TileFn = void (*)(const float*, int64_t, const typename W::T* const*, int64_t, const float* const*, float*,
                            int64_t, const typename W::T*);

// One row: up to four strips (gated: two gate and two up); two or three rows: up to two
// (gated: one of each), so the tile's strips are walked in pieces of that many.
template <typename W, bool GATED>
Avx2TileFn<W> avx2_tile_for(int rows, int strips) {
  if (rows == 1) {
    if constexpr (GATED) return strips == 2 ? tile_avx2<W, 1, 2, true> : tile_avx2<W, 1, 4, true>;
    return strips == 1 ? tile_avx2<W, 1, 1, false> : strips == 2 ? tile_avx2<W, 1, 2, false>
                       : strips == 3 ? tile_avx2<W, 1, 3, false> : tile_avx2<W, 1, 4, false>;
  }
  if (strips == 1) return rows == 2 ? tile_avx2<W, 2, 1, GATED> : tile_avx2<W, 3, 1, GATED>;
  return rows == 2 ? tile_avx2<W, 2, 2, GATED> : tile_avx2<W, 3, 2, GATED>;
}

// Rows [0, m) of x times one group's ns strips (w, with biases b; gated: gate strips,
// then their up strips), columns from out's first: row tiles of up to three rows, each
// walking the strips in pieces its registers hold. next: the strips the next group will
// read, prefetched to L2 a strip per piece (none: the group's own).
template <typename W, bool GATED>
void group_avx2(const float* x, int64_t lda, int64_t m, const typename W::T* const* w, const float* const* b, int ns,
                int64_t steps, const typename W::T* const* next, int next_strips, float* out, int64_t ldc) {
  using T = typename W::T;
  for (int64_t r0 = 0, t = 0; r0 < m; r0 += kAvx2TileRows) {
    const int nr = static_cast<int>(std::min<int64_t>(kAvx2TileRows, m - r0));
    // A piece: a gate strip and its up strip (gated) or one to four strips.
    const int piece = nr == 1 ? ns : GATED ? 2 : std::min(ns, 2);
    const int pieces = GATED && nr > 1 ? ns / 2 : (ns + piece - 1) / piece;
    for (int i = 0; i < pieces; ++i, ++t) {
      const T* pw[kTileStrips];
      const float* pb[kTileStrips];
      int n = 0, first_col;
      if (GATED && nr > 1) {  // gate strip i and up strip ns/2 + i
        pw[0] = w[i], pw[1] = w[ns / 2 + i], pb[0] = b[i], pb[1] = b[ns / 2 + i], n = 2, first_col = i;
      } else {
        for (int j = i * piece; j < std::min(ns, (i + 1) * piece); ++j, ++n) pw[n] = w[j], pb[n] = b[j];
        first_col = i * piece;
      }
      const T* prefetch = t < next_strips ? next[t] : w[0];
      avx2_tile_for<W, GATED>(nr, n)(x + r0 * lda, lda, pw, steps, pb, out + r0 * ldc + first_col * kStripCols, ldc,
                                     prefetch);
    }
  }
}

// From this many rows a group's 16-bit strips are widened once into a float32 copy
// (L2-sized) that every row tile reads: widening in each tile cost prefill 1.6x
// against float32 weights (3-row tiles share each widened vector only three ways).
constexpr int64_t kWidenRows = 8;

template <typename W, bool GATED>
void linear_avx2(const at::Tensor& x, const at::Tensor& packed, const float* bias, at::Tensor& out) {
  using T = typename W::T;
  constexpr bool kNarrow = !std::is_same_v<W, WeightsFloat32>;
  const int64_t m = x.size(0), strips = packed.size(0), steps = packed.size(1);
  const float* xp = x.data_ptr<float>();
  const auto* wp = reinterpret_cast<const T*>(packed.data_ptr());
  float* op = out.data_ptr<float>();
  const int64_t lda = x.stride(0), ldc = out.stride(0), strip_stride = steps * kStripCols;
  for_each_group<T, float, GATED>(wp, bias, strips, strip_stride, [&](const StripGroup<T, float>& group) {
    float* o = op + group.first_col;
    if (kNarrow && m >= kWidenRows) {
      thread_local std::vector<float> widened;  // this thread's float32 copy of a group's strips
      widened.resize(group.ns * strip_stride);
      const float* fw[kTileStrips];
      for (int s = 0; s < group.ns; ++s) {
        float* dst = widened.data() + s * strip_stride;
        for (int64_t i = 0; i < strip_stride; i += 8) _mm256_storeu_ps(dst + i, W::load8(group.w[s] + i));
        fw[s] = dst;
      }
      group_avx2<WeightsFloat32, GATED>(xp, lda, m, fw, group.b, group.ns, steps, fw, 0, o, ldc);
    } else {
      group_avx2<W, GATED>(xp, lda, m, group.w, group.b, group.ns, steps, group.next, group.next_strips, o, ldc);
    }
  });
}

#endif  // RADIXSERVE_GEMM_AVX2

// x [M, K] (unit stride along K), packed [N/16, K/G, 16, G], bias [N] or none, all of
// one dtype; out [M, N] contiguous, or [M, N/2] when gated (N/16 even: the first half
// of the weight's rows are gate and the second half up).
template <bool GATED>
void checked_linear(const char* op, const at::Tensor& x, const at::Tensor& packed,
                    const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  const at::ScalarType dtype = x.scalar_type();
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, op, ": x must be 2-D with unit stride along in features");
  // A float32 model's weight may be packed in bfloat16 or float16 (where that holds it exactly).
  const at::ScalarType stored = packed.scalar_type();
  const bool narrowed = dtype == at::kFloat && (stored == at::kBFloat16 || stored == at::kHalf);
  TORCH_CHECK((stored == dtype || narrowed) && out.scalar_type() == dtype, op,
              ": x and out of one dtype, the weight of theirs (float32 x: or bfloat16, float16)");
  TORCH_CHECK(packed.dim() == 4 && packed.is_contiguous() && packed.size(2) == kStripCols &&
                  packed.size(3) == group_size(dtype),
              op, ": the weight must come from pack_weight");
  TORCH_CHECK(!GATED || packed.size(0) % 2 == 0, op, ": gate and up need 16-column strips each, ",
              packed.size(0), " strips in all");
  const int64_t m = x.size(0), n = packed.size(0) * kStripCols, out_n = GATED ? n / 2 : n;
  TORCH_CHECK(packed.size(1) * packed.size(3) == x.size(1), op, ": x has ", x.size(1), " in features, the weight ",
              packed.size(1) * packed.size(3));
  TORCH_CHECK(out.is_contiguous() && out.size(0) == m && out.size(1) == out_n, op, ": out must be contiguous [",
              m, ", ", out_n, "]");
  const void* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == n,
                op, ": bias must be contiguous [out features] in x's dtype");
    bias_ptr = bias->data_ptr();
  }
  if (m == 0) return;
#if defined(RADIXSERVE_AMX)
  if (dtype == at::kBFloat16 && amx::takes(m, x.size(1)))
    return amx::linear<GATED>(x, packed, static_cast<const c10::BFloat16*>(bias_ptr), out);
#endif
#if defined(__AVX512BF16__)
  if (dtype == at::kBFloat16)
    return linear_impl<BFloat16, GATED>(x, packed, static_cast<const uint16_t*>(bias_ptr), out);
#endif
#if defined(__AVX512F__)
  if (dtype == at::kFloat && stored == at::kFloat)
    return linear_impl<Float32, GATED>(x, packed, static_cast<const float*>(bias_ptr), out);
#endif
#if defined(RADIXSERVE_GEMM_AVX2)
  if (dtype == at::kFloat) {
    const auto* float_bias = static_cast<const float*>(bias_ptr);
    if (stored == at::kBFloat16) return linear_avx2<WeightsBFloat16, GATED>(x, packed, float_bias, out);
    if (stored == at::kHalf) return linear_avx2<WeightsFloat16, GATED>(x, packed, float_bias, out);
    return linear_avx2<WeightsFloat32, GATED>(x, packed, float_bias, out);
  }
#endif
  TORCH_CHECK(false, "radixserve_cpu_gemm.", op, ": no kernel for ", dtype, " in this build (",
              "float32 needs AVX2, FMA and F16C or AVX-512; bfloat16 AVX512-BF16)");
}

void linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias, at::Tensor& out) {
  checked_linear<false>("linear", x, packed, bias, out);
}

// silu(gate) * up of the MLP's fused gate/up projection, without writing the
// projection itself (twice the width of the result).
void linear_silu_and_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         at::Tensor& out) {
  checked_linear<true>("linear_silu_and_mul", x, packed, bias, out);
}

// Lets (or keeps) bfloat16 products of this process from AMX's tiles (these GEMMs and
// cpu_paged's attention), where the build has them and Linux grants the tile state;
// returns whether they are used. Off until
// called: the loader calls it with whether ONEDNN_MAX_CPU_ISA lets oneDNN use AMX, so
// the one setting hides AMX from both (cpu_isa.amx_allowed).
bool set_amx(bool use) {
#if defined(RADIXSERVE_AMX)
  static const bool granted = radixserve_amx::request_permission();
  radixserve_amx::enabled = use && granted;
  return radixserve_amx::enabled;
#else
  (void)use;
  return false;
#endif
}

bool uses_amx() {
#if defined(RADIXSERVE_AMX)
  return radixserve_amx::enabled;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY(radixserve_cpu_gemm, m) {
  m.def("dtypes() -> str[]", &dtypes);
  m.def("set_amx(bool use) -> bool", &set_amx);
  m.def("uses_amx() -> bool", &uses_amx);
  m.def("pack_weight(Tensor weight) -> Tensor");
  m.def("linear(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
  m.def("linear_silu_and_mul(Tensor x, Tensor packed, Tensor? bias, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_gemm, CPU, m) {
  m.impl("pack_weight", &pack_weight);
  m.impl("linear", &linear);
  m.impl("linear_silu_and_mul", &linear_silu_and_mul);
}
