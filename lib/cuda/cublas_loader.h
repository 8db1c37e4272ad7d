// cuBLAS and cuBLASLt loaded at run time in the GPU flavor — internal to lib/cuda (the module's public header is
// cuda.h).
//
// Linking them made every megascale process map libcublasLt (540 MB) and apply its relocations, about 0.1 s of CPU
// (26,000 page faults) before main, on CPU-backend jobs too: every rank, every command, most of the test suite. So
// the GPU flavor links neither: cublas_loader.cpp defines each cuBLAS / cuBLASLt function the backend calls, which
// loads the libraries (dlopen) at the first call and forwards to them. megascale then starts and trains on the CPU
// backend on machines without cuBLAS as well. The emulated flavor keeps its own implementations (kernels/sim).
#pragma once

#include "core/core.h"

namespace ms::cuda {

// Loads libcublasLt and libcublas of the toolkit megascale was built against (once per process; later calls return
// the first outcome): Unavailable naming the library, the loader's reason and the fix when one cannot be loaded.
// The CUDA backend calls it before its first cuBLAS call; a forwarding function called without it returns
// CUBLAS_STATUS_NOT_INITIALIZED where the libraries cannot be loaded.
Status LoadCublas();

}  // namespace ms::cuda
