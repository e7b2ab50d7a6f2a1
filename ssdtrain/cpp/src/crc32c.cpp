// crc32c (Castagnoli polynomial, as in iSCSI/ext4/RocksDB): SSE4.2's crc32 instruction where the CPU has it,
// a table otherwise. Three independent streams hide the instruction's 3-cycle latency on large blocks.
#include <cstdint>
#include <cstring>

#include "ssdtrain/engine.hpp"

#if defined(__x86_64__)
#include <nmmintrin.h>
#endif

namespace ssdtrain {
namespace {

struct table {
  std::uint32_t t[256];
  table() {
    for (std::uint32_t i = 0; i < 256; ++i) {
      std::uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
      t[i] = c;
    }
  }
};

std::uint32_t crc_table(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  static const table tab;
  for (std::size_t i = 0; i < n; ++i) crc = tab.t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
  return crc;
}

// Multiplies a crc by x^(8*len) mod P (shifting it past `len` zero bytes), to combine stream results.
std::uint32_t shift(std::uint32_t crc, std::size_t len) {
  // Square-and-multiply over GF(2) with the reflected polynomial (zlib's crc32_combine method).
  auto gf2_times = [](const std::uint32_t* mat, std::uint32_t vec) {
    std::uint32_t sum = 0;
    for (int i = 0; vec; ++i, vec >>= 1)
      if (vec & 1) sum ^= mat[i];
    return sum;
  };
  auto square = [&](std::uint32_t* sq, const std::uint32_t* mat) {
    for (int n = 0; n < 32; ++n) sq[n] = gf2_times(mat, mat[n]);
  };
  std::uint32_t even[32], odd[32];
  odd[0] = 0x82F63B78u;
  for (int n = 1; n < 32; ++n) odd[n] = 1u << (n - 1);
  square(even, odd);  // 2 zero bits
  square(odd, even);  // 4 zero bits
  do {
    square(even, odd);
    if (len & 1) crc = gf2_times(even, crc);
    len >>= 1;
    if (len == 0) break;
    square(odd, even);
    if (len & 1) crc = gf2_times(odd, crc);
    len >>= 1;
  } while (len != 0);
  return crc;
}

#if defined(__x86_64__)
constexpr std::size_t stripe = 8192;

// The linear map "append `stripe` zero bytes", as 32 columns, built once.
struct stripe_shift {
  std::uint32_t column[32];
  stripe_shift() {
    for (int i = 0; i < 32; ++i) column[i] = shift(1u << i, stripe);
  }
  std::uint32_t operator()(std::uint32_t crc) const {
    std::uint32_t sum = 0;
    for (int i = 0; crc; ++i, crc >>= 1)
      if (crc & 1) sum ^= column[i];
    return sum;
  }
};

__attribute__((target("sse4.2"))) std::uint32_t crc_hw(const unsigned char* p, std::size_t n, std::uint32_t crc) {
  static const stripe_shift past_stripe;
  std::uint64_t c0 = crc;
  while (n >= 3 * stripe) {
    std::uint64_t c1 = 0, c2 = 0;
    const unsigned char* p1 = p + stripe;
    const unsigned char* p2 = p + 2 * stripe;
    for (std::size_t i = 0; i < stripe; i += 8) {
      std::uint64_t a, b, d;
      std::memcpy(&a, p + i, 8);
      std::memcpy(&b, p1 + i, 8);
      std::memcpy(&d, p2 + i, 8);
      c0 = _mm_crc32_u64(c0, a);
      c1 = _mm_crc32_u64(c1, b);
      c2 = _mm_crc32_u64(c2, d);
    }
    // crc(A||B) = shift(crc(A), |B|) ^ crc0(B) for the raw (non-inverted) register.
    c0 = past_stripe(static_cast<std::uint32_t>(c0)) ^ c1;
    c0 = past_stripe(static_cast<std::uint32_t>(c0)) ^ c2;
    p += 3 * stripe;
    n -= 3 * stripe;
  }
  while (n >= 8) {
    std::uint64_t a;
    std::memcpy(&a, p, 8);
    c0 = _mm_crc32_u64(c0, a);
    p += 8;
    n -= 8;
  }
  std::uint32_t c = static_cast<std::uint32_t>(c0);
  while (n-- > 0) c = _mm_crc32_u8(c, *p++);
  return c;
}
#endif

}  // namespace

std::uint32_t crc32c(const void* data, std::size_t bytes, std::uint32_t crc) noexcept {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  crc = hw ? crc_hw(p, bytes, crc) : crc_table(p, bytes, crc);
#else
  crc = crc_table(p, bytes, crc);
#endif
  return ~crc;
}

}  // namespace ssdtrain
