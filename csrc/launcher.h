// The CUDA side: load images per device, launch. Implemented by launcher_cuda.cpp (the static CUDA
// runtime). A CPU-only package builds no op library at all.
// No torch types here: the op layer (aot_ops.cpp) turns tensors into pointers first.
#pragma once

#include <cstddef>
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

// `n` value-initialised T: inline up to N (no allocation per launch), on the heap beyond.
template <typename T, size_t N>
class SmallBuffer {
 public:
  explicit SmallBuffer(size_t n) : size_(n) {
    if (n > N) heap_.assign(n, T{});
  }
  T* data() { return size_ > N ? heap_.data() : inline_; }
  size_t size() const { return size_; }
  T& operator[](size_t i) { return data()[i]; }

 private:
  size_t size_;
  T inline_[N] = {};
  std::vector<T> heap_;
};

// Parameters held inline per launch: every shipped kernel has fewer (at most 50).
constexpr size_t kInlineParams = 64;

// What aot_launch hands over once the arguments are checked: one 8-byte slot per kernel parameter
// holding its value (pointers, ints and floats already in their C types, little-endian), the
// hidden scratch pointers included.
struct PackedLaunch {
  explicit PackedLaunch(size_t num_params) : slots(num_params) {}
  int device = 0;
  int64_t grid[3] = {1, 1, 1};
  void* stream = nullptr;  // cudaStream_t of PyTorch's current stream on `device`
  SmallBuffer<uint64_t, kInlineParams> slots;
};

// Loads `spec` on `launch.device` the first time (cached per kernel and device), then launches it.
// Every CUDA failure becomes AotError naming the kernel and the CUDA error string; no message is
// built unless something fails.
void launch(const KernelSpec& spec, PackedLaunch& launch);

// Which API `launch` calls, for every later launch of the process: the runtime's
// cudaLaunchKernelExC on the library's cudaKernel_t (the default), or with `enable` the driver's
// cuLaunchKernelEx on the kernel's CUfunction in the device's context, resolved at load. Both are
// kept until a GPU measures which costs the host less (`bench overhead --device cuda` times them
// side by side); a driver without those functions makes the driver route's launches fail, clearly.
// Returns the route before (true: the driver's).
bool use_driver_launch(bool enable);

// Loads `spec` on `device` (cached as above) and returns what the driver says about it:
// {registers per thread, local (spill) bytes per thread, static shared bytes, max threads per block,
//  max dynamic shared bytes the device allows per block (opt-in)}.
std::vector<int64_t> kernel_attributes(const KernelSpec& spec, int device);

}  // namespace flash_attn_aot
