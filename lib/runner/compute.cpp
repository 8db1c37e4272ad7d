// A rank's compute device and ops backend, and the peak its MFU is measured against (rank.h).
#include <sys/stat.h>

#include <cstdlib>

#include "cuda/cuda.h"
#include "metrics/metrics.h"
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
  // tp/pp/dp traffic of a multi-rank CUDA job goes through NCCL: libnccl on GPUs; in megascale-emu the emulated
  // NCCL (NCCL's stream semantics), unless runtime.device_comm: gloo keeps the Gloo groups there.
  const cuda::Flavor flavor = cuda::LinkedFlavor();
  const bool nccl = rt.world > 1 && (flavor == cuda::Flavor::kGpu ||
                                     (flavor == cuda::Flavor::kEmulated && spec.runtime.device_comm != "gloo"));
  if (nccl && (!rt.use_nccl || !cuda::NcclAvailable())) {
    return Unimplemented(
        "{}: runtime.backend: cuda with {} ranks needs NCCL process groups, and this megascale was built without "
        "NCCL; run one rank (tp=pp=dp=1){}",
        spec.source, rt.world,
        flavor == cuda::Flavor::kEmulated ? ", or runtime.device_comm: gloo"
                                          : ", or the layout on the emulated CUDA backend with megascale-emu");
  }
  if (!c.device) {
    auto dev = cuda::MakeCudaDevice(cuda::LinkedFlavor() == cuda::Flavor::kEmulated ? 0 : ordinal);
    if (!dev.ok()) return dev.status().WithContext("runtime.backend: cuda");
    c.device = std::move(dev).value();
  }
  const std::string& operands = spec.runtime.bf16_operands;
  const bool cublas_converts = operands == "cublas";
  MS_ASSIGN_OR_RETURN(c.backend,
                      cuda::MakeCudaBackend(c.device.get(), spec.train.precision == config::Precision::kBf16,
                                            cublas_converts      ? cuda::Bf16Operands::kCublas
                                            : operands == "cast" ? cuda::Bf16Operands::kCast
                                                                 : cuda::Bf16Operands::kKeep,
                                            spec.runtime.attention_stored_ds ? cuda::kAttentionDsMaxBytes : 0));
  if (spec.runtime.attention_split_dkdv) {
    MS_RETURN_IF_ERROR_CTX(cuda::UseSplitDkDvAttention(*c.backend, true), "{}", spec.source);
  }
  if (spec.runtime.attention_autotune) {
    MS_RETURN_IF_ERROR_CTX(cuda::UseAttentionAutotune(*c.backend, true), "{}", spec.source);
  }
  if (spec.runtime.attention_kernels == "cudnn") {
    MS_RETURN_IF_ERROR_CTX(cuda::UseCudnnAttention(*c.backend), "{}", spec.source);
  }
  LogInfo("compute: {} on {} (GEMMs {})", c.backend->name(), c.device->name(),
          !c.backend->bf16_gemm() ? "fp32"
          : cublas_converts       ? "bf16 inputs converted by cuBLAS (CUBLAS_COMPUTE_32F_FAST_16BF), fp32 accumulation"
          : c.backend->keeps_bf16_copies()
              ? "bf16 inputs, fp32 accumulation; bf16 weights cast once per step, layer inputs once per micro-batch"
              : "bf16 inputs cast at every GEMM, fp32 accumulation");
  if (nccl) {
    // Device buffers travel through NCCL, on streams ordered after the backend's (world_comm stays Gloo: it
    // carries host scalars).
    MS_RETURN_IF_ERROR_CTX(rt.use_nccl(rt, cuda::BackendStream(*c.backend), c.device.get()),
                           "creating the NCCL groups");
    LogInfo("tensor-, pipeline- and data-parallel communicators: {}",
            flavor == cuda::Flavor::kEmulated ? "the emulated NCCL" : "NCCL");
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

double DatasheetPeak(std::string_view name) {
  auto has = [&](std::string_view what) { return name.find(what) != std::string_view::npos; };
  if (has("B200")) return 2250e12;
  if (has("H200")) return 989e12;
  if (has("H100")) return has("PCIe") ? 756e12 : has("NVL") ? 835e12 : 989e12;
  if (has("A100")) return 312e12;
  return 0;
}

namespace {

std::string PeakCachePath(int threads) {
  std::string dir;
  if (auto x = GetEnv("XDG_CACHE_HOME"); x && !x->empty()) {
    dir = *x + "/megascale";
  } else if (auto home = GetEnv("HOME"); home && !home->empty()) {
    dir = *home + "/.cache/megascale";
  } else {
    return "";
  }
  return fmt::format("{}/gemm-peak-{}-t{}.txt", dir, HostName(), threads);
}

}  // namespace

Result<DevicePeak> ResolvePeak(const config::JobSpec& spec, const Compute& compute, int threads) {
  if (spec.log.peak_flops > 0) return DevicePeak{spec.log.peak_flops, "configured (log.peak_flops)"};
  if (compute.backend) {
    const std::string name = compute.device->name();
    const bool emulated = cuda::LinkedFlavor() == cuda::Flavor::kEmulated;
    if (!emulated) {
      if (const double sheet = DatasheetPeak(name); sheet > 0) {
        return DevicePeak{sheet, fmt::format("datasheet dense bf16 of {}", name)};
      }
    }
    MS_ASSIGN_OR_RETURN(double measured, MeasureBackendGemmPeak(*compute.backend, emulated ? 256 : 8192));
    return DevicePeak{measured,
                      compute.backend->bf16_gemm() ? "measured bf16 cuBLAS GEMM" : "measured fp32 cuBLAS GEMM"};
  }
  // The CPU: a calibration per host and thread count, measured once and reused.
  const std::string path = PeakCachePath(threads);
  if (!path.empty()) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && WallSeconds() - static_cast<double>(st.st_mtime) < 30 * 86400.0) {
      auto text = ReadFile(path);
      const double cached = text.ok() ? std::atof(text->c_str()) : 0;
      if (cached > 0) return DevicePeak{cached, fmt::format("fp32 GEMM calibration of this host ({})", path)};
    }
  }
  const double measured = metrics::MeasureGemmPeakFlops();
  if (!path.empty() && measured > 0) {
    const size_t slash = path.rfind('/');
    Status saved = MakeDirs(path.substr(0, slash));
    if (saved.ok()) saved = WriteFileAtomic(path, fmt::format("{:.6e}\n", measured));
    if (!saved.ok()) LogDebug("not caching the GEMM calibration: {}", saved.message());
  }
  return DevicePeak{measured, "measured fp32 GEMM (now cached for this host)"};
}

}  // namespace ms::runner
