// Huge pages for the relation builders' large, freshly mapped buffers.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mlx_lattice {

// Asks the kernel to back the 2 MiB-aligned interior of a large fresh buffer
// with huge pages: the buffer is written once, and faulting it in 4 KiB pages
// costs about as much as building the relation's edges (Linux; elsewhere, or
// when transparent huge pages are off, the advice is a no-op).
inline void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  if (bytes < 2 * kHuge) return;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

}  // namespace mlx_lattice
