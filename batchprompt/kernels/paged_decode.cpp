// Decode attention over the paged KV cache, for the CPU.
//
// One query token per request. A task is one request: it walks the request's block table and
// reads its cached keys and values where they lie (no gather into a padded copy); the rows a
// task reads stay in the core's L1/L2 cache while every query head that shares their KV head
// (grouped-query attention) uses them. Scores and softmax are float32; the output is written
// in the query's dtype.
//
// With AVX-512 and a head size that is a multiple of 16 the inner loops are vector
// intrinsics with the head held in registers; otherwise a plain loop computes the same thing.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

#if defined(__AVX512F__)
using bp::exp16;
using bp::load16;
#endif

struct Problem {
  int64_t batch, heads, kv_heads, dim, block_size, max_len;
  int64_t q_sb, q_sh, slot_stride, table_stride;
  float scale;
  const int64_t* tables;
  const int64_t* lens;
};

inline int64_t slot_of(const Problem& P, const int64_t* table, int64_t t) {
  return table[t / P.block_size] * P.block_size + t % P.block_size;
}

// Calls fn(t, slot) for the keys 0..len-1 of one request, block by block.
template <typename Fn>
inline void for_each_key(const Problem& P, const int64_t* table, int64_t len, Fn&& fn) {
  for (int64_t t0 = 0, blk = 0; t0 < len; t0 += P.block_size, ++blk) {
    const int64_t base = table[blk] * P.block_size;
    const int64_t n = std::min(P.block_size, len - t0);
    for (int64_t i = 0; i < n; ++i) fn(t0 + i, base + i);
  }
}

// Softmax of s[0..len) in place; returns 1 / the sum of the exponentials.
inline float softmax_unnormalized(float* s, int64_t len);

#if defined(__AVX512F__)
// r[i] = the sum of the lanes of a[i], for sixteen vectors at once.
inline __m512 sum16x16(__m512* a) {
  __m512 z[8], w[4];
  for (int i = 0; i < 8; ++i)  // each 128-bit lane: two sources, two partial sums each
    z[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]), _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // each 128-bit lane: four sources, one partial sum each
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0x44), _mm512_shuffle_ps(z[2 * i], z[2 * i + 1], 0xEE));
  // Sum the four 128-bit lanes of each w[i]; w[i]'s total lands in lane i.
  const __m512 s01 = _mm512_add_ps(_mm512_shuffle_f32x4(w[0], w[1], 0x44), _mm512_shuffle_f32x4(w[0], w[1], 0xEE));
  const __m512 s23 = _mm512_add_ps(_mm512_shuffle_f32x4(w[2], w[3], 0x44), _mm512_shuffle_f32x4(w[2], w[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(s01, s23, 0x88), _mm512_shuffle_f32x4(s01, s23, 0xDD));
}

inline float softmax_unnormalized(float* s, int64_t len) {
  __m512 m16 = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= len; t += 16) m16 = _mm512_max_ps(m16, _mm512_loadu_ps(s + t));
  float m = _mm512_reduce_max_ps(m16);
  for (int64_t r = t; r < len; ++r) m = std::max(m, s[r]);
  const __m512 mv = _mm512_set1_ps(m);
  __m512 sum16 = _mm512_setzero_ps();
  t = 0;
  for (; t + 16 <= len; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), mv));
    _mm512_storeu_ps(s + t, e);
    sum16 = _mm512_add_ps(sum16, e);
  }
  if (t < len) {
    const __mmask16 k = static_cast<__mmask16>((1u << (len - t)) - 1);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, s + t), mv));
    _mm512_mask_storeu_ps(s + t, k, e);
    sum16 = _mm512_add_ps(sum16, _mm512_maskz_mov_ps(k, e));
  }
  return 1.f / _mm512_reduce_add_ps(sum16);
}

// One request, head size 16 * NV. Keys and values are taken sixteen slots at a time: each
// slot's row (all KV heads, contiguous in the cache) is read once and converted to float32
// into a small buffer that stays in L1, and every query head reads it from there.
template <typename scalar_t, int NV>
void attend_vec(const Problem& P, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                int64_t b, float* work, scalar_t* out) {
  constexpr int D = 16 * NV;
  const int64_t len = P.lens[b], group = P.heads / P.kv_heads, row_len = P.slot_stride;
  const int64_t* table = P.tables + b * P.table_stride;
  float* rows = work;                        // [16][row_len]
  float* scores = rows + 16 * row_len;       // [heads][len]
  float* acc = scores + P.heads * len;       // [heads][D]
  const __m512 scale = _mm512_set1_ps(P.scale);
  auto load_rows = [&](const scalar_t* cache, int64_t t0, int n) {
    for (int i = 0; i < n; ++i) {
      const scalar_t* src = cache + slot_of(P, table, t0 + i) * row_len;
      float* dst = rows + i * row_len;
      for (int64_t c = 0; c < row_len; c += 16) _mm512_storeu_ps(dst + c, load16(src + c));
    }
  };
  // Pass 1: scores[h * len + t].
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    load_rows(kc, t0, n);
    for (int64_t h = 0; h < P.heads; ++h) {
      const int64_t kv_off = (h / group) * D;
      const scalar_t* qh = q + b * P.q_sb + h * P.q_sh;
      __m512 qv[NV];
      for (int j = 0; j < NV; ++j) qv[j] = _mm512_mul_ps(load16(qh + 16 * j), scale);
      __m512 part[16];
      for (int i = 0; i < 16; ++i) {
        const float* k = rows + (i < n ? i : 0) * row_len + kv_off;
        part[i] = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int j = 1; j < NV; ++j) part[i] = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), part[i]);
      }
      _mm512_mask_storeu_ps(scores + h * len + t0, static_cast<__mmask16>((1u << n) - 1), sum16x16(part));
    }
  }
  float inv[1024];
  for (int64_t h = 0; h < P.heads; ++h) inv[h] = softmax_unnormalized(scores + h * len, len);
  // Pass 2: acc[h] = sum over t of p[h][t] * V[t].
  std::fill(acc, acc + P.heads * D, 0.f);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    load_rows(vc, t0, n);
    for (int64_t h = 0; h < P.heads; ++h) {
      const int64_t kv_off = (h / group) * D;
      const float* p = scores + h * len + t0;
      __m512 a[NV];
      for (int j = 0; j < NV; ++j) a[j] = _mm512_loadu_ps(acc + h * D + 16 * j);
      for (int i = 0; i < n; ++i) {
        const __m512 pi = _mm512_set1_ps(p[i]);
        const float* v = rows + i * row_len + kv_off;
        for (int j = 0; j < NV; ++j) a[j] = _mm512_fmadd_ps(pi, _mm512_loadu_ps(v + 16 * j), a[j]);
      }
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(acc + h * D + 16 * j, a[j]);
    }
  }
  scalar_t* o = out + b * P.heads * D;
  for (int64_t h = 0; h < P.heads; ++h)
    for (int d = 0; d < D; ++d) o[h * D + d] = static_cast<scalar_t>(acc[h * D + d] * inv[h]);
}
#else
inline float softmax_unnormalized(float* s, int64_t len) {
  float m = -std::numeric_limits<float>::infinity();
  for (int64_t t = 0; t < len; ++t) m = std::max(m, s[t]);
  float sum = 0.f;
  for (int64_t t = 0; t < len; ++t) sum += (s[t] = std::exp(s[t] - m));
  return 1.f / sum;
}
#endif

// One request, any head size.
template <typename scalar_t>
void attend_scalar(const Problem& P, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                   int64_t b, float* scores, scalar_t* out) {
  const int64_t len = P.lens[b], group = P.heads / P.kv_heads, dim = P.dim;
  const int64_t* table = P.tables + b * P.table_stride;
  std::vector<float> qf(dim), acc(dim);
  for (int64_t h = 0; h < P.heads; ++h) {
    const int64_t kv_off = (h / group) * dim;
    for (int64_t d = 0; d < dim; ++d) qf[d] = static_cast<float>(q[b * P.q_sb + h * P.q_sh + d]) * P.scale;
    for_each_key(P, table, len, [&](int64_t t, int64_t slot) {
      const scalar_t* k = kc + slot * P.slot_stride + kv_off;
      float s = 0.f;
      for (int64_t d = 0; d < dim; ++d) s += qf[d] * static_cast<float>(k[d]);
      scores[t] = s;
    });
    const float inv = softmax_unnormalized(scores, len);
    std::fill(acc.begin(), acc.end(), 0.f);
    for_each_key(P, table, len, [&](int64_t t, int64_t slot) {
      const scalar_t* v = vc + slot * P.slot_stride + kv_off;
      for (int64_t d = 0; d < dim; ++d) acc[d] += scores[t] * static_cast<float>(v[d]);
    });
    for (int64_t d = 0; d < dim; ++d) out[(b * P.heads + h) * dim + d] = static_cast<scalar_t>(acc[d] * inv);
  }
}

template <typename scalar_t>
void decode_attention_impl(const Problem& P, const torch::Tensor& q, const torch::Tensor& k_cache,
                           const torch::Tensor& v_cache, torch::Tensor& out) {
  const scalar_t* qp = q.data_ptr<scalar_t>();
  const scalar_t* kp = k_cache.data_ptr<scalar_t>();
  const scalar_t* vp = v_cache.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  at::parallel_for(0, P.batch, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> work(16 * P.slot_stride + P.heads * (P.max_len + P.dim));
    for (int64_t b = begin; b < end; ++b) {
#if defined(__AVX512F__)
      switch (P.dim) {
        case 16: attend_vec<scalar_t, 1>(P, qp, kp, vp, b, work.data(), op); continue;
        case 32: attend_vec<scalar_t, 2>(P, qp, kp, vp, b, work.data(), op); continue;
        case 64: attend_vec<scalar_t, 4>(P, qp, kp, vp, b, work.data(), op); continue;
        case 80: attend_vec<scalar_t, 5>(P, qp, kp, vp, b, work.data(), op); continue;
        case 96: attend_vec<scalar_t, 6>(P, qp, kp, vp, b, work.data(), op); continue;
        case 128: attend_vec<scalar_t, 8>(P, qp, kp, vp, b, work.data(), op); continue;
        case 256: attend_vec<scalar_t, 16>(P, qp, kp, vp, b, work.data(), op); continue;
        default: break;  // other head sizes: the plain loop
      }
#endif
      attend_scalar<scalar_t>(P, qp, kp, vp, b, work.data(), op);
    }
  });
}

}  // namespace

// q [B, H, D] (any strides with a unit last one); k_cache, v_cache [slots, Hkv, D] contiguous;
// block_table [B, max_blocks] int64; context_lens [B] int64 (keys each query sees, >= 1).
// Returns [B, H, D], contiguous.
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, torch::Tensor context_lens,
                               int64_t block_size, double scale) {
  TORCH_CHECK(q.device().is_cpu(), "decode_attention runs on the CPU");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, H, D] with a unit last stride");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the KV cache must be contiguous");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "q and the KV cache must share a dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(2), "q and the KV cache must share head_dim");
  TORCH_CHECK(q.size(1) % k_cache.size(1) == 0 && q.size(1) <= 1024,
              "query heads must be a multiple of KV heads (at most 1024)");
  auto table = block_table.to(torch::kLong).contiguous();
  auto lens = context_lens.to(torch::kLong).contiguous();
  TORCH_CHECK(table.size(0) == q.size(0) && lens.size(0) == q.size(0), "one block table row and length per query");
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  Problem P{q.size(0), q.size(1), k_cache.size(1), q.size(2), block_size, 1,
            q.stride(0), q.stride(1), k_cache.size(1) * q.size(2), table.stride(0),
            static_cast<float>(scale), table.data_ptr<int64_t>(), lens.data_ptr<int64_t>()};
  for (int64_t b = 0; b < P.batch; ++b) {
    TORCH_CHECK(P.lens[b] >= 1 && P.lens[b] <= table.size(1) * block_size, "context length out of the block table");
    P.max_len = std::max(P.max_len, P.lens[b]);
  }
  switch (q.scalar_type()) {
    case at::kFloat: decode_attention_impl<float>(P, q, k_cache, v_cache, out); break;
    case at::kBFloat16: decode_attention_impl<at::BFloat16>(P, q, k_cache, v_cache, out); break;
    case at::kHalf: decode_attention_impl<at::Half>(P, q, k_cache, v_cache, out); break;
    default: TORCH_CHECK(false, "decode_attention: float32, bfloat16 or float16 only, got ", q.scalar_type());
  }
  return out;
}
