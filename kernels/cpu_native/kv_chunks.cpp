// Copying K/V out of the pool into chunk payloads: the KV disk tier's write path.
//
// The torch reference takes two ops per layer and K/V (a gather into a temporary, then a
// strided copy into the payloads) and hands the GIL back and forth around each; on SmolLM2
// (30 layers) that is 120 ops a call. Here one call copies each slot's row straight to its
// place, one memcpy per (chunk, layer, K/V, position).

#include "common.h"

namespace {

// See kernels/reference/kv_chunks.py for the contract.
void gather_kv_chunks(torch::Tensor out, torch::Tensor out_rows, std::vector<torch::Tensor> k_buffers,
                      std::vector<torch::Tensor> v_buffers, torch::Tensor slots) {
  const int64_t layers = static_cast<int64_t>(k_buffers.size());
  TORCH_CHECK(out.dim() == 6 && out.is_contiguous() && out.size(1) == layers && out.size(2) == 2,
              "out must be a contiguous [R, layers, 2, T, kv_heads, head_dim]");
  TORCH_CHECK(v_buffers.size() == k_buffers.size(), "one K and one V buffer per layer");
  TORCH_CHECK(out_rows.dim() == 1 && out_rows.scalar_type() == torch::kInt64 &&
                  out_rows.is_contiguous(),
              "out_rows must be a contiguous [C] int64");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == torch::kInt64 && slots.is_contiguous(),
              "slots must be a contiguous [C * T] int64");
  const int64_t chunks = out_rows.size(0), tokens = out.size(3), capacity = out.size(0);
  TORCH_CHECK(slots.size(0) == chunks * tokens, "slots must hold T slots per chunk");
  const int64_t row_elems = out.size(4) * out.size(5);
  const size_t row_bytes = static_cast<size_t>(row_elems) * out.element_size();
  std::vector<const char*> sources(2 * layers);
  int64_t pool_slots = -1;
  for (int64_t layer = 0; layer < layers; ++layer) {
    for (int kind = 0; kind < 2; ++kind) {
      const auto& buffer = kind == 0 ? k_buffers[layer] : v_buffers[layer];
      TORCH_CHECK(buffer.is_contiguous() && buffer.scalar_type() == out.scalar_type() &&
                      buffer.dim() == 3 && buffer.size(1) * buffer.size(2) == row_elems,
                  "K/V buffers must be contiguous [slots, kv_heads, head_dim] in out's dtype");
      TORCH_CHECK(pool_slots < 0 || buffer.size(0) == pool_slots, "buffers differ in slots");
      pool_slots = buffer.size(0);
      sources[2 * layer + kind] = static_cast<const char*>(buffer.data_ptr());
    }
  }
  const int64_t* slot = slots.data_ptr<int64_t>();
  const int64_t* row = out_rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < chunks * tokens; ++i)
    TORCH_CHECK(slot[i] >= 0 && slot[i] < pool_slots, "slot ", slot[i], " is out of the pool");
  for (int64_t c = 0; c < chunks; ++c)
    TORCH_CHECK(row[c] >= 0 && row[c] < capacity, "out row ", row[c], " is out of range");
  char* base = static_cast<char*>(out.data_ptr());
  const size_t span = static_cast<size_t>(tokens) * row_bytes;  // one (layer, K/V) of a chunk
  // One thread: a few MB of copies are bound by memory, and a second thread would wait for a
  // core the store's writer thread may hold (measured on 2 loaded cores: slower, not faster).
  for (int64_t c = 0; c < chunks; ++c) {
    for (int64_t source = 0; source < 2 * layers; ++source) {
      char* target = base + (row[c] * 2 * layers + source) * span;
      const char* from = sources[source];
      for (int64_t t = 0; t < tokens; ++t)
        std::memcpy(target + t * row_bytes, from + slot[c * tokens + t] * row_bytes, row_bytes);
    }
  }
}

}  // namespace

void register_kv_chunks(pybind11::module& m) {
  m.def("gather_kv_chunks", &gather_kv_chunks,
        pybind11::call_guard<pybind11::gil_scoped_release>());
}
