#!/usr/bin/env python3
"""Projections on paper: the advisor's ranking (seqpar_demo --advise) for published machine
presets at the scales users ask about. Nothing here runs attention: every figure is the cost
model's, from the preset's published numbers. Standard library only.

    python3 bench/cost_model_projections.py --demo build/tools/seqpar_demo/seqpar_demo \
        --out docs/perf/projections.md
"""

import argparse
import pathlib
import re
import shlex
import subprocess
import sys

# Model shapes (from the models' published configs):
#   FLUX.1-dev: 24 heads, D 128, joint attention over 512 text + image tokens (no mask), 57
#     attention layers a step (19 double-stream + 38 single-stream blocks). 1024x1024 gives
#     4096 image tokens; 3840x2160 ("4K UHD") gives 240 x 135 = 32,400.
#   Wan 2.1 14B: 40 heads, D 128, 40 layers, full attention; 720p x 81 frames is 21 latent
#     frames of 45 x 80 patches = 75,600 tokens.
#   Llama 3 8B: 32 query / 8 K/V heads, D 128, causal, 32 layers.
FLUX = "--heads 24 --head-dim 128 --dtype bf16"
WAN = "--heads 40 --head-dim 128 --dtype bf16"
LLAMA = "--heads 32 --kv-heads 8 --head-dim 128 --causal --dtype bf16 --backward"

# (section, label, machine, ranks, shape, layers, what the layers' total means)
SCENARIOS = [
    ("FLUX.1-dev, 1024x1024 (4,608 tokens), inference", "4 x L20", "l20-pcie", 4, f"--seq 4608 {FLUX}", 57, "a step"),
    ("FLUX.1-dev, 1024x1024 (4,608 tokens), inference", "4 x H100", "h100-sxm-ib", 4, f"--seq 4608 {FLUX}", 57, "a step"),
    ("FLUX.1-dev, 1024x1024 (4,608 tokens), inference", "8 x H100", "h100-sxm-ib", 8, f"--seq 4608 {FLUX}", 57, "a step"),
    ("FLUX-like, 3840x2160 (32,912 tokens), inference", "4 x L20", "l20-pcie", 4, f"--seq 32912 {FLUX}", 57, "a step"),
    ("FLUX-like, 3840x2160 (32,912 tokens), inference", "4 x H100", "h100-sxm-ib", 4, f"--seq 32912 {FLUX}", 57, "a step"),
    ("FLUX-like, 3840x2160 (32,912 tokens), inference", "8 x H100", "h100-sxm-ib", 8, f"--seq 32912 {FLUX}", 57, "a step"),
    ("Wan 2.1 14B video, inference", "75,600 tokens, 8 x H100", "h100-sxm-ib", 8, f"--seq 75600 {WAN}", 40, "a step"),
    ("Wan 2.1 14B video, inference", "151,200 tokens, 16 x H100", "h100-sxm-ib", 16, f"--seq 151200 {WAN}", 40, "a step"),
    ("Wan 2.1 14B video, inference", "302,400 tokens, 32 x H100", "h100-sxm-ib", 32, f"--seq 302400 {WAN}", 40, "a step"),
    ("Wan 2.1 14B video, inference", "302,400 tokens, 64 x H100", "h100-sxm-ib", 64, f"--seq 302400 {WAN}", 40, "a step"),
    ("Llama 3 8B, training (forward + backward)", "128K tokens, 8 x H100", "h100-sxm-ib", 8, f"--seq 131072 {LLAMA}", 32, "a training step's attention"),
    ("Llama 3 8B, training (forward + backward)", "256K tokens, 16 x H100", "h100-sxm-ib", 16, f"--seq 262144 {LLAMA}", 32, "a training step's attention"),
    ("Llama 3 8B, training (forward + backward)", "512K tokens, 64 x H100", "h100-sxm-ib", 64, f"--seq 524288 {LLAMA}", 32, "a training step's attention"),
    ("Llama 3 8B, training (forward + backward)", "1M tokens, 128 x H100", "h100-sxm-ib", 128, f"--seq 1048576 {LLAMA}", 32, "a training step's attention"),
    ("Llama 3 8B, training (forward + backward)", "1M tokens, 256 x H100", "h100-sxm-ib", 256, f"--seq 1048576 {LLAMA}", 32, "a training step's attention"),
]

ROW = re.compile(r"^(\S.*?)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+|-)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+)\s*$")


def advise(demo, machine, ranks, shape):
    cmd = [demo, "--advise", "--machine", machine, "--ranks", str(ranks)] + shlex.split(shape)
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{p.stdout}{p.stderr}")
    rows = [m.groups() for m in map(ROW.match, p.stdout.splitlines()) if m]
    return cmd, rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--demo", default="build/tools/seqpar_demo/seqpar_demo")
    ap.add_argument("--out")
    a = ap.parse_args()
    out, section = [], None
    for sec, label, machine, ranks, shape, layers, per in SCENARIOS:
        cmd, rows = advise(a.demo, machine, ranks, shape)
        if sec != section:
            section = sec
            out += ["", f"### {sec}", "",
                    "| world | advisor's choice | ms per layer | fwd / bwd ms | exposed comm ms | bytes per rank | "
                    f"x layers | runner-up | plain ring (zigzag) |",
                    "|---|---|---:|---:|---:|---:|---:|---|---:|"]
        first = rows[0]
        second = rows[1] if len(rows) > 1 else None
        ring = next((r for r in rows if r[0].strip() in ("ring zigzag", "anything ring zigzag")), None)
        out.append(
            f"| {label} | {first[0].strip()} | {float(first[1]):.2f} | {float(first[2]):.2f} / {first[3]} | "
            f"{float(first[4]):.2f} | {int(first[6]) / 2**20:.0f} MiB | {float(first[1]) * layers:.0f} ms ({per}) | "
            f"{second[0].strip() + f' {float(second[1]):.2f}' if second else '-'} | "
            f"{float(ring[1]):.2f} |" if ring else "- |")
        out.append(f"<!-- {' '.join(shlex.quote(c) for c in cmd)} -->")
    text = "\n".join(out).lstrip() + "\n"
    sys.stdout.write(text)
    if a.out:
        pathlib.Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
