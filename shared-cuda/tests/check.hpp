// A minimal test harness: TEST(name) { ... } with CHECK / CHECK_THROWS, SKIP("why"), and a main() that runs every
// test and returns 0 (all passed), 1 (a failure) or 77 (everything that ran was skipped).
#pragma once

#include <cstdio>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace check {

struct skipped : std::exception {
  std::string why;
  explicit skipped(std::string w) : why(std::move(w)) {}
};

struct failure : std::exception {
  std::string what_failed;
  explicit failure(std::string w) : what_failed(std::move(w)) {}
};

inline std::vector<std::pair<std::string, std::function<void()>>>& registry() {
  static std::vector<std::pair<std::string, std::function<void()>>> tests;
  return tests;
}

struct registrar {
  registrar(const char* name, std::function<void()> fn) { registry().emplace_back(name, std::move(fn)); }
};

inline std::string where(const char* file, int line) { return std::string(file) + ":" + std::to_string(line); }

}  // namespace check

#define TEST(name)                                              \
  static void test_##name();                                    \
  static check::registrar registrar_##name(#name, test_##name); \
  static void test_##name()

#define CHECK(cond)                                                                                    \
  do {                                                                                                 \
    if (!(cond)) throw check::failure(check::where(__FILE__, __LINE__) + ": CHECK(" #cond ") failed"); \
  } while (0)

#define CHECK_THROWS(exc, expr)                                                                               \
  do {                                                                                                        \
    bool thrown_ = false;                                                                                     \
    try {                                                                                                     \
      (void)(expr);                                                                                           \
    } catch (const exc&) {                                                                                    \
      thrown_ = true;                                                                                         \
    }                                                                                                         \
    if (!thrown_) throw check::failure(check::where(__FILE__, __LINE__) + ": " #expr " did not throw " #exc); \
  } while (0)

#define SKIP(why) throw check::skipped(why)

int main() {
  int passed = 0, failed = 0, skipped = 0;
  for (auto& [name, fn] : check::registry()) {
    try {
      fn();
      ++passed;
      std::printf("PASS %s\n", name.c_str());
    } catch (const check::skipped& s) {
      ++skipped;
      std::printf("SKIP %s: %s\n", name.c_str(), s.why.c_str());
    } catch (const check::failure& f) {
      ++failed;
      std::printf("FAIL %s: %s\n", name.c_str(), f.what_failed.c_str());
    } catch (const std::exception& e) {
      ++failed;
      std::printf("FAIL %s: unexpected exception: %s\n", name.c_str(), e.what());
    }
  }
  std::printf("%d passed, %d failed, %d skipped\n", passed, failed, skipped);
  if (failed > 0) return 1;
  return (passed == 0 && skipped > 0) ? 77 : 0;
}
