//! gpu-train: a training-like loop whose state lives only in device memory.
//!
//! Each step k, per device: read the state back, advance it on the host by the rule in
//! `train::Rule`, write it back (async HtoD on a stream into a scratch buffer, then DtoD into the
//! state buffer), read it back again and compare every element with the closed form for k.
//! Prints `step <k> checksum <hex>`; on a mismatch prints
//! `MISMATCH step <k> device <d> element <i> got <x> want <y>` and exits 1.

use std::time::Duration;

use gpu_ckpt_gpu_workloads::cli::{TrainOpts, TRAIN_USAGE};
use gpu_ckpt_gpu_workloads::driver::{
    u32_bytes, u32_bytes_mut, CuDevicePtr, Driver, Gpu, Stream, CU_STREAM_NON_BLOCKING,
};
use gpu_ckpt_gpu_workloads::train::{Checksum, Rule};
use gpu_ckpt_gpu_workloads::{emit, Fail};

struct Dev {
    gpu: Gpu,
    rule: Rule,
    state: CuDevicePtr,
    scratch: CuDevicePtr,
    stream: Stream,
}

const POISON: u32 = 0xdead_beef;

fn main() {
    gpu_ckpt_gpu_workloads::main("gpu-train", TRAIN_USAGE, |args| run(args).map(|()| 0));
}

fn run(args: &[String]) -> Result<(), Fail> {
    let o = TrainOpts::parse(args).map_err(Fail::Usage)?;
    let (driver, ordinals) = gpu_ckpt_gpu_workloads::open_devices(&o.devices)?;
    let bytes = o.elements * 4;

    let mut devs = Vec::new();
    for &ord in &ordinals {
        let gpu = Gpu::open(&driver, ord)?;
        let rule = Rule::new(o.seed, ord as u32, o.elements);
        let state = driver.mem_alloc(bytes)?;
        let scratch = driver.mem_alloc(bytes)?;
        let stream = driver.stream_create(CU_STREAM_NON_BLOCKING)?;
        driver.memcpy_htod(state, u32_bytes(&rule.init))?;
        devs.push(Dev {
            gpu,
            rule,
            state,
            scratch,
            stream,
        });
    }
    let list: Vec<String> = ordinals.iter().map(|d| d.to_string()).collect();
    emit(&format!(
        "ready devices {} elements {} seed {}",
        list.join(","),
        o.elements,
        o.seed
    ));

    let mut host = vec![0u32; o.elements];
    let mut k: u64 = 0;
    loop {
        if o.steps.is_some_and(|n| k >= n) {
            break;
        }
        if k > 0 && o.interval_ms > 0 {
            std::thread::sleep(Duration::from_millis(o.interval_ms));
        }
        k += 1;
        let mut sum = Checksum::default();
        for d in &devs {
            step(&driver, d, k, &mut host)?;
            sum.add(&host);
            // No host copy of the state survives the step.
            host.fill(POISON);
        }
        emit(&format!("step {k} checksum {:016x}", sum.value()));
    }
    for d in &devs {
        d.gpu.select(&driver)?;
        driver.stream_destroy(d.stream)?;
        driver.mem_free(d.scratch)?;
        driver.mem_free(d.state)?;
        driver.primary_ctx_release(d.gpu.dev)?;
    }
    Ok(())
}

/// One step on one device; leaves the verified new state in `host`.
fn step(driver: &Driver, d: &Dev, k: u64, host: &mut [u32]) -> Result<(), Fail> {
    let bytes = host.len() * 4;
    let ord = d.gpu.ordinal;
    d.gpu.select(driver)?;

    // Read the state after step k-1 and check it (this catches a bad restore at once).
    host.fill(POISON);
    driver.memcpy_dtoh(u32_bytes_mut(host), d.state)?;
    check(d, ord, k - 1, host)?;

    for (i, v) in host.iter_mut().enumerate() {
        *v = d.rule.advance(i, *v, k);
    }

    // Write back through a stream into the scratch buffer, then DtoD into the state buffer.
    driver.memset_d32(d.scratch, POISON, host.len())?;
    driver.memcpy_htod_on_stream(d.scratch, u32_bytes(host), d.stream)?;
    driver.memcpy_dtod(d.state, d.scratch, bytes)?;
    driver.ctx_synchronize()?;
    driver.memset_d8(d.scratch, 0xa5, bytes)?;

    // Read back the state buffer and compare with the closed form.
    host.fill(POISON);
    driver.memcpy_dtoh_on_stream(u32_bytes_mut(host), d.state, d.stream)?;
    check(d, ord, k, host)
}

fn check(d: &Dev, ord: i32, k: u64, host: &[u32]) -> Result<(), Fail> {
    match d.rule.first_mismatch(host, k) {
        None => Ok(()),
        Some((i, got, want)) => Err(Fail::Mismatch(format!(
            "MISMATCH step {k} device {ord} element {i} got {got:08x} want {want:08x}"
        ))),
    }
}
