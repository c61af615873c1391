// Helpers shared by the CPU kernels: the dtype dispatch, an exp that vectorizes anywhere, and
// sixteen-lane float32 vectors over AVX-512.
#pragma once

#include <torch/extension.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace bp {

// Calls fn(T{}) with T the storage type of `dtype` (fn is a generic lambda).
template <typename Fn>
inline void dispatch(at::ScalarType dtype, const char* name, Fn&& fn) {
  switch (dtype) {
    case at::kFloat: fn(float{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    case at::kHalf: fn(at::Half{}); break;
    default: TORCH_CHECK(false, name, ": float32, bfloat16 or float16 only, got ", dtype);
  }
}

// A value of the storage type as float32, one at a time: loops of these vectorize (bfloat16
// through a shift of its bits).
inline float to_f(float x) { return x; }
inline float to_f(at::BFloat16 x) {
  uint32_t u = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline float to_f(at::Half x) { return static_cast<float>(x); }

// exp(x) as exp16 computes it (2^n * a degree-6 polynomial of the rest; x clamped to
// [-87, 88]), written so that `omp simd` loops of it vectorize on any instruction set (with
// -fno-trapping-math, which lets the compiler turn the clamp's branches into selects).
inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : x;
  x = x > 88.f ? 88.f : x;
  const float t = x * 1.44269504088896341f;
  const float n = (t + 12582912.f) - 12582912.f;  // t rounded to the nearest integer (even on ties)
  const float f = (t - n) * 0.6931471805599453f;
  float p = 1.f / 720;
  p = p * f + 1.f / 120;
  p = p * f + 1.f / 24;
  p = p * f + 1.f / 6;
  p = p * f + 0.5f;
  p = p * f + 1.f;
  p = p * f + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, 4);
  return p * scale;
}

}  // namespace bp

#if defined(__AVX512F__)
#include <immintrin.h>

namespace bp {

// Sixteen values of a storage type as float32.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Sixteen float32 values stored in a storage type, rounded to nearest even as PyTorch does
// (NaN stays NaN).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(at::BFloat16* p, __m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}
inline void store16(at::Half* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// The value after one operation computed in the storage type: rounded to it and back, in
// registers (the same rounding as store16; NaN stays NaN).
template <typename T> inline __m512 round16(__m512 v);
template <> inline __m512 round16<float>(__m512 v) { return v; }
template <> inline __m512 round16<at::BFloat16>(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_and_si512(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))),
                                     _mm512_set1_epi32(static_cast<int>(0xffff0000u)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_castsi512_ps(_mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7fc00000)));
}
template <> inline __m512 round16<at::Half>(__m512 v) {
  return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// exp(x): 2^n * 2^f with f in [-0.5, 0.5] from a degree-6 polynomial (relative error about
// 2e-7, as libm's expf); x is clamped to [-87, 88], where float32 neither underflows to
// denormals nor overflows.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.6931471805599453f));
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace bp

#endif  // __AVX512F__
