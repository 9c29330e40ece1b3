/*
 * The two types nccl.h takes from the CUDA runtime's headers, so that NCCL programs here build
 * with the NCCL wheel's nccl.h and a C compiler, without a CUDA toolkit. They are the runtime's
 * own definitions: a runtime stream or event is the driver's CUstream / CUevent.
 * CUDART_VERSION is left undefined, so nccl.h includes no bf16/fp8 header.
 */
#ifndef GPU_CKPT_CUDART_TYPES_H
#define GPU_CKPT_CUDART_TYPES_H
typedef struct CUstream_st *cudaStream_t;
typedef struct CUevent_st *cudaEvent_t;
#endif
