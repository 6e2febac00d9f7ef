//! The names and descriptions of `CUresult` codes, for `cuGetErrorName` / `cuGetErrorString`
//! and trace output. The codes themselves are `cuda.h`'s, from [`cuda_abi`].

use std::ffi::CStr;

use cuda_abi::CUresult;

/// Name and description of every `CUresult` the fake knows (a subset of `cuda.h`, including
/// every code the fake returns).
const ERRORS: &[(CUresult, &CStr, &CStr)] = &[
    (0, c"CUDA_SUCCESS", c"no error"),
    (1, c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
    (2, c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
    (3, c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
    (4, c"CUDA_ERROR_DEINITIALIZED", c"driver shutting down"),
    (100, c"CUDA_ERROR_NO_DEVICE", c"no CUDA-capable device is detected"),
    (101, c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
    (200, c"CUDA_ERROR_INVALID_IMAGE", c"device kernel image is invalid"),
    (201, c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
    (304, c"CUDA_ERROR_OPERATING_SYSTEM", c"OS call failed or operation not supported on this OS"),
    (400, c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
    (401, c"CUDA_ERROR_ILLEGAL_STATE", c"the operation cannot be performed in the present state"),
    (500, c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
    (600, c"CUDA_ERROR_NOT_READY", c"device not ready"),
    (708, c"CUDA_ERROR_PRIMARY_CONTEXT_ACTIVE", c"primary context active"),
    (709, c"CUDA_ERROR_CONTEXT_IS_DESTROYED", c"context is destroyed"),
    (800, c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
    (801, c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
    (900, c"CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED", c"operation not permitted when stream is capturing"),
    (901, c"CUDA_ERROR_STREAM_CAPTURE_INVALIDATED", c"operation failed due to a previous error during capture"),
    (999, c"CUDA_ERROR_UNKNOWN", c"unknown error"),
];

/// `(name, description)` of a result code, if the fake knows it.
pub fn error_strings(code: CUresult) -> Option<(&'static CStr, &'static CStr)> {
    ERRORS
        .iter()
        .find(|(c, _, _)| *c == code)
        .map(|(_, name, text)| (*name, *text))
}

/// Name of a result code as a Rust string, for trace output.
pub fn error_name(code: CUresult) -> &'static str {
    error_strings(code)
        .and_then(|(name, _)| name.to_str().ok())
        .unwrap_or("CUDA_ERROR_?")
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuda_abi::*;

    #[test]
    fn every_returned_code_has_its_cuda_h_name() {
        let codes = [
            (CUDA_SUCCESS, "CUDA_SUCCESS"),
            (CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE"),
            (CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY"),
            (CUDA_ERROR_NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED"),
            (CUDA_ERROR_NO_DEVICE, "CUDA_ERROR_NO_DEVICE"),
            (CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE"),
            (CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT"),
            (CUDA_ERROR_OPERATING_SYSTEM, "CUDA_ERROR_OPERATING_SYSTEM"),
            (CUDA_ERROR_INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE"),
            (CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND"),
            (CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED"),
        ];
        for (code, name) in codes {
            assert_eq!(error_name(code), name);
        }
        assert_eq!(error_name(12345), "CUDA_ERROR_?");
    }
}
