// Attention in tiles of query rows that share their keys: extend, and decode over
// shared prefixes (cascade).
//
// A tile is up to kLanes rows (a row: one query of one head) that attend to the
// same key list of one KV head, each row up to its own last key. It keeps its
// queries transposed, Qt[i] = component i of all its rows, so both products are
// broadcast FMAs vectorised across the rows: scores S[t] = sum_i Qt[i] * k_t[i] and
// Ot[i] += P[t] * v_t[i]. No horizontal sums and no transposed K/V copies; the
// online softmax (max, exp, sum) runs on whole vectors too. A work item holds up to
// four tiles of one key list, and each block of keys is read from the pool once per
// item (converted to float32 unless the pool holds float32, which is read in place).
// The float32 products run over all of an item's tiles at once: every key component
// is broadcast once for them all, with up to kAccumulators independent FMA chains
// (one tile at a time issued a load per FMA, and W2's extend ran 5-8% slower, its
// cascade 10%).
//
// With AMX (bfloat16 queries and pool, head_dim a multiple of 32), both products of a
// tile are tile instructions on the layouts above as they are: the scores S^T (keys x
// rows) = K (the block's rows, copied contiguous) x Qt, whose bf16 pairs are AMX's
// operand layout, stored straight into the per-key score vectors; and Ot (head_dim x
// rows) += V^T (the block's values as pairs per component) x the probabilities' pairs,
// on Ot where it lies. The softmax between them is the AVX-512 one.
//
// Extend (prefill, chunked prefill, prefix hits): request b's n new queries sit at
// positions kv_len - n .. kv_len - 1 and query j sees keys [0, kv_len - n + j]. Its
// rows for one KV head are ordered query-major (row f is query f / G, head
// kv_head * G + f % G) and cut into tiles; causal masking happens only in the key
// blocks on a tile's diagonal. A request's K/V (tens of KB per head) stays in L2
// across its tiles.
//
// Sliding window (extend): query j also sees only keys from kv_len - n + j - window + 1
// on. An item starts at its first row's first visible key, a tile skips the blocks
// before its rows' windows (and its rows' keys past their ends, as without a window),
// and the blocks that reach below some row's window start are masked there too. The
// logit cap is applied to each block's scores in its softmax step.
//
// Cascade decode: decode requests whose req_to_token rows start with the same
// slots (a prefix the radix cache shares, e.g. a system prompt) attend to that
// shared prefix together: the rows of all members of a group for one KV head form
// the tiles, so the prefix's K/V is read and converted once per tile of rows
// instead of once per request, and the products become small matrix products.
// Each member's own keys (after the prefix) go through the decode kernel, which
// also returns their log-sum-exp; the two parts are merged here.

#include "cpu_amx.h"
#include "cpu_paged_common.h"

#include <type_traits>

namespace radixserve_cpu_paged {
namespace {

// Rows per tile: one vector register of float32 lanes. The products keep up to
// kAccumulators tile vectors in registers: half the vector registers, leaving room
// for the broadcasts and query loads. Without AVX-512 (16 registers of 8 floats) a
// 16-lane tile took two registers and twice the accumulators: GCC spilled them to
// the stack at every FMA, and the extend ran 10x slower than torch's (AVX2, Zen 3).
#if defined(__AVX512F__)
constexpr int kLanes = 16;
constexpr int kAccumulators = 16;
#else
constexpr int kLanes = 8;
constexpr int kAccumulators = 8;
#endif
constexpr int64_t kKeyBlock = 32;   // keys per online-softmax block
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

template <typename T>
inline void prefetch_values(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t off = 0; off < n * static_cast<int64_t>(sizeof(T)); off += 64) __builtin_prefetch(c + off, 0, 2);
}

inline Lanes lanes_max(Lanes a, Lanes b) {
  Lanes r;
#pragma omp simd
  for (int i = 0; i < kLanes; ++i) r[i] = a[i] > b[i] ? a[i] : b[i];
  return r;
}

// fast_exp on every lane: exp16 where there is AVX-512, exp8 with AVX2. The omp simd
// loop over fast_exp compiled its clamps into masked operations with a round trip
// through the stack: with exp16 the extend kernel ran 7-8% faster (qwen2's shape, one
// thread, AVX-512), with exp8 about 1.7x faster (the softmax had been half its time;
// a 1,024-token prompt of 16 heads, AVX2 on Zen 3, two threads).
inline Lanes lanes_exp(Lanes x) {
#if defined(__AVX512F__)
  return (Lanes)exp16((__m512)x);
#elif defined(__AVX2__) && defined(__FMA__)
  return (Lanes)exp8((__m256)x);
#else
  Lanes r;
#pragma omp simd
  for (int i = 0; i < kLanes; ++i) r[i] = fast_exp(x[i]);
  return r;
#endif
}

// bfloat16 queries over a bfloat16 pool, on a CPU with AVX512_BF16: the scores come
// from vdpbf16ps on the raw pool rows (two exact bf16 products per lane and
// instruction, float32 sums): half the instructions of converting K and using
// float32 FMAs, and no K conversion at all.
template <typename QT, typename KVT>
constexpr bool kPairedScores =
#if defined(__AVX512BF16__)
    std::is_same_v<QT, c10::BFloat16> && std::is_same_v<KVT, c10::BFloat16>;
#else
    false;
#endif

// The same pair of types, for P.V: each vdpbf16ps adds two keys' products, the
// probabilities of two keys (rounded to bf16, as torch's bf16 flash attention rounds
// them before its P.V product) against the two keys' values, paired per component
// from the raw pool rows. Half the instructions of float32 FMAs, and no V conversion.
template <typename QT, typename KVT>
constexpr bool kPairedValues =
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    kPairedScores<QT, KVT>;
#else
    false;
#endif

// Tiles of one key list done together: each block of keys is read and converted
// once for all of them (a key list that only one or two tiles read ran at 2/3 of
// the rate of one that eight tiles read).
constexpr int kTilesPerItem = 4;
constexpr int kMaxRows = kTilesPerItem * kLanes;

// The rows of one work item: row r (tile r / kLanes, lane r % kLanes) has query q[r]
// and sees keys [begin, end[r]), or with a window [start[r], end[r]) (start[r] >= begin).
template <typename QT>
struct TileRows {
  int count = 0;
  const QT* q[kMaxRows];
  int64_t start[kMaxRows];
  int64_t end[kMaxRows];
};

// Scratch of one thread.
struct Scratch {
  std::vector<Lanes> qt, ot, scores, p_pairs;
  std::vector<float> kf, vf;
  std::vector<uint32_t> v_pairs;
  // AMX: the block's K rows, contiguous, its values as pairs per component
  // (v_columns[i][j] = component i of keys 2j and 2j + 1), and a tile's P.V for the
  // block (pv[i]: component i of every row); Lanes for 64-byte alignment.
  std::vector<Lanes> k_block, v_columns, pv;
  explicit Scratch(int64_t d)
      : qt(kTilesPerItem * d), ot(kTilesPerItem * d), scores(kTilesPerItem * kKeyBlock), p_pairs(kTilesPerItem * kKeyBlock / 2),
        kf(kKeyBlock * d), vf(kKeyBlock * d), v_pairs(kKeyBlock / 2 * d), k_block(kKeyBlock * d / 32),
        v_columns(d), pv(d) {}
};

#if defined(__AVX512BF16__)
// Scores of N keys (rows k_rows[0..N)) for one tile whose qt holds bf16 pairs: N
// independent vdpbf16ps chains per query load (eight keep the unit busy through the
// instruction's latency; four left it idle a third of the time).
template <int N, typename KVT>
inline void paired_scores_n(const Lanes* qt, const KVT* const* k_rows, int64_t pairs, float scale, Lanes* scores) {
  __m512 s[N];
  const int32_t* k[N];
  for (int u = 0; u < N; ++u) {
    s[u] = _mm512_setzero_ps();
    k[u] = reinterpret_cast<const int32_t*>(k_rows[u]);
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh qv = (__m512bh)_mm512_castps_si512((__m512)qt[p]);
    for (int u = 0; u < N; ++u) s[u] = _mm512_dpbf16_ps(s[u], qv, (__m512bh)_mm512_set1_epi32(k[u][p]));
  }
  for (int u = 0; u < N; ++u) scores[u] = (Lanes)s[u] * scale;
}

// Scores of nb keys (rows k_rows[t] of the bf16 pool): eight keys at a time, then four, then one by one.
template <typename KVT>
void paired_scores(const Lanes* qt, const KVT* const* k_rows, int64_t nb, int64_t d, float scale, Lanes* scores) {
  const int64_t pairs = d / 2;
  int64_t t = 0;
  for (; t + 8 <= nb; t += 8) paired_scores_n<8>(qt, k_rows + t, pairs, scale, scores + t);
  for (; t + 4 <= nb; t += 4) paired_scores_n<4>(qt, k_rows + t, pairs, scale, scores + t);
  for (; t < nb; ++t) paired_scores_n<1>(qt, k_rows + t, pairs, scale, scores + t);
}
#else
template <typename KVT>
void paired_scores(const Lanes*, const KVT* const*, int64_t, int64_t, float, Lanes*) {}
#endif

// v_pairs[j * d + i] = component i of the values of keys 2j and 2j + 1 of a block of
// nb keys, as one bf16 pair (key 2j in the low half; zero past the block's end).
template <typename KVT>
void pair_value_rows(const KVT* const* v_rows, int64_t nb, int64_t d, uint32_t* v_pairs) {
  for (int64_t j = 0; 2 * j < nb; ++j) {
    const uint16_t* lo = reinterpret_cast<const uint16_t*>(v_rows[2 * j]);
    uint32_t* dst = v_pairs + j * d;
    if (2 * j + 1 < nb) {
      const uint16_t* hi = reinterpret_cast<const uint16_t*>(v_rows[2 * j + 1]);
      for (int64_t i = 0; i < d; ++i) dst[i] = static_cast<uint32_t>(lo[i]) | (static_cast<uint32_t>(hi[i]) << 16);
    } else {
      for (int64_t i = 0; i < d; ++i) dst[i] = lo[i];
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
// N components of Ot: Ot = alpha * Ot + sum over key pairs j of p_pairs[j] * (v pair j), one
// independent vdpbf16ps chain per component.
template <int N>
inline void paired_value_columns(const Lanes* p_pairs, int64_t n_pairs, const uint32_t* v_pairs, int64_t d,
                                 Lanes alpha, Lanes* ot) {
  __m512 o[N];
  for (int c = 0; c < N; ++c) o[c] = (__m512)(ot[c] * alpha);
  for (int64_t j = 0; j < n_pairs; ++j) {
    const __m512bh pp = (__m512bh)_mm512_castps_si512((__m512)p_pairs[j]);
    const uint32_t* v = v_pairs + j * d;
    for (int c = 0; c < N; ++c) o[c] = _mm512_dpbf16_ps(o[c], pp, (__m512bh)_mm512_set1_epi32(static_cast<int>(v[c])));
  }
  for (int c = 0; c < N; ++c) ot[c] = (Lanes)o[c];
}

// Ot = alpha * Ot + sum_t P[t] v_t over a block of nb keys, two keys per vdpbf16ps:
// p_pairs[j] holds, in each lane, the bf16 pair (P[2j], P[2j + 1]) of that row.
void paired_values(const Lanes* p, int64_t nb, const uint32_t* v_pairs, int64_t d, Lanes alpha, Lanes* ot,
                   Lanes* p_pairs) {
  const int64_t n_pairs = (nb + 1) / 2;
  for (int64_t j = 0; j < n_pairs; ++j) {
    const __m512 lo = (__m512)p[2 * j], hi = 2 * j + 1 < nb ? (__m512)p[2 * j + 1] : _mm512_setzero_ps();
    const __m512i halves = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words 0-15: lo, 16-31: hi
    p_pairs[j] = (Lanes)_mm512_castsi512_ps(interleave_halves(halves));
  }
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) paired_value_columns<8>(p_pairs, n_pairs, v_pairs + i, d, alpha, ot + i);
  for (; i + 4 <= d; i += 4) paired_value_columns<4>(p_pairs, n_pairs, v_pairs + i, d, alpha, ot + i);
  for (; i < d; ++i) paired_value_columns<1>(p_pairs, n_pairs, v_pairs + i, d, alpha, ot + i);
}
#else
inline void paired_values(const Lanes*, int64_t, const uint32_t*, int64_t, Lanes, Lanes*, Lanes*) {}
#endif

#if defined(RADIXSERVE_AMX)
// Tiles: 0-3 sums, 4, 5 and 7 the keys' rows or value columns, 6 the tile's query or
// probability pairs (all 16 rows x 64 bytes: radixserve_amx::configure_tiles).
constexpr int64_t kTileRow = 64;

// The block's nb K rows (bf16, head_dim d) one after another in kb; v_columns[i * 16 + j]
// = the bf16 pair (V[2j][i], V[2j + 1][i]), zero past the block's end.
template <typename KVT>
void tile_block_rows(const KVT* const* k_rows, const KVT* const* v_rows, int64_t nb, int64_t d, uint16_t* kb,
                     uint32_t* v_columns) {
  for (int64_t t = 0; t < nb; ++t) std::memcpy(kb + t * d, k_rows[t], d * sizeof(uint16_t));
  constexpr int64_t kPairs = kKeyBlock / 2;
  for (int64_t j = 0; j < kPairs; ++j) {
    const uint16_t* lo = 2 * j < nb ? reinterpret_cast<const uint16_t*>(v_rows[2 * j]) : nullptr;
    const uint16_t* hi = 2 * j + 1 < nb ? reinterpret_cast<const uint16_t*>(v_rows[2 * j + 1]) : nullptr;
    for (int64_t i = 0; i < d; ++i)
      v_columns[i * kPairs + j] = (lo ? lo[i] : 0u) | (hi ? static_cast<uint32_t>(hi[i]) << 16 : 0u);
  }
}

// Scores of the block's nb keys (kb, tile_block_rows) for one tile (qt: its rows' bf16
// query pairs per pair of components): scores[t] = scale * (k_t . q) in every lane.
void tile_scores(const Lanes* qt, const uint16_t* kb, int64_t nb, int64_t d, float scale, Lanes* scores) {
  const int64_t stride = d * sizeof(uint16_t);
  _tile_zero(0);
  _tile_zero(1);
  for (int64_t s = 0; s < d / 32; ++s) {
    _tile_loadd(6, qt + s * 16, kTileRow);
    _tile_loadd(4, kb + s * 32, stride);
    _tile_dpbf16ps(0, 4, 6);
    if (nb > 16) {
      _tile_loadd(5, kb + 16 * d + s * 32, stride);
      _tile_dpbf16ps(1, 5, 6);
    }
  }
  _tile_stored(0, scores, kTileRow);
  if (nb > 16) _tile_stored(1, scores + 16, kTileRow);
  for (int64_t t = 0; t < nb; ++t) scores[t] *= scale;
}

// A tile's probabilities over the block's nb keys (p: one vector per key) as bf16 pairs
// per pair of keys, as AMX takes them (and as the paired path rounds them); zero past nb.
void pair_probabilities(const Lanes* p, int64_t nb, Lanes* p_pairs) {
  for (int64_t j = 0; j < kKeyBlock / 2; ++j) {
    const __m512 lo = 2 * j < nb ? (__m512)p[2 * j] : _mm512_setzero_ps();
    const __m512 hi = 2 * j + 1 < nb ? (__m512)p[2 * j + 1] : _mm512_setzero_ps();
    p_pairs[j] = (Lanes)_mm512_castsi512_ps(interleave_halves((__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
  }
}

// Ot = alpha * Ot + P.V over the block (p_pairs from pair_probabilities, made for all
// of the item's tiles before the first of these: a tile load of pairs just stored
// waited for the stores, as did one of Ot just rescaled). The products come from tiles
// of 16 components into pv, and Ot takes them with its rescale in one pass.
void tile_values(const Lanes* p_pairs, const uint32_t* v_columns, int64_t d, Lanes alpha, Lanes* ot, Lanes* pv) {
  constexpr int64_t kPairs = kKeyBlock / 2;
  _tile_loadd(6, p_pairs, kTileRow);
  // Up to four tiles of components at once, on sums 0-3 and operands 4, 5, 7 and 4.
  for (int64_t c = 0; c < d; c += 64) {
    const int64_t n = std::min<int64_t>(4, (d - c) / 16);
    const uint32_t* v = v_columns + c * kPairs;
    _tile_zero(0);
    _tile_loadd(4, v, kTileRow);
    _tile_dpbf16ps(0, 4, 6);
    if (n > 1) {
      _tile_zero(1);
      _tile_loadd(5, v + 16 * kPairs, kTileRow);
      _tile_dpbf16ps(1, 5, 6);
    }
    if (n > 2) {
      _tile_zero(2);
      _tile_loadd(7, v + 32 * kPairs, kTileRow);
      _tile_dpbf16ps(2, 7, 6);
    }
    if (n > 3) {
      _tile_zero(3);
      _tile_loadd(4, v + 48 * kPairs, kTileRow);
      _tile_dpbf16ps(3, 4, 6);
    }
    _tile_stored(0, pv + c, kTileRow);
    if (n > 1) _tile_stored(1, pv + c + 16, kTileRow);
    if (n > 2) _tile_stored(2, pv + c + 32, kTileRow);
    if (n > 3) _tile_stored(3, pv + c + 48, kTileRow);
  }
  for (int64_t i = 0; i < d; ++i) ot[i] = ot[i] * alpha + pv[i];
}
#endif  // RADIXSERVE_AMX

// v, in a register: GCC otherwise folds a vector load that several FMAs share into
// each of them, one load per FMA.
inline Lanes in_register(Lanes v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  asm("" : "+x"(v));
#endif
  return v;
}

// Independent FMA chains per tile when NT tiles run side by side: 8, 4, 2 or 1,
// NT times that within kAccumulators.
constexpr int chains_per_tile(int nt) {
  const int n = kAccumulators / nt;
  return n >= 8 ? 8 : n >= 4 ? 4 : n >= 2 ? 2 : 1;
}

// Scores of keys kp[0..nb) (float32 rows) for the first NT tiles of an item (tile k's
// transposed, pre-scaled queries at qt + k * d) into scores[k * kKeyBlock + t]. Each
// key component is loaded once for all NT tiles and KEYS keys run side by side:
// NT x KEYS independent FMA chains share NT query loads and KEYS broadcasts, where
// one tile at a time issued a load per FMA.
template <int NT, int KEYS>
__attribute__((always_inline)) inline void tiles_scores_n(const Lanes* qt, int64_t d, const float* const* kp,
                                                          Lanes* scores) {
  Lanes s[NT][KEYS];
  for (int k = 0; k < NT; ++k)
    for (int u = 0; u < KEYS; ++u) s[k][u] = Lanes{};
  for (int64_t i = 0; i < d; ++i) {
    float kv[KEYS];
    for (int u = 0; u < KEYS; ++u) kv[u] = kp[u][i];
    for (int k = 0; k < NT; ++k) {
      const Lanes qv = in_register(qt[k * d + i]);
      for (int u = 0; u < KEYS; ++u) s[k][u] += qv * kv[u];
    }
  }
  for (int k = 0; k < NT; ++k)
    for (int u = 0; u < KEYS; ++u) scores[k * kKeyBlock + u] = s[k][u];
}

template <int NT>
void tiles_scores_nt(const Lanes* qt, int64_t d, const float* const* kp, int64_t nb, Lanes* scores) {
  constexpr int kKeys = chains_per_tile(NT);
  int64_t t = 0;
  for (; t + kKeys <= nb; t += kKeys) tiles_scores_n<NT, kKeys>(qt, d, kp + t, scores + t);
  for (; t < nb; ++t) tiles_scores_n<NT, 1>(qt, d, kp + t, scores + t);
}

inline void tiles_scores(int n_tiles, const Lanes* qt, int64_t d, const float* const* kp, int64_t nb,
                         Lanes* scores) {
  switch (n_tiles) {
    case 1: return tiles_scores_nt<1>(qt, d, kp, nb, scores);
    case 2: return tiles_scores_nt<2>(qt, d, kp, nb, scores);
    case 3: return tiles_scores_nt<3>(qt, d, kp, nb, scores);
    default: return tiles_scores_nt<4>(qt, d, kp, nb, scores);
  }
}

// Ot = alpha * Ot + sum_t P[t] v_t over nb keys (float32 rows vp[t]) for the first NT
// tiles (tile k's probabilities at p + k * kKeyBlock, its output at ot + k * d), COLS
// components of the head at a time: each value is broadcast once for all NT tiles.
template <int NT, int COLS>
__attribute__((always_inline)) inline void tiles_values_n(const Lanes* p, int64_t nb, const float* const* vp, int64_t d,
                                                          int64_t i, const Lanes* alpha, Lanes* ot) {
  Lanes o[NT][COLS];
  for (int k = 0; k < NT; ++k)
    for (int c = 0; c < COLS; ++c) o[k][c] = ot[k * d + i + c] * alpha[k];
  for (int64_t t = 0; t < nb; ++t) {
    float vv[COLS];
    for (int c = 0; c < COLS; ++c) vv[c] = vp[t][i + c];
    for (int k = 0; k < NT; ++k) {
      const Lanes pk = in_register(p[k * kKeyBlock + t]);
      for (int c = 0; c < COLS; ++c) o[k][c] += pk * vv[c];
    }
  }
  for (int k = 0; k < NT; ++k)
    for (int c = 0; c < COLS; ++c) ot[k * d + i + c] = o[k][c];
}

template <int NT>
void tiles_values_nt(const Lanes* p, int64_t nb, const float* const* vp, int64_t d, const Lanes* alpha, Lanes* ot) {
  constexpr int kCols = chains_per_tile(NT);
  int64_t i = 0;
  for (; i + kCols <= d; i += kCols) tiles_values_n<NT, kCols>(p, nb, vp, d, i, alpha, ot);
  for (; i < d; ++i) tiles_values_n<NT, 1>(p, nb, vp, d, i, alpha, ot);
}

inline void tiles_values(int n_tiles, const Lanes* p, int64_t nb, const float* const* vp, int64_t d,
                         const Lanes* alpha, Lanes* ot) {
  switch (n_tiles) {
    case 1: return tiles_values_nt<1>(p, nb, vp, d, alpha, ot);
    case 2: return tiles_values_nt<2>(p, nb, vp, d, alpha, ot);
    case 3: return tiles_values_nt<3>(p, nb, vp, d, alpha, ot);
    default: return tiles_values_nt<4>(p, nb, vp, d, alpha, ot);
  }
}

// One online-softmax step of a tile over a block of nb keys starting at key k0:
// scores are capped (cap > 0) and become probabilities (0 outside each row's keys:
// from its `start` when `below`, i.e. the block reaches below some row's window,
// up to its `end`), the running max m and sum l move on, and the returned factor
// rescales the tile's earlier output. Below a window's start a row may have seen
// no key yet: its max stays -inf, and its exponentials are taken against 0 so they
// stay 0 (not NaN).
__attribute__((always_inline)) inline Lanes softmax_block(Lanes* scores, int64_t nb, int64_t k0, int64_t min_end,
                                                         Lanes end, bool below, Lanes start, float cap, Lanes& m,
                                                         Lanes& l) {
  const Lanes zero = {};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  if (cap > 0.0f) cap_scores(reinterpret_cast<float*>(scores), nb * kLanes, 1.0f / cap, cap);
  if (below) {
    for (int64_t t = 0; t < nb; ++t) {
      const float key = static_cast<float>(k0 + t);
#pragma omp simd
      for (int lane = 0; lane < kLanes; ++lane)
        if (key >= end[lane] || key < start[lane]) scores[t][lane] = neg_inf;
    }
  } else if (k0 + nb > min_end) {  // only blocks past some row's last key
    for (int64_t t = 0; t < nb; ++t) {
      const float key = static_cast<float>(k0 + t);
#pragma omp simd
      for (int lane = 0; lane < kLanes; ++lane)
        if (key >= end[lane]) scores[t][lane] = neg_inf;
    }
  }
  const bool masked = below || k0 + nb > min_end;
  Lanes block_max = scores[0];
  for (int64_t t = 1; t < nb; ++t) block_max = lanes_max(block_max, scores[t]);
  const Lanes m_new = lanes_max(m, block_max);
  Lanes m_ref = m_new;
  if (below) {
#pragma omp simd
    for (int lane = 0; lane < kLanes; ++lane)
      if (m_new[lane] == neg_inf) m_ref[lane] = 0.0f;
  }
  const Lanes alpha = lanes_exp(m - m_ref);
  Lanes sum = zero;
  for (int64_t t = 0; t < nb; ++t) {
    Lanes p = lanes_exp(scores[t] - m_ref);
    if (masked) {
#pragma omp simd
      for (int lane = 0; lane < kLanes; ++lane)
        if (scores[t][lane] == neg_inf) p[lane] = 0.0f;
    }
    scores[t] = p;
    sum += p;
  }
  l = l * alpha + sum;
  m = m_new;
  return alpha;
}

// Online softmax of up to kMaxRows rows over keys [begin, their ends) of the key
// list `slots` (KV head at kv_offset in each pool row), or with kWindowed over
// [their starts, their ends). Leaves tile k's unnormalised output in
// sc.ot[k * d .. k * d + d) and its running max and sum in m[k], l[k]. Without a
// window every real row must see key `begin`; with one, begin must be the smallest
// start. Padding lanes see only key `begin` and are to be dropped.
template <bool kWindowed, typename QT, typename KVT>
void attend_tiles(const TileRows<QT>& rows, const KVT* k_pool, const KVT* v_pool, const int64_t* slots,
                  int64_t begin, int64_t kv_offset, const Dims& dm, float scale, float cap, Scratch& sc, Lanes* m,
                  Lanes* l) {
  const int64_t d = dm.d, row_len = dm.row_len;
  const int n_tiles = (rows.count + kLanes - 1) / kLanes;
  Lanes* scores = sc.scores.data();  // [kTilesPerItem][kKeyBlock]: one key's score in every row of a tile
  float* kf = sc.kf.data();
  float* vf = sc.vf.data();
  const Lanes zero = {};
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const bool paired = kPairedScores<QT, KVT> && d % 2 == 0;
#if defined(RADIXSERVE_AMX)
  const bool on_tiles = paired && kPairedValues<QT, KVT> && radixserve_amx::enabled && d % 32 == 0;
  uint16_t* k_block = reinterpret_cast<uint16_t*>(sc.k_block.data());
  uint32_t* v_columns = reinterpret_cast<uint32_t*>(sc.v_columns.data());
#endif
  const KVT* k_rows[kKeyBlock];  // the block's K and V rows in the pool
  const KVT* v_rows[kKeyBlock];
  const float* k_float[kKeyBlock];  // the same rows in float32: the pool's own, or converted into kf and vf
  const float* v_float[kKeyBlock];
  if constexpr (!std::is_same_v<KVT, float>) {
    for (int64_t t = 0; t < kKeyBlock; ++t) {
      k_float[t] = kf + t * d;
      v_float[t] = vf + t * d;
    }
  }

  Lanes end[kTilesPerItem], start[kTilesPerItem];
  int64_t min_end[kTilesPerItem], max_end[kTilesPerItem], min_start[kTilesPerItem], max_start[kTilesPerItem];
  int64_t last = begin + 1;
  for (int k = 0; k < n_tiles; ++k) {
    Lanes* qt = sc.qt.data() + k * d;  // [d]: component i of every row of tile k
    min_end[k] = std::numeric_limits<int64_t>::max();
    max_end[k] = begin + 1;
    min_start[k] = max_start[k] = begin;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int r = k * kLanes + lane;
      int64_t e = begin + 1, st = begin;
      if (r < rows.count && paired) {  // qt[p] holds the bf16 pair (q[2p], q[2p + 1]) of each row, unscaled
        e = rows.end[r];
        const uint32_t* pairs = reinterpret_cast<const uint32_t*>(rows.q[r]);
        for (int64_t p = 0; p < d / 2; ++p) qt[p][lane] = bits_to_float(pairs[p]);
      } else if (r < rows.count) {
        e = rows.end[r];
        for (int64_t i = 0; i < d; ++i) qt[i][lane] = static_cast<float>(rows.q[r][i]) * scale;
      } else {
        for (int64_t i = 0; i < d; ++i) qt[i][lane] = 0.0f;
      }
      if (kWindowed && r < rows.count) st = rows.start[r];
      min_end[k] = std::min(min_end[k], e);
      max_end[k] = std::max(max_end[k], e);
      min_start[k] = std::min(min_start[k], st);
      max_start[k] = std::max(max_start[k], st);
      end[k][lane] = static_cast<float>(e);
      start[k][lane] = static_cast<float>(st);
    }
    last = std::max(last, max_end[k]);
    m[k] = zero + neg_inf;
    l[k] = zero;
    Lanes* ot = sc.ot.data() + k * d;
    for (int64_t i = 0; i < d; ++i) ot[i] = zero;
  }

  for (int64_t k0 = begin; k0 < last; k0 += kKeyBlock) {
    const int64_t block = std::min(kKeyBlock, last - k0);
    for (int64_t t = 0; t < block; ++t) {
      const int64_t slot = slots[k0 + t];
      k_rows[t] = k_pool + slot * row_len + kv_offset;
      v_rows[t] = v_pool + slot * row_len + kv_offset;
      if constexpr (std::is_same_v<KVT, float>) {  // a float32 pool is read in place
        k_float[t] = k_rows[t];
        v_float[t] = v_rows[t];
      } else {
        if (!paired) as_float_into(k_rows[t], kf + t * d, d);
        if constexpr (!kPairedValues<QT, KVT>) as_float_into(v_rows[t], vf + t * d, d);
      }
      if (k0 + kKeyBlock + t < last) {  // the next block's rows, scattered over the pool, while this one computes
        const int64_t ahead = slots[k0 + kKeyBlock + t] * row_len + kv_offset;
        prefetch_values(k_pool + ahead, d);
        prefetch_values(v_pool + ahead, d);
      }
    }
#if defined(RADIXSERVE_AMX)
    if (on_tiles) {
      tile_block_rows(k_rows, v_rows, block, d, k_block, v_columns);
    } else
#endif
        if constexpr (kPairedValues<QT, KVT>) {
      pair_value_rows(v_rows, block, d, sc.v_pairs.data());
    }
    if (!paired) {  // every tile at once: scores, each tile's softmax, P.V
      tiles_scores(n_tiles, sc.qt.data(), d, k_float, block, scores);
      Lanes alpha[kTilesPerItem];
      for (int k = 0; k < n_tiles; ++k) {
        Lanes* tile_scores = scores + k * kKeyBlock;
        // A causal tile that ends before this block, or whose windows start after it: it adds nothing.
        if (max_end[k] <= k0 || (kWindowed && min_start[k] >= k0 + block)) {
          alpha[k] = zero + 1.0f;
          for (int64_t t = 0; t < block; ++t) tile_scores[t] = zero;
          continue;
        }
        alpha[k] = softmax_block(tile_scores, block, k0, min_end[k], end[k], kWindowed && k0 < max_start[k], start[k],
                                 cap, m[k], l[k]);
      }
      if constexpr (kPairedValues<QT, KVT>) {  // bfloat16 at an odd head_dim: the scores were not paired
        for (int k = 0; k < n_tiles; ++k)
          paired_values(scores + k * kKeyBlock, block, sc.v_pairs.data(), d, alpha[k], sc.ot.data() + k * d,
                        sc.p_pairs.data());
      } else {
        tiles_values(n_tiles, scores, block, v_float, d, alpha, sc.ot.data());
      }
      continue;
    }
#if defined(RADIXSERVE_AMX)
    if (on_tiles) {  // every tile's scores and probabilities, then every tile's P.V
      Lanes alpha[kTilesPerItem];
      bool sees[kTilesPerItem];
      for (int k = 0; k < n_tiles; ++k) {
        sees[k] = !(max_end[k] <= k0 || (kWindowed && min_start[k] >= k0 + block));
        if (!sees[k]) continue;
        const int64_t nb = std::min(block, max_end[k] - k0);
        Lanes* tile_scores_k = scores + k * kKeyBlock;
        tile_scores(sc.qt.data() + k * d, k_block, nb, d, scale, tile_scores_k);
        alpha[k] = softmax_block(tile_scores_k, nb, k0, min_end[k], end[k], kWindowed && k0 < max_start[k], start[k],
                                 cap, m[k], l[k]);
        pair_probabilities(tile_scores_k, nb, sc.p_pairs.data() + k * kKeyBlock / 2);
      }
      for (int k = 0; k < n_tiles; ++k)
        if (sees[k])
          tile_values(sc.p_pairs.data() + k * kKeyBlock / 2, v_columns, d, alpha[k], sc.ot.data() + k * d,
                      sc.pv.data());
      continue;
    }
#endif
    for (int k = 0; k < n_tiles; ++k) {
      if (max_end[k] <= k0 || (kWindowed && min_start[k] >= k0 + block)) continue;  // nothing of this block for the tile
      const int64_t nb = std::min(block, max_end[k] - k0);
      paired_scores(sc.qt.data() + k * d, k_rows, nb, d, scale, scores);
      const Lanes alpha =
          softmax_block(scores, nb, k0, min_end[k], end[k], kWindowed && k0 < max_start[k], start[k], cap, m[k], l[k]);
      if constexpr (kPairedValues<QT, KVT>) {
        paired_values(scores, nb, sc.v_pairs.data(), d, alpha, sc.ot.data() + k * d, sc.p_pairs.data());
      } else {
        Lanes* ot = sc.ot.data() + k * d;
        tiles_values(1, scores, nb, v_float, d, &alpha, ot);
      }
    }
  }
}

// Row r's unnormalised output component x, after attend_tiles.
inline float row_out(const Scratch& sc, int r, int64_t x, int64_t d) { return sc.ot[(r / kLanes) * d + x][r % kLanes]; }

// A tile of work: `rows` rows starting at row `first_row` of unit `unit` (a request
// in extend, a group in cascade) for one KV head; cost ~ rows x keys.
struct TileItem {
  int64_t unit, kv_head, first_row, rows, cost;
};

// Run `fn(item, scratch)` over the items on all threads, largest first.
template <typename F>
void run_tiles(std::vector<TileItem>& items, int64_t d, F&& fn) {
  std::stable_sort(items.begin(), items.end(), [](const TileItem& a, const TileItem& b) { return a.cost > b.cost; });
  const int64_t n_items = static_cast<int64_t>(items.size());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    Scratch scratch(d);
#if defined(RADIXSERVE_AMX)
    if (radixserve_amx::enabled) radixserve_amx::configure_tiles();
#endif
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) fn(items[i], scratch);
#if defined(RADIXSERVE_AMX)
    if (radixserve_amx::enabled) _tile_release();
#endif
  });
}

// Cut `total_rows` rows of a unit into items of up to kMaxRows rows, for every KV head.
void add_tiles(std::vector<TileItem>& items, int64_t unit, int64_t total_rows, int64_t kv_heads, int64_t keys) {
  for (int64_t kh = 0; kh < kv_heads; ++kh)
    for (int64_t f = 0; f < total_rows; f += kMaxRows) {
      const int64_t rows = std::min<int64_t>(kMaxRows, total_rows - f);
      items.push_back({unit, kh, f, rows, rows * keys});
    }
}

// Normalise an item's rows and write them: row r goes to dst[r] (head_dim values).
template <typename QT>
void write_rows(const Scratch& sc, const Lanes* l, int count, QT* const* dst, int64_t d) {
  for (int r = 0; r < count; ++r) {
    const float inv = 1.0f / l[r / kLanes][r % kLanes];
    for (int64_t x = 0; x < d; ++x) dst[r][x] = static_cast<QT>(row_out(sc, r, x, d) * inv);
  }
}

template <typename QT, typename KVT>
void extend_impl(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                 const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& q_starts,
                 const at::Tensor& kv_lens, double scaling, ScoreOptions opts, at::Tensor& out) {
  const int64_t n_reqs = rows.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_buf.size(1);
  const Dims dm{heads, heads / kv_heads, d, kv_heads * d};
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* start_ptr = q_starts.data_ptr<int64_t>();
  const int64_t* len_ptr = kv_lens.data_ptr<int64_t>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.stride(0), q_s0 = q.stride(0), q_s1 = q.stride(1);

  const bool windowed = opts.window > 0;
  std::vector<TileItem> items;
  for (int64_t b = 0; b < n_reqs; ++b) {
    const int64_t n = start_ptr[b + 1] - start_ptr[b], kv_len = len_ptr[b];
    TORCH_CHECK(n >= 0 && n <= kv_len && kv_len <= req_to_token.size(1), "cpu_paged: request ", b, " has ", n,
                " new tokens and ", kv_len, " keys");
    // (Two vectors per tile, for more FMAs per load, measured slower on fresh prompts and no faster over prefixes.)
    // An item's keys: all of them, or under a window about the window and the item's own queries.
    add_tiles(items, b, n * dm.group, kv_heads, windowed ? std::min(kv_len, opts.window + kMaxRows) : kv_len);
  }
  const QT* q_ptr = q.data_ptr<QT>();
  QT* out_ptr = out.data_ptr<QT>();
  const KVT* k_ptr = k_buf.data_ptr<KVT>();
  const KVT* v_ptr = v_buf.data_ptr<KVT>();
  const float scale = static_cast<float>(scaling);
  run_tiles(items, d, [&](const TileItem& it, Scratch& sc) {
    const int64_t b = it.unit, n = start_ptr[b + 1] - start_ptr[b], prefix = len_ptr[b] - n;
    TileRows<QT> tile;
    QT* dst[kMaxRows];
    tile.count = static_cast<int>(it.rows);
    for (int r = 0; r < tile.count; ++r) {
      const int64_t f = it.first_row + r, token = start_ptr[b] + f / dm.group;
      const int64_t h = it.kv_head * dm.group + f % dm.group;
      tile.q[r] = q_ptr + token * q_s0 + h * q_s1;
      tile.end[r] = prefix + f / dm.group + 1;
      tile.start[r] = windowed ? std::max<int64_t>(0, tile.end[r] - opts.window) : 0;
      dst[r] = out_ptr + (token * heads + h) * d;
    }
    Lanes m[kTilesPerItem], l[kTilesPerItem];
    // Rows are query-major: the first row's window starts first.
    const int64_t* slots = table + row_ptr[b] * table_stride;
    if (windowed)
      attend_tiles<true>(tile, k_ptr, v_ptr, slots, tile.start[0], it.kv_head * d, dm, scale, opts.softcap, sc, m, l);
    else
      attend_tiles<false>(tile, k_ptr, v_ptr, slots, 0, it.kv_head * d, dm, scale, opts.softcap, sc, m, l);
    write_rows(sc, l, tile.count, dst, d);
  });
}

template <typename QT, typename KVT>
void cascade_impl(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& group_starts,
                  const at::Tensor& shared_lens, const at::Tensor& suffix_out, const at::Tensor& suffix_lse,
                  double scaling, float softcap, at::Tensor& out) {
  const int64_t n_queries = q.size(0), heads = q.size(1), d = q.size(2), kv_heads = k_buf.size(1);
  const int64_t n_groups = shared_lens.size(0);
  const Dims dm{heads, heads / kv_heads, d, kv_heads * d};
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* group_ptr = group_starts.data_ptr<int64_t>();
  const int64_t* shared_ptr = shared_lens.data_ptr<int64_t>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t table_stride = req_to_token.stride(0), q_s0 = q.stride(0), q_s1 = q.stride(1);
  const QT* q_ptr = q.data_ptr<QT>();
  const QT* suffix_ptr = suffix_out.data_ptr<QT>();
  const float* suffix_lse_ptr = suffix_lse.data_ptr<float>();
  QT* out_ptr = out.data_ptr<QT>();
  const KVT* k_ptr = k_buf.data_ptr<KVT>();
  const KVT* v_ptr = v_buf.data_ptr<KVT>();
  const float scale = static_cast<float>(scaling);
  TORCH_CHECK(group_ptr[0] == 0 && group_ptr[n_groups] == n_queries, "cpu_paged: groups must cover every query");

  // Each group's rows against its shared prefix, merged with each row's own part:
  // out = (acc + e^(lse - m) * suffix) / (l + e^(lse - m)) at the common max.
  std::vector<TileItem> items;
  for (int64_t g = 0; g < n_groups; ++g) {
    TORCH_CHECK(group_ptr[g] < group_ptr[g + 1] && shared_ptr[g] >= 1 && shared_ptr[g] <= req_to_token.size(1),
                "cpu_paged: group ", g, " is empty or its shared length is out of range");
    add_tiles(items, g, (group_ptr[g + 1] - group_ptr[g]) * dm.group, kv_heads, shared_ptr[g]);
  }
  run_tiles(items, d, [&](const TileItem& it, Scratch& sc) {
    const int64_t g = it.unit;
    TileRows<QT> tile;
    int64_t state[kMaxRows];  // each row's (query, head) index
    tile.count = static_cast<int>(it.rows);
    for (int r = 0; r < tile.count; ++r) {
      const int64_t f = it.first_row + r, n = group_ptr[g] + f / dm.group, h = it.kv_head * dm.group + f % dm.group;
      tile.q[r] = q_ptr + n * q_s0 + h * q_s1;
      tile.end[r] = shared_ptr[g];
      state[r] = n * heads + h;
    }
    Lanes m[kTilesPerItem], l[kTilesPerItem];
    attend_tiles<false>(tile, k_ptr, v_ptr, table + row_ptr[group_ptr[g]] * table_stride, 0, it.kv_head * d, dm,
                        scale, softcap, sc, m, l);
    for (int r = 0; r < tile.count; ++r) {
      const int64_t s = state[r];
      const float m1 = m[r / kLanes][r % kLanes], l1 = l[r / kLanes][r % kLanes], lse2 = suffix_lse_ptr[s];
      const float m_all = std::max(m1, lse2);
      const float w1 = fast_exp(m1 - m_all), w2 = fast_exp(lse2 - m_all);
      const float inv = 1.0f / (l1 * w1 + w2);
      const QT* own = suffix_ptr + s * d;
      QT* dst = out_ptr + s * d;
      for (int64_t x = 0; x < d; ++x)
        dst[x] = static_cast<QT>((row_out(sc, r, x, d) * w1 + static_cast<float>(own[x]) * w2) * inv);
    }
  });
}

}  // namespace

void extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& q_starts,
                      const at::Tensor& kv_lens, double scaling, ScoreOptions opts, at::Tensor& out) {
  dispatch_dtypes(q.scalar_type(), k_buf.scalar_type(), [&](auto qt, auto kvt) {
    extend_impl<decltype(qt), decltype(kvt)>(q, k_buf, v_buf, req_to_token, rows, q_starts, kv_lens, scaling, opts,
                                             out);
  });
}

void cascade_decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                              const at::Tensor& req_to_token, const at::Tensor& rows,
                              const at::Tensor& group_starts, const at::Tensor& shared_lens,
                              const at::Tensor& suffix_out, const at::Tensor& suffix_lse, double scaling,
                              float softcap, at::Tensor& out) {
  dispatch_dtypes(q.scalar_type(), k_buf.scalar_type(), [&](auto qt, auto kvt) {
    cascade_impl<decltype(qt), decltype(kvt)>(q, k_buf, v_buf, req_to_token, rows, group_starts, shared_lens,
                                              suffix_out, suffix_lse, scaling, softcap, out);
  });
}

}  // namespace radixserve_cpu_paged
