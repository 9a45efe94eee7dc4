# PYKERNELS_CUDA_COMPILE_CHECK: compile, never link, all CUDA code on a machine without a GPU.
#  1. every csrc/*/*.cu with nvcc for each arch in PYKERNELS_CUDA_ARCHS (they include no torch),
#     the *_sm90.cu files for sm_90a alone;
#  2. every csrc/*/*_cuda_torch.cpp with the host compiler against torch's headers. A CPU-only
#     torch wheel ships c10/cuda but not the generated c10/cuda/impl/cuda_cmake_macros.h, so a
#     stand-in is written to the build tree. The bindings must not include ATen/cuda headers that
#     need cuBLAS (absent here); they take the stream from c10::cuda.

enable_language(CUDA)
set(CMAKE_CUDA_ARCHITECTURES ${PYKERNELS_CUDA_ARCHS})

# The Ampere-design files (everything but *_sm90.cu) go through the whole compiler for every arch
# but sm_90a, where they stop at PTX: ptxas for sm_90a of the same mma.sync code that ptxas has just
# compiled for sm_80 checks little and cost CI a minute (the sm80 GEMM, then in lora.cu: 76 s with
# it, 52 s without). The Hopper files get sm_90a SASS below, where ptxas's warnings (wgmma
# serialized) are the check.
set(check_archs "")
foreach(arch IN LISTS PYKERNELS_CUDA_ARCHS)
  if(arch STREQUAL "90a")
    list(APPEND check_archs "90a-virtual")
  else()
    list(APPEND check_archs "${arch}-real")
  endif()
endforeach()
add_library(pykernels_cuda_check OBJECT ${PYKERNELS_CUDA_SOURCES})
target_include_directories(pykernels_cuda_check PRIVATE ${CMAKE_SOURCE_DIR}/csrc ${CUTLASS_DIR})
set_target_properties(pykernels_cuda_check PROPERTIES CUDA_ARCHITECTURES "${check_archs}")
target_compile_options(pykernels_cuda_check PRIVATE
  $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr -Werror all-warnings>)

# --keep: the PTX of each sm_90a file stays in sm90-ptx/ for the Hopper PTX checks (make cuda-check
# runs tests/test_ptx.py -m hopper_ptx on it instead of compiling the files a second time).
pykernels_add_sm90_objects(pykernels_cuda_sm90_check -Werror all-warnings --keep
  --keep-dir=${CMAKE_BINARY_DIR}/sm90-ptx)
file(MAKE_DIRECTORY ${CMAKE_BINARY_DIR}/sm90-ptx)

find_package(Torch REQUIRED)
find_package(CUDAToolkit REQUIRED)
set(shim_dir "${CMAKE_BINARY_DIR}/c10_cuda_shim")
file(WRITE "${shim_dir}/c10/cuda/impl/cuda_cmake_macros.h"
  "#pragma once\n// Stand-in for the header a CUDA build of torch generates (compile check only).\n"
  "#define C10_CUDA_BUILD_SHARED_LIBS\n")
add_library(pykernels_cuda_binding_check OBJECT ${PYKERNELS_CUDA_BINDINGS})
target_include_directories(pykernels_cuda_binding_check PRIVATE
  ${CMAKE_SOURCE_DIR}/csrc ${shim_dir} ${TORCH_INCLUDE_DIRS} ${CUDAToolkit_INCLUDE_DIRS})
target_compile_definitions(pykernels_cuda_binding_check PRIVATE PYKERNELS_WITH_CUDA)
target_compile_options(pykernels_cuda_binding_check PRIVATE ${PYKERNELS_CXX_FLAGS} ${TORCH_CXX_FLAGS})
# The torch headers every binding includes, parsed once: most of each file's compile time.
target_precompile_headers(pykernels_cuda_binding_check PRIVATE
  <torch/library.h> <c10/cuda/CUDAGuard.h> <c10/cuda/CUDAStream.h> <ATen/ATen.h>)

list(LENGTH PYKERNELS_CUDA_SOURCES n_cu)
list(LENGTH PYKERNELS_CUDA_SM90_SOURCES n_sm90)
list(LENGTH PYKERNELS_CUDA_BINDINGS n_bind)
message(STATUS "pykernels: compile check of ${n_cu} .cu files for archs ${PYKERNELS_CUDA_ARCHS}, "
               "${n_sm90} for sm_90a and ${n_bind} CUDA binding files")
