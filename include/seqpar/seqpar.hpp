#pragma once
/// \file
/// Umbrella header: everything that needs only a host compiler. MpiCommunicator
/// (seqpar/comm/mpi_communicator.hpp) and the CUDA headers are included separately.

#include "seqpar/attention.hpp"
#include "seqpar/comm/communicator.hpp"
#include "seqpar/comm/thread_communicator.hpp"
#include "seqpar/core/bfloat16.hpp"
#include "seqpar/core/error.hpp"
#include "seqpar/core/layout_helpers.hpp"
#include "seqpar/core/mask.hpp"
#include "seqpar/core/mesh.hpp"
#include "seqpar/core/plan.hpp"
#include "seqpar/core/problem.hpp"
#include "seqpar/core/sequence_layout.hpp"
#include "seqpar/core/tensor_view.hpp"
#include "seqpar/core/types.hpp"
#include "seqpar/core/workspace.hpp"
#include "seqpar/decode/decode_plan.hpp"
#include "seqpar/decode/paged_decode.hpp"
#include "seqpar/decode/sequence_parallel_decode.hpp"
#include "seqpar/kernel/cpu/flash_kernel.hpp"
#include "seqpar/ops/host_ops.hpp"
#include "seqpar/kernel/local_attention_kernel.hpp"
#include "seqpar/kernel/merge_state.hpp"
#include "seqpar/kernel/reference_kernel.hpp"
#include "seqpar/policy/plan_builder.hpp"
#include "seqpar/policy/policies.hpp"
