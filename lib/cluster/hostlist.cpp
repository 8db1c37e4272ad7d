// ExpandHostList, ExpandCounts: Slurm's compressed host lists and per-node counts.
#include <charconv>

#include "cluster/cluster.h"

namespace ms::cluster {
namespace {

bool ParseNonNegative(std::string_view s, long long* out) {
  if (s.empty() || s.size() > 18) return false;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), *out);
  return ec == std::errc() && p == s.data() + s.size() && *out >= 0;
}

// Expands one bracket range list "01-04,7" into its numbers, keeping the width of zero-padded ones.
Status ExpandRanges(std::string_view ranges, std::string_view list, std::vector<std::string>* out) {
  size_t start = 0;
  while (start <= ranges.size()) {
    size_t end = ranges.find(',', start);
    if (end == std::string_view::npos) end = ranges.size();
    std::string_view item = ranges.substr(start, end - start);
    const size_t dash = item.find('-');
    std::string_view lo_s = item.substr(0, dash);
    std::string_view hi_s = dash == std::string_view::npos ? lo_s : item.substr(dash + 1);
    long long lo = 0, hi = 0;
    if (!ParseNonNegative(lo_s, &lo) || !ParseNonNegative(hi_s, &hi) || hi < lo) {
      return InvalidArgument("host list '{}': bad range '{}' (expected N or N-M with N <= M)", list, item);
    }
    if (hi - lo > 100000) return InvalidArgument("host list '{}': range '{}' is too large", list, item);
    const size_t width = lo_s.size() > 1 && lo_s[0] == '0' ? lo_s.size() : 0;
    for (long long v = lo; v <= hi; ++v) out->push_back(fmt::format("{:0{}}", v, width));
    start = end + 1;
  }
  return Status::Ok();
}

}  // namespace

Result<std::vector<std::string>> ExpandHostList(std::string_view list) {
  std::vector<std::string> hosts;
  // Split at top-level commas (commas inside brackets belong to ranges).
  std::vector<std::string_view> items;
  int depth = 0;
  size_t start = 0;
  for (size_t i = 0; i <= list.size(); ++i) {
    if (i == list.size() || (list[i] == ',' && depth == 0)) {
      items.push_back(list.substr(start, i - start));
      start = i + 1;
    } else if (list[i] == '[') {
      if (++depth > 1) return InvalidArgument("host list '{}': nested brackets", list);
    } else if (list[i] == ']') {
      if (--depth < 0) return InvalidArgument("host list '{}': ']' without '['", list);
    }
  }
  if (depth != 0) return InvalidArgument("host list '{}': '[' without ']'", list);
  for (std::string_view item : items) {
    if (item.empty()) return InvalidArgument("host list '{}': an empty name", list);
    // Expand bracket groups left to right: "a[1-2]b[3-4]" -> a1b3 a1b4 a2b3 a2b4.
    std::vector<std::string> partial{""};
    size_t pos = 0;
    while (pos < item.size()) {
      const size_t open = item.find('[', pos);
      const std::string_view text =
          item.substr(pos, open == std::string_view::npos ? std::string_view::npos : open - pos);
      for (auto& p : partial) p += text;
      if (open == std::string_view::npos) break;
      const size_t close = item.find(']', open);
      std::vector<std::string> numbers;
      MS_RETURN_IF_ERROR(ExpandRanges(item.substr(open + 1, close - open - 1), list, &numbers));
      std::vector<std::string> next;
      next.reserve(partial.size() * numbers.size());
      for (const auto& p : partial) {
        for (const auto& n : numbers) next.push_back(p + n);
      }
      partial = std::move(next);
      pos = close + 1;
    }
    for (auto& p : partial) hosts.push_back(std::move(p));
  }
  return hosts;
}

Result<std::vector<int>> ExpandCounts(std::string_view counts) {
  std::vector<int> out;
  size_t start = 0;
  while (start <= counts.size()) {
    size_t end = counts.find(',', start);
    if (end == std::string_view::npos) end = counts.size();
    std::string_view item = counts.substr(start, end - start);
    long long n = 0, times = 1;
    const size_t paren = item.find("(x");
    if (paren != std::string_view::npos) {
      if (!item.ends_with(")") || !ParseNonNegative(item.substr(paren + 2, item.size() - paren - 3), &times)) {
        return InvalidArgument("counts '{}': bad repetition '{}' (expected N(xM))", counts, item);
      }
      item = item.substr(0, paren);
    }
    if (!ParseNonNegative(item, &n) || n > 1 << 20 || times > 1 << 20) {
      return InvalidArgument("counts '{}': bad count '{}'", counts, item);
    }
    for (long long i = 0; i < times; ++i) out.push_back(static_cast<int>(n));
    start = end + 1;
  }
  return out;
}

}  // namespace ms::cluster
