// megascale data: tokenizers, the Megatron-LM indexed dataset (.bin/.idx, "MMIDIDX" version 1),
// a deterministic resumable sampler of fixed-length training sequences, and prepare-data
// (text files -> token dataset).
//
// Contract: nothing here throws; every failure is a Status. Corrupt or truncated dataset files
// give DataLoss naming the file, the field and the numbers; bad user input gives
// InvalidArgument; missing files NotFound; refusing to replace output AlreadyExists.
// Thread safety is stated per class.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/core.h"  // defines: Status, Result, Rng

namespace ms::data {

// ---- tokenizers ------------------------------------------------------------------------

// Text <-> token ids. Implementations are immutable after construction: every method is
// const and safe to call from many threads at once.
class Tokenizer {
 public:
  virtual ~Tokenizer() = default;
  virtual std::string_view name() const = 0;
  virtual int vocab_size() const = 0;
  // The end-of-document token appended after each document by PrepareDataset.
  virtual int eod_token() const = 0;
  // The id text the vocabulary lacks encodes to (-1: none; the byte tokenizer covers every byte).
  virtual int unknown_token() const { return -1; }
  // Replaces *out with the ids of `text` (*out is cleared first).
  virtual void Encode(std::string_view text, std::vector<int32_t>* out) const = 0;
  // The text of `ids`. Never fails: the EOD token decodes to nothing (it marks a boundary,
  // it is not text); ids outside the vocabulary decode to U+FFFD.
  virtual std::string Decode(std::span<const int32_t> ids) const = 0;
};

// "byte": vocab 256, token = byte value (Encode(text).size() == text.size()), EOD = 0. NUL never
// occurs in text, so 0 is free to be the EOD token; PrepareDataset rejects input holding a NUL.
// Unknown name -> InvalidArgument listing the known ones.
Result<std::unique_ptr<Tokenizer>> MakeTokenizer(std::string_view name);

// SentencePiece (Debian's libsentencepiece): a tokenizer from a .model file (the format LLaMA-family
// tokenizers ship in). Its EOD token is the model's end-of-sequence piece (a model without one:
// InvalidArgument). Text that is not well-formed UTF-8 is encoded byte by byte through the byte
// pieces, so Decode(Encode(text)) == text for any bytes when the model has byte fallback (models
// trained by TrainSentencePiece do); models without byte pieces map such bytes to the unknown piece.
Result<std::unique_ptr<Tokenizer>> LoadSentencePiece(const std::string& model_path);
// The same from the bytes of a .model file; `what` names it in errors.
Result<std::unique_ptr<Tokenizer>> SentencePieceFromBytes(std::string_view serialized, const std::string& what);
// Trains a SentencePiece model (model_type "bpe" or "unigram") of vocab_size pieces on the lines of
// `inputs` (separator lines left out, see PrepareOptions) and returns the .model file's bytes.
// Settings: byte fallback, identity normalization, no dummy prefix, whitespace kept, "\n" a piece,
// unk 0, eos 1 (the EOD token), no bos/pad. Too large a vocabulary for the text: InvalidArgument.
Result<std::string> TrainSentencePiece(const std::vector<std::string>& inputs, const std::string& doc_separator,
                                       std::string_view model_type, int vocab_size);

// What made a dataset's tokens: "<prefix>.json", written by PrepareDataset beside .bin/.idx.
// A dataset without it (made before the file existed, or by another tool) is byte-tokenized.
struct DatasetInfo {
  std::string tokenizer = "byte";  // "byte" or "sentencepiece"
  std::string tokenizer_model;     // sentencepiece: path of the model file ("<prefix>.model"), else ""
  std::string model_fingerprint;   // sentencepiece: 64-bit FNV-1a of that file's bytes, in hex
  int vocab_size = 256;
  int eod_token = 0;
};
// 64-bit FNV-1a of `bytes`, 16 hex digits: identifies a tokenizer model file.
std::string Fingerprint(std::string_view bytes);
// Writes <prefix>.json (atomically) describing `info`; the model path is stored relative to the
// dataset's directory.
Status WriteDatasetInfo(const std::string& prefix, const DatasetInfo& info, int64_t documents, int64_t tokens,
                        int64_t bytes_in);
// Reads <prefix>.json (absent: the byte defaults). A malformed file: DataLoss naming it.
Result<DatasetInfo> ReadDatasetInfo(const std::string& prefix);

// The tokenizer of a job: `name` is the spec's data.tokenizer: "auto" (whatever the dataset's
// metadata names), "byte", "sentencepiece" (the model stored beside the dataset) or the path of a
// SentencePiece .model file (it must be the one the dataset was made with: same fingerprint).
// A tokenizer that does not match the dataset: InvalidArgument naming both and the fix.
Result<std::unique_ptr<Tokenizer>> LoadTokenizer(std::string_view name, const std::string& dataset_prefix);

// ---- Megatron-LM indexed dataset ---------------------------------------------------------
//
// Layout (Megatron-LM megatron/core/datasets/indexed_dataset.py, version 1), little endian:
//   <prefix>.idx = magic "MMIDIDX\0\0" (9 bytes) | version u64 = 1 | dtype code u8
//                | sequence_count u64 (S) | document_count u64 (D + 1)
//                | sizes int32[S] (tokens per sequence) | pointers int64[S] (byte offsets into .bin)
//                | document_indices int64[D + 1] (0, ..., S: document d = sequences [di[d], di[d+1]))
//                | [optional: modes int8[S], multimodal datasets only; ignored]
//   <prefix>.bin = the tokens of every sequence, back to back, in the dtype.
// dtype codes: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16;
// the integer ones are accepted for reading. We write one sequence per document.

inline constexpr int kDTypeUint16 = 8;
inline constexpr int kDTypeInt32 = 4;

// Read-only view of a dataset through mmap. Open validates every field (see Open) and scans
// the tokens once (min >= 0, max <= INT32_MAX, max_token). Movable, not copyable; unmaps in
// the destructor. Thread safety: immutable after Open; every method may be called from many
// threads at once. The files must not be truncated while open (the kernel would raise SIGBUS;
// PrepareDataset never modifies a dataset in place, it renames new files over old ones).
class IndexedDataset {
 public:
  // Opens <prefix>.idx and <prefix>.bin. Missing file: NotFound. Any violation: DataLoss with
  // the file name, the field and the numbers, e.g. "x.idx: truncated: header says 4353
  // sequences and 4354 document indices, needs 87106 bytes, file has 1000". Checked: magic,
  // version 1, integer dtype code, counts vs .idx size (no trailing bytes except multimodal
  // modes), sizes >= 0, every sequence [pointer, pointer + size * itemsize) inside .bin,
  // document indices starting at 0, non-decreasing, ending at the sequence count, token
  // values in [0, INT32_MAX].
  static Result<IndexedDataset> Open(const std::string& prefix);

  IndexedDataset(IndexedDataset&& other) noexcept;
  IndexedDataset& operator=(IndexedDataset&& other) noexcept;
  IndexedDataset(const IndexedDataset&) = delete;
  IndexedDataset& operator=(const IndexedDataset&) = delete;
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  int64_t num_sequences() const { return num_sequences_; }
  // Documents (document_count in the header minus the trailing sentinel).
  int64_t num_documents() const { return num_documents_; }
  // Sum of all sequence lengths: the length of the token stream ReadTokens addresses.
  int64_t num_tokens() const { return num_tokens_; }
  int dtype_code() const { return dtype_code_; }
  // Bytes per token in .bin (1, 2, 4 or 8).
  int itemsize() const { return itemsize_; }
  // Tokens in sequence i; 0 if i is out of range.
  int64_t sequence_length(int64_t i) const;
  // Copies tokens [offset, offset + n) of the concatenation of all sequences (in index order)
  // into out[0..n), converted to int32. Out of [0, num_tokens()]: OutOfRange, out untouched.
  Status ReadTokens(int64_t offset, int64_t n, int32_t* out) const;
  // Largest token id in the dataset (-1 when it holds no tokens); check it against the model
  // vocabulary: max_token() < vocab_size.
  int32_t max_token() const { return max_token_; }

 private:
  IndexedDataset() = default;
  void Release();
  int32_t SizeAt(int64_t i) const;
  int64_t PointerAt(int64_t i) const;
  void Convert(const uint8_t* src, int64_t n, int32_t* out) const;

  std::string prefix_;
  const uint8_t* idx_ = nullptr;  // mmap of .idx (idx_size_ bytes)
  size_t idx_size_ = 0;
  const uint8_t* bin_ = nullptr;  // mmap of .bin (bin_size_ bytes); null when .bin is empty
  size_t bin_size_ = 0;
  int dtype_code_ = 0;
  int itemsize_ = 0;
  int64_t num_sequences_ = 0;
  int64_t num_documents_ = 0;
  int64_t num_tokens_ = 0;
  int32_t max_token_ = -1;
  // Sequences are normally stored back to back in index order: then the token stream is the
  // .bin range starting at stream_base_ and seq_start_ stays empty. Otherwise seq_start_
  // holds the stream offset of each sequence ((S + 1) entries) for a binary search.
  bool contiguous_ = true;
  int64_t stream_base_ = 0;
  std::vector<int64_t> seq_start_;
};

// Streams documents into <prefix>.bin/.idx without holding them in memory (12 bytes of index
// per document). Output goes to "<prefix>.{bin,idx}.tmp-<pid>" and is committed by Finish():
// fsync, remove an existing <prefix>.idx, rename .bin then .idx, fsync the directory; a
// reader sees the old dataset, no dataset (NotFound), or the new one, never a torn one.
// Destroying a builder without a successful Finish removes its temp files.
// dtype: uint16 (code 8) when vocab_size < 65500, else int32 (code 4), as Megatron does.
// Thread safety: thread-compatible (one thread at a time). Movable, not copyable.
class IndexedDatasetBuilder {
 public:
  // Existing output and !overwrite: AlreadyExists. Creates the parent directory.
  static Result<IndexedDatasetBuilder> Create(const std::string& prefix, int vocab_size, bool overwrite);

  IndexedDatasetBuilder(IndexedDatasetBuilder&& other) noexcept;
  IndexedDatasetBuilder& operator=(IndexedDatasetBuilder&& other) noexcept;
  IndexedDatasetBuilder(const IndexedDatasetBuilder&) = delete;
  IndexedDatasetBuilder& operator=(const IndexedDatasetBuilder&) = delete;
  ~IndexedDatasetBuilder();

  // Appends one document (one sequence; may be empty). A token outside [0, vocab_size):
  // InvalidArgument, nothing appended.
  Status AddDocument(std::span<const int32_t> tokens);
  // Writes the index and commits. After Finish (successful or not) the builder is spent.
  Status Finish();

  int64_t num_documents() const { return static_cast<int64_t>(sizes_.size()); }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  IndexedDatasetBuilder() = default;
  Status Flush();
  void Abandon();

  std::string prefix_;
  std::string bin_tmp_, idx_tmp_;
  int bin_fd_ = -1;
  int vocab_size_ = 0;
  int dtype_code_ = kDTypeUint16;
  bool overwrite_ = false;
  bool active_ = false;       // temp files exist and are ours to remove
  std::vector<char> buffer_;  // pending .bin bytes
  std::vector<int32_t> sizes_;
  int64_t num_tokens_ = 0;
};

// Writes `documents` (token ids, one sequence per document, empty ones allowed) as <prefix>.bin
// and <prefix>.idx through IndexedDatasetBuilder, replacing an existing dataset.
Status WriteIndexedDataset(const std::string& prefix, const std::vector<std::vector<int32_t>>& documents,
                           int vocab_size);

// ---- sampler ---------------------------------------------------------------------------

// Deterministic, stateless sampler of fixed-length training sequences. The token stream (all
// sequences concatenated, see ReadTokens) is cut into S = (num_tokens - 1) / seq_len samples of
// seq_len + 1 tokens with stride seq_len: sample j = stream[j*T, j*T + T + 1), inputs
// s[0..T), targets s[1..T+1). Samples cross document boundaries (EOD tokens separate them).
// The last num_valid = max(1, floor(S * valid_fraction)) samples (0 when valid_fraction == 0)
// are the validation split, the first num_train = S - num_valid the training split; the two
// share only the one boundary token (last target of train / first input of valid).
// Training sample k (k = 0, 1, 2, ... over the whole run, e.g. step * global_batch + i) lies in
// epoch e = k / num_train; inside an epoch the order is a Fisher-Yates permutation of the train
// samples drawn with Rng(seed, e) (for i = n-1 .. 1: swap(p[i], p[NextBelow(i + 1)])). Same
// (dataset, seq_len, valid_fraction, seed, k) -> same sample, always: this makes resume exact.
//
// Memory: the permutations of the two most recently used epochs are cached (8 bytes per train
// sample each). Thread safety: every method is const and may be called from many threads at
// once (the cache is guarded by a mutex held only for the index lookup). The dataset is
// borrowed: it must outlive the sampler and must not be moved while the sampler exists.
class Sampler {
 public:
  // seq_len >= 1, 0 <= valid_fraction < 1, else InvalidArgument. Too few tokens for one train
  // sample (plus one valid sample when valid_fraction > 0): InvalidArgument naming the numbers.
  static Result<Sampler> Create(const IndexedDataset* ds, int seq_len, double valid_fraction, uint64_t seed);

  Sampler(Sampler&&) noexcept = default;
  Sampler& operator=(Sampler&&) noexcept = default;

  int seq_len() const { return seq_len_; }
  // Bytes per token of the dataset's .bin.
  int itemsize() const { return ds_ ? ds_->itemsize() : 0; }
  int64_t num_train() const { return num_train_; }
  int64_t num_valid() const { return num_valid_; }
  // Bytes held by the cached epoch permutations.
  int64_t cache_bytes() const;
  // Index j (sample j starts at stream token j * seq_len) of training sample k; k < 0: OutOfRange.
  Result<int64_t> TrainSampleIndex(int64_t k) const;
  // out: seq_len + 1 tokens of training sample k (k >= 0, any epoch). k < 0: OutOfRange.
  Status GetTrain(int64_t k, int32_t* out) const;
  // out: seq_len + 1 tokens of validation sample k % num_valid, in stream order (no shuffle).
  // k < 0: OutOfRange; no validation split: FailedPrecondition.
  Status GetValid(int64_t k, int32_t* out) const;

 private:
  struct Cache {
    std::mutex mu;
    int64_t epoch[2] = {-1, -1};   // GUARDED_BY(mu)
    std::vector<int64_t> perm[2];  // GUARDED_BY(mu)
    int next = 0;                  // GUARDED_BY(mu): slot to evict next
  };
  Sampler() = default;

  const IndexedDataset* ds_ = nullptr;
  int seq_len_ = 0;
  uint64_t seed_ = 0;
  int64_t num_train_ = 0;
  int64_t num_valid_ = 0;
  std::unique_ptr<Cache> cache_;
};

// ---- prepare-data ----------------------------------------------------------------------

struct PrepareOptions {
  std::vector<std::string> inputs;  // text files, read in this order
  std::string output_prefix;        // writes <prefix>.bin and <prefix>.idx
  // "byte"; "bpe" or "unigram": train a SentencePiece model of vocab_size pieces on the inputs;
  // or the path of a SentencePiece .model file. A SentencePiece model is stored beside the dataset
  // as <prefix>.model and named in <prefix>.json (see DatasetInfo).
  std::string tokenizer = "byte";
  int vocab_size = 4096;  // for bpe / unigram
  // A line equal to this (ignoring a trailing "\r") separates documents (e.g. "%" for fortune
  // files); the separator line itself is dropped, the other lines keep their "\n". Empty: each
  // file is one document. Documents with no bytes at all are skipped (not counted).
  std::string doc_separator;
  bool append_eod = true;  // append the tokenizer's EOD token after each document
  bool overwrite = false;  // refuse (AlreadyExists) to replace an existing <prefix>.bin/.idx otherwise
};

struct PrepareStats {
  int64_t documents = 0;  // written
  int64_t tokens = 0;     // written, EOD tokens included
  int64_t bytes_in = 0;   // read from the inputs
  double seconds = 0;
  double tokenizer_seconds = 0;  // training the tokenizer (bpe / unigram), included in seconds
  std::string tokenizer;         // "byte" or "sentencepiece"
  int vocab_size = 0;
};

// Tokenizes the inputs into an indexed dataset. Writes via temp files + rename (never a
// half-written dataset under the final name; on failure nothing is left behind). Every input
// is checked to exist before anything is written (NotFound). Text containing the EOD token
// (a NUL byte for "byte"): InvalidArgument naming the file. `progress` may be empty; it is
// called with (bytes done, bytes total) now and then and once at the end.
Result<PrepareStats> PrepareDataset(const PrepareOptions& opts,
                                    const std::function<void(int64_t, int64_t)>& progress = {});

}  // namespace ms::data
