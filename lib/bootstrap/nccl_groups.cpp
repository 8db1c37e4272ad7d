// ShareGroupId: a group's NCCL id through the store (see bootstrap.h).
#include "bootstrap/bootstrap.h"

namespace ms::bootstrap {

Result<std::string> ShareGroupId(Store& store, const std::string& key, int rank_in_group, int group_size,
                                 Millis timeout, const std::function<Result<std::string>()>& make) {
  if (group_size < 1 || rank_in_group < 0 || rank_in_group >= group_size) {
    return InvalidArgument("group {}: rank {} of {}", key, rank_in_group, group_size);
  }
  if (rank_in_group == 0) {
    MS_ASSIGN_OR_RETURN(std::string id, make());
    MS_RETURN_IF_ERROR_CTX(store.Set(key, id), "publishing the id of group {}", key);
    return id;
  }
  MS_ASSIGN_OR_RETURN(auto values, store.WaitGet({key}, timeout));
  return values[0];
}

}  // namespace ms::bootstrap
