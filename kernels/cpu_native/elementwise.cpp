// Norms, rotary embedding and gated activation for CPU, each one pass over its rows with no
// intermediate tensors. Numerics follow kernels/reference/elementwise.py: float32 inside,
// rounded to the input dtype where the reference rounds.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "common.h"

#include <cmath>

namespace {

using arbor_cpu::to_float;

// Rows of the last dimension; grain sized so a task holds about 16K elements.
int64_t row_grain(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// out = weight * (x * rsqrt(mean(x^2) + eps) rounded to x's dtype); with a residual, x is
// first replaced by x + residual, which is also returned.
template <typename scalar_t>
void norm_rows(const scalar_t* x, const scalar_t* res, const scalar_t* w, scalar_t* out,
               scalar_t* sum_out, int64_t rows, int64_t width, float eps) {
  arbor_cpu::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
    std::vector<float> tmp(width);
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* xr = x + r * width;
      float ss = 0.f;
      for (int64_t i = 0; i < width; ++i) {
        float v = to_float(xr[i]);
        if (res) {
          // The sum is rounded to the storage dtype before the norm reads it, as in the reference.
          const scalar_t s = static_cast<scalar_t>(v + to_float(res[r * width + i]));
          sum_out[r * width + i] = s;
          v = to_float(s);
        }
        tmp[i] = v;
        ss += v * v;
      }
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(width) + eps);
      scalar_t* orow = out + r * width;
      for (int64_t i = 0; i < width; ++i) {
        const scalar_t normed = static_cast<scalar_t>(tmp[i] * inv);
        orow[i] = static_cast<scalar_t>(to_float(w[i]) * to_float(normed));
      }
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto xc = x.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(xc);
  const int64_t width = xc.size(-1), rows = width ? xc.numel() / width : 0;
  ARBOR_DISPATCH_FLOAT(x.scalar_type(), scalar_t, [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), nullptr, w.data_ptr<scalar_t>(),
                        out.data_ptr<scalar_t>(), nullptr, rows, width, static_cast<float>(eps));
  });
  return out;
}

TensorPair fused_add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                              double eps) {
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual must match in shape and dtype");
  auto xc = x.contiguous(), rc = residual.contiguous();
  auto w = weight.to(x.scalar_type()).contiguous();
  auto out = torch::empty_like(xc), sum = torch::empty_like(xc);
  const int64_t width = xc.size(-1), rows = width ? xc.numel() / width : 0;
  ARBOR_DISPATCH_FLOAT(x.scalar_type(), scalar_t, [&] {
    norm_rows<scalar_t>(xc.data_ptr<scalar_t>(), rc.data_ptr<scalar_t>(),
                        w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                        sum.data_ptr<scalar_t>(), rows, width, static_cast<float>(eps));
  });
  return {out, sum};
}

// Rotate-half rotary embedding of x [T, heads, D] (last dim contiguous) by cos/sin [T, D],
// into a new contiguous tensor. cos/sin are rounded to x's dtype first, as the reference does.
template <typename scalar_t>
torch::Tensor rotate(const torch::Tensor& x, const float* cos, const float* sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const scalar_t* xp = x.data_ptr<scalar_t>();
  scalar_t* op = out.data_ptr<scalar_t>();
  const int64_t st = x.stride(0), sh = x.stride(1);
  arbor_cpu::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        arbor_cpu::rotate_head(xp + t * st + h * sh, c, s, half, op + (t * heads + h) * dim);
      }
    }
  });
  return out;
}

TensorPair apply_rotary_emb(torch::Tensor q, torch::Tensor k, torch::Tensor cos,
                            torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.stride(2) == 1 && k.stride(2) == 1,
              "q and k: [T, heads, D] with a contiguous last dimension");
  TORCH_CHECK(q.scalar_type() == k.scalar_type(), "q and k must share a dtype");
  auto c = cos.to(torch::kFloat32).contiguous(), s = sin.to(torch::kFloat32).contiguous();
  TORCH_CHECK(c.size(0) == q.size(0) && c.size(1) == q.size(2), "cos/sin: [T, D]");
  return ARBOR_DISPATCH_FLOAT(q.scalar_type(), scalar_t, [&] {
    return TensorPair{rotate<scalar_t>(q, c.data_ptr<float>(), s.data_ptr<float>()),
                      rotate<scalar_t>(k, c.data_ptr<float>(), s.data_ptr<float>())};
  });
}

// x [T, 2I] = gate | up; returns silu(gate) * up [T, I].
torch::Tensor silu_and_mul(torch::Tensor x) {
  auto xc = x.contiguous();
  const int64_t width = xc.size(-1), inner = width / 2, rows = width ? xc.numel() / width : 0;
  auto sizes = xc.sizes().vec();
  sizes.back() = inner;
  auto out = torch::empty(sizes, xc.options());
  ARBOR_DISPATCH_FLOAT(x.scalar_type(), scalar_t, [&] {
    const scalar_t* xp = xc.data_ptr<scalar_t>();
    scalar_t* op = out.data_ptr<scalar_t>();
    arbor_cpu::parallel_for(0, rows, row_grain(width), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t* g = xp + r * width;
        const scalar_t* u = g + inner;
        scalar_t* o = op + r * inner;
        _Pragma("omp simd")  // (a #pragma cannot sit inside the dispatch macro's argument)
        for (int64_t i = 0; i < inner; ++i) {
          const scalar_t act = static_cast<scalar_t>(arbor_cpu::silu(to_float(g[i])));
          o[i] = static_cast<scalar_t>(to_float(act) * to_float(u[i]));
        }
      }
    });
  });
  return out;
}

}  // namespace

void register_elementwise(pybind11::module& m) {
  // The kernels touch no Python object: other threads (the detokenizer, the HTTP server) run
  // while they do, as they do during torch's own ops.
  const auto release = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("rms_norm", &rms_norm, release);
  m.def("fused_add_rms_norm", &fused_add_rms_norm, release);
  m.def("apply_rotary_emb", &apply_rotary_emb, release);
  m.def("silu_and_mul", &silu_and_mul, release);
}
