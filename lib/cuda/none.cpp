// The CUDA backend of a build without nvcc: every factory says so.
#include "cuda/cuda.h"

namespace ms::cuda {

Flavor LinkedFlavor() {
  return Flavor::kNone;
}
Result<std::unique_ptr<device::Device>> MakeCudaDevice(int) {
  return Unavailable(
      "this megascale was built without nvcc, so it has no CUDA backend: install the CUDA toolkit and rebuild, or "
      "run the emulated backend with megascale-emu");
}
cudaStream_t NativeStream(device::Stream&) {
  return nullptr;
}
AllocatorStats GetAllocatorStats(device::Device&) {
  return {};
}
void ReleaseCachedMemory(device::Device&) {}
void* BackendStream(ops::Backend&) {
  return nullptr;
}
EpilogueStats GetEpilogueStats(ops::Backend&) {
  return {};
}
AttentionStats GetAttentionStats(ops::Backend&) {
  return {};
}
Status UseCudnnAttention(ops::Backend&) {
  return Unavailable("this megascale was built without nvcc, so it has no CUDA backend");
}
Status UseSplitDkDvAttention(ops::Backend&, bool) {
  return Unavailable("this megascale was built without nvcc, so it has no CUDA backend");
}
Status UseAttentionAutotune(ops::Backend&, bool) {
  return Unavailable("this megascale was built without nvcc, so it has no CUDA backend");
}
Result<std::unique_ptr<ops::Backend>> MakeCudaBackend(device::Device*, bool, Bf16Operands, int64_t) {
  return Unavailable("this megascale was built without nvcc, so it has no CUDA backend");
}

bool NcclAvailable() {
  return false;
}
Result<std::string> NewNcclUniqueId() {
  return Unavailable("this megascale was built without nvcc, so it has no NCCL");
}
Result<std::unique_ptr<comm::Communicator>> MakeNcclCommunicator(const std::string&, int, int, NcclOptions) {
  return Unavailable("this megascale was built without nvcc, so it has no NCCL");
}
std::function<void()> RegisterExternalStream(device::Device&, cudaStream_t) {
  return [] {};
}

}  // namespace ms::cuda
