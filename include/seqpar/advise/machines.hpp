#pragma once
/// \file
/// Machine presets for the cost model, from published figures (each says which), for
/// projections on paper. A preset is a starting point: `Machine` is plain numbers, and a
/// measured machine (seqpar::calibrate; seqpar_demo --policy auto or --estimate) beats any preset.

#include <string>
#include <string_view>
#include <vector>

#include "seqpar/advise/cost_model.hpp"

namespace seqpar::machines {

/// 8 x H100 SXM per node, NVLink 4 inside, 400 Gb/s InfiniBand NDR per GPU between nodes, bf16.
inline Machine h100_sxm_nvlink_ib() {
  Machine m;
  m.name = "h100-sxm-ib";
  m.ranks_per_node = 8;
  m.intra = {370, 10};  // NCCL all-to-all bus bandwidth inside one 8-GPU node (~370 GB/s)
  m.inter = {50, 10};   // NDR 400 Gb/s per GPU = 50 GB/s each way
  m.forward_gflops = 650e3;   // FlashAttention-3 bf16 forward at D 128 (~650 TFLOP/s)
  m.backward_gflops = 335e3;  // FlashAttention-2's forward+backward rate on H100 (~335 TFLOP/s), as the backward's
  m.copy_gbytes_per_s = 1500;  // HBM3 3.35 TB/s read + write: about half of it copies
  m.source =
      "NVIDIA H100 SXM datasheet (NVLink 4: 900 GB/s per GPU in total, HBM3 3.35 TB/s); NCCL all-to-all "
      "~370 GB/s bus bandwidth in an 8-GPU node; ConnectX-7 NDR 400 Gb/s per GPU; FlashAttention-3 paper (bf16 "
      "forward ~650 TFLOP/s at D 128); FlashAttention-2 (~335 TFLOP/s forward+backward on H100)";
  return m;
}

/// 4 x L20 in one PCIe host (diffusers' published FLUX.1-dev runs), bf16.
inline Machine l20_pcie() {
  Machine m;
  m.name = "l20-pcie";
  m.ranks_per_node = 4;
  m.intra = {25, 15};  // PCIe 4.0 x16: 32 GB/s each way, ~25 sustained through the host
  m.inter = {12.5, 15};  // 100 Gb/s Ethernet, should a second host be added
  m.forward_gflops = 70e3;   // assumed: 60% of the L20's 119.5 TFLOP/s dense fp16/bf16 tensor rate
  m.backward_gflops = 50e3;  // assumed: 0.7 x the forward, as FlashAttention-2's backward runs
  m.copy_gbytes_per_s = 400;  // GDDR6 864 GB/s read + write
  m.source =
      "NVIDIA L20 datasheet (119.5 TFLOP/s dense fp16 tensor, 864 GB/s GDDR6, PCIe 4.0 x16); kernel "
      "efficiency assumed (60% forward), not measured";
  return m;
}

/// This repository's CI machine: one 2-vCPU Intel Xeon with AVX-512 and AMX, ranks as MPI
/// processes or threads sharing its cores, float32. Measured figures, rounded (docs/perf).
inline Machine this_ci_cpu() {
  Machine m;
  m.name = "ci-xeon-2core";
  m.ranks_per_node = 1 << 20;  // one host
  m.cores_per_node = 2;
  m.intra = {4, 20};  // Open MPI shared memory between two processes, one message of MBs
  m.inter = m.intra;
  m.forward_gflops = 125;   // CpuFlashKernel float32, one thread, D 64 (RESULTS.md: 126-140 at S 4096)
  m.backward_gflops = 55;   // the backward at 2.4-2.5x the forward's time for 2.5x its FLOPs
  m.copy_gbytes_per_s = 10;  // one thread's copy (RESULTS.md: ~22 GB/s read + write)
  m.source = "measured on the CI machine (docs/perf/RESULTS.md); recalibrate on any other";
  return m;
}

/// Every preset, for tools that take a name.
inline std::vector<Machine> all() { return {h100_sxm_nvlink_ib(), l20_pcie(), this_ci_cpu()}; }

/// The preset called `name`; throws ConfigError naming the presets when there is none.
inline Machine by_name(std::string_view name) {
  std::string names;
  for (const Machine& m : all()) {
    if (m.name == name) return m;
    names += (names.empty() ? "" : ", ") + m.name;
  }
  SEQPAR_THROW(ConfigError, "machine preset '" + std::string(name) + "': not known (presets: " + names + ")");
}

}  // namespace seqpar::machines
