// What one ahead-of-time kernel is: its image, its entry point and the exact order and C types of
// its parameters. Everything here is plain C++ (no torch, no CUDA): the checks run without a GPU
// or driver (and are tested that way).
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

namespace flash_attn_aot {

// Every error this library raises: the boxed-kernel boundary turns it into a Python RuntimeError
// whose message is what() (the "flash_attn::<op>: " prefix is added by the op that failed).
struct AotError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

enum class ArgKind {
  Pointer,         // "*fp16", "*i32:16": the data pointer of the next tensor argument
  Int,             // "i32", "i64:16", "u8", "i1": the next value of the int list
  Float,           // "fp32", "fp64": the next value of the float list
  GlobalScratch,   // "global_scratch": Triton's hidden scratch pointer, supplied by the launcher
  ProfileScratch,  // "profile_scratch": Triton's hidden profiler pointer, supplied by the launcher
};

struct ArgSpec {
  ArgKind kind;
  std::string token;      // as written in the signature, e.g. "*fp16:16"
  std::string type;       // "fp16" for "*fp16", "i32" for "i32:16"
  int param_bytes = 0;    // size of the kernel parameter: 8 for pointers, 4 for i32/fp32, ...
  bool is_signed = true;  // ints only
  int64_t divisor = 1;    // ":N" suffix: pointer aligned to N bytes / int divisible by N
  int64_t min_value = 0, max_value = 0;  // ints only: the range of the C type (i1/u1: 0 to 1)
  int32_t torch_dtype = -1;  // pointers: the aoti_torch_dtype_* code the tensor must have
};

struct LaunchConfig {
  int64_t num_warps = 4;
  int64_t num_ctas = 1;  // Triton's cluster size along x (grid x is multiplied by it)
  int64_t shared_bytes = 0;
  int64_t global_scratch_bytes = 0;  // per program (per CTA); 0 = pass a null pointer
  int64_t global_scratch_align = 1;
  int64_t profile_scratch_bytes = 0;
  int64_t profile_scratch_align = 1;
  bool cooperative = false;  // Triton's launch_cooperative_grid
  bool pdl = false;          // Triton's launch_pdl (programmatic dependent launch)
};

struct LoadedKernel;  // the launcher's per-device state of one kernel (launcher_cuda.cpp)

struct KernelSpec {
  std::string image_path;
  std::string kernel_name;
  std::string signature_text;
  std::vector<uint8_t> image;  // the image's bytes (given, or read from image_path); PTX gets a trailing NUL
  bool image_is_ptx = false;
  std::vector<ArgSpec> args;
  int num_tensors = 0;
  int num_ints = 0;
  int num_floats = 0;
  std::vector<int32_t> pointer_dtypes;  // the torch dtype of each pointer parameter, in order
  int global_scratch_slot = -1;   // index in `args` of global_scratch; -1: none
  int profile_scratch_slot = -1;  // index in `args` of profile_scratch; -1: none
  LaunchConfig config;
  // Set by the launcher when the kernel is first loaded (lives as long as the process), so a launch
  // finds its per-device state without a lookup.
  mutable std::atomic<LoadedKernel*> loaded{nullptr};

  // "3 tensors, 1 int, 1 float (signature: *fp32, *fp32, *fp32, i32, fp32, global_scratch, ...)"
  std::string describe() const;
};

// Parses one comma-separated signature (whitespace ignored). Throws AotError naming the bad token.
// `dtype_code` maps a Triton pointee name ("fp16") to the tensor dtype code the pointer needs, or
// -1 when torch has no such dtype; it is a parameter so this file needs no torch header.
std::vector<ArgSpec> parse_signature(const std::string& text, int32_t (*dtype_code)(const std::string&));

// Checks the launch configuration numbers (warps, CTAs, shared memory, scratch).
void check_config(const LaunchConfig& config);

// Reads the image file (unless `spec.image` already holds the image's bytes, e.g. decompressed by
// the caller; `image_path` then only names it) and checks that it is a CUDA ELF (cubin) or PTX text that defines
// `kernel_name`, and, where the image records them (ELF .nv.info, PTX .param lines), that the
// entry's parameter count and sizes match `args`. Throws AotError with what is wrong.
void load_and_check_image(KernelSpec& spec);

}  // namespace flash_attn_aot
