// The launcher of a build without CUDA (FLASH_ATTN_ENABLE_CUDA=OFF): the ops still register and
// check their arguments, and every attempt to reach a GPU says why it cannot.
#include "launcher.h"

namespace flash_attn_aot {

namespace {
const char* kReason = "this flash_attn build has no CUDA support (built with FLASH_ATTN_ENABLE_CUDA=OFF)";
}

const CudaInfo& cuda_info() {
  static const CudaInfo info = [] {
    CudaInfo out;
    out.error = kReason;
    return out;
  }();
  return info;
}

void require_cuda() {
  throw AotError(std::string("no CUDA device is available: ") + kReason);
}

void launch(int64_t, const KernelSpec&, PackedLaunch&) {
  require_cuda();
}

std::vector<int64_t> kernel_attributes(int64_t, const KernelSpec&, int) {
  require_cuda();
  return {};
}

}  // namespace flash_attn_aot
