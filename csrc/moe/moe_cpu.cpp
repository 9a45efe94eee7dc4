// CPU implementation of the grouped MoE ops (schemas in csrc/torch_bindings.cpp): moe_sort_tokens
// here, a stable counting sort of the T*k assignments by expert; the grouped linear and its
// backward in moe_cpu_forward.cpp and moe_cpu_backward.cpp (what they share:
// moe_cpu_grouped_linear.h).
#include <torch/library.h>

#include <vector>

#include "moe/moe_cpu_grouped_linear.h"
#include "moe/moe_torch_checks.h"

namespace pykernels::moe {
namespace {

std::tuple<at::Tensor, at::Tensor, at::Tensor> sort_tokens_cpu(const at::Tensor& top_k_index, int64_t num_experts) {
  check_top_k_index(top_k_index, num_experts);
  const at::Tensor flat = top_k_index.reshape(-1).to(at::kLong).contiguous();
  const int64_t slots = flat.numel();
  const int64_t* id = flat.data_ptr<int64_t>();
  std::vector<int64_t> next(num_experts + 2, 0);  // counts, then each bucket's next free slot
  for (int64_t a = 0; a < slots; ++a) {
    const int64_t e = id[a] >= 0 && id[a] < num_experts ? id[a] : num_experts;  // dropped: last bucket
    ++next[e + 1];
  }
  for (int64_t e = 0; e <= num_experts; ++e) next[e + 1] += next[e];
  at::Tensor offsets = at::from_blob(next.data(), {num_experts + 1}, at::kLong).clone();
  at::Tensor sorted_expert = at::empty({slots}, at::kLong), sorted_token = at::empty({slots}, at::kLong);
  int64_t* se = sorted_expert.data_ptr<int64_t>();
  int64_t* st = sorted_token.data_ptr<int64_t>();
  for (int64_t a = 0; a < slots; ++a) {
    const int64_t e = id[a] >= 0 && id[a] < num_experts ? id[a] : num_experts;
    const int64_t s = next[e]++;
    se[s] = e;
    st[s] = a;
  }
  return {sorted_expert, sorted_token, offsets};
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CPU, m) {
  m.impl("moe_sort_tokens", &sort_tokens_cpu);
  m.impl("moe_grouped_linear", &cpu_op::grouped_linear_cpu);
  m.impl("moe_grouped_linear_backward", &cpu_op::grouped_linear_backward_cpu);
}

}  // namespace pykernels::moe
