// The GPU flavor's cuBLAS loader (lib/cuda/cublas_loader.h): cuBLAS is not in the process until the first use, then
// the forwarding functions reach the real library. Runs without a GPU: descriptors and status strings are host-only.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <dlfcn.h>
#include <doctest/doctest.h>

#include <cstdint>
#include <string>

#include "cuda/cublas_loader.h"

namespace {

bool Loaded(const std::string& soname) {
  void* h = dlopen(soname.c_str(), RTLD_NOW | RTLD_NOLOAD);
  if (h != nullptr) dlclose(h);
  return h != nullptr;
}

}  // namespace

TEST_CASE("cuBLAS is loaded at the first use, and calls reach it") {
  const std::string major = std::to_string(CUBLAS_VER_MAJOR);
  const std::string lt = "libcublasLt.so." + major, blas = "libcublas.so." + major;
  // Linked, the libraries would be here before main.
  CHECK_FALSE(Loaded(lt));
  CHECK_FALSE(Loaded(blas));

  ms::Status st = ms::cuda::LoadCublas();
  REQUIRE_MESSAGE(st.ok(), st.message());
  CHECK(Loaded(lt));
  CHECK(Loaded(blas));
  CHECK(ms::cuda::LoadCublas().ok());  // once; later calls give the same outcome

  // The forwarded calls reach the library: its own status string (not the loader's), and a layout whose attributes,
  // read back through the library directly, are the arguments in their order.
  void* lib_lt = dlopen(lt.c_str(), RTLD_NOW | RTLD_NOLOAD);
  void* lib_blas = dlopen(blas.c_str(), RTLD_NOW | RTLD_NOLOAD);
  REQUIRE(lib_lt != nullptr);
  REQUIRE(lib_blas != nullptr);
  auto status_string = reinterpret_cast<const char* (*)(cublasStatus_t)>(dlsym(lib_blas, "cublasGetStatusString"));
  auto get_attribute =
      reinterpret_cast<cublasStatus_t (*)(cublasLtMatrixLayout_t, cublasLtMatrixLayoutAttribute_t, void*, size_t,
                                          size_t*)>(dlsym(lib_lt, "cublasLtMatrixLayoutGetAttribute"));
  REQUIRE((status_string != nullptr));
  REQUIRE((get_attribute != nullptr));
  CHECK(std::string(cublasGetStatusString(CUBLAS_STATUS_INVALID_VALUE)) == status_string(CUBLAS_STATUS_INVALID_VALUE));

  cublasLtMatrixLayout_t layout = nullptr;
  REQUIRE(cublasLtMatrixLayoutCreate(&layout, CUDA_R_16BF, 37, 11, 40) == CUBLAS_STATUS_SUCCESS);
  REQUIRE(layout != nullptr);
  uint64_t rows = 0, cols = 0;
  int64_t ld = 0;
  int32_t type = -1;
  size_t written = 0;
  CHECK(get_attribute(layout, CUBLASLT_MATRIX_LAYOUT_TYPE, &type, sizeof type, &written) == CUBLAS_STATUS_SUCCESS);
  CHECK(get_attribute(layout, CUBLASLT_MATRIX_LAYOUT_ROWS, &rows, sizeof rows, &written) == CUBLAS_STATUS_SUCCESS);
  CHECK(get_attribute(layout, CUBLASLT_MATRIX_LAYOUT_COLS, &cols, sizeof cols, &written) == CUBLAS_STATUS_SUCCESS);
  CHECK(get_attribute(layout, CUBLASLT_MATRIX_LAYOUT_LD, &ld, sizeof ld, &written) == CUBLAS_STATUS_SUCCESS);
  CHECK(type == CUDA_R_16BF);
  CHECK(rows == 37);
  CHECK(cols == 11);
  CHECK(ld == 40);
  CHECK(cublasLtMatrixLayoutDestroy(layout) == CUBLAS_STATUS_SUCCESS);
  dlclose(lib_lt);
  dlclose(lib_blas);
}
