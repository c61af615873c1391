// Decode attention over the paged KV cache, for the CPU.
//
// One query token per request. A task is one request: it walks the request's block table and
// reads its cached keys and values where they lie (no gather into a padded copy), asking for
// rows ahead of use (the blocks are small and scattered, so the hardware prefetcher loses the
// stream at each one). Pass 1 computes the scores of sixteen keys at a time for each query
// head; with bfloat16 keys and AVX512-BF16 it multiplies the raw keys in pairs (vdpbf16ps, no
// conversion), otherwise it converts sixteen key rows to float32 in an L1 buffer once for all
// heads. Pass 2 sums the values for all query heads of a KV head at once, accumulators in
// registers, each value row converted once. Scores, softmax and sums are float32; the output is
// written in the query's dtype.
//
// With AVX-512 and a head size that is a multiple of 16 the inner loops are vector
// intrinsics with the head held in registers. Elsewhere (AVX2, ARM, other head sizes) the same
// steps are loops written for the compiler's vectorizer (`omp simd`), exp included.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
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

// Calls fn(t, slot) for the keys 0..len-1 of one request, block by block.
template <typename Fn>
inline void for_each_key(const Problem& P, const int64_t* table, int64_t len, Fn&& fn) {
  for (int64_t t0 = 0, blk = 0; t0 < len; t0 += P.block_size, ++blk) {
    const int64_t base = table[blk] * P.block_size;
    const int64_t n = std::min(P.block_size, len - t0);
    for (int64_t i = 0; i < n; ++i) fn(t0 + i, base + i);
  }
}

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

// Softmax of s[0..len) in place; returns 1 / the sum of the exponentials.
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

// Asks for the cache lines of `bytes` bytes at p.
inline void prefetch(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}

// Pass 1 with bfloat16 keys and vdpbf16ps: the raw keys are multiplied in pairs, with no
// conversion. Products of two bfloat16 values are exact in float32; sums are float32.
#if defined(__AVX512BF16__)
template <int NV>
void scores_bf16(const Problem& P, const at::BFloat16* qb, const at::BFloat16* kc, const int64_t* offs,
                 int64_t len, float* scores) {
  constexpr int D = 16 * NV, NP = NV / 2;  // NP vectors of 32 bfloat16 per head
  const int64_t group = P.heads / P.kv_heads;
  const __m512 scale = _mm512_set1_ps(P.scale);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    for (int64_t t = t0 + 32; t < std::min(t0 + 48, len); ++t) prefetch(kc + offs[t], P.slot_stride * 2);
    for (int64_t h = 0; h < P.heads; ++h) {
      const int64_t kv_off = (h / group) * D;
      const at::BFloat16* qh = qb + h * P.q_sh;
      __m512bh qv[NP];
      for (int j = 0; j < NP; ++j) qv[j] = (__m512bh)_mm512_loadu_si512(qh + 32 * j);
      __m512 part[16];
      for (int i = 0; i < 16; ++i) {
        const at::BFloat16* k = kc + offs[t0 + (i < n ? i : n - 1)] + kv_off;
        part[i] = _mm512_dpbf16_ps(_mm512_setzero_ps(), qv[0], (__m512bh)_mm512_loadu_si512(k));
        for (int j = 1; j < NP; ++j)
          part[i] = _mm512_dpbf16_ps(part[i], qv[j], (__m512bh)_mm512_loadu_si512(k + 32 * j));
      }
      _mm512_mask_storeu_ps(scores + h * len + t0, static_cast<__mmask16>((1u << n) - 1),
                            _mm512_mul_ps(sum16x16(part), scale));
    }
  }
}
#endif

// Pass 1, any storage type: sixteen key rows (all KV heads) at a time are converted to float32
// into a buffer that stays in L1, and every query head reads them from there.
template <typename scalar_t, int NV>
void scores_f32(const Problem& P, const scalar_t* qb, const scalar_t* kc, const int64_t* offs,
                int64_t len, float* rows, float* scores) {
  constexpr int D = 16 * NV;
  const int64_t group = P.heads / P.kv_heads, row_len = P.slot_stride;
  const __m512 scale = _mm512_set1_ps(P.scale);
  for (int64_t t0 = 0; t0 < len; t0 += 16) {
    const int n = static_cast<int>(std::min<int64_t>(16, len - t0));
    for (int64_t t = t0 + 32; t < std::min(t0 + 48, len); ++t) prefetch(kc + offs[t], row_len * sizeof(scalar_t));
    for (int i = 0; i < n; ++i) {
      const scalar_t* src = kc + offs[t0 + i];
      for (int64_t c = 0; c < row_len; c += 16) _mm512_storeu_ps(rows + i * row_len + c, load16(src + c));
    }
    for (int64_t h = 0; h < P.heads; ++h) {
      const int64_t kv_off = (h / group) * D;
      const scalar_t* qh = qb + h * P.q_sh;
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
}

// Pass 2 for the query heads h0..h0+HC-1 (at most HC, all of KV head g): out[h] = sum over t
// of p[h][t] * V[t], the accumulators held in registers across all keys; each value row is
// converted once for all these heads.
template <typename scalar_t, int NV, int HC>
void weighted_values(const Problem& P, const scalar_t* vc, const int64_t* offs, int64_t len,
                     const float* scores, const float* inv, int64_t h0, int nh, int64_t g, scalar_t* o) {
  constexpr int D = 16 * NV;
  __m512 a[HC][NV];
  for (int c = 0; c < HC; ++c)
    for (int j = 0; j < NV; ++j) a[c][j] = _mm512_setzero_ps();
  const int64_t kv_off = g * D;
  for (int64_t t = 0; t < len; ++t) {
    if (t + 16 < len) prefetch(vc + offs[t + 16] + kv_off, D * sizeof(scalar_t));
    const scalar_t* v = vc + offs[t] + kv_off;
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = load16(v + 16 * j);
    for (int c = 0; c < HC; ++c) {
      if (c >= nh) break;
      const __m512 pc = _mm512_set1_ps(scores[(h0 + c) * len + t]);
      for (int j = 0; j < NV; ++j) a[c][j] = _mm512_fmadd_ps(pc, vv[j], a[c][j]);
    }
  }
  for (int c = 0; c < nh; ++c) {
    const __m512 s = _mm512_set1_ps(inv[h0 + c]);
    for (int j = 0; j < NV; ++j) bp::store16(o + (h0 + c) * D + 16 * j, _mm512_mul_ps(a[c][j], s));
  }
}

// One request, head size 16 * NV.
template <typename scalar_t, int NV>
void attend_vec(const Problem& P, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                int64_t b, float* work, int64_t* offs, scalar_t* out) {
  constexpr int D = 16 * NV;
  constexpr int HC = NV <= 4 ? 4 : (NV <= 8 ? 2 : 1);  // query heads per pass over the values
  const int64_t len = P.lens[b], group = P.heads / P.kv_heads;
  const int64_t* table = P.tables + b * P.table_stride;
  for_each_key(P, table, len, [&](int64_t t, int64_t slot) { offs[t] = slot * P.slot_stride; });
  float* rows = work;                          // [16][slot_stride]
  float* scores = rows + 16 * P.slot_stride;   // [heads][len]
  const scalar_t* qb = q + b * P.q_sb;
  for (int64_t t = 0; t < std::min<int64_t>(32, len); ++t) prefetch(kc + offs[t], P.slot_stride * sizeof(scalar_t));
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, at::BFloat16> && NV % 2 == 0)
    scores_bf16<NV>(P, qb, kc, offs, len, scores);
  else
#endif
    scores_f32<scalar_t, NV>(P, qb, kc, offs, len, rows, scores);
  for (int64_t t = 0; t < std::min<int64_t>(16, len); ++t) prefetch(vc + offs[t], P.slot_stride * sizeof(scalar_t));
  float inv[1024];
  for (int64_t h = 0; h < P.heads; ++h) inv[h] = softmax_unnormalized(scores + h * len, len);
  scalar_t* o = out + b * P.heads * D;
  for (int64_t g = 0; g < P.kv_heads; ++g)
    for (int64_t h0 = g * group; h0 < (g + 1) * group; h0 += HC)
      weighted_values<scalar_t, NV, HC>(P, vc, offs, len, scores, inv, h0,
                                        static_cast<int>(std::min<int64_t>(HC, (g + 1) * group - h0)), g, o);
}
#endif

// The n values at p as float32: p itself for float32, else converted into buf.
inline const float* as_float(const float* p, float*, int64_t) { return p; }
template <typename T>
inline const float* as_float(const T* p, float* buf, int64_t n) {
#pragma omp simd
  for (int64_t d = 0; d < n; ++d) buf[d] = bp::to_f(p[d]);
  return buf;
}

// Softmax of s[0..len) in place, unnormalized; returns 1 / the sum of the exponentials.
inline float softmax_simd(float* s, int64_t len) {
  float m = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : m)
  for (int64_t t = 0; t < len; ++t) m = s[t] > m ? s[t] : m;
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    const float e = bp::exp_poly(s[t] - m);
    s[t] = e;
    sum += e;
  }
  return 1.f / sum;
}

// One request, any head size and instruction set (AVX2, NEON, ...): the loops over the head
// are written for the compiler's vectorizer (`omp simd`). Each key and value row is read and
// converted to float32 once for all the query heads of its KV head.
template <typename scalar_t>
void attend_portable(const Problem& P, const scalar_t* q, const scalar_t* kc, const scalar_t* vc,
                     int64_t b, float* work, int64_t* offs, scalar_t* out) {
  const int64_t len = P.lens[b], group = P.heads / P.kv_heads, D = P.dim;
  const int64_t* table = P.tables + b * P.table_stride;
  for_each_key(P, table, len, [&](int64_t t, int64_t slot) { offs[t] = slot * P.slot_stride; });
  float* qf = work;                    // [heads][D]: the query, scaled, in float32
  float* scores = qf + P.heads * D;    // [heads][len]
  float* acc = scores + P.heads * len; // [group][D]
  float* row = acc + group * D;        // [D]: one key or value row in float32
  for (int64_t h = 0; h < P.heads; ++h) {
    const scalar_t* qh = q + b * P.q_sb + h * P.q_sh;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) qf[h * D + d] = bp::to_f(qh[d]) * P.scale;
  }
  for (int64_t g = 0; g < P.kv_heads; ++g) {
    for (int64_t t = 0; t < len; ++t) {
      const float* k = as_float(kc + offs[t] + g * D, row, D);
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        const float* qv = qf + h * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qv[d] * k[d];
        scores[h * len + t] = s;
      }
    }
  }
  for (int64_t g = 0; g < P.kv_heads; ++g) {
    float inv[1024];
    for (int64_t c = 0; c < group; ++c) inv[c] = softmax_simd(scores + (g * group + c) * len, len);
    std::fill(acc, acc + group * D, 0.f);
    for (int64_t t = 0; t < len; ++t) {
      const float* v = as_float(vc + offs[t] + g * D, row, D);
      for (int64_t c = 0; c < group; ++c) {
        const float p = scores[(g * group + c) * len + t];
        float* a = acc + c * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
      }
    }
    for (int64_t c = 0; c < group; ++c) {
      scalar_t* o = out + (b * P.heads + g * group + c) * D;
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<scalar_t>(acc[c * D + d] * inv[c]);
    }
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
    // attend_vec: [16][slot_stride] rows and [heads][len] scores; attend_portable: the query,
    // the scores, [group][D] sums and one row.
    std::vector<float> work(16 * P.slot_stride + P.heads * P.max_len + (2 * P.heads + 1) * P.dim);
    std::vector<int64_t> offs(P.max_len);
    for (int64_t b = begin; b < end; ++b) {
#if defined(__AVX512F__)
      switch (P.dim) {
        case 16: attend_vec<scalar_t, 1>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        case 32: attend_vec<scalar_t, 2>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        case 64: attend_vec<scalar_t, 4>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        case 80: attend_vec<scalar_t, 5>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        case 96: attend_vec<scalar_t, 6>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        case 128: attend_vec<scalar_t, 8>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        case 256: attend_vec<scalar_t, 16>(P, qp, kp, vp, b, work.data(), offs.data(), op); continue;
        default: break;  // other head sizes: the portable loops
      }
#endif
      attend_portable<scalar_t>(P, qp, kp, vp, b, work.data(), offs.data(), op);
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
  bp::dispatch(q.scalar_type(), "decode_attention", [&](auto tag) {
    decode_attention_impl<decltype(tag)>(P, q, k_cache, v_cache, out);
  });
  return out;
}
