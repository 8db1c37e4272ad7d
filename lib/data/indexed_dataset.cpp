// IndexedDataset: validating mmap reader of Megatron-LM .bin/.idx (MMIDIDX version 1).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cerrno>
#include <cstring>
#include <limits>

#include "data/data.h"

namespace ms::data {
namespace {

static_assert(std::endian::native == std::endian::little, "the .bin/.idx format is little endian");

constexpr char kMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr size_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, sequence count, document count

template <typename T>
T Load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

// Bytes per token of an integer dtype code, 0 for float codes, -1 for unknown ones.
int ItemSize(int code) {
  switch (code) {
    case 1:
    case 2:
      return 1;
    case 3:
    case 8:
      return 2;
    case 4:
      return 4;
    case 5:
      return 8;
    case 6:
    case 7:
      return 0;
    default:
      return -1;
  }
}

// Maps a whole file read-only. An empty file gives {nullptr, 0}.
Status MapFile(const std::string& path, const uint8_t** data, size_t* size) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    int err = errno;
    if (err == ENOENT) return NotFound("{}: no such file (a dataset is <prefix>.bin + <prefix>.idx)", path);
    return ErrnoError(fmt::format("opening {}", path), err);
  }
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    return ErrnoError(fmt::format("stat of {}", path), err);
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    return InvalidArgument("{}: not a regular file", path);
  }
  *size = static_cast<size_t>(st.st_size);
  *data = nullptr;
  if (*size > 0) {
    void* p = ::mmap(nullptr, *size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      return ErrnoError(fmt::format("mmap of {}", path), err);
    }
    *data = static_cast<const uint8_t*>(p);
  }
  ::close(fd);
  return Status::Ok();
}

std::string Printable(const uint8_t* p, size_t n) {
  std::string s;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\') {
      s += static_cast<char>(p[i]);
    } else {
      s += fmt::format("\\x{:02x}", p[i]);
    }
  }
  return s;
}

template <typename T>
void ConvertAs(const uint8_t* src, int64_t n, int32_t* out) {
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<int32_t>(Load<T>(src + i * static_cast<int64_t>(sizeof(T))));
}

// Min and max token of n tokens of type T at src.
template <typename T>
void ScanAs(const uint8_t* src, int64_t n, int64_t* lo, int64_t* hi) {
  T mn = std::numeric_limits<T>::max(), mx = std::numeric_limits<T>::lowest();
  for (int64_t i = 0; i < n; ++i) {
    T v = Load<T>(src + i * static_cast<int64_t>(sizeof(T)));
    mn = std::min(mn, v);
    mx = std::max(mx, v);
  }
  if (n > 0) {
    *lo = std::min<int64_t>(*lo, static_cast<int64_t>(mn));
    *hi = std::max<int64_t>(*hi, static_cast<int64_t>(mx));
  }
}

}  // namespace

IndexedDataset::IndexedDataset(IndexedDataset&& o) noexcept {
  *this = std::move(o);
}

IndexedDataset& IndexedDataset::operator=(IndexedDataset&& o) noexcept {
  if (this == &o) return *this;
  Release();
  prefix_ = std::move(o.prefix_);
  idx_ = std::exchange(o.idx_, nullptr);
  idx_size_ = std::exchange(o.idx_size_, 0);
  bin_ = std::exchange(o.bin_, nullptr);
  bin_size_ = std::exchange(o.bin_size_, 0);
  dtype_code_ = o.dtype_code_;
  itemsize_ = o.itemsize_;
  num_sequences_ = std::exchange(o.num_sequences_, 0);
  num_documents_ = std::exchange(o.num_documents_, 0);
  num_tokens_ = std::exchange(o.num_tokens_, 0);
  max_token_ = std::exchange(o.max_token_, -1);
  contiguous_ = o.contiguous_;
  stream_base_ = o.stream_base_;
  seq_start_ = std::move(o.seq_start_);
  return *this;
}

IndexedDataset::~IndexedDataset() {
  Release();
}

void IndexedDataset::Release() {
  if (idx_) ::munmap(const_cast<uint8_t*>(idx_), idx_size_);
  if (bin_) ::munmap(const_cast<uint8_t*>(bin_), bin_size_);
  idx_ = bin_ = nullptr;
  idx_size_ = bin_size_ = 0;
}

int32_t IndexedDataset::SizeAt(int64_t i) const {
  return Load<int32_t>(idx_ + kHeaderBytes + 4 * i);
}

int64_t IndexedDataset::PointerAt(int64_t i) const {
  return Load<int64_t>(idx_ + kHeaderBytes + 4 * num_sequences_ + 8 * i);
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  if (i < 0 || i >= num_sequences_) return 0;
  return SizeAt(i);
}

void IndexedDataset::Convert(const uint8_t* src, int64_t n, int32_t* out) const {
  switch (dtype_code_) {
    case 1:
      return ConvertAs<uint8_t>(src, n, out);
    case 2:
      return ConvertAs<int8_t>(src, n, out);
    case 3:
      return ConvertAs<int16_t>(src, n, out);
    case 4:
      return ConvertAs<int32_t>(src, n, out);
    case 5:
      return ConvertAs<int64_t>(src, n, out);
    case 8:
      return ConvertAs<uint16_t>(src, n, out);
    default:
      return;  // unreachable: Open accepts only the codes above
  }
}

Result<IndexedDataset> IndexedDataset::Open(const std::string& prefix) {
  IndexedDataset ds;
  ds.prefix_ = prefix;
  const std::string idx_path = prefix + ".idx", bin_path = prefix + ".bin";
  MS_RETURN_IF_ERROR(MapFile(idx_path, &ds.idx_, &ds.idx_size_));
  MS_RETURN_IF_ERROR(MapFile(bin_path, &ds.bin_, &ds.bin_size_));
  const uint8_t* idx = ds.idx_;
  const uint64_t idx_size = ds.idx_size_;

  // Header.
  if (idx_size < kHeaderBytes) {
    const size_t have = std::min<size_t>(idx_size, 9);
    if (have > 0 && std::memcmp(idx, kMagic, have) != 0) {
      return DataLoss("{}: bad magic \"{}\": not a Megatron-LM indexed dataset (expected \"MMIDIDX\\x00\\x00\")",
                      idx_path, Printable(idx, have));
    }
    return DataLoss("{}: truncated: the header needs {} bytes, file has {}", idx_path, kHeaderBytes, idx_size);
  }
  if (std::memcmp(idx, kMagic, 9) != 0) {
    return DataLoss("{}: bad magic \"{}\": not a Megatron-LM indexed dataset (expected \"MMIDIDX\\x00\\x00\")",
                    idx_path, Printable(idx, 9));
  }
  const uint64_t version = Load<uint64_t>(idx + 9);
  if (version != 1) return DataLoss("{}: version: file has {}, this reader knows version 1", idx_path, version);
  ds.dtype_code_ = idx[17];
  ds.itemsize_ = ItemSize(ds.dtype_code_);
  if (ds.itemsize_ < 0) {
    return DataLoss(
        "{}: dtype code: {} is not a Megatron dtype (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, "
        "6 float64, 7 float32, 8 uint16)",
        idx_path, ds.dtype_code_);
  }
  if (ds.itemsize_ == 0) {
    return DataLoss("{}: dtype code: {} is a floating-point type; token datasets need an integer one", idx_path,
                    ds.dtype_code_);
  }
  const uint64_t seqs = Load<uint64_t>(idx + 18);
  const uint64_t docs = Load<uint64_t>(idx + 26);
  // 2^56 keeps the byte arithmetic below in range; such counts can never fit a real file anyway.
  constexpr uint64_t kCountLimit = uint64_t{1} << 56;
  if (seqs >= kCountLimit || docs >= kCountLimit) {
    return DataLoss("{}: truncated: header says {} sequences and {} document indices, file has {} bytes", idx_path,
                    seqs, docs, idx_size);
  }
  const uint64_t needed = kHeaderBytes + 12 * seqs + 8 * docs;
  if (idx_size < needed) {
    return DataLoss("{}: truncated: header says {} sequences and {} document indices, needs {} bytes, file has {}",
                    idx_path, seqs, docs, needed, idx_size);
  }
  if (idx_size != needed && idx_size != needed + seqs) {  // + seqs: multimodal sequence modes
    return DataLoss(
        "{}: size: header says {} sequences and {} document indices, needs {} bytes, file has {} "
        "({} trailing bytes)",
        idx_path, seqs, docs, needed, idx_size, idx_size - needed);
  }
  if (docs == 0) {
    return DataLoss("{}: document count: 0 document indices; a valid index has at least the entry 0", idx_path);
  }
  ds.num_sequences_ = static_cast<int64_t>(seqs);
  ds.num_documents_ = static_cast<int64_t>(docs) - 1;

  // Sizes and pointers against the .bin size; detect the usual back-to-back layout.
  const int64_t bin_size = static_cast<int64_t>(ds.bin_size_);
  const int64_t item = ds.itemsize_;
  int64_t total = 0;
  ds.stream_base_ = seqs > 0 ? ds.PointerAt(0) : 0;
  for (int64_t i = 0; i < ds.num_sequences_; ++i) {
    const int64_t size = ds.SizeAt(i), ptr = ds.PointerAt(i);
    if (size < 0) return DataLoss("{}: sizes[{}]: {} is negative", idx_path, i, size);
    if (ptr < 0 || ptr > bin_size) {
      return DataLoss("{}: pointers[{}]: byte offset {} is outside {} ({} bytes; truncated .bin?)", idx_path, i, ptr,
                      bin_path, bin_size);
    }
    if (size * item > bin_size - ptr) {
      return DataLoss(
          "{}: pointers[{}]: sequence of {} tokens x {} bytes at byte {} ends at byte {}, past the end of "
          "{} ({} bytes; truncated .bin?)",
          idx_path, i, size, item, ptr, ptr + size * item, bin_path, bin_size);
    }
    if (ptr != ds.stream_base_ + total * item) ds.contiguous_ = false;
    total += size;
  }
  ds.num_tokens_ = total;
  if (!ds.contiguous_) {
    ds.seq_start_.resize(seqs + 1);
    ds.seq_start_[0] = 0;
    for (int64_t i = 0; i < ds.num_sequences_; ++i) ds.seq_start_[i + 1] = ds.seq_start_[i] + ds.SizeAt(i);
  }

  // Document indices: 0, non-decreasing, ..., sequence count.
  const uint8_t* di = idx + kHeaderBytes + 12 * seqs;
  int64_t prev = Load<int64_t>(di);
  if (prev != 0) return DataLoss("{}: document_indices[0]: {}, expected 0", idx_path, prev);
  for (int64_t d = 1; d < static_cast<int64_t>(docs); ++d) {
    int64_t v = Load<int64_t>(di + 8 * d);
    if (v < prev) {
      return DataLoss("{}: document_indices[{}]: {} is less than document_indices[{}] = {} (not monotonic)", idx_path,
                      d, v, d - 1, prev);
    }
    prev = v;
  }
  if (prev != ds.num_sequences_) {
    return DataLoss("{}: document_indices[{}]: last entry is {}, expected the sequence count {}", idx_path, docs - 1,
                    prev, seqs);
  }

  // Token values.
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = -1;
  auto scan = [&](const uint8_t* src, int64_t n) {
    switch (ds.dtype_code_) {
      case 1:
        return ScanAs<uint8_t>(src, n, &lo, &hi);
      case 2:
        return ScanAs<int8_t>(src, n, &lo, &hi);
      case 3:
        return ScanAs<int16_t>(src, n, &lo, &hi);
      case 4:
        return ScanAs<int32_t>(src, n, &lo, &hi);
      case 5:
        return ScanAs<int64_t>(src, n, &lo, &hi);
      case 8:
        return ScanAs<uint16_t>(src, n, &lo, &hi);
      default:
        return;
    }
  };
  if (ds.contiguous_) {
    if (total > 0) scan(ds.bin_ + ds.stream_base_, total);
  } else {
    for (int64_t i = 0; i < ds.num_sequences_; ++i) {
      if (ds.SizeAt(i) > 0) scan(ds.bin_ + ds.PointerAt(i), ds.SizeAt(i));
    }
  }
  if (total > 0 && lo < 0) return DataLoss("{}: tokens: negative token id {} (corrupt .bin?)", bin_path, lo);
  if (hi > std::numeric_limits<int32_t>::max()) {
    return DataLoss("{}: tokens: token id {} does not fit int32", bin_path, hi);
  }
  ds.max_token_ = static_cast<int32_t>(hi);
  return ds;
}

Status IndexedDataset::ReadTokens(int64_t offset, int64_t n, int32_t* out) const {
  if (offset < 0 || n < 0 || offset > num_tokens_ || n > num_tokens_ - offset) {
    return OutOfRange("{}: {} tokens at offset {} requested, the dataset has {} tokens", prefix_, n, offset,
                      num_tokens_);
  }
  if (n == 0) return Status::Ok();
  if (contiguous_) {
    Convert(bin_ + stream_base_ + offset * itemsize_, n, out);
    return Status::Ok();
  }
  // Sequence holding `offset`: the last i with seq_start_[i] <= offset.
  int64_t i = std::upper_bound(seq_start_.begin(), seq_start_.end(), offset) - seq_start_.begin() - 1;
  while (n > 0) {
    const int64_t within = offset - seq_start_[i];
    const int64_t take = std::min(n, seq_start_[i + 1] - offset);
    if (take > 0) {
      Convert(bin_ + PointerAt(i) + within * itemsize_, take, out);
      out += take;
      offset += take;
      n -= take;
    }
    ++i;
  }
  return Status::Ok();
}

}  // namespace ms::data
