// What the kernel files share: the float dtype dispatch and math written so that loops
// calling it vectorize.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "spin_pool.h"

// Runs the lambda with `alias` naming the C++ type of float32, bfloat16 or float16 `type`.
#define ARBOR_DISPATCH_FLOAT(type, alias, ...)                                     \
  [&] {                                                                            \
    switch (type) {                                                                \
      case torch::kFloat32: { using alias = float; return __VA_ARGS__(); }         \
      case torch::kBFloat16: { using alias = c10::BFloat16; return __VA_ARGS__(); } \
      case torch::kFloat16: { using alias = c10::Half; return __VA_ARGS__(); }     \
      default: TORCH_CHECK(false, "unsupported dtype ", type);                     \
    }                                                                              \
  }()

// Two results, which reach Python as a tuple.
using TensorPair = std::tuple<torch::Tensor, torch::Tensor>;

namespace arbor_cpu {

// Deterministic mode (--deterministic, kernels/cpu_native/deterministic.cpp): the kernels whose
// fastest order of summation depends on the batch, the chunking or the thread count take one
// fixed order instead. Process-wide, set once when a model runner starts.
inline std::atomic<bool>& deterministic_mode() {
  static std::atomic<bool> on{false};
  return on;
}

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 in plain arithmetic, so loops over it vectorize (libm's expf does not):
// x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-6 Taylor polynomial (relative error
// under 2e-7), 2^n through the exponent bits. Below -87 (and for -inf) the result is 0.
inline float exp_nonpositive(float x) {
  const float clamped = std::max(x, -87.f);
  const float n = std::nearbyint(clamped * 1.44269504088896341f);
  const float r = clamped - n * 0.693145751953125f - n * 1.428606765330187e-06f;
  float p = 1.f / 720.f;
  p = p * r + 1.f / 120.f;
  p = p * r + 1.f / 24.f;
  p = p * r + 1.f / 6.f;
  p = p * r + 0.5f;
  p = p * r + 1.f;
  p = p * r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return x < -87.f ? 0.f : p * scale;
}

// silu(x) = x * sigmoid(x) through exp_nonpositive(-|x|), so it vectorizes for either sign.
inline float silu(float x) {
  const float e = exp_nonpositive(-std::fabs(x));
  const float sigmoid = x >= 0.f ? 1.f / (1.f + e) : e / (1.f + e);
  return x * sigmoid;
}

// Rotate-half rotary embedding of one head: out[i], out[i + half] from x[i], x[i + half] and
// cos/sin [2 * half] (float32, rounded to scalar_t first, as the reference rounds them). In
// float32 plain products; in 16-bit dtypes each product and the sum rounded to the storage
// dtype, like the torch ops. Shared by apply_rotary_emb and the fused decode attention, so
// both round alike.
template <typename scalar_t>
inline void rotate_head(const scalar_t* x, const float* c, const float* s, int64_t half,
                        scalar_t* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = to_float(x[i]), b = to_float(x[i + half]);
    const float c1 = to_float(static_cast<scalar_t>(c[i]));
    const float s1 = to_float(static_cast<scalar_t>(s[i]));
    const float c2 = to_float(static_cast<scalar_t>(c[i + half]));
    const float s2 = to_float(static_cast<scalar_t>(s[i + half]));
    if constexpr (std::is_same_v<scalar_t, float>) {
      out[i] = a * c1 - b * s1;
      out[i + half] = b * c2 + a * s2;
    } else {
      const scalar_t ac = static_cast<scalar_t>(a * c1), bs = static_cast<scalar_t>(-b * s1);
      const scalar_t bc = static_cast<scalar_t>(b * c2), as = static_cast<scalar_t>(a * s2);
      out[i] = static_cast<scalar_t>(to_float(ac) + to_float(bs));
      out[i + half] = static_cast<scalar_t>(to_float(bc) + to_float(as));
    }
  }
}

}  // namespace arbor_cpu
