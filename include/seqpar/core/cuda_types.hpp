#pragma once
/// \file
/// Forwarding header, kept so that existing includes compile: the CUDA element types lives in
/// seqpar/cuda/types.hpp (one folder per layer).

#include "seqpar/cuda/types.hpp"
