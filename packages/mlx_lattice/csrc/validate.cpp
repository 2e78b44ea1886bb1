#include "validate.h"
#include "cpu/input_error.h"

#include <list>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "common.h"

namespace mlx_lattice {

void fail(const std::string& op, const std::string& message) {
  throw ::mlx_lattice::InputError(op + ": " + message);
}

std::vector<mx::array> concrete_indices(const std::string& op,
                                        const std::vector<std::pair<std::string, mx::array>>& named,
                                        const std::vector<int>& ndims) {
  std::vector<mx::array> arrays;
  for (size_t i = 0; i < named.size(); ++i) {
    const auto& [name, a] = named[i];
    if (a.dtype() != mx::int32) {
      fail(op, name + " must be an int32 array, got " + dtype_str(a.dtype()) + ".");
    }
    if (static_cast<int>(a.ndim()) != ndims[i]) {
      fail(op, name + " must have " + std::to_string(ndims[i]) + " dimension(s), got shape " +
                   shape_str(a.shape()) + ".");
    }
    arrays.push_back(a);
  }
  try {
    mx::eval(arrays);
  } catch (const std::exception& e) {
    fail(op, std::string("index arrays must be concrete values (close over the relation instead "
                         "of passing it through a transformation such as mx.compile); "
                         "evaluating them failed: ") +
                 e.what());
  }
  bool copied = false;
  for (auto& a : arrays) {
    if (!a.flags().row_contiguous) {
      a = mx::contiguous(a, false, mx::Device::cpu);
      copied = true;
    }
  }
  if (copied) mx::eval(arrays);
  return arrays;
}

void check_range(const std::string& op, const std::string& name, const mx::array& a, int64_t lo,
                 int64_t hi) {
  const int32_t* p = a.data<int32_t>();
  for (size_t i = 0; i < a.size(); ++i) {
    if (p[i] < lo || p[i] >= hi) {
      std::ostringstream msg;
      msg << name << "[" << i << "] = " << p[i] << " is out of range [" << lo << ", " << hi
          << ").";
      fail(op, msg.str());
    }
  }
}

void check_offsets(const std::string& op, const std::string& name, const mx::array& offsets,
                   int64_t groups, int64_t total) {
  if (static_cast<int64_t>(offsets.size()) != groups + 1) {
    std::ostringstream msg;
    msg << name << " must have " << groups + 1 << " entries, got " << offsets.size() << ".";
    fail(op, msg.str());
  }
  const int32_t* p = offsets.data<int32_t>();
  if (p[0] != 0 || p[groups] != total) {
    std::ostringstream msg;
    msg << name << " must start at 0 and end at " << total << ", got " << p[0] << " and "
        << p[groups] << ".";
    fail(op, msg.str());
  }
  for (int64_t g = 0; g < groups; ++g) {
    if (p[g + 1] < p[g]) {
      fail(op, name + " must be non-decreasing; it decreases at " + std::to_string(g) + ".");
    }
  }
}

void check_grouping(const std::string& op, const std::string& offsets_name,
                    const std::string& ids_name, const mx::array& offsets, const mx::array* edge_ids,
                    const std::string& keys_name, const mx::array& keys) {
  const int32_t* off = offsets.data<int32_t>();
  const int32_t* ids = edge_ids ? edge_ids->data<int32_t>() : nullptr;
  const int32_t* key = keys.data<int32_t>();
  const int64_t n_edges = keys.size();
  const int64_t groups = offsets.size() - 1;
  std::vector<uint8_t> seen(ids ? n_edges : 0, 0);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = off[g]; j < off[g + 1]; ++j) {
      int64_t e = j;
      if (ids) {
        e = ids[j];
        if (e < 0 || e >= n_edges || seen[e]) {
          std::ostringstream msg;
          msg << ids_name << " must be a permutation of the edges; entry " << j << " = " << e
              << (e >= 0 && e < n_edges ? " repeats." : " is out of range.");
          fail(op, msg.str());
        }
        seen[e] = 1;
      }
      if (key[e] != g) {
        std::ostringstream msg;
        msg << "edge " << e << " is grouped under " << g << " by " << offsets_name << " but "
            << keys_name << "[" << e << "] = " << key[e] << ".";
        fail(op, msg.str());
      }
    }
  }
}

std::pair<int64_t, int32_t> first_repeated_kernel(const mx::array& offsets,
                                                  const mx::array* edge_ids,
                                                  const mx::array& kernel_ids,
                                                  int64_t n_kernels) {
  const int32_t* off = offsets.data<int32_t>();
  const int32_t* ids = edge_ids && edge_ids->size() ? edge_ids->data<int32_t>() : nullptr;
  const int32_t* kid = kernel_ids.size() ? kernel_ids.data<int32_t>() : nullptr;
  const int64_t groups = static_cast<int64_t>(offsets.size()) - 1;
  std::vector<int64_t> stamp(n_kernels, -1);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = off[g]; j < off[g + 1]; ++j) {
      const int32_t k = kid[ids ? ids[j] : j];
      if (stamp[k] == g) return {g, k};
      stamp[k] = g;
    }
  }
  return {-1, -1};
}

void check_distinct_kernels(const std::string& op, const std::string& group_name,
                            const mx::array& offsets, const mx::array* edge_ids,
                            const mx::array& kernel_ids, int64_t n_kernels) {
  const auto [g, k] = first_repeated_kernel(offsets, edge_ids, kernel_ids, n_kernels);
  if (g >= 0) {
    std::ostringstream msg;
    msg << group_name << " row " << g << " has two edges of kernel offset " << k
        << "; a relation holds at most one edge per (row, offset).";
    fail(op, msg.str());
  }
}

namespace {

struct MemoEntry {
  std::string key;
  std::vector<mx::array> pinned;  // the key arrays: keeps their identities unique
  std::shared_ptr<const void> result;
};

// Memo of validated index-array sets: mutable global state because the
// validation of a relation is O(edges) and every layer call would repeat it.
struct Memo {
  std::mutex mutex;
  std::list<MemoEntry> entries;  // most recently used first
};

Memo& memo() {
  static Memo* instance = new Memo();  // never destroyed: arrays may outlive MLX statics
  return *instance;
}

std::string memo_key(const std::string& tag, const std::vector<mx::array>& keys) {
  std::ostringstream key;
  key << tag;
  for (const auto& a : keys) key << ':' << a.id();
  return key.str();
}

}  // namespace

std::shared_ptr<const void> validated(const std::string& tag, const std::vector<mx::array>& keys,
                                      const std::function<std::shared_ptr<const void>()>& validate) {
  const std::string k = memo_key(tag, keys);
  auto& m = memo();
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    for (auto it = m.entries.begin(); it != m.entries.end(); ++it) {
      if (it->key == k) {
        m.entries.splice(m.entries.begin(), m.entries, it);
        return it->result;
      }
    }
  }
  auto result = validate();  // throws on bad input: nothing is remembered
  std::lock_guard<std::mutex> lock(m.mutex);
  m.entries.push_front({k, keys, result});
  while (m.entries.size() > kValidationMemo) m.entries.pop_back();
  return result;
}

void clear_validation_memo() {
  auto& m = memo();
  std::lock_guard<std::mutex> lock(m.mutex);
  m.entries.clear();
}

}  // namespace mlx_lattice
