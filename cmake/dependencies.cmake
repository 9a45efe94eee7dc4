# Locates torch, pybind11 and CUTLASS through the Python interpreter that drives the build,
# so the extension is compiled against exactly the packages it will be imported with.

function(pykernels_python_query out_var code)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c "${code}"
    OUTPUT_VARIABLE value
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE status)
  if(NOT status EQUAL 0)
    message(FATAL_ERROR "pykernels: `${Python_EXECUTABLE} -c \"${code}\"` failed; "
                        "is the package installed in this interpreter?")
  endif()
  set(${out_var} "${value}" PARENT_SCOPE)
endfunction()

pykernels_python_query(TORCH_CMAKE_PREFIX "import torch; print(torch.utils.cmake_prefix_path)")
pykernels_python_query(TORCH_CUDA_VERSION "import torch; print(torch.version.cuda or '')")
pykernels_python_query(PYBIND11_CMAKE_DIR "import pybind11; print(pybind11.get_cmake_dir())")
list(APPEND CMAKE_PREFIX_PATH "${TORCH_CMAKE_PREFIX}" "${PYBIND11_CMAKE_DIR}")
# Linux: the libstdc++ shared library torch's process has loaded (empty if none); CMakeLists.txt links
# _C against it.
if(CMAKE_SYSTEM_NAME STREQUAL "Linux")
  pykernels_python_query(PYKERNELS_LIBSTDCXX
    "import torch; print(next((w for w in open('/proc/self/maps').read().split() if '/libstdc++.so' in w), ''))")
  message(STATUS "pykernels: libstdc++ of torch's process: ${PYKERNELS_LIBSTDCXX}")
endif()

# CUTLASS headers: CUTLASS_DIR wins, else the nvidia-cutlass wheel. Missing is not fatal for
# families that do not use CUTLASS; build_info() then reports no CUTLASS version.
if(NOT CUTLASS_DIR)
  execute_process(
    COMMAND "${Python_EXECUTABLE}" -c
      "import os, cutlass_library; print(os.path.join(os.path.dirname(cutlass_library.__file__), 'source', 'include'))"
    OUTPUT_VARIABLE CUTLASS_DIR
    OUTPUT_STRIP_TRAILING_WHITESPACE
    RESULT_VARIABLE cutlass_status
    ERROR_QUIET)
  if(NOT cutlass_status EQUAL 0)
    set(CUTLASS_DIR "")
  endif()
endif()

set(PYKERNELS_CUTLASS_VERSION "")
if(CUTLASS_DIR AND EXISTS "${CUTLASS_DIR}/cutlass/version.h")
  file(READ "${CUTLASS_DIR}/cutlass/version.h" version_header)
  foreach(part MAJOR MINOR PATCH)
    string(REGEX MATCH "#define CUTLASS_${part} ([0-9]+)" _ "${version_header}")
    set(cutlass_${part} "${CMAKE_MATCH_1}")
  endforeach()
  set(PYKERNELS_CUTLASS_VERSION "${cutlass_MAJOR}.${cutlass_MINOR}.${cutlass_PATCH}")
  message(STATUS "pykernels: CUTLASS ${PYKERNELS_CUTLASS_VERSION} at ${CUTLASS_DIR}")
else()
  message(STATUS "pykernels: CUTLASS headers not found (pip install nvidia-cutlass or set CUTLASS_DIR)")
endif()
