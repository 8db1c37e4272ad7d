// NCCL communicator creation through the store (see bootstrap.h). Compiled only with MS_HAVE_NCCL.
#include "bootstrap/bootstrap.h"

#if defined(MS_HAVE_NCCL)
namespace ms::bootstrap {

Result<std::unique_ptr<comm::Communicator>> CreateNcclCommunicator(Store& store, const std::string& key,
                                                                   int rank_in_group, int group_size, Millis timeout,
                                                                   comm::NcclOptions options) {
  if (group_size < 1 || rank_in_group < 0 || rank_in_group >= group_size) {
    return InvalidArgument("NCCL group {}: rank {} of {}", key, rank_in_group, group_size);
  }
  std::string id;
  if (rank_in_group == 0) {
    MS_ASSIGN_OR_RETURN(id, comm::NewNcclUniqueId());
    MS_RETURN_IF_ERROR_CTX(store.Set(key, id), "publishing the NCCL id of group {}", key);
  } else {
    MS_ASSIGN_OR_RETURN(auto values, store.WaitGet({key}, timeout));
    id = values[0];
  }
  MS_ASSIGN_OR_RETURN(ncclComm_t comm, comm::InitNcclComm(id, rank_in_group, group_size));
  options.name = options.name.empty() ? key : options.name;
  return comm::MakeNcclCommunicator(comm, std::move(options));
}

}  // namespace ms::bootstrap
#endif  // MS_HAVE_NCCL
