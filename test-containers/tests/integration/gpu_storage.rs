//! Device memory by the driver's custom storage (CUDA 13.4 and later), end to end through the
//! shim: a container of two GPU processes on two simulated GPUs at CUDA 13.5 checkpointed
//! through ctr and through CRI and restored on another node with other GPUs from the
//! checkpoint's device-memory files; the same container at CUDA 13.0 by the staged path.
//!
//! The workload is gpu-fill: each process fills its GPU's memory with a pattern derived from
//! its seed and GPU, and on SIGUSR1 checks every byte of it (`verified <bytes> bytes`, or
//! `MISMATCH`). Its first 64 MiB on each GPU are one seeded 32-bit value: a page of it in
//! CRIU's page images means the device memory went through host memory (the staged path).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::common::{gpu::*, *};
use anyhow::{ensure, Context, Result};
use gpu_ckpt_gpu_workloads::fill::{self, Kind};
use image_format::manifest::{self, Manifest};
use simgpu::testing::{SimConfig, SimNode};
use test_containers::{
    cri::{ContainerSpec, Cri, PodSpec},
    stack::{Node, GPU_CKPT_HANDLER, GPU_WORKLOADS_IMAGE},
};

/// Device memory each gpu-fill process fills on its GPU: eight 64 MiB chunks (memset, words,
/// …), so that the first is a seeded value the process's host memory never held (its own
/// buffers, up to two chunks, stay far below the device memory).
const FILL_MIB: u64 = 512;
/// The two processes: (GPU ordinal, seed).
const FILLS: [(u32, u64); 2] = [(0, 1), (1, 2)];

/// A simulated node of two 1 GiB GPUs at CUDA `cuda`, UUIDs from `seed`.
fn sim_at(cuda: i32, seed: &str) -> Result<SimNode> {
    sim_node(SimConfig {
        cuda_version: cuda,
        ..gpus_config(2, 1024, seed)
    })
}

/// A GPU node on `sim` whose device-memory files go under its own directory.
fn storage_node(name: &str, sim: &SimNode) -> Result<(Node, PathBuf)> {
    let dir = test_containers::stack::Stack::discover()?
        .node_dir(name)
        .join("device-memory");
    let _ = std::fs::remove_dir_all(&dir);
    let node = gpu_node(
        name,
        sim,
        &[("DeviceStorageDir", dir.display().to_string().as_str())],
    )?;
    Ok((node, dir))
}

/// The shell command of the container: gpu-fill on GPU 0 (seed 1) in the background and on
/// GPU 1 (seed 2) as init, each logging to `out/fill-<gpu>.log` (`out` empty: stdout, the
/// background one to stderr).
fn fill_command(out: &str) -> String {
    let one = |(gpu, seed): (u32, u64)| {
        let log = if out.is_empty() {
            if gpu == 0 {
                " 1>&2".to_string()
            } else {
                String::new()
            }
        } else {
            format!(" > {out}/fill-{gpu}.log 2>&1")
        };
        format!("/usr/bin/gpu-fill --mib {FILL_MIB} --devices {gpu} --seed {seed}{log}")
    };
    format!("{} & exec {}", one(FILLS[0]), one(FILLS[1]))
}

/// `ctr <verb> --device all … sh -c <fill_command>` on `node` (`verb`: `run -d` or `container
/// create`), logging into a tmpfs at /out that travels with the checkpoint.
fn ctr_fill(node: &Node, verb: &[&str], id: &str) -> Result<()> {
    let flags: Vec<String> = if verb[0] == "run" {
        run_flags(node)
    } else {
        vec!["--runtime".into(), RUNTIME.into()]
    };
    let all = format!("{KIND}=all");
    let cmd = fill_command("/out");
    let mut args: Vec<&str> = verb.to_vec();
    args.extend(["--device", &all]);
    args.extend([
        "--mount",
        "type=tmpfs,src=tmpfs,dst=/out,options=rw:size=16m",
    ]);
    args.extend(flags.iter().map(String::as_str));
    args.extend([GPU_WORKLOADS_IMAGE, id, "/bin/sh", "-c", &cmd]);
    let out = node.ctr_cdi("default", &args)?;
    ensure!(
        out.status.success(),
        "ctr {} failed: {}{}",
        args.join(" "),
        String::from_utf8_lossy(&out.stderr),
        String::from_utf8_lossy(&out.stdout)
    );
    Ok(())
}

/// The gpu-fill processes of the container whose init is `init`: init and its children.
fn fill_pids(init: i32) -> Vec<i32> {
    let children =
        std::fs::read_to_string(format!("/proc/{init}/task/{init}/children")).unwrap_or_default();
    let mut pids = vec![init];
    pids.extend(
        children
            .split_whitespace()
            .filter_map(|p| p.parse::<i32>().ok()),
    );
    pids.retain(|p| {
        std::fs::read_to_string(format!("/proc/{p}/comm")).is_ok_and(|c| c.trim() == "gpu-fill")
    });
    pids
}

/// Both gpu-fill processes of `init`, once there are two.
fn both_fills(init: i32) -> Result<Vec<i32>> {
    wait_until(Duration::from_secs(20), "two gpu-fill processes", || {
        let p = fill_pids(init);
        (p.len() == 2).then_some(p)
    })
}

/// `VmRSS` of `pid`, in bytes.
fn rss(pid: i32) -> Result<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let kb: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .with_context(|| format!("no VmRSS for pid {pid}"))?;
    Ok(kb << 10)
}

/// How many `verified` lines `text` holds; fails on a MISMATCH.
fn verified_lines(text: &str, what: &str) -> Result<usize> {
    ensure!(
        !text.contains("MISMATCH"),
        "{what}: gpu-fill found wrong data:\n{text}"
    );
    Ok(text
        .lines()
        .filter(|l| l.contains(&format!("verified {} bytes", FILL_MIB << 20)))
        .count())
}

/// SIGUSR1 to each of `pids`, then waits until `read` shows one `verified` line more than
/// before for each: every byte of every process's device memory checked by the process.
fn verify_every_byte(pids: &[i32], read: impl Fn(usize) -> String, what: &str) -> Result<()> {
    let before: Vec<usize> = (0..pids.len())
        .map(|i| verified_lines(&read(i), what))
        .collect::<Result<_>>()?;
    for &p in pids {
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(p),
            nix::sys::signal::Signal::SIGUSR1,
        )?;
    }
    for (i, b) in before.iter().enumerate() {
        wait_until(
            Duration::from_secs(60),
            &format!("{what}: process {i} verified"),
            || {
                verified_lines(&read(i), what)
                    .map(|n| n > *b)
                    .unwrap_or(true)
                    .then_some(())
            },
        )?;
        verified_lines(&read(i), what)?;
    }
    println!("{what}: every byte verified by {} processes", pids.len());
    Ok(())
}

/// The log of the ctr container's gpu-fill on GPU `gpu`, read through init `init`'s root.
fn ctr_fill_log(init: i32, gpu: u32) -> String {
    std::fs::read_to_string(format!("/proc/{init}/root/out/fill-{gpu}.log")).unwrap_or_default()
}

/// A page (4 KiB) of the seeded value that starts GPU `gpu`'s memory of process `seed`.
fn seeded_page(gpu: u32, seed: u64) -> Vec<u8> {
    let Kind::Memset(v) = fill::kind(seed, gpu, 0) else {
        panic!("chunk 0 of gpu-fill is a memset");
    };
    v.to_ne_bytes().repeat(1024)
}

/// Whether any page-aligned page of `reader` is `page`.
fn has_page(mut reader: impl Read, page: &[u8]) -> Result<bool> {
    let mut buf = vec![0u8; page.len()];
    loop {
        let mut got = 0;
        while got < buf.len() {
            match reader.read(&mut buf[got..])? {
                0 => return Ok(false),
                n => got += n,
            }
        }
        if buf == page {
            return Ok(true);
        }
    }
}

/// The sizes of CRIU's page images in `dir`, and whether one holds a seeded page of either
/// process.
fn pages_in_dir(dir: &Path) -> Result<(u64, bool)> {
    let (mut size, mut seeded) = (0, false);
    for e in std::fs::read_dir(dir)? {
        let e = e?;
        let name = e.file_name().to_string_lossy().into_owned();
        if !manifest::is_page_image(&name) {
            continue;
        }
        size += e.metadata()?.len();
        for (gpu, seed) in FILLS {
            seeded |= has_page(std::fs::File::open(e.path())?, &seeded_page(gpu, seed))?;
        }
    }
    Ok((size, seeded))
}

/// [`pages_in_dir`] of the `checkpoint/` page images in a CRI checkpoint archive, and the
/// names of the archive's device-memory files.
fn pages_in_archive(archive: &Path) -> Result<(u64, bool, Vec<String>)> {
    let (mut size, mut seeded, mut device) = (0, false, Vec::new());
    let pages: Vec<Vec<u8>> = FILLS.iter().map(|(g, s)| seeded_page(*g, *s)).collect();
    let mut tar = tar::Archive::new(std::fs::File::open(archive)?);
    for e in tar.entries()? {
        let mut e = e?;
        let path = e.path()?.to_string_lossy().into_owned();
        let Some(name) = path.strip_prefix("checkpoint/") else {
            continue;
        };
        if name.starts_with("device-memory-") {
            device.push(name.to_string());
        }
        if !manifest::is_page_image(name) {
            continue;
        }
        size += e.size();
        let mut data = Vec::new();
        e.read_to_end(&mut data)?;
        for p in &pages {
            seeded |= has_page(data.as_slice(), p)?;
        }
    }
    Ok((size, seeded, device))
}

/// The manifest of a custom-storage checkpoint: storage custom, one device-memory file per
/// process and GPU, each listed in `files` with the BLAKE3 `device_state` gives it.
fn expect_custom(m: &Manifest, what: &str) -> Result<()> {
    ensure!(
        m.devices.storage == manifest::STORAGE_CUSTOM,
        "{what}: devices.storage is {:?}, want custom",
        m.devices.storage
    );
    ensure!(
        m.devices.processes.len() == 2 && m.device_state.len() == 2,
        "{what}: {} processes, device state {:?}",
        m.devices.processes.len(),
        m.device_state
    );
    for p in &m.devices.processes {
        let files: Vec<_> = m.device_memory_of(p.pid).collect();
        ensure!(
            files.len() == 1 && files[0].size >= FILL_MIB << 20,
            "{what}: process {} has device-memory files {files:?}",
            p.pid
        );
        let listed = &m.files[&files[0].name];
        ensure!(
            listed.blake3 == files[0].blake3 && listed.size == files[0].size,
            "{what}: {} listed as {listed:?}",
            files[0].name
        );
    }
    Ok(())
}

/// The page images hold no device byte: far smaller than the device memory, and no page of
/// the seeded values (the staged path puts every one of them there).
fn expect_no_device_bytes(pages: u64, seeded: bool, device: u64, what: &str) -> Result<()> {
    ensure!(
        !seeded,
        "{what}: CRIU's page images hold a page of the workload's device memory"
    );
    ensure!(
        pages < device / 2,
        "{what}: CRIU's page images are {pages} bytes for {device} bytes of device memory"
    );
    println!("{what}: page images {pages} bytes, device memory {device} bytes in its own files");
    Ok(())
}

/// Through ctr at CUDA 13.5: Pause puts the device memory into files (the processes' RSS
/// unchanged), Resume brings it back and removes them; `ctr task checkpoint --exit` carries
/// the files in the image directory, listed in the manifest, none of it in the page images;
/// a changed byte in one is refused at restore; on node B (other GPUs) every byte comes back.
#[test]
fn ctr_checkpoint_by_custom_storage_restores_on_another_node() -> Result<()> {
    let sim_a = sim_at(13050, "storage-ctr-a")?;
    let sim_b = sim_at(13050, "storage-ctr-b")?;
    let (a, dir_a) = storage_node("gpu-storage-ctr-a", &sim_a)?;
    let (b, _) = storage_node("gpu-storage-ctr-b", &sim_b)?;
    ctr_fill(&a, &["run", "-d"], "fill")?;
    let init = a.task_pid("fill")?;
    let pids = both_fills(init)?;
    for g in [0, 1] {
        wait_until(Duration::from_secs(30), "gpu-fill filled", || {
            ctr_fill_log(init, g).contains("filled").then_some(())
        })?;
    }

    // 1. Pause: the device memory goes to the files, not into the processes' memory.
    let before: Vec<u64> = pids.iter().map(|p| rss(*p)).collect::<Result<_>>()?;
    a.ctr_ok(&["task", "pause", "fill"])?;
    let held = dir_a.join("default").join("fill");
    let files: Vec<String> = std::fs::read_dir(&held)
        .with_context(|| format!("no device-memory files in {}", held.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    let during: Vec<u64> = pids.iter().map(|p| rss(*p)).collect::<Result<_>>()?;
    a.ctr_ok(&["task", "resume", "fill"])?;
    println!("paused: files {files:?}, RSS before {before:?}, paused {during:?}");
    ensure!(
        files.len() == 2 && files.iter().all(|f| f.starts_with("device-memory-")),
        "the paused container's device-memory files: {files:?}"
    );
    for (b, d) in before.iter().zip(&during) {
        ensure!(
            d.abs_diff(*b) * 10 <= *b,
            "RSS {b} bytes before the device step, {d} bytes paused after it: more than 10% apart"
        );
    }
    ensure!(
        !held.exists(),
        "the device-memory files outlived the Resume: {}",
        held.display()
    );
    verify_every_byte(
        &pids,
        |i| ctr_fill_log(init, i as u32),
        "after pause and resume",
    )?;

    // 2. Checkpoint with --exit into an image directory.
    let image = a.paths().dir.join("storage-exit");
    a.checkpoint_task_exit("fill", &image)?;
    let m = Manifest::read_from(&image)?;
    expect_custom(&m, "ctr --exit")?;
    let (pages, seeded) = pages_in_dir(&image)?;
    expect_no_device_bytes(pages, seeded, m.devices.device_bytes(), "ctr --exit")?;
    ensure!(
        !dir_a.join("default").join("fill").exists(),
        "the device-memory files outlived their checkpoint"
    );
    // gpu-ckpt verify and inspect show the device-memory files.
    let stack = test_containers::stack::Stack::discover()?;
    let cli = test_containers::gpuproc::binary(&stack, "gpu-ckpt")?;
    let shown = run_ok(std::process::Command::new(&cli).arg("inspect").arg(&image))?;
    ensure!(
        shown.contains("Device storage: custom")
            && m.device_state.iter().all(|d| shown.contains(&d.name)),
        "gpu-ckpt inspect does not show the device-memory files:\n{shown}"
    );

    // 3. One changed byte in a device-memory file: refused at restore, naming it.
    let bad = a.paths().dir.join("storage-exit-changed");
    let _ = std::fs::remove_dir_all(&bad);
    std::fs::create_dir_all(&bad)?;
    for e in std::fs::read_dir(&image)? {
        let e = e?;
        std::fs::copy(e.path(), bad.join(e.file_name()))?;
    }
    let victim = bad.join(&m.device_state[0].name);
    let mut data = std::fs::read(&victim)?;
    data[4096 + 17] ^= 0x01;
    std::fs::write(&victim, data)?;
    manifest::verify_dir(&image).context("verify of the checkpoint")?;
    let err = match manifest::verify_dir(&bad) {
        Ok(_) => anyhow::bail!("verify accepts a changed device-memory file"),
        Err(e) => e.to_string(),
    };
    ensure!(
        err.contains(&m.device_state[0].name),
        "verify's refusal does not name the changed file: {err}"
    );
    ctr_fill(&b, &["container", "create"], "fill")?;
    let err = match restore_from_dir(&b, "fill", &bad) {
        Ok(pid) => anyhow::bail!("a changed device-memory file restored as pid {pid}"),
        Err(e) => format!("{e:#}"),
    };
    ensure!(
        err.contains(&m.device_state[0].name),
        "the refusal does not name the changed file: {err}"
    );
    ensure!(
        sim_b.processes()?.is_empty(),
        "the refused restore left GPU processes on node B"
    );
    remove(&b, "fill");

    // 4. The checkpoint restores on node B, onto its GPUs, every byte verified.
    ctr_fill(&b, &["container", "create"], "fill")?;
    let restored = restore_from_dir(&b, "fill", &image)?;
    let pids_b = both_fills(restored)?;
    verify_every_byte(
        &pids_b,
        |i| ctr_fill_log(restored, i as u32),
        "ctr --exit, restored on node B",
    )?;
    let mut on: Vec<[u8; 16]> = Vec::new();
    for p in &pids_b {
        on.extend(gpus_of(&sim_b, *p)?);
    }
    on.sort();
    let mut want: Vec<[u8; 16]> = sim_b.node().gpus.iter().map(|g| g.uuid).collect();
    want.sort();
    ensure!(
        on == want,
        "the restored processes run on {on:?}, want node B's two GPUs"
    );
    remove(&b, "fill");
    Ok(())
}

/// The CRI container spec of the two gpu-fill processes on both simulated GPUs.
fn fill_spec() -> ContainerSpec {
    ContainerSpec::new("fill", GPU_WORKLOADS_IMAGE)
        .command(&["/bin/sh"])
        .args(&["-c", &fill_command("")])
        .annotation("cdi.k8s.io/gpu-ckpt-sim_fill", &format!("{KIND}=all"))
}

/// The CRI log `log`'s lines of stream `i` (0: stderr, gpu-fill on GPU 0; 1: stdout).
fn cri_stream(log: &Path, i: usize) -> String {
    let stream = if i == 0 { "stderr" } else { "stdout" };
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split_whitespace().nth(1) == Some(stream))
        .map(|l| format!("{l}\n"))
        .collect()
}

/// Through CRI at CUDA 13.5 (containerd pauses, the shim checkpoints, containerd archives,
/// then resumes): the archive carries the device-memory files, none of the device memory is
/// in its page images, the original runs on with every byte, and the restore handler on node
/// B restores it onto other GPUs with every byte.
#[test]
fn cri_checkpoint_by_custom_storage_restores_on_another_node() -> Result<()> {
    let sim_a = sim_at(13050, "storage-cri-a")?;
    let sim_b = sim_at(13050, "storage-cri-b")?;
    let (a, dir_a) = storage_node("gpu-storage-cri-a", &sim_a)?;
    let (b, _) = storage_node("gpu-storage-cri-b", &sim_b)?;
    rt().block_on(async {
        let cri_a = Cri::connect(a.socket()).await?;
        let cri_b = Cri::connect(b.socket()).await?;
        let pod = cri_a
            .run_pod(&PodSpec::new("storage", a.pod_log_root()).handler(GPU_CKPT_HANDLER))
            .await?;
        let id = cri_a.run_container(&pod, &fill_spec()).await?;
        let log = pod.container_log("fill");
        for i in 0..2 {
            wait_until(Duration::from_secs(30), "gpu-fill filled", || {
                cri_stream(&log, i).contains("filled").then_some(())
            })?;
        }
        let pids = both_fills(cri_pid(&cri_a, &id).await?)?;
        let archive = a.paths().dir.join("checkpoint-storage-fill.tar");
        let _ = std::fs::remove_file(&archive);
        cri_a.checkpoint_container(&id, &archive, 120).await?;

        let m = crate::gpu_shim::archive_manifest(&archive)?;
        expect_custom(&m, "CRI")?;
        let (pages, seeded, files) = pages_in_archive(&archive)?;
        expect_no_device_bytes(pages, seeded, m.devices.device_bytes(), "CRI")?;
        let mut listed: Vec<String> = m.device_state.iter().map(|d| d.name.clone()).collect();
        let mut files = files;
        listed.sort();
        files.sort();
        ensure!(
            files == listed,
            "the archive holds device-memory files {files:?}, the manifest lists {listed:?}"
        );
        ensure!(
            std::fs::read_dir(dir_a.join("k8s.io")).map_or(true, |mut d| d.next().is_none()),
            "device-memory files outlived the CRI checkpoint under {}",
            dir_a.display()
        );
        verify_every_byte(
            &pids,
            |i| cri_stream(&log, i),
            "the original after the checkpoint",
        )?;

        let pod_r = cri_b
            .run_pod(&restore_pod("storage", &b, &archive.display().to_string()))
            .await?;
        let id_r = cri_b.run_container(&pod_r, &fill_spec()).await?;
        let log_r = pod_r.container_log("fill");
        let pids_r = both_fills(cri_pid(&cri_b, &id_r).await?)?;
        verify_every_byte(
            &pids_r,
            |i| cri_stream(&log_r, i),
            "CRI, restored on node B",
        )?;
        for p in &pids_r {
            let on = gpus_of(&sim_b, *p)?;
            ensure!(
                on.len() == 1 && sim_b.node().gpus.iter().any(|g| g.uuid == on[0]),
                "restored pid {p} runs on {on:?}, not on one of node B's GPUs"
            );
        }
        cri_b.remove_pod(&pod_r).await?;
        cri_a.remove_pod(&pod).await
    })
}

/// At CUDA 13.0 (no custom storage) the same container checkpoints and restores by the staged
/// path: the manifest says staged, lists no device-memory file, and the device memory is in the
/// page images (the assertion the custom-storage tests hold the other way).
#[test]
fn before_cuda_13_4_the_staged_path_still_checkpoints_and_restores() -> Result<()> {
    let sim_a = sim_at(13000, "storage-staged-a")?;
    let sim_b = sim_at(13000, "storage-staged-b")?;
    let (a, _) = storage_node("gpu-storage-staged-a", &sim_a)?;
    let (b, _) = storage_node("gpu-storage-staged-b", &sim_b)?;
    ctr_fill(&a, &["run", "-d"], "fill")?;
    let init = a.task_pid("fill")?;
    both_fills(init)?;
    for g in [0, 1] {
        wait_until(Duration::from_secs(30), "gpu-fill filled", || {
            ctr_fill_log(init, g).contains("filled").then_some(())
        })?;
    }
    let image = a.paths().dir.join("staged-exit");
    a.checkpoint_task_exit("fill", &image)?;
    let m = Manifest::read_from(&image)?;
    ensure!(
        m.devices.storage == manifest::STORAGE_STAGED && m.device_state.is_empty(),
        "at CUDA 13.0: devices.storage {:?}, device state {:?}",
        m.devices.storage,
        m.device_state
    );
    let (pages, seeded) = pages_in_dir(&image)?;
    ensure!(
        seeded && pages >= m.devices.device_bytes(),
        "the staged path's page images ({pages} bytes) do not hold the device memory"
    );
    ctr_fill(&b, &["container", "create"], "fill")?;
    let restored = restore_from_dir(&b, "fill", &image)?;
    let pids_b = both_fills(restored)?;
    verify_every_byte(
        &pids_b,
        |i| ctr_fill_log(restored, i as u32),
        "staged, restored on node B",
    )?;
    remove(&b, "fill");
    Ok(())
}
