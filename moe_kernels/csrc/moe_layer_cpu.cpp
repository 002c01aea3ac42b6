// A MoE layer whose experts are all in this process (the `local` backend) as one call: the
// dispatch layout (rows sorted by expert), the activations' MXFP4 quantization where the
// experts are W4A4, the gather, the grouped experts, and the router-weighted combine back
// into token order. The same kernels as the Python path's (`ep_dispatch.local`), in the
// same order, so the same bits; what goes is the Python between them (the row format's
// packing and unpacking, the layout's tensors, the per-expert timer), which at a decode
// step's one row cost as much as the experts' own arithmetic.
#include "kernels.h"

// x [T, H] float32; topk_ids [T, K] int64 and topk_weights [T, K] float32, the router's;
// float32 experts: gate_up [E, 2I/16, H, 16] and down [E, H/16, I, 16] panels, scales
// undefined; W4A4 experts: the MXFP4 panels' codes as gate_up and down, their scale bytes
// as gate_up_scales and down_scales -> (out [T, H] float32, rows per expert [E], marks:
// each expert's (start, end) monotonic ns as the grouped kernels give them, then when the
// combine began).
std::tuple<torch::Tensor, std::vector<int64_t>, std::vector<int64_t>> local_moe(
    const torch::Tensor& x, const torch::Tensor& topk_ids, const torch::Tensor& topk_weights,
    const torch::Tensor& gate_up, const c10::optional<torch::Tensor>& gate_up_scales,
    const torch::Tensor& down, const c10::optional<torch::Tensor>& down_scales) {
  TORCH_CHECK(x.dtype() == torch::kFloat32 && x.dim() == 2 && x.is_contiguous(),
              "x must be contiguous float32 [T, H]");
  TORCH_CHECK(gate_up_scales.has_value() == down_scales.has_value(),
              "both weights are MXFP4 (with scales) or neither");
  const int64_t experts = gate_up.size(0);
  auto [src, weights, counts_t] = sort_rows_cpu(topk_ids.reshape({-1}), topk_weights, experts);
  const int64_t* cp = counts_t.data_ptr<int64_t>();
  const std::vector<int64_t> counts(cp, cp + experts);
  torch::Tensor y;
  std::vector<int64_t> marks;
  if (gate_up_scales) {
    auto [packed, scales] = quantize_mxfp4(x);  // [T, H/2], [T, H/32]: each token once
    std::tie(y, marks) = grouped_swiglu_w4a4(packed.index_select(0, src),
                                             scales.index_select(0, src), counts, gate_up,
                                             *gate_up_scales, down, *down_scales);
  } else {
    std::tie(y, marks) = grouped_swiglu_f32(x.index_select(0, src), counts, gate_up, down);
  }
  marks.push_back(monotonic_ns());
  return {combine_f32(y, src, weights, x.size(0)), counts, marks};
}
