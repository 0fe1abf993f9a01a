// defines: sync_batch_norm_path(), where a model holds a SyncBatchNorm: what the engine code asks before it lets
// ranks run different numbers of forwards (see include/gradsync/sync_batch_norm.h).
#pragma once
#include <string>

#include <torch/torch.h>

namespace gradsync::norm {

// The state-dict path of the first SyncBatchNorm in `module` ("(the module itself)" for the root), "" for none.
std::string sync_batch_norm_path(const torch::nn::Module& module);

}  // namespace gradsync::norm
