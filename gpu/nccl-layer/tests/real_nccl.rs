//! The layer over NVIDIA's libnccl.so.2 (the pinned wheel's, in the test stack), without a GPU:
//! preloaded into a process that loads NCCL, every function it wraps resolves to the layer, NVIDIA's
//! library has each of them, and the calls that need no GPU (ncclGetVersion, ncclGetErrorString)
//! reach NVIDIA's library through the layer. The handle `dlopen("libnccl.so.2")` gives is the
//! layer's, on which a function the layer does not wrap is NVIDIA's.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::process::Command;

mod common;

const ENV_CHILD: &str = "NCCL_LAYER_TEST_REAL";

/// The NCCL functions the layer wraps (the shared design's list).
const WRAPPED: &str = "\
    ncclGetVersion ncclGetUniqueId ncclCommInitRank ncclCommInitRankConfig ncclCommInitAll \
    ncclCommSplit ncclCommFinalize ncclCommDestroy ncclCommAbort ncclCommCount ncclCommCuDevice \
    ncclCommUserRank ncclCommGetAsyncError ncclGetErrorString ncclGetLastError ncclAllReduce \
    ncclBroadcast ncclBcast ncclReduce ncclAllGather ncclReduceScatter ncclSend ncclRecv \
    ncclGroupStart ncclGroupEnd ncclCommRegister ncclCommDeregister ncclCommSuspend ncclCommResume";

fn wrapped() -> Vec<&'static str> {
    WRAPPED.split_whitespace().collect()
}

fn main() {
    if std::env::var_os(ENV_CHILD).is_some() {
        child();
        return;
    }
    if !common::selected("layer_over_nvidia_nccl") {
        return;
    }
    let dir = tempfile::tempdir().expect("tempdir");
    let layer = common::layer_library(dir.path());
    let stdout = common::stack::run_ok(
        Command::new(std::env::current_exe().unwrap())
            .env(ENV_CHILD, dir.path())
            .env("LD_PRELOAD", &layer)
            .env(
                "LD_LIBRARY_PATH",
                common::stack::wheel_dir("lib", "libnccl.so.2"),
            ),
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let names = wrapped();
    assert_eq!(names.len(), 29);
    assert_eq!(lines.len(), names.len() + 3, "{stdout}");
    for (l, name) in lines.iter().zip(&names) {
        assert_eq!(*l, format!("{name}: layer, and NVIDIA's library has it"));
    }
    // 2.32.6, as the wheel's nccl.h says, through the layer.
    assert_eq!(lines[names.len()], "version 23206");
    assert_eq!(
        lines[names.len() + 1],
        "ncclInvalidUsage: the same text through the layer"
    );
    assert_eq!(
        lines[names.len() + 2],
        "dlopen: the layer's ncclAllReduce, NVIDIA's ncclMemAlloc"
    );
    println!("test layer_over_nvidia_nccl ... ok");
}

/// In the process with the layer preloaded.
fn child() {
    let lib = c"libnccl.so.2";
    // SAFETY: dlopen of NVIDIA's library from LD_LIBRARY_PATH: the layer's handle.
    let opened = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(!opened.is_null(), "cannot load NVIDIA's libnccl.so.2");
    // NVIDIA's library itself, by a name the layer does not take for NCCL's (the same file:
    // the loader hands out the object already loaded).
    let wheel = common::stack::wheel_dir("lib", "libnccl.so.2").join("libnccl.so.2");
    let alias = std::path::Path::new(&std::env::var_os(ENV_CHILD).unwrap()).join("nvidia.so");
    std::os::unix::fs::symlink(&wheel, &alias).expect("symlink");
    let alias = CString::new(alias.to_str().unwrap()).unwrap();
    // SAFETY: dlopen of the library already loaded.
    let real = unsafe { libc::dlopen(alias.as_ptr(), libc::RTLD_NOW | libc::RTLD_NOLOAD) };
    assert!(!real.is_null(), "NVIDIA's libnccl.so.2 is not loaded");
    assert_ne!(real, opened, "dlopen of NCCL did not give the layer");
    for name in wrapped() {
        let c = CString::new(name).unwrap();
        // SAFETY: dlsym and dladdr on symbols of loaded libraries.
        unsafe {
            let global = libc::dlsym(libc::RTLD_DEFAULT, c.as_ptr());
            assert!(!global.is_null(), "{name} not found");
            let mut info: libc::Dl_info = std::mem::zeroed();
            assert_ne!(libc::dladdr(global, &mut info), 0, "{name}: dladdr");
            let file = CStr::from_ptr(info.dli_fname).to_string_lossy();
            assert!(
                file.ends_with("libgpu-ckpt-nccl.so"),
                "{name} resolves to {file}, not the layer"
            );
            assert!(
                !libc::dlsym(real, c.as_ptr()).is_null(),
                "NVIDIA's libnccl.so.2 has no {name}"
            );
        }
        println!("{name}: layer, and NVIDIA's library has it");
    }
    // SAFETY: nccl.h's signatures.
    unsafe {
        let get_version: unsafe extern "C" fn(*mut c_int) -> c_int =
            std::mem::transmute(libc::dlsym(libc::RTLD_DEFAULT, c"ncclGetVersion".as_ptr()));
        let mut v = 0;
        assert_eq!(get_version(&mut v), 0);
        println!("version {v}");
        type ErrStr = unsafe extern "C" fn(c_int) -> *const c_char;
        let sym = |h: *mut c_void| -> ErrStr {
            std::mem::transmute(libc::dlsym(h, c"ncclGetErrorString".as_ptr()))
        };
        let ours = CStr::from_ptr(sym(libc::RTLD_DEFAULT)(5));
        let theirs = CStr::from_ptr(sym(real)(5));
        assert_eq!(ours, theirs);
        assert!(!ours.to_bytes().is_empty());
        println!("ncclInvalidUsage: the same text through the layer");
        let file = |name: &CStr| {
            let p = libc::dlsym(opened, name.as_ptr());
            assert!(!p.is_null(), "no {name:?} on the handle");
            let mut info: libc::Dl_info = std::mem::zeroed();
            assert_ne!(libc::dladdr(p, &mut info), 0);
            CStr::from_ptr(info.dli_fname)
                .to_string_lossy()
                .into_owned()
        };
        assert!(file(c"ncclAllReduce").ends_with("/libgpu-ckpt-nccl.so"));
        let own = file(c"ncclMemAlloc");
        assert!(own.ends_with("/libnccl.so.2"), "ncclMemAlloc from {own}");
        assert_eq!(
            libc::dlsym(opened, c"ncclMemAlloc".as_ptr()),
            libc::dlsym(real, c"ncclMemAlloc".as_ptr())
        );
        println!("dlopen: the layer's ncclAllReduce, NVIDIA's ncclMemAlloc");
    }
}
