// The flash_attn::aot_* operators: argument checks and packing on the LibTorch stable ABI.
//
// Only torch/csrc/stable and torch/headeronly headers, built with TORCH_TARGET_VERSION = 2.10, so
// the library's only torch symbols are the stable C shim (aoti_torch_*, torch_*) and it loads into
// any PyTorch >= 2.10, CPU or CUDA build, with or without a GPU. Schemas: see csrc/README.md.
#include <dlfcn.h>

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "kernel_spec.h"
#include "launcher.h"

namespace flash_attn_aot {
namespace {

using torch::stable::Tensor;

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
  bool has_global = false, has_profile = false;
  for (const auto& a : spec->args) {
    spec->num_tensors += a.kind == ArgKind::Pointer;
    spec->num_ints += a.kind == ArgKind::Int;
    spec->num_floats += a.kind == ArgKind::Float;
    has_global |= a.kind == ArgKind::GlobalScratch;
    has_profile |= a.kind == ArgKind::ProfileScratch;
  }
  if (config.global_scratch_bytes > 0 && !has_global) {
    throw AotError("global_scratch_bytes is " + std::to_string(config.global_scratch_bytes) +
                   " but the signature has no global_scratch entry");
  }
  if (config.profile_scratch_bytes > 0 && !has_profile) {
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

struct TensorFacts {
  int32_t device_type, device_index, dtype;
};

void check_int(const ArgSpec& a, int64_t v, size_t index) {
  int64_t lo = std::numeric_limits<int64_t>::min(), hi = std::numeric_limits<int64_t>::max();
  if (a.type == "i1" || a.type == "u1") lo = 0, hi = 1;
  else if (a.type == "i8") lo = -128, hi = 127;
  else if (a.type == "u8") lo = 0, hi = 255;
  else if (a.type == "i16") lo = -32768, hi = 32767;
  else if (a.type == "u16") lo = 0, hi = 65535;
  else if (a.type == "i32") lo = std::numeric_limits<int32_t>::min(), hi = std::numeric_limits<int32_t>::max();
  else if (a.type == "u32") lo = 0, hi = std::numeric_limits<uint32_t>::max();
  else if (a.type == "u64") lo = 0;
  if (v < lo || v > hi) {
    throw AotError("ints[" + std::to_string(index) + "] = " + std::to_string(v) + " does not fit the kernel's " +
                   a.type + " parameter (range " + std::to_string(lo) + " to " + std::to_string(hi) + ")");
  }
  if (a.divisor > 1 && v % a.divisor != 0) {
    throw AotError("ints[" + std::to_string(index) + "] = " + std::to_string(v) + " must be divisible by " +
                   std::to_string(a.divisor) + ": the kernel was compiled assuming it ('" + a.token + "')");
  }
}

// Checks everything and packs the parameter slots. With `meta_only` (fake/meta tensors, used when
// tracing), stops before anything that needs real memory or a GPU.
void check_and_launch(int64_t kernel_id, const std::vector<int64_t>& grid, const std::vector<Tensor>& tensors,
                      const std::vector<int64_t>& ints, const std::vector<double>& floats, bool meta_only) {
  const KernelSpec& spec = spec_for(kernel_id);
  const std::string kernel = "kernel '" + spec.kernel_name + "'";
  const LaunchConfig& c = spec.config;

  // Grid: 1 to 3 dims, each >= 0 and within CUDA's limits; a zero dim launches nothing.
  if (grid.empty() || grid.size() > 3) {
    throw AotError("grid must have 1, 2 or 3 entries, got " + std::to_string(grid.size()));
  }
  int64_t g[3] = {1, 1, 1};
  for (size_t i = 0; i < grid.size(); ++i) g[i] = grid[i];
  const int64_t limits[3] = {std::numeric_limits<int32_t>::max() / c.num_ctas, 65535, 65535};
  for (int i = 0; i < 3; ++i) {
    if (g[i] < 0 || g[i] > limits[i]) {
      throw AotError("grid[" + std::to_string(i) + "] = " + std::to_string(g[i]) + " is outside 0.." +
                     std::to_string(limits[i]) + (i == 0 && c.num_ctas > 1 ? " (num_ctas multiplies grid[0])" : ""));
    }
  }

  // Counts: the signature says how many of each kind, in which order.
  if (int(tensors.size()) != spec.num_tensors || int(ints.size()) != spec.num_ints ||
      int(floats.size()) != spec.num_floats) {
    throw AotError(kernel + " takes " + spec.describe() + "; got " + std::to_string(tensors.size()) + " tensors, " +
                   std::to_string(ints.size()) + " ints, " + std::to_string(floats.size()) + " floats");
  }

  // Tensors: defined, the signature's dtype, all on one device.
  std::vector<TensorFacts> facts(tensors.size());
  size_t t = 0;
  for (const ArgSpec& a : spec.args) {
    if (a.kind != ArgKind::Pointer) continue;
    const Tensor& x = tensors[t];
    if (!x.defined()) throw AotError("tensors[" + std::to_string(t) + "] ('" + a.token + "') is an undefined tensor");
    TensorFacts& f = facts[t];
    shim_check(aoti_torch_get_device_type(x.get(), &f.device_type), "aoti_torch_get_device_type");
    shim_check(aoti_torch_get_device_index(x.get(), &f.device_index), "aoti_torch_get_device_index");
    shim_check(aoti_torch_get_dtype(x.get(), &f.dtype), "aoti_torch_get_dtype");
    if (f.dtype != a.torch_dtype) {
      throw AotError("tensors[" + std::to_string(t) + "] has dtype " + dtype_name(f.dtype) + " but " + kernel +
                     " expects " + dtype_name(a.torch_dtype) + " ('" + a.token + "')");
    }
    if (t > 0 && (f.device_type != facts[0].device_type || f.device_index != facts[0].device_index)) {
      throw AotError("tensors[" + std::to_string(t) + "] is on " + device_name(f.device_type, f.device_index) +
                     " but tensors[0] is on " + device_name(facts[0].device_type, facts[0].device_index) +
                     "; all must be on the same CUDA device");
    }
    ++t;
  }
  if (tensors.empty()) throw AotError(kernel + " takes no tensor, so there is no device to launch it on");
  const bool no_data = meta_only || facts[0].device_type == aoti_torch_device_type_meta();

  // Pack: one 8-byte slot per kernel parameter, value in the parameter's C type.
  PackedLaunch launch;
  launch.device = facts[0].device_index;
  std::copy(g, g + 3, launch.grid);
  launch.slots.assign(spec.args.size(), 0);
  size_t ti = 0, ii = 0, fi = 0;
  int global_slot = -1, profile_slot = -1;
  for (size_t s = 0; s < spec.args.size(); ++s) {
    const ArgSpec& a = spec.args[s];
    switch (a.kind) {
      case ArgKind::Pointer: {
        const size_t index = ti++;
        if (no_data) break;
        const auto address = reinterpret_cast<uint64_t>(tensors[index].data_ptr());
        if (a.divisor > 1 && address % uint64_t(a.divisor) != 0) {
          char hex[32];
          std::snprintf(hex, sizeof hex, "0x%llx", static_cast<unsigned long long>(address));
          throw AotError("tensors[" + std::to_string(index) + "] data pointer " + hex + " is not " +
                         std::to_string(a.divisor) + "-byte aligned as " + kernel + " assumes ('" + a.token +
                         "'); pass a tensor whose storage offset keeps that alignment");
        }
        launch.slots[s] = address;
        break;
      }
      case ArgKind::Int: {
        const size_t index = ii++;
        check_int(a, ints[index], index);
        const int64_t v = ints[index];
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
        global_slot = int(s);
        break;
      case ArgKind::ProfileScratch:
        profile_slot = int(s);
        break;
    }
  }
  if (meta_only) return;
  // Last, the device: on a machine without a usable GPU, require_cuda() says why.
  if (facts[0].device_type != aoti_torch_device_type_cuda()) {
    require_cuda();
    throw AotError("the tensors are on " + device_name(facts[0].device_type, facts[0].device_index) + "; " + kernel +
                   " runs on CUDA tensors only");
  }
  if (g[0] == 0 || g[1] == 0 || g[2] == 0) return;
  const int64_t programs = g[0] * g[1] * g[2];  // < 2^63 within the grid limits

  // Triton's hidden scratch buffers: bytes per program (times the CTAs of a cluster), taken from
  // PyTorch's caching allocator on the launch device and current stream, so freeing them when this
  // function returns is ordered after the kernel.
  std::vector<Tensor> scratch;
  auto allocate = [&](int slot, int64_t bytes_per_program) {
    if (slot < 0 || bytes_per_program == 0) return;
    int64_t total = 0;
    if (__builtin_mul_overflow(programs, c.num_ctas * bytes_per_program, &total)) {
      throw AotError(kernel + ": the scratch buffer for a grid of " + std::to_string(programs) + " programs overflows");
    }
    scratch.push_back(torch::stable::new_empty(tensors[0], {total}, torch::headeronly::ScalarType::Byte));
    launch.slots[slot] = reinterpret_cast<uint64_t>(scratch.back().data_ptr());
  };
  allocate(global_slot, c.global_scratch_bytes);
  allocate(profile_slot, c.profile_scratch_bytes);

  launch.stream = current_cuda_stream(launch.device);
  flash_attn_aot::launch(kernel_id, spec, launch);
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

std::vector<int64_t> aot_kernel_attributes(int64_t kernel, int64_t device) {
  return with_op_name("aot_kernel_attributes", [&] {
    const KernelSpec& spec = spec_for(kernel);
    require_cuda();
    if (device < 0 || device >= cuda_info().device_count) {
      throw AotError("device " + std::to_string(device) + " does not exist (" +
                     std::to_string(cuda_info().device_count) + " CUDA devices are visible)");
    }
    return kernel_attributes(kernel, spec, int(device));
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
  m.def("aot_kernel_attributes(int kernel, int device) -> int[]");
  m.def("aot_cuda_info() -> (int, int, int, str)");
}

// CompositeExplicitAutograd: one kernel for every device, so a CPU tensor reaches our own checks
// (and their clear message) instead of the dispatcher's "no kernel for CPU"; ops without tensor
// arguments need it too.
STABLE_TORCH_LIBRARY_IMPL(flash_attn, CompositeExplicitAutograd, m) {
  m.impl("aot_register_kernel", &flash_attn_aot::boxed_register_kernel);
  m.impl("aot_launch", TORCH_BOX(&flash_attn_aot::aot_launch));
  m.impl("aot_kernel_attributes", TORCH_BOX(&flash_attn_aot::aot_kernel_attributes));
  m.impl("aot_cuda_info", TORCH_BOX(&flash_attn_aot::aot_cuda_info));
}

// Meta (fake tensors while tracing): the same checks, no launch.
STABLE_TORCH_LIBRARY_IMPL(flash_attn, Meta, m) {
  m.impl("aot_launch", TORCH_BOX(&flash_attn_aot::aot_launch_meta));
}
