//! The next definition of a symbol: first the NCCL the application opened with `dlopen` (see
//! [`crate::dl`]), then the library the application would have called without the layer
//! (`dlsym(RTLD_NEXT)`: a program that links NCCL), else `libnccl.so.2` opened by the layer (a
//! program that calls NCCL through the global scope of a library opened later). A definition in
//! the layer itself is never the next one: nothing the layer resolves comes back into it.

use std::ffi::{c_void, CStr};

use crate::dl;

/// The soname of NVIDIA's NCCL.
pub const LIBNCCL: &CStr = c"libnccl.so.2";

/// The address of the next definition of `name`, or None.
pub fn resolve(name: &CStr) -> Option<usize> {
    let sym = dl::real_dlsym()?;
    let found = |h: *mut c_void| {
        // SAFETY: glibc's dlsym with a valid C string, called from the layer (RTLD_NEXT searches
        // the objects after it).
        let p = unsafe { sym(h, name.as_ptr()) } as usize;
        (p != 0 && !dl::in_layer(p)).then_some(p)
    };
    if let Some(p) = dl::nccl_handle().and_then(|h| found(h as *mut c_void)) {
        return Some(p);
    }
    if let Some(p) = found(libc::RTLD_NEXT) {
        return Some(p);
    }
    found(fallback()? as *mut c_void)
}

/// `libnccl.so.2`, opened by the layer (with glibc's `dlopen`, not the layer's) and kept as the
/// real NCCL; tried again on the next call where it is not there yet.
fn fallback() -> Option<usize> {
    if let Some(h) = dl::nccl_handle() {
        return Some(h);
    }
    let open = dl::real_dlopen()?;
    // SAFETY: dlopen of a library name; RTLD_NOW so that a broken library fails here.
    let h = unsafe { open(LIBNCCL.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    if h.is_null() {
        return None;
    }
    dl::adopt(h as usize);
    dl::nccl_handle()
}

/// `next!(ncclAllReduce, fn(...) -> ...)`: the next definition as a typed function pointer,
/// resolved once per call site (a name not found yet is looked up again on the next call: the
/// application may open NCCL later).
#[macro_export]
macro_rules! next {
    ($name:ident, $ty:ty) => {{
        static F: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let mut p = F.load(std::sync::atomic::Ordering::Acquire);
        if p == 0 {
            p = $crate::next::resolve(
                std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes())
                    .expect("a literal name"),
            )
            .unwrap_or(0);
            F.store(p, std::sync::atomic::Ordering::Release);
        }
        (p != 0).then(|| {
            // SAFETY: the symbol is NCCL's function of this name, with nccl.h's signature.
            #[allow(unused_unsafe)]
            let f = unsafe { std::mem::transmute::<usize, $ty>(p) };
            f
        })
    }};
}
