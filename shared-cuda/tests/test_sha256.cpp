#include "check.hpp"
#include "shared_cuda/detail/sha256.hpp"

using shared_cuda::detail::sha256;

static std::string digest(const std::string& text) {
  sha256 h;
  h.update(text);
  return h.hex_digest();
}

TEST(known_vectors) {  // FIPS 180-4 examples
  CHECK(digest("") == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(digest("abc") == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(digest("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq") ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(digest(std::string(1000000, 'a')) == "cdc76e5c9914fb9281a1c7e284d73e67f1809a48a497200e046d39ccc7112cd0");
}

TEST(incremental_equals_one_shot) {
  const std::string text(1000, 'x');
  sha256 h;
  for (std::size_t i = 0; i < text.size(); i += 37) h.update(text.substr(i, 37));
  CHECK(h.hex_digest() == digest(text));
}
