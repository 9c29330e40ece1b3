//! CUDA driver-API test workloads that run unchanged on a real GPU and on the simulated driver.
//!
//! - [`driver`]: minimal bindings to `libcuda.so.1`, loaded at run time.
//! - [`train`]: the state rule of `gpu-train` and its closed form.
//! - [`collective`]: the numbers of the NCCL workloads (`nccl-train`, `c/nccl_allreduce.c`).
//! - [`fill`]: the memory pattern of `gpu-fill`.
//! - [`cli`]: flag parsing shared by the binaries.
//! - [`signals`]: signal flags polled by the main loops.

pub mod cli;
pub mod collective;
pub mod driver;
pub mod fill;
pub mod signals;
pub mod train;

use std::io::Write;

/// Prints one line to stdout and flushes it (output goes to files and pipes).
pub fn emit(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Why a workload binary stops before its work is done.
pub enum Fail {
    /// A driver call failed: `<binary>: <error>` on stdout, exit status 1.
    Cuda(driver::CudaError),
    /// Bad flags: `<binary>: <message>` and the usage on stderr, exit status 2.
    Usage(String),
    /// Any other failure: `<binary>: <message>` on stdout, exit status 1.
    Other(String),
    /// A report line printed as it is (a `MISMATCH …`), exit status 1.
    Mismatch(String),
}

impl From<driver::CudaError> for Fail {
    fn from(e: driver::CudaError) -> Fail {
        Fail::Cuda(e)
    }
}

/// The program's arguments, or `None` when one of them is `--help` or `-h` (then `usage` is
/// printed).
pub fn args_or_help(usage: &str) -> Option<Vec<String>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.iter().any(|a| a == "--help" || a == "-h") {
        emit(usage);
        return None;
    }
    Some(args)
}

/// The `main` of the workload binary `name`: with `--help` or `-h` prints `usage` and exits 0;
/// otherwise exits with the status `run` returns for the arguments, or its [`Fail`]'s.
pub fn main(name: &str, usage: &str, run: impl FnOnce(&[String]) -> Result<i32, Fail>) {
    let Some(args) = args_or_help(usage) else {
        return;
    };
    let code = match run(&args) {
        Ok(code) => code,
        Err(Fail::Usage(m)) => {
            eprintln!("{name}: {m}\n{usage}");
            2
        }
        Err(Fail::Cuda(e)) => {
            emit(&format!("{name}: {e}"));
            1
        }
        Err(Fail::Other(m)) => {
            emit(&format!("{name}: {m}"));
            1
        }
        Err(Fail::Mismatch(line)) => {
            emit(&line);
            1
        }
    };
    std::process::exit(code);
}

/// Loads and initialises the driver, and resolves `devices` against its GPUs (a device it does
/// not have is a usage error): the driver and the ordinals to use.
pub fn open_devices(devices: &cli::Devices) -> Result<(driver::Driver, Vec<i32>), Fail> {
    let driver = driver::Driver::load()?;
    driver.init()?;
    let ordinals = devices
        .resolve(driver.device_count()?)
        .map_err(Fail::Usage)?;
    Ok((driver, ordinals))
}

/// SplitMix64: the hash behind every pattern here.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// A 32-bit hash of (seed, device, tag, index).
pub fn hash32(seed: u64, device: u32, tag: u32, index: u64) -> u32 {
    let h = mix64(seed ^ mix64(((device as u64) << 32) | tag as u64) ^ mix64(index ^ 0x5851_f42d));
    (h >> 16) as u32
}
