// A rank's compute device and ops backend (rank.h).
#include "cuda/cuda.h"
#include "runner/rank.h"

namespace ms::runner {

Result<Compute> MakeCompute(const config::JobSpec& spec, Runtime& rt) {
  Compute c;
  bool use_cuda = spec.runtime.backend == config::Backend::kCuda;
  const int ordinal = DeviceOrdinal(rt);
  if (spec.runtime.backend == config::Backend::kAuto && cuda::LinkedFlavor() == cuda::Flavor::kGpu) {
    auto probe = cuda::MakeCudaDevice(ordinal);
    if (probe.ok()) {
      use_cuda = true;
      c.device = std::move(probe).value();
    } else {
      LogInfo("runtime.backend auto: no usable GPU ({}); using the CPU backend", probe.status().message());
    }
  }
  if (!use_cuda) {
    if (spec.train.precision == config::Precision::kBf16) {
      LogWarn("train.precision bf16 on the CPU backend: GEMMs run in fp32");
    }
    c.device = device::MakeCpuDevice();
    return c;
  }
  const bool nccl = cuda::LinkedFlavor() == cuda::Flavor::kGpu && rt.world > 1;
  if (nccl && !rt.use_nccl) {
    return Unimplemented(
        "{}: runtime.backend: cuda with {} ranks needs NCCL process groups, and this megascale was built without "
        "NCCL; run one rank (tp=pp=dp=1), or the layout on the emulated CUDA backend with megascale-emu",
        spec.source, rt.world);
  }
  if (!c.device) {
    auto dev = cuda::MakeCudaDevice(cuda::LinkedFlavor() == cuda::Flavor::kEmulated ? 0 : ordinal);
    if (!dev.ok()) return dev.status().WithContext("runtime.backend: cuda");
    c.device = std::move(dev).value();
  }
  MS_ASSIGN_OR_RETURN(c.backend,
                      cuda::MakeCudaBackend(c.device.get(), spec.train.precision == config::Precision::kBf16));
  LogInfo("compute: {} on {} (GEMMs {})", c.backend->name(), c.device->name(),
          c.backend->bf16_gemm() ? "bf16 inputs, fp32 accumulation" : "fp32");
  if (nccl) {
    // Device buffers travel through NCCL, on streams ordered after the backend's (world_comm stays Gloo: it
    // carries host scalars).
    MS_RETURN_IF_ERROR_CTX(rt.use_nccl(rt, cuda::BackendStream(*c.backend)), "creating the NCCL groups");
    LogInfo("tensor-, pipeline- and data-parallel communicators: NCCL");
  }
  return c;
}

// The best GEMM rate of a backend: three linear-layer forwards of an n x n x n problem (the backend's precision),
// each timed to completion. The MFU denominator when log.peak_flops is not set.
Result<double> MeasureBackendGemmPeak(ops::Backend& be, int64_t n) {
  const size_t bytes = sizeof(float) * static_cast<size_t>(n * n);
  device::Device* dev = be.device();
  MS_ASSIGN_OR_RETURN(device::Buffer a, device::Buffer::Allocate(dev, static_cast<size_t>(n * n)));
  MS_ASSIGN_OR_RETURN(device::Buffer w, device::Buffer::Allocate(dev, static_cast<size_t>(n * n)));
  MS_ASSIGN_OR_RETURN(device::Buffer out, device::Buffer::Allocate(dev, static_cast<size_t>(n * n)));
  MS_RETURN_IF_ERROR(be.Zero(a.data(), bytes));
  MS_RETURN_IF_ERROR(be.Zero(w.data(), bytes));
  double best = 0;
  for (int i = 0; i < 4; ++i) {
    const double t0 = NowSeconds();
    MS_RETURN_IF_ERROR(be.MatmulForward(out.f32(), a.f32(), w.f32(), nullptr, n, n, n));
    MS_RETURN_IF_ERROR(be.Synchronize());
    const double dt = NowSeconds() - t0;
    if (i > 0 && dt > 0) best = std::max(best, 2.0 * n * n * n / dt);  // the first call warms up
  }
  return best;
}

}  // namespace ms::runner
