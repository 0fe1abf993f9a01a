// defines: what the data-set loaders of tools/data/ share (private to the folder): the list of the specs
// load_dataset accepts, which ends every "which data set?" message, and the model-size check each loader starts
// with.
#pragma once
#include <cstdint>

namespace gradsync::cli {

inline constexpr const char* kDatasetSpecs =
    "expected fashion-mnist[:train|:test], synthetic:N, or the path of a file written by "
    "torch.save({\"inputs\": X, \"targets\": Y}, path)";

inline constexpr const char* kTokenDatasetSpecs =
    "expected fortunes[:train|:test], text:PATH, text-test:PATH, synthetic:N, or the path of a file written by "
    "torch.save({\"inputs\": int64 [S, L], \"targets\": int64 [S, L]}, path)";

// Throws ConfigError unless both sizes are positive.
void check_model_sizes(int64_t input_size, int64_t output_size);

}  // namespace gradsync::cli
