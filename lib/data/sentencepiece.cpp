// The SentencePiece tokenizer (Debian's libsentencepiece): loading a .model file, and training a
// BPE or unigram model on the documents prepare-data reads.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <unordered_map>

#include "data/data.h"

namespace ms::data {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD
constexpr std::string_view kSpaceMark = "\xE2\x96\x81";    // U+2581, SentencePiece's escaped space

// Length of the well-formed UTF-8 character at text[i] (1-4), or 0 when the bytes there are not one.
size_t Utf8Length(std::string_view text, size_t i) {
  const auto b = [&](size_t k) { return static_cast<unsigned char>(text[k]); };
  const unsigned char c = b(i);
  const size_t left = text.size() - i;
  auto cont = [&](size_t k) { return k < text.size() && (b(k) & 0xC0) == 0x80; };
  if (c < 0x80) return 1;
  if (c >= 0xC2 && c <= 0xDF) return left >= 2 && cont(i + 1) ? 2 : 0;
  if (c >= 0xE0 && c <= 0xEF) {
    if (left < 3 || !cont(i + 1) || !cont(i + 2)) return 0;
    if (c == 0xE0 && b(i + 1) < 0xA0) return 0;   // overlong
    if (c == 0xED && b(i + 1) >= 0xA0) return 0;  // surrogate
    return 3;
  }
  if (c >= 0xF0 && c <= 0xF4) {
    if (left < 4 || !cont(i + 1) || !cont(i + 2) || !cont(i + 3)) return 0;
    if (c == 0xF0 && b(i + 1) < 0x90) return 0;   // overlong
    if (c == 0xF4 && b(i + 1) >= 0x90) return 0;  // above U+10FFFF
    return 4;
  }
  return 0;
}

class SentencePieceTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> Create(std::string_view serialized, const std::string& what) {
    auto t = std::unique_ptr<SentencePieceTokenizer>(new SentencePieceTokenizer());
    auto st = t->sp_.LoadFromSerializedProto({serialized.data(), serialized.size()});
    if (!st.ok()) return DataLoss("{}: not a SentencePiece model: {}", what, st.ToString());
    if (t->sp_.eos_id() < 0) {
      return InvalidArgument(
          "{}: the SentencePiece model has no end-of-sequence piece (eos_id is -1); it is needed "
          "as the end-of-document token: train it with eos_id >= 0",
          what);
    }
    t->vocab_ = t->sp_.GetPieceSize();
    t->byte_ids_.fill(-1);
    for (int v = 0; v < 256; ++v) {
      const int id = t->sp_.PieceToId(fmt::format("<0x{:02X}>", v));
      if (id != t->sp_.unk_id() && t->sp_.IsByte(id)) t->byte_ids_[v] = id;
    }
    t->byte_of_.assign(static_cast<size_t>(t->vocab_), -1);
    for (int v = 0; v < 256; ++v) {
      if (t->byte_ids_[v] >= 0) t->byte_of_[static_cast<size_t>(t->byte_ids_[v])] = v;
    }
    // A model trained with add_dummy_prefix (LLaMA's are) encodes "a" as "▁a": its decoder drops the space that
    // prefix makes at the start of a text.
    std::vector<std::string> pieces;
    if (t->sp_.Encode("a", &pieces).ok() && !pieces.empty()) {
      t->dummy_prefix_ = pieces.front().rfind(kSpaceMark, 0) == 0;
    }
    return std::unique_ptr<Tokenizer>(std::move(t));
  }

  std::string_view name() const override { return "sentencepiece"; }
  int vocab_size() const override { return vocab_; }
  int eod_token() const override { return sp_.eos_id(); }
  int unknown_token() const override { return sp_.unk_id(); }

  // Well-formed UTF-8 goes through SentencePiece; bytes that are not (and the U+2581 character, which
  // SentencePiece would turn into a space) become byte pieces, so that Decode gives back the exact bytes
  // when the model has byte fallback (models without it map them to the unknown piece).
  void Encode(std::string_view text, std::vector<int32_t>* out) const override {
    out->clear();
    std::vector<int> ids;
    size_t run = 0, i = 0;
    auto flush = [&](size_t end) {
      if (end > run) {
        ids.clear();
        if (!sp_.Encode(text.substr(run, end - run), &ids).ok()) {
          for (size_t k = run; k < end; ++k) out->push_back(ByteId(static_cast<unsigned char>(text[k])));
        } else {
          out->insert(out->end(), ids.begin(), ids.end());
        }
      }
    };
    while (i < text.size()) {
      const size_t n = Utf8Length(text, i);
      if (n != 0 && text.compare(i, kSpaceMark.size(), kSpaceMark) != 0) {
        i += n;
        continue;
      }
      flush(i);
      const size_t bad = n == 0 ? 1 : n;
      for (size_t k = i; k < i + bad; ++k) out->push_back(ByteId(static_cast<unsigned char>(text[k])));
      i += bad;
      run = i;
    }
    flush(text.size());
  }

  std::string Decode(std::span<const int32_t> ids) const override {
    std::string text;
    bool first = true;
    for (int32_t id : ids) {
      if (id < 0 || id >= vocab_) {
        text += kReplacement;
      } else if (byte_of_[static_cast<size_t>(id)] >= 0) {
        text += static_cast<char>(byte_of_[static_cast<size_t>(id)]);
      } else if (sp_.IsControl(id)) {
        continue;  // end of document (and begin-of-sequence, padding): boundaries, not text
      } else if (sp_.IsUnknown(id)) {
        text += kReplacement;
      } else {
        std::string piece = sp_.IdToPiece(id);
        size_t from = 0;
        if (first && dummy_prefix_ && piece.rfind(kSpaceMark, 0) == 0) from = kSpaceMark.size();
        for (size_t k = from; k < piece.size();) {
          if (piece.compare(k, kSpaceMark.size(), kSpaceMark) == 0) {
            text += ' ';
            k += kSpaceMark.size();
          } else {
            text += piece[k++];
          }
        }
      }
      first = false;
    }
    return text;
  }

 private:
  SentencePieceTokenizer() = default;
  int32_t ByteId(unsigned char b) const { return byte_ids_[b] >= 0 ? byte_ids_[b] : sp_.unk_id(); }

  sentencepiece::SentencePieceProcessor sp_;
  int vocab_ = 0;
  bool dummy_prefix_ = false;
  std::array<int32_t, 256> byte_ids_{};
  std::vector<int> byte_of_;  // id -> byte value, -1 for other pieces
};

// The lines of the input files (documents split as prepare-data splits them; separator lines left out).
class LineIterator final : public sentencepiece::SentenceIterator {
 public:
  LineIterator(const std::vector<std::string>& inputs, std::string separator)
      : inputs_(inputs), separator_(std::move(separator)) {
    Next();
  }
  ~LineIterator() override {
    if (f_) std::fclose(f_);
    std::free(buf_);
  }
  bool done() const override { return done_; }
  const std::string& value() const override { return line_; }
  sentencepiece::util::Status status() const override {
    if (error_.empty()) return {};
    return sentencepiece::util::Status(sentencepiece::util::StatusCode::kInternal, error_);
  }
  void Next() override {
    while (!done_) {
      if (!f_) {
        if (next_file_ >= inputs_.size()) {
          done_ = true;
          return;
        }
        f_ = std::fopen(inputs_[next_file_].c_str(), "rb");
        if (!f_) {
          error_ = fmt::format("opening {}: {}", inputs_[next_file_], std::strerror(errno));
          done_ = true;
          return;
        }
        ++next_file_;
      }
      const ssize_t n = ::getline(&buf_, &cap_, f_);
      if (n < 0) {
        std::fclose(f_);
        f_ = nullptr;
        continue;
      }
      line_.assign(buf_, static_cast<size_t>(n));
      std::string_view bare(line_);
      while (!bare.empty() && (bare.back() == '\n' || bare.back() == '\r')) bare.remove_suffix(1);
      if (!separator_.empty() && bare == separator_) continue;
      if (line_.empty()) continue;
      return;
    }
  }

 private:
  const std::vector<std::string>& inputs_;
  std::string separator_;
  size_t next_file_ = 0;
  std::FILE* f_ = nullptr;
  char* buf_ = nullptr;
  size_t cap_ = 0;
  std::string line_;
  std::string error_;
  bool done_ = false;
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> LoadSentencePiece(const std::string& model_path) {
  auto bytes = ReadFile(model_path);
  if (!bytes.ok()) return bytes.status().WithContext("reading the SentencePiece model");
  return SentencePieceTokenizer::Create(*bytes, model_path);
}

Result<std::string> TrainSentencePiece(const std::vector<std::string>& inputs, const std::string& doc_separator,
                                       std::string_view model_type, int vocab_size) {
  if (model_type != "bpe" && model_type != "unigram") {
    return InvalidArgument("SentencePiece model type '{}': use bpe or unigram", model_type);
  }
  if (vocab_size < 300) {
    return InvalidArgument(
        "tokenizer vocabulary size {} is too small for a {} model: it needs 256 byte pieces, the special pieces and "
        "some merges; use --vocab-size 300 or more (e.g. 4096)",
        vocab_size, model_type);
  }
  // Settings that make Encode/Decode an exact round trip: no normalization, no dummy space prefix, whitespace
  // kept as it is, byte fallback for characters the vocabulary lacks, newline a piece of its own.
  const std::unordered_map<std::string, std::string> args = {
      {"model_type", std::string(model_type)},
      {"vocab_size", std::to_string(vocab_size)},
      {"byte_fallback", "true"},
      {"normalization_rule_name", "identity"},
      {"add_dummy_prefix", "false"},
      {"remove_extra_whitespaces", "false"},
      {"user_defined_symbols", "\n"},
      {"unk_id", "0"},
      {"eos_id", "1"},
      {"bos_id", "-1"},
      {"pad_id", "-1"},
      {"character_coverage", "0.9995"},
      {"input_sentence_size", "2000000"},
      {"shuffle_input_sentence", "true"},
      {"num_threads", std::to_string(std::max(1, NumCores()))},
      {"minloglevel", "2"},
  };
  LineIterator lines(inputs, doc_separator);
  std::string model;
  auto st = sentencepiece::SentencePieceTrainer::Train(args, &lines, &model);
  if (!lines.status().ok()) return IoError("training the tokenizer: {}", lines.status().ToString());
  if (!st.ok()) {
    return InvalidArgument("training a {} tokenizer of {} pieces: {}{}", model_type, vocab_size, st.ToString(),
                           st.ToString().find("ocab") != std::string::npos
                               ? " (the text is too small for this vocabulary: lower --vocab-size)"
                               : "");
  }
  return model;
}

Result<std::unique_ptr<Tokenizer>> SentencePieceFromBytes(std::string_view serialized, const std::string& what) {
  return SentencePieceTokenizer::Create(serialized, what);
}

}  // namespace ms::data
