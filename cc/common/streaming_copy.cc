#include "cc/common/streaming_copy.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace mpistrategy {

void StreamingCopy(void* dst, const void* src, int64_t bytes) {
#if defined(__SSE2__)
  if (bytes >= kMinStreamingCopyBytes) {
    char* to = static_cast<char*>(dst);
    const char* from = static_cast<const char*>(src);
    // Non-temporal stores need a 16-byte aligned destination.
    const int64_t head = (16 - (reinterpret_cast<uintptr_t>(to) & 15)) & 15;
    std::memcpy(to, from, head);
    to += head;
    from += head;
    bytes -= head;
    // A cache line per iteration, so that each write-combining buffer
    // fills completely before it goes out.
    const int64_t lines = bytes & ~int64_t{63};
    for (int64_t i = 0; i < lines; i += 64) {
      const __m128i* s = reinterpret_cast<const __m128i*>(from + i);
      __m128i* d = reinterpret_cast<__m128i*>(to + i);
      const __m128i a = _mm_loadu_si128(s);
      const __m128i b = _mm_loadu_si128(s + 1);
      const __m128i c = _mm_loadu_si128(s + 2);
      const __m128i e = _mm_loadu_si128(s + 3);
      _mm_stream_si128(d, a);
      _mm_stream_si128(d + 1, b);
      _mm_stream_si128(d + 2, c);
      _mm_stream_si128(d + 3, e);
    }
    std::memcpy(to + lines, from + lines, bytes - lines);
    // Non-temporal stores are weakly ordered: without the fence a later
    // release store could become visible before them.
    _mm_sfence();
    return;
  }
#endif
  std::memcpy(dst, src, bytes);
}

}  // namespace mpistrategy
