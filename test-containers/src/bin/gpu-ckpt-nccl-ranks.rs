//! `gpu-ckpt-nccl-ranks`: one rank of a multi-process NCCL job, as an application is one: it
//! loads `libcuda.so.1` and `libnccl.so.2` with dlopen (whichever the loader finds: the
//! simulated ones on a simulated node) and calls their C API, printing one JSON object per step
//! with what the collectives left in device memory (tests/integration/gpu_nccl.rs checks them).
//!
//! - `uid [--count N]`: N fresh unique ids (`ncclGetUniqueId`), hex, one per line.
//! - `rank --scenario all --rank R --nranks N --id HEX --id2 HEX`: every collective, send/receive
//!   in a group, a split, and two communicators (ids HEX and HEX2) used in opposite orders.
//! - `rank --scenario stuck ...`: an allreduce with the last rank holding back until a line on
//!   stdin: the others report their streams and events not ready, then finish when it comes.
//! - `single`: one process, two GPUs: `ncclCommInitAll` and a group of allreduces over its two
//!   communicators; two ranks made in one group from one thread, a broadcast between them; an
//!   allreduce rank 1 never joins, released by `ncclCommAbort`.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::io::BufRead;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Parser, Subcommand};
use serde_json::{json, Value};
use simgpu::nccl::{Config, UniqueId, API_MAGIC, CONFIG_UNDEF_INT, UNIQUE_ID_BYTES};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    Uid {
        #[arg(long, default_value_t = 1)]
        count: usize,
    },
    Rank {
        #[arg(long)]
        scenario: String,
        #[arg(long)]
        rank: i32,
        #[arg(long)]
        nranks: i32,
        #[arg(long)]
        id: String,
        #[arg(long)]
        id2: Option<String>,
        /// The CUDA device ordinal of this rank.
        #[arg(long, default_value_t = 0)]
        device: i32,
    },
    Single,
}

type Fp = *mut c_void;

/// A library opened with dlopen and its symbols.
struct Lib {
    handle: *mut c_void,
    name: &'static str,
}

impl Lib {
    fn open(name: &'static str) -> Result<Lib> {
        let c = CString::new(name)?;
        // SAFETY: dlopen with a NUL-terminated name.
        let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW) };
        if handle.is_null() {
            // SAFETY: dlerror's message is NUL-terminated.
            let e = unsafe { CStr::from_ptr(libc::dlerror()) };
            bail!("dlopen {name}: {}", e.to_string_lossy());
        }
        Ok(Lib { handle, name })
    }

    fn sym(&self, s: &str) -> Result<Fp> {
        let c = CString::new(s)?;
        // SAFETY: a live handle and a NUL-terminated name.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        if p.is_null() {
            bail!("{} has no {s}", self.name);
        }
        Ok(p)
    }
}

/// Calls symbol `$name` of `$lib` with the C signature `fn($($t),*) -> c_uint`.
macro_rules! call {
    ($lib:expr, $name:expr, ($($t:ty),*) $(, $a:expr)*) => {{
        let f: unsafe extern "C" fn($($t),*) -> c_uint =
            // SAFETY: the symbol's C signature is the one given (cuda.h, nccl.h).
            unsafe { std::mem::transmute::<Fp, _>($lib.sym($name)?) };
        // SAFETY: arguments as the API documents.
        unsafe { f($($a),*) }
    }};
}

struct Api {
    cuda: Lib,
    nccl: Lib,
}

const NCCL_INT32: c_int = 2;
const NCCL_SUM: c_int = 0;

/// The data types the scenario reduces: (nccl.h value, name, element size).
const TYPES: &[(c_int, &str, usize)] = &[
    (1, "uint8", 1),
    (2, "int32", 4),
    (4, "int64", 8),
    (6, "float16", 2),
    (7, "float32", 4),
    (8, "float64", 8),
    (9, "bfloat16", 2),
];

fn encode(name: &str, v: &[f64]) -> Vec<u8> {
    v.iter()
        .flat_map(|x| match name {
            "uint8" => vec![*x as u8],
            "int32" => (*x as i32).to_le_bytes().to_vec(),
            "int64" => (*x as i64).to_le_bytes().to_vec(),
            "float16" => half::f16::from_f64(*x).to_le_bytes().to_vec(),
            "bfloat16" => half::bf16::from_f64(*x).to_le_bytes().to_vec(),
            "float32" => (*x as f32).to_le_bytes().to_vec(),
            _ => x.to_le_bytes().to_vec(),
        })
        .collect()
}

fn decode(name: &str, b: &[u8]) -> Vec<f64> {
    let size = TYPES.iter().find(|t| t.1 == name).map_or(8, |t| t.2);
    b.chunks_exact(size)
        .map(|c| match name {
            "uint8" => f64::from(c[0]),
            "int32" => f64::from(i32::from_le_bytes(c.try_into().unwrap_or_default())),
            "int64" => i64::from_le_bytes(c.try_into().unwrap_or_default()) as f64,
            "float16" => half::f16::from_le_bytes([c[0], c[1]]).to_f64(),
            "bfloat16" => half::bf16::from_le_bytes([c[0], c[1]]).to_f64(),
            "float32" => f64::from(f32::from_le_bytes(c.try_into().unwrap_or_default())),
            _ => f64::from_le_bytes(c.try_into().unwrap_or_default()),
        })
        .collect()
}

fn emit(v: Value) {
    println!("{v}");
}

impl Api {
    fn cu(&self, what: &str, rc: c_uint) -> Result<()> {
        if rc != 0 {
            bail!("{what}: CUresult {rc}");
        }
        Ok(())
    }

    fn nc(&self, what: &str, rc: c_uint) -> Result<()> {
        if rc != 0 {
            let f: unsafe extern "C" fn(c_uint) -> *const c_char =
                // SAFETY: nccl.h's signature of ncclGetErrorString.
                unsafe { std::mem::transmute::<Fp, _>(self.nccl.sym("ncclGetErrorString")?) };
            // SAFETY: a static NUL-terminated string.
            let s = unsafe { CStr::from_ptr(f(rc)) }
                .to_string_lossy()
                .into_owned();
            bail!("{what}: ncclResult {rc} ({s})");
        }
        Ok(())
    }

    fn init_device(&self, dev: c_int) -> Result<()> {
        self.cu("cuInit", call!(self.cuda, "cuInit", (c_uint), 0))?;
        let mut ctx: Fp = std::ptr::null_mut();
        self.cu(
            "cuDevicePrimaryCtxRetain",
            call!(
                self.cuda,
                "cuDevicePrimaryCtxRetain",
                (*mut Fp, c_int),
                &mut ctx,
                dev
            ),
        )?;
        self.cu(
            "cuCtxSetCurrent",
            call!(self.cuda, "cuCtxSetCurrent", (Fp), ctx),
        )
    }

    fn alloc(&self, bytes: usize) -> Result<u64> {
        let mut p = 0u64;
        self.cu(
            "cuMemAlloc",
            call!(
                self.cuda,
                "cuMemAlloc_v2",
                (*mut u64, usize),
                &mut p,
                bytes.max(1)
            ),
        )?;
        Ok(p)
    }

    fn put(&self, dst: u64, b: &[u8]) -> Result<()> {
        self.cu(
            "cuMemcpyHtoD",
            call!(
                self.cuda,
                "cuMemcpyHtoD_v2",
                (u64, *const c_void, usize),
                dst,
                b.as_ptr().cast(),
                b.len()
            ),
        )
    }

    /// Copies `len` bytes back on `stream` (behind the collective) and waits for the stream.
    fn get(&self, src: u64, len: usize, stream: Fp) -> Result<Vec<u8>> {
        let mut b = vec![0u8; len];
        self.cu(
            "cuMemcpyDtoHAsync",
            call!(
                self.cuda,
                "cuMemcpyDtoHAsync_v2",
                (*mut c_void, u64, usize, Fp),
                b.as_mut_ptr().cast(),
                src,
                len,
                stream
            ),
        )?;
        self.sync(stream)?;
        Ok(b)
    }

    fn sync(&self, stream: Fp) -> Result<()> {
        self.cu(
            "cuStreamSynchronize",
            call!(self.cuda, "cuStreamSynchronize", (Fp), stream),
        )
    }

    fn stream(&self) -> Result<Fp> {
        let mut s: Fp = std::ptr::null_mut();
        self.cu(
            "cuStreamCreate",
            call!(self.cuda, "cuStreamCreate", (*mut Fp, c_uint), &mut s, 0),
        )?;
        Ok(s)
    }

    fn unique_id(&self) -> Result<UniqueId> {
        let mut id = UniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        self.nc(
            "ncclGetUniqueId",
            call!(self.nccl, "ncclGetUniqueId", (*mut UniqueId), &mut id),
        )?;
        Ok(id)
    }

    fn init(&self, id: UniqueId, nranks: c_int, rank: c_int) -> Result<Fp> {
        let mut comm: Fp = std::ptr::null_mut();
        self.nc(
            "ncclCommInitRank",
            call!(
                self.nccl,
                "ncclCommInitRank",
                (*mut Fp, c_int, UniqueId, c_int),
                &mut comm,
                nranks,
                id,
                rank
            ),
        )?;
        Ok(comm)
    }

    /// A non-blocking communicator (`blocking = 0`), waited for with ncclCommGetAsyncError.
    fn init_nonblocking(&self, id: UniqueId, nranks: c_int, rank: c_int) -> Result<(Fp, c_uint)> {
        let mut cfg = Config {
            size: std::mem::size_of::<Config>(),
            magic: API_MAGIC,
            version: 23206,
            blocking: 0,
            cgaClusterSize: CONFIG_UNDEF_INT,
            minCTAs: CONFIG_UNDEF_INT,
            maxCTAs: CONFIG_UNDEF_INT,
            netName: std::ptr::null(),
            splitShare: CONFIG_UNDEF_INT,
            trafficClass: CONFIG_UNDEF_INT,
            commName: std::ptr::null(),
            collnetEnable: CONFIG_UNDEF_INT,
            CTAPolicy: CONFIG_UNDEF_INT,
            shrinkShare: CONFIG_UNDEF_INT,
            nvlsCTAs: CONFIG_UNDEF_INT,
            nChannelsPerNetPeer: CONFIG_UNDEF_INT,
            nvlinkCentricSched: CONFIG_UNDEF_INT,
            graphUsageMode: CONFIG_UNDEF_INT,
            numRmaCtx: CONFIG_UNDEF_INT,
            maxP2pPeers: CONFIG_UNDEF_INT,
            graphStreamOrdering: CONFIG_UNDEF_INT,
            launchOrderImplicit: CONFIG_UNDEF_INT,
            numRmaSig: CONFIG_UNDEF_INT,
            rmaEagerInit: CONFIG_UNDEF_INT,
            hostCftMode: CONFIG_UNDEF_INT,
            nvlsHostMode: CONFIG_UNDEF_INT,
        };
        let mut comm: Fp = std::ptr::null_mut();
        let rc = call!(
            self.nccl,
            "ncclCommInitRankConfig",
            (*mut Fp, c_int, UniqueId, c_int, *mut Config),
            &mut comm,
            nranks,
            id,
            rank,
            &mut cfg
        );
        if rc != 0 && rc != 7 {
            self.nc("ncclCommInitRankConfig", rc)?;
        }
        loop {
            let mut e: c_uint = 0;
            self.nc(
                "ncclCommGetAsyncError",
                call!(
                    self.nccl,
                    "ncclCommGetAsyncError",
                    (Fp, *mut c_uint),
                    comm,
                    &mut e
                ),
            )?;
            match e {
                0 => return Ok((comm, rc)),
                7 => std::thread::sleep(Duration::from_millis(10)),
                e => self.nc("communicator initialization", e)?,
            }
        }
    }

    fn info(&self, comm: Fp) -> Result<(c_int, c_int, c_int)> {
        let (mut n, mut r, mut d) = (0, 0, 0);
        self.nc(
            "ncclCommCount",
            call!(self.nccl, "ncclCommCount", (Fp, *mut c_int), comm, &mut n),
        )?;
        self.nc(
            "ncclCommUserRank",
            call!(
                self.nccl,
                "ncclCommUserRank",
                (Fp, *mut c_int),
                comm,
                &mut r
            ),
        )?;
        self.nc(
            "ncclCommCuDevice",
            call!(
                self.nccl,
                "ncclCommCuDevice",
                (Fp, *mut c_int),
                comm,
                &mut d
            ),
        )?;
        Ok((n, r, d))
    }

    /// Collective `name` from `bufs.0` into `bufs.1`, each call with the arguments nccl.h gives it
    /// (`op` where it reduces, `root` where it has one).
    #[allow(clippy::too_many_arguments)] // a collective's arguments
    #[rustfmt::skip]
    fn coll(&self, name: &str, bufs: (u64, u64), count: usize, dt: c_int, op: c_int, root: c_int, comm: Fp, s: Fp) -> Result<()> {
        let (send, recv) = bufs;
        let rc = match name {
            "ncclAllReduce" | "ncclReduceScatter" => call!(self.nccl, name, (u64, u64, usize, c_int, c_int, Fp, Fp), send, recv, count, dt, op, comm, s),
            "ncclBroadcast" => call!(self.nccl, name, (u64, u64, usize, c_int, c_int, Fp, Fp), send, recv, count, dt, root, comm, s),
            "ncclReduce" => call!(self.nccl, name, (u64, u64, usize, c_int, c_int, c_int, Fp, Fp), send, recv, count, dt, op, root, comm, s),
            // ncclAllGather, ncclAlltoAll
            _ => call!(self.nccl, name, (u64, u64, usize, c_int, Fp, Fp), send, recv, count, dt, comm, s),
        };
        self.nc(name, rc)
    }

    fn allreduce(
        &self,
        bufs: (u64, u64),
        count: usize,
        dt: c_int,
        op: c_int,
        comm: Fp,
        s: Fp,
    ) -> Result<()> {
        self.coll("ncclAllReduce", bufs, count, dt, op, 0, comm, s)
    }
}

/// Device memory holding `data`, and an output buffer of `out` bytes.
fn buffers(api: &Api, data: &[u8], out: usize) -> Result<(u64, u64)> {
    let send = api.alloc(data.len())?;
    api.put(send, data)?;
    Ok((send, api.alloc(out)?))
}

fn parse_id(hex: &str) -> Result<UniqueId> {
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<std::result::Result<_, _>>()
        .context("unique id hex")?;
    if bytes.len() != UNIQUE_ID_BYTES {
        bail!(
            "a unique id is {UNIQUE_ID_BYTES} bytes, got {}",
            bytes.len()
        );
    }
    let mut id = UniqueId {
        internal: [0; UNIQUE_ID_BYTES],
    };
    for (d, s) in id.internal.iter_mut().zip(bytes) {
        *d = s as c_char;
    }
    Ok(id)
}

fn hex(id: &UniqueId) -> String {
    id.internal
        .iter()
        .map(|b| format!("{:02x}", *b as u8))
        .collect()
}

/// Every collective on a communicator of `n` ranks, each result printed.
fn all(api: &Api, rank: c_int, n: c_int, id: UniqueId, id2: UniqueId) -> Result<()> {
    let (comm, init_rc) = api.init_nonblocking(id, n, rank)?;
    let (count, user_rank, device) = api.info(comm)?;
    emit(
        json!({"step": "init", "init_rc": init_rc, "count": count, "rank": user_rank, "device": device}),
    );
    let s = api.stream()?;
    let r = f64::from(rank);
    let nu = n as usize;
    // allreduce sum of each type: x[i] = rank + i + 1
    for (dt, name, size) in TYPES {
        let x: Vec<f64> = (0..5).map(|i| r + f64::from(i) + 1.0).collect();
        let (send, recv) = buffers(api, &encode(name, &x), 5 * size)?;
        api.allreduce((send, recv), 5, *dt, NCCL_SUM, comm, s)?;
        let out = decode(name, &api.get(recv, 5 * size, s)?);
        emit(json!({"step": "allreduce", "dtype": name, "op": "sum", "out": out}));
    }
    // max of float32 (x[i] = 2 rank - i), avg of float64 (x[i] = rank + i)
    for (op, opname, dt, name, f) in [
        (
            2,
            "max",
            7,
            "float32",
            (|r: f64, i: f64| 2.0 * r - i) as fn(f64, f64) -> f64,
        ),
        (4, "avg", 8, "float64", |r: f64, i: f64| r + i),
    ] {
        let x: Vec<f64> = (0..4).map(|i| f(r, f64::from(i))).collect();
        let b = encode(name, &x);
        let (send, recv) = buffers(api, &b, b.len())?;
        api.allreduce((send, recv), 4, dt, op, comm, s)?;
        let out = decode(name, &api.get(recv, b.len(), s)?);
        emit(json!({"step": "allreduce", "dtype": name, "op": opname, "out": out}));
    }
    // in place, int32: x[i] = 3 rank + i
    let x: Vec<f64> = (0..4).map(|i| 3.0 * r + f64::from(i)).collect();
    let buf = buffers(api, &encode("int32", &x), 0)?.0;
    api.allreduce((buf, buf), 4, NCCL_INT32, NCCL_SUM, comm, s)?;
    let out = decode("int32", &api.get(buf, 16, s)?);
    emit(json!({"step": "allreduce_inplace", "out": out}));
    // broadcast from rank 2, float32: x[i] = 100 rank + i
    let x: Vec<f64> = (0..4).map(|i| 100.0 * r + f64::from(i)).collect();
    let (send, recv) = buffers(api, &encode("float32", &x), 16)?;
    api.coll("ncclBroadcast", (send, recv), 4, 7, 0, 2, comm, s)?;
    emit(json!({"step": "broadcast", "root": 2, "out": decode("float32", &api.get(recv, 16, s)?)}));
    // reduce to rank 1, int32 sum: x[i] = 7 rank + i
    let x: Vec<f64> = (0..4).map(|i| 7.0 * r + f64::from(i)).collect();
    let (send, recv) = buffers(api, &encode("int32", &x), 16)?;
    api.coll(
        "ncclReduce",
        (send, recv),
        4,
        NCCL_INT32,
        NCCL_SUM,
        1,
        comm,
        s,
    )?;
    let out = decode("int32", &api.get(recv, 16, s)?);
    emit(
        json!({"step": "reduce", "root": 1, "out": if rank == 1 { json!(out) } else { Value::Null }}),
    );
    // allgather of 3 int32: x[i] = 10 rank + i
    let x: Vec<f64> = (0..3).map(|i| 10.0 * r + f64::from(i)).collect();
    let (send, recv) = buffers(api, &encode("int32", &x), 12 * nu)?;
    api.coll("ncclAllGather", (send, recv), 3, NCCL_INT32, 0, 0, comm, s)?;
    emit(json!({"step": "allgather", "out": decode("int32", &api.get(recv, 12 * nu, s)?)}));
    // reducescatter, 2 float32 per rank: x[i] = 8 rank + i over 2 n elements
    let x: Vec<f64> = (0..2 * n).map(|i| 8.0 * r + f64::from(i)).collect();
    let (send, recv) = buffers(api, &encode("float32", &x), 8)?;
    api.coll(
        "ncclReduceScatter",
        (send, recv),
        2,
        7,
        NCCL_SUM,
        0,
        comm,
        s,
    )?;
    emit(json!({"step": "reducescatter", "out": decode("float32", &api.get(recv, 8, s)?)}));
    // alltoall, 1 int32 per peer: x[j] = 10 rank + j
    let x: Vec<f64> = (0..n).map(|j| 10.0 * r + f64::from(j)).collect();
    let (send, recv) = buffers(api, &encode("int32", &x), 4 * nu)?;
    api.coll("ncclAlltoAll", (send, recv), 1, NCCL_INT32, 0, 0, comm, s)?;
    emit(json!({"step": "alltoall", "out": decode("int32", &api.get(recv, 4 * nu, s)?)}));
    // a ring of sends and receives in one group, int64: x[i] = 1000 rank + i
    let x: Vec<f64> = (0..4).map(|i| 1000.0 * r + f64::from(i)).collect();
    let (send, recv) = buffers(api, &encode("int64", &x), 32)?;
    let (next, prev) = ((rank + 1) % n, (rank + n - 1) % n);
    api.nc("ncclGroupStart", call!(api.nccl, "ncclGroupStart", ()))?;
    api.nc(
        "ncclSend",
        call!(
            api.nccl,
            "ncclSend",
            (u64, usize, c_int, c_int, Fp, Fp),
            send,
            4,
            4,
            next,
            comm,
            s
        ),
    )?;
    api.nc(
        "ncclRecv",
        call!(
            api.nccl,
            "ncclRecv",
            (u64, usize, c_int, c_int, Fp, Fp),
            recv,
            4,
            4,
            prev,
            comm,
            s
        ),
    )?;
    api.nc("ncclGroupEnd", call!(api.nccl, "ncclGroupEnd", ()))?;
    emit(json!({"step": "sendrecv", "from": prev, "out": decode("int64", &api.get(recv, 32, s)?)}));
    // split by parity, ranks reversed by key: allreduce of [rank] on the new communicator
    let mut sub: Fp = std::ptr::null_mut();
    api.nc(
        "ncclCommSplit",
        call!(
            api.nccl,
            "ncclCommSplit",
            (Fp, c_int, c_int, *mut Fp, *mut Config),
            comm,
            rank % 2,
            -rank,
            &mut sub,
            std::ptr::null_mut()
        ),
    )?;
    let (scount, srank, _) = api.info(sub)?;
    let (send, recv) = buffers(api, &encode("int32", &[r]), 4)?;
    api.allreduce((send, recv), 1, NCCL_INT32, NCCL_SUM, sub, s)?;
    emit(
        json!({"step": "split", "color": rank % 2, "count": scount, "rank": srank, "out": decode("int32", &api.get(recv, 4, s)?)}),
    );
    // two communicators of two ids, called in opposite orders by even and odd ranks, each on a
    // stream of its own: A sums rank + 1, B sums 100 (rank + 1)
    let comm_b = api.init(id2, n, rank)?;
    let (sa, sb) = (api.stream()?, api.stream()?);
    let (a_send, a_recv) = buffers(api, &encode("int32", &[r + 1.0; 3]), 12)?;
    let (b_send, b_recv) = buffers(api, &encode("int32", &[100.0 * (r + 1.0); 3]), 12)?;
    let a = || api.allreduce((a_send, a_recv), 3, NCCL_INT32, NCCL_SUM, comm, sa);
    let b = || api.allreduce((b_send, b_recv), 3, NCCL_INT32, NCCL_SUM, comm_b, sb);
    if rank % 2 == 0 {
        a()?;
        b()?;
    } else {
        b()?;
        a()?;
    }
    let out_a = decode("int32", &api.get(a_recv, 12, sa)?);
    let out_b = decode("int32", &api.get(b_recv, 12, sb)?);
    emit(json!({"step": "two_comms", "a": out_a, "b": out_b}));
    let mut e: c_uint = 99;
    api.nc(
        "ncclCommGetAsyncError",
        call!(
            api.nccl,
            "ncclCommGetAsyncError",
            (Fp, *mut c_uint),
            comm,
            &mut e
        ),
    )?;
    emit(json!({"step": "async_error", "error": e}));
    for c in [sub, comm_b, comm] {
        api.nc(
            "ncclCommFinalize",
            call!(api.nccl, "ncclCommFinalize", (Fp), c),
        )?;
        api.nc(
            "ncclCommDestroy",
            call!(api.nccl, "ncclCommDestroy", (Fp), c),
        )?;
    }
    Ok(())
}

/// Device `dev`'s context made current, and a stream, input and output buffers of 4 int32 there.
fn on_device(api: &Api, dev: c_int, x: f64) -> Result<(Fp, u64, u64)> {
    api.init_device(dev)?;
    let s = api.stream()?;
    let (send, recv) = buffers(api, &encode("int32", &[x; 4]), 16)?;
    Ok((s, send, recv))
}

/// One process driving two GPUs.
fn single(api: &Api) -> Result<()> {
    // ncclCommInitAll, and one group of an allreduce per communicator, each on its device.
    let mut comms: [Fp; 2] = [std::ptr::null_mut(); 2];
    api.nc(
        "ncclCommInitAll",
        call!(
            api.nccl,
            "ncclCommInitAll",
            (*mut Fp, c_int, *const c_int),
            comms.as_mut_ptr(),
            2,
            std::ptr::null()
        ),
    )?;
    let mut bufs = Vec::new();
    for (i, c) in comms.iter().enumerate() {
        let (n, r, d) = api.info(*c)?;
        emit(json!({"step": "init_all", "count": n, "rank": r, "device": d}));
        bufs.push(on_device(api, i as c_int, i as f64 + 1.0)?);
    }
    api.nc("ncclGroupStart", call!(api.nccl, "ncclGroupStart", ()))?;
    for (c, (s, send, recv)) in comms.iter().zip(&bufs) {
        api.allreduce((*send, *recv), 4, NCCL_INT32, NCCL_SUM, *c, *s)?;
    }
    api.nc("ncclGroupEnd", call!(api.nccl, "ncclGroupEnd", ()))?;
    for (i, (s, _, recv)) in bufs.iter().enumerate() {
        api.init_device(i as c_int)?;
        emit(json!({"step": "group_allreduce", "out": decode("int32", &api.get(*recv, 16, *s)?)}));
    }
    for c in comms {
        api.nc(
            "ncclCommDestroy",
            call!(api.nccl, "ncclCommDestroy", (Fp), c),
        )?;
    }
    // Two ranks made in one group by one thread, then a broadcast from rank 1 in a group.
    let id = api.unique_id()?;
    let mut ranks: [Fp; 2] = [std::ptr::null_mut(); 2];
    api.nc("ncclGroupStart", call!(api.nccl, "ncclGroupStart", ()))?;
    for (i, c) in ranks.iter_mut().enumerate() {
        api.init_device(i as c_int)?;
        api.nc(
            "ncclCommInitRank",
            call!(
                api.nccl,
                "ncclCommInitRank",
                (*mut Fp, c_int, UniqueId, c_int),
                c,
                2,
                id,
                i as c_int
            ),
        )?;
    }
    api.nc("ncclGroupEnd", call!(api.nccl, "ncclGroupEnd", ()))?;
    api.nc("ncclGroupStart", call!(api.nccl, "ncclGroupStart", ()))?;
    for (i, (c, (s, send, recv))) in ranks.iter().zip(&bufs).enumerate() {
        let (_, r, d) = api.info(*c)?;
        emit(json!({"step": "group_init", "rank": r, "device": d, "index": i}));
        api.coll("ncclBroadcast", (*send, *recv), 4, NCCL_INT32, 0, 1, *c, *s)?;
    }
    api.nc("ncclGroupEnd", call!(api.nccl, "ncclGroupEnd", ()))?;
    for (i, (s, _, recv)) in bufs.iter().enumerate() {
        api.init_device(i as c_int)?;
        emit(json!({"step": "group_broadcast", "out": decode("int32", &api.get(*recv, 16, *s)?)}));
    }
    // Rank 0 alone: its stream waits for rank 1 until rank 0 aborts the communicator.
    let (s0, send0, recv0) = bufs[0];
    api.init_device(0)?;
    api.allreduce((send0, recv0), 4, NCCL_INT32, NCCL_SUM, ranks[0], s0)?;
    std::thread::sleep(Duration::from_millis(300));
    let before = call!(api.cuda, "cuStreamQuery", (Fp), s0);
    api.nc(
        "ncclCommAbort",
        call!(api.nccl, "ncclCommAbort", (Fp), ranks[0]),
    )?;
    api.sync(s0)?;
    let after = call!(api.cuda, "cuStreamQuery", (Fp), s0);
    emit(json!({"step": "abort", "before": before, "after": after}));
    api.nc(
        "ncclCommDestroy",
        call!(api.nccl, "ncclCommDestroy", (Fp), ranks[1]),
    )?;
    Ok(())
}

/// An allreduce whose last rank holds back until a line on stdin.
fn stuck(api: &Api, rank: c_int, n: c_int, id: UniqueId) -> Result<()> {
    let comm = api.init(id, n, rank)?;
    let s = api.stream()?;
    let (send, recv) = buffers(api, &encode("int32", &[f64::from(rank + 1); 4]), 16)?;
    if rank == n - 1 {
        emit(json!({"step": "holding"}));
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line)?;
        api.allreduce((send, recv), 4, NCCL_INT32, NCCL_SUM, comm, s)?;
    } else {
        api.allreduce((send, recv), 4, NCCL_INT32, NCCL_SUM, comm, s)?;
        let mut ev: Fp = std::ptr::null_mut();
        api.cu(
            "cuEventCreate",
            call!(api.cuda, "cuEventCreate", (*mut Fp, c_uint), &mut ev, 0),
        )?;
        api.cu(
            "cuEventRecord",
            call!(api.cuda, "cuEventRecord", (Fp, Fp), ev, s),
        )?;
        std::thread::sleep(Duration::from_millis(500));
        let q = call!(api.cuda, "cuStreamQuery", (Fp), s);
        let e = call!(api.cuda, "cuEventQuery", (Fp), ev);
        emit(json!({"step": "pending", "stream_query": q, "event_query": e}));
    }
    let out = decode("int32", &api.get(recv, 16, s)?);
    emit(json!({"step": "allreduce", "out": out}));
    Ok(())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let api = Api {
        cuda: Lib::open("libcuda.so.1")?,
        nccl: Lib::open("libnccl.so.2")?,
    };
    match args.cmd {
        Cmd::Uid { count } => {
            for _ in 0..count {
                println!("{}", hex(&api.unique_id()?));
            }
        }
        Cmd::Single => {
            single(&api)?;
            emit(json!({"done": true}));
        }
        Cmd::Rank {
            scenario,
            rank,
            nranks,
            id,
            id2,
            device,
        } => {
            api.init_device(device)?;
            let id = parse_id(&id)?;
            match scenario.as_str() {
                "all" => {
                    let id2 = parse_id(&id2.ok_or_else(|| anyhow!("--id2 is needed"))?)?;
                    all(&api, rank, nranks, id, id2)?;
                }
                "stuck" => stuck(&api, rank, nranks, id)?,
                s => bail!("no scenario {s}"),
            }
            emit(json!({"done": true}));
        }
    }
    Ok(())
}
