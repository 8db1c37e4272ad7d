// Sampler: seeded per-epoch Fisher-Yates order over fixed-length samples of the token stream.
#include <cmath>
#include <numeric>

#include "data/data.h"

namespace ms::data {

Result<Sampler> Sampler::Create(const IndexedDataset* ds, int seq_len, double valid_fraction, uint64_t seed) {
  if (ds == nullptr) return InvalidArgument("sampler: no dataset");
  if (seq_len < 1) return InvalidArgument("sampler: seq_len {} must be >= 1", seq_len);
  if (!(valid_fraction >= 0 && valid_fraction < 1)) {
    return InvalidArgument("sampler: valid_fraction {} must be in [0, 1)", valid_fraction);
  }
  const int64_t tokens = ds->num_tokens();
  const int64_t samples = tokens > 0 ? (tokens - 1) / seq_len : 0;
  int64_t valid = 0;
  if (valid_fraction > 0) {
    valid = std::max<int64_t>(1, static_cast<int64_t>(std::floor(static_cast<double>(samples) * valid_fraction)));
  }
  const int64_t needed_samples = valid_fraction > 0 ? 2 : 1;
  if (samples < needed_samples || samples - valid < 1) {
    return InvalidArgument(
        "{}: {} tokens make {} samples of seq_len + 1 = {} tokens (stride {}); need at least 1 train sample{} "
        "(at least {} tokens); use a shorter seq_len or more data",
        ds->prefix(), tokens, samples, seq_len + 1, seq_len,
        valid_fraction > 0 ? fmt::format(" + 1 valid sample (valid_fraction {})", valid_fraction) : "",
        needed_samples * int64_t{seq_len} + 1);
  }
  Sampler s;
  s.ds_ = ds;
  s.seq_len_ = seq_len;
  s.seed_ = seed;
  s.num_valid_ = valid;
  s.num_train_ = samples - valid;
  s.cache_ = std::make_unique<Cache>();
  return s;
}

Result<int64_t> Sampler::TrainSampleIndex(int64_t k) const {
  if (k < 0) return OutOfRange("sampler: training sample {} is negative", k);
  if (!cache_) return FailedPrecondition("sampler: used after move");
  const int64_t epoch = k / num_train_, i = k % num_train_;
  std::lock_guard<std::mutex> lock(cache_->mu);
  for (int slot = 0; slot < 2; ++slot) {
    if (cache_->epoch[slot] == epoch) {
      cache_->next = slot ^ 1;
      return cache_->perm[slot][i];
    }
  }
  // Not cached: build this epoch's permutation in the slot used least recently.
  const int slot = cache_->next;
  cache_->next ^= 1;
  std::vector<int64_t>& perm = cache_->perm[slot];
  perm.resize(num_train_);
  std::iota(perm.begin(), perm.end(), int64_t{0});
  Rng rng(seed_, static_cast<uint64_t>(epoch));
  for (int64_t j = num_train_ - 1; j > 0; --j) {
    std::swap(perm[j], perm[rng.NextBelow(static_cast<uint64_t>(j + 1))]);
  }
  cache_->epoch[slot] = epoch;
  return perm[i];
}

int64_t Sampler::cache_bytes() const {
  if (!cache_) return 0;
  std::lock_guard<std::mutex> lock(cache_->mu);
  return static_cast<int64_t>(sizeof(int64_t) * (cache_->perm[0].capacity() + cache_->perm[1].capacity()));
}

Status Sampler::GetTrain(int64_t k, int32_t* out) const {
  MS_ASSIGN_OR_RETURN(int64_t j, TrainSampleIndex(k));
  return ds_->ReadTokens(j * seq_len_, seq_len_ + 1, out);
}

Status Sampler::GetValid(int64_t k, int32_t* out) const {
  if (k < 0) return OutOfRange("sampler: validation sample {} is negative", k);
  if (num_valid_ == 0) return FailedPrecondition("sampler: no validation split (valid_fraction is 0)");
  const int64_t j = num_train_ + k % num_valid_;
  return ds_->ReadTokens(j * seq_len_, seq_len_ + 1, out);
}

}  // namespace ms::data
