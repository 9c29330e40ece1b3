//! The simulated `libnvidia-ml.so.1`: the NVML calls a node inventory needs, with the real
//! symbol names (the versioned ones too), structs and return codes, answered by
//! `gpu-ckpt-simgpu`. It holds no connection between calls, so it never stands in CRIU's way.
#![allow(clippy::missing_safety_doc)] // C entry points; their contracts are NVIDIA's documentation.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard};

use simgpu::client::Client;
use simgpu::cuerr::{self, nvml};
use simgpu::node::{format_uuid, parse_uuid, GpuDesc, NodeDesc};
use simgpu::proto::{ProcUse, Reply, Request, Role};

type Ret = c_uint;
type Device = *mut c_void;
type R<T = ()> = Result<T, Ret>;

struct State {
    refs: u32,
    socket: PathBuf,
    node: NodeDesc,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

fn out<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(nvml::ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: the caller passed a pointer to a T.
    unsafe { p.write(v) };
    Ok(())
}

fn copy_cstr(dst: *mut c_char, len: c_uint, s: &str) -> R {
    if dst.is_null() {
        return Err(nvml::ERROR_INVALID_ARGUMENT);
    }
    let b = s.as_bytes();
    if (len as usize) < b.len() + 1 {
        return Err(nvml::ERROR_INSUFFICIENT_SIZE);
    }
    // SAFETY: the buffer holds len >= b.len() + 1 bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(b.as_ptr(), dst.cast::<u8>(), b.len());
        *dst.add(b.len()) = 0;
    }
    Ok(())
}

fn connect(socket: &std::path::Path) -> R<Client> {
    Client::connect(socket, Role::Nvml).map_err(|_| nvml::ERROR_DRIVER_NOT_LOADED)
}

fn init() -> R {
    let mut st = state();
    if let Some(s) = st.as_mut() {
        s.refs += 1;
        return Ok(());
    }
    let lib = simgpu::library_file_of(nvmlInit_v2 as *const () as usize);
    let socket = simgpu::socket_path(lib.as_deref());
    let mut c = connect(&socket)?;
    let mut node = match c.call(&Request::Node) {
        Ok(Reply::Node(n)) => n,
        _ => return Err(nvml::ERROR_UNKNOWN),
    };
    simgpu::retain_visible(&mut node, &simgpu::dev_dir(&socket));
    *st = Some(State {
        refs: 1,
        socket,
        node,
    });
    Ok(())
}

fn with_node<T>(f: impl FnOnce(&NodeDesc) -> R<T>) -> R<T> {
    let st = state();
    let s = st.as_ref().ok_or(nvml::ERROR_UNINITIALIZED)?;
    f(&s.node)
}

const HANDLE_BASE: usize = 0x4e56_0000;

fn handle(index: usize) -> Device {
    (HANDLE_BASE + index * 0x100) as Device
}

fn gpu(dev: Device) -> R<GpuDesc> {
    let off = (dev as usize)
        .checked_sub(HANDLE_BASE)
        .ok_or(nvml::ERROR_INVALID_ARGUMENT)?;
    if off % 0x100 != 0 {
        return Err(nvml::ERROR_INVALID_ARGUMENT);
    }
    with_node(|n| {
        n.gpus
            .get(off / 0x100)
            .cloned()
            .ok_or(nvml::ERROR_INVALID_ARGUMENT)
    })
}

fn daemon_call(req: &Request) -> R<Reply> {
    let socket = {
        let st = state();
        st.as_ref().ok_or(nvml::ERROR_UNINITIALIZED)?.socket.clone()
    };
    connect(&socket)?.call(req).map_err(|_| nvml::ERROR_UNKNOWN)
}

fn mem(g: &GpuDesc) -> R<(u64, u64)> {
    match daemon_call(&Request::MemInfo { gpu: g.uuid })? {
        Reply::MemInfo { free, total } => Ok((free, total)),
        _ => Err(nvml::ERROR_UNKNOWN),
    }
}

#[repr(C)]
pub struct Memory {
    total: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct MemoryV2 {
    version: c_uint,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

#[repr(C)]
pub struct PciInfo {
    bus_id_legacy: [c_char; 16],
    domain: c_uint,
    bus: c_uint,
    device: c_uint,
    pci_device_id: c_uint,
    pci_sub_system_id: c_uint,
    bus_id: [c_char; 32],
}

/// `nvmlProcessInfo_t` (also `_v2_t`), as `..._v2` and `..._v3` fill it.
#[repr(C)]
pub struct ProcessInfo {
    pid: c_uint,
    used_gpu_memory: u64,
    gpu_instance_id: c_uint,
    compute_instance_id: c_uint,
}

/// `nvmlProcessInfo_v1_t`.
#[repr(C)]
pub struct ProcessInfoV1 {
    pid: c_uint,
    used_gpu_memory: u64,
}

/// The processes with a context on `g`: MPS clients (`mps`), or the others.
fn procs_on(g: &GpuDesc, mps: bool) -> R<Vec<ProcUse>> {
    match daemon_call(&Request::Processes)? {
        Reply::Processes(p) => Ok(p
            .into_iter()
            .filter(|p| p.gpu == g.uuid && p.mps == mps)
            .collect()),
        _ => Err(nvml::ERROR_UNKNOWN),
    }
}

/// NVML's two-call convention: with too small a buffer, the count and INSUFFICIENT_SIZE.
fn fill_procs<T>(
    dev: Device,
    mps: bool,
    count: *mut c_uint,
    infos: *mut T,
    make: impl Fn(&ProcUse) -> T,
) -> R {
    if count.is_null() {
        return Err(nvml::ERROR_INVALID_ARGUMENT);
    }
    let procs = procs_on(&gpu(dev)?, mps)?;
    // SAFETY: count is a valid pointer (checked above).
    let room = unsafe { *count } as usize;
    out(count, procs.len() as c_uint)?;
    if procs.is_empty() {
        return Ok(());
    }
    if infos.is_null() || room < procs.len() {
        return Err(nvml::ERROR_INSUFFICIENT_SIZE);
    }
    for (i, p) in procs.iter().enumerate() {
        // SAFETY: room >= procs.len() entries at infos.
        unsafe { infos.add(i).write(make(p)) };
    }
    Ok(())
}

fn pci(g: &GpuDesc) -> PciInfo {
    let mut info = PciInfo {
        bus_id_legacy: [0; 16],
        domain: 0,
        bus: 0,
        device: 0,
        // 0x2330 is the H100 SXM5's device id; 0x10de NVIDIA's vendor id.
        pci_device_id: 0x2330_10de,
        pci_sub_system_id: 0x16c1_10de,
        bus_id: [0; 32],
    };
    let parts: Vec<&str> = g.pci_bus_id.split([':', '.']).collect();
    if let [dom, bus, dev, _func] = parts.as_slice() {
        info.domain = u32::from_str_radix(dom, 16).unwrap_or(0);
        info.bus = u32::from_str_radix(bus, 16).unwrap_or(0);
        info.device = u32::from_str_radix(dev, 16).unwrap_or(0);
    }
    let legacy = format!("{:04X}:{:02X}:{:02X}.0", info.domain, info.bus, info.device);
    for (d, s) in info.bus_id_legacy.iter_mut().zip(legacy.bytes().take(15)) {
        *d = s as c_char;
    }
    for (d, s) in info.bus_id.iter_mut().zip(g.pci_bus_id.bytes().take(31)) {
        *d = s as c_char;
    }
    info
}

fn by_index(index: c_uint, dev: *mut Device) -> R {
    let n = with_node(|n| Ok(n.gpus.len()))?;
    if index as usize >= n {
        return Err(nvml::ERROR_INVALID_ARGUMENT);
    }
    out(dev, handle(index as usize))
}

fn find_by(s: *const c_char, pick: impl Fn(&GpuDesc, &str) -> bool, dev: *mut Device) -> R {
    if s.is_null() {
        return Err(nvml::ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: a NUL-terminated string from the caller.
    let want = unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned();
    let i = with_node(|n| {
        n.gpus
            .iter()
            .position(|g| pick(g, &want))
            .ok_or(nvml::ERROR_NOT_FOUND)
    })?;
    out(dev, handle(i))
}

macro_rules! entry {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $name($($arg: $ty),*) -> Ret {
            let run = std::panic::AssertUnwindSafe(|| -> R { $body });
            match std::panic::catch_unwind(run) {
                Ok(Ok(())) => nvml::SUCCESS,
                Ok(Err(code)) => code,
                Err(_) => nvml::ERROR_UNKNOWN,
            }
        }
    )*};
}

entry! {
    fn nvmlInit_v2() { init() }
    fn nvmlInit() { init() }
    fn nvmlInitWithFlags(_flags: c_uint) { init() }
    fn nvmlShutdown() {
        let mut st = state();
        let s = st.as_mut().ok_or(nvml::ERROR_UNINITIALIZED)?;
        s.refs -= 1;
        if s.refs == 0 {
            *st = None;
        }
        Ok(())
    }
    fn nvmlSystemGetDriverVersion(version: *mut c_char, length: c_uint) {
        let v = with_node(|n| Ok(n.driver_version.clone()))?;
        copy_cstr(version, length, &v)
    }
    fn nvmlSystemGetNVMLVersion(version: *mut c_char, length: c_uint) {
        let (d, c) = with_node(|n| Ok((n.driver_version.clone(), n.cuda_version)))?;
        copy_cstr(version, length, &format!("{}.{d}", c / 1000))
    }
    fn nvmlSystemGetCudaDriverVersion(v: *mut c_int) {
        out(v, with_node(|n| Ok(n.cuda_version))?)
    }
    fn nvmlSystemGetCudaDriverVersion_v2(v: *mut c_int) {
        out(v, with_node(|n| Ok(n.cuda_version))?)
    }
    fn nvmlDeviceGetCount_v2(count: *mut c_uint) {
        out(count, with_node(|n| Ok(n.gpus.len() as c_uint))?)
    }
    fn nvmlDeviceGetCount(count: *mut c_uint) {
        out(count, with_node(|n| Ok(n.gpus.len() as c_uint))?)
    }
    fn nvmlDeviceGetHandleByIndex_v2(index: c_uint, dev: *mut Device) { by_index(index, dev) }
    fn nvmlDeviceGetHandleByIndex(index: c_uint, dev: *mut Device) { by_index(index, dev) }
    fn nvmlDeviceGetHandleByUUID(uuid: *const c_char, dev: *mut Device) {
        find_by(uuid, |g, want| parse_uuid(want) == Some(g.uuid), dev)
    }
    fn nvmlDeviceGetHandleByPciBusId_v2(bus: *const c_char, dev: *mut Device) {
        find_by(bus, |g, want| g.pci_bus_id.eq_ignore_ascii_case(want) || g.pci_bus_id[4..].eq_ignore_ascii_case(want), dev)
    }
    fn nvmlDeviceGetHandleByPciBusId(bus: *const c_char, dev: *mut Device) {
        find_by(bus, |g, want| g.pci_bus_id.eq_ignore_ascii_case(want) || g.pci_bus_id[4..].eq_ignore_ascii_case(want), dev)
    }
    fn nvmlDeviceGetIndex(dev: Device, index: *mut c_uint) {
        let g = gpu(dev)?;
        let i = with_node(|n| Ok(n.gpus.iter().position(|x| x.uuid == g.uuid).unwrap_or(0)))?;
        out(index, i as c_uint)
    }
    fn nvmlDeviceGetMinorNumber(dev: Device, minor: *mut c_uint) {
        out(minor, gpu(dev)?.index)
    }
    fn nvmlDeviceGetUUID(dev: Device, uuid: *mut c_char, length: c_uint) {
        copy_cstr(uuid, length, &format_uuid(&gpu(dev)?.uuid))
    }
    fn nvmlDeviceGetName(dev: Device, name: *mut c_char, length: c_uint) {
        copy_cstr(name, length, &gpu(dev)?.name)
    }
    fn nvmlDeviceGetMemoryInfo(dev: Device, memory: *mut Memory) {
        let (free, total) = mem(&gpu(dev)?)?;
        out(memory, Memory { total, free, used: total - free })
    }
    fn nvmlDeviceGetMemoryInfo_v2(dev: Device, memory: *mut MemoryV2) {
        if memory.is_null() {
            return Err(nvml::ERROR_INVALID_ARGUMENT);
        }
        let (free, total) = mem(&gpu(dev)?)?;
        // SAFETY: checked non-null; the caller set `version`.
        let version = unsafe { (*memory).version };
        out(memory, MemoryV2 { version, total, reserved: 0, free, used: total - free })
    }
    fn nvmlDeviceGetPciInfo_v3(dev: Device, info: *mut PciInfo) { out(info, pci(&gpu(dev)?)) }
    fn nvmlDeviceGetPciInfo_v2(dev: Device, info: *mut PciInfo) { out(info, pci(&gpu(dev)?)) }
    fn nvmlDeviceGetPciInfo(dev: Device, info: *mut PciInfo) { out(info, pci(&gpu(dev)?)) }
    fn nvmlDeviceGetPersistenceMode(dev: Device, mode: *mut c_uint) {
        out(mode, c_uint::from(gpu(dev)?.persistence))
    }
    fn nvmlDeviceGetCudaComputeCapability(dev: Device, major: *mut c_int, minor: *mut c_int) {
        let g = gpu(dev)?;
        out(major, g.cc.0)?;
        out(minor, g.cc.1)
    }
    fn nvmlDeviceGetArchitecture(dev: Device, arch: *mut c_uint) {
        out(arch, gpu(dev)?.arch)
    }
    fn nvmlDeviceGetMigMode(dev: Device, current: *mut c_uint, pending: *mut c_uint) {
        // NVML_DEVICE_MIG_ENABLE (1) or NVML_DEVICE_MIG_DISABLE (0); no change is pending.
        let mode = c_uint::from(gpu(dev)?.mig);
        out(current, mode)?;
        out(pending, mode)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses_v3(dev: Device, count: *mut c_uint, infos: *mut ProcessInfo) {
        fill_procs(dev, true, count, infos, proc_info)
    }
    fn nvmlDeviceGetMPSComputeRunningProcesses_v2(dev: Device, count: *mut c_uint, infos: *mut ProcessInfo) {
        fill_procs(dev, true, count, infos, proc_info)
    }
    fn nvmlDeviceGetComputeRunningProcesses_v3(dev: Device, count: *mut c_uint, infos: *mut ProcessInfo) {
        fill_procs(dev, false, count, infos, proc_info)
    }
    fn nvmlDeviceGetComputeRunningProcesses_v2(dev: Device, count: *mut c_uint, infos: *mut ProcessInfo) {
        fill_procs(dev, false, count, infos, proc_info)
    }
    fn nvmlDeviceGetComputeRunningProcesses(dev: Device, count: *mut c_uint, infos: *mut ProcessInfoV1) {
        fill_procs(dev, false, count, infos, |p| ProcessInfoV1 { pid: p.pid, used_gpu_memory: p.used_bytes })
    }
}

fn proc_info(p: &ProcUse) -> ProcessInfo {
    // 0xFFFFFFFF: not a MIG instance.
    ProcessInfo {
        pid: p.pid,
        used_gpu_memory: p.used_bytes,
        gpu_instance_id: u32::MAX,
        compute_instance_id: u32::MAX,
    }
}

/// `nvmlErrorString`.
#[no_mangle]
pub extern "C" fn nvmlErrorString(result: Ret) -> *const c_char {
    static STRINGS: std::sync::OnceLock<Mutex<std::collections::HashMap<Ret, std::ffi::CString>>> =
        std::sync::OnceLock::new();
    let mut m = STRINGS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    m.entry(result)
        .or_insert_with(|| std::ffi::CString::new(cuerr::nvml_string(result)).unwrap_or_default())
        .as_ptr()
}
