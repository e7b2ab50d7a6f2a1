// SHA-256 (FIPS 180-4), used for JIT cache keys: a collision would load the wrong kernel, so no weak hash.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace shared_cuda::detail {

class sha256 {
 public:
  sha256();
  void update(const void* data, std::size_t bytes);
  void update(const std::string& text) { update(text.data(), text.size()); }
  // Lower-case hex digest; the object must not be updated afterwards.
  std::string hex_digest();

 private:
  void compress(const std::uint8_t* block);
  std::uint32_t state_[8];
  std::uint8_t buffer_[64];
  std::size_t buffered_ = 0;
  std::uint64_t total_bytes_ = 0;
};

}  // namespace shared_cuda::detail
