// run_case, and the time-out runner: a quick collective under a time-out of milliseconds::max(),
// INT64_MAX ms or anything large (or the environment variable saying so) must succeed, as a
// time-out means "fail a wait longer than this", and no wait here is long.
#include <chrono>
#include <cstdlib>
#include <vector>

#include "fuzz/fuzz_runners.hpp"
#include "seqpar/comm/thread_communicator.hpp"

namespace seqpar::fuzz {

void run_timeout(const TimeoutCase& c, Report& rep) {
  const ThreadRunOptions options{std::chrono::milliseconds(c.via_env ? 0 : c.timeout_ms)};
  if (c.via_env) setenv(comm_timeout_env, c.env_text.c_str(), 1);
  const auto start = std::chrono::steady_clock::now();
  const std::string what = c.via_env ? std::string(comm_timeout_env) + "=\"" + c.env_text + "\""
                                     : "ThreadRunOptions.timeout " + std::to_string(c.timeout_ms) + " ms";
  try {
    run_ranks(
        c.world,
        [](ThreadCommunicator& comm) {
          comm.barrier();
          const std::int64_t mine = comm.rank();
          std::vector<std::int64_t> all(static_cast<std::size_t>(comm.size()));
          comm.all_gather_host(std::span<const std::int64_t>(&mine, 1), all);
          comm.barrier();
        },
        options);
  } catch (const ConfigError& e) {
    if (!c.via_env || c.env_valid) rep.fail(prop::timeout, what + ": a quick collective threw ConfigError: " + e.what());
  } catch (const std::exception& e) {
    rep.fail(prop::timeout, what + ": a quick collective failed: " + e.what());
  }
  if (c.via_env) unsetenv(comm_timeout_env);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() - start).count();
  rep.note(c.via_env ? "time-out: environment variable" : "time-out: ThreadRunOptions");
  if (ms > 20000) rep.fail(prop::timeout, what + ": a quick collective took " + std::to_string(ms) + " ms");
}

void run_case(const FuzzCase& c, Report& report) {
  switch (c.kind) {
    case CaseKind::attention:
      if (c.attention.kernel == KernelKind::cpu_flash_1 || c.attention.kernel == KernelKind::cpu_flash_2)
        run_attention_cpu(c.attention, report);
      else
        run_attention_reference(c.attention, report);
      break;
    case CaseKind::decode: run_decode(c.decode, report); break;
    case CaseKind::timeout: run_timeout(c.timeout, report); break;
  }
}

}  // namespace seqpar::fuzz
