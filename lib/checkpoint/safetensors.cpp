// defines: ExportSafetensors (every "param" tensor, global fp32, atomically).
//
// safetensors layout: u64 little-endian N, then N bytes of JSON header
//   {"__metadata__": {...string values...}, "<name>": {"dtype": "F32", "shape": [...],
//    "data_offsets": [begin, end]}, ...}
// padded with spaces so the data starts 8-byte aligned, then the tensors' bytes back to back;
// data_offsets are relative to the start of the data.
#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include <fmt/ranges.h>

#include "checkpoint/internal.h"

namespace ms::checkpoint {

Status ExportSafetensors(const Checkpoint& checkpoint, const std::string& out_path) {
  const std::vector<std::string> names = checkpoint.tensors("param");
  if (names.empty()) return NotFound("checkpoint {} has no \"param\" tensors to export", checkpoint.dir());

  std::string header = "{\"__metadata__\": {\"format\": \"pt\", \"source\": \"megascale\", \"step\": ";
  internal::AppendJsonString(&header, std::to_string(checkpoint.step()));
  header += ", \"checkpoint\": ";
  internal::AppendJsonString(&header, checkpoint.dir());
  header += "}";
  std::vector<int64_t> numels;
  int64_t offset = 0;
  for (const auto& name : names) {
    MS_ASSIGN_OR_RETURN(std::vector<int64_t> shape, checkpoint.GlobalShape("param", name));
    int64_t numel = 1;
    for (int64_t d : shape) numel *= d;
    numels.push_back(numel);
    header += ", ";
    internal::AppendJsonString(&header, name);
    header += fmt::format(": {{\"dtype\": \"F32\", \"shape\": [{}], \"data_offsets\": [{}, {}]}}",
                          fmt::join(shape, ", "), offset, offset + numel * 4);
    offset += numel * 4;
  }
  header += "}";
  while ((8 + header.size()) % 8) header.push_back(' ');

  if (auto slash = out_path.rfind('/'); slash != std::string::npos && slash > 0) {
    MS_RETURN_IF_ERROR(MakeDirs(out_path.substr(0, slash)));
  }
  const std::string tmp = out_path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return ErrnoError(fmt::format("creating {}", tmp), errno);
  auto fail = [&](Status s) {
    ::close(fd);
    ::unlink(tmp.c_str());
    return s.WithContext(fmt::format("exporting {} to {}", checkpoint.dir(), out_path));
  };
  uint64_t n = header.size();
  unsigned char len[8];
  for (int i = 0; i < 8; ++i) len[i] = static_cast<unsigned char>(n >> (8 * i));
  Status s = internal::WriteAll(fd, len, 8, tmp);
  if (s.ok()) s = internal::WriteAll(fd, header.data(), header.size(), tmp);
  if (!s.ok()) return fail(s);
  std::vector<float> buf;
  for (size_t i = 0; i < names.size(); ++i) {
    buf.resize(static_cast<size_t>(numels[i]));
    s = checkpoint.ReadGlobal("param", names[i], buf.data());
    if (s.ok()) s = internal::WriteAll(fd, buf.data(), buf.size() * sizeof(float), tmp);
    checkpoint.DropCache();  // one tensor in memory at a time
    if (!s.ok()) return fail(s);
  }
  MS_RETURN_IF_ERROR_CTX(CommitTempFile(fd, tmp, out_path), "exporting {} to {}", checkpoint.dir(), out_path);
  auto slash = out_path.rfind('/');
  return internal::FsyncPath(slash == std::string::npos ? "." : slash == 0 ? "/" : out_path.substr(0, slash));
}

}  // namespace ms::checkpoint
