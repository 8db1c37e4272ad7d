// PreflightCheck: what the driver (and `megascale validate`) checks before anything is launched,
// so that a mistake costs one message instead of one failure per rank after the launch.
#include "bootstrap/bootstrap.h"
#include "cuda/cuda.h"
#include "data/data.h"
#include "runner/driver.h"
#include "runner/runner.h"

namespace ms::runner {

Status PreflightCheck(const config::JobSpec& spec, bool files) {
  const int64_t world = config::WorldSize(spec.parallel);
  if (spec.runtime.backend == config::Backend::kCuda) {
    if (cuda::LinkedFlavor() == cuda::Flavor::kNone) {
      return Unavailable(
          "{}: runtime.backend: cuda, but this megascale was built without nvcc: install the CUDA toolkit and "
          "rebuild, use runtime.backend: cpu, or run the kernels on the emulator with megascale-emu",
          config::KeyLocation(spec, "runtime.backend"));
    }
    if (cuda::LinkedFlavor() == cuda::Flavor::kGpu && world > 1 && !cuda::NcclAvailable()) {
      return Unimplemented(
          "{}: runtime.backend: cuda with {} ranks needs NCCL process groups, and this megascale was built without "
          "NCCL; run one rank (tp=pp=dp=1), or the layout on the emulated CUDA backend with megascale-emu",
          config::KeyLocation(spec, "runtime.backend"), world);
    }
    if (cuda::LinkedFlavor() == cuda::Flavor::kGpu && world > 1 && spec.runtime.device_comm == "gloo") {
      return InvalidArgument(
          "{}: runtime.device_comm: gloo cannot move GPU memory; use auto or nccl (gloo is for megascale-emu, whose "
          "device memory is host memory)",
          config::KeyLocation(spec, "runtime.device_comm"));
    }
  }
  {
    const std::string& t = spec.data.tokenizer;
    if (t != "auto" && t != "byte" && t != "sentencepiece" && t.find('/') == std::string::npos &&
        !t.ends_with(".model")) {
      return InvalidArgument(
          "{}: data.tokenizer \"{}\": use auto (what the dataset was made with), byte, sentencepiece or the path of "
          "a SentencePiece .model file",
          config::KeyLocation(spec, "data.tokenizer"), t);
    }
  }
  if (!spec.runtime.redis.empty()) {
    auto ep = bootstrap::ParseRedisUrl(spec.runtime.redis);
    if (!ep.ok()) return ep.status().WithContext(config::KeyLocation(spec, "runtime.redis"));
  }
  // Inside a Slurm allocation: the driver runs once (in the batch script or the salloc shell) and
  // the layout must fit the allocation.
  MS_ASSIGN_OR_RETURN(auto alloc, cluster::ReadSlurmAllocation());
  if (alloc && alloc->in_task_step() && world > 1) {
    auto ntasks = GetEnv("SLURM_STEP_NUM_TASKS");
    return FailedPrecondition(
        "megascale train runs once per job and starts the ranks itself, but this process is a task of Slurm job "
        "step {}.{}{}: run it directly in the batch script (`exec megascale train job.yaml`) or the salloc shell, "
        "not under srun",
        alloc->job_id, alloc->step_id, ntasks ? fmt::format(" ({} tasks)", *ntasks) : std::string());
  }
  if (alloc && world > 1) MS_RETURN_IF_ERROR(FitSlurmAllocation(spec, *alloc).status());
  if (!files) return Status::Ok();
  MS_RETURN_IF_ERROR(config::CheckDataFiles(spec));
  auto tokenizer = data::LoadTokenizer(spec.data.tokenizer, spec.data.path);
  if (!tokenizer.ok()) {
    return tokenizer.status().WithContext(
        fmt::format("{}: data.tokenizer", config::KeyLocation(spec, "data.tokenizer")));
  }
  if ((*tokenizer)->vocab_size() > spec.model.vocab) {
    return InvalidArgument("{}: model.vocab: tokenizer '{}' has {} tokens but model.vocab is {}; set model.vocab >= {}",
                           config::KeyLocation(spec, "model.vocab"), (*tokenizer)->name(), (*tokenizer)->vocab_size(),
                           spec.model.vocab, (*tokenizer)->vocab_size());
  }
  auto ds = data::IndexedDataset::Open(spec.data.path);
  if (!ds.ok()) {
    return ds.status().WithContext(
        fmt::format("{}: opening dataset data.path={}", config::KeyLocation(spec, "data.path"), spec.data.path));
  }
  if (ds->max_token() >= spec.model.vocab) {
    return InvalidArgument(
        "{}: model.vocab: dataset {} holds token id {} but model.vocab is {}; raise model.vocab or re-tokenize",
        config::KeyLocation(spec, "model.vocab"), spec.data.path, ds->max_token(), spec.model.vocab);
  }
  return Status::Ok();
}

}  // namespace ms::runner
