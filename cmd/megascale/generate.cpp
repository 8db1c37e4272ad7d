// megascale generate: sample text from a checkpoint (runner::Generate).
#include <sys/stat.h>

#include <cstdio>
#include <memory>

#include "cmd/megascale/commands.h"
#include "config/config.h"
#include "runner/runner.h"

namespace ms::cmd {

CLI::App* AddGenerateCommand(CLI::App& parent, RunFn* run) {
  auto* sub = parent.add_subcommand(
      "generate", "Sample text from the newest checkpoint of a job (any layout), with the dataset's tokenizer");
  struct Args {
    std::string job;
    std::vector<std::string> overrides;
    runner::GenerateOptions o;
    bool no_cache = false, json = false;
  };
  auto a = std::make_shared<Args>();
  sub->add_option("job", a->job, "The job spec the model was trained with, or its run directory (holding job.yaml)")
      ->required();
  sub->add_option("--set", a->overrides, "Override a key of the job spec (e.g. checkpoint.dir=...)")->take_all();
  sub->add_option("-p,--prompt", a->o.prompt, "Text to continue (empty: start a new document)");
  sub->add_option("-n,--tokens", a->o.tokens, "Tokens to generate")->capture_default_str();
  sub->add_option("--temperature", a->o.temperature, "Sampling temperature; 0: greedy")->capture_default_str();
  sub->add_option("--top-k", a->o.top_k, "Sample among the k most likely tokens; 0: all")->capture_default_str();
  sub->add_option("--seed", a->o.seed, "Sampling seed")->capture_default_str();
  sub->add_option("--step", a->o.step, "The checkpoint's step (default: the newest valid one)");
  sub->add_flag("--no-kv-cache", a->no_cache, "Recompute the whole context for every token (same tokens, slower)");
  sub->add_flag("--json", a->json, "Print one JSON object (ids, text, checkpoint) instead of the text");
  *run = [a]() -> int {
    std::string path = a->job;
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode)) path += "/job.yaml";
    auto spec = config::LoadJobSpec(path);
    if (!spec.ok()) return ReportError(spec.status());
    for (const auto& o : a->overrides) {
      if (Status s = config::ApplyOverride(&*spec, o); !s.ok()) return ReportError(s);
    }
    if (Status s = config::ResolveAndValidate(&*spec); !s.ok()) return ReportError(s);
    a->o.kv_cache = !a->no_cache;
    auto r = runner::Generate(*spec, a->o);
    if (!r.ok()) return ReportError(r.status());
    if (a->json) {
      auto ids = [](const std::vector<int32_t>& v) {
        std::string s;
        for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + std::to_string(v[i]);
        return "[" + s + "]";
      };
      std::printf("{\"checkpoint\": \"%s\", \"layout\": \"%s\", \"prompt_ids\": %s, \"ids\": %s, \"text\": \"%s\"}\n",
                  JsonEscape(r->checkpoint).c_str(), JsonEscape(r->layout).c_str(), ids(r->prompt_ids).c_str(),
                  ids(r->ids).c_str(), JsonEscape(r->text).c_str());
    } else {
      std::printf("%s%s\n", a->o.prompt.c_str(), r->text.c_str());
      std::fprintf(stderr, "generated %zu tokens in %.2f s (%.0f tokens/s) from %s (saved as %s)\n", r->ids.size(),
                   r->seconds, r->tokens_per_s, r->checkpoint.c_str(), r->layout.c_str());
    }
    return 0;
  };
  return sub;
}

}  // namespace ms::cmd
