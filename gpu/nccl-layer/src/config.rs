//! An owned copy of an application's `ncclConfig_t`, kept to create the communicator again.

use std::ffi::{c_char, CStr, CString};
use std::mem::{offset_of, size_of};

use crate::ffi::{ncclConfig_t, NCCL_API_MAGIC};

/// The config as the application passed it, its strings owned. Boxed, so that the pointers
/// into its own strings stay valid.
#[derive(Debug)]
pub struct ConfigCopy {
    raw: ncclConfig_t,
    _net_name: Option<CString>,
    _comm_name: Option<CString>,
}

// SAFETY: the raw pointers point into the CStrings this value owns, which it never mutates.
unsafe impl Send for ConfigCopy {}
unsafe impl Sync for ConfigCopy {}

impl ConfigCopy {
    /// Copies `cfg` (None for a null pointer or one without NCCL's magic: such a config is
    /// passed to NCCL as it is, which refuses it, and never needed again). Only the bytes the
    /// application's `size` covers are read; fields past them keep the initializer's values.
    ///
    /// # Safety
    /// `cfg` is null or points to at least `(*cfg).size` readable bytes (NCCL's own rule).
    pub unsafe fn copy(cfg: *const ncclConfig_t) -> Option<Box<ConfigCopy>> {
        if cfg.is_null() {
            return None;
        }
        // size and magic come first in every version of the struct.
        let app_size = std::ptr::read_unaligned(cfg as *const usize);
        let magic = std::ptr::read_unaligned(
            (cfg as *const u8).add(offset_of!(ncclConfig_t, magic)) as *const u32,
        );
        if magic != NCCL_API_MAGIC || app_size < offset_of!(ncclConfig_t, blocking) {
            return None;
        }
        let n = app_size.min(size_of::<ncclConfig_t>());
        let mut raw = ncclConfig_t::initializer();
        std::ptr::copy_nonoverlapping(cfg as *const u8, &mut raw as *mut _ as *mut u8, n);
        raw.size = n;
        let take = |p: *const c_char, end: usize| {
            (n >= end && !p.is_null()).then(|| CStr::from_ptr(p).to_owned())
        };
        let net = take(
            raw.netName,
            offset_of!(ncclConfig_t, netName) + size_of::<usize>(),
        );
        let name = take(
            raw.commName,
            offset_of!(ncclConfig_t, commName) + size_of::<usize>(),
        );
        let mut b = Box::new(ConfigCopy {
            raw,
            _net_name: net,
            _comm_name: name,
        });
        b.raw.netName = b
            ._net_name
            .as_ref()
            .map_or(std::ptr::null(), |s| s.as_ptr());
        b.raw.commName = b
            ._comm_name
            .as_ref()
            .map_or(std::ptr::null(), |s| s.as_ptr());
        Some(b)
    }

    /// A pointer to hand to NCCL (which reads it and keeps nothing).
    pub fn as_ptr(&self) -> *mut ncclConfig_t {
        &self.raw as *const ncclConfig_t as *mut ncclConfig_t
    }

    pub fn raw(&self) -> &ncclConfig_t {
        &self.raw
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_fields_and_strings_within_size() {
        let net = CString::new("Socket").unwrap();
        let mut c = ncclConfig_t::initializer();
        c.blocking = 0;
        c.netName = net.as_ptr();
        c.nvlsHostMode = 7;
        let copy = unsafe { ConfigCopy::copy(&c) }.unwrap();
        drop(net);
        assert_eq!(copy.raw().blocking, 0);
        assert_eq!(copy.raw().nvlsHostMode, 7);
        assert_eq!(copy.raw().size, size_of::<ncclConfig_t>());
        let s = unsafe { CStr::from_ptr(copy.raw().netName) };
        assert_eq!(s.to_str().unwrap(), "Socket");
        assert!(copy.raw().commName.is_null());

        // An older, shorter struct: fields past its size keep the initializer's value.
        let mut old = ncclConfig_t::initializer();
        old.size = offset_of!(ncclConfig_t, netName);
        old.maxCTAs = 4;
        old.nvlsHostMode = 9;
        let copy = unsafe { ConfigCopy::copy(&old) }.unwrap();
        assert_eq!(copy.raw().maxCTAs, 4);
        assert_eq!(copy.raw().nvlsHostMode, crate::ffi::NCCL_CONFIG_UNDEF_INT);
        assert_eq!(copy.raw().size, offset_of!(ncclConfig_t, netName));

        // No magic: not a config NCCL would take.
        let mut bad = ncclConfig_t::initializer();
        bad.magic = 0;
        assert!(unsafe { ConfigCopy::copy(&bad) }.is_none());
        assert!(unsafe { ConfigCopy::copy(std::ptr::null()) }.is_none());
    }
}
