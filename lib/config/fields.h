// Internal to lib/config: the table of settable keys that drives parsing, --set overrides, range
// checks and ToYaml, plus message helpers shared by parse.cpp and validate.cpp.
#pragma once

#include <functional>
#include <string>
#include <string_view>
#include <vector>

#include "config/config.h"

namespace ms::config::internal {

// One settable key of the job spec.
struct Field {
  std::string key;                   // dotted, e.g. "model.attention.window"
  std::string expected;              // "a positive integer", "one of \"adamw\", \"lamb\""
  std::string example;               // the default value as YAML text, for hints
  std::vector<std::string> choices;  // allowed spellings (enums, restricted strings); empty: any
  bool is_string = false;            // a YAML null / empty value means ""
  // Parses `text` into the field; false when it is not a valid value (type or range).
  std::function<bool(JobSpec*, std::string_view text)> set;
  // The current value as YAML text (strings quoted).
  std::function<std::string(const JobSpec&)> get;
  // The current value for messages (strings unquoted).
  std::function<std::string(const JobSpec&)> show;
  // Whether the current value is in range.
  std::function<bool(const JobSpec&)> valid;
};

// All fields, in ToYaml order; groups ("model", "model.attention") are contiguous.
const std::vector<Field>& Fields();
// The field with this dotted key, or nullptr.
const Field* FindField(std::string_view key);
// Next-level names below `prefix` ("" for the top level), in table order.
std::vector<std::string> ChildrenOf(std::string_view prefix);
// True when `key` is a group ("model", "model.attention").
bool IsGroup(std::string_view key);

// Levenshtein distance.
size_t EditDistance(std::string_view a, std::string_view b);
// The closest candidate if it is close enough to be a plausible typo, else "".
std::string ClosestMatch(std::string_view word, const std::vector<std::string>& candidates);
// "\"text\"" with control characters and quotes escaped.
std::string Quote(std::string_view text);
// "a, b, c".
std::string Join(const std::vector<std::string>& items, std::string_view sep = ", ");
// The message for a key that is not in `section` ("" = top level): did-you-mean, the right
// section for a key that lives elsewhere, or the list of valid keys.
std::string UnknownKeyMessage(std::string_view section, std::string_view name);
// The hint after a bad value: did-you-mean for choices, else an example.
std::string BadValueHint(const Field& field, std::string_view found, bool from_override);

}  // namespace ms::config::internal
