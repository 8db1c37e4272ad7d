// Dataset metadata (<prefix>.json) and the choice of a job's tokenizer.
#include <sys/stat.h>

#include <cctype>
#include <map>

#include "data/data.h"

namespace ms::data {
namespace {

std::string DirOf(const std::string& prefix) {
  const size_t slash = prefix.rfind('/');
  return slash == std::string::npos ? "." : prefix.substr(0, slash);
}
std::string BaseOf(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

// A flat JSON object of string and integer values (what WriteDatasetInfo writes).
Result<std::map<std::string, std::string>> ParseFlatJson(std::string_view s, const std::string& file) {
  std::map<std::string, std::string> out;
  size_t i = 0;
  auto bad = [&](std::string_view what) {
    return DataLoss("{}: malformed dataset metadata at byte {}: {}; re-run megascale prepare-data", file, i, what);
  };
  auto ws = [&] {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  };
  auto str = [&](std::string* v) -> bool {
    if (i >= s.size() || s[i] != '"') return false;
    ++i;
    while (i < s.size() && s[i] != '"') {
      if (s[i] == '\\' && i + 1 < s.size()) {
        const char e = s[++i];
        *v += e == 'n' ? '\n' : e == 't' ? '\t' : e;
      } else {
        *v += s[i];
      }
      ++i;
    }
    if (i >= s.size()) return false;
    ++i;
    return true;
  };
  ws();
  if (i >= s.size() || s[i++] != '{') return bad("expected {");
  for (;;) {
    ws();
    if (i < s.size() && s[i] == '}') break;
    std::string key, value;
    if (!str(&key)) return bad("expected a key");
    ws();
    if (i >= s.size() || s[i++] != ':') return bad("expected :");
    ws();
    if (i < s.size() && s[i] == '"') {
      if (!str(&value)) return bad("unterminated string");
    } else {
      while (i < s.size() && (std::isalnum(static_cast<unsigned char>(s[i])) || s[i] == '-' || s[i] == '.')) {
        value += s[i++];
      }
      if (value.empty()) return bad("expected a value");
    }
    out[key] = value;
    ws();
    if (i < s.size() && s[i] == ',') {
      ++i;
      continue;
    }
    ws();
    if (i >= s.size() || s[i] != '}') return bad("expected , or }");
    break;
  }
  return out;
}

Result<int> ToInt(const std::map<std::string, std::string>& kv, const std::string& key, const std::string& file) {
  auto it = kv.find(key);
  if (it == kv.end()) return DataLoss("{}: no \"{}\"; re-run megascale prepare-data", file, key);
  char* end = nullptr;
  const long v = std::strtol(it->second.c_str(), &end, 10);
  if (end == it->second.c_str() || *end != '\0' || v < 0 || v > (1L << 31) - 1) {
    return DataLoss("{}: \"{}\" is {}, not a count; re-run megascale prepare-data", file, key, it->second);
  }
  return static_cast<int>(v);
}

}  // namespace

std::string Fingerprint(std::string_view bytes) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : bytes) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  return fmt::format("{:016x}", h);
}

Status WriteDatasetInfo(const std::string& prefix, const DatasetInfo& info, int64_t documents, int64_t tokens,
                        int64_t bytes_in) {
  std::string json = fmt::format(
      "{{\n  \"format\": \"megascale dataset\",\n  \"version\": 1,\n  \"tokenizer\": \"{}\",\n"
      "  \"tokenizer_model\": \"{}\",\n  \"model_fingerprint\": \"{}\",\n  \"vocab_size\": {},\n"
      "  \"eod_token\": {},\n  \"documents\": {},\n  \"tokens\": {},\n  \"bytes_in\": {}\n}}\n",
      JsonEscape(info.tokenizer), JsonEscape(BaseOf(info.tokenizer_model)), info.model_fingerprint, info.vocab_size,
      info.eod_token, documents, tokens, bytes_in);
  return WriteFileAtomic(prefix + ".json", json);
}

Result<DatasetInfo> ReadDatasetInfo(const std::string& prefix) {
  DatasetInfo info;
  const std::string file = prefix + ".json";
  struct stat st;
  if (::stat(file.c_str(), &st) != 0) return info;  // made before the metadata existed: bytes
  MS_ASSIGN_OR_RETURN(std::string text, ReadFile(file));
  MS_ASSIGN_OR_RETURN(auto kv, ParseFlatJson(text, file));
  info.tokenizer = kv["tokenizer"];
  if (info.tokenizer != "byte" && info.tokenizer != "sentencepiece") {
    return DataLoss("{}: tokenizer \"{}\" is not byte or sentencepiece; re-run megascale prepare-data", file,
                    info.tokenizer);
  }
  MS_ASSIGN_OR_RETURN(info.vocab_size, ToInt(kv, "vocab_size", file));
  MS_ASSIGN_OR_RETURN(info.eod_token, ToInt(kv, "eod_token", file));
  if (info.tokenizer == "sentencepiece") {
    if (kv["tokenizer_model"].empty()) return DataLoss("{}: no \"tokenizer_model\"; re-run prepare-data", file);
    info.tokenizer_model = DirOf(prefix) + "/" + kv["tokenizer_model"];
    info.model_fingerprint = kv["model_fingerprint"];
  }
  return info;
}

Result<std::unique_ptr<Tokenizer>> LoadTokenizer(std::string_view name, const std::string& dataset_prefix) {
  auto info_or = ReadDatasetInfo(dataset_prefix);
  if (!info_or.ok()) return info_or.status().WithContext("choosing the tokenizer");
  const DatasetInfo& info = *info_or;
  const bool model_file = name.find('/') != std::string_view::npos || name.ends_with(".model");
  if (name != "auto" && name != "byte" && name != "sentencepiece" && !model_file) {
    return InvalidArgument(
        "data.tokenizer \"{}\": use auto (what the dataset was made with), byte, sentencepiece "
        "or the path of a SentencePiece .model file",
        name);
  }
  const std::string made_with = info.tokenizer == "byte"
                                    ? std::string("the byte tokenizer")
                                    : fmt::format("the SentencePiece model {}", info.tokenizer_model);
  if (name == "byte" || (name == "auto" && info.tokenizer == "byte")) {
    if (info.tokenizer != "byte") {
      return InvalidArgument(
          "data.tokenizer is byte but dataset {} was made with {} ({} pieces); set data.tokenizer: auto",
          dataset_prefix, made_with, info.vocab_size);
    }
    return MakeTokenizer("byte");
  }
  if (info.tokenizer != "sentencepiece") {
    return InvalidArgument(
        "data.tokenizer is {} but dataset {} was made with the byte tokenizer; set data.tokenizer: auto (or byte), or "
        "re-tokenize with megascale prepare-data --tokenizer",
        name, dataset_prefix);
  }
  const std::string path = model_file ? std::string(name) : info.tokenizer_model;
  auto bytes = ReadFile(path);
  if (!bytes.ok()) {
    return bytes.status().WithContext(
        fmt::format("the tokenizer of dataset {} (named in {}.json)", dataset_prefix, dataset_prefix));
  }
  if (Fingerprint(*bytes) != info.model_fingerprint) {
    return InvalidArgument(
        "tokenizer {} (fingerprint {}) is not the model dataset {} was made with ({}, fingerprint {}){}", path,
        Fingerprint(*bytes), dataset_prefix, info.tokenizer_model, info.model_fingerprint,
        model_file ? "; set data.tokenizer: auto to use the dataset's own model"
                   : "; the model file beside the dataset was replaced: re-run megascale prepare-data");
  }
  MS_ASSIGN_OR_RETURN(auto tok, SentencePieceFromBytes(*bytes, path));
  if (tok->vocab_size() != info.vocab_size || tok->eod_token() != info.eod_token) {
    return DataLoss("{}: {} pieces (end of document {}), but {}.json says {} ({}); re-run megascale prepare-data", path,
                    tok->vocab_size(), tok->eod_token(), dataset_prefix, info.vocab_size, info.eod_token);
  }
  return tok;
}

}  // namespace ms::data
