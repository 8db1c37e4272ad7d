// Internal to the runner: what a rank process builds before its work (training or the
// self-check): its place in the job and its communicators (JoinJob), and its compute device and
// ops backend (MakeCompute).
#pragma once

#include <memory>

#include "config/config.h"
#include "core/core.h"
#include "device/device.h"
#include "ops/ops.h"
#include "runner/runner.h"

namespace ms::runner {

// A worker's place in a multi-rank job: reads its rank and the store from the environment the
// driver set (MEGASCALE_RANK, MEGASCALE_STORE_URL, MEGASCALE_JOB_ID, MEGASCALE_ATTEMPT, ...),
// rendezvous, builds the process groups (Gloo; NCCL later through Runtime::use_nccl), the
// checkpoint coordinator and the progress board. `worker_start` (WallSeconds()) is the first
// start-up milestone.
Result<std::unique_ptr<Runtime>> JoinJob(const config::JobSpec& spec, double worker_start);

// The device and ops backend of a rank: runtime.backend cpu, cuda (the linked flavor: a GPU, or the
// emulator in megascale-emu), or auto (cuda when this binary drives GPUs and one is present, else cpu).
struct Compute {
  std::unique_ptr<device::Device> device;
  std::unique_ptr<ops::Backend> backend;  // null: the model's own CPU backend
};
// May swap rt's tensor-, pipeline- and data-parallel communicators for NCCL ones (CUDA on GPUs).
Result<Compute> MakeCompute(const config::JobSpec& spec, Runtime& rt);

// The best GEMM rate of a backend: three linear-layer forwards of an n x n x n problem (the
// backend's precision), each timed to completion, in FLOP/s.
Result<double> MeasureBackendGemmPeak(ops::Backend& be, int64_t n);

// The peak FLOP/s of one device that MFU is measured against, and where it came from:
//   log.peak_flops when set ("configured");
//   a GPU: the datasheet dense bf16 tensor-core figure of its model (DatasheetPeak), else a measured cuBLAS GEMM;
//   the CPU: a measured fp32 GEMM with this rank's threads, cached per host and thread count for 30 days in
//   $XDG_CACHE_HOME/megascale (else ~/.cache/megascale) as gemm-peak-<host>-t<threads>.txt, so that every run
//   and every bench point of a host divides by the same figure (delete the file to measure again).
struct DevicePeak {
  double flops = 0;
  std::string source;
};
Result<DevicePeak> ResolvePeak(const config::JobSpec& spec, const Compute& compute, int threads);
// Dense bf16 FLOP/s of a GPU model from its datasheet, by the device's name ("NVIDIA H100 80GB HBM3"): A100 312 T,
// H100 SXM 989 T (PCIe 756 T, NVL 835 T), H200 and GH200 989 T, B200 2250 T; 0 when unknown.
double DatasheetPeak(std::string_view device_name);

}  // namespace ms::runner
