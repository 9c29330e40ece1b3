//! The next definition of a symbol: the library the application would have called without the
//! layer (`dlsym(RTLD_NEXT)`), else `libnccl.so.2` opened by the layer for programs that do not
//! link NCCL (they `dlopen` it later, and find the layer's definitions first in the global scope).

use std::ffi::{c_void, CStr};
use std::sync::OnceLock;

/// The soname of NVIDIA's NCCL.
pub const LIBNCCL: &CStr = c"libnccl.so.2";

/// The address of the next definition of `name`, or None.
pub fn resolve(name: &CStr) -> Option<usize> {
    // SAFETY: dlsym with a valid C string; RTLD_NEXT searches the objects after this one.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if !p.is_null() {
        return Some(p as usize);
    }
    let lib = fallback()?;
    // SAFETY: a handle dlopen returned, never closed.
    let p = unsafe { libc::dlsym(lib as *mut c_void, name.as_ptr()) };
    (!p.is_null()).then_some(p as usize)
}

/// `libnccl.so.2`, opened once (never closed).
fn fallback() -> Option<usize> {
    static LIB: OnceLock<Option<usize>> = OnceLock::new();
    *LIB.get_or_init(|| {
        // SAFETY: dlopen of a library name; RTLD_NOW so that a broken library fails here.
        let h = unsafe { libc::dlopen(LIBNCCL.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
        (!h.is_null()).then_some(h as usize)
    })
}

/// `next!(ncclAllReduce, fn(...) -> ...)`: the next definition as a typed function pointer,
/// resolved once per call site.
#[macro_export]
macro_rules! next {
    ($name:ident, $ty:ty) => {{
        static F: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
        F.get_or_init(|| {
            $crate::next::resolve(
                std::ffi::CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes())
                    .expect("a literal name"),
            )
        })
        .map(|p| {
            // SAFETY: the symbol is NCCL's function of this name, with nccl.h's signature.
            #[allow(unused_unsafe)]
            let f = unsafe { std::mem::transmute::<usize, $ty>(p) };
            f
        })
    }};
}
