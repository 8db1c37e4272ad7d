// The SentencePiece tokenizer: training, exact round trips of any bytes, the dataset metadata and
// the checks of a job's data.tokenizer against it.
#include <doctest/doctest.h>

#include "data/data.h"
#include "data/test_util.h"

namespace ms::data {
namespace {

using testing::Slurp;
using testing::Spit;
using testing::TempDir;

// English-like text made here (no downloads): sentences of 300 made-up words of 1-4 syllables, a few
// of them with non-ASCII letters.
std::string MakeCorpus(uint64_t seed, int sentences) {
  static const char* syllables[] = {"ka",  "to", "ri",        "mun",       "sel",          "pa",  "qua",
                                    "dre", "lo", "vin",       "ex",        "zu",           "ber", "stal",
                                    "gon", "fi", "\xc3\xa9t", "\xc3\xbcr", "\xe6\x97\xa5", "ny"};
  Rng words_rng(1234);  // the same words for every seed
  std::vector<std::string> words(300);
  for (auto& w : words) {
    const int n = 1 + static_cast<int>(words_rng.NextBelow(4));
    for (int i = 0; i < n; ++i) w += syllables[words_rng.NextBelow(sizeof(syllables) / sizeof(syllables[0]))];
  }
  Rng rng(seed);
  std::string text;
  for (int s = 0; s < sentences; ++s) {
    const int n = 3 + static_cast<int>(rng.NextBelow(9));
    for (int w = 0; w < n; ++w) {
      text += words[rng.NextBelow(words.size()) * rng.NextBelow(words.size()) / words.size()];  // skewed
      text += w + 1 < n ? " " : ".\n";
    }
    if (rng.NextBelow(6) == 0) text += "%\n";
  }
  return text;
}

// Trains a model on a corpus in `dir` and returns it.
std::unique_ptr<Tokenizer> Trained(const TempDir& dir, std::string_view type, int vocab) {
  const std::string in = dir / "train.txt";
  Spit(in, MakeCorpus(1, 3000));
  auto model = TrainSentencePiece({in}, "%", type, vocab);
  REQUIRE(model.ok());
  auto tok = SentencePieceFromBytes(*model, "test model");
  REQUIRE(tok.ok());
  return std::move(tok).value();
}

}  // namespace

TEST_CASE("sentencepiece: bpe and unigram round trip arbitrary bytes, invalid UTF-8 and empty text included") {
  TempDir dir;
  for (const char* type : {"bpe", "unigram"}) {
    CAPTURE(type);
    auto tok = Trained(dir, type, 400);
    CHECK(tok->name() == "sentencepiece");
    CHECK(tok->vocab_size() == 400);
    CHECK(tok->eod_token() == 1);
    std::vector<int32_t> ids = {7, 7};
    tok->Encode("", &ids);
    CHECK(ids.empty());
    CHECK(tok->Decode(ids).empty());
    const std::vector<std::string> fixed = {
        "the model trains.\n",
        "  leading and trailing spaces  \n\n\ttab\r\n",
        "\xff\xfe invalid \xc0\xaf overlong \xed\xa0\x80 surrogate \xf4\x90\x80\x80 too big \xe2\x82 cut",
        "U+2581 \xe2\x96\x81 is not a space; emoji \xf0\x9f\x98\x80 and caf\xc3\xa9",
        std::string("a\0b", 3),
        "\xe2",
    };
    for (const auto& text : fixed) {
      tok->Encode(text, &ids);
      for (int32_t id : ids) CHECK((id >= 0 && id < tok->vocab_size()));
      CHECK(tok->Decode(ids) == text);
    }
    Rng rng(42);
    for (int trial = 0; trial < 200; ++trial) {
      std::string text(rng.NextBelow(120), ' ');
      for (char& c : text) c = static_cast<char>(rng.NextBelow(256));
      tok->Encode(text, &ids);
      REQUIRE(tok->Decode(ids) == text);
    }
    // On text like the training text it compresses: well under one token per byte.
    const std::string sample = MakeCorpus(9, 200);
    tok->Encode(sample, &ids);
    CHECK(static_cast<double>(ids.size()) < 0.6 * static_cast<double>(sample.size()));
    // End of document decodes to nothing; ids outside the vocabulary to U+FFFD.
    std::vector<int32_t> odd = {1, -1, 400};
    CHECK(tok->Decode(odd) == "\xEF\xBF\xBD\xEF\xBF\xBD");
  }
}

TEST_CASE("sentencepiece: a vocabulary too large for the text, or too small, is refused with the fix") {
  TempDir dir;
  const std::string in = dir / "small.txt";
  Spit(in, "tiny text\n");
  auto big = TrainSentencePiece({in}, "", "bpe", 5000);
  REQUIRE_FALSE(big.ok());
  CHECK(big.status().message().find("lower --vocab-size") != std::string::npos);
  auto small = TrainSentencePiece({in}, "", "unigram", 100);
  REQUIRE_FALSE(small.ok());
  CHECK(small.status().message().find("--vocab-size 300") != std::string::npos);
  CHECK(TrainSentencePiece({in}, "", "wordpiece", 1000).status().code() == Code::kInvalidArgument);
  CHECK(SentencePieceFromBytes("not a model", "junk").status().code() == Code::kDataLoss);
}

TEST_CASE("prepare-data with a trained tokenizer: model and metadata beside the dataset, checked by LoadTokenizer") {
  TempDir dir;
  const std::string in = dir / "corpus.txt";
  const std::string corpus = MakeCorpus(3, 2000);
  Spit(in, corpus);
  PrepareOptions opts;
  opts.inputs = {in};
  opts.doc_separator = "%";
  opts.output_prefix = dir / "sp";
  opts.tokenizer = "bpe";
  opts.vocab_size = 500;
  auto stats = PrepareDataset(opts);
  REQUIRE(stats.ok());
  CHECK(stats->tokenizer == "sentencepiece");
  CHECK(stats->vocab_size == 500);
  PrepareOptions bytes = opts;
  bytes.tokenizer = "byte";
  bytes.output_prefix = dir / "bytes";
  auto byte_stats = PrepareDataset(bytes);
  REQUIRE(byte_stats.ok());
  CHECK(stats->documents == byte_stats->documents);
  CHECK(stats->tokens < byte_stats->tokens / 2);  // fewer tokens per byte than one per byte

  auto info = ReadDatasetInfo(dir / "sp");
  REQUIRE(info.ok());
  CHECK(info->tokenizer == "sentencepiece");
  CHECK(info->tokenizer_model == dir / "sp.model");
  CHECK(info->vocab_size == 500);
  auto byte_info = ReadDatasetInfo(dir / "bytes");
  REQUIRE(byte_info.ok());
  CHECK(byte_info->tokenizer == "byte");
  auto none = ReadDatasetInfo(dir / "no-such-dataset");  // made before the metadata: bytes
  REQUIRE(none.ok());
  CHECK(none->tokenizer == "byte");

  // The tokens are the documents, each followed by the end-of-document token, in the Megatron layout.
  auto ds = IndexedDataset::Open(dir / "sp");
  REQUIRE(ds.ok());
  CHECK(ds->dtype_code() == kDTypeUint16);
  CHECK(ds->num_documents() == stats->documents);
  auto tok = LoadTokenizer("auto", dir / "sp");
  REQUIRE(tok.ok());
  std::vector<int32_t> all(static_cast<size_t>(ds->num_tokens()));
  REQUIRE(ds->ReadTokens(0, ds->num_tokens(), all.data()).ok());
  CHECK(std::count(all.begin(), all.end(), 1) == stats->documents);
  std::string without_separators;
  for (size_t at = 0; at < corpus.size();) {
    const size_t nl = corpus.find('\n', at);
    const std::string line = corpus.substr(at, nl - at + 1);
    if (line != "%\n") without_separators += line;
    at = nl + 1;
  }
  CHECK((*tok)->Decode(all) == without_separators);

  // The job's data.tokenizer against the dataset.
  CHECK(LoadTokenizer("sentencepiece", dir / "sp").ok());
  CHECK(LoadTokenizer(dir / "sp.model", dir / "sp").ok());
  auto wrong_kind = LoadTokenizer("byte", dir / "sp");
  REQUIRE_FALSE(wrong_kind.ok());
  CHECK(wrong_kind.status().message().find("data.tokenizer: auto") != std::string::npos);
  auto sp_on_bytes = LoadTokenizer("sentencepiece", dir / "bytes");
  REQUIRE_FALSE(sp_on_bytes.ok());
  CHECK(sp_on_bytes.status().message().find("byte tokenizer") != std::string::npos);
  CHECK(LoadTokenizer("gpt2", dir / "sp").status().code() == Code::kInvalidArgument);
  // Another model (trained on other text) is not the dataset's.
  const std::string other_in = dir / "other.txt";
  Spit(other_in, MakeCorpus(77, 500) + "zebra quagga okapi\n");
  auto other = TrainSentencePiece({other_in}, "", "unigram", 500);
  REQUIRE(other.ok());
  Spit(dir / "other.model", *other);
  auto mismatch = LoadTokenizer(dir / "other.model", dir / "sp");
  REQUIRE_FALSE(mismatch.ok());
  CHECK(mismatch.status().message().find("is not the model dataset") != std::string::npos);
  // The model beside the dataset replaced: caught by its fingerprint.
  Spit(dir / "sp.model", *other);
  auto replaced = LoadTokenizer("auto", dir / "sp");
  REQUIRE_FALSE(replaced.ok());
  CHECK(replaced.status().message().find("re-run megascale prepare-data") != std::string::npos);
  // A malformed metadata file names itself.
  Spit(dir / "bytes.json", "{\"tokenizer\": ");
  auto broken = LoadTokenizer("auto", dir / "bytes");
  REQUIRE_FALSE(broken.ok());
  CHECK(broken.status().message().find("bytes.json") != std::string::npos);

  // An existing .model file as the tokenizer: copied beside the new dataset.
  PrepareOptions reuse = opts;
  reuse.tokenizer = dir / "other.model";
  reuse.output_prefix = dir / "reuse";
  REQUIRE(PrepareDataset(reuse).ok());
  CHECK(Slurp(dir / "reuse.model") == *other);
  CHECK(LoadTokenizer("auto", dir / "reuse").ok());
  // A refused output costs no training and writes nothing.
  PrepareOptions again = opts;
  auto exists = PrepareDataset(again);
  CHECK(exists.status().code() == Code::kAlreadyExists);
}

}  // namespace ms::data
