// CUDA implementations of the NF4 ops: checks, allocation and the launch on torch's current
// stream. The kernels themselves are in nf4.cu (no torch headers).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "nf4/nf4.h"
#include "nf4/nf4_torch_checks.h"

namespace pykernels::nf4 {
namespace {

void check_launch(const char* error) { TORCH_CHECK(error == nullptr, error); }

cudaStream_t current_stream(const at::Tensor& t) {
  return c10::cuda::getCurrentCUDAStream(t.device().index()).stream();
}

std::tuple<at::Tensor, at::Tensor> nf4_quantize_cuda(const at::Tensor& x, int64_t blocksize) {
  check_input(x, "x");
  check_blocksize(blocksize, "blocksize");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t numel = x.numel();
  at::Tensor packed = at::empty({(numel + 1) / 2}, x.options().dtype(at::kByte));
  at::Tensor absmax = at::empty({num_blocks(numel, blocksize)}, x.options().dtype(at::kFloat));
  const QuantizeParams p{x.data_ptr(), float_dtype(x.scalar_type(), "x"), numel, blocksize,
                         packed.data_ptr<uint8_t>(), absmax.data_ptr<float>()};
  check_launch(launch_quantize(p, current_stream(x)));
  return {packed, absmax};
}

void nf4_dequantize_into_cuda(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                              const at::Tensor& out, const std::optional<at::Tensor>& nested_absmax,
                              const std::optional<at::Tensor>& nested_code,
                              const std::optional<at::Tensor>& nested_offset, int64_t nested_blocksize) {
  check_out(out, packed);
  const c10::cuda::CUDAGuard guard(packed.device());
  const DequantizeParams p = dequantize_params(packed, absmax, blocksize, out.numel(), nested_absmax,
                                               nested_code, nested_offset, nested_blocksize, out);
  check_launch(launch_dequantize(p, current_stream(packed)));
}

at::Tensor nf4_dequantize_cuda(const at::Tensor& packed, const at::Tensor& absmax, int64_t blocksize,
                               at::IntArrayRef shape, at::ScalarType dtype,
                               const std::optional<at::Tensor>& nested_absmax,
                               const std::optional<at::Tensor>& nested_code,
                               const std::optional<at::Tensor>& nested_offset, int64_t nested_blocksize) {
  float_dtype(dtype, "dtype");
  at::Tensor out = at::empty(shape, packed.options().dtype(dtype));
  nf4_dequantize_into_cuda(packed, absmax, blocksize, out, nested_absmax, nested_code, nested_offset,
                           nested_blocksize);
  return out;
}

std::tuple<at::Tensor, at::Tensor> dynamic8_quantize_cuda(const at::Tensor& x, const at::Tensor& code,
                                                          int64_t blocksize,
                                                          const std::optional<at::Tensor>& offset) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor q, absmax;
  const Dynamic8QuantizeParams p = dynamic8_quantize_params(x, code, blocksize, offset, q, absmax);
  check_launch(launch_dynamic8_quantize(p, current_stream(x)));
  return {q, absmax};
}

at::Tensor dynamic8_dequantize_cuda(const at::Tensor& q, const at::Tensor& absmax, const at::Tensor& code,
                                    int64_t blocksize) {
  const c10::cuda::CUDAGuard guard(q.device());
  at::Tensor out;
  const Dynamic8DequantizeParams p = dynamic8_dequantize_params(q, absmax, code, blocksize, out);
  check_launch(launch_dynamic8_dequantize(p, current_stream(q)));
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(pykernels, CUDA, m) {
  m.impl("nf4_quantize", &nf4_quantize_cuda);
  m.impl("nf4_dequantize", &nf4_dequantize_cuda);
  m.impl("nf4_dequantize_into", &nf4_dequantize_into_cuda);
  m.impl("dynamic8_quantize", &dynamic8_quantize_cuda);
  m.impl("dynamic8_dequantize", &dynamic8_dequantize_cuda);
}

}  // namespace pykernels::nf4
