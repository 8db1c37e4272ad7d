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
  MS_ASSIGN_OR_RETURN(std::unique_ptr<Tokenizer> tok, MakeTokenizer(opts.tokenizer));

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
  if (progress) progress(done, std::max(total, done));
  stats.seconds = NowSeconds() - start;
  LogDebug("prepare-data: {} files, {} bytes -> {} documents, {} tokens ({}) in {:.2f} s", opts.inputs.size(), done,
           stats.documents, stats.tokens, opts.output_prefix, stats.seconds);
  return stats;
}

}  // namespace ms::data
