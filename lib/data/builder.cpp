// IndexedDatasetBuilder and WriteIndexedDataset: streaming writer of Megatron-LM .bin/.idx.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <limits>

#include "data/data.h"

namespace ms::data {
namespace {

constexpr size_t kFlushBytes = size_t{1} << 20;
constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};

bool Exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

std::string DirName(const std::string& path) {
  size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

Status WriteAll(int fd, const void* data, size_t n, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    ssize_t w = ::write(fd, p, n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return ErrnoError(fmt::format("writing {}", path), errno);
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return Status::Ok();
}

Status FsyncDirOf(const std::string& path) {
  std::string dir = DirName(path);
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return ErrnoError(fmt::format("opening directory {}", dir), errno);
  int rc = ::fsync(fd);
  int err = errno;
  ::close(fd);
  if (rc != 0) return ErrnoError(fmt::format("fsync of directory {}", dir), err);
  return Status::Ok();
}

template <typename T>
void AppendPod(std::vector<char>* buf, T v) {
  size_t at = buf->size();
  buf->resize(at + sizeof(T));
  std::memcpy(buf->data() + at, &v, sizeof(T));
}

}  // namespace

Result<IndexedDatasetBuilder> IndexedDatasetBuilder::Create(const std::string& prefix, int vocab_size, bool overwrite) {
  if (prefix.empty()) return InvalidArgument("dataset output prefix is empty");
  if (vocab_size <= 0) return InvalidArgument("{}: vocab_size {} must be positive", prefix, vocab_size);
  const std::string bin = prefix + ".bin", idx = prefix + ".idx";
  if (!overwrite && (Exists(bin) || Exists(idx))) {
    return AlreadyExists("{}: output exists ({}{}{}); pass overwrite (--overwrite) to replace it", prefix,
                         Exists(bin) ? bin : "", Exists(bin) && Exists(idx) ? ", " : "", Exists(idx) ? idx : "");
  }
  MS_RETURN_IF_ERROR(MakeDirs(DirName(prefix)));
  static std::atomic<int> counter{0};
  const std::string suffix = fmt::format(".tmp-{}-{}", ::getpid(), counter.fetch_add(1));
  IndexedDatasetBuilder b;
  b.prefix_ = prefix;
  b.bin_tmp_ = bin + suffix;
  b.idx_tmp_ = idx + suffix;
  b.vocab_size_ = vocab_size;
  b.dtype_code_ = vocab_size < 65500 ? kDTypeUint16 : kDTypeInt32;
  b.overwrite_ = overwrite;
  b.bin_fd_ = ::open(b.bin_tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (b.bin_fd_ < 0) return ErrnoError(fmt::format("creating {}", b.bin_tmp_), errno);
  b.active_ = true;
  b.buffer_.reserve(kFlushBytes + 4096);
  return b;
}

IndexedDatasetBuilder::IndexedDatasetBuilder(IndexedDatasetBuilder&& o) noexcept {
  *this = std::move(o);
}

IndexedDatasetBuilder& IndexedDatasetBuilder::operator=(IndexedDatasetBuilder&& o) noexcept {
  if (this == &o) return *this;
  Abandon();
  prefix_ = std::move(o.prefix_);
  bin_tmp_ = std::move(o.bin_tmp_);
  idx_tmp_ = std::move(o.idx_tmp_);
  bin_fd_ = std::exchange(o.bin_fd_, -1);
  vocab_size_ = o.vocab_size_;
  dtype_code_ = o.dtype_code_;
  overwrite_ = o.overwrite_;
  active_ = std::exchange(o.active_, false);
  buffer_ = std::move(o.buffer_);
  sizes_ = std::move(o.sizes_);
  num_tokens_ = std::exchange(o.num_tokens_, 0);
  return *this;
}

IndexedDatasetBuilder::~IndexedDatasetBuilder() {
  Abandon();
}

void IndexedDatasetBuilder::Abandon() {
  if (bin_fd_ >= 0) ::close(bin_fd_);
  bin_fd_ = -1;
  if (active_) {
    ::unlink(bin_tmp_.c_str());
    ::unlink(idx_tmp_.c_str());
  }
  active_ = false;
}

Status IndexedDatasetBuilder::Flush() {
  if (buffer_.empty()) return Status::Ok();
  Status s = WriteAll(bin_fd_, buffer_.data(), buffer_.size(), bin_tmp_);
  buffer_.clear();
  return s;
}

Status IndexedDatasetBuilder::AddDocument(std::span<const int32_t> tokens) {
  if (!active_) return FailedPrecondition("{}: builder already finished", prefix_);
  if (tokens.size() > static_cast<size_t>(std::numeric_limits<int32_t>::max())) {
    return InvalidArgument("{}: document {} has {} tokens; the format stores sizes as int32", prefix_, sizes_.size(),
                           tokens.size());
  }
  for (size_t i = 0; i < tokens.size(); ++i) {
    if (tokens[i] < 0 || tokens[i] >= vocab_size_) {
      return InvalidArgument("{}: document {} token {}: id {} outside the vocabulary [0, {})", prefix_, sizes_.size(),
                             i, tokens[i], vocab_size_);
    }
  }
  for (int32_t t : tokens) {
    if (dtype_code_ == kDTypeUint16) {
      AppendPod(&buffer_, static_cast<uint16_t>(t));
    } else {
      AppendPod(&buffer_, t);
    }
    if (buffer_.size() >= kFlushBytes) {
      Status s = Flush();
      if (!s.ok()) {
        Abandon();
        return s;
      }
    }
  }
  sizes_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
  return Status::Ok();
}

Status IndexedDatasetBuilder::Finish() {
  if (!active_) return FailedPrecondition("{}: builder already finished", prefix_);
  auto fail = [&](Status s) {
    Abandon();
    return s.WithContext(fmt::format("writing dataset {}", prefix_));
  };
  Status s = Flush();
  if (!s.ok()) return fail(s);
  if (::fsync(bin_fd_) != 0) return fail(ErrnoError(fmt::format("fsync of {}", bin_tmp_), errno));
  int rc = ::close(bin_fd_);
  bin_fd_ = -1;
  if (rc != 0) return fail(ErrnoError(fmt::format("closing {}", bin_tmp_), errno));

  // The index, streamed through buffer_.
  int fd = ::open(idx_tmp_.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) return fail(ErrnoError(fmt::format("creating {}", idx_tmp_), errno));
  bin_fd_ = fd;  // so that Abandon closes it
  const uint64_t n = sizes_.size();
  buffer_.resize(sizeof(kMagic));  // (insert() trips a GCC 12 -Wstringop-overflow false positive)
  std::memcpy(buffer_.data(), kMagic, sizeof(kMagic));
  AppendPod<uint64_t>(&buffer_, 1);
  AppendPod<uint8_t>(&buffer_, static_cast<uint8_t>(dtype_code_));
  AppendPod<uint64_t>(&buffer_, n);
  AppendPod<uint64_t>(&buffer_, n + 1);
  auto flush_idx = [&](bool force) {
    if (!force && buffer_.size() < kFlushBytes) return Status::Ok();
    Status w = WriteAll(fd, buffer_.data(), buffer_.size(), idx_tmp_);
    buffer_.clear();
    return w;
  };
  for (int32_t size : sizes_) {
    AppendPod<int32_t>(&buffer_, size);
    if (s = flush_idx(false); !s.ok()) return fail(s);
  }
  const int64_t item = dtype_code_ == kDTypeUint16 ? 2 : 4;
  int64_t pointer = 0;
  for (int32_t size : sizes_) {
    AppendPod<int64_t>(&buffer_, pointer);
    pointer += size * item;
    if (s = flush_idx(false); !s.ok()) return fail(s);
  }
  for (uint64_t d = 0; d <= n; ++d) {
    AppendPod<int64_t>(&buffer_, static_cast<int64_t>(d));
    if (s = flush_idx(false); !s.ok()) return fail(s);
  }
  if (s = flush_idx(true); !s.ok()) return fail(s);
  if (::fsync(fd) != 0) return fail(ErrnoError(fmt::format("fsync of {}", idx_tmp_), errno));
  rc = ::close(fd);
  bin_fd_ = -1;
  if (rc != 0) return fail(ErrnoError(fmt::format("closing {}", idx_tmp_), errno));

  // Commit: no index while the .bin changes, so a reader never pairs an old .idx with a new .bin.
  const std::string bin = prefix_ + ".bin", idx = prefix_ + ".idx";
  if (!overwrite_ && (Exists(bin) || Exists(idx))) {
    return fail(AlreadyExists("{}: output appeared while writing; not replacing it", prefix_));
  }
  if (::unlink(idx.c_str()) != 0 && errno != ENOENT) return fail(ErrnoError(fmt::format("removing {}", idx), errno));
  if (::rename(bin_tmp_.c_str(), bin.c_str()) != 0) {
    return fail(ErrnoError(fmt::format("renaming {} to {}", bin_tmp_, bin), errno));
  }
  if (::rename(idx_tmp_.c_str(), idx.c_str()) != 0) {
    return fail(ErrnoError(fmt::format("renaming {} to {}", idx_tmp_, idx), errno));
  }
  active_ = false;
  buffer_ = {};
  return FsyncDirOf(idx);
}

Status WriteIndexedDataset(const std::string& prefix, const std::vector<std::vector<int32_t>>& documents,
                           int vocab_size) {
  MS_ASSIGN_OR_RETURN(IndexedDatasetBuilder builder, IndexedDatasetBuilder::Create(prefix, vocab_size, true));
  for (const auto& doc : documents) MS_RETURN_IF_ERROR(builder.AddDocument(doc));
  return builder.Finish();
}

}  // namespace ms::data
