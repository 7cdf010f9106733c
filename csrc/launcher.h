// The CUDA side: load images per device, launch. Implemented by launcher_cuda.cpp (the static CUDA
// runtime). A CPU-only package builds no op library at all.
// No torch types here: the op layer (aot_ops.cpp) turns tensors into pointers first.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernel_spec.h"

namespace flash_attn_aot {

struct CudaInfo {
  int64_t runtime_version = 0;  // CUDART_VERSION this library was built with (e.g. 13000); 0 = no CUDA
  int64_t driver_version = 0;   // cudaDriverGetVersion; 0 when no driver is installed
  int64_t device_count = 0;     // 0 when no device can be used
  std::string error;            // why no device can be used; empty when device_count > 0
};

// Cached after the first call; never throws.
const CudaInfo& cuda_info();

// Throws AotError("no CUDA device is available: ...") unless at least one device can be used.
void require_cuda();

// What aot_launch hands over once the arguments are checked: one 8-byte slot per kernel parameter
// holding its value (pointers, ints and floats already in their C types, little-endian), the
// hidden scratch pointers included.
struct PackedLaunch {
  int device = 0;
  int64_t grid[3] = {1, 1, 1};
  void* stream = nullptr;  // cudaStream_t of PyTorch's current stream on `device`
  std::vector<uint64_t> slots;
};

// Loads `spec` on `device` the first time (cached per kernel id and device), then launches it.
// Every CUDA failure becomes AotError naming the kernel and the CUDA error string.
void launch(int64_t kernel_id, const KernelSpec& spec, PackedLaunch& launch);

// Loads `spec` on `device` (cached as above) and returns what the driver says about it:
// {registers per thread, local (spill) bytes per thread, static shared bytes, max threads per block,
//  max dynamic shared bytes the device allows per block (opt-in)}.
std::vector<int64_t> kernel_attributes(int64_t kernel_id, const KernelSpec& spec, int device);

}  // namespace flash_attn_aot
