"""Side by side with the peers on one CPU machine (see README.md): seqpar's CpuFlashKernel
against torch's CPU flash attention, then seqpar's sequence-parallel attention over Open MPI
against yunchang's and diffusers' over torch.distributed (gloo). Timed rounds alternate
between the sides, so that a change of load on a shared machine hits all of them; each side's
figure is the median of its rounds. Writes one Markdown report.

Run through run.sh, which makes the venv and builds what this needs.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import os
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from peer_attention import Case, PeerError, PeerPool, reference_rows  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(*a):
    print(*a, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Kernel side by side
# ---------------------------------------------------------------------------------------------


class SeqparShim:
    """seqpar's CpuFlashKernel through seqpar_shim.cpp (ctypes)."""

    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        lib.seqpar_shim_create.restype = ctypes.c_void_p
        lib.seqpar_shim_create.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.seqpar_shim_destroy.argtypes = [ctypes.c_void_p]
        lib.seqpar_shim_isa.restype = ctypes.c_char_p
        lib.seqpar_shim_isa.argtypes = [ctypes.c_void_p]
        lib.seqpar_shim_last_error.restype = ctypes.c_char_p
        lib.seqpar_shim_forward.restype = ctypes.c_int
        lib.seqpar_shim_forward.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        lib.seqpar_shim_forward_bf16.restype = ctypes.c_int
        lib.seqpar_shim_forward_bf16.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4 + [ctypes.c_int]
        self.lib, self.kernels = lib, {}

    def kernel(self, threads: int):
        if threads not in self.kernels:
            k = self.lib.seqpar_shim_create(threads, 256)
            if not k:
                raise RuntimeError(self.lib.seqpar_shim_last_error().decode())
            self.kernels[threads] = k
        return self.kernels[threads]

    def isa(self) -> str:
        return self.lib.seqpar_shim_isa(self.kernel(1)).decode()

    def forward(self, threads, q, k, v, out, lse, causal: bool) -> None:
        """q, k, v, out contiguous [B, S, H, D] float32 or bfloat16 (all alike); lse [B, H, S] float32."""
        B, S, H, D = q.shape
        entry = self.lib.seqpar_shim_forward_bf16 if q.dtype == torch.bfloat16 else self.lib.seqpar_shim_forward
        rc = entry(self.kernel(threads), q.data_ptr(), k.data_ptr(), v.data_ptr(),
                                          out.data_ptr(), lse.data_ptr(), B, S, H, D, int(causal))
        if rc:
            raise RuntimeError(self.lib.seqpar_shim_last_error().decode())


def attention_gflop(B, H, S, D, causal) -> float:
    return 4.0 * B * H * S * S * D / (2 if causal else 1) * 1e-9


def norm_rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def alternate(sides: dict, rounds: int) -> dict:
    """Calls each side's timer once per round, in turn (A B A B ...); {name: median}."""
    times = {name: [] for name in sides}
    for _ in range(rounds):
        for name, timer in sides.items():
            times[name].append(timer())
    return {name: statistics.median(t) for name, t in times.items()}


def kernel_row(shim: SeqparShim, D: int, S: int, causal: bool, threads: int, rounds: int, B=1, H=4,
               dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(S * 1000 + D + causal)
    # BSHD, seqpar's layout, in `dtype` (bf16: rounded once from the float32 draws)
    q, k, v = (torch.randn((B, S, H, D), generator=g).to(dtype) for _ in range(3))
    qt, kt, vt = (x.transpose(1, 2).contiguous() for x in (q, k, v))  # the same values in BHSD, torch's
    out, lse = torch.empty_like(q), torch.empty((B, H, S))
    torch.set_num_threads(threads)

    def torch_call():
        return F.scaled_dot_product_attention(qt, kt, vt, is_causal=causal)

    def seqpar_call():
        shim.forward(threads, q, k, v, out, lse, causal)

    def timer(call, reps):
        def run():
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            return (time.perf_counter() - t0) / reps
        return run

    with torch.no_grad():
        t_warm = timer(torch_call, 1)()  # warm-up, and a measure of how many calls make a round
        timer(seqpar_call, 1)()
        reps = max(1, round(0.3 / t_warm))
        med = alternate({"torch": timer(torch_call, reps), "seqpar": timer(seqpar_call, reps)}, rounds)
        torch_out = torch_call().transpose(1, 2)
        seqpar_call()
        torch.set_num_threads(2)  # the reference is untimed
        ref = reference_rows(q.float(), k.float(), v.float(), torch.arange(S), causal)
    gf = attention_gflop(B, H, S, D, causal)
    return {"D": D, "S": S, "causal": causal, "threads": threads, "dtype": str(dtype).removeprefix("torch."),
            "torch_gflops": gf / med["torch"],
            "seqpar_gflops": gf / med["seqpar"], "ratio": med["torch"] / med["seqpar"],
            "torch_err": norm_rel(torch_out, ref), "seqpar_err": norm_rel(out, ref)}


def kernel_table(shim: SeqparShim, rounds: int, dtypes) -> list[str]:
    configs = []
    for dt in dtypes:
        configs += [(D, S, c, 1, dt) for D in (64, 128) for S in (2048, 4096, 8192) for c in (False, True)]
        configs += [(128, 8192, c, 2, dt) for c in (False, True)]
    lines = ["| dtype | D | S | causal | threads | torch GFLOP/s | seqpar GFLOP/s | seqpar/torch | torch err | seqpar err |",
             "| :--- | ---: | ---: | :---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for D, S, c, t, dt in configs:
        r = kernel_row(shim, D, S, c, t, rounds, dtype=dt)
        lines.append(f"| {r['dtype']} | {D} | {S} | {'yes' if c else 'no'} | {t} | {r['torch_gflops']:.1f} "
                     f"| {r['seqpar_gflops']:.1f} | {r['ratio']:.2f} | {r['torch_err']:.1e} | {r['seqpar_err']:.1e} |")
        log(lines[-1])
    return lines


# ---------------------------------------------------------------------------------------------
# Distributed side by side
# ---------------------------------------------------------------------------------------------

# (label, algo, procs, seq, heads, causal, ulysses, ring, seqpar_demo options)
DIST_ROWS = [
    ("Ulysses", "ulysses", 2, 4096, 8, False, 2, 1, ["--policy", "ulysses"]),
    ("Ulysses", "ulysses", 2, 4096, 8, True, 2, 1, ["--policy", "ulysses"]),
    ("Ring", "ring", 2, 4096, 8, False, 1, 2, ["--policy", "ring"]),
    ("Ring (zigzag)", "ring", 2, 4096, 8, True, 1, 2, ["--policy", "ring", "--layout", "zigzag"]),
    ("USP 2x2", "usp", 4, 4096, 8, False, 2, 2, ["--policy", "unified", "--ulysses-degree", "2", "--ring-degree", "2"]),
    ("Ulysses", "ulysses", 2, 8192, 8, False, 2, 1, ["--policy", "ulysses"]),
    ("Ring", "ring", 2, 8192, 8, False, 1, 2, ["--policy", "ring"]),
    ("Ulysses Anything", "anything", 4, 4099, 30, False, 4, 1, ["--policy", "ulysses", "--anything"]),
    # Four processes on Ulysses and Ring alone. (On a 2-core machine two of the four run at a
    # time, for the peers as for seqpar: the rows compare how each waits, not only its work.)
    ("Ulysses", "ulysses", 4, 4096, 8, False, 4, 1, ["--policy", "ulysses"]),
    ("Ring", "ring", 4, 4096, 8, False, 1, 4, ["--policy", "ring"]),
    ("Ulysses", "ulysses", 4, 8192, 8, False, 4, 1, ["--policy", "ulysses"]),
    ("Ring", "ring", 4, 8192, 8, False, 1, 4, ["--policy", "ring"]),
]
PEERS = ("yunchang", "diffusers")


class Seqpar:
    """seqpar_demo under mpirun, one rank a process, one thread a rank."""

    def __init__(self, build: str):
        self.demo = os.path.join(build, "tools", "seqpar_demo", "seqpar_demo")
        self.env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
                        OMPI_MCA_mpi_yield_when_idle="1")

    def command(self, procs, seq, heads, causal, options, iters, check=False) -> list[str]:
        # unbound, like bench/run.sh and like the peers' processes: on a shared machine a rank
        # pinned to a busy core could not move
        cmd = ["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(procs), self.demo, *options,
               "--seq", str(seq), "--heads", str(heads), "--head-dim", "64", "--threads", "1", "--iters", str(iters)]
        return cmd + (["--causal"] if causal else []) + (["--check"] if check else [])

    def run(self, *args, **kw) -> dict:
        cmd = self.command(*args, **kw)
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        if p.returncode or not line:
            raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-400:]}")
        return dict(kv.split("=", 1) for kv in line[-1].split()[1:])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# seqpar_demo's name of each torch dtype the distributed table runs
DEMO_DTYPE = {"float32": "f32", "bfloat16": "bf16"}


def dist_table(build: str, rounds: int, iters: int, check_seqpar: bool, rows: list[int],
               dtypes: list[str]) -> tuple[list[str], list[str]]:
    seqpar = Seqpar(build)
    lines = ["| Variant | dtype | P | S | H | causal | peer | peer ms | seqpar ms | peer/seqpar | peer bytes/rank "
             "| seqpar bytes/rank | peer err | seqpar err |",
             "| --- | --- | ---: | ---: | ---: | :---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    notes = []
    for dtype, (label, algo, P, S, H, causal, U, R, row_options) in ((d, DIST_ROWS[i]) for i in rows for d in dtypes):
        options = row_options + ["--dtype", DEMO_DTYPE[dtype]]
        pools, peer_med, peer_err = {}, {}, {}
        for peer in PEERS:
            case = Case(peer, algo, P, S, H, 64, causal, U, R, dtype=dtype)
            try:
                pools[peer] = PeerPool(case, free_port())
            except PeerError as e:
                peer_med[peer] = None
                notes.append(f"{label} {dtype} P={P} S={S}{' causal' if causal else ''}, {peer}: {e}")
                log(notes[-1])
        sides = {"seqpar": lambda: float(seqpar.run(P, S, H, causal, options, iters)["time_ms_per_iter"])}
        sides.update({peer: (lambda p=pool: p.time_ms(iters)) for peer, pool in pools.items()})
        med = alternate(sides, rounds)
        for peer, pool in pools.items():
            peer_med[peer] = med[peer]
            peer_err[peer] = pool.check()
            pool.close()
        # bytes from the untimed check run, or (without it) from a one-iteration run
        sp = seqpar.run(P, S, H, causal, options, 1, check=check_seqpar)
        for peer in PEERS:
            case = Case(peer, algo, P, S, H, 64, causal, U, R, dtype=dtype)
            t, err = peer_med.get(peer), peer_err.get(peer)
            timing = (f"- | {med['seqpar']:.1f} | - | -" if t is None else
                      f"{t:.1f} | {med['seqpar']:.1f} | {t / med['seqpar']:.2f} | {case.bytes_per_rank():,}")
            lines.append(f"| {label} | {DEMO_DTYPE[dtype]} | {P} | {S} | {H} | {'yes' if causal else 'no'} | {peer} | {timing} "
                         f"| {int(sp['bytes_sent_per_rank']):,} | {'-' if err is None else format(err['max_rel'], '.1e')} "
                         f"| {sp['max_rel_err']} |")
            log(lines[-1])
    return lines, notes


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def sh(*cmd) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, cwd=REPO).stdout.strip()
    except OSError:
        return "?"


def header(shim: SeqparShim, command: str) -> list[str]:
    import diffusers
    import yunchang

    model = next((l.split(":", 1)[1].strip() for l in sh("lscpu").splitlines() if l.startswith("Model name")), "?")
    dirty = (" (include/, examples/ or tools/ had uncommitted changes: other work in progress in this tree)"
             if sh("git", "status", "--porcelain", "--untracked-files=no", "--", "include", "examples", "tools") else "")
    return [
        "# seqpar against its peers on one CPU",
        "",
        f"- CPU: {model} ({os.cpu_count()} logical CPUs, shared with other jobs: a possibly busy machine)",
        f"- seqpar's SIMD path (CpuFlashKernel): {shim.isa()}; torch's CPU capability: "
        f"{torch.backends.cpu.get_cpu_capability()}",
        f"- torch {torch.__version__}, yunchang {yunchang.__version__}, diffusers {diffusers.__version__}, "
        f"Python {sys.version.split()[0]}",
        f"- date {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}, "
        f"git commit {sh('git', 'rev-parse', '--short', 'HEAD')}{dirty}",
        f"- command: `{command}`",
        f"- load average at the start (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}",
        "",
    ]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shim", required=True, help="libseqpar_shim.so built by run.sh")
    ap.add_argument("--build", required=True, help="build folder holding tools/seqpar_demo/seqpar_demo")
    ap.add_argument("--only", choices=["kernel", "dist"], help="run one of the two tables")
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds per side (>= 3)")
    ap.add_argument("--kernel-dtypes", default="float32,bfloat16",
                    help="element types of the kernel table (float32, bfloat16; comma-separated)")
    ap.add_argument("--dist-dtypes", default="float32,bfloat16",
                    help="element types of the distributed table (float32, bfloat16), comma-separated")
    ap.add_argument("--iters", type=int, default=3, help="forwards per distributed round")
    ap.add_argument("--no-seqpar-check", action="store_true", help="skip seqpar_demo --check (slow: minutes)")
    ap.add_argument("--rows", default=",".join(map(str, range(len(DIST_ROWS)))),
                    help="distributed rows to run, as indices into DIST_ROWS (default: all)")
    ap.add_argument("--out", help="also write the report to this file")
    ap.add_argument("--command", default=" ".join(sys.argv), help="the command to quote in the report")
    a = ap.parse_args()
    shim = SeqparShim(a.shim)
    t0 = time.time()
    report = header(shim, a.command)
    if a.only != "dist":
        dtypes = [getattr(torch, name) for name in a.kernel_dtypes.split(",")]
        report += ["## Kernel: one forward, B=1, H=4", "",
                   "torch: `F.scaled_dot_product_attention` on [B, H, S, D] (its CPU flash path), "
                   "`torch.set_num_threads(threads)`; seqpar: `CpuFlashKernel(threads)` on [B, S, H, D] with LSE "
                   "(float32; bf16: bf16 inputs and output, float accumulation, the LSE in float32). Same values. "
                   "GFLOP/s = 4 B H S^2 D / time (halved for causal), median of "
                   f"{a.rounds} alternating rounds after a warm-up. Errors: ||o - ref|| / ||ref|| against "
                   "float64 attention of the same (bf16: rounded) inputs.", ""]
        report += kernel_table(shim, a.rounds, dtypes) + [""]
    if a.only != "kernel":
        lines, notes = dist_table(a.build, a.rounds, a.iters, not a.no_seqpar_check,
                                  [int(i) for i in a.rows.split(",")], a.dist_dtypes.split(","))
        report += ["## Sequence parallel: one forward, B=1, D=64, one thread per rank", "",
                   "seqpar: `mpirun --oversubscribe --bind-to none -np P seqpar_demo ... --threads 1` (Open MPI, "
                   "`OMPI_MCA_mpi_yield_when_idle=1`); peers: P processes over torch.distributed gloo, "
                   "`torch.set_num_threads(1)`. Time: ms per forward of the slowest rank, median of "
                   f"{a.rounds} alternating rounds of {a.iters} forwards after a warm-up. Bytes: seqpar's "
                   "counted bytes (RESULT line); the peers' from their code's traffic (README.md). "
                   "Errors: max|o - ref| / max|ref| against float64 attention (seqpar: `--check`, in a "
                   "separate untimed run). bf16: both sides take bf16 inputs (rounded once from the same "
                   "float32 draws), send bf16 and return bf16 (seqpar: `--dtype bf16`).", ""]
        report += lines + [""]
        if notes:
            report += ["Rows a peer could not run:", ""] + [f"- {n}" for n in notes] + [""]
    report.append(f"Total run time {(time.time() - t0) / 60:.0f} min; load average at the end: "
                  f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}.")
    text = "\n".join(report) + "\n"
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
