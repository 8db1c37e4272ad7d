// megascale export: a checkpoint's parameters as one safetensors file (lib/checkpoint).
// Argument binding only.
#include <cstdio>
#include <memory>
#include <string>

#include "checkpoint/checkpoint.h"
#include "cmd/megascale/commands.h"

namespace ms::cmd {

CLI::App* AddExportCommand(CLI::App& parent, RunFn* run) {
  CLI::App* sub = parent.add_subcommand(
      "export", "Write a checkpoint's parameters as full fp32 tensors to a safetensors file (names as in the model)");
  struct Args {
    std::string checkpoint;
    std::string output;
    bool lazy = false;
  };
  auto a = std::make_shared<Args>();
  sub->add_option("checkpoint", a->checkpoint,
                  "a checkpoint step directory (holding manifest.json), or a checkpoint root such as "
                  "<run_dir>/checkpoints: its newest valid checkpoint")
      ->required();
  sub->add_option("--output,-o", a->output, "the safetensors file to write (atomically)")->required();
  sub->add_flag("--lazy-verify", a->lazy,
                "check each piece's checksum as it is read instead of every file's checksum up front");
  *run = [a]() -> int {
    auto ckpt =
        checkpoint::FindLatestValid(a->checkpoint, a->lazy ? checkpoint::Verify::kLazy : checkpoint::Verify::kFull);
    if (!ckpt.ok()) return ReportError(ckpt.status());
    Status s = checkpoint::ExportSafetensors(*ckpt, a->output);
    if (!s.ok()) return ReportError(s);
    std::fprintf(stderr, "exported %zu tensors of %s (step %lld) to %s\n", ckpt->tensors("param").size(),
                 ckpt->dir().c_str(), static_cast<long long>(ckpt->step()), a->output.c_str());
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
