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

}  // namespace ms::runner
