#!/usr/bin/env python3
"""The cost model against this machine: estimated vs measured time of seqpar_demo runs.

For each problem (a shape, a mask, a world over MPI or threads) it runs every candidate
policy with --estimate (the cost model on figures calibrated in the same run) and once with
--policy auto (the advisor's first choice over every legal mesh), alternating the runs over
--rounds rounds and keeping the medians. It prints, and writes to --out, a Markdown table of
estimated vs measured time per run (forward, or forward + backward with --backward), the
median and worst error, and for each problem how far the advisor's choice is from the fastest
measured one. Standard library only.

    python3 bench/cost_model_validation.py --demo build/tools/seqpar_demo/seqpar_demo \
        --out docs/perf/cost_model.md --rounds 3
"""

import argparse
import pathlib
import os
import re
import shlex
import statistics
import subprocess
import sys
import time

# (name, comm, ranks, shape arguments, candidate policies). Each candidate is the policy part
# of the demo's command line; the advisor's choice (--policy auto) is added to every problem.
PROBLEMS = [
    ("S 8192 causal", "mpi", 4, "--seq 8192 --causal",
     ["--policy ulysses", "--policy ring --layout zigzag", "--policy ring --layout contiguous",
      "--policy unified --ulysses-degree 2 --ring-degree 2 --layout zigzag"]),
    ("S 8192 full", "mpi", 4, "--seq 8192",
     ["--policy ulysses", "--policy ring", "--policy unified --ulysses-degree 2 --ring-degree 2"]),
    ("S 4096 causal, training", "mpi", 4, "--seq 4096 --causal --backward",
     ["--policy ulysses", "--policy ring --layout zigzag", "--policy ring --layout contiguous",
      "--policy unified --ulysses-degree 2 --ring-degree 2 --layout zigzag"]),
    ("S 16384 causal", "mpi", 2, "--seq 16384 --causal --heads 4",
     ["--policy ulysses", "--policy ring --layout zigzag", "--policy ring --layout contiguous"]),
    ("S 4099 causal GQA 6/3", "mpi", 3, "--seq 4099 --causal --heads 6 --kv-heads 3",
     ["--policy ulysses --anything", "--policy ring --layout zigzag --anything",
      "--policy ring --layout contiguous --anything"]),
    ("S 6000 causal, 5 ranks", "mpi", 5, "--seq 6000 --causal",
     ["--policy ulysses --anything", "--policy ring --layout zigzag --anything"]),
    ("S 32768 causal, 2 heads", "mpi", 4, "--seq 32768 --causal --heads 2",
     ["--policy ring --layout zigzag", "--policy ring --layout contiguous",
      "--policy unified --ulysses-degree 2 --ring-degree 2 --layout zigzag"]),
    ("S 8192 causal, 8 threads", "threads", 8, "--seq 8192 --causal",
     ["--policy ulysses", "--policy ring --layout zigzag",
      "--policy unified --ulysses-degree 2 --ring-degree 4 --layout zigzag",
      "--policy unified --ulysses-degree 4 --ring-degree 2 --layout zigzag"]),
    ("S 7937 window 512, 6 threads", "threads", 6, "--seq 7937 --window 512,0 --heads 6",
     ["--policy ulysses --anything", "--policy ring --layout zigzag --anything",
      "--policy ring --layout contiguous --anything"]),
    ("S 4096 documents, training", "threads", 4, "--seq 4096 --docs 700,1400,1996 --backward",
     ["--policy ulysses", "--policy ring --layout zigzag", "--policy ring --layout contiguous"]),
]

RESULT = re.compile(r"^RESULT (.*)$", re.M)


def run_demo(demo, comm, ranks, args, timeout):
    """One demo run; returns its RESULT fields (a dict), or raises with the demo's output."""
    cmd = [demo] + shlex.split(args) + ["--iters", "3"]
    if comm == "mpi":
        cmd = ["mpirun", "-np", str(ranks), "--oversubscribe", "--bind-to", "none"] + cmd
    else:
        cmd += ["--comm", "threads", "--ranks", str(ranks)]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_mpi_yield_when_idle="1")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    found = RESULT.findall(p.stdout)
    if p.returncode != 0 or not found:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    return dict(f.split("=", 1) for f in found[-1].split()), p.stdout


def describe(fields, stdout):
    """The choice as the run reports it: policy, mesh and layout."""
    name = ("anything " if "AnythingPolicy" in stdout else "") + fields["policy"]
    if fields["layout"] != "none" and fields["mesh"] != f"{fields['ranks']}x1":
        name += " " + fields["layout"]
    if fields["policy"] == "unified":
        name += " " + fields["mesh"]
    return name


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="build/tools/seqpar_demo/seqpar_demo")
    ap.add_argument("--out", help="Markdown file to write")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds; medians are kept")
    ap.add_argument("--only", help="comma-separated problem indices")
    ap.add_argument("--timeout", type=int, default=300)
    a = ap.parse_args()
    problems = [PROBLEMS[int(i)] for i in a.only.split(",")] if a.only else PROBLEMS

    rows, choices = [], []
    started = time.time()
    for name, comm, ranks, shape, candidates in problems:
        runs = candidates + ["--policy auto"]
        measured = {c: [] for c in runs}
        estimated = {c: [] for c in runs}
        label = {}
        for r in range(a.rounds):
            order = runs if r % 2 == 0 else list(reversed(runs))  # alternate the sides
            for c in order:
                extra = "" if c == "--policy auto" else " --estimate"
                fields, stdout = run_demo(a.demo, comm, ranks, f"{c} {shape}{extra}", a.timeout)
                measured[c].append(float(fields["time_ms_per_iter"]))
                estimated[c].append(float(fields["est_ms"]))
                label[c] = describe(fields, stdout)
        med = {c: statistics.median(measured[c]) for c in runs}
        est = {c: statistics.median(estimated[c]) for c in runs}
        train = "--backward" in shape
        for c in candidates:
            rows.append((name, comm, ranks, label[c], "fwd+bwd" if train else "fwd", med[c], est[c]))
        fastest = min(candidates, key=lambda c: med[c])
        best = min(med[fastest], med["--policy auto"])
        choices.append((name, comm, ranks, label["--policy auto"], med["--policy auto"], est["--policy auto"],
                        label[fastest], med[fastest], med["--policy auto"] / best))
        print(f"{name}: auto -> {label['--policy auto']} {med['--policy auto']:.1f} ms; fastest measured "
              f"{label[fastest]} {med[fastest]:.1f} ms", flush=True)

    errors = [100.0 * (e - m) / m for *_, m, e in rows]
    within = sum(1 for c in choices if c[-1] <= 1.10)
    lines = [
        "| problem | comm | ranks | choice | pass | measured ms | estimated ms | error |",
        "|---|---|---:|---|---|---:|---:|---:|",
    ]
    for (name, comm, ranks, choice, pas, m, e), err in zip(rows, errors):
        lines.append(f"| {name} | {comm} | {ranks} | {choice} | {pas} | {m:.1f} | {e:.1f} | {err:+.0f}% |")
    lines += [
        "",
        f"{len(rows)} runs: median |error| {statistics.median(abs(x) for x in errors):.1f}%, "
        f"worst {max(abs(x) for x in errors):.1f}%.",
        "",
        "| problem | comm | ranks | advisor's choice (--policy auto) | its measured ms | its estimate | "
        "fastest candidate | its ms | auto / fastest |",
        "|---|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for name, comm, ranks, pick, pm, pe, fast, fm, ratio in choices:
        lines.append(f"| {name} | {comm} | {ranks} | {pick} | {pm:.1f} | {pe:.1f} | {fast} | {fm:.1f} | {ratio:.2f} |")
    lines += ["", f"The advisor's choice is within 10% of the fastest measured one in {within} of {len(choices)} "
              f"problems ({a.rounds} rounds, medians; {time.time() - started:.0f} s)."]
    text = "\n".join(lines) + "\n"
    sys.stdout.write(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
