// PrepareDataset: documents split on a separator line, EOD, overwrite policy, no partial output.
#include <doctest/doctest.h>

#include "data/data.h"
#include "data/test_util.h"

namespace ms::data {
namespace {

using namespace std::string_literals;
using testing::Slurp;
using testing::Spit;
using testing::TempDir;

// The text of every sequence of a byte-tokenized dataset (EOD tokens kept as '\0').
std::vector<std::string> Sequences(const IndexedDataset& ds) {
  std::vector<std::string> docs;
  int64_t offset = 0;
  for (int64_t i = 0; i < ds.num_sequences(); ++i) {
    std::vector<int32_t> ids(ds.sequence_length(i));
    REQUIRE(ds.ReadTokens(offset, ids.size(), ids.data()).ok());
    offset += ids.size();
    std::string s;
    for (int32_t t : ids) s += static_cast<char>(t);
    docs.push_back(s);
  }
  return docs;
}

}  // namespace

TEST_CASE("prepare-data: fortune-style files split on '%' lines") {
  TempDir dir;
  const std::string a = dir / "a.txt", b = dir / "b.txt";
  const std::string text_a = "first\nfortune\n%\nsecond\n%\n%\nthird, CRLF\r\n%\r\n  %  \nlast without newline";
  const std::string text_b = "%\nfrom b\n%\n";
  Spit(a, text_a);
  Spit(b, text_b);
  PrepareOptions opts;
  opts.inputs = {a, b};
  opts.output_prefix = dir / "out/fortunes";  // the parent directory is created
  opts.doc_separator = "%";
  std::vector<std::pair<int64_t, int64_t>> calls;
  auto stats = PrepareDataset(opts, [&](int64_t done, int64_t total) { calls.emplace_back(done, total); });
  REQUIRE_MESSAGE(stats.ok(), stats.status().ToString());
  const std::vector<std::string> expected = {"first\nfortune\n\0"s, "second\n\0"s, "third, CRLF\r\n\0"s,
                                             "  %  \nlast without newline\0"s, "from b\n\0"s};
  CHECK(stats->documents == 5);
  int64_t tokens = 0;
  for (const auto& e : expected) tokens += e.size();
  CHECK(stats->tokens == tokens);
  CHECK(stats->bytes_in == static_cast<int64_t>(text_a.size() + text_b.size()));
  CHECK(stats->seconds >= 0);
  REQUIRE_FALSE(calls.empty());
  CHECK(calls.back() == std::pair<int64_t, int64_t>{stats->bytes_in, stats->bytes_in});

  auto ds = IndexedDataset::Open(opts.output_prefix);
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  CHECK(ds->dtype_code() == kDTypeUint16);
  CHECK(ds->num_documents() == 5);
  CHECK(ds->num_tokens() == tokens);
  CHECK(Sequences(*ds) == expected);
  auto tok = MakeTokenizer("byte");
  REQUIRE(tok.ok());
  std::vector<int32_t> ids(ds->sequence_length(0));
  REQUIRE(ds->ReadTokens(0, ids.size(), ids.data()).ok());
  CHECK((*tok)->Decode(ids) == "first\nfortune\n");
  CHECK(dir.List() == std::vector<std::string>{"a.txt", "b.txt", "out"});
}

TEST_CASE("prepare-data: whole files as documents, without EOD; random text round trips") {
  TempDir dir;
  Rng rng(11);
  std::vector<std::string> texts;
  PrepareOptions opts;
  for (int f = 0; f < 5; ++f) {
    std::string t(f == 2 ? 0 : 1 + rng.NextBelow(3000), ' ');  // file 2 is empty: skipped
    for (char& c : t) c = static_cast<char>(1 + rng.NextBelow(255));
    texts.push_back(t);
    opts.inputs.push_back(dir / fmt::format("f{}.txt", f));
    Spit(opts.inputs.back(), t);
  }
  opts.output_prefix = dir / "whole";
  opts.append_eod = false;
  opts.doc_separator = "";
  auto stats = PrepareDataset(opts);
  REQUIRE_MESSAGE(stats.ok(), stats.status().ToString());
  CHECK(stats->documents == 4);
  auto ds = IndexedDataset::Open(opts.output_prefix);
  REQUIRE(ds.ok());
  texts.erase(texts.begin() + 2);
  CHECK(Sequences(*ds) == texts);
}

TEST_CASE("prepare-data: refuses to overwrite, and leaves nothing behind on failure") {
  TempDir dir;
  const std::string in = dir / "in.txt";
  Spit(in, "one\n%\ntwo\n");
  PrepareOptions opts;
  opts.inputs = {in};
  opts.output_prefix = dir / "ds";
  opts.doc_separator = "%";
  REQUIRE(PrepareDataset(opts).ok());
  const std::string bin = Slurp(dir / "ds.bin"), idx = Slurp(dir / "ds.idx");

  Spit(in, "changed\n");
  auto again = PrepareDataset(opts);
  REQUIRE_FALSE(again.ok());
  CHECK(again.status().code() == Code::kAlreadyExists);
  CHECK(again.status().message().find("overwrite") != std::string::npos);
  CHECK(Slurp(dir / "ds.bin") == bin);
  CHECK(Slurp(dir / "ds.idx") == idx);

  opts.overwrite = true;
  auto replaced = PrepareDataset(opts);
  REQUIRE(replaced.ok());
  CHECK(replaced->documents == 1);
  CHECK(Slurp(dir / "ds.bin") != bin);

  // Failures: nothing new appears in the directory, the old dataset is untouched.
  const auto before = dir.List();
  const std::string bin2 = Slurp(dir / "ds.bin");
  PrepareOptions missing = opts;
  missing.inputs = {in, dir / "no-such-file.txt"};
  missing.output_prefix = dir / "fresh";
  auto r = PrepareDataset(missing);
  CHECK(r.status().code() == Code::kNotFound);
  CHECK(r.status().message().find("no-such-file.txt") != std::string::npos);
  missing.output_prefix = dir / "ds";  // overwrite allowed, but an input is missing: old data stays
  CHECK(PrepareDataset(missing).status().code() == Code::kNotFound);
  CHECK(Slurp(dir / "ds.bin") == bin2);

  const std::string nul = dir / "nul.txt";
  Spit(nul, "good\n%\nbad \0 byte\n"s);
  PrepareOptions with_nul = opts;
  with_nul.inputs = {in, nul};
  with_nul.output_prefix = dir / "nul";
  auto n = PrepareDataset(with_nul);
  CHECK(n.status().code() == Code::kInvalidArgument);
  CHECK(n.status().message().find("nul.txt") != std::string::npos);
  CHECK(n.status().message().find("byte 7") != std::string::npos);
  CHECK(n.status().message().find("NUL") != std::string::npos);

  PrepareOptions bad_tok = opts;
  bad_tok.tokenizer = "sentencepiece";
  bad_tok.output_prefix = dir / "tok";
  CHECK(PrepareDataset(bad_tok).status().code() == Code::kInvalidArgument);
  PrepareOptions no_inputs = opts;
  no_inputs.inputs.clear();
  CHECK(PrepareDataset(no_inputs).status().code() == Code::kInvalidArgument);

  auto after = dir.List();
  after.erase(std::find(after.begin(), after.end(), "nul.txt"));
  CHECK(after == before);
}

}  // namespace ms::data
