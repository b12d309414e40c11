"""The peers' sequence-parallel attention on CPU over torch.distributed (gloo), one process
per rank, each on one thread: yunchang's LongContextAttention (Ulysses, Ring, USP) and
diffusers' templated context-parallel attention (Ulysses, Ring, unified, Ulysses Anything).

`PeerPool` starts the ranks once per benchmark row and keeps them waiting on a queue, so the
driver can alternate their timed rounds with seqpar's without paying torch's start-up each
time. What each peer needed to run on CPU is patched in `_yunchang_attention` and
`_diffusers_attention` (and listed in README.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# aten's CPU flash attention: (q, k, v [B, H, S, D], dropout_p, is_causal, *, scale) ->
# (out [B, H, S, D], lse [B, H, S]). The peers' own "flash" ops are CUDA-only.
CPU_FLASH = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


@dataclasses.dataclass(frozen=True)
class Case:
    """One distributed row for one peer. `algo`: ulysses, ring, usp or anything (Ulysses
    Anything); the mesh is ulysses x ring = procs."""

    peer: str  # yunchang | diffusers
    algo: str
    procs: int
    seq: int
    heads: int
    head_dim: int
    causal: bool
    ulysses: int
    ring: int
    batch: int = 1
    dtype: str = "float32"  # or bfloat16: inputs rounded once from the float32 draws, sent as such

    def split(self) -> list[int]:
        """Tokens per rank: the first seq % procs ranks get one more (the peers' and
        seqpar's uneven split)."""
        base, extra = divmod(self.seq, self.procs)
        return [base + (1 if r < extra else 0) for r in range(self.procs)]

    def positions(self, rank: int) -> torch.Tensor:
        """Global positions of the query (and key) rows that `rank` holds."""
        if self.peer == "yunchang" and self.algo == "ring" and self.causal:
            # zigzag: 2P chunks, rank r holds chunks r and 2P-1-r
            c = self.seq // (2 * self.procs)
            a, b = rank, 2 * self.procs - 1 - rank
            return torch.cat([torch.arange(a * c, (a + 1) * c), torch.arange(b * c, (b + 1) * c)])
        lens = self.split()
        start = sum(lens[:rank])
        return torch.arange(start, start + lens[rank])

    def bytes_per_rank(self) -> int:
        """Bytes the busiest rank sends per forward, from the peer's code."""
        s, B, D, H, P = getattr(torch, self.dtype).itemsize, self.batch, self.head_dim, self.heads, self.procs
        U, R = self.ulysses, self.ring
        if self.algo == "anything":
            # diffusers pads the heads to a multiple of P (zeros travel) and sends Q, K, V rows
            # to the P-1 others, then each rank's output rows for the others' tokens back.
            hp = -(-H // P) * P
            return max(s * B * D * (3 * L * (hp // P) * (P - 1) + (self.seq - L) * (hp // P)) for L in self.split())
        L = self.seq // P
        ulysses = s * B * L * D * 4 * H * (U - 1) // U  # Q, K, V out, O back
        ring = 2 * s * B * L * H * D * (R - 1)  # K and V, R-1 steps (diffusers: one all-gather)
        return ulysses + ring


def _init(case: Case, rank: int, port: int) -> None:
    torch.set_num_threads(1)
    backend = "cpu:gloo" if case.peer == "diffusers" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=case.procs)


def _yunchang_attention(case: Case, rank: int):
    import yunchang
    import yunchang.kernels.attention as yk
    from yunchang.kernels import AttnType

    # Its "torch flash" forward calls aten's CUDA flash op; point it at the CPU one (same
    # (out, lse) in its first two results).
    yk._scaled_dot_product_flash_attention = CPU_FLASH
    yunchang.set_seq_parallel_pg(case.ulysses, case.ring, rank, case.procs)
    impl = "zigzag" if case.causal and case.ring > 1 else "basic"
    attn = yunchang.LongContextAttention(ring_impl_type=impl, attn_type=AttnType.TORCH_FLASH)
    scale = case.head_dim**-0.5
    return lambda q, k, v: attn(q, k, v, softmax_scale=scale, causal=case.causal)


def _diffusers_cpu_flash_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                    scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                                    _parallel_config=None):
    """diffusers' `_native_flash_attention_forward_op` with aten's CPU flash op: model layout
    [B, S, H, D] in and out, LSE [B, S, H] (the ring merge needs it)."""
    out, lse = CPU_FLASH(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), dropout_p, is_causal,
                         scale=scale)
    out = out.transpose(1, 2).contiguous()
    lse = lse.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def _diffusers_attention(case: Case, rank: int):
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig
    from diffusers.models.attention_dispatch import _templated_context_parallel_attention
    from torch.distributed.device_mesh import init_device_mesh

    cp = ContextParallelConfig(ring_degree=case.ring, ulysses_degree=case.ulysses,
                               ulysses_anything=case.algo == "anything")
    config = ParallelConfig(context_parallel_config=cp)
    # What ModelMixin.enable_parallelism does, without a model.
    mesh = init_device_mesh("cpu", cp.mesh_shape, mesh_dim_names=cp.mesh_dim_names)
    config.setup(rank, case.procs, torch.device("cpu"), mesh=mesh)
    scale = case.head_dim**-0.5

    def run(q, k, v):
        return _templated_context_parallel_attention(q, k, v, None, 0.0, case.causal, scale, False, False,
                                                     forward_op=_diffusers_cpu_flash_forward_op, backward_op=None,
                                                     _parallel_config=config)

    return run


def global_inputs(case: Case, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Q, K, V [B, S, H, D] in the case's dtype, the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    shape = (case.batch, case.seq, case.heads, case.head_dim)
    dtype = getattr(torch, case.dtype)
    return tuple(torch.randn(shape, generator=g, dtype=torch.float32).to(dtype) for _ in range(3))


def reference_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor, causal: bool,
                   chunk: int = 1024) -> torch.Tensor:
    """Exact attention in float64 for query rows `rows` (global positions) of [B, S, H, D]
    inputs, against every key; [B, len(rows), H, D] float64."""
    qd, kd, vd = (x.double().transpose(1, 2) for x in (q, k, v))  # [B, H, S, D]
    scale = 1.0 / math.sqrt(q.shape[-1])
    keys = torch.arange(k.shape[1])
    out = []
    for i in range(0, len(rows), chunk):
        r = rows[i:i + chunk]
        s = qd[:, :, r] @ kd.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(keys[None, :] > r[:, None], float("-inf"))
        out.append(torch.softmax(s, dim=-1) @ vd)
    return torch.cat(out, dim=2).transpose(1, 2)


def error_sums(out: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """[sum err^2, sum ref^2, max |err|, max |ref|] of one slice (float64)."""
    e = out.double() - ref
    return torch.tensor([e.square().sum(), ref.square().sum(), e.abs().max(), ref.abs().max()], dtype=torch.float64)


def _worker(rank: int, case: Case, port: int, commands, results) -> None:
    try:
        _init(case, rank, port)
        attn = (_yunchang_attention if case.peer == "yunchang" else _diffusers_attention)(case, rank)
        q, k, v = global_inputs(case)
        pos = case.positions(rank)
        lq, lk, lv = (x[:, pos].contiguous() for x in (q, k, v))
        with torch.no_grad():
            attn(lq, lk, lv)  # first call: warm-up, and fails early on a shape it cannot run
            results.put(("ready", rank, None))
            while True:
                cmd, arg = commands.get()
                if cmd == "stop":
                    break
                if cmd == "time":
                    dist.barrier()
                    t0 = time.perf_counter()
                    for _ in range(arg):
                        attn(lq, lk, lv)
                    dist.barrier()  # the slowest rank's time
                    ms = torch.tensor([(time.perf_counter() - t0) * 1e3 / arg], dtype=torch.float64)
                    dist.all_reduce(ms, op=dist.ReduceOp.MAX)
                    results.put(("time", rank, float(ms)))
                elif cmd == "check":
                    sums = error_sums(attn(lq, lk, lv), reference_rows(q, k, v, pos, case.causal))
                    total = sums[:2].clone()
                    peak = sums[2:].clone()
                    dist.all_reduce(total)
                    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
                    results.put(("check", rank, {"norm_rel": math.sqrt(total[0] / total[1]),
                                                 "max_rel": float(peak[0] / peak[1])}))
        dist.destroy_process_group()
    except Exception as e:  # reported to the driver, which writes '-' and the reason
        results.put(("error", rank, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"))
        if os.environ.get("PEERS_DEBUG"):
            traceback.print_exc()


class PeerError(RuntimeError):
    """A peer could not run a case (the message says why)."""


class PeerPool:
    """`case.procs` ranks of one peer, started once, driven round by round."""

    def __init__(self, case: Case, port: int, timeout_s: float = 1800):
        self.case, self.timeout = case, timeout_s
        ctx = mp.get_context("spawn")
        self.results = ctx.Queue()
        self.commands = [ctx.Queue() for _ in range(case.procs)]
        self.procs = [ctx.Process(target=_worker, args=(r, case, port, self.commands[r], self.results), daemon=True)
                      for r in range(case.procs)]
        for p in self.procs:
            p.start()
        self._collect("ready")

    def _collect(self, kind: str) -> list:
        got = []
        while len(got) < self.case.procs:
            what, rank, value = self.results.get(timeout=self.timeout)
            if what == "error":
                self.close(kill=True)
                raise PeerError(value)
            got.append(value)
        return got

    def _send(self, cmd, arg=None):
        for q in self.commands:
            q.put((cmd, arg))

    def time_ms(self, iters: int) -> float:
        """Milliseconds per forward of the slowest rank over `iters` forwards."""
        self._send("time", iters)
        return self._collect("time")[0]

    def check(self) -> dict:
        """Errors of the whole output against the float64 reference (untimed)."""
        self._send("check")
        return self._collect("check")[0]

    def close(self, kill: bool = False) -> None:
        if not kill:
            self._send("stop")
        for p in self.procs:
            p.join(timeout=1 if kill else 60)
            if p.is_alive():
                p.kill()
                p.join()
