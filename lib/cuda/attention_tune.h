// The tensor-core attention's autotuning (runtime.attention_autotune; internal to the CUDA backend): at the first call
// of each pass and shape, every variant of megascale's kernels that gives the same bits as the default — the wide
// forward (kernels::SetAttentionTcWideForward), the split dK/dV kernel (SetAttentionTcSplitDkDv), the product loops
// with run-time instead of compile-time bounds (SetAttentionTcFixedBounds(false)) — is run on the call's own inputs,
// its outputs compared with the default's bit for bit (a variant that differs is left out, with a warning: a kernel
// bug on this device), and the fastest of the agreeing ones (the median of 3 runs, timed with events on the stream)
// runs that call and every later one of the same key. Because all candidates give the default's bits, the choice
// changes no result: a run with tuning trains the bits of one without, and a resume may choose otherwise.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/core.h"

namespace ms::cuda {

// The kernels' process-wide switches for one call. The default: the 4-warp dK/dV kernel unless
// runtime.attention_split_dkdv forces the split one, compile-time bounds where they apply, the 4-warp forward.
struct AttentionVariant {
  bool wide = false;   // the forward with two 16-row fragments per warp
  bool fixed = true;   // compile-time product bounds where D == the instance's bound
  bool split = false;  // the backward's 8-warp dK/dV kernel
  bool operator==(const AttentionVariant& o) const { return wide == o.wide && fixed == o.fixed && split == o.split; }
  // "default", "wide", "split", "varD", "wide+varD", ... (what kernels_bench's rows call them).
  std::string Name() const;
  // Sets kernels::SetAttentionTcWideForward / FixedBounds / SplitDkDv.
  void Apply() const;
};

// A device range a tuning run writes that every variant must write bit for bit alike (null: none).
struct TuneOutput {
  const char* name = "";  // for the messages: "out16", "dqkv", ...
  const void* data = nullptr;
  size_t bytes = 0;
};

class AttentionTuner {
 public:
  // The variant for the call `key` names (pass, shape, which inputs and outputs, their alignment): the one chosen at
  // the key's first call, or, when the tuner is on, not capturing and the key is new, the one tuned now (the stream
  // synchronized; a launch error is returned). `run` launches the call's kernels on `stream` under the switches the
  // tuner set, writing `outputs` and nothing the caller keeps otherwise (what it accumulates goes to a scratch that
  // `reset`, run before each compared run, zeroes). `backward`, `D`: which candidates apply (the split dK/dV
  // kernel where kernels::AttentionTcBackwardSharedByDefault(D) is false (D <= 64): above, the default backward's
  // softmax runs through shared memory and gives other bits;
  // the wide forward at every D, as the default forward's softmax stays in registers). `def`: the default (its split
  // forced by runtime.attention_split_dkdv). Off, or capturing: `def`.
  Result<AttentionVariant> Choose(const std::string& key, bool backward, int64_t D, const AttentionVariant& def,
                                  cudaStream_t stream, bool capturing, const std::vector<TuneOutput>& outputs,
                                  const std::function<cudaError_t()>& run, const std::function<cudaError_t()>& reset);
  void set_on(bool on) { on_ = on; }
  bool on() const { return on_; }
  // Keys tuned, and one line per key (the choice and every candidate's time or why it was left out), for the log.
  int64_t tuned() const { return static_cast<int64_t>(notes_.size()); }
  const std::vector<std::string>& notes() const { return notes_; }
  // Candidates left out because their bits differed from the default's.
  int64_t disagreed() const { return disagreed_; }

 private:
  bool on_ = false;
  std::map<std::string, AttentionVariant> chosen_;
  std::vector<std::string> notes_;
  int64_t disagreed_ = 0;
};

}  // namespace ms::cuda
