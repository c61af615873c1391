// The Python module of batchprompt's CPU kernels (built by batchprompt/kernels/build.py).
#include <torch/extension.h>

torch::Tensor decode_attention(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                               torch::Tensor block_table, torch::Tensor context_lens,
                               int64_t block_size, double scale);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm(torch::Tensor residual, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor silu_mul(torch::Tensor gate_up);
void rotary_to_cache(torch::Tensor qkv, int64_t num_heads, int64_t num_kv_heads, torch::Tensor cos,
                     torch::Tensor sin, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slot_mapping);
torch::Tensor argmax_rows(torch::Tensor x);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention,
        "Paged decode attention: q [B, H, D], k/v cache [slots, Hkv, D], block table, context lengths");
  m.def("rms_norm", &rms_norm, "weight * rms_norm(x)");
  m.def("add_rms_norm", &add_rms_norm, "residual += delta in place; returns weight * rms_norm(residual)");
  m.def("silu_mul", &silu_mul, "silu(gate) * up from gate_up [rows, 2I]");
  m.def("argmax_rows", &argmax_rows, "argmax over the last dim of a float32 [rows, n] tensor");
  m.def("rotary_to_cache", &rotary_to_cache, "rotary on q and k of qkv in place, then k and v into the cache");
}
