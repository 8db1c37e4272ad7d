// Internal to the runner: what a rank saves in a checkpoint and how it restores it.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "checkpoint/checkpoint.h"
#include "config/config.h"
#include "model/model.h"
#include "optim/optim.h"
#include "runner/runner.h"

namespace ms::bootstrap {
class Store;
}

namespace ms::runner {

// A Coordinator over the job's Redis store: key ckpt/<step>/<rank> holds the rank's FileInfo
// (or "!error ..."); rank 0 waits for all of them. Thread-safe: two new connections (clones of
// `store`), one for the marks and one for rank 0's wait, so a mark never waits behind a wait.
Result<std::shared_ptr<checkpoint::Coordinator>> MakeStoreCoordinator(const bootstrap::Store& store);

// The model description a checkpoint must match to be loaded into `spec`'s model.
std::string ModelSignature(const config::ModelSpec& m);
// Metadata blob of a rank: "key=value" lines (step, consumed_samples: the training samples consumed
// once `step` is done, the data loader's position; seed, model, layout).
std::string MakeMetadata(const config::JobSpec& spec, int64_t step, int64_t consumed_samples);
Result<int64_t> MetadataStep(const std::string& metadata);
// One value of a metadata blob ("" when absent).
std::string MetadataValue(const std::string& metadata, const std::string& key);
Status CheckCompatible(const checkpoint::Checkpoint& ckpt, const config::JobSpec& spec);

// The pieces this rank saves: its parameter shards (data-parallel rank 0 only; replicated
// tensors from tensor-parallel rank 0; never the tied replica) and the optimizer state of the
// segments it counts.
// On a host device the pieces point at the live buffers; on a GPU (or the emulated one) parameters and
// optimizer state are first copied into `staging` (host memory, grown as needed and reused), and the pieces
// point there (with stage = false only the sizes are meaningful: used to reserve snapshot memory).
struct HostStaging {
  std::vector<float> params, exp_avg, exp_avg_sq;
};
Result<std::vector<checkpoint::PieceRef>> RankPieces(const model::Gpt& gpt, optim::Optimizer& opt, int dp_rank,
                                                     HostStaging* staging, bool stage = true);
// Runs `work` on the leader of a group (leader = true) while its other members wait for it
// through `store`, under `key` (unique per use). A waiter fails when the leader reports a failure
// or stops making progress (its beat thread stops) for `silence_s`; a long but live leader is
// never timed out. store == nullptr (one rank): runs work when leader.
Status WaitForLeader(bootstrap::Store* store, const std::string& key, bool leader, double silence_s,
                     const std::function<Status()>& work);
// Restores parameters (read by data-parallel rank 0, broadcast over dp; the others wait for the
// read through WaitForLeader) and optimizer state, tensor by tensor, dropping each reassembled
// global tensor once read; a non-host device is filled through host staging buffers.
Status RestoreRank(const checkpoint::Checkpoint& ckpt, model::Gpt& gpt, optim::Optimizer& opt, Runtime& rt);

}  // namespace ms::runner
