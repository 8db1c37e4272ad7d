// Dataset metadata (<prefix>.json) and the choice of a job's tokenizer.
#include <sys/stat.h>

#include "data/data.h"

namespace ms::data {

Result<DatasetInfo> ReadDatasetInfo(const std::string& prefix) {
  DatasetInfo info;
  struct stat st;
  if (::stat((prefix + ".json").c_str(), &st) != 0) return info;
  return Unimplemented("{}.json: dataset metadata is not read yet", prefix);
}

Result<std::unique_ptr<Tokenizer>> LoadTokenizer(std::string_view name, const std::string& dataset_prefix) {
  MS_ASSIGN_OR_RETURN(DatasetInfo info, ReadDatasetInfo(dataset_prefix));
  if (name == "auto") name = info.tokenizer;
  return MakeTokenizer(name);
}

}  // namespace ms::data
