// YAML -> JobSpec (ParseJobSpec, LoadJobSpec), --set overrides, JobSpec -> YAML (ToYaml).
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <system_error>

#include <yaml-cpp/yaml.h>  // defines: YAML::LoadAll, YAML::Node, YAML::Exception (mark, msg)

#include "config/config.h"
#include "config/fields.h"

namespace ms::config {

using internal::Field;
using internal::Fields;
using internal::FindField;
using internal::Quote;

namespace {

using LineCol = std::pair<int, int>;

// 1-based (line, column); (0, 0) when yaml-cpp has no position (null nodes, empty documents).
LineCol MarkOf(const YAML::Node& n) {
  YAML::Mark m = n.Mark();
  if (m.line < 0 || m.column < 0) return {0, 0};
  return {m.line + 1, m.column + 1};
}

std::string At(std::string_view source, LineCol lc) {
  if (lc.first <= 0) return std::string(source);
  return fmt::format("{}:{}:{}", source, lc.first, lc.second);
}

std::string Found(const YAML::Node& n) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return "nothing (an empty value)";
    case YAML::NodeType::Scalar:
      return Quote(n.Scalar());
    case YAML::NodeType::Sequence:
      return "a list";
    case YAML::NodeType::Map:
      return "a map";
    default:
      return "an undefined value";
  }
}

// "model: {layers: 4}" — an example of a group written as a map, for hints.
std::string GroupExample(const std::string& group) {
  std::vector<std::string> children = internal::ChildrenOf(group);
  std::string leaf = group.substr(group.rfind('.') + 1);
  if (children.empty()) return leaf + ": {}";
  std::string child = group + "." + children[0];
  const Field* f = FindField(child);
  std::string value = f ? f->example : GroupExample(child).substr(children[0].size() + 2);
  return fmt::format("{}: {{{}: {}}}", leaf, children[0], value);
}

class Parser {
 public:
  explicit Parser(JobSpec* spec) : spec_(spec) {}

  Status ParseMap(const YAML::Node& node, const std::string& prefix) {
    const std::vector<std::string> children = internal::ChildrenOf(prefix);
    std::map<std::string, LineCol> seen;
    for (const auto& pair : node) {  // yaml-cpp's iterator value, held by the loop
      const YAML::Node key = pair.first;
      const YAML::Node value = pair.second;
      const LineCol km = MarkOf(key);
      if (!key.IsScalar()) {
        return InvalidArgument("{}: {}: expected a key name, found {}; keys are plain words such as \"{}\"", At(km),
                               prefix.empty() ? "job spec" : prefix, Found(key), children.front());
      }
      const std::string name = key.Scalar();
      const std::string full = prefix.empty() ? name : prefix + "." + name;
      // The sweep of `megascale bench` (docs/bench.md), read by lib/bench: a job spec may carry it, and
      // training ignores it, so that one file both trains and benches.
      if (prefix.empty() && name == "bench") continue;
      if (std::find(children.begin(), children.end(), name) == children.end()) {
        return InvalidArgument("{}: {}", At(km), internal::UnknownKeyMessage(prefix, name));
      }
      if (auto s = seen.find(name); s != seen.end()) {
        return InvalidArgument("{}: {}: duplicate key (first given at line {}); remove one of them", At(km), full,
                               s->second.first);
      }
      seen[name] = km;
      spec_->marks[full] = km;
      if (internal::IsGroup(full)) {
        if (value.IsNull()) continue;  // "model:" with nothing under it: all defaults
        if (!value.IsMap()) {
          return InvalidArgument(
              "{}: {}: expected a map of settings (indented \"key: value\" lines), found {}; "
              "for example {}",
              At(MarkOf(value)), full, Found(value), GroupExample(full));
        }
        MS_RETURN_IF_ERROR(ParseMap(value, full));
      } else {
        MS_RETURN_IF_ERROR(ParseValue(*FindField(full), value, km));
      }
    }
    return Status::Ok();
  }

  std::string At(LineCol lc) const { return ::ms::config::At(spec_->source, lc); }

 private:
  Status ParseValue(const Field& f, const YAML::Node& value, LineCol key_mark) {
    if (value.IsNull()) {
      if (f.is_string && f.set(spec_, "")) return Status::Ok();
      return InvalidArgument("{}: {}: expected {}, found nothing (an empty value){}", At(key_mark), f.key, f.expected,
                             internal::BadValueHint(f, "", false));
    }
    const LineCol vm = MarkOf(value);
    if (!value.IsScalar()) {
      return InvalidArgument("{}: {}: expected {}, found {}{}", At(vm), f.key, f.expected, Found(value),
                             internal::BadValueHint(f, "", false));
    }
    const std::string& text = value.Scalar();
    if (!f.set(spec_, text)) {
      return InvalidArgument("{}: {}: expected {}, found {}{}", At(vm), f.key, f.expected, Quote(text),
                             internal::BadValueHint(f, text, false));
    }
    return Status::Ok();
  }

  JobSpec* spec_;
};

std::string_view Trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

const char kSyntaxHint[] = "check the indentation (spaces, not tabs) and that each key is followed by \": \"";

}  // namespace

Result<JobSpec> ParseJobSpec(std::string_view yaml_text, std::string_view source_name) {
  JobSpec spec;
  spec.source = source_name.empty() ? std::string("<string>") : std::string(source_name);
  const std::string& src = spec.source;
  try {
    std::vector<YAML::Node> docs = YAML::LoadAll(std::string(yaml_text));
    if (docs.empty() || (docs.size() == 1 && docs[0].IsNull())) {
      return InvalidArgument(
          "{}: the job spec is empty; expected a map with the sections name, model, parallel, train, optimizer, "
          "data, checkpoint, runtime, log (see configs/tiny.yaml)",
          src);
    }
    if (docs.size() > 1) {
      return InvalidArgument(
          "{}: found {} YAML documents; a job spec is one document: remove the \"---\" separator before line {}",
          At(src, MarkOf(docs[1])), docs.size(), MarkOf(docs[1]).first);
    }
    const YAML::Node& root = docs[0];
    if (!root.IsMap()) {
      return InvalidArgument(
          "{}: expected the job spec to be a map of sections (\"model:\", \"train:\", ...), found {}; "
          "see configs/tiny.yaml for the layout",
          At(src, MarkOf(root)), Found(root));
    }
    Parser parser(&spec);
    MS_RETURN_IF_ERROR(parser.ParseMap(root, ""));
  } catch (const YAML::Exception& e) {
    LineCol lc = e.mark.is_null() ? LineCol{0, 0} : LineCol{e.mark.line + 1, e.mark.column + 1};
    return InvalidArgument("{}: YAML syntax error: {}; {}", At(src, lc), e.msg, kSyntaxHint);
  } catch (const std::exception& e) {
    return InvalidArgument("{}: cannot parse the job spec: {}", src, e.what());
  }
  return spec;
}

Result<JobSpec> LoadJobSpec(const std::string& path) {
  std::error_code ec;
  auto st = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(st)) {
    std::string cwd = std::filesystem::current_path(ec).string();
    return NotFound(
        "job spec {} not found (relative paths are taken from the current directory {}); check the path, "
        "e.g. configs/tiny.yaml",
        path, cwd);
  }
  if (std::filesystem::is_directory(st)) {
    return InvalidArgument("job spec {} is a directory; pass a YAML file, e.g. {}/tiny.yaml", path, path);
  }
  MS_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  return ParseJobSpec(text, path);
}

Status ApplyOverride(JobSpec* spec, std::string_view dotted_key_equals_value) {
  const std::string_view text = Trim(dotted_key_equals_value);
  const std::string where = fmt::format("--set {}", text);
  const size_t eq = text.find('=');
  if (eq == std::string_view::npos) {
    return InvalidArgument("{}: expected key=value, found no \"=\"; for example --set train.steps=10", where);
  }
  const std::string key(Trim(text.substr(0, eq)));
  std::string_view value = Trim(text.substr(eq + 1));
  if (value.size() >= 2 && (value.front() == '"' || value.front() == '\'') && value.back() == value.front()) {
    value = value.substr(1, value.size() - 2);
  }
  if (key.empty()) {
    return InvalidArgument("{}: expected key=value, found an empty key; for example --set train.steps=10", where);
  }
  // Walk the dotted key one segment at a time, for precise "unknown key" messages.
  std::string prefix;
  size_t start = 0;
  while (true) {
    size_t dot = key.find('.', start);
    std::string segment = key.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    std::vector<std::string> children = internal::ChildrenOf(prefix);
    if (std::find(children.begin(), children.end(), segment) == children.end()) {
      return InvalidArgument("{}: {}", where, internal::UnknownKeyMessage(prefix, segment));
    }
    prefix = prefix.empty() ? segment : prefix + "." + segment;
    if (dot == std::string::npos) break;
    if (!internal::IsGroup(prefix)) {
      return InvalidArgument("{}: {} is a value, not a section; set it as --set {}=...", where, prefix, prefix);
    }
    start = dot + 1;
  }
  if (internal::IsGroup(key)) {
    std::string child = key + "." + internal::ChildrenOf(key).front();
    const Field* f = FindField(child);
    return InvalidArgument("{}: {} is a section, not a value; set one of its keys, e.g. --set {}={}", where, key, child,
                           f ? f->example : "...");
  }
  const Field& f = *FindField(key);
  if (!f.set(spec, value)) {
    return InvalidArgument("{}: {}: expected {}, found {}{}", where, key, f.expected,
                           value.empty() ? std::string("nothing (an empty value)") : Quote(value),
                           internal::BadValueHint(f, value, true));
  }
  // Override texts are shown in messages and written (as comments) into <run_dir>/job.yaml: a
  // password in a URL is masked there (ResolveAndValidate then refuses it).
  std::string shown(text);
  if (key == "runtime.redis") {
    const size_t scheme = shown.find("://"), at = shown.rfind('@');
    const size_t colon = scheme == std::string::npos ? std::string::npos : shown.find(':', scheme + 3);
    if (at != std::string::npos && colon != std::string::npos && colon < at)
      shown.replace(colon + 1, at - colon - 1, "***");
  }
  spec->overrides[key] = shown;
  return Status::Ok();
}

std::string ToYaml(const JobSpec& spec) {
  std::string out = "# megascale job spec";
  if (spec.source != "<string>") out += fmt::format(" (from {})", spec.source);
  out += "\n";
  for (const auto& [key, text] : spec.overrides) out += fmt::format("# --set {}\n", text);
  std::vector<std::string> open;  // the groups the previous line was in
  for (const Field& f : Fields()) {
    std::vector<std::string> groups;
    size_t start = 0;
    for (size_t dot; (dot = f.key.find('.', start)) != std::string::npos; start = dot + 1) {
      groups.push_back(f.key.substr(start, dot - start));
    }
    std::string leaf = f.key.substr(start);
    size_t common = 0;
    while (common < open.size() && common < groups.size() && open[common] == groups[common]) ++common;
    open.resize(common);
    while (open.size() < groups.size()) {
      if (open.empty()) out += "\n";
      out += fmt::format("{:{}}{}:\n", "", 2 * open.size(), groups[open.size()]);
      open.push_back(groups[open.size()]);
    }
    out += fmt::format("{:{}}{}: {}\n", "", 2 * groups.size(), leaf, f.get(spec));
  }
  return out;
}

bool SameSettings(const JobSpec& a, const JobSpec& b) {
  return a.name == b.name && a.model == b.model && a.parallel == b.parallel && a.train == b.train &&
         a.optimizer == b.optimizer && a.data == b.data && a.checkpoint == b.checkpoint && a.runtime == b.runtime &&
         a.log == b.log;
}

std::string KeyLocation(const JobSpec& spec, std::string_view dotted_key) {
  std::string key(dotted_key);
  if (auto it = spec.overrides.find(key); it != spec.overrides.end()) return "--set " + it->second;
  while (true) {
    if (auto it = spec.marks.find(key); it != spec.marks.end()) return At(spec.source, it->second);
    size_t dot = key.rfind('.');
    if (dot == std::string::npos) return spec.source;
    key.resize(dot);  // not given: point at its section
  }
}

std::vector<std::string> AllKeys() {
  std::vector<std::string> keys;
  for (const Field& f : Fields()) keys.push_back(f.key);
  return keys;
}

}  // namespace ms::config
