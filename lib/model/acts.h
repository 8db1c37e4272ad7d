// lib/model/acts.h: the model's private structures, shared by its sources (model.cpp, graphs.cpp): a slot's
// activations, a layer's parameters and its kept bf16 operands. Not part of the module's interface (model.h).
#pragma once

#include <cstdint>
#include <vector>

#include "model/model.h"
#include "ops/ops.h"

namespace ms::model {

// Element `at` of bf16 storage held in a float array (2 per float).
inline void* Bf16At(const DeviceArray<float>& a, int64_t at) {
  return static_cast<void*>(reinterpret_cast<uint16_t*>(a.data()) + at);
}
// p + off, or null for a buffer that is not there (an fp32 activation kept only as its bf16 rounding).
template <typename T>
inline T* Off(T* p, int64_t off) {
  return p ? p + off : nullptr;
}
// Allocates n bf16 elements in a float array.
inline Status AllocateBf16(DeviceArray<float>& a, ops::Backend* be, int64_t n) {
  return a.Allocate(be, (n + 1) / 2);
}

// Activations of one micro-batch in one chunk (R = rows_, N = B*T).
// All device memory (host memory on the CPU backend); only inputs_host / targets_host live on the host.
struct Gpt::Acts {
  std::vector<int32_t> inputs_host, targets_host;  // [N]
  DeviceArray<int32_t> inputs, targets;            // [N]; inputs as local vocab ids under tp (-1: another rank's row)
  DeviceArray<float> res;                          // (layers+1) x [R, C]
  struct Layer {
    // fch: bf16 with Bf16Fc; qkv: bf16 with Bf16AttnIO; atty: unallocated without Atty32 (only its rounding atty_16)
    DeviceArray<float> ln1, ln1_mean, ln1_rstd, ln1_full, qkv, atty, lse, fch, fch_gelu;
    DeviceArray<float> mid, ln2, ln2_mean, ln2_rstd, ln2_full;
    // bf16 roundings of the GEMM inputs (all N rows), made in the forward (by the LayerNorms, the bias + GeLU or
    // the GEMMs) and read again by the weight gradients' (backends that keep bf16 operands; else unallocated): ln1
    // (qkv, and fc in the parallel block), ln2 (fc, sequential), atty (attn.proj), fch_gelu (mlp.proj). Where the
    // producer writes the rounding (RoundedLn / RoundedGelu) nothing else reads the fp32 output: ln1, ln2 and
    // fch_gelu are then not allocated (null) and not written.
    DeviceArray<float> ln1_16, ln2_16, atty_16, fch_gelu_16;
  };
  std::vector<Layer> layers;
  DeviceArray<float> lnf, lnf_mean, lnf_rstd, lnf_full, logits, ce_lse, losses;  // logits: dlogits after the loss
  DeviceArray<float> lnf_16;      // the head GEMM's input, bf16 (lnf then unallocated: RoundedLn)
  DeviceArray<float> dlogits_16;  // dlogits rounded to bf16 by the cross-entropy: then no fp32 dlogits are written
  DeviceArray<float> logits_16;   // Bf16Logits: the logits in bf16 (no fp32 logits), their gradient written over them
  bool dlogits_ready = false;     // the fused classifier loss wrote dlogits over the logits, for weight dlogits_weight
  float dlogits_weight = 0.0f;
  DeviceArray<float> dx_in;  // [R, C] gradient of the chunk input (to send upstream)
  bool forward_done = false;
};

struct Gpt::LayerW {
  const ParamInfo *ln1w, *ln1b, *qkvw, *qkvb, *projw, *projb, *ln2w, *ln2b, *fcw, *fcb, *mprojw, *mprojb;
};

// A layer's kept bf16 GEMM operands (KeptLayer): the weights' roundings and where its GEMM inputs' roundings live;
// empty (every GEMM rounds its own operands) when the backend keeps none.
struct Gpt::LayerBf16 {
  const void* w[4] = {};  // qkv, attn.proj, mlp.fc, mlp.proj
  const DeviceArray<float>*ln1 = nullptr, *fc_in = nullptr, *atty = nullptr, *fch_gelu = nullptr;
  int64_t C = 0, HlD = 0, Fl = 0;
  int64_t mine = 0;  // this rank's first row of the [N, C] LayerNorm outputs (tp_rank * R under SpGather16, else 0)
  ops::Bf16Copies Make(int j, const DeviceArray<float>* in, int64_t at, bool ready) const {
    if (!in) return {};
    return {w[j], Bf16At(*in, at), ready};
  }
  // Where a producer writes its output's rounding (from row0 on; null when nothing is kept): the LayerNorm
  // feeding qkv (and fc in the parallel block), the one feeding fc (sequential block) — this rank's rows, under
  // sequence parallelism the gather writes the others' — the bias + GeLU, the attention (all N rows of the local
  // heads, with or without sequence parallelism).
  void* Ln1Out() const { return ln1 ? Bf16At(*ln1, mine * C) : nullptr; }
  void* FcInOut() const { return fc_in ? Bf16At(*fc_in, mine * C) : nullptr; }
  void* GeluOut(int64_t row0) const { return fch_gelu ? Bf16At(*fch_gelu, row0 * Fl) : nullptr; }
  void* AttyOut() const { return atty ? Bf16At(*atty, 0) : nullptr; }  // the attention forward's rounding
  // For the GEMM rows from row0 on; `ready`: those input rows are already rounded (by their producer or an earlier
  // GEMM).
  ops::Bf16Copies Qkv(int64_t row0, bool ready) const { return Make(0, ln1, row0 * C, ready); }
  ops::Bf16Copies Proj(int64_t row0, bool ready) const { return Make(1, atty, row0 * HlD, ready); }
  ops::Bf16Copies Fc(int64_t row0, bool ready) const { return Make(2, fc_in, row0 * C, ready); }
  ops::Bf16Copies Mproj(int64_t row0, bool ready) const { return Make(3, fch_gelu, row0 * Fl, ready); }
};

}  // namespace ms::model
