// defines: the internal JSON reader/writer and FileInfo <-> JSON.
#include <cerrno>
#include <cmath>
#include <cstdlib>

#include <fmt/ranges.h>

#include "checkpoint/internal.h"

namespace ms::checkpoint {
namespace internal {

const Json* Json::Find(std::string_view key) const {
  for (const auto& [k, v] : members) {
    if (k == key) return &v;
  }
  return nullptr;
}

namespace {

class Parser {
 public:
  explicit Parser(std::string_view s) : s_(s) {}

  Result<Json> Document() {
    Json v;
    MS_RETURN_IF_ERROR(Value(&v, 0));
    SkipWs();
    if (pos_ != s_.size()) return Error("trailing characters after the JSON value");
    return v;
  }

 private:
  Status Error(std::string_view what) const { return DataLoss("JSON at byte {}: {}", pos_, what); }

  void SkipWs() {
    while (pos_ < s_.size() && (s_[pos_] == ' ' || s_[pos_] == '\n' || s_[pos_] == '\r' || s_[pos_] == '\t')) ++pos_;
  }

  Status Value(Json* v, int depth) {
    if (depth > 64) return Error("nested too deeply");
    SkipWs();
    if (pos_ >= s_.size()) return Error("unexpected end");
    char c = s_[pos_];
    if (c == '{') return Object(v, depth);
    if (c == '[') return Array(v, depth);
    if (c == '"') {
      v->type = Json::Type::kString;
      return String(&v->str);
    }
    if (c == '-' || (c >= '0' && c <= '9')) return Number(v);
    if (s_.substr(pos_, 4) == "true") {
      pos_ += 4;
      v->type = Json::Type::kBool;
      v->boolean = true;
      return Status::Ok();
    }
    if (s_.substr(pos_, 5) == "false") {
      pos_ += 5;
      v->type = Json::Type::kBool;
      return Status::Ok();
    }
    if (s_.substr(pos_, 4) == "null") {
      pos_ += 4;
      return Status::Ok();
    }
    return Error(fmt::format("unexpected character '{}'", c));
  }

  Status Object(Json* v, int depth) {
    v->type = Json::Type::kObject;
    ++pos_;  // {
    SkipWs();
    if (pos_ < s_.size() && s_[pos_] == '}') {
      ++pos_;
      return Status::Ok();
    }
    while (true) {
      SkipWs();
      if (pos_ >= s_.size() || s_[pos_] != '"') return Error("expected a key string");
      std::string key;
      MS_RETURN_IF_ERROR(String(&key));
      SkipWs();
      if (pos_ >= s_.size() || s_[pos_] != ':') return Error("expected ':'");
      ++pos_;
      Json item;
      MS_RETURN_IF_ERROR(Value(&item, depth + 1));
      v->members.emplace_back(std::move(key), std::move(item));
      SkipWs();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == '}') {
        ++pos_;
        return Status::Ok();
      }
      return Error("expected ',' or '}'");
    }
  }

  Status Array(Json* v, int depth) {
    v->type = Json::Type::kArray;
    ++pos_;  // [
    SkipWs();
    if (pos_ < s_.size() && s_[pos_] == ']') {
      ++pos_;
      return Status::Ok();
    }
    while (true) {
      Json item;
      MS_RETURN_IF_ERROR(Value(&item, depth + 1));
      v->items.push_back(std::move(item));
      SkipWs();
      if (pos_ < s_.size() && s_[pos_] == ',') {
        ++pos_;
        continue;
      }
      if (pos_ < s_.size() && s_[pos_] == ']') {
        ++pos_;
        return Status::Ok();
      }
      return Error("expected ',' or ']'");
    }
  }

  static void AppendUtf8(std::string* out, uint32_t cp) {
    if (cp < 0x80) {
      out->push_back(static_cast<char>(cp));
    } else if (cp < 0x800) {
      out->push_back(static_cast<char>(0xC0 | (cp >> 6)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else if (cp < 0x10000) {
      out->push_back(static_cast<char>(0xE0 | (cp >> 12)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    } else {
      out->push_back(static_cast<char>(0xF0 | (cp >> 18)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 12) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | ((cp >> 6) & 0x3F)));
      out->push_back(static_cast<char>(0x80 | (cp & 0x3F)));
    }
  }

  Result<uint32_t> Hex4() {
    if (pos_ + 4 > s_.size()) return Error("short \\u escape");
    uint32_t v = 0;
    for (int k = 0; k < 4; ++k) {
      char c = s_[pos_++];
      v <<= 4;
      if (c >= '0' && c <= '9') {
        v |= static_cast<uint32_t>(c - '0');
      } else if (c >= 'a' && c <= 'f') {
        v |= static_cast<uint32_t>(c - 'a' + 10);
      } else if (c >= 'A' && c <= 'F') {
        v |= static_cast<uint32_t>(c - 'A' + 10);
      } else {
        return Error("bad hex digit in \\u escape");
      }
    }
    return v;
  }

  Status String(std::string* out) {
    ++pos_;  // opening quote
    while (true) {
      if (pos_ >= s_.size()) return Error("unterminated string");
      char c = s_[pos_++];
      if (c == '"') return Status::Ok();
      if (static_cast<unsigned char>(c) < 0x20) return Error("control character in string");
      if (c != '\\') {
        out->push_back(c);
        continue;
      }
      if (pos_ >= s_.size()) return Error("unterminated escape");
      char e = s_[pos_++];
      switch (e) {
        case '"':
        case '\\':
        case '/':
          out->push_back(e);
          break;
        case 'b':
          out->push_back('\b');
          break;
        case 'f':
          out->push_back('\f');
          break;
        case 'n':
          out->push_back('\n');
          break;
        case 'r':
          out->push_back('\r');
          break;
        case 't':
          out->push_back('\t');
          break;
        case 'u': {
          MS_ASSIGN_OR_RETURN(uint32_t cp, Hex4());
          if (cp >= 0xD800 && cp < 0xDC00 && pos_ + 2 <= s_.size() && s_[pos_] == '\\' && s_[pos_ + 1] == 'u') {
            pos_ += 2;
            MS_ASSIGN_OR_RETURN(uint32_t lo, Hex4());
            if (lo < 0xDC00 || lo >= 0xE000) return Error("bad surrogate pair");
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
          }
          AppendUtf8(out, cp);
          break;
        }
        default:
          return Error(fmt::format("bad escape '\\{}'", e));
      }
    }
  }

  Status Number(Json* v) {
    size_t start = pos_;
    bool is_int = true;
    if (s_[pos_] == '-') ++pos_;
    while (pos_ < s_.size()) {
      char c = s_[pos_];
      if (c >= '0' && c <= '9') {
        ++pos_;
      } else if (c == '.' || c == 'e' || c == 'E' || c == '+' || c == '-') {
        is_int = false;
        ++pos_;
      } else {
        break;
      }
    }
    std::string text(s_.substr(start, pos_ - start));
    v->type = Json::Type::kNumber;
    char* endp = nullptr;
    errno = 0;
    if (is_int) {
      long long x = std::strtoll(text.c_str(), &endp, 10);
      if (errno == 0 && endp && *endp == '\0') {
        v->is_int = true;
        v->integer = x;
        v->number = static_cast<double>(x);
        return Status::Ok();
      }
    }
    errno = 0;
    v->number = std::strtod(text.c_str(), &endp);
    if (!endp || *endp != '\0' || text.empty() || text == "-") return Error(fmt::format("bad number '{}'", text));
    return Status::Ok();
  }

  std::string_view s_;
  size_t pos_ = 0;
};

}  // namespace

Result<Json> ParseJson(std::string_view text) {
  return Parser(text).Document();
}

void AppendJsonString(std::string* out, std::string_view s) {
  out->push_back('"');
  out->append(JsonEscape(s));
  out->push_back('"');
}

Result<int64_t> GetInt(const Json& obj, std::string_view key, std::string_view where) {
  const Json* v = obj.Find(key);
  if (!v) return DataLoss("{}: missing key '{}'", where, key);
  if (v->type != Json::Type::kNumber || !v->is_int) return DataLoss("{}: '{}' is not an integer", where, key);
  return v->integer;
}

Result<std::string> GetString(const Json& obj, std::string_view key, std::string_view where) {
  const Json* v = obj.Find(key);
  if (!v) return DataLoss("{}: missing key '{}'", where, key);
  if (v->type != Json::Type::kString) return DataLoss("{}: '{}' is not a string", where, key);
  return v->str;
}

Result<const Json*> GetArray(const Json& obj, std::string_view key, std::string_view where) {
  const Json* v = obj.Find(key);
  if (!v) return DataLoss("{}: missing key '{}'", where, key);
  if (v->type != Json::Type::kArray) return DataLoss("{}: '{}' is not an array", where, key);
  return v;
}

Result<model::ShardKind> ParseShardKind(std::string_view name) {
  for (auto k :
       {model::ShardKind::kReplicated, model::ShardKind::kRows, model::ShardKind::kCols, model::ShardKind::kQkvRows}) {
    if (ShardKindName(k) == name) return k;
  }
  return DataLoss("unknown shard kind '{}' (expected replicated, rows, cols or qkv_rows)", name);
}

void AppendFileInfoJson(std::string* out, const FileInfo& info) {
  *out += fmt::format("{{\"rank\": {}, \"name\": ", info.rank);
  AppendJsonString(out, info.name);
  *out += fmt::format(", \"size\": {}, \"crc32c\": {}, \"metadata\": ", info.size, info.crc32c);
  AppendJsonString(out, info.metadata);
  *out += ", \"pieces\": [";
  for (size_t i = 0; i < info.pieces.size(); ++i) {
    const PieceInfo& p = info.pieces[i];
    *out += i ? ",\n  {\"tensor\": " : "\n  {\"tensor\": ";
    AppendJsonString(out, p.tensor);
    *out += ", \"kind\": ";
    AppendJsonString(out, p.kind);
    *out += fmt::format(
        ", \"global_shape\": [{}], \"shard\": \"{}\", \"tp_size\": {}, \"tp_rank\": {}, \"begin\": {}, \"end\": {}, "
        "\"offset\": {}, \"crc32c\": {}}}",
        fmt::join(p.global_shape, ", "), ShardKindName(p.shard), p.tp_size, p.tp_rank, p.begin, p.end, p.offset,
        p.crc32c);
  }
  *out += "]}";
}

Result<FileInfo> FileInfoFromJson(const Json& j, std::string_view where) {
  if (j.type != Json::Type::kObject) return DataLoss("{}: a file entry is not an object", where);
  FileInfo f;
  MS_ASSIGN_OR_RETURN(int64_t rank, GetInt(j, "rank", where));
  f.rank = static_cast<int>(rank);
  MS_ASSIGN_OR_RETURN(f.name, GetString(j, "name", where));
  std::string fwhere = fmt::format("{}: file {}", where, f.name);
  MS_ASSIGN_OR_RETURN(f.size, GetInt(j, "size", fwhere));
  MS_ASSIGN_OR_RETURN(int64_t crc, GetInt(j, "crc32c", fwhere));
  if (crc < 0 || crc > 0xFFFFFFFFll) return DataLoss("{}: crc32c {} out of range", fwhere, crc);
  f.crc32c = static_cast<uint32_t>(crc);
  MS_ASSIGN_OR_RETURN(f.metadata, GetString(j, "metadata", fwhere));
  MS_ASSIGN_OR_RETURN(const Json* pieces, GetArray(j, "pieces", fwhere));
  f.pieces.reserve(pieces->items.size());
  for (size_t i = 0; i < pieces->items.size(); ++i) {
    const Json& pj = pieces->items[i];
    std::string pwhere = fmt::format("{} piece {}", fwhere, i);
    if (pj.type != Json::Type::kObject) return DataLoss("{}: not an object", pwhere);
    PieceInfo p;
    MS_ASSIGN_OR_RETURN(p.tensor, GetString(pj, "tensor", pwhere));
    MS_ASSIGN_OR_RETURN(p.kind, GetString(pj, "kind", pwhere));
    MS_ASSIGN_OR_RETURN(const Json* shape, GetArray(pj, "global_shape", pwhere));
    for (const Json& d : shape->items) {
      if (d.type != Json::Type::kNumber || !d.is_int) return DataLoss("{}: global_shape is not integers", pwhere);
      p.global_shape.push_back(d.integer);
    }
    MS_ASSIGN_OR_RETURN(std::string shard, GetString(pj, "shard", pwhere));
    MS_ASSIGN_OR_RETURN(p.shard, ParseShardKind(shard));
    MS_ASSIGN_OR_RETURN(int64_t tp_size, GetInt(pj, "tp_size", pwhere));
    MS_ASSIGN_OR_RETURN(int64_t tp_rank, GetInt(pj, "tp_rank", pwhere));
    p.tp_size = static_cast<int>(tp_size);
    p.tp_rank = static_cast<int>(tp_rank);
    MS_ASSIGN_OR_RETURN(p.begin, GetInt(pj, "begin", pwhere));
    MS_ASSIGN_OR_RETURN(p.end, GetInt(pj, "end", pwhere));
    MS_ASSIGN_OR_RETURN(p.offset, GetInt(pj, "offset", pwhere));
    MS_ASSIGN_OR_RETURN(int64_t pcrc, GetInt(pj, "crc32c", pwhere));
    if (pcrc < 0 || pcrc > 0xFFFFFFFFll) return DataLoss("{}: crc32c {} out of range", pwhere, pcrc);
    p.crc32c = static_cast<uint32_t>(pcrc);
    f.pieces.push_back(std::move(p));
  }
  return f;
}

}  // namespace internal

std::string FileInfo::ToJson() const {
  std::string out;
  internal::AppendFileInfoJson(&out, *this);
  return out;
}

Result<FileInfo> FileInfo::FromJson(std::string_view json) {
  MS_ASSIGN_OR_RETURN(internal::Json j, internal::ParseJson(json));
  return internal::FileInfoFromJson(j, "file info");
}

}  // namespace ms::checkpoint
