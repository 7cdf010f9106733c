// The flash_attn::aot_* operators: argument checks and packing on the LibTorch stable ABI.
//
// Only torch/csrc/stable and torch/headeronly headers, built with TORCH_TARGET_VERSION = 2.10, so
// the library's only torch symbols are the stable C shim (aoti_torch_*, torch_*) and it loads into
// any PyTorch >= 2.10, CPU or CUDA build, with or without a GPU. Schemas: see csrc/README.md.
#include <dlfcn.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "flash_attn_limits.h"  // generated from flash_attn/limits.py at build time (CMakeLists.txt)
#include "kernel_spec.h"
#include "launcher.h"

namespace flash_attn_aot {
namespace {

using torch::stable::Tensor;

// limits.py's INT32_MAX is the range of the kernels' i32 parameters, which check_int enforces.
static_assert(limits::kInt32Max == std::numeric_limits<int32_t>::max(),
              "flash_attn/limits.py's INT32_MAX is not the largest int32");

// ------------------------------------------------------------------------------------------
// Kernel registry: kernel id -> KernelSpec. Specs are never removed, so references stay valid.
// ------------------------------------------------------------------------------------------
std::mutex g_specs_mutex;
std::vector<std::unique_ptr<KernelSpec>> g_specs;

const KernelSpec& spec_for(int64_t kernel_id) {
  std::lock_guard<std::mutex> lock(g_specs_mutex);
  if (kernel_id < 0 || kernel_id >= int64_t(g_specs.size())) {
    throw AotError("unknown kernel id " + std::to_string(kernel_id) + " (" + std::to_string(g_specs.size()) +
                   " kernels are registered; ids come from flash_attn::aot_register_kernel)");
  }
  return *g_specs[kernel_id];
}

int32_t dtype_code(const std::string& t) {
  if (t == "fp16") return aoti_torch_dtype_float16();
  if (t == "bf16") return aoti_torch_dtype_bfloat16();
  if (t == "fp32") return aoti_torch_dtype_float32();
  if (t == "fp64") return aoti_torch_dtype_float64();
  if (t == "i8") return aoti_torch_dtype_int8();
  if (t == "i16") return aoti_torch_dtype_int16();
  if (t == "i32") return aoti_torch_dtype_int32();
  if (t == "i64") return aoti_torch_dtype_int64();
  if (t == "u8") return aoti_torch_dtype_uint8();
  if (t == "u16") return aoti_torch_dtype_uint16();
  if (t == "u32") return aoti_torch_dtype_uint32();
  if (t == "u64") return aoti_torch_dtype_uint64();
  if (t == "i1") return aoti_torch_dtype_bool();
  if (t == "fp8e4nv") return aoti_torch_dtype_float8_e4m3fn();
  if (t == "fp8e5") return aoti_torch_dtype_float8_e5m2();
  if (t == "fp8e4b8") return aoti_torch_dtype_float8_e4m3fnuz();
  if (t == "fp8e5b16") return aoti_torch_dtype_float8_e5m2fnuz();
  return -1;
}

std::string dtype_name(int32_t code) {
  static const std::pair<int32_t (*)(), const char*> kNames[] = {
      {aoti_torch_dtype_float16, "torch.float16"},   {aoti_torch_dtype_bfloat16, "torch.bfloat16"},
      {aoti_torch_dtype_float32, "torch.float32"},   {aoti_torch_dtype_float64, "torch.float64"},
      {aoti_torch_dtype_int8, "torch.int8"},         {aoti_torch_dtype_int16, "torch.int16"},
      {aoti_torch_dtype_int32, "torch.int32"},       {aoti_torch_dtype_int64, "torch.int64"},
      {aoti_torch_dtype_uint8, "torch.uint8"},       {aoti_torch_dtype_uint16, "torch.uint16"},
      {aoti_torch_dtype_uint32, "torch.uint32"},     {aoti_torch_dtype_uint64, "torch.uint64"},
      {aoti_torch_dtype_bool, "torch.bool"},         {aoti_torch_dtype_float8_e4m3fn, "torch.float8_e4m3fn"},
      {aoti_torch_dtype_float8_e5m2, "torch.float8_e5m2"},
      {aoti_torch_dtype_float8_e4m3fnuz, "torch.float8_e4m3fnuz"},
      {aoti_torch_dtype_float8_e5m2fnuz, "torch.float8_e5m2fnuz"},
  };
  for (const auto& [fn, name] : kNames) {
    if (fn() == code) return name;
  }
  return "dtype code " + std::to_string(code);
}

void shim_check(AOTITorchError err, const char* call) {
  if (err != AOTI_TORCH_SUCCESS) throw AotError(std::string("PyTorch C shim call ") + call + " failed");
}

std::string device_name(int32_t type, int32_t index) {
  std::string name;
  if (type == aoti_torch_device_type_cpu()) return "cpu";
  if (type == aoti_torch_device_type_cuda()) name = "cuda";
  else if (type == aoti_torch_device_type_meta()) name = "meta";
  else if (type == aoti_torch_device_type_mps()) name = "mps";
  else if (type == aoti_torch_device_type_xpu()) name = "xpu";
  else name = "device type " + std::to_string(type);
  return index >= 0 ? name + ":" + std::to_string(index) : name;
}

// ------------------------------------------------------------------------------------------
// PyTorch's current CUDA stream. The stream getters live in libtorch_cuda.so (absent from CPU
// builds), so they are looked up when first needed instead of being linked: the library must
// load into a CPU-only PyTorch. Both are C functions of the stable shim.
// ------------------------------------------------------------------------------------------
using GetCudaStreamFn = AOTITorchError (*)(int32_t device_index, void** ret_stream);
using NativeHandleFn = AOTITorchError (*)(StreamHandle stream, void** ret_native_handle);

void* torch_symbol(const char* name) {
  for (const char* lib : {"libtorch_cuda.so", "libtorch_cpu.so", "libtorch.so"}) {
    if (void* handle = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD)) {  // only libraries torch already loaded
      void* sym = dlsym(handle, name);
      dlclose(handle);
      if (sym != nullptr) return sym;
    }
  }
  return dlsym(RTLD_DEFAULT, name);
}

void* current_cuda_stream(int32_t device) {
  // aoti_torch_get_current_cuda_stream: every CUDA build since 2.x; torch_stream_native_handle:
  // the accelerator-generic route added in 2.13.
  static const auto get_cuda_stream = reinterpret_cast<GetCudaStreamFn>(torch_symbol("aoti_torch_get_current_cuda_stream"));
  static const auto native_handle = reinterpret_cast<NativeHandleFn>(torch_symbol("torch_stream_native_handle"));
  void* stream = nullptr;
  if (get_cuda_stream != nullptr) {
    shim_check(get_cuda_stream(device, &stream), "aoti_torch_get_current_cuda_stream");
    return stream;
  }
  if (native_handle != nullptr) {
    StreamHandle handle = nullptr;
    shim_check(aoti_torch_get_current_stream(device, &handle), "aoti_torch_get_current_stream");
    const AOTITorchError err = native_handle(handle, &stream);
    aoti_torch_delete_stream(handle);
    shim_check(err, "torch_stream_native_handle");
    return stream;
  }
  throw AotError("cannot find PyTorch's current CUDA stream: this PyTorch build exports neither "
                 "aoti_torch_get_current_cuda_stream nor torch_stream_native_handle");
}

// ------------------------------------------------------------------------------------------
// Ops
// ------------------------------------------------------------------------------------------
template <typename F>
auto with_op_name(const char* op, F&& body) -> decltype(body()) {
  try {
    return body();
  } catch (const std::exception& e) {
    throw std::runtime_error(std::string("flash_attn::") + op + ": " + e.what());
  }
}

// `image` (may be empty): the image's bytes when the caller has them (the packaged images are
// stored compressed and inflated in Python); empty: read the file `image_path`.
int64_t register_kernel(const std::string& image_path, const std::string& kernel_name, const std::string& signature,
                        const LaunchConfig& config, std::vector<uint8_t> image) {
  if (image_path.empty()) throw AotError("image_path is empty");
  if (kernel_name.empty()) throw AotError("kernel_name is empty");
  auto spec = std::make_unique<KernelSpec>();
  spec->image_path = image_path;
  spec->image = std::move(image);
  spec->kernel_name = kernel_name;
  spec->signature_text = signature;
  spec->config = config;
  spec->args = parse_signature(signature, &dtype_code);
  check_config(config);
  for (size_t i = 0; i < spec->args.size(); ++i) {
    const ArgKind kind = spec->args[i].kind;
    spec->num_tensors += kind == ArgKind::Pointer;
    if (kind == ArgKind::Pointer) spec->pointer_dtypes.push_back(spec->args[i].torch_dtype);
    spec->num_ints += kind == ArgKind::Int;
    spec->num_floats += kind == ArgKind::Float;
    if (kind == ArgKind::GlobalScratch) spec->global_scratch_slot = int(i);
    if (kind == ArgKind::ProfileScratch) spec->profile_scratch_slot = int(i);
  }
  if (config.global_scratch_bytes > 0 && spec->global_scratch_slot < 0) {
    throw AotError("global_scratch_bytes is " + std::to_string(config.global_scratch_bytes) +
                   " but the signature has no global_scratch entry");
  }
  if (config.profile_scratch_bytes > 0 && spec->profile_scratch_slot < 0) {
    throw AotError("profile_scratch_bytes is " + std::to_string(config.profile_scratch_bytes) +
                   " but the signature has no profile_scratch entry");
  }
  {
    // The same registration twice (every process asks once per kernel it uses) gives the same id.
    std::lock_guard<std::mutex> lock(g_specs_mutex);
    for (size_t i = 0; i < g_specs.size(); ++i) {
      const KernelSpec& s = *g_specs[i];
      const LaunchConfig& c = s.config;
      if (s.image_path == image_path && s.kernel_name == kernel_name && s.signature_text == signature &&
          c.num_warps == config.num_warps && c.num_ctas == config.num_ctas && c.shared_bytes == config.shared_bytes &&
          c.global_scratch_bytes == config.global_scratch_bytes && c.global_scratch_align == config.global_scratch_align &&
          c.profile_scratch_bytes == config.profile_scratch_bytes &&
          c.profile_scratch_align == config.profile_scratch_align && c.cooperative == config.cooperative &&
          c.pdl == config.pdl) {
        return int64_t(i);
      }
    }
  }
  load_and_check_image(*spec);
  std::lock_guard<std::mutex> lock(g_specs_mutex);
  g_specs.push_back(std::move(spec));
  return int64_t(g_specs.size() - 1);
}

// ------------------------------------------------------------------------------------------
// aot_launch: check the grid, the counts and the tensors, pack the parameters, allocate Triton's
// scratch, launch. Every message is built only when its check fails.
// ------------------------------------------------------------------------------------------
std::string kernel_text(const KernelSpec& spec) { return "kernel '" + spec.kernel_name + "'"; }

// The grid padded to 3 dims (missing ones are 1): 1 to 3 entries, each from 0 to flash_attn/limits.py's
// GRID_LIMITS, grid[0] to GRID_LIMITS[0] / num_ctas (the CTAs of a cluster multiply it). A zero
// dim launches nothing.
std::array<int64_t, 3> check_grid(const std::vector<int64_t>& grid, int64_t num_ctas) {
  if (grid.empty() || grid.size() > 3) {
    throw AotError("grid must have 1, 2 or 3 entries, got " + std::to_string(grid.size()));
  }
  std::array<int64_t, 3> g = {1, 1, 1};
  std::copy(grid.begin(), grid.end(), g.begin());
  const int64_t bounds[3] = {limits::kGridLimits[0] / num_ctas, limits::kGridLimits[1], limits::kGridLimits[2]};
  for (int i = 0; i < 3; ++i) {
    if (g[i] < 0 || g[i] > bounds[i]) {
      throw AotError("grid[" + std::to_string(i) + "] = " + std::to_string(g[i]) + " is outside 0.." +
                     std::to_string(bounds[i]) + (i == 0 && num_ctas > 1 ? " (num_ctas multiplies grid[0])" : ""));
    }
  }
  return g;
}

// The signature says how many tensors, ints and floats, in which order.
void check_counts(const KernelSpec& spec, size_t tensors, size_t ints, size_t floats) {
  if (int(tensors) != spec.num_tensors || int(ints) != spec.num_ints || int(floats) != spec.num_floats) {
    throw AotError(kernel_text(spec) + " takes " + spec.describe() + "; got " + std::to_string(tensors) +
                   " tensors, " + std::to_string(ints) + " ints, " + std::to_string(floats) + " floats");
  }
}

// Each tensor of the signature's dtype, all on one device: returns that device and the first
// tensor. An undefined tensor (aot_run's index -1) is a pointer the kernel does not read: null.
struct Device {
  int32_t type, index;
  size_t first;  // index of the first defined tensor
};

Device check_tensors(const KernelSpec& spec, const std::vector<Tensor>& tensors) {
  Device first{0, 0, tensors.size()};
  size_t t = 0;
  for (const ArgSpec& a : spec.args) {
    if (a.kind != ArgKind::Pointer) continue;
    const Tensor& x = tensors[t];
    if (!x.defined()) {
      ++t;
      continue;
    }
    int32_t type = 0, index = 0, dtype = 0;
    shim_check(aoti_torch_get_device_type(x.get(), &type), "aoti_torch_get_device_type");
    shim_check(aoti_torch_get_device_index(x.get(), &index), "aoti_torch_get_device_index");
    shim_check(aoti_torch_get_dtype(x.get(), &dtype), "aoti_torch_get_dtype");
    if (dtype != a.torch_dtype) {
      throw AotError("tensors[" + std::to_string(t) + "] has dtype " + dtype_name(dtype) + " but " + kernel_text(spec) +
                     " expects " + dtype_name(a.torch_dtype) + " ('" + a.token + "')");
    }
    if (first.first == tensors.size()) {
      first = Device{type, index, t};
    } else if (type != first.type || index != first.index) {
      throw AotError("tensors[" + std::to_string(t) + "] is on " + device_name(type, index) + " but tensors[" +
                     std::to_string(first.first) + "] is on " + device_name(first.type, first.index) +
                     "; all must be on the same CUDA device");
    }
    ++t;
  }
  if (first.first == tensors.size()) {
    throw AotError(kernel_text(spec) + " takes no tensor, so there is no device to launch it on");
  }
  return first;
}

void check_int(const ArgSpec& a, int64_t v, size_t index) {
  if (v < a.min_value || v > a.max_value) {
    throw AotError("ints[" + std::to_string(index) + "] = " + std::to_string(v) + " does not fit the kernel's " +
                   a.type + " parameter (range " + std::to_string(a.min_value) + " to " + std::to_string(a.max_value) +
                   ")");
  }
  if (a.divisor > 1 && v % a.divisor != 0) {
    throw AotError("ints[" + std::to_string(index) + "] = " + std::to_string(v) + " must be divisible by " +
                   std::to_string(a.divisor) + ": the kernel was compiled assuming it ('" + a.token + "')");
  }
}

// One 8-byte slot per kernel parameter, the value in the parameter's C type: ints range- and
// divisibility-checked, pointers alignment-checked (and left null with `no_data`: meta tensors).
// The scratch slots stay null here.
void pack(const KernelSpec& spec, const std::vector<Tensor>& tensors, const std::vector<int64_t>& ints,
          const std::vector<double>& floats, bool no_data, PackedLaunch& launch) {
  size_t ti = 0, ii = 0, fi = 0;
  for (size_t s = 0; s < spec.args.size(); ++s) {
    const ArgSpec& a = spec.args[s];
    switch (a.kind) {
      case ArgKind::Pointer: {
        const size_t index = ti++;
        if (no_data || !tensors[index].defined()) break;  // undefined: null
        const auto address = reinterpret_cast<uint64_t>(tensors[index].data_ptr());
        if (a.divisor > 1 && address % uint64_t(a.divisor) != 0) {
          char hex[32];
          std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(address));
          throw AotError("tensors[" + std::to_string(index) + "] data pointer " + hex + " is not " +
                         std::to_string(a.divisor) + "-byte aligned as " + kernel_text(spec) + " assumes ('" +
                         a.token + "'); pass a tensor whose storage offset keeps that alignment");
        }
        launch.slots[s] = address;
        break;
      }
      case ArgKind::Int: {
        const size_t index = ii++;
        const int64_t v = ints[index];
        check_int(a, v, index);
        std::memcpy(&launch.slots[s], &v, sizeof v);  // little-endian: narrower params read the low bytes
        break;
      }
      case ArgKind::Float: {
        const double v = floats[fi++];
        if (a.param_bytes == 4) {
          const float f = static_cast<float>(v);
          std::memcpy(&launch.slots[s], &f, sizeof f);
        } else {
          std::memcpy(&launch.slots[s], &v, sizeof v);
        }
        break;
      }
      case ArgKind::GlobalScratch:
      case ArgKind::ProfileScratch:
        break;
    }
  }
}

// Triton's hidden scratch buffers: bytes per program (times the CTAs of a cluster), taken from
// PyTorch's caching allocator on the launch device and current stream, so freeing them (when the
// caller drops the result, after the launch) is ordered after the kernel. Null when not needed.
struct Scratch {
  std::optional<Tensor> global, profile;
};

// The bytes of a hidden scratch buffer (`bytes_per_program` per program and CTA) for `programs` programs.
int64_t scratch_bytes(const KernelSpec& spec, int64_t bytes_per_program, int64_t programs) {
  int64_t total = 0;
  if (__builtin_mul_overflow(programs, spec.config.num_ctas * bytes_per_program, &total)) {
    throw AotError(kernel_text(spec) + ": the scratch buffer for a grid of " + std::to_string(programs) +
                   " programs overflows");
  }
  return total;
}

// `global_address`: where the caller made room for the global scratch (aot_run: in the call's
// scratch), else 0: made here.
Scratch allocate_scratch(const KernelSpec& spec, const Tensor& like, int64_t programs, PackedLaunch& launch,
                         uint64_t global_address) {
  const LaunchConfig& c = spec.config;
  auto allocate = [&](int slot, int64_t bytes_per_program) -> std::optional<Tensor> {
    if (slot < 0 || bytes_per_program == 0) return std::nullopt;
    const int64_t bytes = scratch_bytes(spec, bytes_per_program, programs);
    Tensor buffer = torch::stable::new_empty(like, {bytes}, torch::headeronly::ScalarType::Byte);
    launch.slots[slot] = reinterpret_cast<uint64_t>(buffer.data_ptr());
    return buffer;
  };
  Scratch scratch;
  if (global_address != 0 && spec.global_scratch_slot >= 0 && c.global_scratch_bytes > 0) {
    launch.slots[spec.global_scratch_slot] = global_address;
  } else {
    scratch.global = allocate(spec.global_scratch_slot, c.global_scratch_bytes);
  }
  scratch.profile = allocate(spec.profile_scratch_slot, c.profile_scratch_bytes);
  return scratch;
}

// Measuring the host's cost without a GPU (`python -m flash_attn bench overhead`): while switched
// on, launches whose tensors are CPU tensors (standing in for device memory) go through every
// check, the packing and the scratch allocation and are counted instead of refused; only the CUDA
// launch itself is left out. CUDA tensors are launched as always.
std::atomic<bool> g_count_cpu_launches{false};
std::atomic<int64_t> g_counted_launches{0};

// Checks everything in this order (tests/aot/test_aot_library.py): kernel id, grid, counts, tensors,
// ints and pointers (while packing), then that the tensors are CUDA tensors. With `meta_only`
// (fake/meta tensors, used when tracing), stops before anything that needs real memory or a GPU.
// `global_scratch`: where aot_run made room for the kernel's global scratch, else 0 (made here).
void check_and_launch(int64_t kernel_id, const std::vector<int64_t>& grid, const std::vector<Tensor>& tensors,
                      const std::vector<int64_t>& ints, const std::vector<double>& floats, bool meta_only,
                      uint64_t global_scratch = 0) {
  const KernelSpec& spec = spec_for(kernel_id);
  const std::array<int64_t, 3> g = check_grid(grid, spec.config.num_ctas);
  check_counts(spec, tensors.size(), ints.size(), floats.size());
  const Device device = check_tensors(spec, tensors);
  PackedLaunch launch(spec.args.size());
  pack(spec, tensors, ints, floats, meta_only || device.type == aoti_torch_device_type_meta(), launch);
  if (meta_only) return;
  const int64_t programs = g[0] * g[1] * g[2];  // < 2^63 within the grid limits
  if (device.type == aoti_torch_device_type_cpu() && g_count_cpu_launches.load(std::memory_order_relaxed)) {
    const Scratch scratch = allocate_scratch(spec, tensors[device.first], programs, launch, global_scratch);
    g_counted_launches.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  // Last, the device: on a machine without a usable GPU, require_cuda() says why.
  if (device.type != aoti_torch_device_type_cuda()) {
    require_cuda();
    throw AotError("the tensors are on " + device_name(device.type, device.index) + "; " + kernel_text(spec) +
                   " runs on CUDA tensors only");
  }
  if (g[0] == 0 || g[1] == 0 || g[2] == 0) return;
  launch.device = device.index;
  std::copy(g.begin(), g.end(), launch.grid);
  const Scratch scratch = allocate_scratch(spec, tensors[device.first], programs, launch, global_scratch);
  launch.stream = current_cuda_stream(launch.device);
  flash_attn_aot::launch(spec, launch);
}

// ------------------------------------------------------------------------------------------
// aot_run: every launch of one call in one op call, and the buffers they write. The caller
// describes the call once (per call shape) in `plan`, a 1-D int64 CPU tensor, and passes the
// call's tensors and its per-call row counts; the buffers are made here, and each launch is then
// checked and launched exactly as aot_launch does. Layout:
//   n_buffers, per buffer:
//     flags (bit 0: zero-filled; bit 1: part of the call's scratch), ndim, ndim sizes (a size
//       -(r + 1): the row count rows[r]),
//     columns (-1: the whole last dimension; else the buffer is a view of its first `columns`),
//   n_launches, per launch:
//     kernel, grid0, grid1, grid2,
//     n_tensors, n_tensors indices into the call's tensors followed by the buffers (-1: a pointer
//       the kernel does not read, passed null),
//     n_ints, n_ints values,
//     n_rows, n_rows pairs (index into this launch's ints, index into `rows`): that int is the row count,
//     n_floats, n_floats IEEE doubles (their bit patterns).
// A buffer takes the device of the call's first tensor and the dtype of the first kernel
// parameter it is passed to (a later launch taking it as another dtype is refused by its checks).
// The call's scratch (the buffers it does not return, of one dtype, and the launches' Triton
// global scratch where no launch overlaps the next: no PDL) is one allocation, each part
// kScratchAlign-aligned, where a Triton global scratch is among them.
// ------------------------------------------------------------------------------------------
// A plan's entries: those of a 1-D contiguous int64 CPU tensor, checked as such.
std::pair<const int64_t*, int64_t> plan_entries(const Tensor& plan) {
  int32_t device_type = 0, dtype = 0;
  shim_check(aoti_torch_get_device_type(plan.get(), &device_type), "aoti_torch_get_device_type");
  shim_check(aoti_torch_get_dtype(plan.get(), &dtype), "aoti_torch_get_dtype");
  if (device_type != aoti_torch_device_type_cpu() || dtype != aoti_torch_dtype_int64() || plan.dim() != 1 ||
      !plan.is_contiguous()) {
    throw AotError("plan must be a 1-D contiguous int64 CPU tensor (flash_attn/backends/aot.py writes it)");
  }
  return {static_cast<const int64_t*>(plan.data_ptr()), plan.numel()};
}

class PlanReader {
 public:
  PlanReader(const int64_t* data, int64_t size) : data_(data), size_(size) {}

  int64_t next(const char* what) {
    if (pos_ >= size_) {
      throw AotError("plan ends at entry " + std::to_string(pos_) + " where " + what + " was expected");
    }
    return data_[pos_++];
  }

  // A count or index in [0, bound); -1 too with `none`.
  int64_t index(const char* what, int64_t bound, bool none = false) {
    const int64_t at = pos_;
    const int64_t v = next(what);
    if ((v < 0 && !(none && v == -1)) || v >= bound) {
      throw AotError("plan entry " + std::to_string(at) + " (" + what + ") is " + std::to_string(v) +
                     ", outside 0.." + std::to_string(bound - 1));
    }
    return v;
  }

  int64_t position() const { return pos_; }
  bool done() const { return pos_ == size_; }

 private:
  const int64_t* data_ = nullptr;
  int64_t size_ = 0, pos_ = 0;
};

constexpr int64_t kMaxItems = 4096;  // far above any kernel's parameter count
constexpr int64_t kMaxDims = 8;

constexpr int64_t kScratchAlign = 256;  // bytes: every part of the call's scratch starts at a multiple

struct BufferShape {
  bool zeroed = false, scratch = false;
  std::vector<int64_t> storage;
  int64_t columns = -1;
  int32_t dtype = -1;  // from the first launch it is passed to
};

struct LaunchRecord {
  int64_t kernel = 0;
  std::vector<int64_t> grid = std::vector<int64_t>(3), tensors, ints;
  std::vector<double> floats;
};

BufferShape read_buffer(PlanReader& read, const std::vector<int64_t>& rows) {
  BufferShape b;
  const int64_t flags = read.index("a buffer's flags", 4);
  b.zeroed = (flags & 1) != 0;
  b.scratch = (flags & 2) != 0;
  b.storage.resize(size_t(read.index("a buffer's dimension count", kMaxDims + 1)));
  if (b.storage.empty()) {
    throw AotError("plan entry " + std::to_string(read.position() - 1) + ": a buffer has no dimension");
  }
  for (int64_t& n : b.storage) {
    const int64_t at = read.position();
    n = read.next("a buffer size");
    if (n < 0) {
      const int64_t r = -n - 1;
      if (r >= int64_t(rows.size())) {
        throw AotError("plan entry " + std::to_string(at) + " (a buffer size) is the row count rows[" +
                       std::to_string(r) + "] but the call passes " + std::to_string(rows.size()) + " row counts");
      }
      n = rows[r];
      if (n < 0) throw AotError("rows[" + std::to_string(r) + "] is " + std::to_string(n) + ", not a row count");
    }
  }
  const int64_t at = read.position();
  b.columns = read.next("a buffer's columns");
  if (b.columns < -1 || b.columns > b.storage.back()) {
    throw AotError("plan entry " + std::to_string(at) + " (a buffer's columns) is " + std::to_string(b.columns) +
                   ", outside -1.." + std::to_string(b.storage.back()));
  }
  return b;
}

LaunchRecord read_launch(PlanReader& read, int64_t tensor_count, const std::vector<int64_t>& rows) {
  LaunchRecord l;
  l.kernel = read.next("a kernel id");
  for (int64_t& g : l.grid) g = read.next("a grid dimension");
  l.tensors.resize(size_t(read.index("a tensor count", kMaxItems)));
  for (int64_t& t : l.tensors) t = read.index("a tensor index", tensor_count, /*none=*/true);
  l.ints.resize(size_t(read.index("an int count", kMaxItems)));
  for (int64_t& v : l.ints) v = read.next("an int");
  for (int64_t r = read.index("a row count", kMaxItems); r > 0; --r) {
    const int64_t at = read.index("an int index", int64_t(l.ints.size()));
    l.ints[at] = rows[read.index("a row index", int64_t(rows.size()))];
  }
  l.floats.resize(size_t(read.index("a float count", kMaxItems)));
  for (double& f : l.floats) {
    const int64_t bits = read.next("a float");
    std::memcpy(&f, &bits, sizeof f);
  }
  return l;
}

// Row-major strides of `sizes` (a size 0 counts as 1), refusing what cannot be addressed.
std::vector<int64_t> contiguous_strides(const std::vector<int64_t>& sizes) {
  std::vector<int64_t> strides(sizes.size());
  int64_t stride = 1;
  for (int64_t d = int64_t(sizes.size()) - 1; d >= 0; --d) {
    strides[d] = stride;
    if (__builtin_mul_overflow(stride, std::max<int64_t>(sizes[d], 1), &stride)) {
      throw AotError("a buffer of the plan is too large to address");
    }
  }
  return strides;
}

int64_t element_count(const std::vector<int64_t>& sizes) {
  int64_t n = 1;
  for (const int64_t s : sizes) {
    if (__builtin_mul_overflow(n, s, &n)) throw AotError("a buffer of the plan is too large to address");
  }
  return n;
}

int64_t element_bytes(int32_t dtype) {
  if (dtype == aoti_torch_dtype_float64() || dtype == aoti_torch_dtype_int64() || dtype == aoti_torch_dtype_uint64()) {
    return 8;
  }
  if (dtype == aoti_torch_dtype_float32() || dtype == aoti_torch_dtype_int32() || dtype == aoti_torch_dtype_uint32()) {
    return 4;
  }
  if (dtype == aoti_torch_dtype_float16() || dtype == aoti_torch_dtype_bfloat16() ||
      dtype == aoti_torch_dtype_int16() || dtype == aoti_torch_dtype_uint16()) {
    return 2;
  }
  return 1;
}

// `b.storage`, contiguous: its own (`base` null) or `base`'s elements from `offset` on; zero-filled
// if asked, then viewed as its first `b.columns` columns.
Tensor make_buffer(const BufferShape& b, int32_t device_type, int32_t device_index, const Tensor* base = nullptr,
                   int64_t offset = 0) {
  const int64_t ndim = int64_t(b.storage.size());
  const std::vector<int64_t> strides = contiguous_strides(b.storage);
  AtenTensorHandle handle = nullptr;
  if (base == nullptr) {
    shim_check(aoti_torch_empty_strided(ndim, b.storage.data(), strides.data(), b.dtype, device_type, device_index,
                                        &handle),
               "aoti_torch_empty_strided");
  } else {
    shim_check(aoti_torch__reinterpret_tensor(base->get(), ndim, b.storage.data(), strides.data(), offset, &handle),
               "aoti_torch__reinterpret_tensor");
  }
  Tensor storage(handle);
  if (b.zeroed) shim_check(aoti_torch_zero_(storage.get()), "aoti_torch_zero_");
  if (b.columns < 0 || b.columns == b.storage.back()) return storage;
  std::vector<int64_t> sizes(b.storage);
  sizes.back() = b.columns;
  AtenTensorHandle view = nullptr;
  shim_check(aoti_torch__reinterpret_tensor(storage.get(), ndim, sizes.data(), strides.data(), offset, &view),
             "aoti_torch__reinterpret_tensor");
  return Tensor(view);
}

// Rounds `n` elements of `bytes` each up to a multiple of kScratchAlign bytes (in elements).
int64_t scratch_aligned(int64_t n, int64_t bytes) {
  const int64_t unit = kScratchAlign / bytes;
  int64_t up = 0;
  if (__builtin_add_overflow(n, unit - 1, &up)) throw AotError("the call's scratch is too large to address");
  return up / unit * unit;
}

// The call's scratch parts: the offset of each scratch buffer carved from it (-1 for the others) and
// of the Triton global scratch (-1: none carved), in elements of the scratch's dtype (-1: no
// scratch allocation), and the elements in all.
struct ScratchLayout {
  int32_t dtype = -1;
  std::vector<int64_t> offsets;
  int64_t triton = -1, total = 0;
};

// The scratch is of the dtype most scratch buffers have (the first of them on a tie); the others
// are made on their own.
ScratchLayout scratch_layout(const std::vector<BufferShape>& buffers, int64_t triton_bytes) {
  ScratchLayout layout;
  layout.offsets.assign(buffers.size(), -1);
  // without a Triton scratch to join them, the parts stay apart: the allocation saved per part but
  // one costs a tensor more (the storage's), which the stubbed decode step measured dearer
  if (triton_bytes == 0) return layout;
  int64_t most = 0;
  for (const BufferShape& b : buffers) {
    const auto n = std::count_if(buffers.begin(), buffers.end(),
                                 [&](const BufferShape& o) { return o.scratch && o.dtype == b.dtype; });
    if (b.scratch && n > most) {
      most = n;
      layout.dtype = b.dtype;
    }
  }
  for (size_t b = 0; b < buffers.size(); ++b) {
    if (!buffers[b].scratch || buffers[b].dtype != layout.dtype) continue;
    layout.offsets[b] = layout.total;
    layout.total = scratch_aligned(layout.total + element_count(buffers[b].storage), element_bytes(layout.dtype));
  }
  if (layout.dtype < 0) return layout;  // (no scratch buffer)
  const int64_t bytes = element_bytes(layout.dtype);
  layout.triton = layout.total;
  layout.total = scratch_aligned(layout.total + (triton_bytes + bytes - 1) / bytes, bytes);
  return layout;
}

// A plan read: its buffers and launches (row counts in place), each buffer's dtype, and what the
// call's scratch layout needs from its launches.
struct ReadPlan {
  std::vector<BufferShape> buffers;
  std::vector<LaunchRecord> launches;
  int64_t triton_bytes = 0;  // the most Triton global scratch a launch takes (only with scratch buffers)
  bool overlapping = false;  // a launch overlaps the next (PDL)
};

ReadPlan read_plan(const int64_t* plan, int64_t plan_size, int64_t inputs, const std::vector<int64_t>& rows) {
  PlanReader read(plan, plan_size);
  ReadPlan p;
  p.buffers.resize(size_t(read.index("the buffer count", kMaxItems)));
  for (BufferShape& b : p.buffers) b = read_buffer(read, rows);
  const int64_t all = inputs + int64_t(p.buffers.size());
  p.launches.resize(size_t(read.index("the launch count", kMaxItems)));
  for (LaunchRecord& l : p.launches) l = read_launch(read, all, rows);
  if (!read.done()) throw AotError("plan has entries after its " + std::to_string(p.launches.size()) + " launches");

  // Each buffer's dtype: that of the first kernel parameter it is passed to; the most Triton
  // global scratch a launch takes (each grid checked first, as the launch will).
  // (only a plan with scratch buffers takes the Triton scratch into them: scratch_layout)
  const bool scratch_buffers =
      std::any_of(p.buffers.begin(), p.buffers.end(), [](const BufferShape& b) { return b.scratch; });
  for (const LaunchRecord& l : p.launches) {
    const KernelSpec& spec = spec_for(l.kernel);
    for (size_t t = 0; t < l.tensors.size() && t < spec.pointer_dtypes.size(); ++t) {
      if (l.tensors[t] >= inputs && p.buffers[l.tensors[t] - inputs].dtype < 0) {
        p.buffers[l.tensors[t] - inputs].dtype = spec.pointer_dtypes[t];
      }
    }
    p.overlapping = p.overlapping || spec.config.pdl;
    if (scratch_buffers && spec.global_scratch_slot >= 0 && spec.config.global_scratch_bytes > 0) {
      const std::array<int64_t, 3> g = check_grid(l.grid, spec.config.num_ctas);
      p.triton_bytes =
          std::max(p.triton_bytes, scratch_bytes(spec, spec.config.global_scratch_bytes, g[0] * g[1] * g[2]));
    }
  }
  return p;
}

// Runs a read plan for the call's `tensors` (as many as it was read for): its buffers made, each
// launch checked and launched. Returns every buffer made, or with `returned_only` those the call
// returns (not flagged scratch: the other ones are freed here, after their launches).
std::vector<Tensor> run_plan(const ReadPlan& p, const std::vector<Tensor>& tensors, bool meta_only,
                             bool returned_only = false) {
  const std::vector<BufferShape>& buffers = p.buffers;
  std::vector<Tensor> call(tensors), made;
  std::optional<Tensor> scratch;
  ScratchLayout layout;
  int32_t device_type = 0, device_index = 0;
  if (!buffers.empty()) {
    const auto first = std::find_if(tensors.begin(), tensors.end(), [](const Tensor& t) { return t.defined(); });
    if (first == tensors.end()) {
      throw AotError("the plan makes buffers but the call passes no tensor to take their device from");
    }
    shim_check(aoti_torch_get_device_type(first->get(), &device_type), "aoti_torch_get_device_type");
    shim_check(aoti_torch_get_device_index(first->get(), &device_index), "aoti_torch_get_device_index");
    for (size_t b = 0; b < buffers.size(); ++b) {
      if (buffers[b].dtype < 0) {
        throw AotError("buffer " + std::to_string(b) + " of the plan is passed to no kernel parameter");
      }
    }
    layout = scratch_layout(buffers, p.overlapping ? 0 : p.triton_bytes);
    if (layout.dtype >= 0) {
      BufferShape whole;
      whole.storage = {layout.total};
      whole.dtype = layout.dtype;
      scratch.emplace(make_buffer(whole, device_type, device_index));
    }
    made.reserve(buffers.size());
    for (size_t b = 0; b < buffers.size(); ++b) {
      made.push_back(layout.offsets[b] >= 0
                         ? make_buffer(buffers[b], device_type, device_index, &*scratch, layout.offsets[b])
                         : make_buffer(buffers[b], device_type, device_index));
    }
    call.insert(call.end(), made.begin(), made.end());
  }
  const uint64_t triton_scratch = layout.triton < 0 || meta_only ? 0 :
      reinterpret_cast<uint64_t>(static_cast<char*>(scratch->data_ptr()) + layout.triton * element_bytes(layout.dtype));
  // Reused from launch to launch; tensors copied in, never default-made (each would be a new handle).
  std::vector<Tensor> launch_tensors;
  std::optional<Tensor> none;
  for (const LaunchRecord& l : p.launches) {
    launch_tensors.clear();
    for (const int64_t t : l.tensors) {
      if (t < 0 && !none) none.emplace();  // an undefined tensor
      launch_tensors.push_back(t < 0 ? *none : call[t]);
    }
    check_and_launch(l.kernel, l.grid, launch_tensors, l.ints, l.floats, meta_only, triton_scratch);
  }
  if (returned_only) {
    std::vector<Tensor> returned;
    for (size_t b = 0; b < buffers.size(); ++b) {
      if (!buffers[b].scratch) returned.push_back(std::move(made[b]));
    }
    return returned;
  }
  return made;
}

std::vector<Tensor> run_plan(const Tensor& plan, const std::vector<Tensor>& tensors, const std::vector<int64_t>& rows,
                             bool meta_only) {
  const auto [entries, size] = plan_entries(plan);
  return run_plan(read_plan(entries, size, int64_t(tensors.size()), rows), tensors, meta_only);
}

// ------------------------------------------------------------------------------------------
// Lanes: a plan held with the metadata of the tensors of the call it was written for, and run
// for a later call whose tensors have the same metadata (flash_attn/dispatch.py's run_held and
// hold_held: one per checked call signature that runs one fixed plan). `key` stands for the rest of the signature
// (the caller's scalars, which tensors are absent); under one key, a call whose tensors' dims,
// sizes, strides, dtypes and devices equal a held lane's, its pointers aligned to
// limits::kPointerAlignment (what the held plan assumes), runs that lane's plan with no row
// count; any other call is not a lane's (an empty result: the caller takes its general route).
// A lane's plan is read once, when held (so it takes no row count: one that does is refused
// then), and a lane's run returns only the buffers the call returns (not flagged scratch).
// ------------------------------------------------------------------------------------------
// A tensor's metadata, in place (a lane's tensors have at most kMaxDims dims): compared per call.
struct TensorMeta {
  int32_t dtype = 0, device_type = 0, device_index = 0;
  int64_t ndim = 0;
  std::array<int64_t, kMaxDims> sizes{}, strides{};

  bool operator==(const TensorMeta& o) const {
    return dtype == o.dtype && device_type == o.device_type && device_index == o.device_index && ndim == o.ndim &&
           std::equal(sizes.begin(), sizes.begin() + ndim, o.sizes.begin()) &&
           std::equal(strides.begin(), strides.begin() + ndim, o.strides.begin());
  }
};

// `t`'s metadata, or nothing where it is undefined or has more dims than a lane's tensor may.
std::optional<TensorMeta> meta_of(const Tensor& t) {
  if (!t.defined()) return std::nullopt;
  TensorMeta m;
  int64_t *sizes = nullptr, *strides = nullptr;
  shim_check(aoti_torch_get_dim(t.get(), &m.ndim), "aoti_torch_get_dim");
  if (m.ndim > kMaxDims) return std::nullopt;
  shim_check(aoti_torch_get_dtype(t.get(), &m.dtype), "aoti_torch_get_dtype");
  shim_check(aoti_torch_get_device_type(t.get(), &m.device_type), "aoti_torch_get_device_type");
  shim_check(aoti_torch_get_device_index(t.get(), &m.device_index), "aoti_torch_get_device_index");
  shim_check(aoti_torch_get_sizes(t.get(), &sizes), "aoti_torch_get_sizes");
  shim_check(aoti_torch_get_strides(t.get(), &strides), "aoti_torch_get_strides");
  std::copy(sizes, sizes + m.ndim, m.sizes.begin());
  std::copy(strides, strides + m.ndim, m.strides.begin());
  return m;
}

struct Lane {
  std::shared_ptr<const ReadPlan> plan;  // read from the caller's plan: nothing of the caller's is kept
  std::vector<TensorMeta> tensors;
};

constexpr size_t kLanesPerKey = 16;  // shapes met under one key's scalars (then the oldest goes)

std::mutex g_lanes_mutex;
std::unordered_map<int64_t, std::vector<Lane>> g_lanes;

// The metadata of each of `tensors`, or nothing where one is not a lane's (undefined, too many
// dims, or with `aligned` a pointer not aligned to limits::kPointerAlignment).
std::optional<std::vector<TensorMeta>> metas_of(const std::vector<Tensor>& tensors, bool aligned) {
  std::vector<TensorMeta> metas;
  metas.reserve(tensors.size());
  for (const Tensor& t : tensors) {
    const std::optional<TensorMeta> m = meta_of(t);
    if (!m || (aligned && reinterpret_cast<uint64_t>(t.data_ptr()) % uint64_t(limits::kPointerAlignment) != 0)) {
      return std::nullopt;
    }
    metas.push_back(*m);
  }
  return metas;
}

void hold_lane(int64_t key, const Tensor& plan, const std::vector<Tensor>& tensors) {
  std::optional<std::vector<TensorMeta>> metas = metas_of(tensors, /*aligned=*/false);
  if (!metas) {
    throw AotError("a lane's tensors are all defined (absent ones are part of its key), of at most " +
                   std::to_string(kMaxDims) + " dims");
  }
  const auto [entries, size] = plan_entries(plan);
  Lane lane{std::make_shared<const ReadPlan>(read_plan(entries, size, int64_t(tensors.size()), {})),
            std::move(*metas)};
  std::lock_guard<std::mutex> lock(g_lanes_mutex);
  std::vector<Lane>& held = g_lanes[key];
  for (Lane& l : held) {
    if (l.tensors == lane.tensors) {
      l.plan = std::move(lane.plan);
      return;
    }
  }
  if (held.size() >= kLanesPerKey) held.erase(held.begin());
  held.push_back(std::move(lane));
}

// The plan of the lane under `key` that `tensors` fit (held by the caller: the lane may go meanwhile), or null.
std::shared_ptr<const ReadPlan> lane_plan(int64_t key, const std::vector<Tensor>& tensors) {
  const std::optional<std::vector<TensorMeta>> metas = metas_of(tensors, /*aligned=*/true);
  if (!metas) return nullptr;
  std::lock_guard<std::mutex> lock(g_lanes_mutex);
  const auto found = g_lanes.find(key);
  if (found == g_lanes.end()) return nullptr;
  for (const Lane& l : found->second) {
    if (l.tensors == *metas) return l.plan;
  }
  return nullptr;
}

// ---- boxed entry points -----------------------------------------------------------------

std::string take_string(StableIValue v) {
  // Unboxed by hand rather than through to<std::string>, which (2.13 headers) leaks a copy.
  auto handle = torch::stable::detail::to<StringHandle>(v);
  size_t length = 0;
  const char* data = nullptr;
  const bool ok = torch_string_length(handle, &length) == AOTI_TORCH_SUCCESS &&
                  torch_string_c_str(handle, &data) == AOTI_TORCH_SUCCESS;
  std::string out = ok ? std::string(data, length) : std::string();
  torch_delete_string(handle);
  if (!ok) throw std::runtime_error("flash_attn: cannot read a string argument");
  return out;
}

// The bytes of an optional 1-D contiguous uint8 CPU tensor (empty when absent).
std::vector<uint8_t> take_image_bytes(StableIValue v) {
  auto image = torch::stable::detail::to<std::optional<Tensor>>(v);
  if (!image.has_value()) return {};
  int32_t device_type = 0, dtype = 0;
  shim_check(aoti_torch_get_device_type(image->get(), &device_type), "aoti_torch_get_device_type");
  shim_check(aoti_torch_get_dtype(image->get(), &dtype), "aoti_torch_get_dtype");
  if (device_type != aoti_torch_device_type_cpu() || dtype != aoti_torch_dtype_uint8() || image->dim() != 1 ||
      !image->is_contiguous()) {
    throw AotError("image must be a 1-D contiguous uint8 CPU tensor of the image's bytes");
  }
  if (image->numel() == 0) throw AotError("image is empty");
  const auto* data = static_cast<const uint8_t*>(image->data_ptr());
  return std::vector<uint8_t>(data, data + image->numel());
}

void boxed_register_kernel(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  using torch::stable::detail::to;
  STD_TORCH_CHECK(num_args == 13 && num_outputs == 1, "flash_attn::aot_register_kernel: schema mismatch");
  std::string image_path = take_string(stack[0]);
  std::string kernel_name = take_string(stack[1]);
  std::string signature = take_string(stack[2]);
  LaunchConfig config;
  config.num_warps = to<int64_t>(stack[3]);
  config.num_ctas = to<int64_t>(stack[4]);
  config.shared_bytes = to<int64_t>(stack[5]);
  config.global_scratch_bytes = to<int64_t>(stack[6]);
  config.global_scratch_align = to<int64_t>(stack[7]);
  config.profile_scratch_bytes = to<int64_t>(stack[8]);
  config.profile_scratch_align = to<int64_t>(stack[9]);
  config.cooperative = to<bool>(stack[10]);
  config.pdl = to<bool>(stack[11]);
  const int64_t id = with_op_name("aot_register_kernel", [&] {
    return register_kernel(image_path, kernel_name, signature, config, take_image_bytes(stack[12]));
  });
  stack[0] = torch::stable::detail::from(id);
}

void aot_launch(int64_t kernel, std::vector<int64_t> grid, std::vector<Tensor> tensors, std::vector<int64_t> ints,
                std::vector<double> floats) {
  with_op_name("aot_launch", [&] { check_and_launch(kernel, grid, tensors, ints, floats, /*meta_only=*/false); });
}

void aot_launch_meta(int64_t kernel, std::vector<int64_t> grid, std::vector<Tensor> tensors, std::vector<int64_t> ints,
                     std::vector<double> floats) {
  with_op_name("aot_launch", [&] { check_and_launch(kernel, grid, tensors, ints, floats, /*meta_only=*/true); });
}

std::vector<Tensor> aot_run(Tensor plan, std::vector<Tensor> tensors, std::vector<int64_t> rows) {
  return with_op_name("aot_run", [&] { return run_plan(plan, tensors, rows, /*meta_only=*/false); });
}

std::vector<Tensor> aot_run_meta(Tensor plan, std::vector<Tensor> tensors, std::vector<int64_t> rows) {
  return with_op_name("aot_run", [&] { return run_plan(plan, tensors, rows, /*meta_only=*/true); });
}

void aot_lane_hold(int64_t key, Tensor plan, std::vector<Tensor> tensors) {
  with_op_name("aot_lane_hold", [&] { hold_lane(key, plan, tensors); });
}

std::vector<Tensor> aot_lane_run(int64_t key, std::vector<Tensor> tensors) {
  return with_op_name("aot_lane_run", [&] {
    const std::shared_ptr<const ReadPlan> plan = lane_plan(key, tensors);
    return plan ? run_plan(*plan, tensors, /*meta_only=*/false, /*returned_only=*/true) : std::vector<Tensor>{};
  });
}

void aot_lanes_clear() {
  std::lock_guard<std::mutex> lock(g_lanes_mutex);
  g_lanes.clear();
}

int64_t aot_lanes_held() {
  std::lock_guard<std::mutex> lock(g_lanes_mutex);
  int64_t n = 0;
  for (const auto& [key, lanes] : g_lanes) n += int64_t(lanes.size());
  return n;
}

void aot_count_cpu_launches(bool enable) { g_count_cpu_launches.store(enable, std::memory_order_relaxed); }

int64_t aot_counted_launches() { return g_counted_launches.load(std::memory_order_relaxed); }

bool aot_use_driver_launch(bool enable) { return use_driver_launch(enable); }

std::vector<int64_t> aot_kernel_attributes(int64_t kernel, int64_t device) {
  return with_op_name("aot_kernel_attributes", [&] {
    const KernelSpec& spec = spec_for(kernel);
    require_cuda();
    if (device < 0 || device >= cuda_info().device_count) {
      throw AotError("device " + std::to_string(device) + " does not exist (" +
                     std::to_string(cuda_info().device_count) + " CUDA devices are visible)");
    }
    return kernel_attributes(spec, int(device));
  });
}

std::tuple<int64_t, int64_t, int64_t, std::string> aot_cuda_info() {
  const CudaInfo& info = cuda_info();
  return {info.runtime_version, info.driver_version, info.device_count, info.error};
}

}  // namespace
}  // namespace flash_attn_aot

// FRAGMENT, not DEF: the Python side defines flash_attn::forward/backward/... in the same namespace.
STABLE_TORCH_LIBRARY_FRAGMENT(flash_attn, m) {
  m.def(
      "aot_register_kernel(str image_path, str kernel_name, str signature, int num_warps, int num_ctas, "
      "int shared_bytes, int global_scratch_bytes=0, int global_scratch_align=1, int profile_scratch_bytes=0, "
      "int profile_scratch_align=1, bool launch_cooperative_grid=False, bool launch_pdl=False, Tensor? image=None) -> int");
  m.def("aot_launch(int kernel, int[] grid, Tensor(a!)[] tensors, int[] ints, float[] floats) -> ()");
  m.def("aot_run(Tensor plan, Tensor(a!)[] tensors, int[] rows) -> Tensor[]");
  m.def("aot_lane_hold(int key, Tensor plan, Tensor[] tensors) -> ()");
  m.def("aot_lane_run(int key, Tensor(a!)[] tensors) -> Tensor[]");
  m.def("aot_lanes_clear() -> ()");
  m.def("aot_lanes_held() -> int");
  m.def("aot_count_cpu_launches(bool enable) -> ()");
  m.def("aot_counted_launches() -> int");
  m.def("aot_use_driver_launch(bool enable) -> bool");
  m.def("aot_kernel_attributes(int kernel, int device) -> int[]");
  m.def("aot_cuda_info() -> (int, int, int, str)");
}

// CompositeExplicitAutograd: one kernel for every device, so a CPU tensor reaches our own checks
// (and their clear message) instead of the dispatcher's "no kernel for CPU"; ops without tensor
// arguments need it too.
STABLE_TORCH_LIBRARY_IMPL(flash_attn, CompositeExplicitAutograd, m) {
  m.impl("aot_register_kernel", &flash_attn_aot::boxed_register_kernel);
  m.impl("aot_launch", TORCH_BOX(&flash_attn_aot::aot_launch));
  m.impl("aot_run", TORCH_BOX(&flash_attn_aot::aot_run));
  m.impl("aot_lane_hold", TORCH_BOX(&flash_attn_aot::aot_lane_hold));
  m.impl("aot_lane_run", TORCH_BOX(&flash_attn_aot::aot_lane_run));
  m.impl("aot_lanes_clear", TORCH_BOX(&flash_attn_aot::aot_lanes_clear));
  m.impl("aot_lanes_held", TORCH_BOX(&flash_attn_aot::aot_lanes_held));
  m.impl("aot_count_cpu_launches", TORCH_BOX(&flash_attn_aot::aot_count_cpu_launches));
  m.impl("aot_counted_launches", TORCH_BOX(&flash_attn_aot::aot_counted_launches));
  m.impl("aot_use_driver_launch", TORCH_BOX(&flash_attn_aot::aot_use_driver_launch));
  m.impl("aot_kernel_attributes", TORCH_BOX(&flash_attn_aot::aot_kernel_attributes));
  m.impl("aot_cuda_info", TORCH_BOX(&flash_attn_aot::aot_cuda_info));
}

// Meta (fake tensors while tracing): the same checks, no launch.
STABLE_TORCH_LIBRARY_IMPL(flash_attn, Meta, m) {
  m.impl("aot_launch", TORCH_BOX(&flash_attn_aot::aot_launch_meta));
  m.impl("aot_run", TORCH_BOX(&flash_attn_aot::aot_run_meta));
}
