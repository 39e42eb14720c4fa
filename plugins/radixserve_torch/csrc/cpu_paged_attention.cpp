// Paged attention on the CPU that reads K/V in place from the KV pool.
//
// One query row n (a decode request, or one new token of an extend) attends to
// the first lens[n] tokens of request row rows[n] of req_to_token; token t
// lives in pool slot req_to_token[rows[n], t]. A work item is (query, key
// range) with all heads: each key's pool row (every KV head of one slot,
// contiguous) is read once, converted to float32 once, and used by all query
// heads. Scores, softmax and accumulation are float32, with an online
// (flash-decoding style) softmax over blocks of keys; rows are prefetched a few
// keys ahead. When there are too few queries to keep every thread busy, long
// key ranges are split and the partial results merged afterwards. Threads take
// items longest first from a shared counter.
//
// The inner loops are plain loops over head_dim that the compiler vectorises
// (-O3 -march=native, `omp simd`); only the dot product's final lane sum uses
// AVX-512 intrinsics where available. Registered as torch.ops.radixserve_cpu_paged.

// Only ATen and the op registry: including <torch/extension.h> (pybind and the
// whole C++ API) made the first build four times slower.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kBlock = 32;       // keys per online-softmax block
constexpr int64_t kPrefetch = 12;    // pool rows requested (into L2) ahead of use; <= kBlock
constexpr int64_t kItemsPerThread = 8;  // split long ranges until about this many items per thread
constexpr int64_t kMinSplit = 128;   // ... but never into ranges shorter than this

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t float_to_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// exp(x) for x <= 0 in plain arithmetic (vectorisable): 2^n * e^r with
// r = x - n ln2 in [-ln2/2, ln2/2] and a degree-6 Taylor polynomial (relative
// error < 2e-7). Inputs below -87 (including -inf) give about 1e-38, which
// is 0 for every weight it multiplies.
inline float exp_nonpositive(float x) {
  x = x < -87.0f ? -87.0f : x;
  const float t = x * 1.44269504088896341f;
  const float big = t + 12582912.0f;  // 1.5 * 2^23: rounds t to the nearest integer
  const float n = big - 12582912.0f;
  const int32_t ni = static_cast<int32_t>(float_to_bits(big)) - 0x4B400000;
  const float r = x - n * 0.693147180559945309f;
  float p = 1.0f / 720.0f;
  p = p * r + 1.0f / 120.0f;
  p = p * r + 1.0f / 24.0f;
  p = p * r + 1.0f / 6.0f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  return p * bits_to_float(static_cast<uint32_t>(ni + 127) << 23);
}

// One row of head_dim values as float32: bfloat16 by a shift, half by its
// conversion, float32 without a copy.
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

// sum(a[i] * b[i]). The compiler vectorises the products of a plain loop but
// ends an `omp simd` reduction with a serial chain of scalar adds, which at
// 16 dot products per key dominated the kernel; with AVX-512 the lanes are
// summed by a shuffle tree instead.
inline float dot(const float* a, const float* b, int64_t d) {
#if defined(__AVX512F__)
  if (d % 32 == 0) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; i += 32) {
      acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a + i + 16), _mm512_loadu_ps(b + i + 16), acc1);
    }
    return _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
  }
#endif
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

// Shapes one item needs: H query heads in groups of G per KV head, head dim D,
// a pool row (one slot, all KV heads) of row_len = KVH * D elements.
struct Dims {
  int64_t heads, group, d, row_len;
};

// Attend the (scaled, float32) queries q[H][D] to keys [begin, end) of one
// request. Output: per head the running max m, sum l and unnormalised acc[D].
template <typename T>
void attend(const T* k_pool, const T* v_pool, const int64_t* slots, int64_t begin, int64_t end, const float* q,
            const Dims& dm, float* m, float* l, float* acc, float* scores, float* row) {
  const int64_t heads = dm.heads, group = dm.group, d = dm.d, row_len = dm.row_len;
  std::fill(m, m + heads, -std::numeric_limits<float>::infinity());
  std::fill(l, l + heads, 0.0f);
  std::fill(acc, acc + heads * d, 0.0f);
  for (int64_t t = begin; t < std::min(end, begin + kPrefetch); ++t) prefetch_row(k_pool + slots[t] * row_len, row_len);
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
    for (int64_t h = 0; h < heads; ++h) {
      float* sh = scores + h * kBlock;
      float block_max = sh[0];
      for (int64_t t = 1; t < nb; ++t) block_max = std::max(block_max, sh[t]);
      const float m_new = std::max(m[h], block_max);
      const float alpha = exp_nonpositive(m[h] - m_new);
      float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < nb; ++t) {
        sh[t] = exp_nonpositive(sh[t] - m_new);
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

template <typename T>
void paged_attention_impl(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                          const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens,
                          double scaling, at::Tensor& out) {
  const int64_t n_queries = q.size(0), heads = q.size(1), d = q.size(2);
  const Dims dm{heads, heads / k_buf.size(1), d, k_buf.size(1) * d};
  const int64_t q_s0 = q.stride(0), q_s1 = q.stride(1), table_stride = req_to_token.stride(0);
  const T* q_ptr = q.data_ptr<T>();
  const T* k_ptr = k_buf.data_ptr<T>();
  const T* v_ptr = v_buf.data_ptr<T>();
  const int64_t* table = req_to_token.data_ptr<int64_t>();
  const int64_t* row_ptr = rows.data_ptr<int64_t>();
  const int64_t* len_ptr = lens.data_ptr<int64_t>();
  T* out_ptr = out.data_ptr<T>();
  const float scale = static_cast<float>(scaling);

  // Split key ranges only when there are too few queries to keep every thread busy.
  const int64_t threads = at::get_num_threads();
  int64_t chunk = std::numeric_limits<int64_t>::max();
  if (n_queries < kItemsPerThread * threads) {
    const int64_t max_len = *std::max_element(len_ptr, len_ptr + n_queries);
    const int64_t want = (kItemsPerThread * threads + n_queries - 1) / n_queries;  // splits per query
    chunk = std::max(kMinSplit, (max_len + want - 1) / want);
  }
  std::vector<Item> items;
  std::vector<int64_t> first_split(n_queries + 1, 0);
  for (int64_t n = 0; n < n_queries; ++n) {
    const int64_t len = len_ptr[n];
    TORCH_CHECK(len >= 1 && len <= req_to_token.size(1), "cpu_paged: key length ", len, " out of range");
    const int64_t splits = chunk >= len ? 1 : (len + chunk - 1) / chunk;
    for (int64_t s = 0; s < splits; ++s) {
      const int64_t begin = s * chunk;
      items.push_back({n, begin, std::min(len, begin + chunk), first_split[n] + s});
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

  std::atomic<int64_t> next{0};
  const int64_t n_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, threads, 1, [&](int64_t, int64_t) {
    std::vector<float> qf(heads * d), scores(heads * kBlock), row(dm.row_len), ml(2 * heads), acc(heads * d);
    for (int64_t i = next.fetch_add(1); i < n_items; i = next.fetch_add(1)) {
      const Item& it = items[i];
      for (int64_t h = 0; h < heads; ++h) {
        const T* src = q_ptr + it.query * q_s0 + h * q_s1;
        for (int64_t x = 0; x < d; ++x) qf[h * d + x] = static_cast<float>(src[x]) * scale;
      }
      float* m = split ? part_ml.data() + it.split * heads * 2 : ml.data();
      float* l = m + heads;
      float* a = split ? part_acc.data() + it.split * heads * d : acc.data();
      attend<T>(k_ptr, v_ptr, table + row_ptr[it.query] * table_stride, it.begin, it.end, qf.data(), dm, m, l, a,
                scores.data(), row.data());
      if (!split) {
        T* dst = out_ptr + it.query * heads * d;
        for (int64_t h = 0; h < heads; ++h) {
          const float inv = 1.0f / l[h];
          for (int64_t x = 0; x < d; ++x) dst[h * d + x] = static_cast<T>(a[h * d + x] * inv);
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
          const float w = exp_nonpositive(part_ml[s * heads * 2 + h] - m_all);
          l_all += w * part_ml[s * heads * 2 + heads + h];
          const float* src = part_acc.data() + (s * heads + h) * d;
          for (int64_t x = 0; x < d; ++x) acc[x] += w * src[x];
        }
        T* dst = out_ptr + (n * heads + h) * d;
        const float inv = 1.0f / l_all;
        for (int64_t x = 0; x < d; ++x) dst[x] = static_cast<T>(acc[x] * inv);
      }
    }
  });
}

}  // namespace

// q [N, H, D] (rows and heads may be strided, head_dim contiguous); k_buf/v_buf
// [slots, KVH, D] contiguous; req_to_token [R, C] int64; rows/lens [N] int64;
// out [N, H, D] contiguous, same dtype as q and the pool.
void paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens, double scaling,
                     at::Tensor out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "cpu_paged: q must be [N, H, D] with a contiguous last dim");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes(),
              "cpu_paged: the K/V buffers must be contiguous [slots, KVH, D]");
  TORCH_CHECK(k_buf.size(2) == q.size(2) && q.size(1) % k_buf.size(1) == 0, "cpu_paged: head shapes do not match");
  TORCH_CHECK(q.scalar_type() == k_buf.scalar_type() && v_buf.scalar_type() == k_buf.scalar_type() &&
                  out.scalar_type() == q.scalar_type(),
              "cpu_paged: q, K/V pool and out must share one dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "cpu_paged: out must be contiguous like q");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.stride(1) == 1 && rows.is_contiguous() &&
                  lens.is_contiguous() && rows.scalar_type() == at::kLong && lens.scalar_type() == at::kLong &&
                  rows.numel() == q.size(0) && lens.numel() == q.size(0),
              "cpu_paged: req_to_token, rows and lens must be int64 (rows/lens contiguous, one per query)");
  if (q.size(0) == 0) return;
  switch (q.scalar_type()) {
    case at::kFloat:
      paged_attention_impl<float>(q, k_buf, v_buf, req_to_token, rows, lens, scaling, out);
      break;
    case at::kBFloat16:
      paged_attention_impl<c10::BFloat16>(q, k_buf, v_buf, req_to_token, rows, lens, scaling, out);
      break;
    case at::kHalf:
      paged_attention_impl<c10::Half>(q, k_buf, v_buf, req_to_token, rows, lens, scaling, out);
      break;
    default:
      TORCH_CHECK(false, "cpu_paged: unsupported dtype ", q.scalar_type());
  }
}

TORCH_LIBRARY(radixserve_cpu_paged, m) {
  m.def("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor rows, Tensor lens, "
        "float scaling, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_paged, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
