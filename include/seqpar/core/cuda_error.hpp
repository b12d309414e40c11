#pragma once
/// \file
/// Forwarding header, kept so that existing includes compile: the CUDA error check lives in
/// seqpar/cuda/error.hpp (one folder per layer).

#include "seqpar/cuda/error.hpp"
