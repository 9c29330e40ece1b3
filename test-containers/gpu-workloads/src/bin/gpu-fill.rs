//! gpu-fill: puts a seeded pattern into device memory, then waits; verifies it on SIGUSR1.
//!
//! Prints `filled <bytes> bytes on <n> GPUs` (bytes summed over the GPUs), then on each SIGUSR1
//! `verified <bytes> bytes` or `MISMATCH device <d> offset <o>` (and exits 1). Before those (and
//! after `filled`), `--show-uuids` adds `device <d> uuid <uuid>` for each GPU it filled, and
//! `--show-ordinals` adds `devices <n>` (cuDeviceGetCount) and `ordinal <i> uuid <uuid>` for every
//! ordinal it sees. SIGTERM and SIGINT exit 0. `--verify-and-exit` verifies once right after
//! filling and exits. `--tick-ms MS`: after filling, every MS milliseconds one driver call (a
//! 4-byte cuMemcpyDtoH from the first GPU's memory, which waits while the process is locked for a
//! checkpoint) and then `tick <n>`, so the gaps between ticks show how long the process could not
//! use its GPU.

use std::time::{Duration, Instant};

use gpu_ckpt_gpu_workloads::cli::{FillOpts, FILL_USAGE};
use gpu_ckpt_gpu_workloads::driver::{
    format_uuid, u32_bytes, u32_bytes_mut, CuDevicePtr, Driver, Gpu,
};
use gpu_ckpt_gpu_workloads::fill::{self, Kind, Plan};
use gpu_ckpt_gpu_workloads::{emit, signals, Fail};

struct Dev {
    gpu: Gpu,
    allocs: Vec<CuDevicePtr>,
}

fn main() {
    gpu_ckpt_gpu_workloads::main("gpu-fill", FILL_USAGE, run);
}

fn run(args: &[String]) -> Result<i32, Fail> {
    let o = FillOpts::parse(args).map_err(Fail::Usage)?;
    if o.bytes % 4 != 0 {
        return Err(Fail::Usage("size must be a multiple of 4 bytes".into()));
    }
    signals::install().map_err(|e| Fail::Other(format!("sigaction: {e}")))?;
    let (driver, ordinals) = gpu_ckpt_gpu_workloads::open_devices(&o.devices)?;
    let plan = Plan::new(o.bytes);
    let chunk_words = (plan.chunk_bytes.min(plan.bytes) / 4) as usize;
    let mut host = vec![0u32; chunk_words];
    let mut want = vec![0u32; chunk_words];

    let mut devs = Vec::new();
    for &ord in &ordinals {
        let gpu = Gpu::open(&driver, ord)?;
        let mut allocs = Vec::new();
        for size in plan.allocs() {
            allocs.push(driver.mem_alloc(size as usize)?);
        }
        let dev = Dev { gpu, allocs };
        fill_device(&driver, &dev, &plan, o.seed, &mut host)?;
        devs.push(dev);
    }
    for d in &devs {
        d.gpu.select(&driver)?;
        driver.ctx_synchronize()?;
    }
    let total = plan.bytes * devs.len() as u64;
    emit(&format!("filled {total} bytes on {} GPUs", devs.len()));
    if o.show_uuids {
        show_uuids(&driver, &devs)?;
    }
    if o.show_ordinals {
        show_ordinals(&driver)?;
    }

    if o.verify_and_exit {
        return verify_all(&driver, &devs, &plan, o.seed, &mut host, &mut want);
    }
    let idle = Duration::from_millis(20);
    let tick = o.tick_ms.map(Duration::from_millis);
    let mut ticks = 0u64;
    let mut next_tick = Instant::now();
    // The ticks read the first GPU's memory: its context is current between verifications.
    devs[0].gpu.select(&driver)?;
    loop {
        if signals::stop_requested() {
            return Ok(0);
        }
        if signals::take_verify() {
            if o.show_uuids {
                show_uuids(&driver, &devs)?;
            }
            if o.show_ordinals {
                show_ordinals(&driver)?;
            }
            let code = verify_all(&driver, &devs, &plan, o.seed, &mut host, &mut want)?;
            if code != 0 {
                return Ok(code);
            }
            devs[0].gpu.select(&driver)?;
        }
        let Some(every) = tick else {
            std::thread::sleep(idle);
            continue;
        };
        if Instant::now() >= next_tick {
            tick_once(&driver, &devs[0])?;
            ticks += 1;
            emit(&format!("tick {ticks}"));
            // After a stall (a checkpoint held the call) the next tick comes one period on; the
            // missed ones are not made up.
            let after = Instant::now();
            next_tick += every;
            if next_tick <= after {
                next_tick = after + every;
            }
        }
        std::thread::sleep(
            next_tick
                .saturating_duration_since(Instant::now())
                .min(idle),
        );
    }
}

/// One driver call on device `d` (current): its first word copied to the host.
fn tick_once(driver: &Driver, d: &Dev) -> Result<(), Fail> {
    let mut word = [0u32; 1];
    driver.memcpy_dtoh(u32_bytes_mut(&mut word), d.allocs[0])?;
    Ok(())
}

fn show_uuids(driver: &Driver, devs: &[Dev]) -> Result<(), Fail> {
    for d in devs {
        let u = driver.device_uuid(d.gpu.dev)?;
        emit(&format!(
            "device {} uuid {}",
            d.gpu.ordinal,
            format_uuid(&u)
        ));
    }
    Ok(())
}

/// `devices <n>` (cuDeviceGetCount), then `ordinal <i> uuid <uuid>` for each ordinal.
fn show_ordinals(driver: &Driver) -> Result<(), Fail> {
    let n = driver.device_count()?;
    emit(&format!("devices {n}"));
    for i in 0..n {
        let u = driver.device_uuid(driver.device_get(i)?)?;
        emit(&format!("ordinal {i} uuid {}", format_uuid(&u)));
    }
    Ok(())
}

fn fill_device(
    driver: &Driver,
    d: &Dev,
    plan: &Plan,
    seed: u64,
    host: &mut [u32],
) -> Result<(), Fail> {
    let ord = d.gpu.ordinal as u32;
    d.gpu.select(driver)?;
    for c in plan.chunks() {
        let ptr = d.allocs[c.alloc] + c.alloc_offset;
        let words = (c.bytes / 4) as usize;
        match fill::kind(seed, ord, c.index) {
            Kind::Memset(v) => driver.memset_d32(ptr, v, words)?,
            Kind::Words => {
                let buf = &mut host[..words];
                fill::expected(seed, ord, &c, buf);
                driver.memcpy_htod(ptr, u32_bytes(buf))?;
            }
        }
    }
    Ok(())
}

fn verify_all(
    driver: &Driver,
    devs: &[Dev],
    plan: &Plan,
    seed: u64,
    host: &mut [u32],
    want: &mut [u32],
) -> Result<i32, Fail> {
    for d in devs {
        let ord = d.gpu.ordinal as u32;
        d.gpu.select(driver)?;
        for c in plan.chunks() {
            let words = (c.bytes / 4) as usize;
            let (got, exp) = (&mut host[..words], &mut want[..words]);
            got.fill(!0);
            driver.memcpy_dtoh(u32_bytes_mut(got), d.allocs[c.alloc] + c.alloc_offset)?;
            fill::expected(seed, ord, &c, exp);
            if let Some(off) = fill::first_mismatch(got, exp) {
                emit(&format!(
                    "MISMATCH device {} offset {}",
                    d.gpu.ordinal,
                    c.offset + off
                ));
                return Ok(1);
            }
        }
    }
    emit(&format!(
        "verified {} bytes",
        plan.bytes * devs.len() as u64
    ));
    Ok(0)
}
