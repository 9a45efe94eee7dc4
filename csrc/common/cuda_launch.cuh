// What every family's launchers share: how a failure becomes the message they return, and the
// grid of a grid-stride element-wise kernel. Launchers return nullptr on success, else a message
// that stays valid until this thread's next failure (the torch bindings raise it).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace pykernels {

// Keeps `message` alive until this thread's next failure and returns it.
inline const char* fail(std::string message) {
  thread_local std::string last;
  last = std::move(message);
  return last.c_str();
}

// nullptr when the launch went through, else `what` with CUDA's own reason. cudaGetLastError also
// returns an error left by an earlier asynchronous failure, so the message says it may not be this
// launch's (a bare "kernel launch failed" sent people looking at the wrong kernel).
inline const char* launch_status(const char* what) {
  const cudaError_t status = cudaGetLastError();
  if (status == cudaSuccess) return nullptr;
  return fail(std::string(what) + ": " + cudaGetErrorName(status) + " (" + cudaGetErrorString(status) +
              "; an error from an earlier asynchronous CUDA call also surfaces here)");
}

// Blocks of `threads` for a grid-stride loop over work_items: at least 1, at most 2^20 (each
// thread then strides over the rest).
inline int grid_for(int64_t work_items, int threads) {
  const int64_t blocks = (work_items + threads - 1) / threads;
  return static_cast<int>(blocks < (int64_t{1} << 20) ? (blocks > 0 ? blocks : 1) : (int64_t{1} << 20));
}

}  // namespace pykernels
