// The cpu_paged attention ops: argument checks and registration as
// torch.ops.radixserve_cpu_paged.{store_kv, paged_attention, paged_attention_with_lse,
// extend_attention, cascade_decode_attention}.
#include <torch/library.h>

#include <cstring>
#include <type_traits>

#include "cpu_paged_common.h"

namespace {

void check_common(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                  const at::Tensor& req_to_token, const at::Tensor& out) {
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "cpu_paged: q must be [N, H, D] with a contiguous last dim");
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes(),
              "cpu_paged: the K/V buffers must be contiguous [slots, KVH, D]");
  TORCH_CHECK(k_buf.size(2) == q.size(2) && q.size(1) % k_buf.size(1) == 0, "cpu_paged: head shapes do not match");
  TORCH_CHECK(v_buf.scalar_type() == k_buf.scalar_type() && out.scalar_type() == q.scalar_type(),
              "cpu_paged: K and V share one dtype, out has q's dtype");
  TORCH_CHECK(out.is_contiguous() && out.sizes() == q.sizes(), "cpu_paged: out must be contiguous like q");
  TORCH_CHECK(req_to_token.scalar_type() == at::kLong && req_to_token.stride(1) == 1,
              "cpu_paged: req_to_token must be int64 with contiguous rows");
}

// A layer's window (keys; 0: none) and logit cap (0: none), checked.
radixserve_cpu_paged::ScoreOptions score_options(int64_t sliding_window, double logit_softcap) {
  TORCH_CHECK(sliding_window >= 0 && logit_softcap >= 0.0, "cpu_paged: sliding_window ", sliding_window,
              " and logit_softcap ", logit_softcap, " must be >= 0 (0: none)");
  return {sliding_window, static_cast<float>(logit_softcap)};
}

void check_index(const at::Tensor& t, int64_t numel, const char* name) {
  TORCH_CHECK(t.is_contiguous() && t.scalar_type() == at::kLong && t.numel() == numel, "cpu_paged: ", name,
              " must be a contiguous int64 tensor of ", numel, " elements");
}

// Row i of src [n, KVH, D] into pool row loc[i] of dst, converted to dst's dtype.
template <typename Src, typename Dst>
void store_rows(const at::Tensor& src, const int64_t* loc, at::Tensor& dst) {
  const int64_t n = src.size(0), heads = src.size(1), d = src.size(2), s0 = src.stride(0), s1 = src.stride(1);
  const int64_t row_len = heads * d;
  const Src* from = src.data_ptr<Src>();
  Dst* to = dst.data_ptr<Dst>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      Dst* row = to + loc[i] * row_len;
      for (int64_t h = 0; h < heads; ++h) {
        const Src* x = from + i * s0 + h * s1;
        if constexpr (std::is_same_v<Src, Dst>) {
          std::memcpy(row + h * d, x, d * sizeof(Src));
        } else {
          for (int64_t j = 0; j < d; ++j) row[h * d + j] = static_cast<Dst>(static_cast<float>(x[j]));  // nearest even
        }
      }
    }
  });
}

void store_one(const at::Tensor& src, const at::Tensor& loc, at::Tensor& buf, const char* name) {
  TORCH_CHECK(src.dim() == 3 && src.stride(2) == 1 && src.size(0) == loc.numel() && src.size(1) == buf.size(1) &&
                  src.size(2) == buf.size(2),
              "cpu_paged: ", name, " must be [n, KVH, D] with a contiguous last dim, one row per slot in loc");
  const at::ScalarType from = src.scalar_type(), to = buf.scalar_type();
  TORCH_CHECK(from == to || (from == at::kFloat && (to == at::kBFloat16 || to == at::kHalf)), "cpu_paged: ", name,
              " in ", from, " cannot be stored in a ", to, " pool");
  radixserve_cpu_paged::dispatch_dtypes(from, to, [&](auto s, auto d) {
    store_rows<decltype(s), decltype(d)>(src, loc.data_ptr<int64_t>(), buf);
  });
}
}  // namespace

// The new tokens' K and V [n, KVH, D] (rows and heads may be strided, head_dim
// contiguous) into pool slots loc [n] (int64) of k_buf/v_buf [slots, KVH, D]: a copy
// in the pool's dtype, or float32 rounded to a bfloat16/float16 pool as torch's .to() rounds.
void store_kv(const at::Tensor& k, const at::Tensor& v, const at::Tensor& loc, at::Tensor k_buf, at::Tensor v_buf) {
  TORCH_CHECK(k_buf.is_contiguous() && v_buf.is_contiguous() && k_buf.dim() == 3 && k_buf.sizes() == v_buf.sizes() &&
                  k_buf.scalar_type() == v_buf.scalar_type(),
              "cpu_paged: the K/V buffers must be contiguous [slots, KVH, D] of one dtype");
  check_index(loc, loc.numel(), "loc");
  if (loc.numel() == 0) return;
  const int64_t* slots = loc.data_ptr<int64_t>();
  const auto [lo, hi] = std::minmax_element(slots, slots + loc.numel());
  TORCH_CHECK(*lo >= 0 && *hi < k_buf.size(0), "cpu_paged: a slot in loc is outside the pool of ", k_buf.size(0));
  store_one(k, loc, k_buf, "k");
  store_one(v, loc, v_buf, "v");
}

// Decode, one query per request. q [N, H, D] (rows and heads may be strided, head_dim
// contiguous); k_buf/v_buf [slots, KVH, D] contiguous; req_to_token [R, C] int64;
// rows/lens [N] int64; out [N, H, D] contiguous, q's dtype. Every op takes the layer's
// softmax scale, sliding window (keys, 0: none) and logit cap (0: none).
void paged_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                     const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens, double scaling,
                     int64_t sliding_window, double logit_softcap, at::Tensor out) {
  check_common(q, k_buf, v_buf, req_to_token, out);
  check_index(rows, q.size(0), "rows");
  check_index(lens, q.size(0), "lens");
  const auto opts = score_options(sliding_window, logit_softcap);
  if (q.size(0) == 0) return;
  radixserve_cpu_paged::decode_attention(q, k_buf, v_buf, req_to_token, rows, lens, scaling, opts, out);
}

// Extend: request b's new queries are q[q_starts[b] : q_starts[b + 1]] and it has
// kv_lens[b] keys in all (cached prefix + new, the new ones already in the pool).
// rows/kv_lens [B], q_starts [B + 1] int64.
void extend_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                      const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& q_starts,
                      const at::Tensor& kv_lens, double scaling, int64_t sliding_window, double logit_softcap,
                      at::Tensor out) {
  check_common(q, k_buf, v_buf, req_to_token, out);
  check_index(kv_lens, rows.numel(), "kv_lens");
  check_index(q_starts, rows.numel() + 1, "q_starts");
  check_index(rows, rows.numel(), "rows");
  TORCH_CHECK(q_starts[-1].item<int64_t>() == q.size(0) && q_starts[0].item<int64_t>() == 0,
              "cpu_paged: q_starts must run from 0 to the number of query rows");
  const auto opts = score_options(sliding_window, logit_softcap);
  if (q.size(0) == 0) return;
  radixserve_cpu_paged::extend_attention(q, k_buf, v_buf, req_to_token, rows, q_starts, kv_lens, scaling, opts, out);
}

// Decode that also returns each (query, head)'s log-sum-exp: lse [N, H] float32.
void paged_attention_with_lse(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                              const at::Tensor& req_to_token, const at::Tensor& rows, const at::Tensor& lens,
                              double scaling, int64_t sliding_window, double logit_softcap, at::Tensor out,
                              at::Tensor lse) {
  check_common(q, k_buf, v_buf, req_to_token, out);
  check_index(rows, q.size(0), "rows");
  check_index(lens, q.size(0), "lens");
  TORCH_CHECK(lse.is_contiguous() && lse.scalar_type() == at::kFloat && lse.numel() == q.size(0) * q.size(1),
              "cpu_paged: lse must be contiguous float32 [N, H]");
  const auto opts = score_options(sliding_window, logit_softcap);
  if (q.size(0) == 0) return;
  radixserve_cpu_paged::decode_attention(q, k_buf, v_buf, req_to_token, rows, lens, scaling, opts, out,
                                         lse.data_ptr<float>());
}

// Decode over shared prefixes: queries group_starts[g] .. group_starts[g + 1] - 1 share
// the first shared_lens[g] slots of row rows[group_starts[g]] of req_to_token;
// suffix_out [N, H, D] / suffix_lse [N, H] (paged_attention_with_lse over each query's
// keys after its group's prefix) are merged in. group_starts [G + 1], shared_lens [G].
// No sliding window: a windowed layer decodes through paged_attention.
void cascade_decode_attention(const at::Tensor& q, const at::Tensor& k_buf, const at::Tensor& v_buf,
                              const at::Tensor& req_to_token, const at::Tensor& rows,
                              const at::Tensor& group_starts, const at::Tensor& shared_lens,
                              const at::Tensor& suffix_out, const at::Tensor& suffix_lse, double scaling,
                              double logit_softcap, at::Tensor out) {
  check_common(q, k_buf, v_buf, req_to_token, out);
  check_index(rows, q.size(0), "rows");
  check_index(group_starts, shared_lens.numel() + 1, "group_starts");
  check_index(shared_lens, shared_lens.numel(), "shared_lens");
  TORCH_CHECK(suffix_out.is_contiguous() && suffix_out.sizes() == q.sizes() &&
                  suffix_out.scalar_type() == q.scalar_type() && suffix_lse.is_contiguous() &&
                  suffix_lse.scalar_type() == at::kFloat && suffix_lse.numel() == q.size(0) * q.size(1),
              "cpu_paged: suffix_out must be contiguous like q and suffix_lse contiguous float32 [N, H]");
  const auto opts = score_options(0, logit_softcap);
  if (q.size(0) == 0) return;
  radixserve_cpu_paged::cascade_decode_attention(q, k_buf, v_buf, req_to_token, rows, group_starts, shared_lens,
                                                 suffix_out, suffix_lse, scaling, opts.softcap, out);
}

TORCH_LIBRARY(radixserve_cpu_paged, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor loc, Tensor(a!) k_buf, Tensor(b!) v_buf) -> ()");
  m.def("paged_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor rows, Tensor lens, "
        "float scaling, int sliding_window, float logit_softcap, Tensor(a!) out) -> ()");
  m.def("extend_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor rows, "
        "Tensor q_starts, Tensor kv_lens, float scaling, int sliding_window, float logit_softcap, "
        "Tensor(a!) out) -> ()");
  m.def("paged_attention_with_lse(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor rows, "
        "Tensor lens, float scaling, int sliding_window, float logit_softcap, Tensor(a!) out, "
        "Tensor(b!) lse) -> ()");
  m.def("cascade_decode_attention(Tensor q, Tensor k_buf, Tensor v_buf, Tensor req_to_token, Tensor rows, "
        "Tensor group_starts, Tensor shared_lens, Tensor suffix_out, Tensor suffix_lse, float scaling, "
        "float logit_softcap, Tensor(a!) out) -> ()");
}

TORCH_LIBRARY_IMPL(radixserve_cpu_paged, CPU, m) {
  m.impl("store_kv", &store_kv);
  m.impl("paged_attention", &paged_attention);
  m.impl("extend_attention", &extend_attention);
  m.impl("paged_attention_with_lse", &paged_attention_with_lse);
  m.impl("cascade_decode_attention", &cascade_decode_attention);
}

