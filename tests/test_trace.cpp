// The event log of PhaseProfile and its Chrome trace (seqpar/core/trace.hpp): a forward and a
// backward on thread ranks, written as a trace and read back with a strict JSON parser. The
// trace must be JSON, name every rank's tracks, and its bars must add up to the profile's sums
// (phases, calls, hops), nest within their call and never overlap on one track. A full log
// counts what it drops and does not grow.
//
// SEQPAR_TRACE_OUT=<file> makes the last test case write a 4-rank zigzag ring trace (forward
// and backward, after a warm-up pair) for tools/trace_svg.py; SEQPAR_TRACE_SEQ sets its
// global length (default 4096; 4 heads of 64).
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdlib>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "seqpar/core/trace.hpp"
#include "support/attention_check.hpp"
#include "support/mini_json.hpp"

using namespace seqpar;
using namespace seqpar::test;

namespace {

/// Runs `warmups` untimed forward/backward pairs, then one with each rank's profile keeping
/// up to `capacity` events; returns the profiles. Checks that recording did not grow the log.
template <class Policy>
std::vector<PhaseProfile> traced_run(int ranks, Policy policy, const GlobalShape& c, std::size_t capacity,
                                     int warmups = 0) {
  const GlobalInputs g = make_inputs(c);
  std::vector<PhaseProfile> profiles(static_cast<std::size_t>(ranks));
  std::vector<const ProfileEvent*> buffers(profiles.size());
  for (std::size_t w = 0; w < profiles.size(); ++w) {
    profiles[w].keep_events(capacity);
    buffers[w] = profiles[w].events().data();
  }
  const std::int64_t B = c.batch, H = c.heads, K = c.kv_heads, D = c.head_dim;
  run_ranks(ranks, [&](ThreadCommunicator& comm) {
    const auto w = static_cast<std::size_t>(comm.rank());
    SequenceParallelAttention<Policy, ThreadCommunicator, CpuFlashKernel> attn(comm, policy);
    const Plan plan = attn.plan(c.problem<float>(true), {split_sequence(c.seq_q, attn.mesh())[w]});
    const PositionMap qp = plan.q_positions(comm.rank()), kp = plan.kv_positions(comm.rank());
    const std::int64_t lq = qp.size(), lk = kp.size();
    const LocalSlices<float> x = local_slices<float>(g, qp, kp);
    const auto dout = take_rows<float>(g.q, B, c.seq_q, H, D, qp);
    std::vector<std::byte> ws(std::max(plan.workspace_bytes(), plan.backward_workspace_bytes()));
    std::vector<float> out(x.q.size()), lse(static_cast<std::size_t>(B * lq * H)), dq(x.q.size()), dk(x.k.size()),
        dv(x.v.size());
    using CV = TensorView<const float>;
    using V = TensorView<float>;
    const auto l = V::lse_bhs(lse.data(), B, lq, H);
    auto pair = [&] {
      attn.template forward<float>(plan, CV::bshd(x.q.data(), B, lq, H, D), CV::bshd(x.k.data(), B, lk, K, D),
                                   CV::bshd(x.v.data(), B, lk, K, D), V::bshd(out.data(), B, lq, H, D), l, ws);
      attn.template backward<float>(plan, CV::bshd(dout.data(), B, lq, H, D), CV::bshd(x.q.data(), B, lq, H, D),
                                    CV::bshd(x.k.data(), B, lk, K, D), CV::bshd(x.v.data(), B, lk, K, D),
                                    CV::bshd(out.data(), B, lq, H, D), l, V::bshd(dq.data(), B, lq, H, D),
                                    V::bshd(dk.data(), B, lk, K, D), V::bshd(dv.data(), B, lk, K, D), ws);
    };
    for (int i = 0; i < warmups; ++i) pair();
    attn.set_profile(&profiles[w]);
    pair();
    attn.set_profile(nullptr);
  });
  for (std::size_t w = 0; w < profiles.size(); ++w) {
    CHECK(profiles[w].event_capacity() == capacity);
    CHECK(profiles[w].events().size() <= capacity);
    if (!profiles[w].events().empty()) CHECK(profiles[w].events().data() == buffers[w]);  // never reallocated
  }
  return profiles;
}

std::string trace_of(const std::vector<PhaseProfile>& profiles) {
  std::ostringstream os;
  write_chrome_trace(os, profiles);
  return os.str();
}

const char* pass_name(Pass p) { return p == Pass::forward ? "forward" : "backward"; }

/// An X event as read back.
struct Bar {
  std::string name, cat;
  int tid;
  double ts, dur;
};

/// Reads `text` back and checks it against the profiles it was written from (rank = index).
/// `ring`: ring steps of the run (hops expected when > 1).
void check_trace(const std::string& text, const std::vector<PhaseProfile>& profiles, int ring) {
  json::Value doc;
  REQUIRE_NOTHROW(doc = json::parse(text));
  REQUIRE(doc.is(json::Value::Type::object));
  REQUIRE(doc.get("traceEvents"));
  REQUIRE(doc.get("traceEvents")->is(json::Value::Type::array));
  REQUIRE(doc.get("displayTimeUnit"));
  CHECK(doc.get("displayTimeUnit")->s == "ms");

  std::set<std::string> phase_names;
  for (int p = 0; p < static_cast<int>(Phase::count); ++p) phase_names.insert(phase_name(static_cast<Phase>(p)));
  std::map<int, std::vector<Bar>> bars;          // by pid, in file order
  std::map<int, std::string> process_names;      // pid -> name
  std::map<std::pair<int, int>, std::string> thread_names;
  auto is_int = [](const json::Value* v) { return v && v->is(json::Value::Type::number) && v->n == std::floor(v->n); };
  for (const json::Value& e : doc.get("traceEvents")->a) {
    REQUIRE(e.is(json::Value::Type::object));
    const json::Value *ph = e.get("ph"), *name = e.get("name"), *pid = e.get("pid"), *tid = e.get("tid"),
                      *args = e.get("args");
    REQUIRE((ph && ph->is(json::Value::Type::string)));
    REQUIRE((name && name->is(json::Value::Type::string) && !name->s.empty()));
    REQUIRE(is_int(pid));
    REQUIRE(is_int(tid));
    REQUIRE((args && args->is(json::Value::Type::object)));
    const int p = static_cast<int>(pid->n), t = static_cast<int>(tid->n);
    if (ph->s == "M") {
      if (name->s == "process_name") process_names[p] = args->get("name")->s;
      if (name->s == "thread_name") thread_names[{p, t}] = args->get("name")->s;
      continue;
    }
    REQUIRE(ph->s == "X");
    const json::Value *ts = e.get("ts"), *dur = e.get("dur"), *cat = e.get("cat");
    REQUIRE((ts && ts->is(json::Value::Type::number) && ts->n >= 0));
    REQUIRE((dur && dur->is(json::Value::Type::number) && dur->n >= 0));
    REQUIRE((cat && (cat->s == "forward" || cat->s == "backward")));
    REQUIRE(args->get("pass"));
    CHECK(args->get("pass")->s == cat->s);
    const bool call = name->s == cat->s + " call";
    CHECK((call || name->s == "hop" || phase_names.count(name->s) == 1));
    CHECK((call || is_int(args->get("step"))));
    CHECK((name->s == "hop") == (t > 0));  // hops, and only hops, on the hop tracks
    bars[p].push_back({name->s, cat->s, t, ts->n, dur->n});
  }

  REQUIRE(bars.size() == profiles.size());
  for (std::size_t w = 0; w < profiles.size(); ++w) {
    CAPTURE(w);
    const int r = static_cast<int>(w);
    CHECK(process_names[r] == "rank " + std::to_string(r));
    CHECK(thread_names[{r, 0}] == "phases");
    if (ring > 1) CHECK(thread_names[{r, 1}] == "hops");
    const std::vector<Bar>& b = bars[r];
    // Each track: in time order, and a bar either nests in the open one or starts after it ends
    // (in whole nanoseconds, as written: sums of decimal doubles would round).
    struct Span {
      std::int64_t start, end;
    };
    std::map<int, std::vector<Span>> open;
    for (const Bar& x : b) {
      CAPTURE(x.name);
      CAPTURE(x.tid);
      CAPTURE(x.ts);
      const Span me{std::llround(x.ts * 1e3), std::llround(x.ts * 1e3) + std::llround(x.dur * 1e3)};
      auto& stack = open[x.tid];
      if (!stack.empty()) CHECK(me.start >= stack.back().start);
      while (!stack.empty() && stack.back().end <= me.start) stack.pop_back();
      if (!stack.empty()) CHECK(me.end <= stack.back().end);
      const bool call = x.name == x.cat + " call";
      CHECK(stack.empty() == (call || x.tid > 0));  // phases only inside a call; calls and hops never nest
      stack.push_back(me);
    }
    // The bars add up to the profile's sums (each bar's ends are rounded to 1 ns).
    const PhaseProfile& prof = profiles[w];
    for (Pass pass : {Pass::forward, Pass::backward}) {
      CAPTURE(pass_name(pass));
      double phases = 0, calls = 0, hops = 0, hop_sum = 0;
      std::map<std::string, double> per_phase;
      int n = 0;
      for (const Bar& x : b) {
        if (x.cat != pass_name(pass)) continue;
        ++n;
        if (x.name == x.cat + " call") calls += x.dur;
        else if (x.name == "hop") hops += x.dur;
        else {
          phases += x.dur;
          per_phase[x.name] += x.dur;
        }
      }
      for (int s = 0; s < PhaseProfile::max_steps; ++s) hop_sum += prof.hop_ms(pass, s) * 1e3;
      auto near = [&](double got, double want) { return std::abs(got - want) <= 1e-6 * want + 1e-3 * n + 1e-9; };
      CHECK(near(phases, prof.phases_ms(pass) * 1e3));
      CHECK(near(calls, prof.total_ms(pass) * 1e3));
      CHECK(near(hops, hop_sum));
      for (int p = 0; p < static_cast<int>(Phase::count); ++p) {
        const auto ph = static_cast<Phase>(p);
        CAPTURE(phase_name(ph));
        CHECK(near(per_phase[phase_name(ph)], prof.ms(pass, ph) * 1e3));
      }
      CHECK(calls > 0);
      CHECK(phases > 0);
      CHECK((hops > 0) == (ring > 1));
    }
  }
}

}  // namespace

TEST_CASE("trace: the JSON parser of the tests rejects what is not JSON") {
  const json::Value v = json::parse(R"( {"a":[1,-2.5e3,true,false,null,"x\"\\\/\n\u0041"],"b":{}} )");
  CHECK(v.get("a")->a.size() == 6);
  CHECK(v.get("a")->a[1].n == -2500.0);
  CHECK(v.get("a")->a[5].s == "x\"\\/\nA");
  for (const char* bad : {R"({"a":1,})", R"([1,2,])", R"({"a":1)", R"({"a" 1})", R"([NaN])", R"([1.])", R"([01])",
                          R"(["tab	in"])", R"(["\x"])", R"({"a":1}{)", R"({a:1})", R"({"a":1,"a":2})", "", "[inf]"}) {
    CAPTURE(bad);
    CHECK_THROWS_AS(json::parse(bad), json::ParseError);
  }
}

TEST_CASE("trace: a 4-rank zigzag ring's forward and backward, every bar accounted for") {
  const GlobalShape c = make_case(256, 4, 4, 32, true, 11);
  const std::vector<PhaseProfile> profiles = traced_run(4, RingPolicy<Zigzag>{}, c, 4096);
  for (const PhaseProfile& p : profiles) {
    CHECK(p.dropped_events() == 0);
    CHECK(!p.events().empty());
  }
  const std::string text = trace_of(profiles);
  check_trace(text, profiles, 4);
  // The parser is no rubber stamp: one stray comma and the document is refused.
  SUBCASE("a corrupted copy is refused by the parser") {
    std::string broken = text;
    broken.insert(broken.rfind(']'), ",");  // a trailing comma
    CHECK_THROWS_AS(json::parse(broken), json::ParseError);
  }
}

TEST_CASE("trace: a 2x2 Unified mesh shows its all-to-alls and its ring hops") {
  const GlobalShape c = make_case(256, 4, 2, 32, true, 12);
  const std::vector<PhaseProfile> profiles = traced_run(4, UnifiedPolicy<Zigzag>{2, 2}, c, 4096);
  const std::string text = trace_of(profiles);
  check_trace(text, profiles, 2);
  CHECK(text.find("\"a2a_in\"") != std::string::npos);
  CHECK(text.find("\"a2a_out\"") != std::string::npos);
}

TEST_CASE("trace: a full log counts what it drops, and reset keeps its buffer") {
  const GlobalShape c = make_case(128, 2, 2, 16, false, 13);
  const std::vector<PhaseProfile> full = traced_run(2, RingPolicy<Contiguous>{}, c, 4096);
  const std::vector<PhaseProfile> tiny = traced_run(2, RingPolicy<Contiguous>{}, c, 5);
  for (std::size_t w = 0; w < full.size(); ++w) {
    CAPTURE(w);
    const std::size_t all = full[w].events().size();
    CHECK(all > 5);
    CHECK(tiny[w].events().size() == 5);
    CHECK(tiny[w].dropped_events() == all - 5);
    // The sums do not depend on the log.
    CHECK(tiny[w].calls(Pass::backward) == 1);
    // The first events kept are the first that ended, in the same order as the full log's.
    for (std::size_t i = 0; i < 5; ++i) {
      CHECK(tiny[w].events()[i].kind == full[w].events()[i].kind);
      CHECK(tiny[w].events()[i].phase == full[w].events()[i].phase);
    }
  }
  // A truncated trace is still JSON, and says what it lacks.
  const std::string text = trace_of(tiny);
  CHECK_NOTHROW(json::parse(text));
  CHECK(text.find("events dropped") != std::string::npos);

  PhaseProfile p = tiny[0];
  CHECK(p.event_capacity() == 5);
  CHECK(p.events().size() == 5);
  const ProfileEvent* buffer = p.events().data();
  p.reset();
  CHECK(p.events().empty());
  CHECK(p.dropped_events() == 0);
  CHECK(p.event_capacity() == 5);
  CHECK(p.calls(Pass::forward) == 0);
  const auto t0 = PhaseProfile::clock::now();
  for (int i = 0; i < 7; ++i) p.add(Pass::forward, Phase::compute, i, t0, t0 + std::chrono::microseconds(10));
  CHECK(p.events().data() == buffer);  // the buffer reset kept
  CHECK(p.events().size() == 5);
  CHECK(p.dropped_events() == 2);
  CHECK(p.ms(Pass::forward, Phase::compute) == doctest::Approx(0.07));  // the sums count every lap
  CHECK(p.events()[4].step == 4);
  CHECK(p.events()[4].end_us - p.events()[4].start_us == doctest::Approx(10.0));

  // Off (the default, or capacity 0): nothing kept, nothing counted as dropped.
  PhaseProfile off;
  off.add(Pass::forward, Phase::pack, 0, t0, t0 + std::chrono::microseconds(1));
  CHECK(off.events().empty());
  CHECK(off.dropped_events() == 0);
  p.keep_events(0);
  p.add_call(Pass::forward, t0, t0 + std::chrono::microseconds(1));
  CHECK(p.events().empty());
  CHECK(p.event_capacity() == 0);
}

TEST_CASE("trace: SEQPAR_TRACE_OUT writes a 4-rank zigzag ring trace") {
  const char* path = std::getenv("SEQPAR_TRACE_OUT");
  if (!path || !*path) return;  // only on request
  const char* seq = std::getenv("SEQPAR_TRACE_SEQ");
  const std::int64_t S = seq && *seq ? std::atoll(seq) : 4096;
  const GlobalShape c = make_case(S, 4, 4, 64, true, 14);
  // One warm-up pair first: the trace shows the steady state, not first-touch page faults.
  const std::vector<PhaseProfile> profiles = traced_run(4, RingPolicy<Zigzag>{}, c, 4096, 1);
  const std::string text = trace_of(profiles);
  check_trace(text, profiles, 4);
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
  MESSAGE("wrote " << path);
}
