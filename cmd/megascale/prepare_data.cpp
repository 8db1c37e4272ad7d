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
  sub->add_option("--tokenizer", opts->tokenizer,
                  "byte (one token per byte, vocab 256); bpe or unigram: train a SentencePiece model of --vocab-size "
                  "pieces on the inputs; or the path of a SentencePiece .model file (e.g. a LLaMA tokenizer). The "
                  "model is stored as <output>.model and named in <output>.json")
      ->capture_default_str();
  sub->add_option("--vocab-size", opts->vocab_size, "Pieces of the trained tokenizer (bpe, unigram)")
      ->capture_default_str()
      ->check(CLI::Range(300, 1 << 24));
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
    std::printf(
        "wrote %s.{bin,idx,json}%s: %lld documents, %lld tokens from %lld bytes (%.3f tokens per byte, %s "
        "tokenizer of %d pieces) in %.2f s%s\n",
        opts->output_prefix.c_str(), stats->tokenizer == "byte" ? "" : " and .model", (long long)stats->documents,
        (long long)stats->tokens, (long long)stats->bytes_in,
        stats->bytes_in > 0 ? static_cast<double>(stats->tokens) / static_cast<double>(stats->bytes_in) : 0.0,
        stats->tokenizer.c_str(), stats->vocab_size, stats->seconds,
        stats->tokenizer_seconds > 0
            ? fmt::format(" ({:.2f} s training the tokenizer)", stats->tokenizer_seconds).c_str()
            : "");
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
