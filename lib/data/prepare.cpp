// PrepareDataset: text files -> documents -> tokens -> IndexedDatasetBuilder.
#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>

#include "data/data.h"

namespace ms::data {
namespace {

// Reads a file line by line ("\n" kept) and hands out documents.
class DocumentReader {
 public:
  DocumentReader(const PrepareOptions& opts, const Tokenizer& tok, IndexedDatasetBuilder* builder,
                 const std::function<void(int64_t)>& on_bytes)
      : opts_(opts), tok_(tok), builder_(builder), on_bytes_(on_bytes) {}

  Status ReadFile(const std::string& path) {
    std::FILE* f = std::fopen(path.c_str(), "rb");
    if (f == nullptr) return ErrnoError(fmt::format("opening {}", path), errno);
    path_ = path;
    doc_.clear();
    doc_start_ = 0;
    int64_t offset = 0;
    char* line = nullptr;
    size_t cap = 0;
    Status status;
    for (;;) {
      errno = 0;
      ssize_t n = ::getline(&line, &cap, f);
      if (n < 0) {
        if (std::ferror(f)) status = ErrnoError(fmt::format("reading {}", path), errno ? errno : EIO);
        break;
      }
      std::string_view text(line, static_cast<size_t>(n));
      offset += n;
      if (!opts_.doc_separator.empty() && IsSeparator(text)) {
        status = EmitDocument();
        if (!status.ok()) break;
        doc_start_ = offset;
      } else {
        doc_.append(text);
      }
      on_bytes_(n);
    }
    std::free(line);
    std::fclose(f);
    MS_RETURN_IF_ERROR(status);
    return EmitDocument();
  }

 private:
  bool IsSeparator(std::string_view line) const {
    if (!line.empty() && line.back() == '\n') line.remove_suffix(1);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    return line == opts_.doc_separator;
  }

  Status EmitDocument() {
    if (doc_.empty()) return Status::Ok();
    tok_.Encode(doc_, &ids_);
    auto eod = std::find(ids_.begin(), ids_.end(), tok_.eod_token());
    if (eod != ids_.end()) {
      return InvalidArgument(
          "{}: the document starting at byte {} contains the end-of-document token {} (token {} of the document{}); "
          "clean the input",
          path_, doc_start_, tok_.eod_token(), eod - ids_.begin(), tok_.name() == "byte" ? ": a NUL byte" : "");
    }
    if (opts_.append_eod) ids_.push_back(tok_.eod_token());
    doc_.clear();
    return builder_->AddDocument(ids_);
  }

  const PrepareOptions& opts_;
  const Tokenizer& tok_;
  IndexedDatasetBuilder* builder_;
  const std::function<void(int64_t)>& on_bytes_;
  std::string path_;
  std::string doc_;        // text of the current document
  int64_t doc_start_ = 0;  // its byte offset in the file
  std::vector<int32_t> ids_;
};

}  // namespace

Result<PrepareStats> PrepareDataset(const PrepareOptions& opts, const std::function<void(int64_t, int64_t)>& progress) {
  const double start = NowSeconds();
  if (opts.inputs.empty()) return InvalidArgument("prepare-data: no input files");
  if (opts.output_prefix.empty()) return InvalidArgument("prepare-data: no output prefix (--output)");
  const bool train_sp = opts.tokenizer == "bpe" || opts.tokenizer == "unigram";
  const bool sp_file = opts.tokenizer.find('/') != std::string::npos || opts.tokenizer.ends_with(".model");
  if (opts.tokenizer != "byte" && !train_sp && !sp_file) {
    return InvalidArgument(
        "prepare-data: tokenizer \"{}\": use byte, bpe or unigram (train a SentencePiece model of --vocab-size "
        "pieces on the inputs), or the path of a SentencePiece .model file",
        opts.tokenizer);
  }

  // Every input must be there before anything is written.
  int64_t total = 0;
  for (const std::string& path : opts.inputs) {
    struct stat st;
    if (::stat(path.c_str(), &st) != 0) {
      int err = errno;
      if (err == ENOENT) return NotFound("prepare-data: input {}: no such file", path);
      return ErrnoError(fmt::format("prepare-data: input {}", path), err);
    }
    if (!S_ISREG(st.st_mode)) return InvalidArgument("prepare-data: input {} is not a regular file", path);
    total += st.st_size;
  }

  // The tokenizer: trained on the inputs, read from a model file, or bytes. The output is claimed
  // first, so that a refused --output costs no training.
  std::unique_ptr<Tokenizer> tok;
  std::string model_bytes;
  double tokenizer_seconds = 0;
  if (opts.tokenizer == "byte") {
    MS_ASSIGN_OR_RETURN(tok, MakeTokenizer("byte"));
  } else {
    struct stat st;
    if (!opts.overwrite && ::stat((opts.output_prefix + ".idx").c_str(), &st) == 0) {
      return AlreadyExists("prepare-data: {}.idx exists; pass --overwrite to replace the dataset", opts.output_prefix);
    }
    const double t0 = NowSeconds();
    if (train_sp) {
      auto trained = TrainSentencePiece(opts.inputs, opts.doc_separator, opts.tokenizer, opts.vocab_size);
      if (!trained.ok()) return trained.status().WithContext("prepare-data");
      model_bytes = std::move(trained).value();
    } else {
      auto read = ReadFile(opts.tokenizer);
      if (!read.ok()) return read.status().WithContext("prepare-data: reading --tokenizer");
      model_bytes = std::move(read).value();
    }
    auto made = SentencePieceFromBytes(model_bytes, train_sp ? std::string("the trained model") : opts.tokenizer);
    if (!made.ok()) return made.status().WithContext("prepare-data");
    tok = std::move(made).value();
    tokenizer_seconds = NowSeconds() - t0;
  }
  MS_ASSIGN_OR_RETURN(IndexedDatasetBuilder builder,
                      IndexedDatasetBuilder::Create(opts.output_prefix, tok->vocab_size(), opts.overwrite));
  int64_t done = 0;
  const int64_t step = std::max<int64_t>(int64_t{1} << 20, total / 100);
  int64_t next_report = step;
  std::function<void(int64_t)> on_bytes = [&](int64_t n) {
    done += n;
    if (progress && done >= next_report) {
      progress(done, total);
      next_report = done + step;
    }
  };
  DocumentReader reader(opts, *tok, &builder, on_bytes);
  for (const std::string& path : opts.inputs) {
    MS_RETURN_IF_ERROR_CTX(reader.ReadFile(path), "prepare-data");
  }
  PrepareStats stats;
  stats.documents = builder.num_documents();
  stats.tokens = builder.num_tokens();
  stats.bytes_in = done;
  MS_RETURN_IF_ERROR_CTX(builder.Finish(), "prepare-data");
  // The metadata after the tokens: the model first, then the file naming it.
  DatasetInfo info;
  info.tokenizer = std::string(tok->name());
  info.vocab_size = tok->vocab_size();
  info.eod_token = tok->eod_token();
  if (!model_bytes.empty()) {
    info.tokenizer_model = opts.output_prefix + ".model";
    info.model_fingerprint = Fingerprint(model_bytes);
    MS_RETURN_IF_ERROR_CTX(WriteFileAtomic(info.tokenizer_model, model_bytes), "prepare-data: writing the tokenizer");
  }
  MS_RETURN_IF_ERROR_CTX(WriteDatasetInfo(opts.output_prefix, info, stats.documents, stats.tokens, done),
                         "prepare-data: writing {}.json", opts.output_prefix);
  stats.tokenizer = info.tokenizer;
  stats.vocab_size = info.vocab_size;
  stats.tokenizer_seconds = tokenizer_seconds;
  if (progress) progress(done, std::max(total, done));
  stats.seconds = NowSeconds() - start;
  LogDebug("prepare-data: {} files, {} bytes -> {} documents, {} tokens ({}) in {:.2f} s", opts.inputs.size(), done,
           stats.documents, stats.tokens, opts.output_prefix, stats.seconds);
  return stats;
}

}  // namespace ms::data
