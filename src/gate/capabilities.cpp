// cpuid / xgetbv detection. A flag is reported usable only when the OS enables the register
// state it needs (XCR0: YMM for AVX-class, opmask+ZMM for AVX-512, tile state for AMX), so a
// kernel compiled for it cannot fault with #UD.
#include "gate/capabilities.h"

#include <hwy/targets.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "kernels/cpu/cpu_kernels.h"
#include "kernels/cuda/cuda_device.h"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif
#define PTLLM_X86 1
#endif

namespace ptllm {
namespace {

const char* const kFlagNames[] = {"f16c",        "fma",         "avx",      "avx2",
                                  "avx512f",     "avx512dq",    "avx512bw", "avx512vl",
                                  "avx512_bf16", "avx512_fp16", "avx_vnni", "avx512_vnni",
                                  "amx_tile",    "amx_bf16",    "amx_int8"};

#ifdef PTLLM_X86
struct Regs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};

Regs cpuid(unsigned leaf, unsigned sub) {
  Regs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = Regs{};
  return r;
}

bool bit(unsigned v, int i) {
  return (v >> i) & 1u;
}

uint64_t xgetbv0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (uint64_t(hi) << 32) | lo;
}

std::string brandString() {
  if (cpuid(0x80000000u, 0).a < 0x80000004u) return "unknown x86 CPU";
  char s[49] = {};
  for (unsigned i = 0; i < 3; ++i) {
    Regs r = cpuid(0x80000002u + i, 0);
    std::memcpy(s + 16 * i, &r, 16);
  }
  std::string out(s);
  out.erase(0, out.find_first_not_of(' '));
  out.erase(out.find_last_not_of(' ') + 1);
  return out.empty() ? "unknown x86 CPU" : out;
}

// Linux hands out the AMX tile-data state only on request (arch_prctl ARCH_REQ_XCOMP_PERM).
bool requestAmxPermission() {
#if defined(__linux__) && defined(__x86_64__)
  constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
#else
  return false;
#endif
}

void detectX86(std::map<std::string, bool>& f) {
  const unsigned maxLeaf = cpuid(0, 0).a;
  const Regs l1 = cpuid(1, 0);
  const Regs l7 = maxLeaf >= 7 ? cpuid(7, 0) : Regs{};
  const Regs l7s1 = (maxLeaf >= 7 && l7.a >= 1) ? cpuid(7, 1) : Regs{};

  const uint64_t xcr0 = bit(l1.c, 27) ? xgetbv0() : 0;   // OSXSAVE
  const bool osAvx = (xcr0 & 0x6) == 0x6;                // SSE + YMM state
  const bool osAvx512 = osAvx && (xcr0 & 0xE0) == 0xE0;  // opmask, ZMM_Hi256, Hi16_ZMM
  const bool osAmx = (xcr0 & 0x60000) == 0x60000;        // XTILECFG + XTILEDATA

  f["avx"] = osAvx && bit(l1.c, 28);
  f["fma"] = osAvx && bit(l1.c, 12);
  f["f16c"] = osAvx && bit(l1.c, 29);
  f["avx2"] = osAvx && bit(l7.b, 5);
  f["avx_vnni"] = osAvx && bit(l7s1.a, 4);
  f["avx512f"] = osAvx512 && bit(l7.b, 16);
  f["avx512dq"] = f["avx512f"] && bit(l7.b, 17);
  f["avx512bw"] = f["avx512f"] && bit(l7.b, 30);
  f["avx512vl"] = f["avx512f"] && bit(l7.b, 31);
  f["avx512_vnni"] = f["avx512f"] && bit(l7.c, 11);
  f["avx512_bf16"] = f["avx512f"] && bit(l7s1.a, 5);
  f["avx512_fp16"] = f["avx512f"] && bit(l7.d, 23);
  const bool amx = osAmx && bit(l7.d, 24) && requestAmxPermission();
  f["amx_tile"] = amx;
  f["amx_bf16"] = amx && bit(l7.d, 22);
  f["amx_int8"] = amx && bit(l7.d, 25);
}
#endif

Capabilities detect() {
  Capabilities c;
  for (const char* n : kFlagNames) c.flags[n] = false;
#ifdef PTLLM_X86
  c.cpuModel = brandString();
  detectX86(c.flags);
#else
  c.cpuModel = "non-x86 CPU";
#endif
  // SupportedTargets(): bit set per target this CPU can run; lower bits are better targets.
  const int64_t targets = hwy::SupportedTargets();
  for (int i = 0; i < 63; ++i) {
    const int64_t t = int64_t(1) << i;
    if (targets & t) c.hwyTargets.emplace_back(hwy::TargetName(t));
  }
  c.dispatchedTarget = cpu::simdTargetName();
  // The GPU (device 0), when this binary has the CUDA backend and the machine a usable GPU.
  const CudaDeviceInfo& gpu = cudaDeviceInfo();
  c.gpu = gpu.summary();
  c.gpuJson = gpu.toJson();
  c.flags["cuda"] = gpu.available;
  c.flags["cuda_tensor_cores"] = gpu.available && gpu.tensorCoresF16;
  c.flags["cuda_fp8"] = gpu.available && gpu.fp8;
  c.flags["cuda_wgmma"] = gpu.available && gpu.wgmma;
  return c;
}

}  // namespace

bool Capabilities::has(const std::string& name) const {
  auto it = flags.find(name);
  return it != flags.end() && it->second;
}

Capabilities Capabilities::withOut(const std::string& name) const {
  Capabilities c = *this;
  c.flags[name] = false;
  return c;
}

std::vector<std::string> Capabilities::missing(const std::vector<std::string>& required) const {
  std::vector<std::string> out;
  for (const auto& r : required)
    if (!has(r)) out.push_back(r);
  return out;
}

nlohmann::json Capabilities::toJson() const {
  nlohmann::json j;
  j["cpu_model"] = cpuModel;
  j["hwy_targets"] = hwyTargets;
  j["hwy_dispatched"] = dispatchedTarget;
  j["flags"] = flags;
  j["gpu"] = gpuJson;
  return j;
}

const Capabilities& detectCapabilities() {
  static const Capabilities caps = detect();
  return caps;
}

}  // namespace ptllm
