#pragma once
// A minimal stand-in for the doctest header, used ONLY by tests/gpu/run.sh on a GPU machine
// whose image has no doctest (nothing can be installed there). It implements the subset that
// the GPU tests and test_tile_math use, with doctest's spelling: TEST_CASE, CHECK, REQUIRE,
// CHECK_THROWS_AS, CHECK_NOTHROW, CAPTURE, doctest::Approx, doctest::Context with the -tc=
// filter, DOCTEST_CONFIG_IMPLEMENT(_WITH_MAIN). Everywhere else the real doctest is used.
// Assertions may run on several threads; CAPTURE values are per thread.

#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace doctest {

/// Approximate equality for floating-point checks (relative epsilon, as doctest's default).
class Approx {
 public:
  explicit Approx(double v) : v_(v) {}
  friend bool operator==(double x, const Approx& a) {
    return std::fabs(x - a.v_) <= a.eps_ * (1.0 + std::fmax(std::fabs(x), std::fabs(a.v_)));
  }
  friend bool operator==(const Approx& a, double x) { return x == a; }
  friend bool operator!=(double x, const Approx& a) { return !(x == a); }
  friend bool operator!=(const Approx& a, double x) { return !(x == a); }

 private:
  double v_;
  double eps_ = 1.1920929e-05;  // float epsilon * 100, doctest's default
};

namespace fallback {

struct TestCase {
  const char* name;
  void (*fn)();
};

inline std::vector<TestCase>& registry() {
  static std::vector<TestCase> r;
  return r;
}

struct Stats {
  std::atomic<long> checks{0}, failed_checks{0};
  std::atomic<bool> current_failed{false};
  std::mutex print;
};

inline Stats& stats() {
  static Stats s;
  return s;
}

/// Active CAPTURE lines of this thread (printed with a failure).
inline std::vector<std::function<std::string()>>& captures() {
  thread_local std::vector<std::function<std::string()>> c;
  return c;
}

/// Thrown by a failed REQUIRE: ends the test case.
struct RequireFailed {};

inline void report(bool ok, const char* what, const char* file, int line, const char* kind) {
  Stats& s = stats();
  ++s.checks;
  if (ok) return;
  ++s.failed_checks;
  s.current_failed = true;
  std::lock_guard lock(s.print);
  std::printf("%s:%d: ERROR: %s( %s ) is NOT correct!\n", file, line, kind, what);
  for (auto& c : captures()) std::printf("  logged: %s\n", c().c_str());
}

/// Keeps a copy of the captured value (so a captured temporary stays valid).
template <class T>
class Capture {
 public:
  Capture(const char* name, T value) : name_(name), value_(std::move(value)) {
    captures().push_back([this] {
      std::ostringstream os;
      os << name_ << " := " << value_;
      return os.str();
    });
  }
  Capture(const Capture&) = delete;
  Capture& operator=(const Capture&) = delete;
  ~Capture() { captures().pop_back(); }

 private:
  const char* name_;
  T value_;
};

inline int add(const char* name, void (*fn)()) {
  registry().push_back({name, fn});
  return 0;
}

/// Glob match with '*' (as doctest's -tc= filters).
inline bool matches(const char* pattern, const char* text) {
  if (*pattern == '\0') return *text == '\0';
  if (*pattern == '*') return matches(pattern + 1, text) || (*text && matches(pattern, text + 1));
  return *text && *pattern == *text && matches(pattern + 1, text + 1);
}

}  // namespace fallback

/// Runs the registered test cases (those matching -tc=PATTERN[,PATTERN] when given).
class Context {
 public:
  Context(int argc = 0, char** argv = nullptr) {
    for (int i = 1; i < argc; ++i) {
      const char* a = argv[i];
      for (const char* key : {"-tc=", "--test-case="})
        if (std::strncmp(a, key, std::strlen(key)) == 0) {
          std::string list = a + std::strlen(key);
          std::size_t start = 0;
          while (start <= list.size()) {
            const std::size_t comma = list.find(',', start);
            filters_.push_back(list.substr(start, comma == std::string::npos ? std::string::npos : comma - start));
            if (comma == std::string::npos) break;
            start = comma + 1;
          }
        }
    }
  }
  int run() {
    fallback::Stats& s = fallback::stats();
    int cases = 0, failed = 0;
    for (const auto& tc : fallback::registry()) {
      bool selected = filters_.empty();
      for (const auto& f : filters_) selected = selected || fallback::matches(f.c_str(), tc.name);
      if (!selected) continue;
      ++cases;
      s.current_failed = false;
      try {
        tc.fn();
      } catch (const fallback::RequireFailed&) {
      } catch (const std::exception& e) {
        s.current_failed = true;
        std::printf("TEST CASE \"%s\" threw: %s\n", tc.name, e.what());
      } catch (...) {
        s.current_failed = true;
        std::printf("TEST CASE \"%s\" threw an unknown exception\n", tc.name);
      }
      if (s.current_failed) {
        ++failed;
        std::printf("TEST CASE FAILED: %s\n", tc.name);
      }
      std::fflush(stdout);
    }
    std::printf("[doctest fallback] test cases: %d | %d passed | %d failed\n", cases, cases - failed, failed);
    std::printf("[doctest fallback] assertions: %ld | %ld failed\n", s.checks.load(), s.failed_checks.load());
    return failed == 0 ? 0 : 1;
  }

 private:
  std::vector<std::string> filters_;
};

}  // namespace doctest

#define DOCTEST_FALLBACK_CAT2(a, b) a##b
#define DOCTEST_FALLBACK_CAT(a, b) DOCTEST_FALLBACK_CAT2(a, b)

#define DOCTEST_FALLBACK_TEST_CASE(fn, name)                                                     \
  static void fn();                                                                              \
  [[maybe_unused]] static const int DOCTEST_FALLBACK_CAT(fn, _reg) = ::doctest::fallback::add(name, fn); \
  static void fn()
#define TEST_CASE(name) DOCTEST_FALLBACK_TEST_CASE(DOCTEST_FALLBACK_CAT(doctest_fallback_case_, __COUNTER__), name)

#define CHECK(...) ::doctest::fallback::report(static_cast<bool>(__VA_ARGS__), #__VA_ARGS__, __FILE__, __LINE__, "CHECK")
#define REQUIRE(...)                                                                             \
  do {                                                                                           \
    const bool doctest_fallback_ok_ = static_cast<bool>(__VA_ARGS__);                            \
    ::doctest::fallback::report(doctest_fallback_ok_, #__VA_ARGS__, __FILE__, __LINE__, "REQUIRE"); \
    if (!doctest_fallback_ok_) throw ::doctest::fallback::RequireFailed{};                      \
  } while (0)
#define CHECK_THROWS_AS(expr, ...)                                                               \
  do {                                                                                           \
    bool doctest_fallback_ok_ = false;                                                           \
    try {                                                                                        \
      (void)(expr);                                                                              \
    } catch (const __VA_ARGS__&) {                                                               \
      doctest_fallback_ok_ = true;                                                               \
    } catch (...) {                                                                              \
    }                                                                                            \
    ::doctest::fallback::report(doctest_fallback_ok_, #expr " throws " #__VA_ARGS__, __FILE__, __LINE__, \
                                "CHECK_THROWS_AS");                                              \
  } while (0)
#define CHECK_NOTHROW(...)                                                                       \
  do {                                                                                           \
    bool doctest_fallback_ok_ = true;                                                            \
    try {                                                                                        \
      (void)(__VA_ARGS__);                                                                       \
    } catch (...) {                                                                              \
      doctest_fallback_ok_ = false;                                                              \
    }                                                                                            \
    ::doctest::fallback::report(doctest_fallback_ok_, #__VA_ARGS__, __FILE__, __LINE__, "CHECK_NOTHROW"); \
  } while (0)
#define CAPTURE(x) \
  const ::doctest::fallback::Capture<std::decay_t<decltype(x)>> DOCTEST_FALLBACK_CAT(doctest_fallback_capture_, __LINE__)(#x, x)

#if defined(DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN)
int main(int argc, char** argv) { return doctest::Context(argc, argv).run(); }
#endif
