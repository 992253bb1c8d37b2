// torch's pluggable-allocator entry points for gpushare.Arena.torch_mem_pool.
//
// torch.cuda.memory.CUDAPluggableAllocator loads a shared library and calls
// two of its functions for every segment its caching allocator takes or
// gives back.  This library holds nothing but those two functions and the
// Python callbacks they forward to (set once, through ctypes, by
// gpushare/_torch_alloc.py), so the memory comes from a gpushare.Arena and
// every tensor of the pool is shareable the fast way.  It links nothing:
// no CUDA, no Python.

#include <atomic>
#include <cstddef>

using AllocFn = void *(*)(std::size_t size, int device, void *stream);
using FreeFn = void (*)(void *ptr, std::size_t size, int device, void *stream);

namespace {
std::atomic<AllocFn> alloc_hook{nullptr};
std::atomic<FreeFn> free_hook{nullptr};
}  // namespace

extern "C" {

__attribute__((visibility("default"))) void gpushare_torch_set_hooks(AllocFn alloc, FreeFn release) {
  free_hook.store(release);
  alloc_hook.store(alloc);
}

// A segment of `size` bytes on `device` for `stream` (torch's cudaStream_t),
// or NULL (torch raises its out-of-memory error) where no arena serves it.
__attribute__((visibility("default"))) void *gpushare_torch_malloc(std::size_t size, int device, void *stream) {
  AllocFn alloc = alloc_hook.load();
  return alloc == nullptr ? nullptr : alloc(size, device, stream);
}

__attribute__((visibility("default"))) void gpushare_torch_free(void *ptr, std::size_t size, int device,
                                                                void *stream) {
  FreeFn release = free_hook.load();
  if (release != nullptr) release(ptr, size, device, stream);
}

}  // extern "C"
