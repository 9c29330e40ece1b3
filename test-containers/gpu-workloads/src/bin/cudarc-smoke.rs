//! cudarc-smoke: cudarc's safe driver API against whatever `libcuda.so` the loader finds (a real
//! driver, or the simulated one through `LD_LIBRARY_PATH`).
//!
//! On device 0: the context (`CudaContext::new`), the device's name and memory, then on the
//! default stream a copy out and back (`clone_htod`, `clone_dtoh`), `alloc_zeros`,
//! `memcpy_htod` into part of a buffer, `memcpy_dtod`, `memset_zeros`, and a synchronize. Every
//! result is checked. Prints a few facts and then `cudarc ok`; a failure prints
//! `cudarc-smoke: <what>: <error>` and exits 1. cudarc panics when libcuda lacks a function it
//! calls ("Missing symbol ..."); that panic names the function and exits 101.

use std::process::ExitCode;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaStream, DriverError};

/// Elements per buffer: 4 MiB of u32.
const N: usize = 1 << 20;

fn main() -> ExitCode {
    // SAFETY: only tries to dlopen the library by its usual names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!("cudarc-smoke: no libcuda.so found by the dynamic loader");
        return ExitCode::FAILURE;
    }
    match run() {
        Ok(()) => {
            println!("cudarc ok");
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("cudarc-smoke: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A driver error with the step that hit it.
fn at(step: &'static str) -> impl FnOnce(DriverError) -> String {
    move |e| format!("{step}: {e:?}")
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), String> {
    if ok {
        Ok(())
    } else {
        Err(what())
    }
}

/// The word at index `i` of the test pattern.
fn word(i: usize) -> u32 {
    (i as u32).wrapping_mul(0x9e37_79b1) ^ 0x5a5a_0f0f
}

fn run() -> Result<(), String> {
    let count = CudaContext::device_count().map_err(at("device count"))?;
    check(count >= 1, || format!("device count is {count}"))?;
    let ctx = CudaContext::new(0).map_err(at("CudaContext::new(0)"))?;
    let name = ctx.name().map_err(at("device name"))?;
    check(!name.is_empty(), || "empty device name".into())?;
    let total = ctx.total_mem().map_err(at("total memory"))?;
    check(total >= 4 * N * 4, || format!("total memory {total} bytes"))?;
    let (cc_major, cc_minor) = ctx.compute_capability().map_err(at("compute capability"))?;
    println!("devices {count}");
    println!("device 0 {name} sm_{cc_major}{cc_minor} {total} bytes");

    let stream = ctx.default_stream();
    copies(&stream)?;
    stream.synchronize().map_err(at("stream synchronize"))?;

    let (free, total2) = ctx.mem_get_info().map_err(at("memory info"))?;
    check(total2 == total && free <= total, || {
        format!("memory info: free {free}, total {total2} (device total {total})")
    })?;
    Ok(())
}

fn copies(stream: &Arc<CudaStream>) -> Result<(), String> {
    let pattern: Vec<u32> = (0..N).map(word).collect();

    // Host → device → host.
    let mut a = stream.clone_htod(&pattern).map_err(at("clone_htod"))?;
    let back = stream.clone_dtoh(&a).map_err(at("clone_dtoh"))?;
    check(back == pattern, || mismatch("htod/dtoh", &back, &pattern))?;

    // Zeroed allocation.
    let mut b = stream.alloc_zeros::<u32>(N).map_err(at("alloc_zeros"))?;
    let zeros = stream.clone_dtoh(&b).map_err(at("clone_dtoh of zeros"))?;
    check(zeros.iter().all(|&w| w == 0), || {
        mismatch("alloc_zeros", &zeros, &vec![0; N])
    })?;

    // Into the second half of `b`, then all of `b` onto `a`.
    let half = N / 2;
    let mut upper = b.slice_mut(half..);
    stream
        .memcpy_htod(&pattern[..N - half], &mut upper)
        .map_err(at("memcpy_htod into a view"))?;
    stream.memcpy_dtod(&b, &mut a).map_err(at("memcpy_dtod"))?;
    let got = stream.clone_dtoh(&a).map_err(at("clone_dtoh after dtod"))?;
    let want: Vec<u32> = (0..N)
        .map(|i| if i < half { 0 } else { word(i - half) })
        .collect();
    check(got == want, || mismatch("dtod", &got, &want))?;

    // Zero it again.
    stream.memset_zeros(&mut a).map_err(at("memset_zeros"))?;
    let got = stream
        .clone_dtoh(&a)
        .map_err(at("clone_dtoh after memset"))?;
    check(got.iter().all(|&w| w == 0), || {
        mismatch("memset_zeros", &got, &vec![0; N])
    })?;
    Ok(())
}

fn mismatch(what: &str, got: &[u32], want: &[u32]) -> String {
    match got.iter().zip(want).position(|(g, w)| g != w) {
        Some(i) => format!(
            "{what}: MISMATCH at word {i}: got {:#010x}, want {:#010x}",
            got[i], want[i]
        ),
        None => format!("{what}: {} words back, {} expected", got.len(), want.len()),
    }
}
