"""The CUDA backend: cuda.core device runtime, NVRTC-compiled kernels (metrale/cuda_kernels/) and cuBLASLt.
The only package that imports cuda.*."""
