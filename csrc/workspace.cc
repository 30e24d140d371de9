// The block of memory the process keeps between kernel calls for their large scratch (see
// problem.h). Pages malloc hands out fresh are faulted in again on every call: a float32
// forward + backward of 8 heads of 4096 x 64 took a median of 13,700 page faults a call with
// its scratch from malloc, 2,000 with the block kept (torch's own tensors), and ran 1.012x as
// fast (paired medians of 15 calls in one process).
//
// Under AddressSanitizer the block's bytes past a call's request, and the whole block between
// calls, are poisoned, so an overrun is caught as one past malloc's block would be.
#include <pthread.h>

#include <cstdint>
#include <cstdlib>
#include <mutex>

#include "problem.h"

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#else
#define ASAN_POISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#define ASAN_UNPOISON_MEMORY_REGION(p, n) ((void)(p), (void)(n))
#endif

namespace qkv {
namespace {

std::mutex kept_mutex;
void* kept_raw = nullptr;  // from malloc; the block starts at its first 64-byte boundary
char* kept = nullptr;
size_t kept_size = 0;
bool kept_lent = false;

// fork() takes the mutex first: a child forked while another thread held it would wait on
// it forever. (A block lent to a thread the child lacks stays lent there: its calls use malloc.)
const int fork_handlers = pthread_atfork([] { kept_mutex.lock(); }, [] { kept_mutex.unlock(); },
                                         [] { kept_mutex.unlock(); });

void free_kept() {
  ASAN_UNPOISON_MEMORY_REGION(kept, kept_size);
  free(kept_raw);
  kept_raw = nullptr, kept = nullptr, kept_size = 0;
}

}  // namespace

void* take_kept_block(size_t bytes) {
  bytes = (bytes + 63) & ~size_t(63);
  if (bytes > KEPT_BLOCK_MAX) return nullptr;
  std::lock_guard<std::mutex> lock(kept_mutex);
  if (kept_lent) return nullptr;
  if (kept_size < bytes) {  // grown to the largest request so far; its contents are scratch
    free_kept();
    kept_raw = malloc(bytes + 64);
    if (!kept_raw) return nullptr;
    kept = reinterpret_cast<char*>((reinterpret_cast<uintptr_t>(kept_raw) + 63) & ~uintptr_t(63));
    kept_size = bytes;
  }
  kept_lent = true;
  ASAN_UNPOISON_MEMORY_REGION(kept, bytes);
  ASAN_POISON_MEMORY_REGION(kept + bytes, kept_size - bytes);
  return kept;
}

void give_back_kept_block() {
  std::lock_guard<std::mutex> lock(kept_mutex);
  ASAN_POISON_MEMORY_REGION(kept, kept_size);
  kept_lent = false;
}

size_t kept_block_bytes() {
  std::lock_guard<std::mutex> lock(kept_mutex);
  return kept_size;
}

bool release_kept_block() {
  std::lock_guard<std::mutex> lock(kept_mutex);
  if (kept_lent) return false;
  free_kept();
  return true;
}

}  // namespace qkv
