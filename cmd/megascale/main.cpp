// megascale: one binary, one subcommand per file in this folder.
#include <cstdio>
#include <string>
#include <vector>

#include "cmd/megascale/commands.h"
#include "core/core.h"
#include "cuda/cuda.h"

namespace ms::cmd {
int ReportError(const Status& status) {
  std::fprintf(stderr, "error: %s\n", status.message().c_str());
  return 1;
}
}  // namespace ms::cmd

int main(int argc, char** argv) {
  CLI::App app{"megascale: trains large language models with 3D parallelism (CPU and CUDA backends)", "megascale"};
  const ms::cuda::Flavor cuda_flavor = ms::cuda::LinkedFlavor();
  const char* cuda_text = cuda_flavor == ms::cuda::Flavor::kGpu ? "CUDA backend: GPU (cuBLAS GEMMs, fused kernels)"
                          : cuda_flavor == ms::cuda::Flavor::kEmulated
                              ? "CUDA backend: emulated (SIMT emulator on the CPU)"
                              : "CUDA backend: not built (no nvcc)";
  app.set_version_flag("--version", std::string("megascale ") + std::string(ms::Version()) + " (" + cuda_text + ")");
  app.require_subcommand(1);
  using Adder = CLI::App* (*)(CLI::App&, ms::cmd::RunFn*);
  const Adder adders[] = {ms::cmd::AddTrainCommand,       ms::cmd::AddResumeCommand,   ms::cmd::AddValidateCommand,
                          ms::cmd::AddPrepareDataCommand, ms::cmd::AddInitTestCommand, ms::cmd::AddBenchCommand,
                          ms::cmd::AddWorkerCommand,      ms::cmd::AddExportCommand,   ms::cmd::AddSelfCheckCommand,
                          ms::cmd::AddGenerateCommand,    ms::cmd::AddReportCommand};
  std::vector<std::pair<CLI::App*, ms::cmd::RunFn>> subs;
  subs.reserve(std::size(adders));  // Add*Command keeps a pointer into this vector
  for (Adder add : adders) {
    subs.emplace_back();
    subs.back().first = add(app, &subs.back().second);
  }
  CLI11_PARSE(app, argc, argv);
  for (auto& [sub, run] : subs) {
    if (sub->parsed() && run) return run();
  }
  return 1;
}
