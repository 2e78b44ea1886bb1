// Validation of the index arrays handed to the extension.
//
// Every public op checks its index arrays (dtype, shape, bounds, groupings)
// on evaluated data before building a primitive, so the kernels never read
// out of bounds. Violations raise InputError (Python: MlxLatticeError).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "mlx/mlx.h"

namespace mlx_lattice {

namespace mx = mlx::core;

// Data pointer of an evaluated int32 array, or nullptr when it is empty.
inline const int32_t* idx_or_null(const mx::array& a) {
  return a.size() ? a.data<int32_t>() : nullptr;
}

[[noreturn]] void fail(const std::string& op, const std::string& message);

// Evaluates the arrays (row-contiguous int32 of the given ranks) and returns
// them ready for reading. Raises for a wrong dtype or rank, or for arrays that
// cannot be evaluated (placeholders of a transformation being traced).
std::vector<mx::array> concrete_indices(const std::string& op,
                                        const std::vector<std::pair<std::string, mx::array>>& named,
                                        const std::vector<int>& ndims);

void check_range(const std::string& op, const std::string& name, const mx::array& a, int64_t lo,
                 int64_t hi);

// offsets: length groups + 1, starts at 0, non-decreasing, ends at total.
void check_offsets(const std::string& op, const std::string& name, const mx::array& offsets,
                   int64_t groups, int64_t total);

// Edges of group g (edge_ids[offsets[g]:offsets[g+1]], or the identity when
// edge_ids is empty) all have keys[e] == g; edge_ids is a permutation.
void check_grouping(const std::string& op, const std::string& offsets_name,
                    const std::string& ids_name, const mx::array& offsets, const mx::array* edge_ids,
                    const std::string& keys_name, const mx::array& keys);

// The first (group, kernel offset) holding two edges, in group order, or
// {-1, -1} when no group holds two edges of one offset. `offsets` (groups +
// 1) index `edge_ids` (or the edges themselves when null); ids in range.
std::pair<int64_t, int32_t> first_repeated_kernel(const mx::array& offsets,
                                                  const mx::array* edge_ids,
                                                  const mx::array& kernel_ids,
                                                  int64_t n_kernels);

// No group holds two edges of one kernel offset.
void check_distinct_kernels(const std::string& op, const std::string& group_name,
                            const mx::array& offsets, const mx::array* edge_ids,
                            const mx::array& kernel_ids, int64_t n_kernels);

// Runs `validate` once per distinct set of index arrays: its result is
// remembered under `tag` and the identities of `keys`. Entries hold
// references to the keys, so an identity cannot be reused while remembered;
// an array updated in place gets a new identity and is validated again. At
// most kValidationMemo sets are kept (least recently used first out), so dead
// relations are released soon.
constexpr size_t kValidationMemo = 32;
std::shared_ptr<const void> validated(const std::string& tag, const std::vector<mx::array>& keys,
                                      const std::function<std::shared_ptr<const void>()>& validate);

// Forgets all remembered validations.
void clear_validation_memo();

}  // namespace mlx_lattice
