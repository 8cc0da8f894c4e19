/* MKL picks its kernels by CPU vendor: on an Intel CPU with AVX-512 it runs its
 * AVX-512 code, on any other vendor's CPU its generic ("COMPATIBLE") code, whatever
 * the CPU's instruction set. That choice is where AMD and Intel machines' fp32
 * matmuls sum in different orders (docs/RELIABILITY.md, "Tolerances"). Preloaded
 * (LD_PRELOAD), these two definitions answer MKL's vendor check with "Intel", so a
 * non-Intel CPU with AVX-512 runs the kernels an Intel Xeon would. On an Intel CPU
 * they change nothing. Built and used by `make test-intel-mkl`. */
int mkl_serv_intel_cpu_true(void) { return 1; }
int mkl_serv_intel_cpu(void) { return 1; }
