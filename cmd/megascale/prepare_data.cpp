// megascale prepare-data: text files -> token dataset (.bin/.idx, Megatron's MMIDIDX format).
#include <unistd.h>

#include <cstdio>
#include <memory>

#include "cmd/megascale/commands.h"
#include "data/data.h"

namespace ms::cmd {

CLI::App* AddPrepareDataCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "prepare-data", "Tokenize text files into a Megatron-compatible indexed dataset (<output>.bin + <output>.idx)");
  auto opts = std::make_shared<data::PrepareOptions>();
  auto no_eod = std::make_shared<bool>(false);
  sub->add_option("inputs", opts->inputs, "Text files")->required()->check(CLI::ExistingFile);
  sub->add_option("-o,--output", opts->output_prefix, "Output prefix: writes <prefix>.bin and <prefix>.idx")
      ->required();
  sub->add_option("--tokenizer", opts->tokenizer, "Tokenizer (byte)")->capture_default_str();
  sub->add_option(
      "--doc-separator", opts->doc_separator,
      "A line equal to this separates documents (e.g. % for fortune files); default: one document per file");
  sub->add_flag("--no-eod", *no_eod, "Do not append the end-of-document token to each document");
  sub->add_flag("--overwrite", opts->overwrite, "Replace an existing dataset with this prefix");
  *run = [opts, no_eod]() -> int {
    opts->append_eod = !*no_eod;
    const bool tty = isatty(fileno(stderr));
    auto progress = [tty](int64_t done, int64_t total) {
      if (tty && total > 0) std::fprintf(stderr, "\r%5.1f%% of %lld bytes", 100.0 * done / total, (long long)total);
    };
    auto stats = data::PrepareDataset(*opts, progress);
    if (tty) std::fprintf(stderr, "\r\033[K");
    if (!stats.ok()) return ReportError(stats.status());
    std::printf("wrote %s.bin and %s.idx: %lld documents, %lld tokens from %lld bytes in %.2f s\n",
                opts->output_prefix.c_str(), opts->output_prefix.c_str(), (long long)stats->documents,
                (long long)stats->tokens, (long long)stats->bytes_in, stats->seconds);
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
