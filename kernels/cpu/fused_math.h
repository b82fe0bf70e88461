// Scalar building blocks of the fused CPU kernels, written so that GCC/Clang vectorise the loops
// that call them (`#pragma omp simd`, -O3 -march=native): no libm calls, no branches that do not
// turn into selects, bf16 handled as raw uint16 bits.
#pragma once

#include <cstdint>

namespace raylib_kernels {

// -- storage types: float, or bf16 as its 16 raw bits ------------------------------------------

inline float load(float v) { return v; }
inline float load(uint16_t v) { return __builtin_bit_cast(float, static_cast<uint32_t>(v) << 16); }

inline void store(float& dst, float v) { dst = v; }
inline void store(uint16_t& dst, float v) {
  // round to nearest even, NaN stays a (quiet) NaN: what c10::BFloat16 does
  const uint32_t u = __builtin_bit_cast(uint32_t, v);
  const uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  dst = static_cast<uint16_t>(v != v ? 0x7FC0u : r);
}

// The value a float takes once stored as T and loaded again (Llama's `x.to(input_dtype)`).
template <typename T>
inline float round_to(float v) {
  T t;
  store(t, v);
  return load(t);
}

// sign(x) * min(|x|, limit), on the bits: an integer min, which the vectoriser turns into one
// instruction (a float compare-and-select it would rather split the loop on). A NaN comes out
// as +-limit: every caller multiplies the result by the original value, so NaN still propagates.
inline float clamp_abs(float x, float limit) {
  const uint32_t b = __builtin_bit_cast(uint32_t, x);
  const uint32_t l = __builtin_bit_cast(uint32_t, limit);
  uint32_t a = b & 0x7FFFFFFFu;
  a = a < l ? a : l;
  return __builtin_bit_cast(float, a | (b & 0x80000000u));
}

// -- exp -------------------------------------------------------------------------------------

// exp(x) with x clamped to [-80, 80] (results stay normal floats: no slow denormals); ~1 ulp.
// A NaN x gives a finite value: callers multiply by the NaN's source (see clamp_abs).
// Cody-Waite reduction by ln2 and Cephes' expf polynomial; 2^n from the exponent bits.
inline float exp_clamped(float x) {
  x = clamp_abs(x, 80.f);
  const float t = x * 1.44269504088896341f + 12582912.f;  // 1.5 * 2^23: rounds x*log2(e) to an integer
  const float n = t - 12582912.f;
  const int32_t e = __builtin_bit_cast(int32_t, t) - 0x4B400000;
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.f;
  return y * __builtin_bit_cast(float, (e + 127) << 23);
}

// -- GeLU, erf form: gelu(v) = v * Phi(v) --------------------------------------------------------

// Phi(v), the standard normal CDF, from e = exp(-v^2/2): erfc by Abramowitz & Stegun 7.1.26
// (|error| <= 1.5e-7 on erf, the formula ATen's vectorised erf uses), whose exp(-z^2) is the
// same e the derivative needs, so the backward pays one exp for both Phi and phi.
inline float normal_cdf(float v, float e) {
  const float z = __builtin_fabsf(v) * 0.70710678118654752f;
  const float t = 1.f / (1.f + 0.3275911f * z);
  float q = 1.061405429f;
  q = q * t - 1.453152027f;
  q = q * t + 1.421413741f;
  q = q * t - 0.284496736f;
  q = q * t + 0.254829592f;
  const float tail = 0.5f * q * t * e;  // 0.5 * erfc(|v| / sqrt(2))
  return v < 0.f ? tail : 1.f - tail;
}

// erf(z) for the forward, where no exp is needed otherwise: z * P(z^2) / Q(z^2) on z clamped to
// [-4, 4] (erf(4) is 1 in fp32), degrees 6/5, fitted for this file (Lawson-weighted least
// squares on the relative error: 1e-8 in double, |error| <= 3.5e-7 evaluated in fp32).
inline float erf_rational(float z) {
  const uint32_t b = __builtin_bit_cast(uint32_t, z);
  const bool saturated = (b & 0x7FFFFFFFu) >= 0x40800000u;  // |z| >= 4 (or NaN): erf is +-1 in fp32
  z = clamp_abs(z, 4.f);
  const float s = z * z;
  float p = -1.418549587e-08f;
  p = p * s + 4.886194756e-06f;
  p = p * s + 3.866235645e-04f;
  p = p * s + 3.844257338e-03f;
  p = p * s + 5.439859364e-02f;
  p = p * s + 1.845141922e-01f;
  p = p * s + 1.128379179e+00f;
  float q = 6.502565872e-05f;
  q = q * s + 1.315968641e-03f;
  q = q * s + 1.547537768e-02f;
  q = q * s + 1.138268353e-01f;
  q = q * s + 4.968549790e-01f;
  q = q * s + 1.f;
  // exactly +-1 where saturated, so gelu(v) is exactly 0 (not |v| * 1e-8) far below zero; an
  // integer select, like clamp_abs, for the vectoriser's sake
  const uint32_t r = __builtin_bit_cast(uint32_t, z * p / q);
  return __builtin_bit_cast(float, saturated ? (0x3F800000u | (b & 0x80000000u)) : r);
}

inline float gelu_erf(float v) { return 0.5f * v * (1.f + erf_rational(v * 0.70710678118654752f)); }

inline float gelu_erf_grad(float v) {
  const float e = exp_clamped(-0.5f * v * v);
  return normal_cdf(v, e) + v * e * 0.39894228040143268f;  // Phi(v) + v * phi(v)
}

// -- GeLU, tanh form (GPT-2's gelu_new): 0.5 v (1 + tanh(u)) = v * sigmoid(2u) ------------------

constexpr float kSqrt2OverPi = 0.79788456080286536f;
constexpr float kKappa = 0.044715f;

inline float gelu_tanh(float v) {
  const float u = kSqrt2OverPi * (v + kKappa * v * v * v);
  return v / (1.f + exp_clamped(-2.f * u));
}

inline float gelu_tanh_grad(float v) {
  const float u = kSqrt2OverPi * (v + kKappa * v * v * v);
  const float s = 1.f / (1.f + exp_clamped(-2.f * u));  // (1 + tanh u) / 2
  return s + 2.f * v * s * (1.f - s) * kSqrt2OverPi * (1.f + 3.f * kKappa * v * v);
}

// -- dropout's keep-mask: a counter-based hash of (seed, flat element index) ----------------------
// Identical in raylib/ops/layer_norm.py (torch integer ops) and kernels/triton/layer_norm.py:
//   key     = mix32(lo32(seed) ^ mix32(hi32(seed) + 0x9E3779B9))
//   bits(i) = mix32(mix32(lo32(i) ^ key) + hi32(i))
//   keep(i) = (bits(i) >> 8) >= ceil(p * 2^24)       (a 24-bit uniform u >= p)

inline uint32_t mix32(uint32_t x) {  // a bijective 32-bit integer hash (Wellons' lowbias32 family)
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0x735A2D97u;
  x ^= x >> 15;
  return x;
}

inline uint32_t dropout_key(uint64_t seed) {
  return mix32(static_cast<uint32_t>(seed) ^ mix32(static_cast<uint32_t>(seed >> 32) + 0x9E3779B9u));
}

inline bool dropout_keep(uint32_t key, uint32_t lo, uint32_t hi, uint32_t threshold) {
  return (mix32(mix32(lo ^ key) + hi) >> 8) >= threshold;
}

}  // namespace raylib_kernels
