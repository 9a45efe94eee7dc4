// pykernels._C.host_logic.cpu_gemm_bf16: the CPU kernels' bf16 GEMM (common/cpu_gemm_bf16.h) on
// NumPy arrays, so that tests/kernels/test_cpu_gemm.py checks each of its paths (AVX-512, AMX and
// the tails AMX leaves to AVX-512) against an fp64 product at shapes chosen to land in each region.
// Test-only: the ops reach the GEMM through their own packings.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstdint>
#include <stdexcept>

#include "common/cpu_gemm_bf16.h"
#include "common/cpu_memory.h"

namespace py = pybind11;

namespace pykernels {

void define_cpu_gemm_test(py::module_& m) {
  m.def(
      "cpu_gemm_bf16",
      [](py::array_t<uint16_t, py::array::c_style> a, py::array_t<uint16_t, py::array::c_style> b_t,
         py::array_t<float, py::array::c_style> c, bool accumulate, bool prepacked) {
        if (a.ndim() != 2 || b_t.ndim() != 2 || c.ndim() != 2) throw std::invalid_argument("a, b_t and c must be 2-D");
        const int64_t m = a.shape(0), k = a.shape(1), n = b_t.shape(0);
        if (b_t.shape(1) != k || c.shape(0) != m || c.shape(1) < n) {
          throw std::invalid_argument("shapes must be a [m, k], b_t [n, k], c [m, >= n]");
        }
        if (!gemm::has_bf16_gemm()) throw std::invalid_argument("this CPU has no AVX-512 BF16");
        AlignedVector<uint32_t> packed(gemm::panels(n) * gemm::panel_stride(k));
        gemm::pack_transposed(b_t.data(), n, k, k, packed.data());
        AlignedVector<uint16_t> a_packed(prepacked ? gemm::prepacked_a_size(m, k) : 0);
        if (!a_packed.empty()) gemm::prepack_a(a.data(), k, m, k, a_packed.data());
        gemm::gemm_bf16(m, n, k, a.data(), k, a_packed.empty() ? nullptr : a_packed.data(), packed.data(),
                        gemm::panel_stride(k), c.mutable_data(), c.shape(1), accumulate);
      },
      py::arg("a"), py::arg("b_t"), py::arg("c"), py::arg("accumulate"), py::arg("prepacked") = false,
      "c[:, :n] (+)= a @ b_t.T in fp32 on the CPU path set_cpu_isa chose (a, b_t: bf16 bits as uint16); columns "
      "of c past n untouched. prepacked: A given to the GEMM as gemm::prepack_a wrote it");
}

}  // namespace pykernels
