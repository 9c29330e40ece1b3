//! Version numbers of the CUDA driver, as the driver API reports them; shared by the driver
//! binding (module `cuda`) and the errors that name a version (module `error`).

use std::fmt;

/// A `cuDriverGetVersion` number shown as `major.minor` (12080 → "12.8").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CudaVersion(pub i32);

impl fmt::Display for CudaVersion {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{}", self.0 / 1000, (self.0 % 1000) / 10)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shown_as_major_minor() {
        assert_eq!(CudaVersion(12080).to_string(), "12.8");
        assert_eq!(CudaVersion(13000).to_string(), "13.0");
        assert_eq!(CudaVersion(12040).to_string(), "12.4");
    }
}
