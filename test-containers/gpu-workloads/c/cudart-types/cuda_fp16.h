/* nccl.h includes cuda_fp16.h but declares nothing with its types in C: empty here. */
