// megascale generate: a checkpoint, the dataset's tokenizer and model::Decoder (runner.h).
#include <algorithm>
#include <cmath>
#include <numeric>

#include "checkpoint/checkpoint.h"
#include "data/data.h"
#include "model/model.h"
#include "runner/checkpointing.h"
#include "runner/runner.h"

namespace ms::runner {
namespace {

// The next token from logits: greedy at temperature <= 0, else a draw among the top_k most likely.
int32_t Sample(const std::vector<float>& logits, const GenerateOptions& o, Rng* rng) {
  const int V = static_cast<int>(logits.size());
  if (o.temperature <= 0) return static_cast<int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin());
  std::vector<int> order(V);
  std::iota(order.begin(), order.end(), 0);
  const int k = o.top_k > 0 ? std::min(o.top_k, V) : V;
  // The k largest, ties broken by the lower id (deterministic).
  std::partial_sort(order.begin(), order.begin() + k, order.end(),
                    [&](int a, int b) { return logits[a] > logits[b] || (logits[a] == logits[b] && a < b); });
  std::vector<double> p(k);
  const double mx = logits[order[0]];
  double sum = 0;
  for (int i = 0; i < k; ++i) sum += (p[i] = std::exp((logits[order[i]] - mx) / o.temperature));
  double u = rng->NextDouble() * sum;
  for (int i = 0; i < k; ++i) {
    if ((u -= p[i]) < 0) return order[i];
  }
  return order[k - 1];
}

}  // namespace

Result<GenerateResult> Generate(const config::JobSpec& spec, const GenerateOptions& o) {
  const auto& m = spec.model;
  if (o.tokens < 1) return InvalidArgument("--tokens {}: generate at least 1 token", o.tokens);
  // The tokenizer first: the prompt must be expressible before anything is loaded.
  auto tok_or = data::LoadTokenizer(spec.data.tokenizer, spec.data.path);
  if (!tok_or.ok()) return tok_or.status().WithContext(fmt::format("{}: data.tokenizer", spec.source));
  auto tok = std::move(tok_or).value();
  if (tok->vocab_size() > m.vocab) {
    return InvalidArgument("tokenizer {} has {} tokens but model.vocab is {}: the checkpoint cannot be this dataset's",
                           tok->name(), tok->vocab_size(), m.vocab);
  }
  GenerateResult r;
  tok->Encode(o.prompt, &r.prompt_ids);
  if (r.prompt_ids.empty()) r.prompt_ids.push_back(tok->eod_token());  // an empty prompt: a new document
  for (size_t i = 0; i < r.prompt_ids.size(); ++i) {
    const int32_t id = r.prompt_ids[i];
    if (id < 0 || id >= m.vocab) {
      return InvalidArgument("the prompt's token {} (id {}) is outside the model's vocabulary of {} (model.vocab)", i,
                             id, m.vocab);
    }
    if (id == tok->unknown_token()) {
      return InvalidArgument(
          "the prompt holds text the tokenizer's vocabulary lacks (token {} is the unknown piece): remove those "
          "characters or use a tokenizer with byte fallback",
          i);
    }
  }
  const int64_t need = static_cast<int64_t>(r.prompt_ids.size()) + o.tokens;
  if (need > m.seq_len) {
    return InvalidArgument(
        "the prompt ({} tokens) and --tokens {} need {} positions, and the model has {} (model.seq_len, learned "
        "positions); ask for at most {} tokens",
        r.prompt_ids.size(), o.tokens, need, m.seq_len, std::max<int64_t>(0, m.seq_len - r.prompt_ids.size()));
  }

  // The checkpoint, in whatever layout it was saved.
  const std::string& dir = spec.checkpoint.dir;
  Result<checkpoint::Checkpoint> ck_or =
      o.step >= 0 ? checkpoint::Checkpoint::Open(fmt::format("{}/{}", dir, checkpoint::StepDirName(o.step)))
                  : checkpoint::FindLatestValid(dir);
  if (!ck_or.ok()) {
    return ck_or.status().WithContext(fmt::format(
        "no checkpoint to generate from in checkpoint.dir={} (train with checkpoint.interval > 0 first, or give the "
        "job spec the run used)",
        dir));
  }
  checkpoint::Checkpoint ckpt = std::move(ck_or).value();
  MS_RETURN_IF_ERROR(CheckCompatible(ckpt, spec));
  r.checkpoint = ckpt.dir();
  r.layout = MetadataValue(ckpt.metadata(0), "layout");
  auto read = [&](const std::string& name, float* out, int64_t numel) -> Status {
    MS_ASSIGN_OR_RETURN(auto shape, ckpt.GlobalShape("param", name));
    int64_t n = 1;
    for (auto d : shape) n *= d;
    if (n != numel) return DataLoss("{} holds {} floats, the model needs {}", name, n, numel);
    MS_RETURN_IF_ERROR(ckpt.ReadGlobal("param", name, out));
    ckpt.DropCache("param", name);
    return Status::Ok();
  };
  MS_ASSIGN_OR_RETURN(auto decoder, model::Decoder::Create(m, read));

  const double t0 = NowSeconds();
  Rng rng(o.seed, 0x67656e);  // stream "gen"
  std::vector<float> logits;
  for (int32_t id : r.prompt_ids) {
    MS_ASSIGN_OR_RETURN(logits, decoder->Step(id));
  }
  for (int i = 0; i < o.tokens; ++i) {
    if (!o.kv_cache) {
      MS_ASSIGN_OR_RETURN(logits, decoder->Recompute());
    }
    const int32_t next = Sample(logits, o, &rng);
    r.ids.push_back(next);
    if (i + 1 < o.tokens) {
      MS_ASSIGN_OR_RETURN(logits, decoder->Step(next));
    }
  }
  r.seconds = NowSeconds() - t0;
  r.tokens_per_s = r.seconds > 0 ? o.tokens / r.seconds : 0;
  r.text = tok->Decode(r.ids);
  return r;
}

}  // namespace ms::runner
