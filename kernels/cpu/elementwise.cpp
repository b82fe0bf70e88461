// Fused element-wise CPU kernels of raylib.ops, forward and backward, fp32 and bf16 (fp32 math):
//   bias_gelu            gelu(x + bias), erf or tanh form; grads for x and bias
//   residual_layer_norm  LayerNorm(dropout(x) + residual), dropout mask hashed from (seed, index)
//   rms_norm             Llama's RMSNorm, its dtype behaviour included
// Rows run in parallel (at::parallel_for); each row's inner loops are `omp simd` loops over
// fused_math.h's branch-free helpers. Column reductions (bias, weight grads) go to one fp32
// partial row per thread chunk, summed at the end: no atomics.
// Only the headers used (not <torch/extension.h>): the build takes a few seconds instead of ~35.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

#ifdef __linux__
#include <sys/mman.h>
#endif

#include "fused_math.h"

namespace raylib_kernels {
namespace {

using at::Tensor;

// Calls f(T{}) with T = float for fp32 and uint16_t (raw bits) for bf16.
template <typename F>
void dispatch_float_bf16(at::ScalarType t, const char* what, F&& f) {
  if (t == at::kFloat) {
    f(float{});
  } else if (t == at::kBFloat16) {
    f(uint16_t{});
  } else {
    TORCH_CHECK(false, what, ": takes float32 or bfloat16, not ", t);
  }
}

template <typename T>
const T* ptr(const Tensor& t) { return static_cast<const T*>(t.const_data_ptr()); }
template <typename T>
T* mut(Tensor& t) { return static_cast<T*>(t.mutable_data_ptr()); }

// A new output tensor. One of 32 MiB or more (glibc's largest dynamic mmap threshold: such
// blocks are mapped fresh from the kernel on every allocation, and page-faulted in on first write)
// is asked to use transparent huge pages: one fault per 2 MiB instead of 512, which at BERT-large
// sizes is most of what these kernels would otherwise spend. Smaller blocks come from the heap,
// where glibc trims and regrows memory in small steps that would split huge pages again: left
// alone. A hint only: where THP is off, or with another allocator, nothing changes.
Tensor new_output(at::IntArrayRef sizes, const at::TensorOptions& options) {
  Tensor t = at::empty(sizes, options);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  const size_t bytes = t.nbytes();
  if (bytes >= (size_t{32} << 20)) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(t.data_ptr());
    const uintptr_t start = (p + kHuge - 1) & ~(kHuge - 1), end = (p + bytes) & ~(kHuge - 1);
    if (end > start) madvise(reinterpret_cast<void*>(start), end - start, MADV_HUGEPAGE);
  }
#endif
  return t;
}

int64_t row_grain(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

// Rows [begin, end) of chunk c when m rows are split into `chunks` nearly equal runs.
inline int64_t chunk_start(int64_t c, int64_t chunks, int64_t m) { return c * m / chunks; }

int64_t num_chunks(int64_t m) {
  return std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), m));
}

// Sums the fp32 partial rows part[chunks, n] into out (dtype T).
template <typename T>
void reduce_partials(const float* part, int64_t chunks, int64_t n, T* out) {
  for (int64_t j0 = 0; j0 < n; j0 += 1024) {
    const int64_t j1 = std::min(n, j0 + 1024);
    float acc[1024];
#pragma omp simd
    for (int64_t j = j0; j < j1; ++j) acc[j - j0] = part[j];
    for (int64_t c = 1; c < chunks; ++c) {
      const float* p = part + c * n;
#pragma omp simd
      for (int64_t j = j0; j < j1; ++j) acc[j - j0] += p[j];
    }
    for (int64_t j = j0; j < j1; ++j) store(out[j], acc[j - j0]);
  }
}

void check_rows(const Tensor& x, const Tensor& v, const char* what, const char* name) {
  TORCH_CHECK(x.device().is_cpu() && v.device().is_cpu(), what, ": CPU tensors only");
  TORCH_CHECK(x.dim() >= 1, what, ": x needs a last dimension");
  TORCH_CHECK(v.dim() == 1 && v.size(0) == x.size(-1), what, ": ", name, " must have shape (",
              x.size(-1), ",), not ", v.sizes());
}

// ================================ bias + GeLU ================================================

// The bias row as fp32, converted once per thread chunk (the inner loops then load floats).
template <typename T>
std::vector<float> as_float(const T* v, int64_t n) {
  std::vector<float> out(n);
  for (int64_t j = 0; j < n; ++j) out[j] = load(v[j]);
  return out;
}

template <typename T, bool TANH>
void bias_gelu_fwd_impl(const T* x, const T* bias, T* y, int64_t m, int64_t n) {
  at::parallel_for(0, m, row_grain(n), [&](int64_t r0, int64_t r1) {
    const std::vector<float> bf = as_float(bias, n);
    const float* b = bf.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      T* yr = y + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) {
        const float v = load(xr[j]) + b[j];
        store(yr[j], TANH ? gelu_tanh(v) : gelu_erf(v));
      }
    }
  });
}

template <typename T, bool TANH>
void bias_gelu_bwd_impl(const T* dy, const T* x, const T* bias, T* dx, float* part, int64_t chunks,
                        int64_t m, int64_t n) {
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    const std::vector<float> bf = as_float(bias, n);
    const float* b = bf.data();
    for (int64_t c = c0; c < c1; ++c) {
      float* acc = part + c * n;
      std::fill(acc, acc + n, 0.f);
      for (int64_t r = chunk_start(c, chunks, m); r < chunk_start(c + 1, chunks, m); ++r) {
        const T* xr = x + r * n;
        const T* dyr = dy + r * n;
        T* dxr = dx + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const float v = load(xr[j]) + b[j];
          const float d = load(dyr[j]) * (TANH ? gelu_tanh_grad(v) : gelu_erf_grad(v));
          store(dxr[j], d);
          acc[j] += d;
        }
      }
    }
  });
}

Tensor bias_gelu_fwd(const Tensor& x_, const Tensor& bias_, bool tanh) {
  check_rows(x_, bias_, "bias_gelu", "bias");
  TORCH_CHECK(x_.scalar_type() == bias_.scalar_type(), "bias_gelu: x and bias must share a dtype");
  const Tensor x = x_.contiguous(), bias = bias_.contiguous();
  Tensor y = new_output(x.sizes(), x.options());
  const int64_t n = x.size(-1), m = n ? x.numel() / n : 0;
  if (m == 0 || n == 0) return y;
  dispatch_float_bf16(x.scalar_type(), "bias_gelu", [&](auto tag) {
    using T = decltype(tag);
    if (tanh) bias_gelu_fwd_impl<T, true>(ptr<T>(x), ptr<T>(bias), mut<T>(y), m, n);
    else bias_gelu_fwd_impl<T, false>(ptr<T>(x), ptr<T>(bias), mut<T>(y), m, n);
  });
  return y;
}

std::vector<Tensor> bias_gelu_bwd(const Tensor& dy_, const Tensor& x_, const Tensor& bias_, bool tanh) {
  check_rows(x_, bias_, "bias_gelu_backward", "bias");
  const Tensor x = x_.contiguous(), bias = bias_.contiguous();
  const Tensor dy = dy_.to(x.scalar_type()).contiguous();
  TORCH_CHECK(dy.sizes() == x.sizes(), "bias_gelu_backward: grad and x differ in shape");
  Tensor dx = new_output(x.sizes(), x.options());
  Tensor db = at::zeros({bias.size(0)}, bias.options());
  const int64_t n = x.size(-1), m = n ? x.numel() / n : 0;
  if (m == 0 || n == 0) return {dx, db};
  const int64_t chunks = num_chunks(m);
  Tensor part = at::empty({chunks, n}, x.options().dtype(at::kFloat));
  dispatch_float_bf16(x.scalar_type(), "bias_gelu_backward", [&](auto tag) {
    using T = decltype(tag);
    if (tanh) bias_gelu_bwd_impl<T, true>(ptr<T>(dy), ptr<T>(x), ptr<T>(bias), mut<T>(dx), mut<float>(part),
                                          chunks, m, n);
    else bias_gelu_bwd_impl<T, false>(ptr<T>(dy), ptr<T>(x), ptr<T>(bias), mut<T>(dx), mut<float>(part),
                                      chunks, m, n);
    reduce_partials(ptr<float>(part), chunks, n, mut<T>(db));
  });
  return {dx, db};
}

// ================================ dropout + residual + LayerNorm ==============================

struct Dropout {
  uint32_t key = 0, threshold = 0;
  float scale = 1.f;
};

Dropout make_dropout(const std::optional<Tensor>& seed, double p) {
  Dropout d;
  if (p <= 0.0) return d;
  TORCH_CHECK(seed.has_value() && seed->numel() == 1, "residual_layer_norm: dropout needs a one-element seed");
  d.key = dropout_key(static_cast<uint64_t>(seed->to(at::kCPU).item<int64_t>()));
  d.threshold = static_cast<uint32_t>(std::min(16777216.0, std::ceil(p * 16777216.0)));
  d.scale = p >= 1.0 ? 0.f : static_cast<float>(1.0 / (1.0 - p));
  return d;
}

// h[j] = dropout(x[j]) + res[j] for the row starting at flat index `base`; with MASK, mask[j] is
// what the backward multiplies by (scale or 0). Returns the row's sum.
template <typename T, bool DROP, bool MASK>
inline float residual_row(const T* xr, const T* rr, float* h, float* mask, int64_t n, uint64_t base,
                          const Dropout& d) {
  float sum = 0.f;
  if (!DROP) {
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const float v = load(xr[j]) + load(rr[j]);
      h[j] = v;
      sum += v;
    }
    return sum;
  }
  const uint32_t hi = static_cast<uint32_t>(base >> 32), lo = static_cast<uint32_t>(base);
  if (((base + n - 1) >> 32) == hi) {  // the usual case: the row's indices share their high word
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < n; ++j) {
      const bool keep = dropout_keep(d.key, lo + static_cast<uint32_t>(j), hi, d.threshold);
      const float v = (keep ? load(xr[j]) * d.scale : 0.f) + load(rr[j]);
      if (MASK) mask[j] = keep ? d.scale : 0.f;
      h[j] = v;
      sum += v;
    }
  } else {
    for (int64_t j = 0; j < n; ++j) {
      const uint64_t i = base + static_cast<uint64_t>(j);
      const bool keep = dropout_keep(d.key, static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), d.threshold);
      const float v = (keep ? load(xr[j]) * d.scale : 0.f) + load(rr[j]);
      if (MASK) mask[j] = keep ? d.scale : 0.f;
      h[j] = v;
      sum += v;
    }
  }
  return sum;
}

template <typename T, bool DROP>
void rln_fwd_impl(const T* x, const T* res, const T* w, const T* b, T* out, float* mean, float* rstd,
                  int64_t m, int64_t n, float eps, const Dropout& d) {
  at::parallel_for(0, m, row_grain(n), [&](int64_t r0, int64_t r1) {
    std::vector<float> buf(n);
    float* h = buf.data();
    const std::vector<float> wv = as_float(w, n), bv = as_float(b, n);
    const float* wf = wv.data();
    const float* bf = bv.data();
    for (int64_t r = r0; r < r1; ++r) {
      const float mu = residual_row<T, DROP, false>(x + r * n, res + r * n, h, nullptr, n,
                                                    static_cast<uint64_t>(r) * n, d) / n;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < n; ++j) sq += (h[j] - mu) * (h[j] - mu);
      const float rs = 1.f / std::sqrt(sq / n + eps);
      mean[r] = mu;
      rstd[r] = rs;
      T* o = out + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) store(o[j], (h[j] - mu) * rs * wf[j] + bf[j]);
    }
  });
}

template <typename T, bool DROP>
void rln_bwd_impl(const T* dy, const T* x, const T* res, const T* w, const float* mean, const float* rstd,
                  T* dx, T* dres, float* part, int64_t chunks, int64_t m, int64_t n, const Dropout& d) {
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> buf(2 * n);
    float* xh = buf.data();
    float* mask = xh + n;
    const std::vector<float> wv = as_float(w, n);
    const float* wf = wv.data();
    for (int64_t c = c0; c < c1; ++c) {
      float* dw = part + 2 * c * n;
      float* db = dw + n;
      std::fill(dw, dw + 2 * n, 0.f);
      for (int64_t r = chunk_start(c, chunks, m); r < chunk_start(c + 1, chunks, m); ++r) {
        residual_row<T, DROP, true>(x + r * n, res + r * n, xh, mask, n, static_cast<uint64_t>(r) * n, d);
        const float mu = mean[r], rs = rstd[r];
        const T* g = dy + r * n;
        float sg = 0.f, sgx = 0.f;
#pragma omp simd reduction(+ : sg, sgx)
        for (int64_t j = 0; j < n; ++j) {
          const float xhat = (xh[j] - mu) * rs;
          const float dyv = load(g[j]);
          const float gw = dyv * wf[j];
          xh[j] = xhat;
          sg += gw;
          sgx += gw * xhat;
          dw[j] += dyv * xhat;
          db[j] += dyv;
        }
        const float c1m = sg / n, c2m = sgx / n;
        T* dr = dres + r * n;
        if (DROP) {
          T* dxr = dx + r * n;
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) {
            const float dh = rs * (load(g[j]) * wf[j] - c1m - xh[j] * c2m);
            store(dr[j], dh);
            store(dxr[j], dh * mask[j]);
          }
        } else {
#pragma omp simd
          for (int64_t j = 0; j < n; ++j) store(dr[j], rs * (load(g[j]) * wf[j] - c1m - xh[j] * c2m));
        }
      }
    }
  });
}

void check_rln(const Tensor& x, const Tensor& res, const Tensor& w, const Tensor& b, const char* what) {
  check_rows(x, w, what, "weight");
  check_rows(x, b, what, "bias");
  TORCH_CHECK(res.sizes() == x.sizes(), what, ": x and residual differ in shape");
  const auto t = x.scalar_type();
  TORCH_CHECK(res.scalar_type() == t && w.scalar_type() == t && b.scalar_type() == t, what,
              ": x, residual, weight and bias must share a dtype");
}

std::vector<Tensor> residual_layer_norm_fwd(const Tensor& x_, const Tensor& res_, const Tensor& w_,
                                            const Tensor& b_, const std::optional<Tensor>& seed, double eps,
                                            double p) {
  check_rln(x_, res_, w_, b_, "residual_layer_norm");
  const Tensor x = x_.contiguous(), res = res_.contiguous(), w = w_.contiguous(), b = b_.contiguous();
  const int64_t n = x.size(-1), m = n ? x.numel() / n : 0;
  Tensor out = new_output(x.sizes(), x.options());
  Tensor mean = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  Tensor rstd = at::empty_like(mean);
  if (m == 0 || n == 0) return {out, mean, rstd};
  const Dropout d = make_dropout(seed, p);
  dispatch_float_bf16(x.scalar_type(), "residual_layer_norm", [&](auto tag) {
    using T = decltype(tag);
    auto run = [&](auto drop) {
      rln_fwd_impl<T, decltype(drop)::value>(ptr<T>(x), ptr<T>(res), ptr<T>(w), ptr<T>(b), mut<T>(out),
                                             mut<float>(mean), mut<float>(rstd), m, n,
                                             static_cast<float>(eps), d);
    };
    if (p > 0.0) run(std::true_type{});
    else run(std::false_type{});
  });
  return {out, mean, rstd};
}

// -> [dx, dresidual, dweight, dbias]; without dropout dx is dresidual (returned once, as dx undefined).
std::vector<Tensor> residual_layer_norm_bwd(const Tensor& dy_, const Tensor& x_, const Tensor& res_,
                                            const Tensor& w_, const std::optional<Tensor>& seed,
                                            const Tensor& mean_, const Tensor& rstd_, double p) {
  check_rln(x_, res_, w_, w_, "residual_layer_norm_backward");
  const Tensor x = x_.contiguous(), res = res_.contiguous(), w = w_.contiguous();
  const Tensor dy = dy_.to(x.scalar_type()).contiguous();
  const Tensor mean = mean_.contiguous(), rstd = rstd_.contiguous();
  TORCH_CHECK(dy.sizes() == x.sizes(), "residual_layer_norm_backward: grad and x differ in shape");
  const int64_t n = x.size(-1), m = n ? x.numel() / n : 0;
  TORCH_CHECK(mean.numel() == m && rstd.numel() == m && mean.scalar_type() == at::kFloat &&
              rstd.scalar_type() == at::kFloat, "residual_layer_norm_backward: mean/rstd must be float32 per row");
  const bool drop = p > 0.0;
  Tensor dres = new_output(x.sizes(), x.options());
  Tensor dx = drop ? new_output(x.sizes(), x.options()) : Tensor();
  Tensor dw = at::zeros({n}, w.options()), db = at::zeros({n}, w.options());
  if (m == 0 || n == 0) return {dx, dres, dw, db};
  const Dropout d = make_dropout(seed, p);
  const int64_t chunks = num_chunks(m);
  Tensor part = at::empty({chunks, 2, n}, x.options().dtype(at::kFloat));
  dispatch_float_bf16(x.scalar_type(), "residual_layer_norm_backward", [&](auto tag) {
    using T = decltype(tag);
    if (drop) rln_bwd_impl<T, true>(ptr<T>(dy), ptr<T>(x), ptr<T>(res), ptr<T>(w), ptr<float>(mean),
                                    ptr<float>(rstd), mut<T>(dx), mut<T>(dres), mut<float>(part), chunks, m, n, d);
    else rln_bwd_impl<T, false>(ptr<T>(dy), ptr<T>(x), ptr<T>(res), ptr<T>(w), ptr<float>(mean),
                                ptr<float>(rstd), nullptr, mut<T>(dres), mut<float>(part), chunks, m, n, d);
    // part is [chunks][2][n]: weight partials at even rows, bias partials at odd rows
    Tensor pw = part.select(1, 0).contiguous(), pb = part.select(1, 1).contiguous();
    reduce_partials(ptr<float>(pw), chunks, n, mut<T>(dw));
    reduce_partials(ptr<float>(pb), chunks, n, mut<T>(db));
  });
  return {dx, dres, dw, db};
}

// ================================ RMSNorm (LlamaRMSNorm) =======================================
// y = weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype), in the dtype weight * x promotes to.

template <typename T, typename W, typename O>
void rms_fwd_impl(const T* x, const W* w, O* out, float* rstd, int64_t m, int64_t n, float eps) {
  at::parallel_for(0, m, row_grain(n), [&](int64_t r0, int64_t r1) {
    const std::vector<float> wv = as_float(w, n);
    const float* wf = wv.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * n;
      float sq = 0.f;
#pragma omp simd reduction(+ : sq)
      for (int64_t j = 0; j < n; ++j) sq += load(xr[j]) * load(xr[j]);
      const float rs = 1.f / std::sqrt(sq / n + eps);
      rstd[r] = rs;
      O* o = out + r * n;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) store(o[j], wf[j] * round_to<T>(load(xr[j]) * rs));
    }
  });
}

template <typename T, typename W, typename O>
void rms_bwd_impl(const O* dy, const T* x, const W* w, const float* rstd, T* dx, float* part, int64_t chunks,
                  int64_t m, int64_t n) {
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    const std::vector<float> wv = as_float(w, n);
    const float* wf = wv.data();
    for (int64_t c = c0; c < c1; ++c) {
      float* dw = part + c * n;
      std::fill(dw, dw + n, 0.f);
      for (int64_t r = chunk_start(c, chunks, m); r < chunk_start(c + 1, chunks, m); ++r) {
        const T* xr = x + r * n;
        const O* g = dy + r * n;
        const float rs = rstd[r];
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < n; ++j) {
          const float xhat = load(xr[j]) * rs;
          const float dyv = load(g[j]);
          dot += dyv * wf[j] * xhat;
          dw[j] += dyv * round_to<T>(xhat);
        }
        const float cm = dot / n;
        T* dxr = dx + r * n;
#pragma omp simd
        for (int64_t j = 0; j < n; ++j) {
          const float xhat = load(xr[j]) * rs;
          store(dxr[j], rs * (load(g[j]) * wf[j] - xhat * cm));
        }
      }
    }
  });
}

// Calls f(T{}, W{}, O{}) for the dtype combinations the kernels take.
template <typename F>
void dispatch_rms(at::ScalarType xt, at::ScalarType wt, F&& f) {
  if (xt == at::kFloat && wt == at::kFloat) f(float{}, float{}, float{});
  else if (xt == at::kBFloat16 && wt == at::kBFloat16) f(uint16_t{}, uint16_t{}, uint16_t{});
  else if (xt == at::kBFloat16 && wt == at::kFloat) f(uint16_t{}, float{}, float{});
  else TORCH_CHECK(false, "rms_norm: takes x/weight of float32/float32, bfloat16/bfloat16 or bfloat16/float32, not ",
                   xt, "/", wt);
}

std::vector<Tensor> rms_norm_fwd(const Tensor& x_, const Tensor& w_, double eps) {
  check_rows(x_, w_, "rms_norm", "weight");
  const Tensor x = x_.contiguous(), w = w_.contiguous();
  const auto out_type = c10::promoteTypes(x.scalar_type(), w.scalar_type());
  Tensor out = new_output(x.sizes(), x.options().dtype(out_type));
  Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
  const int64_t n = x.size(-1), m = n ? x.numel() / n : 0;
  if (m == 0 || n == 0) return {out, rstd};
  dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto t, auto wt, auto o) {
    using T = decltype(t);
    using W = decltype(wt);
    using O = decltype(o);
    rms_fwd_impl<T, W, O>(ptr<T>(x), ptr<W>(w), mut<O>(out), mut<float>(rstd), m, n, static_cast<float>(eps));
  });
  return {out, rstd};
}

std::vector<Tensor> rms_norm_bwd(const Tensor& dy_, const Tensor& x_, const Tensor& w_, const Tensor& rstd_) {
  check_rows(x_, w_, "rms_norm_backward", "weight");
  const Tensor x = x_.contiguous(), w = w_.contiguous(), rstd = rstd_.contiguous();
  const auto out_type = c10::promoteTypes(x.scalar_type(), w.scalar_type());
  const Tensor dy = dy_.to(out_type).contiguous();
  TORCH_CHECK(dy.sizes() == x.sizes(), "rms_norm_backward: grad and x differ in shape");
  const int64_t n = x.size(-1), m = n ? x.numel() / n : 0;
  TORCH_CHECK(rstd.numel() == m && rstd.scalar_type() == at::kFloat, "rms_norm_backward: rstd must be float32 per row");
  Tensor dx = new_output(x.sizes(), x.options());
  Tensor dw = at::zeros({n}, w.options());
  if (m == 0 || n == 0) return {dx, dw};
  const int64_t chunks = num_chunks(m);
  Tensor part = at::empty({chunks, n}, x.options().dtype(at::kFloat));
  dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto t, auto wt, auto o) {
    using T = decltype(t);
    using W = decltype(wt);
    using O = decltype(o);
    rms_bwd_impl<T, W, O>(ptr<O>(dy), ptr<T>(x), ptr<W>(w), ptr<float>(rstd), mut<T>(dx), mut<float>(part),
                          chunks, m, n);
    reduce_partials(ptr<float>(part), chunks, n, mut<W>(dw));
  });
  return {dx, dw};
}

}  // namespace
}  // namespace raylib_kernels

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace raylib_kernels;
  m.doc() = "raylib's fused element-wise CPU kernels (kernels/cpu)";
  m.def("bias_gelu_fwd", &bias_gelu_fwd, "gelu(x + bias)", py::arg("x"), py::arg("bias"), py::arg("tanh"));
  m.def("bias_gelu_bwd", &bias_gelu_bwd, "-> [dx, dbias]", py::arg("grad"), py::arg("x"), py::arg("bias"),
        py::arg("tanh"));
  m.def("residual_layer_norm_fwd", &residual_layer_norm_fwd, "-> [out, mean, rstd]", py::arg("x"),
        py::arg("residual"), py::arg("weight"), py::arg("bias"), py::arg("seed"), py::arg("eps"), py::arg("p"));
  m.def("residual_layer_norm_bwd", &residual_layer_norm_bwd, "-> [dx (None without dropout), dres, dw, db]",
        py::arg("grad"), py::arg("x"), py::arg("residual"), py::arg("weight"), py::arg("seed"), py::arg("mean"),
        py::arg("rstd"), py::arg("p"));
  m.def("rms_norm_fwd", &rms_norm_fwd, "-> [out, rstd]", py::arg("x"), py::arg("weight"), py::arg("eps"));
  m.def("rms_norm_bwd", &rms_norm_bwd, "-> [dx, dweight]", py::arg("grad"), py::arg("x"), py::arg("weight"),
        py::arg("rstd"));
}
