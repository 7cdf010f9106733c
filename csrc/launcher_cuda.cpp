// Loading and launching with the CUDA runtime, linked statically: nothing here needs a CUDA
// library at run time beyond the NVIDIA driver (libcuda.so.1, which the runtime opens itself).
#include <cuda_runtime.h>

#include <atomic>
#include <memory>
#include <mutex>

#include "launcher.h"

namespace flash_attn_aot {
namespace {

std::string error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// Messages are built only when something fails: a launch builds no string.
std::string kernel_label(const KernelSpec& spec) {
  return "kernel '" + spec.kernel_name + "' (" + spec.image_path + ")";
}

// Makes `device` current for the scope and restores the previous device afterwards, so the
// caller's (PyTorch's) current device is unchanged.
class DeviceScope {
 public:
  DeviceScope(int device, const KernelSpec& spec) {
    cudaError_t err = cudaGetDevice(&previous_);
    if (err == cudaSuccess && previous_ != device) err = cudaSetDevice(device);
    if (err != cudaSuccess) {
      cudaGetLastError();
      throw AotError(kernel_label(spec) + ": cannot select CUDA device " + std::to_string(device) + " (" +
                     error_text(err) + ")");
    }
    restore_ = previous_ != device;
  }
  ~DeviceScope() {
    if (restore_) cudaSetDevice(previous_);
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;

 private:
  int previous_ = 0;
  bool restore_ = false;
};

struct Loaded {
  std::atomic<bool> ready{false};
  cudaLibrary_t library = nullptr;
  cudaKernel_t kernel = nullptr;
  cudaFuncAttributes attributes{};
  int shared_optin = 0;
};

}  // namespace

// One kernel's state on every device; `KernelSpec::loaded` points at it once created.
struct LoadedKernel {
  std::mutex mutex;
  std::vector<std::unique_ptr<Loaded>> devices;  // index = CUDA device
};

namespace {

std::mutex g_registry_mutex;
std::vector<std::unique_ptr<LoadedKernel>> g_loaded;  // owns every LoadedKernel (never freed)

LoadedKernel& loaded_kernel(const KernelSpec& spec, int64_t device_count) {
  if (LoadedKernel* known = spec.loaded.load(std::memory_order_acquire)) return *known;
  std::lock_guard<std::mutex> lock(g_registry_mutex);
  if (LoadedKernel* known = spec.loaded.load(std::memory_order_relaxed)) return *known;
  auto created = std::make_unique<LoadedKernel>();
  for (int64_t d = 0; d < device_count; ++d) created->devices.push_back(std::make_unique<Loaded>());
  spec.loaded.store(created.get(), std::memory_order_release);
  g_loaded.push_back(std::move(created));
  return *g_loaded.back();
}

std::string device_label(int device) {
  cudaDeviceProp prop{};
  std::string label = "device " + std::to_string(device);
  if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
    label += " (" + std::string(prop.name) + ", sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + ")";
  } else {
    cudaGetLastError();
  }
  return label;
}

[[noreturn]] void fail(cudaError_t err, const std::string& what) {
  cudaGetLastError();  // clear this runtime's per-thread error so it does not leak into later calls
  throw AotError(what + ": " + error_text(err));
}

void check(cudaError_t err, const std::string& what) {
  if (err != cudaSuccess) fail(err, what);
}

// Compares the parameter list the driver reports with the signature. Drivers older than 12.4 do
// not answer; then the load-time check of the image (kernel_spec.cpp) is all we have.
void check_params(const KernelSpec& spec, cudaKernel_t kernel, const std::string& label) {
  std::vector<size_t> sizes;
  for (size_t i = 0; i < 4096; ++i) {
    size_t offset = 0, size = 0;
    const cudaError_t err = cudaFuncGetParamInfo(reinterpret_cast<const void*>(kernel), i, &offset, &size);
    if (err != cudaSuccess) {
      cudaGetLastError();
      // Past the last parameter: cudaErrorInvalidValue. A failure on the first one means the
      // driver cannot answer (every Triton kernel has parameters): skip the check.
      if (i == 0 || err != cudaErrorInvalidValue) return;
      break;
    }
    sizes.push_back(size);
  }
  bool same = sizes.size() == spec.args.size();
  for (size_t i = 0; same && i < sizes.size(); ++i) same = sizes[i] == size_t(spec.args[i].param_bytes);
  if (!same) {
    std::string found;
    for (size_t s : sizes) found += (found.empty() ? "" : ", ") + std::to_string(s);
    throw AotError(label + " takes " + std::to_string(sizes.size()) + " parameters of sizes [" + found +
                   "] bytes, which does not match its signature '" + spec.signature_text + "'");
  }
}

Loaded& ensure_loaded(const KernelSpec& spec, int device) {
  require_cuda();
  const CudaInfo& info = cuda_info();
  if (device < 0 || device >= info.device_count) {
    throw AotError("CUDA device " + std::to_string(device) + " does not exist (" +
                   std::to_string(info.device_count) + " visible)");
  }
  LoadedKernel& per_kernel = loaded_kernel(spec, info.device_count);
  Loaded& loaded = *per_kernel.devices[device];
  if (loaded.ready.load(std::memory_order_acquire)) return loaded;

  // First use on this device: load and check (messages built up front here, once per kernel).
  std::lock_guard<std::mutex> lock(per_kernel.mutex);
  if (loaded.ready.load(std::memory_order_relaxed)) return loaded;
  const std::string label = kernel_label(spec);
  DeviceScope scope(device, spec);
  const std::string on = " on " + device_label(device);

  cudaLibrary_t library = nullptr;
  check(cudaLibraryLoadData(&library, spec.image.data(), nullptr, nullptr, 0, nullptr, nullptr, 0),
        "cannot load " + label + on);
  try {
    cudaKernel_t kernel = nullptr;
    check(cudaLibraryGetKernel(&kernel, library, spec.kernel_name.c_str()), "cannot find " + label + on);
    const void* fn = reinterpret_cast<const void*>(kernel);
    cudaFuncAttributes attributes{};
    check(cudaFuncGetAttributes(&attributes, fn), "cannot load " + label + on);
    check_params(spec, kernel, label);

    int optin = 0;
    check(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
          "cannot query shared memory of " + device_label(device));
    const int64_t needed = spec.config.shared_bytes + int64_t(attributes.sharedSizeBytes);
    if (needed > optin) {
      throw AotError(label + " needs " + std::to_string(needed) + " bytes of shared memory per block but " +
                     device_label(device) + " allows at most " + std::to_string(optin));
    }
    if (spec.config.shared_bytes > 48 * 1024) {
      check(cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(spec.config.shared_bytes)),
            "cannot enable " + std::to_string(spec.config.shared_bytes) + " bytes of dynamic shared memory for " +
                label + on);
    }
    if (attributes.maxThreadsPerBlock < spec.config.num_warps * 32) {
      throw AotError(label + " can run at most " + std::to_string(attributes.maxThreadsPerBlock) +
                     " threads per block" + on + " (registers), but num_warps=" +
                     std::to_string(spec.config.num_warps) + " needs " + std::to_string(spec.config.num_warps * 32));
    }
    if (spec.config.num_ctas > 8) {
      check(cudaFuncSetAttribute(fn, cudaFuncAttributeNonPortableClusterSizeAllowed, 1),
            "cannot allow a cluster of " + std::to_string(spec.config.num_ctas) + " CTAs for " + label + on);
    }
    loaded.library = library;
    loaded.kernel = kernel;
    loaded.attributes = attributes;
    loaded.shared_optin = optin;
  } catch (...) {
    cudaLibraryUnload(library);
    cudaGetLastError();
    throw;
  }
  loaded.ready.store(true, std::memory_order_release);
  return loaded;
}

}  // namespace

const CudaInfo& cuda_info() {
  static const CudaInfo info = [] {
    CudaInfo out;
    out.runtime_version = CUDART_VERSION;
    int driver = 0;
    if (cudaDriverGetVersion(&driver) == cudaSuccess) out.driver_version = driver;
    cudaGetLastError();
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();
      out.error = "cudaGetDeviceCount failed with " + error_text(err);
      if (driver == 0) out.error += " (no NVIDIA driver is installed)";
    } else if (count == 0) {
      out.error = "the NVIDIA driver reports no CUDA device";
    } else {
      out.device_count = count;
    }
    return out;
  }();
  return info;
}

void require_cuda() {
  const CudaInfo& info = cuda_info();
  if (info.device_count <= 0) throw AotError("no CUDA device is available: " + info.error);
}

void launch(const KernelSpec& spec, PackedLaunch& launch) {
  Loaded& loaded = ensure_loaded(spec, launch.device);
  const LaunchConfig& c = spec.config;
  DeviceScope scope(launch.device, spec);

  SmallBuffer<void*, kInlineParams> params(launch.slots.size());
  for (size_t i = 0; i < params.size(); ++i) params[i] = &launch.slots[i];

  cudaLaunchAttribute attrs[4];
  unsigned n_attrs = 0;
  if (c.num_ctas > 1) {
    attrs[n_attrs].id = cudaLaunchAttributeClusterDimension;
    attrs[n_attrs].val.clusterDim.x = unsigned(c.num_ctas);
    attrs[n_attrs].val.clusterDim.y = 1;
    attrs[n_attrs].val.clusterDim.z = 1;
    ++n_attrs;
    attrs[n_attrs].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
    attrs[n_attrs].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicySpread;
    ++n_attrs;
  }
  if (c.cooperative) {
    attrs[n_attrs].id = cudaLaunchAttributeCooperative;
    attrs[n_attrs].val.cooperative = 1;
    ++n_attrs;
  }
  if (c.pdl) {
    attrs[n_attrs].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n_attrs].val.programmaticStreamSerializationAllowed = 1;
    ++n_attrs;
  }
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(unsigned(launch.grid[0] * c.num_ctas), unsigned(launch.grid[1]), unsigned(launch.grid[2]));
  config.blockDim = dim3(unsigned(c.num_warps * 32), 1, 1);
  config.dynamicSmemBytes = size_t(c.shared_bytes);
  config.stream = static_cast<cudaStream_t>(launch.stream);
  config.attrs = attrs;
  config.numAttrs = n_attrs;
  const cudaError_t err = cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(loaded.kernel), params.data());
  if (err != cudaSuccess) {
    fail(err, "launching " + kernel_label(spec) + " on device " + std::to_string(launch.device) + " with grid (" +
                  std::to_string(launch.grid[0]) + ", " + std::to_string(launch.grid[1]) + ", " +
                  std::to_string(launch.grid[2]) + ") failed");
  }
}

std::vector<int64_t> kernel_attributes(const KernelSpec& spec, int device) {
  const Loaded& loaded = ensure_loaded(spec, device);
  const cudaFuncAttributes& a = loaded.attributes;
  return {int64_t(a.numRegs), int64_t(a.localSizeBytes), int64_t(a.sharedSizeBytes), int64_t(a.maxThreadsPerBlock),
          int64_t(loaded.shared_optin)};
}

}  // namespace flash_attn_aot
