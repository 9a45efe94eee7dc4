// pykernels._C: importing it registers every op (TORCH_LIBRARY in torch_bindings.cpp and the
// per-family implementations); the functions here describe what this build contains, and the
// test-only submodule host_logic exposes the kernels' index/tile arithmetic to the host tests.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "common/cpu_isa.h"
#ifdef PYKERNELS_WITH_CUDA
#include "common/grouped_gemm_sm90.h"
#endif

namespace py = pybind11;

namespace pykernels {
void define_host_logic(py::module_& m);     // common/host_logic_bindings.cpp
void define_cpu_gemm_test(py::module_& m);  // common/cpu_gemm_test_bindings.cpp
}

namespace {

std::vector<std::string> split_csv(const std::string& csv) {
  std::vector<std::string> parts;
  size_t start = 0;
  while (start < csv.size()) {
    const size_t comma = csv.find(',', start);
    const size_t end = comma == std::string::npos ? csv.size() : comma;
    if (end > start) parts.push_back(csv.substr(start, end - start));
    start = end + 1;
  }
  return parts;
}

bool has_cuda() {
#ifdef PYKERNELS_WITH_CUDA
  return true;
#else
  return false;
#endif
}

// The Hopper GEMM core (common/grouped_gemm_sm90.cu) was compiled in (the archs include sm_90a).
bool hopper_gemm() {
#ifdef PYKERNELS_WITH_CUDA
  return pykernels::gemm::grouped_gemm_sm90_built();
#else
  return false;
#endif
}

std::vector<std::string> cuda_archs() {
#ifdef PYKERNELS_WITH_CUDA
  return split_csv(PYKERNELS_CUDA_ARCHS);
#else
  return {};
#endif
}

py::dict build_info() {
  py::dict info;
  info["families"] = split_csv(PYKERNELS_FAMILIES);
  info["cuda"] = has_cuda();
  info["cuda_archs"] = cuda_archs();
  info["hopper_gemm"] = hopper_gemm();
  const std::string cutlass = PYKERNELS_CUTLASS_VERSION;
  info["cutlass_version"] = cutlass.empty() ? py::object(py::none()) : py::object(py::str(cutlass));
  info["torch_version"] = PYKERNELS_TORCH_VERSION;
  info["cpu_isa"] = pykernels::cpu_isa_name(pykernels::active_cpu_isa());
  info["cpu_isa_detected"] = pykernels::cpu_isa_name(pykernels::detected_cpu_isa());
  return info;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "pykernels compiled kernels; ops are registered under torch.ops.pykernels";
  m.def("build_info", &build_info,
        "Compiled kernel families, CUDA on/off, CUDA archs, the Hopper GEMM core, CUTLASS and torch versions, "
        "CPU SIMD path");
  m.def("has_cuda", &has_cuda, "True when CUDA kernels were compiled into this build");
  m.def("cuda_archs", &cuda_archs, "CUDA architectures compiled into this build");
  m.def(
      "set_cpu_isa", [](const std::string& name) { pykernels::force_cpu_isa(name); }, py::arg("name"),
      "Force the CPU SIMD path: 'auto' (default), 'scalar', 'avx2', 'avx512' or 'amx' (AVX-512 with the bf16 "
      "GEMMs on AMX tiles)");
  py::module_ host_logic = m.def_submodule(
      "host_logic", "Test-only: the CUDA kernels' __host__ __device__ index/tile arithmetic, compiled for the host");
  pykernels::define_host_logic(host_logic);
  pykernels::define_cpu_gemm_test(host_logic);
}
