// Signature parsing and image checks: everything about a kernel that can be verified without a GPU.
#include "kernel_spec.h"

#include <cctype>
#include <cstring>
#include <fstream>
#include <iterator>
#include <limits>
#include <sstream>

namespace flash_attn_aot {
namespace {

std::string trim(const std::string& s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return s.substr(b, e - b);
}

struct ScalarInfo {
  const char* name;
  ArgKind kind;
  int bytes;
  bool is_signed;
  int64_t min_value = 0, max_value = 0;  // ints: the values the parameter's C type holds
};

template <typename T>
constexpr ScalarInfo int_type(const char* name) {
  return {name, ArgKind::Int, int(sizeof(T)), std::numeric_limits<T>::is_signed,
          int64_t(std::numeric_limits<T>::min()),
          // u64: the ints arrive as int64
          uint64_t(std::numeric_limits<T>::max()) > uint64_t(std::numeric_limits<int64_t>::max())
              ? std::numeric_limits<int64_t>::max()
              : int64_t(std::numeric_limits<T>::max())};
}

// Triton's scalar parameter types and the size each has in the kernel's parameter list (read off
// the PTX Triton emits: i1/u1 are .u8 params). fp16/bf16 scalars are not supported: Triton passes
// them as 16-bit floats and our kernels take fp32 scalars.
constexpr ScalarInfo kScalars[] = {
    {"i1", ArgKind::Int, 1, false, 0, 1}, {"u1", ArgKind::Int, 1, false, 0, 1},
    int_type<int8_t>("i8"),               int_type<uint8_t>("u8"),
    int_type<int16_t>("i16"),             int_type<uint16_t>("u16"),
    int_type<int32_t>("i32"),             int_type<uint32_t>("u32"),
    int_type<int64_t>("i64"),             int_type<uint64_t>("u64"),
    {"fp32", ArgKind::Float, 4, true},    {"f32", ArgKind::Float, 4, true},
    {"fp64", ArgKind::Float, 8, true},
};

int64_t parse_divisor(const std::string& token, const std::string& digits) {
  if (digits.empty() || digits.size() > 6 ||
      digits.find_first_not_of("0123456789") != std::string::npos) {
    throw AotError("signature token '" + token + "': the part after ':' must be a positive integer");
  }
  int64_t d = std::stoll(digits);
  if (d <= 0 || (d & (d - 1)) != 0) {
    throw AotError("signature token '" + token + "': the divisor after ':' must be a power of two, got " + digits);
  }
  return d;
}

}  // namespace

std::vector<ArgSpec> parse_signature(const std::string& text, int32_t (*dtype_code)(const std::string&)) {
  std::vector<ArgSpec> out;
  std::stringstream ss(text);
  std::string raw;
  bool seen_hidden = false;
  while (std::getline(ss, raw, ',')) {
    const std::string token = trim(raw);
    if (token.empty()) {
      throw AotError("signature '" + text + "' has an empty entry (expected comma-separated types)");
    }
    ArgSpec a;
    a.token = token;
    std::string base = token;
    const size_t colon = token.find(':');
    if (colon != std::string::npos) {
      base = token.substr(0, colon);
      a.divisor = parse_divisor(token, token.substr(colon + 1));
    }
    if (base == "global_scratch" || base == "profile_scratch") {
      if (colon != std::string::npos) throw AotError("signature token '" + token + "' takes no ':' suffix");
      a.kind = base == "global_scratch" ? ArgKind::GlobalScratch : ArgKind::ProfileScratch;
      a.type = base;
      a.param_bytes = 8;
      seen_hidden = true;
    } else if (!base.empty() && base[0] == '*') {
      if (seen_hidden) {
        throw AotError("signature token '" + token + "' comes after a hidden scratch argument; "
                       "global_scratch and profile_scratch must be the last entries");
      }
      a.kind = ArgKind::Pointer;
      a.type = base.substr(1);
      a.param_bytes = 8;
      a.torch_dtype = dtype_code(a.type);
      if (a.torch_dtype < 0) {
        throw AotError("signature token '" + token + "': unknown pointee type '" + a.type +
                       "' (expected one of fp16, bf16, fp32, fp64, i8, i16, i32, i64, u8, u16, u32, u64, i1, "
                       "fp8e4nv, fp8e5, fp8e4b8, fp8e5b16)");
      }
    } else {
      const ScalarInfo* info = nullptr;
      for (const auto& s : kScalars) {
        if (base == s.name) info = &s;
      }
      if (info == nullptr) {
        if (base == "constexpr") {
          throw AotError("signature token 'constexpr': constexpr arguments are compiled into the kernel and "
                         "must be removed from the runtime signature");
        }
        throw AotError("signature token '" + token + "' is not a supported type (expected '*<dtype>' for a "
                       "tensor, i1/i8/i16/i32/i64/u1/u8/u16/u32/u64 for an int, fp32/fp64 for a float, or "
                       "global_scratch/profile_scratch)");
      }
      if (seen_hidden) {
        throw AotError("signature token '" + token + "' comes after a hidden scratch argument; "
                       "global_scratch and profile_scratch must be the last entries");
      }
      if (info->kind == ArgKind::Float && colon != std::string::npos) {
        throw AotError("signature token '" + token + "': a float takes no ':' divisibility suffix");
      }
      a.kind = info->kind;
      a.type = info->name;
      a.param_bytes = info->bytes;
      a.is_signed = info->is_signed;
      a.min_value = info->min_value;
      a.max_value = info->max_value;
    }
    out.push_back(a);
  }
  if (!text.empty() && trim(text).back() == ',') {
    throw AotError("signature '" + text + "' ends with a comma");
  }
  int n_global = 0, n_profile = 0;
  for (const auto& a : out) {
    n_global += a.kind == ArgKind::GlobalScratch;
    n_profile += a.kind == ArgKind::ProfileScratch;
  }
  if (n_global > 1 || n_profile > 1) {
    throw AotError("signature '" + text + "' names global_scratch or profile_scratch more than once");
  }
  return out;
}

void check_config(const LaunchConfig& c) {
  auto fail = [](const std::string& m) { throw AotError(m); };
  // any count up to 1024 threads: a warp-specialised image has its partitions' warps on top of
  // the num_warps it was compiled with (4 + 2 x 4 for the forward's producer and two consumers)
  if (c.num_warps < 1 || c.num_warps > 32) {
    fail("num_warps must be between 1 and 32, got " + std::to_string(c.num_warps));
  }
  if (c.num_ctas < 1 || c.num_ctas > 16) {
    fail("num_ctas must be between 1 and 16, got " + std::to_string(c.num_ctas));
  }
  if (c.shared_bytes < 0 || c.shared_bytes > (1 << 20)) {
    fail("shared_bytes must be between 0 and 1 MiB, got " + std::to_string(c.shared_bytes));
  }
  const int64_t max_scratch = int64_t(1) << 32;
  if (c.global_scratch_bytes < 0 || c.global_scratch_bytes > max_scratch) {
    fail("global_scratch_bytes must be between 0 and 4 GiB, got " + std::to_string(c.global_scratch_bytes));
  }
  if (c.profile_scratch_bytes < 0 || c.profile_scratch_bytes > max_scratch) {
    fail("profile_scratch_bytes must be between 0 and 4 GiB, got " + std::to_string(c.profile_scratch_bytes));
  }
  for (int64_t align : {c.global_scratch_align, c.profile_scratch_align}) {
    // PyTorch's caching allocator hands out 512-byte aligned blocks.
    if (align < 1 || align > 512 || (align & (align - 1)) != 0) {
      fail("scratch alignment must be a power of two between 1 and 512, got " + std::to_string(align));
    }
  }
}

std::string KernelSpec::describe() const {
  auto plural = [](int n, const char* word) {
    return std::to_string(n) + " " + word + (n == 1 ? "" : "s");
  };
  std::string sig;
  for (size_t i = 0; i < args.size(); ++i) sig += (i ? ", " : "") + args[i].token;
  return plural(num_tensors, "tensor") + ", " + plural(num_ints, "int") + ", " + plural(num_floats, "float") +
         " (signature: " + sig + ")";
}

// ---------------------------------------------------------------------------------------------
// Image checks. A cubin is a 64-bit little-endian ELF file (e_machine 190, EM_CUDA); its symbol
// table names the entry points and the section ".nv.info.<kernel>" holds one EIATTR_KPARAM_INFO
// record per parameter (ordinal, offset, size) and EIATTR_REQNTID (the block size the kernel was
// compiled for). PTX is text: ".entry <name>(" followed by ".param" lines and ".reqntid".
// ---------------------------------------------------------------------------------------------
namespace {

constexpr uint16_t kEmCuda = 190;
constexpr uint8_t kEiattrKparamInfo = 0x17;
constexpr uint8_t kEiattrReqntid = 0x10;

template <typename T>
T read_at(const std::vector<uint8_t>& d, uint64_t off, const std::string& what) {
  if (off > d.size() || d.size() - off < sizeof(T)) throw AotError("truncated ELF file (" + what + ")");
  T v;
  std::memcpy(&v, d.data() + off, sizeof(T));
  return v;
}

struct Section {
  std::string name;
  uint32_t type;
  uint64_t offset, size;
  uint32_t link;
  uint64_t entsize;
};

struct EntryFacts {
  bool found = false;
  std::vector<int> param_sizes;  // by ordinal; empty when the image does not record them
  int reqntid = 0;               // 0 when not recorded
  std::vector<std::string> entries;
};

std::string c_string(const std::vector<uint8_t>& d, uint64_t off) {
  std::string s;
  while (off < d.size() && d[off] != 0) s.push_back(static_cast<char>(d[off++]));
  return s;
}

EntryFacts inspect_elf(const std::vector<uint8_t>& d, const std::string& kernel) {
  EntryFacts f;
  if (d.size() < 64 || d[4] != 2 || d[5] != 1) throw AotError("not a 64-bit little-endian ELF file");
  if (read_at<uint16_t>(d, 18, "e_machine") != kEmCuda) {
    throw AotError("ELF file is not a CUDA cubin (e_machine is not EM_CUDA)");
  }
  const uint64_t shoff = read_at<uint64_t>(d, 0x28, "e_shoff");
  const uint16_t shentsize = read_at<uint16_t>(d, 0x3a, "e_shentsize");
  const uint16_t shnum = read_at<uint16_t>(d, 0x3c, "e_shnum");
  const uint16_t shstrndx = read_at<uint16_t>(d, 0x3e, "e_shstrndx");
  if (shentsize < 64 || shstrndx >= shnum) throw AotError("malformed ELF section table");
  std::vector<Section> secs(shnum);
  std::vector<uint32_t> name_offsets(shnum);
  for (uint16_t i = 0; i < shnum; ++i) {
    const uint64_t h = shoff + uint64_t(i) * shentsize;
    name_offsets[i] = read_at<uint32_t>(d, h, "section header");
    secs[i].type = read_at<uint32_t>(d, h + 4, "section header");
    secs[i].offset = read_at<uint64_t>(d, h + 24, "section header");
    secs[i].size = read_at<uint64_t>(d, h + 32, "section header");
    secs[i].link = read_at<uint32_t>(d, h + 40, "section header");
    secs[i].entsize = read_at<uint64_t>(d, h + 56, "section header");
    if (secs[i].type != 8 /* SHT_NOBITS */ &&
        (secs[i].offset > d.size() || d.size() - secs[i].offset < secs[i].size)) {
      throw AotError("truncated ELF file (section data)");
    }
  }
  for (uint16_t i = 0; i < shnum; ++i) secs[i].name = c_string(d, secs[shstrndx].offset + name_offsets[i]);

  for (const auto& s : secs) {
    if (s.type != 2 /* SHT_SYMTAB */ || s.entsize < 24 || s.link >= shnum) continue;
    const Section& strtab = secs[s.link];
    for (uint64_t off = s.offset; off + 24 <= s.offset + s.size; off += s.entsize) {
      const uint32_t st_name = read_at<uint32_t>(d, off, "symbol");
      const uint8_t st_info = d[off + 4];
      const uint8_t st_other = d[off + 5];
      // Kernel entry points are global functions marked STO_CUDA_ENTRY (0x10) in st_other.
      if ((st_info & 0xf) != 2 /* STT_FUNC */ || (st_other & 0x10) == 0) continue;
      const std::string name = c_string(d, strtab.offset + st_name);
      f.entries.push_back(name);
      if (name == kernel) f.found = true;
    }
  }
  if (!f.found) return f;

  for (const auto& s : secs) {
    if (s.name != ".nv.info." + kernel) continue;
    std::vector<std::pair<int, int>> params;  // (ordinal, size)
    uint64_t p = s.offset;
    const uint64_t end = s.offset + s.size;
    while (p + 4 <= end) {
      const uint8_t fmt = d[p];
      const uint8_t attr = d[p + 1];
      if (fmt == 4) {  // EIFMT_SVAL: u16 size, then the payload
        const uint16_t sz = read_at<uint16_t>(d, p + 2, ".nv.info");
        const uint64_t payload = p + 4;
        if (payload + sz > end) throw AotError("truncated .nv.info section");
        if (attr == kEiattrKparamInfo && sz >= 12) {
          const uint16_t ordinal = read_at<uint16_t>(d, payload + 4, ".nv.info");
          const uint32_t bits = read_at<uint32_t>(d, payload + 8, ".nv.info");
          params.emplace_back(ordinal, int((bits >> 18) & 0x3fff));
        } else if (attr == kEiattrReqntid && sz >= 4) {
          f.reqntid = int(read_at<uint32_t>(d, payload, ".nv.info"));
        }
        p = payload + sz;
      } else {  // EIFMT_NVAL / BVAL / HVAL: the value fits in the 4-byte record
        p += 4;
      }
    }
    if (!params.empty()) {
      f.param_sizes.assign(params.size(), -1);
      for (const auto& [ordinal, size] : params) {
        if (ordinal < 0 || size_t(ordinal) >= params.size()) throw AotError("malformed EIATTR_KPARAM_INFO");
        f.param_sizes[ordinal] = size;
      }
    }
  }
  return f;
}

int ptx_param_bytes(const std::string& decl) {
  // ".param .u64 .ptr .global .align 1 name" / ".param .f32 name" / ".param .align 8 .b8 name[16]"
  const size_t lb = decl.find('[');
  if (lb != std::string::npos) return std::atoi(decl.c_str() + lb + 1);
  static const std::pair<const char*, int> kTypes[] = {
      {".u64", 8}, {".s64", 8}, {".b64", 8}, {".f64", 8}, {".u32", 4}, {".s32", 4}, {".b32", 4}, {".f32", 4},
      {".u16", 2}, {".s16", 2}, {".b16", 2}, {".f16", 2}, {".u8", 1},  {".s8", 1},  {".b8", 1},
  };
  for (const auto& [name, bytes] : kTypes) {
    const size_t at = decl.find(name);
    if (at != std::string::npos) {
      const char next = at + std::strlen(name) < decl.size() ? decl[at + std::strlen(name)] : ' ';
      if (std::isspace(static_cast<unsigned char>(next))) return bytes;
    }
  }
  return -1;
}

EntryFacts inspect_ptx(const std::string& text, const std::string& kernel) {
  EntryFacts f;
  size_t pos = 0;
  while ((pos = text.find(".entry", pos)) != std::string::npos) {
    size_t p = pos + 6;
    while (p < text.size() && std::isspace(static_cast<unsigned char>(text[p]))) ++p;
    size_t q = p;
    while (q < text.size() && (std::isalnum(static_cast<unsigned char>(text[q])) || text[q] == '_' || text[q] == '$')) ++q;
    const std::string name = text.substr(p, q - p);
    pos = q;
    if (name.empty()) continue;
    f.entries.push_back(name);
    if (name != kernel) continue;
    f.found = true;
    const size_t open = text.find('(', q);
    const size_t close = text.find(')', q);
    if (open == std::string::npos || close == std::string::npos || close < open) throw AotError("malformed .entry in PTX");
    std::stringstream params(text.substr(open + 1, close - open - 1));
    std::string decl;
    while (std::getline(params, decl, ',')) {
      if (trim(decl).empty()) continue;
      const int bytes = ptx_param_bytes(" " + trim(decl) + " ");
      if (bytes < 0) throw AotError("cannot read the PTX parameter declaration '" + trim(decl) + "'");
      f.param_sizes.push_back(bytes);
    }
    const size_t body = text.find('{', close);
    const size_t req = text.find(".reqntid", close);
    if (req != std::string::npos && (body == std::string::npos || req < body)) {
      f.reqntid = std::atoi(text.c_str() + req + 8);
    }
  }
  return f;
}

}  // namespace

void load_and_check_image(KernelSpec& spec) {
  const std::string where = "image '" + spec.image_path + "'";
  if (spec.image.empty()) {
    std::ifstream file(spec.image_path, std::ios::binary);
    if (!file) {
      throw AotError(where + " cannot be read (" + std::string(std::strerror(errno)) + ")");
    }
    spec.image.assign(std::istreambuf_iterator<char>(file), std::istreambuf_iterator<char>());
    if (file.bad()) throw AotError(where + " cannot be read (I/O error)");
    if (spec.image.empty()) throw AotError(where + " is empty");
  }

  EntryFacts facts;
  const bool is_elf = spec.image.size() >= 4 && spec.image[0] == 0x7f && spec.image[1] == 'E' &&
                      spec.image[2] == 'L' && spec.image[3] == 'F';
  try {
    if (is_elf) {
      spec.image_is_ptx = false;
      facts = inspect_elf(spec.image, spec.kernel_name);
    } else {
      const std::string text(spec.image.begin(), spec.image.end());
      if (text.find(".version") == std::string::npos || text.find(".target") == std::string::npos) {
        throw AotError("neither a cubin (ELF) nor PTX text (no .version/.target directive)");
      }
      spec.image_is_ptx = true;
      facts = inspect_ptx(text, spec.kernel_name);
      spec.image.push_back(0);  // the CUDA loader wants NUL-terminated PTX
    }
  } catch (const AotError& e) {
    throw AotError(where + ": " + e.what());
  }
  if (!facts.found) {
    std::string names;
    for (const auto& n : facts.entries) names += (names.empty() ? "" : ", ") + n;
    throw AotError(where + " has no kernel entry point named '" + spec.kernel_name + "' (entry points: " +
                   (names.empty() ? "none" : names) + ")");
  }
  if (!facts.param_sizes.empty()) {
    std::string expected, found;
    for (const auto& a : spec.args) expected += (expected.empty() ? "" : ", ") + std::to_string(a.param_bytes);
    for (int s : facts.param_sizes) found += (found.empty() ? "" : ", ") + std::to_string(s);
    bool same = facts.param_sizes.size() == spec.args.size();
    for (size_t i = 0; same && i < spec.args.size(); ++i) same = facts.param_sizes[i] == spec.args[i].param_bytes;
    if (!same) {
      throw AotError(where + ": kernel '" + spec.kernel_name + "' takes " + std::to_string(facts.param_sizes.size()) +
                     " parameters of sizes [" + found + "] bytes but the signature '" + spec.signature_text +
                     "' describes " + std::to_string(spec.args.size()) + " of sizes [" + expected +
                     "] (did the manifest drop a constexpr-specialized argument or the trailing "
                     "global_scratch/profile_scratch pointers?)");
    }
  }
  if (facts.reqntid > 0 && facts.reqntid != spec.config.num_warps * 32) {
    throw AotError(where + ": kernel '" + spec.kernel_name + "' was compiled for " + std::to_string(facts.reqntid) +
                   " threads per block but num_warps=" + std::to_string(spec.config.num_warps) + " gives " +
                   std::to_string(spec.config.num_warps * 32));
  }
}

}  // namespace flash_attn_aot
