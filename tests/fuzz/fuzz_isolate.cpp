// fuzz_isolate.hpp: a case in a child process, or here under a watchdog.
#include "fuzz/fuzz_isolate.hpp"

#include <poll.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <string>

#include "fuzz/fuzz_runners.hpp"
#include "support/attention_check.hpp"

namespace seqpar::fuzz {
namespace {

using Clock = std::chrono::steady_clock;

/// One line: newlines and the field separator out.
std::string flat(std::string s) {
  for (char& ch : s)
    if (ch == '\n' || ch == '\x1f') ch = ' ';
  return s;
}

#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool cap_memory = false;  // the sanitizers reserve terabytes of address space
#else
constexpr bool cap_memory = true;
#endif

/// Writes all of `line` to `fd`.
void write_all(int fd, const std::string& line) {
  for (std::size_t at = 0; at < line.size();) {
    const ssize_t n = write(fd, line.data() + at, line.size() - at);
    if (n <= 0) return;
    at += static_cast<std::size_t>(n);
  }
}

}  // namespace

// The child's failures ("F", property, detail) and notes ("N", what) come one per line.
Report run_isolated(const FuzzCase& c, double seconds) {
  Report out;
  int fd[2];
  if (pipe(fd) != 0) {
    out.fail(prop::no_crash, "pipe failed");
    return out;
  }
  std::fflush(stdout);
  std::fflush(stderr);
  const pid_t pid = fork();
  if (pid < 0) {
    out.fail(prop::no_crash, "fork failed");
    return out;
  }
  if (pid == 0) {
    close(fd[0]);
    // A crash must end the child: a handler the caller installed (doctest's) would report it
    // as the caller's and carry on running the caller's program in the child.
    for (int sig : {SIGSEGV, SIGFPE, SIGABRT, SIGBUS, SIGILL}) std::signal(sig, SIG_DFL);
    if (cap_memory) {
      const rlimit cap{rlim_t{4} << 30, rlim_t{4} << 30};
      setrlimit(RLIMIT_AS, &cap);
    }
    Report rep;
    rep.sink = [&](const Failure& f) { write_all(fd[1], "F\x1f" + flat(f.property) + '\x1f' + flat(f.detail) + '\n'); };
    rep.note_sink = [&](const std::string& what) { write_all(fd[1], "N\x1f" + flat(what) + '\n'); };
    try {
      run_case(c, rep);
    } catch (const std::exception& e) {
      rep.fail(prop::no_crash, std::string("an exception escaped the runner: ") + e.what());
    }
    close(fd[1]);
    _exit(0);
  }
  close(fd[1]);
  std::string text;
  const auto deadline = Clock::now() + std::chrono::milliseconds(static_cast<long long>(seconds * 1000));
  bool hung = false;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      hung = true;
      break;
    }
    pollfd p{fd[0], POLLIN, 0};
    if (poll(&p, 1, static_cast<int>(std::min<long long>(left, 1000))) <= 0) continue;
    char buf[4096];
    const ssize_t n = read(fd[0], buf, sizeof buf);
    if (n <= 0) break;  // EOF: the child closed its end (finished or died)
    text.append(buf, static_cast<std::size_t>(n));
  }
  close(fd[0]);
  if (hung) kill(pid, SIGKILL);
  int status = 0;
  waitpid(pid, &status, 0);
  for (std::size_t at = 0; at < text.size();) {
    const std::size_t end = text.find('\n', at);
    if (end == std::string::npos) break;
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    const std::size_t sep = line.find('\x1f', 2);
    if (line.rfind("N\x1f", 0) == 0) out.notes.push_back(line.substr(2));
    else if (line.rfind("F\x1f", 0) == 0 && sep != std::string::npos)
      out.failures.push_back({line.substr(2, sep - 2), line.substr(sep + 1)});
  }
  if (hung) out.fail(prop::no_hang, "killed after " + std::to_string(seconds) + " s");
  else if (WIFSIGNALED(status))
    out.fail(prop::no_crash, std::string("signal ") + std::to_string(WTERMSIG(status)) + " (" + strsignal(WTERMSIG(status)) +
                                 ")" + (WTERMSIG(status) == SIGABRT ? " (an abort: std::terminate, or an assertion)" : ""));
  else if (WIFEXITED(status) && WEXITSTATUS(status) != 0)
    out.fail(prop::no_crash, "exit status " + std::to_string(WEXITSTATUS(status)));
  return out;
}


Report run_here(const FuzzCase& c, double seconds) {
  Report rep;
  try {
    seqpar::test::within(std::chrono::milliseconds(static_cast<long long>(seconds * 1000)), [&] { run_case(c, rep); },
                         "the case");
  } catch (const std::exception& e) {
    rep.fail(prop::no_crash, std::string("an exception escaped the runner: ") + e.what());
  }
  return rep;
}

}  // namespace seqpar::fuzz
