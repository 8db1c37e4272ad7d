// Decoder: token-by-token inference of the unsharded GPT with a KV cache (model.h).
#include <cmath>

#include "model/model.h"

namespace ms::model {

Result<std::unique_ptr<Decoder>> Decoder::Create(const config::ModelSpec& spec, const TensorReader& read) {
  if (spec.heads <= 0 || spec.hidden % spec.heads != 0 || spec.ffn_hidden <= 0) {
    return InvalidArgument("decoder: the model spec is not resolved (heads {}, hidden {}, ffn_hidden {})", spec.heads,
                           spec.hidden, spec.ffn_hidden);
  }
  auto d = std::unique_ptr<Decoder>(new Decoder());
  d->spec_ = spec;
  // The embedding and classifier hold the padded vocabulary (model.vocab_pad_to); Forward computes the logits of
  // the first vocab rows only, so the padding is never sampled.
  const int64_t C = spec.hidden, F = spec.ffn_hidden, V = spec.padded_vocab(), T = spec.seq_len;
  auto shape = [&](const std::string& name) -> int64_t {
    const auto dot = name.rfind('.');
    const std::string leaf = name.substr(dot + 1), owner = name.substr(0, dot);
    if (name == "embed.wte" || name == "lm_head.weight") return V * C;
    if (name == "embed.wpe") return T * C;
    if (owner.ends_with("attn.qkv")) return leaf == "weight" ? 3 * C * C : 3 * C;
    if (owner.ends_with("attn.proj") || owner.ends_with("mlp.proj"))
      return leaf == "weight" ? C * (owner.ends_with("mlp.proj") ? F : C) : C;
    if (owner.ends_with("mlp.fc")) return leaf == "weight" ? F * C : F;
    return C;  // norms
  };
  for (const auto& name : AllTensorNames(spec)) {
    std::vector<float> t(static_cast<size_t>(shape(name)));
    MS_RETURN_IF_ERROR_CTX(read(name, t.data(), static_cast<int64_t>(t.size())), "reading tensor {}", name);
    d->w_[name] = std::move(t);
  }
  d->ring_ = spec.window > 0 ? std::min<int64_t>(spec.window, T) : T;
  d->k_.assign(spec.layers, std::vector<float>(static_cast<size_t>(d->ring_ * C)));
  d->v_.assign(spec.layers, std::vector<float>(static_cast<size_t>(d->ring_ * C)));
  return d;
}

void Decoder::Reset() {
  tokens_.clear();
}

Result<std::vector<float>> Decoder::Step(int32_t token) {
  if (token < 0 || token >= spec_.vocab) {
    return InvalidArgument("token {} is outside the model's vocabulary [0, {})", token, spec_.vocab);
  }
  if (position() >= spec_.seq_len) {
    return OutOfRange(
        "the model has learned positions for {} tokens (model.seq_len) and the context is full; generate fewer tokens "
        "or use a shorter prompt",
        spec_.seq_len);
  }
  std::vector<float> logits;
  MS_RETURN_IF_ERROR(Forward(token, position(), &logits));
  tokens_.push_back(token);
  return logits;
}

Result<std::vector<float>> Decoder::Recompute() {
  const std::vector<int32_t> tokens = tokens_;
  if (tokens.empty()) return FailedPrecondition("decoder: no tokens to recompute");
  Reset();
  std::vector<float> logits;
  for (int32_t t : tokens) {
    MS_ASSIGN_OR_RETURN(logits, Step(t));
  }
  return logits;
}

Status Decoder::Forward(int32_t token, int64_t pos, std::vector<float>* logits) {
  const int64_t C = spec_.hidden, H = spec_.heads, D = C / H, F = spec_.ffn_hidden, V = spec_.vocab;
  const float eps = spec_.norm_eps;
  const bool seq = spec_.block == config::BlockKind::kSequential;
  auto W = [&](const std::string& name) { return w_.at(name).data(); };
  std::vector<float> x(C), ln(C), qkv(3 * C), att(C), fc(F), a(C), m(C), mid(C), ln2(C);
  float mean = 0, rstd = 0;
  const float* wte = W("embed.wte");
  const float* wpe = W("embed.wpe");
  for (int64_t c = 0; c < C; ++c) x[c] = wte[token * C + c] + wpe[pos * C + c];
  const int64_t first = spec_.window > 0 ? std::max<int64_t>(0, pos - spec_.window + 1) : 0;
  std::vector<double> p;
  for (int l = 0; l < spec_.layers; ++l) {
    const std::string L = fmt::format("layers.{}.", l);
    ops::LayerNormForward(ln.data(), &mean, &rstd, x.data(), W(L + "ln1.weight"), W(L + "ln1.bias"), 1, C, eps);
    ops::MatmulForward(qkv.data(), ln.data(), W(L + "attn.qkv.weight"), W(L + "attn.qkv.bias"), 1, C, 3 * C);
    // The cache: this position's keys and values, in the ring row pos % ring_.
    float* kc = k_[l].data();
    float* vc = v_[l].data();
    std::copy(qkv.begin() + C, qkv.begin() + 2 * C, kc + (pos % ring_) * C);
    std::copy(qkv.begin() + 2 * C, qkv.end(), vc + (pos % ring_) * C);
    const double scale = 1.0 / std::sqrt(static_cast<double>(D));
    for (int64_t h = 0; h < H; ++h) {
      const float* q = qkv.data() + h * D;
      p.assign(static_cast<size_t>(pos - first + 1), 0.0);
      double mx = -INFINITY;
      for (int64_t s = first; s <= pos; ++s) {
        const float* k = kc + (s % ring_) * C + h * D;
        double dot = 0;
        for (int64_t d = 0; d < D; ++d) dot += static_cast<double>(q[d]) * k[d];
        p[s - first] = dot * scale;
        mx = std::max(mx, p[s - first]);
      }
      double sum = 0;
      for (double& e : p) sum += (e = std::exp(e - mx));
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t s = first; s <= pos; ++s) o += p[s - first] * vc[(s % ring_) * C + h * D + d];
        att[h * D + d] = static_cast<float>(o / sum);
      }
    }
    ops::MatmulForward(a.data(), att.data(), W(L + "attn.proj.weight"), nullptr, 1, C, C);
    const float* mlp_in = ln.data();
    if (seq) {
      for (int64_t c = 0; c < C; ++c) mid[c] = x[c] + a[c] + W(L + "attn.proj.bias")[c];
      ops::LayerNormForward(ln2.data(), &mean, &rstd, mid.data(), W(L + "ln2.weight"), W(L + "ln2.bias"), 1, C, eps);
      mlp_in = ln2.data();
    }
    ops::MatmulForward(fc.data(), mlp_in, W(L + "mlp.fc.weight"), W(L + "mlp.fc.bias"), 1, C, F);
    ops::GeluForward(fc.data(), fc.data(), F);
    ops::MatmulForward(m.data(), fc.data(), W(L + "mlp.proj.weight"), nullptr, 1, F, C);
    const float* pb = W(L + "attn.proj.bias");
    const float* mb = W(L + "mlp.proj.bias");
    for (int64_t c = 0; c < C; ++c) {
      x[c] = seq ? mid[c] + m[c] + mb[c] : x[c] + (a[c] + m[c]) + pb[c] + mb[c];
    }
  }
  ops::LayerNormForward(ln.data(), &mean, &rstd, x.data(), W("final_norm.weight"), W("final_norm.bias"), 1, C, eps);
  logits->assign(static_cast<size_t>(V), 0.0f);
  ops::MatmulForward(logits->data(), ln.data(), W(spec_.tied_embeddings ? "embed.wte" : "lm_head.weight"), nullptr, 1,
                     C, V);
  return Status::Ok();
}

}  // namespace ms::model
