// Decode attention on the CPU that reads K/V in place from the KV pool.
//
// One query row n (a decode request, or one new token of an extend) attends to
// the first lens[n] tokens of request row rows[n] of req_to_token; token t
// lives in pool slot req_to_token[rows[n], t]. A work item is (query, key
// range) with all heads: each key's pool row (every KV head of one slot,
// contiguous) is read from memory once and used by all query heads. Scores,
// softmax and accumulation are float32, with an online (flash-decoding style)
// softmax over blocks of 32 keys; rows are prefetched ahead (the AVX-512
// loops: a block's V rows during its scores, the next block's K rows during
// its P.V). When there are too few queries to keep every thread busy, long key
// ranges are split and the partial results merged afterwards. Threads take
// items longest first from a shared counter.
//
// Inner loops, with AVX-512 and head_dim a multiple of 16 (attend_avx512), per
// block of keys and KV head:
// - scores: 8 keys x 8/S heads at a time in 8-lane vectors, each lane holding
//   S consecutive head_dim positions of one head (S = 1 when the group has a
//   multiple of 8 heads, 2, 4 or 8 for groups of 4, 2 or 1), against those
//   positions of a key broadcast to every head, one accumulator per key; then
//   one transpose-and-add tree gives the 8 keys' scores for those heads (no
//   horizontal sum per key and head). With groups of 8 heads (S = 1) a key's
//   vector already holds its 8 heads' scores: it is stored as is, key-major,
//   and the softmax works on it lane by lane (online_softmax_key_major). A
//   bfloat16 query over a bfloat16 pool on a CPU with AVX512_BF16 multiplies
//   pairs of values straight from the pool rows with vdpbf16ps (the query as
//   stored, so the products are exact); other pools are converted to float32
//   once per block and KV head;
// - softmax: per head, the block's scores as 16-key vectors; key-major, per
//   8-head vector, each head's running max and sum in a lane, two keys per exp;
// - P.V: tiles of (heads x 16-column vectors), at most 16 accumulator
//   registers, held across the block's keys; V converted on the fly, or with
//   vdpbf16ps (bfloat16 pool and query, AVX512_BF16) two keys per instruction,
//   the probabilities rounded to bfloat16 and the two keys' values interleaved.
// Without AVX-512 (or at another head_dim) plain loops that the compiler
// vectorises (-O3 -march=native, `omp simd`) do the same per key (attend_plain).
//
// A windowed layer's query starts its key range at the first key of its window,
// so the pages before it are never read; a capped layer caps each block's scores
// (cap_scores) before its softmax. Neither costs anything when the layer has none.

#include "cpu_paged_common.h"

#include <cmath>

#include <type_traits>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace radixserve_cpu_paged {
namespace {

constexpr int64_t kBlock = 32;       // keys per online-softmax block
constexpr int64_t kPrefetch = 12;    // portable loops: pool rows requested (into L2) ahead of use; <= kBlock
constexpr int64_t kItemsPerThread = 8;  // split long ranges until about this many items per thread
constexpr int64_t kMinSplit = 128;   // ... but never into ranges shorter than this

template <typename T>
inline const float* as_float(const T* src, float* dst, int64_t d) {
  for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<float>(src[i]);
  return dst;
}

template <>
inline const float* as_float<float>(const float* src, float*, int64_t) {
  return src;
}

template <>
inline const float* as_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t d) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) dst[i] = bits_to_float(static_cast<uint32_t>(s[i]) << 16);
  return dst;
}

// sum(a[i] * b[i]) (the portable loops).
inline float dot(const float* a, const float* b, int64_t d) {
  float s = 0.0f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
  return s;
}

// Ask for one pool row (all KV heads of a slot) ahead of use: the slots are
// scattered over the pool, so without this each row is a cache (and often a
// TLB) miss the loop waits for. Into L2 (locality hint 2), a dozen rows ahead:
// measured faster than into L1 four rows ahead, whose miss buffers fill up.
template <typename T>
inline void prefetch_row(const T* row, int64_t row_len) {
  const char* p = reinterpret_cast<const char*>(row);
  for (int64_t off = 0; off < row_len * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(p + off, 0, 2);
}

struct Item {
  int64_t query, begin, end;  // keys [begin, end) of one query row, all heads
  int64_t split;              // its index among all splits (partial results), when split
};

// One thread's buffers: the query (the portable loops' float32 copy, or the
// AVX-512 loops' interleaved one), a block's scores per head, a converted row
// or block of rows, and an unsplit item's m, l and accumulators.
struct Scratch {
  std::vector<float> q, scores, row, ml, acc;
  std::vector<uint32_t> q_lanes;  // float32 bits or bfloat16 pairs
  std::vector<uint32_t> p_pairs;  // bf16 P.V: each head's block of probabilities as bfloat16 pairs
  explicit Scratch(const Dims& dm)
      : q(dm.heads * dm.d), scores(dm.heads * kBlock), row(std::max(dm.row_len, kBlock * dm.d)), ml(2 * dm.heads),
        acc(dm.heads * dm.d), q_lanes(dm.heads * dm.d), p_pairs(dm.heads * kBlock / 2) {}
};

// Reset an item's running max, sum and accumulators; request its first `ahead` K rows.
template <typename T>
inline void begin_item(const T* k_pool, const int64_t* slots, int64_t begin, int64_t end, int64_t ahead,
                       const Dims& dm, float* m, float* l, float* acc) {
  std::fill(m, m + dm.heads, -std::numeric_limits<float>::infinity());
  std::fill(l, l + dm.heads, 0.0f);
  std::fill(acc, acc + dm.heads * dm.d, 0.0f);
  for (int64_t t = begin; t < std::min(end, begin + ahead); ++t)
    prefetch_row(k_pool + slots[t] * dm.row_len, dm.row_len);
}

// The online softmax step over a block of nb keys: scores[h][t] become the
// weights exp(s - m_new), and each head's sum and accumulator are rescaled to
// the new running max.
inline void online_softmax(float* scores, int64_t nb, const Dims& dm, float* m, float* l, float* acc) {
  const int64_t d = dm.d;
  for (int64_t h = 0; h < dm.heads; ++h) {
    float* sh = scores + h * kBlock;
    float block_max = sh[0];
    for (int64_t t = 1; t < nb; ++t) block_max = std::max(block_max, sh[t]);
    const float m_new = std::max(m[h], block_max);
    const float alpha = fast_exp(m[h] - m_new);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < nb; ++t) {
      sh[t] = fast_exp(sh[t] - m_new);
      sum += sh[t];
    }
    if (m_new != m[h]) {
      float* ah = acc + h * d;
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) ah[i] *= alpha;
    }
    l[h] = l[h] * alpha + sum;
    m[h] = m_new;
  }
}

// The portable path (any head_dim, any instruction set): per key, the pool row
// is converted to float32 once and each head's score is a dot product; per
// key, every head's accumulator takes p * V.
template <typename T>
void attend_plain(const T* k_pool, const T* v_pool, const int64_t* slots, int64_t begin, int64_t end, const float* q,
                  float cap, const Dims& dm, float* m, float* l, float* acc, Scratch& sc) {
  const int64_t heads = dm.heads, group = dm.group, d = dm.d, row_len = dm.row_len;
  float* scores = sc.scores.data();
  float* row = sc.row.data();
  begin_item(k_pool, slots, begin, end, kPrefetch, dm, m, l, acc);
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, end - b0);
    for (int64_t t = 0; t < nb; ++t) {
      if (t + kPrefetch < nb) prefetch_row(k_pool + slots[b0 + t + kPrefetch] * row_len, row_len);
      else if (t + kPrefetch - nb < nb) prefetch_row(v_pool + slots[b0 + t + kPrefetch - nb] * row_len, row_len);
      const float* kf = as_float(k_pool + slots[b0 + t] * row_len, row, row_len);
      for (int64_t h = 0; h < heads; ++h) {
        scores[h * kBlock + t] = dot(q + h * d, kf + (h / group) * d, d);
      }
    }
    if (cap > 0.0f)
      for (int64_t h = 0; h < heads; ++h) cap_scores(scores + h * kBlock, nb, 1.0f / cap, cap);
    online_softmax(scores, nb, dm, m, l, acc);
    const int64_t next = b0 + nb;  // first key of the next block
    for (int64_t t = 0; t < nb; ++t) {
      if (t + kPrefetch < nb) prefetch_row(v_pool + slots[b0 + t + kPrefetch] * row_len, row_len);
      else if (next + t + kPrefetch - nb < end) prefetch_row(k_pool + slots[next + t + kPrefetch - nb] * row_len, row_len);
      const float* vf = as_float(v_pool + slots[b0 + t] * row_len, row, row_len);
      for (int64_t h = 0; h < heads; ++h) {
        const float p = scores[h * kBlock + t];
        const float* vh = vf + (h / group) * d;
        float* ah = acc + h * d;
#pragma omp simd
        for (int64_t i = 0; i < d; ++i) ah[i] += p * vh[i];
      }
    }
  }
}

#if defined(__AVX512F__)
// 16 values of a pool row as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// S consecutive 32-bit values (floats, or pairs of bfloat16) repeated over 8
// lanes: a broadcast load, no shuffle.
template <int S>
inline __m256 broadcast_load(const float* p) {
  if constexpr (S == 1) return _mm256_broadcast_ss(p);
  if constexpr (S == 2) return _mm256_castpd_ps(_mm256_broadcast_sd(reinterpret_cast<const double*>(p)));
  if constexpr (S == 4) return _mm256_broadcast_ps(reinterpret_cast<const __m128*>(p));
  if constexpr (S == 8) return _mm256_loadu_ps(p);
}

// acc[u] (key u = 0..7) holds 8/S heads x S partial sums, lane g * S + s;
// out[g * kBlock + u] = scale * (the sum of head g's S lanes of acc[u]).
// Transpose-and-add trees: per 8 keys 24 shuffles for 8 heads (S = 1), 20
// shuffles and adds for 4 heads (S = 2) or 2 heads (S = 4), 21 for one head.
template <int S>
inline void store_scores(__m256* acc, float scale, float* out) {
  const __m256 sc = _mm256_set1_ps(scale);
  if constexpr (S == 1) {  // 8 x 8 transpose
    __m256 t[8], u[8];
    for (int i = 0; i < 4; ++i) {
      t[2 * i] = _mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]);
      t[2 * i + 1] = _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]);
    }
    for (int i = 0; i < 2; ++i) {
      u[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
      u[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
      u[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int g = 0; g < 4; ++g) {
      _mm256_storeu_ps(out + g * kBlock, _mm256_mul_ps(_mm256_permute2f128_ps(u[g], u[g + 4], 0x20), sc));
      _mm256_storeu_ps(out + (g + 4) * kBlock, _mm256_mul_ps(_mm256_permute2f128_ps(u[g], u[g + 4], 0x31), sc));
    }
  } else if constexpr (S == 2) {  // lanes [g0 g0 g1 g1 | g2 g2 g3 g3]
    __m256 x[4];
    for (int i = 0; i < 4; ++i) x[i] = _mm256_hadd_ps(acc[2 * i], acc[2 * i + 1]);  // [u.g0 u.g1 v.g0 v.g1 | g2 g3]
    const __m256 y0 = _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0));  // keys 0-3: g0 | g2
    const __m256 y1 = _mm256_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1));  // g1 | g3
    const __m256 z0 = _mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(2, 0, 2, 0));  // keys 4-7
    const __m256 z1 = _mm256_shuffle_ps(x[2], x[3], _MM_SHUFFLE(3, 1, 3, 1));
    _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_permute2f128_ps(y0, z0, 0x20), sc));
    _mm256_storeu_ps(out + kBlock, _mm256_mul_ps(_mm256_permute2f128_ps(y1, z1, 0x20), sc));
    _mm256_storeu_ps(out + 2 * kBlock, _mm256_mul_ps(_mm256_permute2f128_ps(y0, z0, 0x31), sc));
    _mm256_storeu_ps(out + 3 * kBlock, _mm256_mul_ps(_mm256_permute2f128_ps(y1, z1, 0x31), sc));
  } else {  // S = 4 (lanes [g0 x4 | g1 x4]) or 8 (one head)
    __m256 a[4], b[2];
    for (int i = 0; i < 4; ++i)  // per 128-bit half: [u0+u2, v0+v2, u1+u3, v1+v3]
      a[i] = _mm256_add_ps(_mm256_unpacklo_ps(acc[2 * i], acc[2 * i + 1]),
                           _mm256_unpackhi_ps(acc[2 * i], acc[2 * i + 1]));
    for (int i = 0; i < 2; ++i)  // per 128-bit half: keys 4i .. 4i+3
      b[i] = _mm256_add_ps(_mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                           _mm256_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const __m256 lo = _mm256_permute2f128_ps(b[0], b[1], 0x20), hi = _mm256_permute2f128_ps(b[0], b[1], 0x31);
    if constexpr (S == 4) {
      _mm256_storeu_ps(out, _mm256_mul_ps(lo, sc));
      _mm256_storeu_ps(out + kBlock, _mm256_mul_ps(hi, sc));
    } else {
      _mm256_storeu_ps(out, _mm256_mul_ps(_mm256_add_ps(lo, hi), sc));
    }
  }
}

// Scores of 8/S heads of one KV head against 8 keys: each 8-lane vector holds
// S consecutive head_dim positions of each head (ql, the query interleaved so,
// once per item), multiplied by the same S positions of a key broadcast to
// every head; the S partial sums per head are added at the end. float32 K rows
// (kr), or with kBf16 raw bfloat16 rows and pairs of positions per lane, by
// vdpbf16ps. 8 independent accumulators, one per key.
template <int S, bool kBf16>
inline void accumulate_block8(const float* ql, const float* const* kr, int64_t d, __m256* acc) {
  for (int u = 0; u < 8; ++u) acc[u] = _mm256_setzero_ps();
  const int64_t steps = kBf16 ? d / (2 * S) : d / S;
  for (int64_t i = 0; i < steps; ++i) {
    const __m256 qi = _mm256_loadu_ps(ql + i * 8);
    for (int u = 0; u < 8; ++u) {
      const __m256 ki = broadcast_load<S>(kr[u] + i * S);
#if defined(__AVX512BF16__)
      if constexpr (kBf16) {
        acc[u] = _mm256_dpbf16_ps(acc[u], (__m256bh)_mm256_castps_si256(qi), (__m256bh)_mm256_castps_si256(ki));
        continue;
      }
#endif
      acc[u] = _mm256_fmadd_ps(qi, ki, acc[u]);
    }
  }
}

// Head-major: out[g * kBlock + u] = the scaled score of head g, key u.
template <int S, bool kBf16>
inline void scores_block8(const float* ql, const float* const* kr, int64_t d, float scale, float* out) {
  __m256 acc[8];
  accumulate_block8<S, kBf16>(ql, kr, d, acc);
  store_scores<S>(acc, scale, out);
}

// Key-major, for 8 heads in a vector (S = 1): out[u * heads + g] = the unscaled
// score of head g, key u, stored as accumulated (no transpose).
template <bool kBf16>
inline void scores_block8_key_major(const float* ql, const float* const* kr, int64_t d, float* out, int64_t heads) {
  __m256 acc[8];
  accumulate_block8<1, kBf16>(ql, kr, d, acc);
  for (int u = 0; u < 8; ++u) _mm256_storeu_ps(out + u * heads, acc[u]);
}

// online_softmax with each head's block of scores as vectors of 16 keys (keys
// past nb masked out).
inline void online_softmax16(float* scores, int64_t nb, const Dims& dm, float* m, float* l, float* acc) {
  constexpr int kVecs = kBlock / 16;
  const int64_t d = dm.d;
  __mmask16 valid[kVecs];
  for (int i = 0; i < kVecs; ++i) {
    const int64_t n = std::clamp<int64_t>(nb - 16 * i, 0, 16);
    valid[i] = static_cast<__mmask16>((1u << n) - 1u);
  }
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t h = 0; h < dm.heads; ++h) {
    float* sh = scores + h * kBlock;
    __m512 s[kVecs];
    __m512 mx = neg_inf;
    for (int i = 0; i < kVecs; ++i) {
      s[i] = _mm512_mask_loadu_ps(neg_inf, valid[i], sh + 16 * i);
      mx = _mm512_max_ps(mx, s[i]);
    }
    const float m_new = std::max(m[h], _mm512_reduce_max_ps(mx));
    const float alpha = fast_exp(m[h] - m_new);
    __m512 sum = _mm512_setzero_ps();
    for (int i = 0; i < kVecs; ++i) {
      const __m512 e = _mm512_maskz_mov_ps(valid[i], exp16(_mm512_sub_ps(s[i], _mm512_set1_ps(m_new))));
      _mm512_storeu_ps(sh + 16 * i, e);
      sum = _mm512_add_ps(sum, e);
    }
    if (m_new != m[h]) {
      float* ah = acc + h * d;
      const __m512 a = _mm512_set1_ps(alpha);
      for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(ah + i, _mm512_mul_ps(_mm512_loadu_ps(ah + i), a));
    }
    l[h] = l[h] * alpha + _mm512_reduce_add_ps(sum);
    m[h] = m_new;
  }
}

// The online softmax over a block of nb keys in the key-major layout
// (scores[t * heads + h], unscaled), for groups of 8 heads: each 8-head vector
// keeps its heads' running max and sum lane by lane, so there is no horizontal
// reduction and no scalar exp per head and block; two keys go through exp16
// together. Leaves the weights in scores (float32 P.V) or, with kBf16, as
// bfloat16 pairs (keys 2j and 2j + 1 of head h) in pairs[j * heads + h].
template <bool kBf16>
inline void online_softmax_key_major(float* scores, int64_t nb, float scale, const Dims& dm, float* m, float* l,
                                     float* acc, uint32_t* pairs) {
  const int64_t heads = dm.heads, d = dm.d;
  const __m512 scale16 = _mm512_set1_ps(scale);
  for (int64_t h0 = 0; h0 < heads; h0 += 8) {
    float* s = scores + h0;
    __m256 block_max = _mm256_loadu_ps(s);
    for (int64_t t = 1; t < nb; ++t) block_max = _mm256_max_ps(block_max, _mm256_loadu_ps(s + t * heads));
    const __m256 m_old = _mm256_loadu_ps(m + h0);
    const __m256 m_new = _mm256_max_ps(m_old, _mm256_mul_ps(block_max, _mm512_castps512_ps256(scale16)));
    const __m256 alpha = _mm512_castps512_ps256(exp16(_mm512_castps256_ps512(_mm256_sub_ps(m_old, m_new))));
    const __m512 m_both = _mm512_insertf32x8(_mm512_castps256_ps512(m_new), m_new, 1);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < nb; t += 2) {  // keys t (low half) and t + 1 (high half, zero past nb)
      const bool pair = t + 1 < nb;
      const __m256 lo = _mm256_loadu_ps(s + t * heads);
      const __m256 hi = pair ? _mm256_loadu_ps(s + (t + 1) * heads) : lo;
      __m512 e = exp16(_mm512_fmsub_ps(_mm512_insertf32x8(_mm512_castps256_ps512(lo), hi, 1), scale16, m_both));
      if (!pair) e = _mm512_maskz_mov_ps(0x00FF, e);
      sum = _mm512_add_ps(sum, e);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
      if constexpr (kBf16) {
        // Words: key t's 8 heads, then key t + 1's; interleaved into one (t, t + 1) pair per head.
        static const uint16_t kOrder[16] = {0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15};
        const __m256i words = (__m256i)_mm512_cvtneps_pbh(e);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(pairs + (t / 2) * heads + h0),
                            _mm256_permutexvar_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(kOrder)), words));
        continue;
      }
#endif
      _mm256_storeu_ps(s + t * heads, _mm512_castps512_ps256(e));
      if (pair) _mm256_storeu_ps(s + (t + 1) * heads, _mm512_extractf32x8_ps(e, 1));
    }
    const __m256 block_sum = _mm256_add_ps(_mm512_castps512_ps256(sum), _mm512_extractf32x8_ps(sum, 1));
    _mm256_storeu_ps(l + h0, _mm256_fmadd_ps(_mm256_loadu_ps(l + h0), alpha, block_sum));
    _mm256_storeu_ps(m + h0, m_new);
    const int moved = _mm256_movemask_ps(_mm256_cmp_ps(m_new, m_old, _CMP_NEQ_UQ));
    if (moved != 0) {  // rescale the accumulators of the heads whose max moved
      alignas(32) float a[8];
      _mm256_store_ps(a, alpha);
      for (int g = 0; g < 8; ++g) {
        if (!(moved >> g & 1)) continue;
        float* ah = acc + (h0 + g) * d;
        const __m512 av = _mm512_set1_ps(a[g]);
        for (int64_t i = 0; i < d; i += 16) _mm512_storeu_ps(ah + i, _mm512_mul_ps(_mm512_loadu_ps(ah + i), av));
      }
    }
  }
}

// The probabilities a P.V tile reads: float32 p[h * kBlock + t], or with kPaired
// (a bfloat16 pool, AVX512_BF16) bfloat16 pairs pairs[h * kBlock / 2 + j] = (P[2j],
// P[2j + 1]) of each head, made by paired_probabilities; or the same key-major,
// as online_softmax_key_major leaves them.
struct BlockProbs {
  const float* p;
  const uint32_t* pairs;
  int64_t p_head_stride, pair_head_stride, key_stride;  // key_stride: per key in p, per key pair in pairs
  static BlockProbs head_major(const float* p, const uint32_t* pairs) { return {p, pairs, kBlock, kBlock / 2, 1}; }
  // scores_block8_key_major's layout: p[t * heads + h], pairs[j * heads + h].
  static BlockProbs key_major(const float* p, const uint32_t* pairs, int64_t heads) { return {p, pairs, 1, 1, heads}; }
  float prob(int64_t h, int64_t t) const { return p[h * p_head_stride + t * key_stride]; }
  uint32_t pair(int64_t h, int64_t j) const { return pairs[h * pair_head_stride + j * key_stride]; }
  BlockProbs heads_from(int64_t h) const {
    return {p + h * p_head_stride, pairs + h * pair_head_stride, p_head_stride, pair_head_stride, key_stride};
  }
};

#if defined(__AVX512BF16__)
// Each head's block of probabilities (zero past the block's keys, as
// online_softmax16 leaves them) rounded to bfloat16, in key order: 32-bit value j
// holds keys 2j (low half) and 2j + 1. torch's bf16 flash attention rounds them
// likewise before its P.V product.
inline void paired_probabilities(const float* scores, int64_t heads, uint32_t* pairs) {
  static_assert(kBlock == 32, "two vectors of 16 probabilities per head");
  for (int64_t h = 0; h < heads; ++h) {
    const float* sh = scores + h * kBlock;
    const __m512bh bf = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sh + 16), _mm512_loadu_ps(sh));
    _mm512_storeu_si512(pairs + h * kBlock / 2, (__m512i)bf);
  }
}
#endif

// acc[h][col : col + 16 DC] += sum_t p[h][t] * V_t for HG heads of one KV
// head: the accumulators stay in registers across the block's keys. kPaired:
// two keys per vdpbf16ps, their values interleaved per column from the raw
// bfloat16 rows (word 2i: key 2j's column i, word 2i + 1: key 2j + 1's).
template <int DC, int HG, bool kPaired, typename T>
inline void pv_tile(const T* const* vr, int64_t col, int64_t nb, BlockProbs probs, float* acc, int64_t d) {
  __m512 a[HG][DC];
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < DC; ++c) a[h][c] = _mm512_loadu_ps(acc + h * d + col + c * 16);
#if defined(__AVX512BF16__) && defined(__AVX512BW__)  // (every CPU with the first has the second)
  if constexpr (kPaired) {
    for (int64_t t = 0; t < nb; t += 2) {
      __m512bh v[DC];
      for (int c = 0; c < DC; ++c) {
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[t] + col + c * 16));
        const __m256i hi = t + 1 < nb ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(vr[t + 1] + col + c * 16))
                                      : _mm256_setzero_si256();
        v[c] = (__m512bh)interleave_halves(_mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
      }
      for (int h = 0; h < HG; ++h) {
        const __m512bh w = (__m512bh)_mm512_set1_epi32(static_cast<int>(probs.pair(h, t / 2)));
        for (int c = 0; c < DC; ++c) a[h][c] = _mm512_dpbf16_ps(a[h][c], w, v[c]);
      }
    }
  } else
#endif
  {
    for (int64_t t = 0; t < nb; ++t) {
      __m512 v[DC];
      for (int c = 0; c < DC; ++c) v[c] = load16(vr[t] + col + c * 16);
      for (int h = 0; h < HG; ++h) {
        const __m512 w = _mm512_set1_ps(probs.prob(h, t));
        for (int c = 0; c < DC; ++c) a[h][c] = _mm512_fmadd_ps(w, v[c], a[h][c]);
      }
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < DC; ++c) _mm512_storeu_ps(acc + h * d + col + c * 16, a[h][c]);
}

// The group's heads over 16 DC columns in tiles of at most 16 accumulator
// registers: HG heads at a time, then one by one.
template <int DC, int HG, bool kPaired, typename T>
inline void pv_group(const T* const* vr, int64_t col, int64_t nb, BlockProbs probs, float* acc, int64_t d,
                     int64_t group) {
  int64_t h = 0;
  for (; h + HG <= group; h += HG) pv_tile<DC, HG, kPaired>(vr, col, nb, probs.heads_from(h), acc + h * d, d);
  for (; h < group; ++h) pv_tile<DC, 1, kPaired>(vr, col, nb, probs.heads_from(h), acc + h * d, d);
}

template <int DC, bool kPaired, typename T>
inline void pv_columns(const T* const* vr, int64_t col, int64_t nb, BlockProbs probs, float* acc, int64_t d,
                       int64_t group) {
  constexpr int kMaxHeads = 16 / DC;
  if (group >= kMaxHeads) pv_group<DC, kMaxHeads, kPaired>(vr, col, nb, probs, acc, d, group);
  else if (group >= 4) pv_group<DC, (kMaxHeads < 4 ? kMaxHeads : 4), kPaired>(vr, col, nb, probs, acc, d, group);
  else if (group >= 2) pv_group<DC, 2, kPaired>(vr, col, nb, probs, acc, d, group);
  else pv_group<DC, 1, kPaired>(vr, col, nb, probs, acc, d, group);
}

// The AVX-512 loops (head_dim a multiple of 16). Per block of kBlock keys: per
// KV head the scores of its heads, 8/S heads x 8 keys at a time
// (scores_block8); the softmax over the block (online_softmax16); then per KV
// head and column tile pv_tile. K rows are read as float32 (converted once per
// block and KV head) or, with kBf16, raw by vdpbf16ps.
template <bool kBf16, int S, typename T>
void attend_avx512(const T* k_pool, const T* v_pool, const int64_t* slots, int64_t begin, int64_t end, float scale,
                   float cap, const Dims& dm, float* m, float* l, float* acc, Scratch& sc) {
  constexpr int kHeadsPerVec = 8 / S;
  constexpr bool kKeyMajor = S == 1;  // groups of 8 heads: online_softmax_key_major
  const int64_t group = dm.group, d = dm.d, row_len = dm.row_len, kv_heads = dm.heads / dm.group;
  const int64_t ql_head = kBf16 ? d / 2 : d;  // 32-bit values of the interleaved query per head
  const float* q_lanes = reinterpret_cast<const float*>(sc.q_lanes.data());  // read by intrinsics only
  float* scores = sc.scores.data();
  float* kf = sc.row.data();  // the block's converted K rows of one KV head: [kBlock][d]
  const float* kr[kBlock];
  const T* raw[kBlock];
  begin_item(k_pool, slots, begin, end, kBlock, dm, m, l, acc);
  for (int64_t b0 = begin; b0 < end; b0 += kBlock) {
    const int64_t nb = std::min(kBlock, end - b0);
    const int64_t padded = (nb + 7) / 8 * 8;  // keys past nb repeat the last one; their scores are unused
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      // This block's V rows, a share per KV head (the miss buffers take a few at a time).
      for (int64_t t = kh * nb / kv_heads; t < (kh + 1) * nb / kv_heads; ++t)
        prefetch_row(v_pool + slots[b0 + t] * row_len, row_len);
      for (int64_t t = 0; t < padded; ++t) {
        raw[t] = k_pool + slots[b0 + std::min(t, nb - 1)] * row_len + kh * d;
        if constexpr (kBf16 || std::is_same_v<T, float>) {
          kr[t] = reinterpret_cast<const float*>(raw[t]);
        } else {
          for (int64_t c = 0; c < d; c += 16) _mm512_storeu_ps(kf + t * d + c, load16(raw[t] + c));
          kr[t] = kf + t * d;
        }
      }
      for (int64_t g = kh * group; g < (kh + 1) * group; g += kHeadsPerVec)
        for (int64_t t0 = 0; t0 < padded; t0 += 8) {
          if constexpr (kKeyMajor)
            scores_block8_key_major<kBf16>(q_lanes + g * ql_head, kr + t0, d, scores + t0 * dm.heads + g, dm.heads);
          else
            scores_block8<S, kBf16>(q_lanes + g * ql_head, kr + t0, d, scale, scores + g * kBlock + t0);
        }
    }
    if (cap > 0.0f) {  // key-major scores are scaled in the softmax: cap them as they will be
      if constexpr (kKeyMajor) cap_scores(scores, nb * dm.heads, scale / cap, cap / scale);
      else
        for (int64_t h = 0; h < dm.heads; ++h) cap_scores(scores + h * kBlock, nb, 1.0f / cap, cap);
    }
    if constexpr (kKeyMajor) {
      online_softmax_key_major<kBf16>(scores, nb, scale, dm, m, l, acc, sc.p_pairs.data());
    } else {
      online_softmax16(scores, nb, dm, m, l, acc);
#if defined(__AVX512BF16__)
      if constexpr (kBf16) paired_probabilities(scores, dm.heads, sc.p_pairs.data());
#endif
    }
    const int64_t next = b0 + nb;
    const int64_t n_next = std::min(end, next + kBlock) - next;
    for (int64_t kh = 0; kh < kv_heads; ++kh) {
      // The next block's K rows, likewise.
      for (int64_t t = kh * n_next / kv_heads; t < (kh + 1) * n_next / kv_heads; ++t)
        prefetch_row(k_pool + slots[next + t] * row_len, row_len);
      for (int64_t t = 0; t < nb; ++t) raw[t] = v_pool + slots[b0 + t] * row_len + kh * d;
      const BlockProbs block = kKeyMajor ? BlockProbs::key_major(scores, sc.p_pairs.data(), dm.heads)
                                         : BlockProbs::head_major(scores, sc.p_pairs.data());
      const BlockProbs probs = block.heads_from(kh * group);
      float* a = acc + kh * group * d;
      int64_t c = 0;
      for (; c + 64 <= d; c += 64) pv_columns<4, kBf16>(raw, c, nb, probs, a, d, group);
      for (; c + 32 <= d; c += 32) pv_columns<2, kBf16>(raw, c, nb, probs, a, d, group);
      for (; c < d; c += 16) pv_columns<1, kBf16>(raw, c, nb, probs, a, d, group);
    }
  }
}
#endif

// The loops that serve a call: the AVX-512 ones when head_dim is a multiple of
// 16, with vdpbf16ps when the query and the pool are bfloat16 (the query's
// values are then multiplied exactly) and the CPU has AVX512_BF16; S, the
// head_dim positions per lane, makes 8/S the largest of 8, 4, 2, 1 that
// divides the group.
struct Path {
  bool vector = false, bf16 = false;
  int slices = 8;
};

#if defined(__AVX512F__)
constexpr bool kAvx512 = true;
#else
constexpr bool kAvx512 = false;
#endif
#if defined(__AVX512BF16__)
constexpr bool kAvx512Bf16 = true;
#else
constexpr bool kAvx512Bf16 = false;
#endif

template <typename QT, typename T>
Path choose_path(int64_t d, int64_t group) {
  Path path;
  path.vector = kAvx512 && d % 16 == 0;
  path.bf16 = kAvx512Bf16 && path.vector && std::is_same_v<QT, c10::BFloat16> && std::is_same_v<T, c10::BFloat16>;
  for (int heads = 8; heads >= 1; heads /= 2) {
    if (group % heads == 0) {
      path.slices = 8 / heads;
      break;
    }
  }
  return path;
}

// One item's query: sc.q, float32 and scaled, for the portable loops; for the
// AVX-512 ones sc.q_lanes, each group of 8/S heads interleaved as
// scores_block8 reads it (unscaled: float32 values, or the stored bfloat16
// values in pairs).
template <typename QT>
void load_query(const Path& path, const QT* q, int64_t s1, float scale, const Dims& dm, Scratch& sc) {
  const int64_t heads = dm.heads, d = dm.d;
  if (!path.vector) {
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t x = 0; x < d; ++x) sc.q[h * d + x] = static_cast<float>(q[h * s1 + x]) * scale;
    return;
  }
  const int64_t s = path.slices, per_vec = 8 / s;
  const int64_t width = path.bf16 ? 2 : 1;  // values per 32-bit lane
  const int64_t ql_head = d / width;
  uint32_t* out = sc.q_lanes.data();
  for (int64_t h = 0; h < heads; ++h) {
    const int64_t h0 = h / per_vec * per_vec, g = h - h0;
    for (int64_t x = 0; x < d; x += width) {
      const int64_t j = x / width;  // 32-bit position in the head: step j / s, slice j % s
      uint32_t bits;
      if (path.bf16) {
        bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(q + h * s1)[x]) |
               static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(q + h * s1)[x + 1]) << 16;
      } else {
        bits = float_to_bits(static_cast<float>(q[h * s1 + x]));
      }
      out[h0 * ql_head + (j / s) * 8 + g * s + j % s] = bits;
    }
  }
}

template <typename T>
void attend([[maybe_unused]] const Path& path, const T* k_pool, const T* v_pool, const int64_t* slots,
            int64_t begin, int64_t end, [[maybe_unused]] float scale, float cap, const Dims& dm, float* m, float* l,
            float* acc, Scratch& sc) {
#if defined(__AVX512F__)
  if (path.vector) {
    auto run = [&](auto bf16, auto slices) {
      attend_avx512<decltype(bf16)::value, decltype(slices)::value>(k_pool, v_pool, slots, begin, end, scale, cap, dm,
                                                                    m, l, acc, sc);
    };
    auto with_slices = [&](auto bf16) {
      switch (path.slices) {
        case 1: return run(bf16, std::integral_constant<int, 1>{});
        case 2: return run(bf16, std::integral_constant<int, 2>{});
        case 4: return run(bf16, std::integral_constant<int, 4>{});
        default: return run(bf16, std::integral_constant<int, 8>{});
      }
    };
#if defined(__AVX512BF16__)
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (path.bf16) return with_slices(std::true_type{});
    }
#endif
    return with_slices(std::false_type{});
  }
#endif
  attend_plain(k_pool, v_pool, slots, begin, end, sc.q.data(), cap, dm, m, l, acc, sc);
}

template <typename QT, typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                          const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens,
                          double scaling, ScoreOptions opts, at::Tensor& out, float* lse) {
  const int64_t n_queries = q.size(0), heads = q.size(1), d = q.size(2);
  const Dims dm{heads, heads / k_buf.size(1), d, k_buf.size(1) * d};
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), table_stride = req_to_token.stride(0);
  const QT* q_ptr = q.data_ptr<QT>();
  const T* k_ptr = k_buf.data_ptr<T>();
  const T* v_ptr = v_buf.data_ptr<T>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  QT* out_ptr = out.data_ptr<QT>();
  const float scale = static_cast<float>(scaling);

  // Each query's first key: its window's (0 without one).
  auto first_key = [&](int64_t len) { return opts.window > 0 ? std::max<int64_t>(0, len - opts.window) : 0; };
  // Split key ranges only when there are too few queries to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (n_queries < kItemsPerThread * threads) {
    int64_t max_keys = 0;
    for (int64_t n = 0; n < n_queries; ++n) max_keys = std::max(max_keys, len_ptr[n] - first_key(len_ptr[n]));
    const int64_t want = (kItemsPerThread * threads + n_queries - 1) / n_queries;  // splits per query
    chunk = std::max(kMinSplit, (max_keys + want - 1) / want);
  }
  std::vector<Item> items;
  std::vector<int64_t> first_split(n_queries + 1, 0);
  for (int64_t n = 0; n < n_queries; ++n) {
    const int64_t len = len_ptr[n], first = first_key(len), keys = len - first;
    TORCH_CHECK(len >= 1 && len <= req_to_token.size(1), "cpu_paged: key length ", len, " out of range");
    const int64_t splits = chunk >= keys ? 1 : (keys + chunk - 1) / chunk;
    for (int64_t s = 0; s < splits; ++s) {  // (chunk may be INT64_MAX: never added to a key)
      const int64_t begin = first + s * chunk;
      items.push_back({n, begin, s + 1 == splits ? len : begin + chunk, first_split[n] + s});
    }
    first_split[n + 1] = first_split[n] + splits;
  }
  const int64_t total_splits = first_split[n_queries];
  const bool split = total_splits > n_queries;
  // Longest first, so the short items fill in at the end.
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.end - a.begin > b.end - b.begin; });

  // Partial results (only when split): per split, m[H], l[H] and acc[H][D].
  std::vector<float> part_ml(split ? total_splits * heads * 2 : 0);
  std::vector<float> part_acc(split ? total_splits * heads * d : 0);

  const Path path = choose_path<QT, T>(d, dm.group);
  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    Scratch sc(dm);
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      load_query(path, q_ptr + it.query * q_s0, q_s1, scale, dm, sc);
      float* m = split ? part_ml.data() + it.split * heads * 2 : sc.ml.data();
      float* l = m + heads;
      float* a = split ? part_acc.data() + it.split * heads * d : sc.acc.data();
      attend(path, k_ptr, v_ptr, table + row_ptr[it.query] * table_stride, it.begin, it.end, scale, opts.softcap, dm,
             m, l, a, sc);
      if (!split) {
        QT* dst = out_ptr + it.query * heads * d;
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = 1.0f / l[h];
          for (int64_t x = 0; x < d; ++x) dst[h * d + x] = static_cast<QT>(a[h * d + x] * inv);
          if (lse != nullptr) lse[it.query * heads + h] = m[h] + std::log(l[h]);
        }
      }
    }
  });
  if (!split) return;

  // Merge each query's splits: rescale every partial sum to the common max.
  at::parallel_for(0, n_queries, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(d);
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t h = 0; h < heads; ++h) {
        float m_all = -std::numeric_limits<float>::infinity();
        for (int64_t s = first_split[n]; s < first_split[n + 1]; ++s) m_all = std::max(m_all, part_ml[s * heads * 2 + h]);
        float l_all = 0.0f;
        std::fill(acc.begin(), acc.end(), 0.0f);
        for (int64_t s = first_split[n]; s < first_split[n + 1]; ++s) {
          const float w = fast_exp(part_ml[s * heads * 2 + h] - m_all);
          l_all += w * part_ml[s * heads * 2 + heads + h];
          const float* src = part_acc.data() + (s * heads + h) * d;
          for (int64_t x = 0; x < d; ++x) acc[x] += w * src[x];
        }
        QT* dst = out_ptr + (n * heads + h) * d;
        const float inv = 1.0f / l_all;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<QT>(acc[x] * inv);
        if (lse != nullptr) lse[n * heads + h] = m_all + std::log(l_all);
      }
    }
  });
}

}  // namespace

void decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens, double scaling,
                      ScoreOptions opts, at::Tensor& out, float* lse) {
  dispatch_dtypes(q.scalar_type(), k_buf.scalar_type(), [&](auto qt, auto kvt) {
    paged_attention_impl<decltype(qt), decltype(kvt)>(q, k_buf, v_buf, req_to_token, rows, lens, scaling, opts, out,
                                                      lse);
  });
}

}  // namespace radixserve_cpu_paged
