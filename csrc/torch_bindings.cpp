// Every op schema of pykernels, one comment line per op. Implementations register per dispatch
// key in the file that defines them (<family>_cpu.cpp, <family>_cuda_torch.cpp); fake
// (meta) implementations for torch.compile live in pykernels/ops/<family>.py.
#include <torch/library.h>

TORCH_LIBRARY(pykernels, m) {
  // ---- NF4 (bitsandbytes-compatible 4-bit NormalFloat, QLoRA https://arxiv.org/abs/2305.14314)

  // Quantizes x (any shape, fp32/fp16/bf16) in blocks: packed uint8 [ceil(numel/2)] (two codes per
  // byte, high nibble first) and absmax fp32 [ceil(numel/blocksize)].
  m.def("nf4_quantize(Tensor x, int blocksize) -> (Tensor packed, Tensor absmax)");

  // code[nibble] * absmax[block] rounded to dtype, reshaped to shape; absmax is fp32, or uint8
  // codes when nested_absmax/code/offset are given (double quantization, nested blocks of 256).
  m.def(
      "nf4_dequantize(Tensor packed, Tensor absmax, int blocksize, SymInt[] shape, ScalarType dtype, "
      "Tensor? nested_absmax=None, Tensor? nested_code=None, Tensor? nested_offset=None, "
      "int nested_blocksize=256) -> Tensor");

  // bitsandbytes' 8-bit blockwise quantization of fp32 (x - offset) with a 256-entry code (double
  // quantization of absmax): q uint8 [numel], absmax fp32 [ceil(numel/blocksize)].
  // https://arxiv.org/abs/1511.04561
  m.def(
      "dynamic8_quantize(Tensor x, Tensor code, int blocksize, Tensor? offset=None) -> (Tensor q, Tensor absmax)");

  // code[q] * absmax[block] as fp32 [numel].
  m.def("dynamic8_dequantize(Tensor q, Tensor absmax, Tensor code, int blocksize) -> Tensor");
}
