//! The CUresult and nvmlReturn_t codes the simulated driver returns, with their names and strings
//! as the real libraries give them.

/// `CUresult` values (cuda.h).
pub mod cu {
    pub const SUCCESS: u32 = 0;
    pub const INVALID_VALUE: u32 = 1;
    pub const OUT_OF_MEMORY: u32 = 2;
    pub const NOT_INITIALIZED: u32 = 3;
    pub const DEINITIALIZED: u32 = 4;
    pub const NO_DEVICE: u32 = 100;
    pub const INVALID_DEVICE: u32 = 101;
    pub const INVALID_IMAGE: u32 = 200;
    pub const INVALID_CONTEXT: u32 = 201;
    pub const INVALID_HANDLE: u32 = 400;
    pub const ILLEGAL_STATE: u32 = 401;
    pub const NOT_FOUND: u32 = 500;
    pub const NOT_READY: u32 = 600;
    pub const ILLEGAL_ADDRESS: u32 = 700;
    pub const OPERATING_SYSTEM: u32 = 304;
    pub const NOT_PERMITTED: u32 = 800;
    pub const NOT_SUPPORTED: u32 = 801;
    pub const TIMEOUT: u32 = 909;
    pub const UNKNOWN: u32 = 999;
}

/// (code, name, description) for every code above.
const CU_TABLE: &[(u32, &str, &str)] = &[
    (cu::SUCCESS, "CUDA_SUCCESS", "no error"),
    (
        cu::INVALID_VALUE,
        "CUDA_ERROR_INVALID_VALUE",
        "invalid argument",
    ),
    (
        cu::OUT_OF_MEMORY,
        "CUDA_ERROR_OUT_OF_MEMORY",
        "out of memory",
    ),
    (
        cu::NOT_INITIALIZED,
        "CUDA_ERROR_NOT_INITIALIZED",
        "initialization error",
    ),
    (
        cu::DEINITIALIZED,
        "CUDA_ERROR_DEINITIALIZED",
        "driver shutting down",
    ),
    (
        cu::NO_DEVICE,
        "CUDA_ERROR_NO_DEVICE",
        "no CUDA-capable device is detected",
    ),
    (
        cu::INVALID_DEVICE,
        "CUDA_ERROR_INVALID_DEVICE",
        "invalid device ordinal",
    ),
    (
        cu::INVALID_IMAGE,
        "CUDA_ERROR_INVALID_IMAGE",
        "device kernel image is invalid",
    ),
    (
        cu::INVALID_CONTEXT,
        "CUDA_ERROR_INVALID_CONTEXT",
        "invalid device context",
    ),
    (
        cu::OPERATING_SYSTEM,
        "CUDA_ERROR_OPERATING_SYSTEM",
        "OS call failed or operation not supported on this OS",
    ),
    (
        cu::INVALID_HANDLE,
        "CUDA_ERROR_INVALID_HANDLE",
        "invalid resource handle",
    ),
    (
        cu::ILLEGAL_STATE,
        "CUDA_ERROR_ILLEGAL_STATE",
        "the operation cannot be performed in the present state",
    ),
    (
        cu::NOT_FOUND,
        "CUDA_ERROR_NOT_FOUND",
        "named symbol not found",
    ),
    (cu::NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"),
    (
        cu::ILLEGAL_ADDRESS,
        "CUDA_ERROR_ILLEGAL_ADDRESS",
        "an illegal memory access was encountered",
    ),
    (
        cu::NOT_PERMITTED,
        "CUDA_ERROR_NOT_PERMITTED",
        "operation not permitted",
    ),
    (
        cu::NOT_SUPPORTED,
        "CUDA_ERROR_NOT_SUPPORTED",
        "operation not supported",
    ),
    (
        cu::TIMEOUT,
        "CUDA_ERROR_TIMEOUT",
        "wait operation timed out",
    ),
    (cu::UNKNOWN, "CUDA_ERROR_UNKNOWN", "unknown error"),
];

/// The NUL-terminated name of a CUresult (`cuGetErrorName`), or None for a code the simulator
/// does not know (the real call then fails with CUDA_ERROR_INVALID_VALUE).
pub fn cu_name(code: u32) -> Option<&'static str> {
    CU_TABLE.iter().find(|e| e.0 == code).map(|e| e.1)
}

/// The description of a CUresult (`cuGetErrorString`).
pub fn cu_string(code: u32) -> Option<&'static str> {
    CU_TABLE.iter().find(|e| e.0 == code).map(|e| e.2)
}

/// `nvmlReturn_t` values (nvml.h).
pub mod nvml {
    pub const SUCCESS: u32 = 0;
    pub const ERROR_UNINITIALIZED: u32 = 1;
    pub const ERROR_INVALID_ARGUMENT: u32 = 2;
    pub const ERROR_NOT_SUPPORTED: u32 = 3;
    pub const ERROR_NO_PERMISSION: u32 = 4;
    pub const ERROR_NOT_FOUND: u32 = 6;
    pub const ERROR_INSUFFICIENT_SIZE: u32 = 7;
    pub const ERROR_DRIVER_NOT_LOADED: u32 = 9;
    pub const ERROR_FUNCTION_NOT_FOUND: u32 = 13;
    pub const ERROR_UNKNOWN: u32 = 999;
}

/// `nvmlErrorString`.
pub fn nvml_string(code: u32) -> &'static str {
    match code {
        nvml::SUCCESS => "Success",
        nvml::ERROR_UNINITIALIZED => "Uninitialized",
        nvml::ERROR_INVALID_ARGUMENT => "Invalid Argument",
        nvml::ERROR_NOT_SUPPORTED => "Not Supported",
        nvml::ERROR_NO_PERMISSION => "Insufficient Permissions",
        nvml::ERROR_NOT_FOUND => "Not Found",
        nvml::ERROR_INSUFFICIENT_SIZE => "Insufficient Size",
        nvml::ERROR_DRIVER_NOT_LOADED => "Driver Not Loaded",
        nvml::ERROR_FUNCTION_NOT_FOUND => "Function Not Found",
        _ => "Unknown Error",
    }
}
