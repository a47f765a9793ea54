// The extension module: one Python module holding every native CPU op.

#include <torch/extension.h>

void register_attention(pybind11::module& m);
void register_elementwise(pybind11::module& m);
void register_quantized(pybind11::module& m);
void register_sampling(pybind11::module& m);
void register_kv_chunks(pybind11::module& m);
void register_deterministic(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Arbor's native CPU kernels (see kernels/cpu_native/__init__.py)";
  register_attention(m);
  register_elementwise(m);
  register_quantized(m);
  register_sampling(m);
  register_kv_chunks(m);
  register_deterministic(m);
}
