# The Hopper kernels (csrc/*/*_sm90.cu: CUTLASS 3.x wgmma + TMA) as an object library. wgmma needs the
# arch-specific sm_90a target, and these files have nothing to offer other archs, so they compile
# for sm_90a alone when PYKERNELS_CUDA_ARCHS lists it (PYKERNELS_SM90A_GEMM: the kernels are in);
# otherwise for the listed archs without it, leaving launchers that say the kernels are not built.
# NDEBUG always: CUTLASS's debug asserts make ptxas serialize the wgmma pipeline (warning C7510).
# The GEMM core's tiles are one file each (common/grouped_gemm_tile_*_sm90.cu), compiled in parallel.
function(pykernels_add_sm90_objects name)
  add_library(${name} OBJECT ${PYKERNELS_CUDA_SM90_SOURCES})
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/csrc ${CUTLASS_DIR})
  if("90a" IN_LIST PYKERNELS_CUDA_ARCHS)
    set_target_properties(${name} PROPERTIES CUDA_ARCHITECTURES 90a)
    target_compile_definitions(${name} PRIVATE PYKERNELS_SM90A_GEMM NDEBUG)
  else()
    set_target_properties(${name} PROPERTIES CUDA_ARCHITECTURES "${PYKERNELS_CUDA_ARCHS}")
  endif()
  target_compile_options(${name} PRIVATE $<$<COMPILE_LANGUAGE:CUDA>:--expt-relaxed-constexpr ${ARGN}>)
endfunction()
