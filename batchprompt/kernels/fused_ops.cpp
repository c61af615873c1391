// Fused elementwise steps of a Llama layer, for the CPU. Each reads and writes its rows once
// (PyTorch's eager ops make a pass, and often a temporary, per operation) and rounds to the
// model dtype where the reference implementation does, so results match it to float rounding.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstring>

#include "vec.h"

namespace {

// The storage dtype <- float32 (bp::to_f, in vec.h, is the other way). bfloat16 goes through
// bit operations the compiler vectorizes (round to nearest even, as PyTorch does).
using bp::to_f;

template <typename T> inline T from_f(float f);
template <> inline float from_f<float>(float f) { return f; }
template <> inline at::BFloat16 from_f<at::BFloat16>(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  at::BFloat16 out;
  if ((u & 0x7fffffffu) > 0x7f800000u) {
    out.x = 0x7fc0;  // NaN stays NaN
  } else {
    out.x = static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  return out;
}
template <> inline at::Half from_f<at::Half>(float f) { return static_cast<at::Half>(f); }

// Rounds a float32 value to T and back: the result of one operation computed in dtype T.
template <typename T> inline float round_to(float f) { return to_f(from_f<T>(f)); }

template <typename T>
inline void norm_row(const T* x, const T* w, T* out, int64_t n, float eps) {
  int64_t i = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = bp::load16(x + i);
    acc = _mm512_fmadd_ps(v, v, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; i < n; ++i) ss += to_f(x[i]) * to_f(x[i]);
  const float r = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  i = 0;
#if defined(__AVX512F__)
  const __m512 rv = _mm512_set1_ps(r);
  for (; i + 16 <= n; i += 16)
    bp::store16(out + i, _mm512_mul_ps(bp::load16(w + i), bp::round16<T>(_mm512_mul_ps(bp::load16(x + i), rv))));
#endif
  for (; i < n; ++i) out[i] = from_f<T>(to_f(w[i]) * round_to<T>(to_f(x[i]) * r));
}

template <typename Fn>
void for_rows(int64_t rows, int64_t grain, Fn&& fn) {
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) fn(r);
  });
}

void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, name, " must be a [rows, n] CPU tensor with unit last stride");
}

}  // namespace

// weight * rms_norm(x): normalized in float32, rounded to the dtype, then scaled (as Llama's
// reference does).
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == x.size(1) && weight.scalar_type() == x.scalar_type(),
              "weight must be [n] in x's dtype");
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t n = x.size(1), sx = x.stride(0);
  bp::dispatch(x.scalar_type(), "rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(x.size(0), 16, [&](int64_t r) { norm_row(xp + r * sx, wp, op + r * n, n, static_cast<float>(eps)); });
  });
  return out;
}

// residual += delta (rounded to the dtype), in place; returns weight * rms_norm(residual).
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps) {
  check_rows(residual, "residual");
  check_rows(delta, "delta");
  TORCH_CHECK(residual.is_contiguous() && delta.sizes() == residual.sizes() && delta.scalar_type() == residual.scalar_type(),
              "residual (contiguous) and delta must match");
  TORCH_CHECK(weight.is_contiguous() && weight.numel() == residual.size(1) && weight.scalar_type() == residual.scalar_type(),
              "weight must be [n] in the residual's dtype");
  auto out = torch::empty_like(residual);
  const int64_t n = residual.size(1), sd = delta.stride(0);
  bp::dispatch(residual.scalar_type(), "add_rms_norm", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* rp = residual.data_ptr<scalar_t>();
    const scalar_t* dp = delta.data_ptr<scalar_t>();
    const scalar_t* wp = weight.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(residual.size(0), 16, [&](int64_t r) {
      scalar_t* row = rp + r * n;
      const scalar_t* d = dp + r * sd;
      int64_t i = 0;
#if defined(__AVX512F__)
      for (; i + 16 <= n; i += 16) bp::store16(row + i, _mm512_add_ps(bp::load16(row + i), bp::load16(d + i)));
#endif
      for (; i < n; ++i) row[i] = from_f<scalar_t>(to_f(row[i]) + to_f(d[i]));
      norm_row(row, wp, op + r * n, n, static_cast<float>(eps));
    });
  });
  return out;
}

// gate_up [rows, 2I] -> silu(gate) * up [rows, I], each op rounded to the dtype.
torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  const int64_t n = gate_up.size(1) / 2, s = gate_up.stride(0);
  auto out = torch::empty({gate_up.size(0), n}, gate_up.options());
  bp::dispatch(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* gp = gate_up.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    for_rows(gate_up.size(0), 4, [&](int64_t r) {
      const scalar_t* g = gp + r * s;
      const scalar_t* u = g + n;
      scalar_t* o = op + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= n; i += 16) {
        const __m512 x = bp::load16(g + i);
        // x / (1 + e^-x) with a refined reciprocal (within 2 ulp of the division, at a fraction
        // of its cost; the result is rounded to the dtype next). Where e^-x overflows, 1/inf = 0.
        const __m512 den = _mm512_add_ps(one, bp::exp16(_mm512_sub_ps(_mm512_setzero_ps(), x)));
        __m512 inv = _mm512_rcp14_ps(den);
        inv = _mm512_mul_ps(inv, _mm512_fnmadd_ps(den, inv, _mm512_set1_ps(2.f)));
        const __m512 silu = _mm512_mul_ps(x, inv);
        bp::store16(o + i, _mm512_mul_ps(bp::round16<scalar_t>(silu), bp::load16(u + i)));
      }
#endif
      // The rest (all of it without AVX-512): exp as exp16 computes it, in a loop the compiler
      // vectorizes; an exact division.
#pragma omp simd
      for (int64_t j = i; j < n; ++j) {
        const float x = to_f(g[j]);
        o[j] = from_f<scalar_t>(round_to<scalar_t>(x / (1.f + bp::exp_poly(-x))) * to_f(u[j]));
      }
    });
  });
  return out;
}

// Rotary embedding ("rotate half" layout) of the query and key heads of qkv
// [T, H + 2 * Hkv, D], in place and in the dtype; then the new keys and values are written to
// the cache [slots, Hkv, D] at slot_mapping [T].
void rotary_to_cache(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, torch::Tensor cos,
                     torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(qkv.device().is_cpu() && qkv.dim() == 3 && qkv.is_contiguous(), "qkv must be a contiguous [T, heads, D] CPU tensor");
  TORCH_CHECK(qkv.size(1) == num_heads + 2 * num_kv_heads, "qkv's head count must be heads + 2 * kv_heads");
  const int64_t T = qkv.size(0), D = qkv.size(2), half = D / 2;
  TORCH_CHECK(D % 2 == 0, "head_dim must be even");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(0) == T && cos.size(1) == D && sin.sizes() == cos.sizes(),
              "cos and sin must be [T, head_dim]");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.size(1) == num_kv_heads && k_cache.size(2) == D,
              "the cache must be [slots, kv_heads, head_dim], contiguous");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && k_cache.scalar_type() == qkv.scalar_type(), "one dtype for qkv, cos/sin and the cache");
  auto slots = slot_mapping.to(torch::kLong).contiguous();
  TORCH_CHECK(slots.numel() == T, "one slot per token");
  const int64_t row = qkv.size(1) * D, kv_row = num_kv_heads * D, num_slots = k_cache.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "slot out of the cache");
  bp::dispatch(qkv.scalar_type(), "rotary_to_cache", [&](auto tag) {
    using scalar_t = decltype(tag);
    scalar_t* xp = qkv.data_ptr<scalar_t>();
    const scalar_t* cp = cos.data_ptr<scalar_t>();
    const scalar_t* snp = sin.data_ptr<scalar_t>();
    scalar_t* kc = k_cache.data_ptr<scalar_t>();
    scalar_t* vc = v_cache.data_ptr<scalar_t>();
    for_rows(T, 8, [&](int64_t t) {
      const scalar_t* c = cp + t * D;
      const scalar_t* s = snp + t * D;
      for (int64_t h = 0; h < num_heads + num_kv_heads; ++h) {
        scalar_t* x = xp + t * row + h * D;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= half; i += 16) {
          using bp::load16;
          using bp::round16;
          const __m512 x1 = load16(x + i), x2 = load16(x + i + half);
          const __m512 a = _mm512_add_ps(round16<scalar_t>(_mm512_mul_ps(x1, load16(c + i))),
                                         round16<scalar_t>(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), load16(s + i))));
          const __m512 b = _mm512_add_ps(round16<scalar_t>(_mm512_mul_ps(x2, load16(c + i + half))),
                                         round16<scalar_t>(_mm512_mul_ps(x1, load16(s + i + half))));
          bp::store16(x + i, a);
          bp::store16(x + i + half, b);
        }
#endif
        for (; i < half; ++i) {
          const float x1 = to_f(x[i]), x2 = to_f(x[i + half]);
          const float a = round_to<scalar_t>(x1 * to_f(c[i])) + round_to<scalar_t>(-x2 * to_f(s[i]));
          const float b = round_to<scalar_t>(x2 * to_f(c[i + half])) + round_to<scalar_t>(x1 * to_f(s[i + half]));
          x[i] = from_f<scalar_t>(a);
          x[i + half] = from_f<scalar_t>(b);
        }
      }
      std::memcpy(kc + sp[t] * kv_row, xp + t * row + num_heads * D, kv_row * sizeof(scalar_t));
      std::memcpy(vc + sp[t] * kv_row, xp + t * row + (num_heads + num_kv_heads) * D, kv_row * sizeof(scalar_t));
    });
  });
}

namespace {

template <typename T>
int64_t argmax_row(const T* v, int64_t n) {
  int64_t i = 0;
  float m = to_f(v[0]);
  bool nan = false;
#if defined(__AVX512F__)
  __m512 m16 = _mm512_set1_ps(m);
  __mmask16 nan16 = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 x = bp::load16(v + i);
    m16 = _mm512_max_ps(m16, x);
    nan16 |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
  }
  m = _mm512_reduce_max_ps(m16);
  nan = nan16 != 0;
#endif
  for (; i < n; ++i) {
    const float x = to_f(v[i]);
    m = std::max(m, x);
    nan |= x != x;
  }
  i = 0;  // the first index that holds it
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = bp::load16(v + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) : _mm512_cmp_ps_mask(x, mv, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (; i < n; ++i) {
    const float x = to_f(v[i]);
    if (nan ? x != x : x == m) return i;
  }
  return 0;
}

}  // namespace

// The index of each row's largest value (the first one on ties, NaN counted largest), as
// torch.argmax(x, -1) gives (a row with NaN: its first NaN), in one vectorized pass per row
// plus a short search.
torch::Tensor argmax_rows(torch::Tensor x) {
  check_rows(x, "x");
  const int64_t rows = x.size(0), n = x.size(1), sx = x.stride(0);
  TORCH_CHECK(n > 0, "argmax_rows: empty rows");
  auto out = torch::empty({rows}, x.options().dtype(torch::kLong));
  int64_t* op = out.data_ptr<int64_t>();
  bp::dispatch(x.scalar_type(), "argmax_rows", [&](auto tag) {
    using scalar_t = decltype(tag);
    const scalar_t* xp = x.data_ptr<scalar_t>();
    for_rows(rows, 1, [&](int64_t r) { op[r] = argmax_row(xp + r * sx, n); });
  });
  return out;
}
