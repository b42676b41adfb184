// Fake CUDA for a CPU-only torch build (test support only; see tests/fakecuda/__init__.py).
//
// A CPU-only build registers neither a CUDA device guard nor CUDA hooks, so a tensor that merely
// *claims* device cuda:0 (a FakeTensor, or the CPU-backed wrapper in tests/fakecuda/wrapper.py)
// cannot pass through the dispatcher's device guards, pinned memory or generator queries. This
// library fills both holes when loaded before `import torch`: c10's own FakeGuardImpl for CUDA,
// and CUDA hooks that say "built, available, one device" and hand out CPU resources. It computes
// nothing on any GPU; every kernel still runs on the CPU.
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/FakeGuardImpl.h>

namespace c10::impl {
C10_REGISTER_GUARD_IMPL(CUDA, FakeGuardImpl<DeviceType::CUDA>);
}  // namespace c10::impl

namespace at {
namespace {

struct FakeCUDAHooks final : public CUDAHooksInterface {
  explicit FakeCUDAHooks(CUDAHooksArgs) {}
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasCUDA() const override { return true; }
  bool hasCUDART() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex current_device() const override { return 0; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  void setCurrentDevice(DeviceIndex) const override {}
  DeviceIndex exchangeDevice(DeviceIndex) const override { return 0; }
  DeviceIndex maybeExchangeDevice(DeviceIndex) const override { return 0; }
  bool isPinnedPtr(const void*) const override { return false; }
  Allocator* getPinnedMemoryAllocator() const override { return c10::GetCPUAllocator(); }
  Allocator* getCUDADeviceAllocator() const override { return c10::GetCPUAllocator(); }
  Device getDeviceFromPtr(void*) const override { return Device(DeviceType::CUDA, 0); }
  const Generator& getDefaultGenerator(DeviceIndex) const override {
    static Generator generator = detail::createCPUGenerator(default_rng_seed_val);
    return generator;
  }
  Generator getNewGenerator(DeviceIndex) const override {
    return detail::createCPUGenerator(default_rng_seed_val);
  }
  void deviceSynchronize(DeviceIndex) const override {}
  std::string showConfig() const override { return "fake CUDA (tests/fakecuda): CPU kernels\n"; }
};

}  // namespace
// getCUDAHooks() asks the registry for the name "CUDAHooks" (what libtorch_cuda registers).
C10_REGISTER_CLASS(CUDAHooksRegistry, CUDAHooks, FakeCUDAHooks);
}  // namespace at

extern "C" int gptbook_fake_cuda_loaded() { return 1; }
