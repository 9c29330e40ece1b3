//! `dlopen` and `dlsym` for programs that load NCCL themselves.
//!
//! A program that links `libnccl.so.2` finds the layer's definitions first in the global scope
//! (the layer is preloaded). A program that opens NCCL with `dlopen` and looks its functions up
//! on that handle (cudarc's dynamic loading, Python's `ctypes.CDLL`, vLLM's `pynccl`) would
//! bypass the layer: `dlsym(handle, ...)` searches only the opened library and its
//! dependencies. So the layer exports `dlopen` and `dlsym`:
//!
//! - `dlopen` of a file whose name (the part after the last `/`) starts with `libnccl.so` opens
//!   it for real (the next `dlopen`, with the caller's mode). That handle is where
//!   [`crate::next`](mod@crate::next) finds the real functions from then on (kept open for good: a `dlclose` by
//!   the application never unloads the NCCL the layer calls). The caller gets a handle on the
//!   layer itself (marked `RTLD_NODELETE`, so its `dlclose` unloads nothing), on which
//!   `dlsym(handle, "ncclAllReduce")` finds the layer's wrapper.
//! - `dlsym` on that handle of a name the layer does not define (an NCCL function it does not
//!   wrap, `ncclMemAlloc`, a function of a newer NCCL) looks the name up on the real NCCL's
//!   handle instead. Every other `dlsym` goes on unchanged.
//!
//! Why `dlsym` and not forwarders: exported forwarders would need the full list of NCCL's
//! functions, which grows with every release (window registration, the device API, shrink and
//! grow), and a name missing from the list would make a program fail to load a function NCCL
//! has. Falling through to the real handle covers every name, present and future, with nothing
//! to keep in step.
//!
//! Both are entered through a few instructions that call a routing function and then *jump*
//! (not call) to where it says, with the caller's return address still in place: glibc's
//! `dlopen` and `dlsym` look at their return address to know who calls (`RTLD_NEXT`, the
//! caller's `RPATH`/`RUNPATH` and namespace), and a wrapper that called them would make every
//! lookup in the process look as if it came from the layer. Only the `libnccl.so*` opens are
//! made by the layer itself: their name is searched as the layer's would be (`LD_LIBRARY_PATH`,
//! the executable's `RPATH`, the loader's cache and default directories), not with the calling
//! library's own `RUNPATH`.
//!
//! `dlmopen` is not interposed: a library opened into another link-map namespace does not see
//! the preloaded layer at all (preloads live in the base namespace), so there is nothing to
//! route there; NCCL is not loaded that way in practice. `dlvsym` is not interposed either
//! (NCCL's symbols carry no versions). On targets other than x86_64 and aarch64 the layer does
//! not export `dlopen` and `dlsym`: there only programs that link NCCL are covered.
//!
//! The layer's own lookups go to the real functions directly ([`real_dlsym`], [`real_dlopen`]),
//! so that nothing the layer does comes back into itself.

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `dlopen`'s signature.
pub type OpenFn = unsafe extern "C" fn(*const c_char, c_int) -> *mut c_void;
/// `dlsym`'s signature.
pub type SymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;

/// Where a stub goes on: the function it jumps to, and the first argument it passes (for
/// `dlsym`: the handle to search).
#[repr(C)]
pub struct Route {
    target: usize,
    arg: usize,
}

static REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
static REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);
/// The first real NCCL opened for the application (or by the layer's fallback): one
/// reference held for good.
static NCCL: AtomicUsize = AtomicUsize::new(0);
/// The layer's own handle, opened once with `RTLD_NODELETE` and never closed.
static SELF_HANDLE: AtomicUsize = AtomicUsize::new(0);
static SELF_BASE: AtomicUsize = AtomicUsize::new(0);

/// The versions glibc's `dlsym` is defined with (2.34 moved it into libc.so.6).
#[cfg(target_arch = "aarch64")]
const DLSYM_VERSIONS: [&CStr; 2] = [c"GLIBC_2.34", c"GLIBC_2.17"];
#[cfg(not(target_arch = "aarch64"))]
const DLSYM_VERSIONS: [&CStr; 2] = [c"GLIBC_2.34", c"GLIBC_2.2.5"];

/// glibc's `dlsym` (the next definition after the layer, found with `dlvsym`, which the layer
/// does not define).
pub fn real_dlsym() -> Option<SymFn> {
    let mut p = REAL_DLSYM.load(Ordering::Acquire);
    if p == 0 {
        for v in DLSYM_VERSIONS {
            // SAFETY: dlvsym with valid C strings; RTLD_NEXT searches after the layer.
            p = unsafe { libc::dlvsym(libc::RTLD_NEXT, c"dlsym".as_ptr(), v.as_ptr()) } as usize;
            if p != 0 {
                break;
            }
        }
        if p == 0 {
            return None;
        }
        REAL_DLSYM.store(p, Ordering::Release);
    }
    // SAFETY: glibc's dlsym, with its signature.
    Some(unsafe { std::mem::transmute::<usize, SymFn>(p) })
}

/// glibc's `dlopen`: `dlsym(RTLD_NEXT, "dlopen")` from the layer.
pub fn real_dlopen() -> Option<OpenFn> {
    let mut p = REAL_DLOPEN.load(Ordering::Acquire);
    if p == 0 {
        let sym = real_dlsym()?;
        // SAFETY: the real dlsym, called from the layer: RTLD_NEXT is the next after it.
        p = unsafe { sym(libc::RTLD_NEXT, c"dlopen".as_ptr()) } as usize;
        if p == 0 || in_layer(p) {
            return None;
        }
        REAL_DLOPEN.store(p, Ordering::Release);
    }
    // SAFETY: glibc's dlopen, with its signature.
    Some(unsafe { std::mem::transmute::<usize, OpenFn>(p) })
}

/// The loader's record of the object holding address `p`.
fn dladdr(p: usize) -> Option<libc::Dl_info> {
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: dladdr only reads the loader's tables; `info` is a valid out pointer.
    (unsafe { libc::dladdr(p as *const c_void, &mut info) } != 0).then_some(info)
}

/// The layer's load address.
fn self_base() -> usize {
    let mut b = SELF_BASE.load(Ordering::Acquire);
    if b == 0 {
        b = dladdr(self_base as fn() -> usize as usize).map_or(0, |i| i.dli_fbase as usize);
        SELF_BASE.store(b, Ordering::Release);
    }
    b
}

/// Whether address `p` is code or data of the layer itself (a definition found there is never
/// "the next one").
pub fn in_layer(p: usize) -> bool {
    let base = self_base();
    base != 0 && dladdr(p).is_some_and(|i| i.dli_fbase as usize == base)
}

/// The file the layer was loaded from.
fn self_path() -> Option<&'static CStr> {
    let i = dladdr(self_base as fn() -> usize as usize)?;
    // SAFETY: the loader's copy of the layer's name, valid while the layer stays loaded (for
    // good: it is marked RTLD_NODELETE before anyone gets a handle on it).
    (!i.dli_fname.is_null()).then(|| unsafe { CStr::from_ptr(i.dli_fname) })
}

/// The real NCCL opened for the application, where one was.
pub fn nccl_handle() -> Option<usize> {
    Some(NCCL.load(Ordering::Acquire)).filter(|h| *h != 0)
}

/// Records `h` (a reference the caller gives away) as the real NCCL; where one is already
/// recorded, the reference is dropped again (the same library: its count stays above zero) or
/// kept (another file: never closed, never called).
pub fn adopt(h: usize) {
    match NCCL.compare_exchange(0, h, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => {}
        Err(old) if old == h => {
            // SAFETY: a reference the layer holds, with another one still held.
            unsafe { libc::dlclose(h as *mut c_void) };
        }
        Err(_) => tracing::warn!(
            "a second NCCL library was opened; the layer goes on calling the first one"
        ),
    }
}

/// Whether a `dlopen` request names NCCL: its file name starts with `libnccl.so`.
pub fn is_nccl(file: &[u8]) -> bool {
    let base = file.rsplit(|b| *b == b'/').next().unwrap_or(file);
    base.starts_with(b"libnccl.so")
}

/// A handle on the layer for the application (one more reference; the first one is opened
/// with `RTLD_NODELETE` and kept).
fn self_handle(open: OpenFn) -> *mut c_void {
    let Some(path) = self_path() else {
        return std::ptr::null_mut();
    };
    if SELF_HANDLE.load(Ordering::Acquire) == 0 {
        // SAFETY: the layer's own file, already loaded: RTLD_NOLOAD only finds it.
        let h = unsafe {
            open(
                path.as_ptr(),
                libc::RTLD_LAZY | libc::RTLD_NOLOAD | libc::RTLD_NODELETE,
            )
        };
        if h.is_null() {
            return h;
        }
        if SELF_HANDLE
            .compare_exchange(0, h as usize, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            // SAFETY: a reference just taken; the kept one holds the layer.
            unsafe { libc::dlclose(h) };
        }
    }
    // SAFETY: as above.
    unsafe { open(path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_NOLOAD) }
}

/// `dlopen` of NCCL for the application: opened for real, recorded, answered with the layer.
unsafe extern "C" fn nccl_dlopen(file: *const c_char, mode: c_int) -> *mut c_void {
    let Some(open) = real_dlopen() else {
        return std::ptr::null_mut();
    };
    let h = open(file, mode);
    if h.is_null() {
        // The loader's error stays for the caller's dlerror.
        return h;
    }
    let me = self_handle(open);
    if me.is_null() || me == h {
        // The layer cannot name itself (or the request named the layer): no wrapping.
        if !me.is_null() {
            libc::dlclose(me);
        }
        return h;
    }
    adopt(h as usize);
    me
}

/// Where a stub goes when glibc's function is not found (it always is).
unsafe extern "C" fn missing(_: *const c_char, _: c_int) -> *mut c_void {
    std::ptr::null_mut()
}

/// Where `dlopen(file, mode)` goes: [`nccl_dlopen`] for NCCL, glibc's `dlopen` otherwise.
unsafe extern "C" fn route_dlopen(file: *const c_char, _mode: c_int) -> usize {
    let Some(open) = real_dlopen() else {
        return missing as OpenFn as usize;
    };
    if !file.is_null() && is_nccl(CStr::from_ptr(file).to_bytes()) {
        return nccl_dlopen as OpenFn as usize;
    }
    open as usize
}

/// Where `dlsym(handle, name)` goes: glibc's `dlsym`, on the real NCCL's handle for a name
/// looked up on the layer's handle that the layer does not define, else on `handle`.
unsafe extern "C" fn route_dlsym(handle: *mut c_void, name: *const c_char) -> Route {
    let Some(sym) = real_dlsym() else {
        return Route {
            target: missing as OpenFn as usize,
            arg: handle as usize,
        };
    };
    let me = SELF_HANDLE.load(Ordering::Acquire);
    if me != 0 && handle as usize == me && !name.is_null() {
        if let Some(nccl) = nccl_handle() {
            let own = sym(handle, name) as usize;
            if own == 0 || !in_layer(own) {
                return Route {
                    target: sym as usize,
                    arg: nccl,
                };
            }
        }
    }
    Route {
        target: sym as usize,
        arg: handle as usize,
    }
}

/// The exported `dlopen`: asks `route_dlopen`, then jumps there with the caller's arguments
/// and return address.
///
/// # Safety
/// `dlopen`'s contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "jmp rax",
        route = sym route_dlopen,
    )
}

/// The exported `dlsym`: asks `route_dlsym`, then jumps to glibc's `dlsym` with the handle
/// it says, the caller's name and the caller's return address.
///
/// # Safety
/// `dlsym`'s contract.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {route}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "mov rdi, rdx",
        "jmp rax",
        route = sym route_dlsym,
    )
}

/// As on x86_64: the link register is restored before the jump.
///
/// # Safety
/// `dlopen`'s contract.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlopen(file: *const c_char, mode: c_int) -> *mut c_void {
    std::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {route}",
        "mov x16, x0",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "br x16",
        route = sym route_dlopen,
    )
}

/// As on x86_64: the link register is restored before the jump.
///
/// # Safety
/// `dlsym`'s contract.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
#[no_mangle]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, name: *const c_char) -> *mut c_void {
    std::arch::naked_asm!(
        "stp x29, x30, [sp, #-32]!",
        "mov x29, sp",
        "stp x0, x1, [sp, #16]",
        "bl {route}",
        "mov x16, x0",
        "mov x17, x1",
        "ldp x0, x1, [sp, #16]",
        "ldp x29, x30, [sp], #32",
        "mov x0, x17",
        "br x16",
        route = sym route_dlsym,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nccl_names() {
        for yes in [
            &b"libnccl.so"[..],
            b"libnccl.so.2",
            b"libnccl.so.2.28.3",
            b"/usr/lib/x86_64-linux-gnu/libnccl.so.2",
            b"nvidia/nccl/lib/libnccl.so.2",
        ] {
            assert!(is_nccl(yes), "{}", String::from_utf8_lossy(yes));
        }
        for no in [
            &b"libnccl-net.so"[..],
            b"libnccl-tuner.so",
            b"libnccl_static.a",
            b"/opt/libnccl.so.2/libcuda.so.1",
            b"libcuda.so.1",
            b"",
            b"/",
        ] {
            assert!(!is_nccl(no), "{}", String::from_utf8_lossy(no));
        }
    }

    #[test]
    fn the_real_functions_are_glibcs_not_the_layers() {
        let sym = real_dlsym().expect("glibc's dlsym");
        assert!(!in_layer(sym as usize));
        let open = real_dlopen().expect("glibc's dlopen");
        assert!(!in_layer(open as usize));
        assert!(in_layer(nccl_dlopen as OpenFn as usize));
        // The exported stub passes a lookup that is not on the layer's handle on unchanged.
        // SAFETY: dlsym with a valid name.
        let p = unsafe { dlsym(libc::RTLD_DEFAULT, c"getpid".as_ptr()) };
        assert!(p as usize != 0 && !in_layer(p as usize));
    }
}
