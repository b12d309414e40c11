// Main of the GPU tests: runs doctest when a CUDA device is present; otherwise prints why the
// tests are skipped and exits with 77, which ctest reports as "Skipped" (SKIP_RETURN_CODE).

#define DOCTEST_CONFIG_IMPLEMENT
#include <doctest/doctest.h>

#include <cstdio>

#include "seqpar/cuda/error.hpp"

int main(int argc, char** argv) {
  int count = 0;
  const cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc != cudaSuccess || count == 0) {
    std::printf("SKIPPED: no CUDA device (%s); the GPU tests need one (run tests/gpu/run.sh on a GPU machine)\n",
                rc != cudaSuccess ? cudaGetErrorString(rc) : "cudaGetDeviceCount returned 0");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("GPU tests on %s (sm_%d%d), %d device(s)\n", prop.name, prop.major, prop.minor, count);
  doctest::Context context(argc, argv);
  return context.run();
}
