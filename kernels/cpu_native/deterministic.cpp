// Deterministic mode (common.h) and the float linear layer it runs.
//
// oneDNN's and MKL's GEMMs block the reduction over k by the number of rows of x, so a token's
// output moves in the last bits with the batch it came in. fixed_order_linear computes every
// output as one dot product in one order: 16 float32 lanes stepping through k, then the lanes
// summed in a fixed tree. A tile of up to 4 rows of x times 4 rows of W shares its loads (16
// independent lane vectors), and threads split W's rows only, so neither the rows of x nor the
// thread count changes an output's order.

#include <torch/extension.h>

#include "common.h"

#include <array>

namespace {

constexpr int kLanes = 16;
constexpr int kTile = 4;  // rows of x, and rows of W, per tile

inline float sum_lanes(float* lanes) {
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

// y[m][r] = x[m] . w[r] for MT rows of x (row stride ldx) and RT rows of w (stride k).
template <int MT, int RT>
void tile(const float* x, int64_t ldx, const float* w, int64_t k, float* y, int64_t ldy) {
  float acc[MT][RT][kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes)
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < RT; ++r)
#pragma omp simd
        for (int l = 0; l < kLanes; ++l) acc[m][r][l] += x[m * ldx + i + l] * w[r * k + i + l];
  for (int l = 0; i + l < k; ++l)
    for (int m = 0; m < MT; ++m)
      for (int r = 0; r < RT; ++r) acc[m][r][l] += x[m * ldx + i + l] * w[r * k + i + l];
  for (int m = 0; m < MT; ++m)
    for (int r = 0; r < RT; ++r) y[m * ldy + r] = sum_lanes(acc[m][r]);
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);

template <int MT>
constexpr std::array<TileFn, kTile> tiles_of() {
  return {&tile<MT, 1>, &tile<MT, 2>, &tile<MT, 3>, &tile<MT, 4>};
}

// y = x W^T (+ bias), x [..., k] and W [n, k] of a float dtype, y in x's dtype.
torch::Tensor fixed_order_linear(torch::Tensor x, torch::Tensor weight,
                                 c10::optional<torch::Tensor> bias) {
  TORCH_CHECK(weight.dim() == 2, "weight must be [n, k]");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(x.size(-1) == k, "x has ", x.size(-1), " features, the weight ", k);
  auto x2 = x.reshape({-1, k}).to(torch::kFloat32).contiguous();
  auto w = weight.to(torch::kFloat32).contiguous();
  const int64_t rows = x2.size(0);
  auto y = torch::empty({rows, n}, x2.options());
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(torch::kFloat32).contiguous();
    TORCH_CHECK(b.numel() == n, "bias has ", b.numel(), " values, the weight ", n, " rows");
  }
  if (rows > 0 && n > 0) {
    static constexpr std::array<std::array<TileFn, kTile>, kTile> tiles = {
        tiles_of<1>(), tiles_of<2>(), tiles_of<3>(), tiles_of<4>()};
    const float* xp = x2.data_ptr<float>();
    const float* wp = w.data_ptr<float>();
    const float* bp = b.defined() ? b.data_ptr<float>() : nullptr;
    float* yp = y.data_ptr<float>();
    const int64_t groups = (n + kTile - 1) / kTile;
    // About 64K multiply-adds per task at least, so small layers do not pay for threads.
    const int64_t grain = std::max<int64_t>(1, 65536 / std::max<int64_t>(kTile * k * rows, 1));
    arbor_cpu::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t r0 = g * kTile, rt = std::min<int64_t>(kTile, n - r0);
        for (int64_t m0 = 0; m0 < rows; m0 += kTile) {
          const int64_t mt = std::min<int64_t>(kTile, rows - m0);
          tiles[mt - 1][rt - 1](xp + m0 * k, k, wp + r0 * k, k, yp + m0 * n + r0, n);
          if (bp)
            for (int64_t m = m0; m < m0 + mt; ++m)
              for (int64_t r = r0; r < r0 + rt; ++r) yp[m * n + r] += bp[r];
        }
      }
    });
  }
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = n;
  return y.view(shape).to(x.scalar_type());
}

void set_deterministic(bool on) { arbor_cpu::deterministic_mode() = on; }

}  // namespace

void register_deterministic(pybind11::module& m) {
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("fixed_order_linear", &fixed_order_linear, release,
        "y = x W^T (+ bias), each output summed in one order whatever x's rows");
  m.def("set_deterministic", &set_deterministic,
        "deterministic mode on or off for the whole process (kernels/cpu_native/common.h)");
}
