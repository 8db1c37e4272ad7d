// Tokenizers: the byte-level tokenizer and the MakeTokenizer registry.
#include <string>

#include "data/data.h"

namespace ms::data {
namespace {

constexpr std::string_view kReplacement = "\xEF\xBF\xBD";  // U+FFFD in UTF-8

class ByteTokenizer final : public Tokenizer {
 public:
  std::string_view name() const override { return "byte"; }
  int vocab_size() const override { return 256; }
  int eod_token() const override { return 0; }
  void Encode(std::string_view text, std::vector<int32_t>* out) const override {
    out->resize(text.size());
    for (size_t i = 0; i < text.size(); ++i) (*out)[i] = static_cast<unsigned char>(text[i]);
  }
  std::string Decode(std::span<const int32_t> ids) const override {
    std::string text;
    text.reserve(ids.size());
    for (int32_t id : ids) {
      if (id == 0) continue;  // EOD
      if (id < 0 || id > 255) {
        text += kReplacement;
      } else {
        text += static_cast<char>(static_cast<unsigned char>(id));
      }
    }
    return text;
  }
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> MakeTokenizer(std::string_view name) {
  if (name == "byte") return std::unique_ptr<Tokenizer>(std::make_unique<ByteTokenizer>());
  return InvalidArgument("unknown tokenizer \"{}\"; known: byte", name);
}

}  // namespace ms::data
