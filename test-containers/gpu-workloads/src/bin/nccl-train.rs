//! nccl-train: a data-parallel training loop on cudarc's NCCL bindings, N ranks on N GPUs, each
//! step verified element by element; the Rust twin of `c/nccl_allreduce.c` (same flags, same
//! numbers, same lines: see `collective`).
//!
//! cudarc loads `libcuda.so` and `libnccl.so` at run time (its dynamic loading: NVIDIA's
//! libraries, or the simulator's, by `LD_LIBRARY_PATH`; NCCL's wheel names its library
//! `libnccl.so.2`, cudarc looks for `libnccl.so`). The communicators are made and used through
//! cudarc's `nccl::result` layer: its safe `Comm` has no split and keeps its handle private.
//!
//! `--ranks N` launches N ranks as child processes of this one (torchrun's shape: rank = first +
//! i on GPU `--device` + i; the unique id goes from rank 0 to the others through a private rendezvous
//! directory, or `--rendezvous DIR` when the world has ranks elsewhere), waits for them, and stops
//! the others when one fails. Without it this process is one rank (`--rank`/`RANK`,
//! `--world-size`/`WORLD_SIZE`, `--device`/`LOCAL_RANK`, `--rendezvous DIR` shared by the ranks).
//!
//! Each step prints `rank <r> step <k> checksum <16 hex>`; a mismatch prints `MISMATCH rank <r>
//! step <k> <what> element <i> got <x> want <y>`, and every rank exits 1 at that step.

use std::ffi::c_void;
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::sync::Arc;
use std::time::{Duration, Instant};

use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtrMut, DriverError};
use cudarc::nccl::result::{self as nccl, NcclError};
use cudarc::nccl::sys;
use gpu_ckpt_gpu_workloads::cli::{NcclOpts, NCCL_USAGE};
use gpu_ckpt_gpu_workloads::collective::{mismatch_line, step_line, Buffer, Sums};
use gpu_ckpt_gpu_workloads::{emit, signals, Fail};

/// The file rank 0 writes in the rendezvous directory (as `c/nccl_allreduce.c` does).
const ID_FILE: &str = "nccl-unique-id";
/// How long a rank waits for rank 0's unique id.
const ID_WAIT: Duration = Duration::from_secs(600);
/// How long the other ranks have to stop on their own after one failed.
const GRACE: Duration = Duration::from_secs(5);

fn main() {
    gpu_ckpt_gpu_workloads::main("nccl-train", NCCL_USAGE, run);
}

fn run(args: &[String]) -> Result<i32, Fail> {
    let o = NcclOpts::parse(args, |v| std::env::var(v).ok()).map_err(Fail::Usage)?;
    match o.ranks {
        Some(n) => launch(&o, n),
        None => rank(&o, o.rank, o.device).map(|()| 0),
    }
}

fn cuda(what: &'static str) -> impl FnOnce(DriverError) -> Fail {
    move |e| Fail::Other(format!("{what}: {e:?}"))
}

fn nccl_err(what: &'static str) -> impl FnOnce(NcclError) -> Fail {
    move |e| Fail::Other(format!("{what} returned {:?}", e.0))
}

/// A communicator, finalized and destroyed when dropped.
struct Comm(sys::ncclComm_t);

impl Comm {
    fn init(id: sys::ncclUniqueId, world: u32, rank: u32) -> Result<Comm, Fail> {
        let mut c = MaybeUninit::uninit();
        // SAFETY: `c` is written by ncclCommInitRank on success.
        unsafe {
            nccl::comm_init_rank(c.as_mut_ptr(), world as i32, id, rank as i32)
                .map_err(nccl_err("ncclCommInitRank"))?;
            Ok(Comm(c.assume_init()))
        }
    }

    fn split(&self, color: i32, key: i32) -> Result<Comm, Fail> {
        let mut c = MaybeUninit::uninit();
        // SAFETY: a live communicator; a null config is NCCL's default; `c` written on success.
        unsafe {
            sys::ncclCommSplit(self.0, color, key, c.as_mut_ptr(), std::ptr::null_mut())
                .result()
                .map_err(nccl_err("ncclCommSplit"))?;
            Ok(Comm(c.assume_init()))
        }
    }

    /// (ranks, this rank, CUDA device) as NCCL reports them.
    fn facts(&self) -> Result<(i32, i32, i32), Fail> {
        // SAFETY: a live communicator.
        unsafe {
            Ok((
                nccl::comm_count(self.0).map_err(nccl_err("ncclCommCount"))?,
                nccl::comm_user_rank(self.0).map_err(nccl_err("ncclCommUserRank"))?,
                nccl::comm_cu_device(self.0).map_err(nccl_err("ncclCommCuDevice"))?,
            ))
        }
    }

    /// Enqueues `call(buffer, count, comm, stream)` in place on `buf` on stream `s`.
    fn in_place(
        &self,
        what: &'static str,
        buf: &mut CudaSlice<u32>,
        s: &Arc<CudaStream>,
        call: impl FnOnce(*mut c_void, usize, sys::ncclComm_t, sys::cudaStream_t) -> NcclResult,
    ) -> Result<(), Fail> {
        let n = buf.len();
        let (p, _sync) = buf.device_ptr_mut(s);
        call(
            p as *mut c_void,
            n,
            self.0,
            s.cu_stream() as sys::cudaStream_t,
        )
        .map(drop)
        .map_err(nccl_err(what))
    }

    fn all_reduce_sum(&self, buf: &mut CudaSlice<u32>, s: &Arc<CudaStream>) -> Result<(), Fail> {
        self.in_place("ncclAllReduce", buf, s, |p, n, comm, st| {
            // SAFETY: `p` is `n` u32 of device memory of this rank, used in place.
            unsafe { nccl::all_reduce(p, p, n, UINT32, sys::ncclRedOp_t::ncclSum, comm, st) }
        })
    }

    fn broadcast(
        &self,
        buf: &mut CudaSlice<u32>,
        root: i32,
        s: &Arc<CudaStream>,
    ) -> Result<(), Fail> {
        self.in_place("ncclBroadcast", buf, s, |p, n, comm, st| {
            // SAFETY: as in all_reduce_sum.
            unsafe { nccl::broadcast(p, p, n, UINT32, root, comm, st) }
        })
    }
}

type NcclResult = Result<nccl::NcclStatus, NcclError>;
const UINT32: sys::ncclDataType_t = sys::ncclDataType_t::ncclUint32;

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator is not used after this.
        unsafe {
            let _ = nccl::comm_finalize(self.0);
            let _ = nccl::comm_destroy(self.0);
        }
    }
}

/// Rank 0's unique id, handed to the others through `dir`.
fn unique_id(rank: u32, dir: Option<&str>) -> Result<sys::ncclUniqueId, Fail> {
    let io = |what: &str, p: &Path, e: std::io::Error| {
        Fail::Other(format!("{what} {}: {e}", p.display()))
    };
    if rank == 0 {
        let id = nccl::get_uniqueid().map_err(nccl_err("ncclGetUniqueId"))?;
        if let Some(dir) = dir {
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            let tmp = Path::new(dir).join(format!(".{ID_FILE}.{}", std::process::id()));
            std::fs::write(&tmp, &bytes).map_err(|e| io("writing", &tmp, e))?;
            let to = Path::new(dir).join(ID_FILE);
            std::fs::rename(&tmp, &to).map_err(|e| io("renaming to", &to, e))?;
        }
        return Ok(id);
    }
    let dir = dir.ok_or_else(|| Fail::Other("no rendezvous directory".into()))?;
    let path = Path::new(dir).join(ID_FILE);
    let deadline = Instant::now() + ID_WAIT;
    loop {
        if let Ok(b) = std::fs::read(&path) {
            if let Ok(bytes) = <[u8; 128]>::try_from(b.as_slice()) {
                return Ok(sys::ncclUniqueId {
                    internal: bytes.map(|b| b as std::ffi::c_char),
                });
            }
        }
        if Instant::now() > deadline {
            return Err(Fail::Other(format!(
                "no unique id in {} after {} s (rank 0 writes it)",
                path.display(),
                ID_WAIT.as_secs()
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// One rank's device buffers.
struct Bufs {
    grad: CudaSlice<u32>,
    params: CudaSlice<u32>,
    part: CudaSlice<u32>,
    flag: CudaSlice<u32>,
}

fn rank(o: &NcclOpts, rank: u32, device: i32) -> Result<(), Fail> {
    let named = |f: Fail| match f {
        Fail::Other(m) => Fail::Other(format!("rank {rank}: {m}")),
        f => f,
    };
    run_rank(o, rank, device).map_err(named)
}

fn run_rank(o: &NcclOpts, rank: u32, device: i32) -> Result<(), Fail> {
    // SAFETY: these only try to dlopen the libraries by cudarc's names.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(Fail::Other("no NVIDIA driver: no libcuda.so found".into()));
    }
    if !unsafe { sys::is_culib_present() } {
        return Err(Fail::Other(
            "no libnccl.so found by the dynamic loader (NCCL's wheel has libnccl.so.2: link \
             libnccl.so to it in a directory of LD_LIBRARY_PATH)"
                .into(),
        ));
    }
    let ctx = CudaContext::new(device as usize).map_err(cuda("CudaContext::new"))?;
    let s = ctx.new_stream().map_err(cuda("new_stream"))?;
    // NCCL takes the device of the calling thread's current context.
    ctx.bind_to_thread().map_err(cuda("bind_to_thread"))?;
    let id = unique_id(rank, o.rendezvous.as_deref())?;
    let world = Comm::init(id, o.world, rank)?;
    let split = world.split((rank % 2) as i32, rank as i32)?;
    let (n_world, me, dev) = world.facts()?;
    let (n_split, _, _) = split.facts()?;
    let want_split = (o.world + 1 - rank % 2) / 2;
    if (n_world, me, dev, n_split) != (o.world as i32, rank as i32, device, want_split as i32) {
        return Err(Fail::Other(format!(
            "communicator: {n_world} ranks, rank {me}, device {dev}, split of {n_split}"
        )));
    }
    let n = o.elements;
    let sums = Sums::new(o.seed, rank, o.world, n);
    let mut b = Bufs {
        grad: s.alloc_zeros(n).map_err(cuda("alloc"))?,
        params: s
            .clone_htod(sums.initial_parameters())
            .map_err(cuda("clone_htod"))?,
        part: s.alloc_zeros(n).map_err(cuda("alloc"))?,
        flag: s.alloc_zeros(1).map_err(cuda("alloc"))?,
    };
    let version = nccl::get_nccl_version().map_err(nccl_err("ncclGetVersion"))?;
    emit(&format!(
        "rank {rank} ready world {} device {device} elements {n} seed {} nccl {version}",
        o.world, o.seed
    ));
    let mut k = 0u64;
    while o.steps.is_none_or(|last| k < last) {
        if k > 0 && o.interval_ms > 0 {
            std::thread::sleep(Duration::from_millis(o.interval_ms));
        }
        k += 1;
        step(o, rank, k, &sums, &world, &split, &s, &mut b)?;
        emit(&step_line(rank, k, sums.digest(k)));
    }
    drop(split);
    drop(world);
    Ok(())
}

/// The first mismatch of a step, as the line to print.
struct Verdict<'a> {
    sums: &'a Sums,
    rank: u32,
    k: u64,
    first: Option<String>,
}

impl Verdict<'_> {
    /// Reads `buf` back (after the stream's work) and checks it against `what`'s closed form.
    fn check(
        &mut self,
        s: &Arc<CudaStream>,
        buf: &CudaSlice<u32>,
        what: Buffer,
        k: u64,
    ) -> Result<Vec<u32>, Fail> {
        let host = s.clone_dtoh(buf).map_err(cuda("clone_dtoh"))?;
        if self.first.is_none() {
            if let Some(m) = self.sums.first_mismatch(what, k, &host) {
                self.first = Some(mismatch_line(self.rank, self.k, what, m));
            }
        }
        Ok(host)
    }
}

#[allow(clippy::too_many_arguments)]
fn step(
    o: &NcclOpts,
    rank: u32,
    k: u64,
    sums: &Sums,
    world: &Comm,
    split: &Comm,
    s: &Arc<CudaStream>,
    b: &mut Bufs,
) -> Result<(), Fail> {
    let mut v = Verdict {
        sums,
        rank,
        k,
        first: None,
    };
    // What step k-1 left on the device (catches a bad restore at once).
    let params = v.check(s, &b.params, Buffer::Parameters, k - 1)?;

    // Gradients: allreduce sum in place on the world communicator.
    s.memcpy_htod(&sums.gradient(k), &mut b.grad)
        .map_err(cuda("memcpy_htod"))?;
    world.all_reduce_sum(&mut b.grad, s)?;
    if o.corrupt.is_some_and(|(r, at, _)| r == rank && at == k) {
        let i = o.corrupt.map_or(0, |(_, _, i)| i);
        let mut w = s
            .clone_dtoh(&b.grad.slice(i..i + 1))
            .map_err(cuda("clone_dtoh"))?;
        w[0] ^= 1;
        s.memcpy_htod(&w, &mut b.grad.slice_mut(i..i + 1))
            .map_err(cuda("memcpy_htod"))?;
    }
    let grad = v.check(s, &b.grad, Buffer::Allreduce, k)?;

    // Rank 0 applies the update; the others' parameters come from the broadcast.
    let next: Vec<u32> = if rank == 0 {
        params
            .iter()
            .zip(&grad)
            .map(|(p, g)| p.wrapping_add(*g))
            .collect()
    } else {
        vec![0xdead_beef; params.len()]
    };
    s.memcpy_htod(&next, &mut b.params)
        .map_err(cuda("memcpy_htod"))?;
    world.broadcast(&mut b.params, 0, s)?;
    v.check(s, &b.params, Buffer::Broadcast, k)?;

    // The split communicator: ranks of the same parity.
    s.memcpy_htod(&sums.split_part(k), &mut b.part)
        .map_err(cuda("memcpy_htod"))?;
    split.all_reduce_sum(&mut b.part, s)?;
    v.check(s, &b.part, Buffer::Split, k)?;

    // How many ranks failed: every rank stops at the same step.
    s.memcpy_htod(&[u32::from(v.first.is_some())], &mut b.flag)
        .map_err(cuda("memcpy_htod"))?;
    world.all_reduce_sum(&mut b.flag, s)?;
    let failed = s.clone_dtoh(&b.flag).map_err(cuda("clone_dtoh"))?[0];
    if let Some(line) = v.first {
        return Err(Fail::Mismatch(line));
    }
    if failed != 0 {
        return Err(Fail::Other(format!(
            "step {k}: stopping: {failed} rank(s) failed verification"
        )));
    }
    Ok(())
}

/// The arguments of rank `rank` on GPU `device`, launched by this process.
fn rank_args(o: &NcclOpts, rank: u32, device: u32, dir: &Path) -> Vec<String> {
    let mut a: Vec<String> = vec![
        "--rank".into(),
        rank.to_string(),
        "--world-size".into(),
        o.world.to_string(),
        "--device".into(),
        device.to_string(),
        "--rendezvous".into(),
        dir.display().to_string(),
        "--elements".into(),
        o.elements.to_string(),
        "--interval-ms".into(),
        o.interval_ms.to_string(),
        "--seed".into(),
        o.seed.to_string(),
    ];
    if let Some(n) = o.steps {
        a.extend(["--steps".into(), n.to_string()]);
    }
    if let Some((r, k, i)) = o.corrupt {
        a.extend(["--corrupt".into(), format!("{r}:{k}:{i}")]);
    }
    a
}

/// Starts ranks `o.rank .. o.rank + n` as children, waits for them, stops them all when one
/// fails or this process is asked to stop.
fn launch(o: &NcclOpts, n: u32) -> Result<i32, Fail> {
    signals::install().map_err(|e| Fail::Other(format!("sigaction: {e}")))?;
    let exe = std::env::current_exe().map_err(|e| Fail::Other(format!("current_exe: {e}")))?;
    let private = o.rendezvous.is_none();
    let dir = match &o.rendezvous {
        Some(d) => PathBuf::from(d),
        None => std::env::temp_dir().join(format!("nccl-train-{}", std::process::id())),
    };
    if private {
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir)
            .map_err(|e| Fail::Other(format!("creating {}: {e}", dir.display())))?;
    }
    let mut children: Vec<(u32, Option<Child>)> = Vec::new();
    let mut status = 0;
    for i in 0..n {
        let r = o.rank + i;
        let device = o.device as u32 + i;
        match Command::new(&exe)
            .args(rank_args(o, r, device, &dir))
            .spawn()
        {
            Ok(c) => children.push((r, Some(c))),
            Err(e) => {
                emit(&format!("nccl-train: starting rank {r}: {e}"));
                status = 1;
                break;
            }
        }
    }
    let stop = |children: &[(u32, Option<Child>)]| {
        for c in children.iter().filter_map(|(_, c)| c.as_ref()) {
            // SAFETY: kill(2) on our own child's pid.
            unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        }
    };
    if status != 0 {
        stop(&children);
    }
    // A rank that fails stops the job: the others see it at the same step and exit on their
    // own; whoever is still there after GRACE (a rank stuck in a collective whose peer died)
    // gets SIGTERM.
    let mut stopping = status != 0;
    let mut failed_at: Option<Instant> = None;
    while children.iter().any(|(_, c)| c.is_some()) {
        let overdue = failed_at.is_some_and(|t| t.elapsed() > GRACE);
        if !stopping && (signals::stop_requested() || overdue) {
            stop(&children);
            stopping = true;
        }
        for (r, slot) in children.iter_mut() {
            let Some(c) = slot else { continue };
            let Ok(Some(st)) = c.try_wait() else { continue };
            *slot = None;
            if !st.success() && status == 0 {
                emit(&format!("nccl-train: rank {r} exited with {st}"));
                status = 1;
                failed_at = Some(Instant::now());
            }
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    if private {
        let _ = std::fs::remove_dir_all(&dir);
    }
    Ok(status)
}
