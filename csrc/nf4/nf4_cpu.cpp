// CPU implementations of the NF4 ops (schemas in csrc/torch_bindings.cpp): argument checks,
// output allocation and multi-threading over blocks with at::parallel_for.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common/cpu_memory.h"
#include "nf4/nf4_cpu_kernels.h"
#include "nf4/nf4_torch_checks.h"

namespace pykernels::nf4 {
namespace {

// Blocks per parallel task: enough work (~64K values) that scheduling cost stays negligible.
int64_t grain_blocks(int64_t blocksize) { return std::max<int64_t>(1, (int64_t{1} << 16) / blocksize); }

std::tuple<at::Tensor, at::Tensor> nf4_quantize_cpu(const at::Tensor& x, int64_t blocksize) {
  check_input(x, "x");
  check_blocksize(blocksize, "blocksize");
  const int64_t numel = x.numel();
  const int64_t blocks = num_blocks(numel, blocksize);
  at::Tensor packed = at::empty({(numel + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({blocks}, x.options().dtype(at::kFloat));
  advise_huge_pages(packed.data_ptr(), packed.nbytes());
  const QuantizeParams p{x.data_ptr(), float_dtype(x.scalar_type(), "x"), numel, blocksize,
                         packed.data_ptr<uint8_t>(), absmax.data_ptr<float>()};
  at::parallel_for(0, blocks, grain_blocks(blocksize),
                   [&](int64_t begin, int64_t end) { cpu::quantize_blocks(p, begin, end); });
  return {packed, absmax};
}

void nf4_dequantize_into_cpu(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                             const at::Tensor& out, const std::optional<at::Tensor>& nested_absmax,
                             const std::optional<at::Tensor>& nested_code,
                             const std::optional<at::Tensor>& nested_offset, int64_t nested_blocksize) {
  check_out(out, packed);
  const DequantizeParams p = dequantize_params(packed, absmax, blocksize, out.numel(), nested_absmax,
                                               nested_code, nested_offset, nested_blocksize, out);
  at::parallel_for(0, num_blocks(p.numel, blocksize), grain_blocks(blocksize),
                   [&](int64_t begin, int64_t end) { cpu::dequantize_blocks(p, begin, end); });
}

at::Tensor nf4_dequantize_cpu(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                              at::IntArrayRef shape, at::ScalarType dtype,
                              const std::optional<at::Tensor>& nested_absmax,
                              const std::optional<at::Tensor>& nested_code,
                              const std::optional<at::Tensor>& nested_offset, int64_t nested_blocksize) {
  float_dtype(dtype, "dtype");
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));
  advise_huge_pages(out.data_ptr(), out.nbytes());  // fresh pages: fault them in 2 MiB at a time
  nf4_dequantize_into_cpu(packed, absmax, blocksize, out, nested_absmax, nested_code, nested_offset,
                          nested_blocksize);
  return out;
}

std::tuple<at::Tensor, at::Tensor> dynamic8_quantize_cpu(const at::Tensor& x, const at::Tensor& code,
                                                         int64_t blocksize,
                                                         const std::optional<at::Tensor>& offset) {
  at::Tensor q, absmax;
  const Dynamic8QuantizeParams p = dynamic8_quantize_params(x, code, blocksize, offset, q, absmax);
  const std::shared_ptr<const cpu::DynamicLut> lut = cpu::dynamic_lut(p.code);
  at::parallel_for(0, absmax.numel(), grain_blocks(blocksize), [&](int64_t begin, int64_t end) {
    cpu::dynamic8_quantize_blocks(p, lut->data(), begin, end);
  });
  return {q, absmax};
}

at::Tensor dynamic8_dequantize_cpu(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                                   int64_t blocksize) {
  at::Tensor out;
  const Dynamic8DequantizeParams p = dynamic8_dequantize_params(q, absmax, code, blocksize, out);
  at::parallel_for(0, q.numel(), int64_t{1} << 16,
                   [&](int64_t begin, int64_t end) { cpu::dynamic8_dequantize_range(p, begin, end); });
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CPU, m) {
  m.impl("nf4_quantize", &nf4_quantize_cpu);
  m.impl("nf4_dequantize", &nf4_dequantize_cpu);
  m.impl("nf4_dequantize_into", &nf4_dequantize_into_cpu);
  m.impl("dynamic8_quantize", &dynamic8_quantize_cpu);
  m.impl("dynamic8_dequantize", &dynamic8_dequantize_cpu);
}

}  // namespace pykernels::nf4
