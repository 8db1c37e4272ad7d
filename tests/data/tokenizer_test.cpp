#include <doctest/doctest.h>

#include "data/data.h"

namespace ms::data {

TEST_CASE("byte tokenizer round trips every byte but NUL") {
  auto tok = MakeTokenizer("byte");
  REQUIRE(tok.ok());
  CHECK((*tok)->name() == "byte");
  CHECK((*tok)->vocab_size() == 256);
  CHECK((*tok)->eod_token() == 0);

  Rng rng(7);
  std::vector<int32_t> ids = {99, 98};  // Encode must replace, not append
  for (int trial = 0; trial < 50; ++trial) {
    std::string text(rng.NextBelow(301), ' ');
    for (char& c : text) c = static_cast<char>(1 + rng.NextBelow(255));  // bytes 1..255
    (*tok)->Encode(text, &ids);
    REQUIRE(ids.size() == text.size());
    for (size_t i = 0; i < text.size(); ++i) CHECK(ids[i] == static_cast<unsigned char>(text[i]));
    CHECK((*tok)->Decode(ids) == text);
  }
  (*tok)->Encode("héllo\n", &ids);
  CHECK(ids.size() == 7);  // é is two UTF-8 bytes
  CHECK((*tok)->Decode(ids) == "héllo\n");
}

TEST_CASE("byte tokenizer decode: EOD is a boundary, out-of-vocabulary ids are U+FFFD") {
  auto tok = MakeTokenizer("byte");
  REQUIRE(tok.ok());
  std::vector<int32_t> ids = {'a', 0, 'b', 256, -1, 'c'};
  CHECK((*tok)->Decode(ids) ==
        "ab\xEF\xBF\xBD\xEF\xBF\xBD"
        "c");
  CHECK((*tok)->Decode({}).empty());
}

TEST_CASE("unknown tokenizer lists the known ones") {
  auto tok = MakeTokenizer("gpt2");
  REQUIRE_FALSE(tok.ok());
  CHECK(tok.status().code() == Code::kInvalidArgument);
  CHECK(tok.status().message().find("gpt2") != std::string::npos);
  CHECK(tok.status().message().find("byte") != std::string::npos);
}

}  // namespace ms::data
