/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU.
 *
 * Mosaic GPU compiles a kernel inside the CUDA plugin's MosaicGpuCompile:
 * MLIR -> LLVM -> PTX -> ptxas -> cubin, then loads the cubin onto the current
 * device. Only two driver calls come before ptxas has run: the current
 * context's device and its compute capability (which picks sm_90a). This
 * library answers them for an H100/H200 and refuses the load, so the compile
 * runs to its end on the CPU, ptxas's report and the PTX land in
 * MOSAIC_GPU_DUMP_TO, and nothing is ever launched. scripts/ptxas/env.sh
 * builds it; scripts/compile_report.py --offline uses it.
 */
typedef int CUresult;
typedef int CUdevice;
enum { CUDA_SUCCESS = 0, CUDA_ERROR_NOT_SUPPORTED = 801 };
enum { CC_MAJOR = 75, CC_MINOR = 76, MULTIPROCESSORS = 16,
       SMEM_PER_BLOCK_OPTIN = 97 };

CUresult cuInit(unsigned flags) { (void)flags; return CUDA_SUCCESS; }

CUresult cuDriverGetVersion(int *version) {
  *version = 13000;
  return CUDA_SUCCESS;
}

CUresult cuCtxGetDevice(CUdevice *device) {
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  (void)ordinal;
  *device = 0;
  return CUDA_SUCCESS;
}

CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) {
  (void)device;
  switch (attribute) {
    case CC_MAJOR: *value = 9; return CUDA_SUCCESS;
    case CC_MINOR: *value = 0; return CUDA_SUCCESS;
    case MULTIPROCESSORS: *value = 132; return CUDA_SUCCESS;
    case SMEM_PER_BLOCK_OPTIN: *value = 232448; return CUDA_SUCCESS;
    default: *value = 0; return CUDA_ERROR_NOT_SUPPORTED;
  }
}

CUresult cuGetErrorString(CUresult error, const char **text) {
  (void)error;
  *text = "no GPU: scripts/ptxas/fake_libcuda.c compiles, it never loads";
  return CUDA_SUCCESS;
}

CUresult cuGetErrorName(CUresult error, const char **text) {
  (void)error;
  *text = "CUDA_ERROR_NOT_SUPPORTED";
  return CUDA_SUCCESS;
}

/* The compiled cubin has nowhere to go. */
CUresult cuModuleLoadData(void **module, const void *image) {
  (void)module; (void)image;
  return CUDA_ERROR_NOT_SUPPORTED;
}
