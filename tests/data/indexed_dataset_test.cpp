// IndexedDataset / IndexedDatasetBuilder: round trips, every corruption class, Megatron cross-check.
#include <doctest/doctest.h>

#include <cstdlib>
#include <cstring>
#include <map>
#include <numeric>
#include <sstream>

#include "data/data.h"
#include "data/test_util.h"

namespace ms::data {
namespace {

using testing::Slurp;
using testing::Spit;
using testing::TempDir;

// Random documents of random (often odd) lengths, some empty.
std::vector<std::vector<int32_t>> RandomDocuments(Rng& rng, int n, int max_len, int vocab) {
  std::vector<std::vector<int32_t>> docs(n);
  for (auto& d : docs) {
    d.resize(rng.NextBelow(5) == 0 ? 0 : 1 + 2 * rng.NextBelow(max_len / 2));
    for (auto& t : d) t = static_cast<int32_t>(rng.NextBelow(vocab));
  }
  return docs;
}

std::vector<int32_t> Concat(const std::vector<std::vector<int32_t>>& docs) {
  std::vector<int32_t> all;
  for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());
  return all;
}

template <typename T>
void Put(std::string* s, T v) {
  s->append(reinterpret_cast<const char*>(&v), sizeof(T));
}

// A hand-made .idx in the Megatron layout.
std::string MakeIdx(int code, const std::vector<int32_t>& sizes, const std::vector<int64_t>& pointers,
                    const std::vector<int64_t>& doc_idx) {
  std::string s("MMIDIDX\0\0", 9);
  Put<uint64_t>(&s, 1);
  Put<uint8_t>(&s, static_cast<uint8_t>(code));
  Put<uint64_t>(&s, sizes.size());
  Put<uint64_t>(&s, doc_idx.size());
  for (auto v : sizes) Put(&s, v);
  for (auto v : pointers) Put(&s, v);
  for (auto v : doc_idx) Put(&s, v);
  return s;
}

// Expects Open to fail with DataLoss whose message contains every one of `needles`.
void ExpectDataLoss(const std::string& prefix, std::initializer_list<std::string_view> needles) {
  auto ds = IndexedDataset::Open(prefix);
  REQUIRE_FALSE(ds.ok());
  CHECK(ds.status().code() == Code::kDataLoss);
  for (auto n : needles) {
    INFO("message: " << ds.status().message() << " / expected to contain: " << n);
    CHECK(ds.status().message().find(n) != std::string::npos);
  }
}

}  // namespace

TEST_CASE("indexed dataset: write + read round trip (uint16 and int32, empty documents)") {
  TempDir dir;
  Rng rng(1234);
  for (int vocab : {256, 65499, 65500, 100003}) {
    CAPTURE(vocab);
    auto docs = RandomDocuments(rng, 1 + static_cast<int>(rng.NextBelow(60)), 97, vocab);
    docs.insert(docs.begin(), std::vector<int32_t>{});  // an empty first document
    docs.push_back({});                                 // and an empty last one
    if (vocab > 1000) docs[1] = {vocab - 1, 0, vocab - 1};
    const std::string prefix = dir / fmt::format("ds{}", vocab);
    REQUIRE(WriteIndexedDataset(prefix, docs, vocab).ok());
    auto all = Concat(docs);

    auto ds = IndexedDataset::Open(prefix);
    REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
    CHECK(ds->dtype_code() == (vocab < 65500 ? kDTypeUint16 : kDTypeInt32));
    CHECK(ds->num_sequences() == static_cast<int64_t>(docs.size()));
    CHECK(ds->num_documents() == static_cast<int64_t>(docs.size()));
    CHECK(ds->num_tokens() == static_cast<int64_t>(all.size()));
    CHECK(ds->max_token() == *std::max_element(all.begin(), all.end()));
    for (size_t i = 0; i < docs.size(); ++i) CHECK(ds->sequence_length(i) == static_cast<int64_t>(docs[i].size()));
    CHECK(ds->sequence_length(-1) == 0);
    CHECK(ds->sequence_length(docs.size()) == 0);

    std::vector<int32_t> out(all.size() + 1, -7);
    REQUIRE(ds->ReadTokens(0, all.size(), out.data()).ok());
    CHECK(std::equal(all.begin(), all.end(), out.begin()));
    CHECK(out[all.size()] == -7);  // nothing written past n
    for (int trial = 0; trial < 200; ++trial) {
      int64_t off = rng.NextBelow(all.size() + 1), n = rng.NextBelow(all.size() - off + 1);
      std::fill(out.begin(), out.end(), -7);
      REQUIRE(ds->ReadTokens(off, n, out.data()).ok());
      CHECK(std::equal(all.begin() + off, all.begin() + off + n, out.begin()));
      CHECK(out[n] == -7);
    }
    // Out of range: OutOfRange, out untouched.
    std::fill(out.begin(), out.end(), -7);
    for (auto [off, n] : std::vector<std::pair<int64_t, int64_t>>{{-1, 1},
                                                                  {0, -1},
                                                                  {0, static_cast<int64_t>(all.size()) + 1},
                                                                  {static_cast<int64_t>(all.size()) + 1, 0},
                                                                  {static_cast<int64_t>(all.size()), 1},
                                                                  {1, INT64_MAX}}) {
      Status s = ds->ReadTokens(off, n, out.data());
      CHECK(s.code() == Code::kOutOfRange);
    }
    CHECK(out[0] == -7);
    CHECK(ds->ReadTokens(all.size(), 0, out.data()).ok());

    // Moving keeps the mapping valid.
    IndexedDataset moved = std::move(*ds);
    REQUIRE(moved.ReadTokens(0, all.size(), out.data()).ok());
    CHECK(std::equal(all.begin(), all.end(), out.begin()));
  }
  CHECK(dir.List().size() == 8);  // four datasets, no temp files left
}

TEST_CASE("indexed dataset: a dataset with no tokens opens") {
  TempDir dir;
  REQUIRE(WriteIndexedDataset(dir / "empty", {}, 256).ok());
  auto ds = IndexedDataset::Open(dir / "empty");
  REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
  CHECK(ds->num_sequences() == 0);
  CHECK(ds->num_documents() == 0);
  CHECK(ds->num_tokens() == 0);
  CHECK(ds->max_token() == -1);
  REQUIRE(WriteIndexedDataset(dir / "empties", {{}, {}, {}}, 256).ok());
  auto ds2 = IndexedDataset::Open(dir / "empties");
  REQUIRE(ds2.ok());
  CHECK(ds2->num_documents() == 3);
  CHECK(ds2->num_tokens() == 0);
}

TEST_CASE("indexed dataset builder: rejects bad tokens and leaves nothing behind") {
  TempDir dir;
  CHECK(WriteIndexedDataset(dir / "a", {{1, 2}, {3, 256}}, 256).code() == Code::kInvalidArgument);
  CHECK(WriteIndexedDataset(dir / "b", {{-1}}, 256).code() == Code::kInvalidArgument);
  CHECK(WriteIndexedDataset(dir / "c", {{1}}, 0).code() == Code::kInvalidArgument);
  CHECK(dir.List().empty());
  {
    auto b = IndexedDatasetBuilder::Create(dir / "d", 256, false);
    REQUIRE(b.ok());
    REQUIRE(b->AddDocument(std::vector<int32_t>{1, 2, 3}).ok());
    CHECK(dir.List().size() == 1);  // the temp .bin
  }                                 // destroyed without Finish
  CHECK(dir.List().empty());
  // overwrite=false refuses existing output; Finish twice is an error.
  REQUIRE(WriteIndexedDataset(dir / "e", {{5}}, 256).ok());
  auto again = IndexedDatasetBuilder::Create(dir / "e", 256, false);
  CHECK(again.status().code() == Code::kAlreadyExists);
  auto b = IndexedDatasetBuilder::Create(dir / "e", 256, true);
  REQUIRE(b.ok());
  REQUIRE(b->AddDocument(std::vector<int32_t>{7, 8}).ok());
  REQUIRE(b->Finish().ok());
  CHECK(b->Finish().code() == Code::kFailedPrecondition);
  auto ds = IndexedDataset::Open(dir / "e");
  REQUIRE(ds.ok());
  CHECK(ds->num_tokens() == 2);
  CHECK(dir.List() == std::vector<std::string>{"e.bin", "e.idx"});
}

TEST_CASE("indexed dataset: hand-made files: every integer dtype, scattered pointers, multi-sequence documents") {
  TempDir dir;
  // Sequences stored in reverse order in .bin, with a gap: the reader must follow the pointers.
  const std::vector<std::vector<int64_t>> seqs = {{1, 2, 3}, {}, {4, 5}, {6, 7, 8, 9, 10}, {11}};
  for (int code : {1, 2, 3, 4, 5, 8}) {
    CAPTURE(code);
    const int item = code == 1 || code == 2 ? 1 : code == 3 || code == 8 ? 2 : code == 4 ? 4 : 8;
    std::string bin(3, 'x');  // a gap before the first sequence
    std::vector<int64_t> pointers(seqs.size());
    for (int i = static_cast<int>(seqs.size()) - 1; i >= 0; --i) {
      pointers[i] = bin.size();
      for (int64_t t : seqs[i]) bin.append(reinterpret_cast<const char*>(&t), item);  // little endian
    }
    std::vector<int32_t> sizes;
    for (const auto& s : seqs) sizes.push_back(s.size());
    const std::string prefix = dir / fmt::format("h{}", code);
    Spit(prefix + ".bin", bin);
    Spit(prefix + ".idx", MakeIdx(code, sizes, pointers, {0, 2, 2, 5}));  // 3 documents, one empty
    auto ds = IndexedDataset::Open(prefix);
    REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
    CHECK(ds->dtype_code() == code);
    CHECK(ds->itemsize() == item);
    CHECK(ds->num_sequences() == 5);
    CHECK(ds->num_documents() == 3);
    CHECK(ds->num_tokens() == 11);
    CHECK(ds->max_token() == 11);
    std::vector<int32_t> out(11);
    for (int off = 0; off <= 11; ++off) {
      for (int n = 0; off + n <= 11; ++n) {
        REQUIRE(ds->ReadTokens(off, n, out.data()).ok());
        for (int t = 0; t < n; ++t) CHECK(out[t] == off + t + 1);
      }
    }
    // Multimodal datasets append one mode byte per sequence: accepted.
    Spit(prefix + ".idx", MakeIdx(code, sizes, pointers, {0, 2, 2, 5}) + std::string(5, '\0'));
    CHECK(IndexedDataset::Open(prefix).ok());
  }
  // Float dtypes are not token datasets; negative ids are corrupt.
  Spit(dir / "f.bin", std::string(8, '\0'));
  Spit(dir / "f.idx", MakeIdx(7, {2}, {0}, {0, 1}));
  ExpectDataLoss(dir / "f", {"f.idx", "dtype code", "7", "floating-point"});
  Spit(dir / "f.idx", MakeIdx(2, {2}, {0}, {0, 1}));
  Spit(dir / "f.bin", std::string("\x05\xff", 2));
  ExpectDataLoss(dir / "f", {"f.bin", "negative token id -1"});
  Spit(dir / "f.idx", MakeIdx(5, {1}, {0}, {0, 1}));
  int64_t big = int64_t{1} << 40;
  Spit(dir / "f.bin", std::string(reinterpret_cast<const char*>(&big), 8));
  ExpectDataLoss(dir / "f", {"does not fit int32"});
}

TEST_CASE("indexed dataset: every corruption class gives DataLoss") {
  TempDir dir;
  Rng rng(99);
  auto docs = RandomDocuments(rng, 7, 21, 256);
  docs[3] = {1, 2, 3};
  const std::string good = dir / "good";
  REQUIRE(WriteIndexedDataset(good, docs, 256).ok());
  const std::string idx = Slurp(good + ".idx"), bin = Slurp(good + ".bin");
  const int64_t n = docs.size();
  REQUIRE(idx.size() == static_cast<size_t>(34 + 12 * n + 8 * (n + 1)));
  const std::string bad = dir / "bad";
  auto with = [&](const std::string& i, const std::string& b) {
    Spit(bad + ".idx", i);
    Spit(bad + ".bin", b);
  };
  auto patched = [&](size_t at, const auto& value) {
    std::string s = idx;
    std::memcpy(s.data() + at, &value, sizeof(value));
    return s;
  };
  const size_t sizes_at = 34, pointers_at = 34 + 4 * n, docs_at = 34 + 12 * n;

  SUBCASE("missing files are NotFound") {
    auto ds = IndexedDataset::Open(dir / "nothing");
    CHECK(ds.status().code() == Code::kNotFound);
    CHECK(ds.status().message().find("nothing.idx") != std::string::npos);
    Spit(bad + ".idx", idx);
    CHECK(IndexedDataset::Open(bad).status().code() == Code::kNotFound);
  }
  SUBCASE("truncated .idx at every offset") {
    for (size_t len = 0; len < idx.size(); ++len) {
      CAPTURE(len);
      with(idx.substr(0, len), bin);
      ExpectDataLoss(bad, {"bad.idx"});
    }
    with(idx.substr(0, 100), bin);
    ExpectDataLoss(bad, {"truncated", fmt::format("header says {} sequences", n),
                         fmt::format("needs {} bytes, file has 100", idx.size())});
    with(idx.substr(0, 20), bin);
    ExpectDataLoss(bad, {"truncated", "file has 20"});
  }
  SUBCASE("trailing bytes") {
    with(idx + "xyz", bin);
    ExpectDataLoss(bad, {"3 trailing bytes"});
  }
  SUBCASE("wrong magic") {
    for (size_t at : {0, 3, 8}) {
      std::string s = idx;
      s[at] ^= 0x20;
      with(s, bin);
      ExpectDataLoss(bad, {"bad magic", "not a Megatron-LM indexed dataset"});
    }
    with(std::string("TNTIDX\0\0", 8), bin);  // the legacy (non-mmap) format's magic, short file
    ExpectDataLoss(bad, {"bad magic"});
  }
  SUBCASE("wrong version") {
    for (uint64_t v : {uint64_t{0}, uint64_t{2}, ~uint64_t{0}}) {
      with(patched(9, v), bin);
      ExpectDataLoss(bad, {"version", fmt::format("{}", v)});
    }
  }
  SUBCASE("bad dtype code") {
    for (uint8_t c : {0, 6, 7, 9, 255}) {
      with(patched(17, c), bin);
      ExpectDataLoss(bad, {"dtype code", fmt::format("{}", c)});
    }
  }
  SUBCASE("absurd counts") {
    with(patched(18, uint64_t{1} << 63), bin);
    ExpectDataLoss(bad, {"truncated", "sequences"});
    with(patched(26, static_cast<uint64_t>(n + 2)), bin);
    ExpectDataLoss(bad, {"document indices"});
    with(patched(26, uint64_t{0}), bin);
    ExpectDataLoss(bad, {"bad.idx"});  // trailing bytes, then the count itself
  }
  SUBCASE("negative size") {
    with(patched(sizes_at + 4 * 3, int32_t{-3}), bin);
    ExpectDataLoss(bad, {"sizes[3]", "-3"});
  }
  SUBCASE("size larger than the .bin") {
    with(patched(sizes_at + 4 * 3, int32_t{1} << 30), bin);
    ExpectDataLoss(bad, {"pointers[3]", "past the end", "bad.bin"});
  }
  SUBCASE("pointer past the .bin end, negative pointer") {
    with(patched(pointers_at + 8 * 3, static_cast<int64_t>(bin.size()) + 2), bin);
    ExpectDataLoss(bad, {"pointers[3]", fmt::format("{}", bin.size() + 2)});
    with(patched(pointers_at + 8 * 3, static_cast<int64_t>(bin.size()) - 2), bin);  // 3 tokens, 1 fits
    ExpectDataLoss(bad, {"pointers[3]", "past the end"});
    with(patched(pointers_at + 8 * 2, int64_t{-8}), bin);
    ExpectDataLoss(bad, {"pointers[2]", "-8"});
    with(patched(pointers_at + 8 * 2, INT64_MAX), bin);
    ExpectDataLoss(bad, {"pointers[2]"});
  }
  SUBCASE("truncated .bin") {
    for (size_t cut : {size_t{1}, size_t{2}, bin.size() / 2, bin.size()}) {
      with(idx, bin.substr(0, bin.size() - cut));
      ExpectDataLoss(bad, {"truncated .bin?", fmt::format("{} bytes", bin.size() - cut)});
    }
  }
  SUBCASE("document indices: not starting at 0, not monotonic, not ending at the sequence count") {
    with(patched(docs_at, int64_t{1}), bin);
    ExpectDataLoss(bad, {"document_indices[0]", "expected 0"});
    with(patched(docs_at + 8 * 3, int64_t{1}), bin);  // [0, 1, 2, 1, 4, ...]
    ExpectDataLoss(bad, {"document_indices[3]", "not monotonic"});
    with(patched(docs_at + 8 * n, int64_t{n - 1}), bin);
    ExpectDataLoss(bad, {fmt::format("document_indices[{}]", n), fmt::format("expected the sequence count {}", n)});
    with(patched(docs_at + 8 * n, int64_t{n + 1}), bin);
    ExpectDataLoss(bad, {"expected the sequence count"});
  }
  SUBCASE("random byte flips never crash; what opens reads back") {
    for (int trial = 0; trial < 300; ++trial) {
      std::string s = idx, b = bin;
      const int flips = 1 + rng.NextBelow(3);
      for (int f = 0; f < flips; ++f) {
        if (rng.NextBelow(4) == 0 && !b.empty()) {
          b[rng.NextBelow(b.size())] ^= static_cast<char>(1 + rng.NextBelow(255));
        } else {
          s[rng.NextBelow(s.size())] ^= static_cast<char>(1 << rng.NextBelow(8));
        }
      }
      with(s, b);
      auto ds = IndexedDataset::Open(bad);
      if (!ds.ok()) {
        CHECK(ds.status().code() == Code::kDataLoss);
        continue;
      }
      std::vector<int32_t> out(ds->num_tokens());
      CHECK(ds->ReadTokens(0, ds->num_tokens(), out.data()).ok());
      for (int32_t t : out) CHECK((t >= 0 && t <= ds->max_token()));
    }
  }
}

// ---- cross-check with an independent numpy implementation of Megatron's reader/writer ----

namespace {

bool HavePythonNumpy() {
  static const bool ok = std::system("/usr/bin/python3 -c 'import numpy' >/dev/null 2>&1") == 0;
  return ok;
}

// Runs megatron_idx.py with `args`; returns its "key value" lines.
std::map<std::string, std::string> RunPy(const TempDir& dir, const std::string& args) {
  const std::string out = dir / "py.out";
  const std::string cmd =
      fmt::format("/usr/bin/python3 {}/tests/data/megatron_idx.py {} > {} 2>&1", MS_SOURCE_DIR, args, out);
  const int rc = std::system(cmd.c_str());
  INFO("command: " << cmd << "\noutput: " << Slurp(out));
  REQUIRE(rc == 0);
  std::map<std::string, std::string> kv;
  std::istringstream in(Slurp(out));
  std::string key, value;
  while (in >> key >> value) kv[key] = value;
  return kv;
}

std::map<std::string, std::string> Summary(const IndexedDataset& ds) {
  std::vector<int32_t> all(ds.num_tokens());
  REQUIRE(ds.ReadTokens(0, all.size(), all.data()).ok());
  int64_t sum = 0, weighted = 0;
  std::string head;
  for (size_t i = 0; i < all.size(); ++i) {
    sum += all[i];
    weighted += int64_t{all[i]} * static_cast<int64_t>(i % 1000 + 1);
    if (i < 10) head += (i ? "," : "") + std::to_string(all[i]);
  }
  return {{"dtype", std::to_string(ds.dtype_code())},
          {"sequences", std::to_string(ds.num_sequences())},
          {"documents", std::to_string(ds.num_documents())},
          {"tokens", std::to_string(ds.num_tokens())},
          {"sum", std::to_string(sum)},
          {"weighted", std::to_string(weighted)},
          {"max", std::to_string(ds.max_token())},
          {"head", head}};
}

}  // namespace

TEST_CASE("indexed dataset: cross-check with an independent Megatron-layout reader and writer (numpy)") {
  if (!HavePythonNumpy()) {
    MESSAGE("skipped: /usr/bin/python3 with numpy is not available");
    return;
  }
  TempDir dir;
  Rng rng(2024);
  SUBCASE("python reads what we write") {
    for (int vocab : {256, 100003}) {
      auto docs = RandomDocuments(rng, 41, 63, vocab);
      const std::string prefix = dir / fmt::format("ours{}", vocab);
      REQUIRE(WriteIndexedDataset(prefix, docs, vocab).ok());
      auto ds = IndexedDataset::Open(prefix);
      REQUIRE(ds.ok());
      CHECK(RunPy(dir, "read " + prefix) == Summary(*ds));
    }
  }
  SUBCASE("python reads a dataset prepare-data tokenized with a trained SentencePiece model") {
    std::string text;
    for (int i = 0; i < 4000; ++i) {
      text += fmt::format("line {} of the corpus, with word{} and word{}\n", i, rng.NextBelow(300), rng.NextBelow(50));
      if (i % 7 == 0) text += "%\n";
    }
    Spit(dir / "corpus.txt", text);
    PrepareOptions opts;
    opts.inputs = {dir / "corpus.txt"};
    opts.doc_separator = "%";
    opts.output_prefix = dir / "sp";
    opts.tokenizer = "bpe";
    opts.vocab_size = 1000;
    REQUIRE(PrepareDataset(opts).ok());
    auto ds = IndexedDataset::Open(dir / "sp");
    REQUIRE(ds.ok());
    CHECK(ds->dtype_code() == kDTypeUint16);
    CHECK(RunPy(dir, "read " + dir / "sp") == Summary(*ds));
  }
  SUBCASE("we read what python writes") {
    for (auto [dtype, code, vocab] : {std::tuple{"uint16", 8, 50000}, std::tuple{"int32", 4, 100000}}) {
      const std::string prefix = dir / fmt::format("theirs_{}", dtype);
      auto py = RunPy(dir, fmt::format("write {} {}", prefix, dtype));
      auto ds = IndexedDataset::Open(prefix);
      REQUIRE_MESSAGE(ds.ok(), ds.status().ToString());
      CHECK(ds->dtype_code() == code);
      CHECK(ds->num_sequences() == 37);
      CHECK(ds->num_documents() == 13);  // 3 sequences per document
      CHECK(py == Summary(*ds));
      // Token j of sequence i is (i * 7919 + j * 104729) % vocab.
      int64_t offset = 0;
      for (int64_t i = 0; i < 37; ++i) {
        const int64_t len = ds->sequence_length(i);
        CHECK(len == (i * 13) % 29);
        std::vector<int32_t> out(len);
        REQUIRE(ds->ReadTokens(offset, len, out.data()).ok());
        for (int64_t j = 0; j < len; ++j) CHECK(out[j] == (i * 7919 + j * 104729) % vocab);
        offset += len;
      }
    }
  }
}

}  // namespace ms::data
