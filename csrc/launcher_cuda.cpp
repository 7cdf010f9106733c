// Loading and launching with the CUDA runtime, linked statically: nothing here needs a CUDA
// library at run time beyond the NVIDIA driver (libcuda.so.1, which the runtime opens itself).
// The driver route's two driver functions come from the runtime's entry-point lookup, so this
// library still does not link libcuda and loads where no driver is installed.
#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_runtime.h>

#include <cstring>

#include <atomic>
#include <memory>
#include <mutex>

#include "launcher.h"

namespace flash_attn_aot {
namespace {

std::string error_text(cudaError_t err) {
  return std::string(cudaGetErrorName(err)) + ": " + cudaGetErrorString(err);
}

// The driver functions of the driver route (use_driver_launch), looked up once; null where the
// driver does not have them (then `why` says so).
struct DriverApi {
  PFN_cuKernelGetFunction_v12000 kernel_function = nullptr;
  PFN_cuLaunchKernelEx_v11060 launch = nullptr;
  PFN_cuGetErrorName_v6000 error_name = nullptr;
  std::string why;
};

const DriverApi& driver_api() {
  static const DriverApi api = [] {
    DriverApi out;
    auto find = [&](const char* symbol, int version, void** fn) {
      cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
      const cudaError_t err = cudaGetDriverEntryPointByVersion(symbol, fn, version, cudaEnableDefault, &found);
      if (err != cudaSuccess || found != cudaDriverEntryPointSuccess) {
        cudaGetLastError();
        *fn = nullptr;
        if (out.why.empty()) out.why = std::string("the driver does not provide ") + symbol;
      }
    };
    find("cuKernelGetFunction", 12000, reinterpret_cast<void**>(&out.kernel_function));
    find("cuLaunchKernelEx", 11060, reinterpret_cast<void**>(&out.launch));
    find("cuGetErrorName", 6000, reinterpret_cast<void**>(&out.error_name));
    return out;
  }();
  return api;
}

std::string driver_error_text(CUresult err) {
  const char* name = nullptr;
  const DriverApi& api = driver_api();
  if (api.error_name == nullptr || api.error_name(err, &name) != CUDA_SUCCESS || name == nullptr) {
    return "CUresult " + std::to_string(int(err));
  }
  return name;
}

std::atomic<bool> g_driver_launch{false};

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
  CUfunction function = nullptr;  // the kernel in this device's context (the driver route); null: unknown
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
    // (the driver route's function; a driver without cuKernelGetFunction leaves it null)
    const DriverApi& api = driver_api();
    if (api.kernel_function == nullptr || api.kernel_function(&loaded.function, kernel) != CUDA_SUCCESS) {
      loaded.function = nullptr;
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

bool use_driver_launch(bool enable) { return g_driver_launch.exchange(enable, std::memory_order_relaxed); }

namespace {

// The launch attributes a kernel's config asks for (at most 4), in the runtime's form.
unsigned launch_attributes(const LaunchConfig& c, cudaLaunchAttribute* attrs) {
  unsigned n = 0;
  if (c.num_ctas > 1) {
    attrs[n].id = cudaLaunchAttributeClusterDimension;
    attrs[n].val.clusterDim.x = unsigned(c.num_ctas);
    attrs[n].val.clusterDim.y = 1;
    attrs[n].val.clusterDim.z = 1;
    ++n;
    attrs[n].id = cudaLaunchAttributeClusterSchedulingPolicyPreference;
    attrs[n].val.clusterSchedulingPolicyPreference = cudaClusterSchedulingPolicySpread;
    ++n;
  }
  if (c.cooperative) {
    attrs[n].id = cudaLaunchAttributeCooperative;
    attrs[n].val.cooperative = 1;
    ++n;
  }
  if (c.pdl) {
    attrs[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attrs[n].val.programmaticStreamSerializationAllowed = 1;
    ++n;
  }
  return n;
}

// The runtime's attribute ids and values are the driver's (the driver route copies them over).
static_assert(int(cudaLaunchAttributeClusterDimension) == int(CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION) &&
                  int(cudaLaunchAttributeClusterSchedulingPolicyPreference) ==
                      int(CU_LAUNCH_ATTRIBUTE_CLUSTER_SCHEDULING_POLICY_PREFERENCE) &&
                  int(cudaLaunchAttributeCooperative) == int(CU_LAUNCH_ATTRIBUTE_COOPERATIVE) &&
                  int(cudaLaunchAttributeProgrammaticStreamSerialization) ==
                      int(CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION) &&
                  int(cudaClusterSchedulingPolicySpread) == int(CU_CLUSTER_SCHEDULING_POLICY_SPREAD),
              "the runtime's launch attributes differ from the driver's");
static_assert(sizeof(cudaLaunchAttributeValue) == sizeof(CUlaunchAttributeValue),
              "the runtime's launch attribute values differ from the driver's");

// The driver route: cuLaunchKernelEx on the kernel's function in the device's context, resolved
// when the kernel was loaded.
CUresult driver_launch(const Loaded& loaded, const dim3& grid, const dim3& block, size_t shared, void* stream,
                       const cudaLaunchAttribute* attrs, unsigned n_attrs, void** params,
                       const KernelSpec& spec) {
  const DriverApi& api = driver_api();
  if (api.launch == nullptr || loaded.function == nullptr) {
    throw AotError("launching " + kernel_label(spec) + " by the driver route: " +
                   (api.why.empty() ? std::string("the driver gave no function for the kernel") : api.why));
  }
  CUlaunchAttribute driver_attrs[4];
  for (unsigned i = 0; i < n_attrs; ++i) {
    driver_attrs[i] = CUlaunchAttribute{};
    driver_attrs[i].id = CUlaunchAttributeID(attrs[i].id);
    std::memcpy(&driver_attrs[i].value, &attrs[i].val, sizeof driver_attrs[i].value);
  }
  CUlaunchConfig config{};
  config.gridDimX = grid.x;
  config.gridDimY = grid.y;
  config.gridDimZ = grid.z;
  config.blockDimX = block.x;
  config.blockDimY = block.y;
  config.blockDimZ = block.z;
  config.sharedMemBytes = unsigned(shared);
  config.hStream = static_cast<CUstream>(stream);
  config.attrs = driver_attrs;
  config.numAttrs = n_attrs;
  return api.launch(&config, loaded.function, params, nullptr);
}

}  // namespace

void launch(const KernelSpec& spec, PackedLaunch& launch) {
  Loaded& loaded = ensure_loaded(spec, launch.device);
  const LaunchConfig& c = spec.config;
  DeviceScope scope(launch.device, spec);

  SmallBuffer<void*, kInlineParams> params(launch.slots.size());
  for (size_t i = 0; i < params.size(); ++i) params[i] = &launch.slots[i];

  cudaLaunchAttribute attrs[4];
  const unsigned n_attrs = launch_attributes(c, attrs);
  const dim3 grid(unsigned(launch.grid[0] * c.num_ctas), unsigned(launch.grid[1]), unsigned(launch.grid[2]));
  const dim3 block(unsigned(c.num_warps * 32), 1, 1);
  std::string failed;
  if (g_driver_launch.load(std::memory_order_relaxed)) {
    const CUresult err = driver_launch(loaded, grid, block, size_t(c.shared_bytes), launch.stream, attrs, n_attrs,
                                       params.data(), spec);
    if (err != CUDA_SUCCESS) failed = driver_error_text(err);
  } else {
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = size_t(c.shared_bytes);
    config.stream = static_cast<cudaStream_t>(launch.stream);
    config.attrs = attrs;
    config.numAttrs = n_attrs;
    const cudaError_t err = cudaLaunchKernelExC(&config, reinterpret_cast<const void*>(loaded.kernel), params.data());
    if (err != cudaSuccess) {
      failed = error_text(err);
      cudaGetLastError();  // clear this runtime's per-thread error so it does not leak into later calls
    }
  }
  if (!failed.empty()) {
    throw AotError("launching " + kernel_label(spec) + " on device " + std::to_string(launch.device) + " with grid (" +
                   std::to_string(launch.grid[0]) + ", " + std::to_string(launch.grid[1]) + ", " +
                   std::to_string(launch.grid[2]) + ") failed: " + failed);
  }
}

std::vector<int64_t> kernel_attributes(const KernelSpec& spec, int device) {
  const Loaded& loaded = ensure_loaded(spec, device);
  const cudaFuncAttributes& a = loaded.attributes;
  return {int64_t(a.numRegs), int64_t(a.localSizeBytes), int64_t(a.sharedSizeBytes), int64_t(a.maxThreadsPerBlock),
          int64_t(loaded.shared_optin)};
}

}  // namespace flash_attn_aot
