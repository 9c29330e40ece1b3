//! `gpu-ckpt-images --workloads-dir DIR [--gpu-workloads-dir DIR] --out DIR`: builds the test
//! images as OCI layout tarballs and lists them in `<out>/images.json`:
//!
//! - `localhost:5000/gpu-ckpt/workloads:1`: the static workloads in /bin, the host's static
//!   busybox as /bin/busybox with its applet symlinks, /tmp, /etc/passwd and /etc/group with
//!   root; default command `/bin/counter`;
//! - `localhost:5000/pause:1`: only /pause; command `/pause`;
//! - `localhost:5000/gpu-ckpt/gpu-workloads:1`: the CUDA workloads `gpu-train`, `gpu-fill`,
//!   `nccl-train` and `nccl_allreduce` (dynamically linked, from the workspace build:
//!   `--gpu-workloads-dir`, by default the directory of this program) in /usr/bin, the host's
//!   glibc as a CUDA base image has it (every library the workloads and the simulated
//!   `libcuda.so.1`/`libnvidia-ml.so.1`/`libnccl.so.2` need, found by following `DT_NEEDED`, plus
//!   libm, libdl, libpthread and librt) in /usr/lib/x86_64-linux-gnu with `/lib -> usr/lib`,
//!   `/lib64 -> usr/lib64` and the loader at its interpreter path, busybox and its applets;
//!   default command `/usr/bin/gpu-train`. No `libcuda.so.1` is in the image: the CDI spec of the
//!   (simulated) driver mounts it at run time, as the NVIDIA toolkit does; nor `libnccl.so.2`,
//!   which the job's environment brings (on a simulated node, the CDI spec mounts the simulated
//!   one).
//!
//! `gpu-ckpt-images --node-installer-bins DIR --payload DIR --out DIR` builds only the node
//! installer's image instead, `ghcr.io/gpu-ckpt/gpu-ckpt-node-installer:<version>` (the Helm
//! chart's default image) in `<out>/gpu-ckpt-node-installer-<version>.tar` (not listed in
//! `images.json`, which the tests import into every node): `gpu-ckpt-node-installer` from the
//! first DIR as its entrypoint (default argument `install`) and `gpu-ckpt-agent` from the same DIR
//! (the chart's agent DaemonSet) with the glibc they need, busybox's
//! `sh`, `sleep` and `nsenter` (the default restart command), and the payload DIR (`make
//! payload`: runtime-class/installer/payload.sh) as it is in /payload: the shim, `gpu-ckpt`,
//! `gpu-ckpt-hook`, and CRIU with its libraries and loader in `criu/`.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Parser;
use serde_json::json;
use test_containers::image::{
    elf_is_static, BuiltImage, HostLibraries, ImageBlobs, ImageBuilder, HOST_LIB_DIRS,
};

/// Reference of the workloads image.
const WORKLOADS_REF: &str = "localhost:5000/gpu-ckpt/workloads:1";
/// Reference of the pause image.
const PAUSE_REF: &str = "localhost:5000/pause:1";
/// Reference of the GPU workloads image.
const GPU_WORKLOADS_REF: &str = "localhost:5000/gpu-ckpt/gpu-workloads:1";

/// The CUDA workloads (test-containers/gpu-workloads), dynamically linked: the Rust ones from
/// the workspace build, `nccl_allreduce` from `c/build.sh` into the same directory.
const GPU_WORKLOADS: &[&str] = &["gpu-train", "gpu-fill", "nccl-train", "nccl_allreduce"];

/// The simulated driver's libraries and the simulated NCCL in the workspace build. They are not
/// put in the image (the CDI spec mounts them), but what they need is.
const SIM_DRIVER_LIBS: &[&str] = &["libcuda.so", "libnvidia_ml.so", "libnccl.so"];

/// Libraries the workloads need that are not put in the image: NCCL (`nccl_allreduce` links
/// `libnccl.so.2`) comes with the job's environment at run time, NVIDIA's or the simulator's,
/// as the driver's libraries do.
const RUN_TIME_LIBS: &[&str] = &["libnccl.so.2"];

/// glibc libraries a CUDA base image has besides what the workloads name (a real libcuda.so.1
/// needs libm, libdl, libpthread and librt).
const GLIBC_LIBS: &[&str] = &[
    "libc.so.6",
    "libm.so.6",
    "libgcc_s.so.1",
    "libdl.so.2",
    "libpthread.so.0",
    "librt.so.1",
];

/// The workload binaries (test-containers/workloads).
const WORKLOADS: &[&str] = &[
    "counter",
    "memhog",
    "echo-server",
    "echo-client",
    "pause",
    "oom-eater",
];

/// busybox applets linked in /bin.
const APPLETS: &[&str] = &[
    "sh", "ls", "cat", "sleep", "echo", "true", "false", "kill", "ps", "grep", "test", "mkdir",
    "rm", "id", "env", "head", "tail", "wc", "sync",
];

const DYNAMIC_HINT: &str = "build them with `cargo build --workspace` (no crt-static: they \
dlopen libcuda.so.1) and nccl_allreduce with `test-containers/gpu-workloads/c/build.sh DIR` \
into that build's directory, then pass it with --gpu-workloads-dir";

const STATIC_HINT: &str =
    "build them with `make workloads` (RUSTFLAGS=\"-C target-feature=+crt-static\" \
cargo build --release -p gpu-ckpt-workloads --target x86_64-unknown-linux-gnu)";

#[derive(Parser, Debug)]
#[command(
    name = "gpu-ckpt-images",
    about = "Build the gpu-ckpt test images (OCI layout tarballs)"
)]
struct Args {
    /// Directory with the static workload binaries
    /// (target/x86_64-unknown-linux-gnu/release).
    #[arg(
        long,
        value_name = "DIR",
        required_unless_present = "node_installer_bins"
    )]
    workloads_dir: Option<PathBuf>,
    /// Directory with the dynamically linked GPU workloads (gpu-train, gpu-fill, nccl-train,
    /// nccl_allreduce) of the workspace build; by default the directory of this program
    /// (target/debug when run from there).
    #[arg(long, value_name = "DIR")]
    gpu_workloads_dir: Option<PathBuf>,
    /// Output directory for the tarballs and images.json.
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The static busybox to put in the workloads image.
    #[arg(long, value_name = "PATH", default_value = "/bin/busybox")]
    busybox: PathBuf,
    /// Also write each image as an OCI layout directory next to its tarball.
    #[arg(long)]
    layout_dirs: bool,
    /// Build only the node installer's image, with gpu-ckpt-node-installer from this directory
    /// (target/payload/installer).
    #[arg(long, value_name = "DIR", requires = "payload")]
    node_installer_bins: Option<PathBuf>,
    /// The payload the node installer's image carries in /payload (target/payload/payload).
    #[arg(long, value_name = "DIR")]
    payload: Option<PathBuf>,
}

fn check_static(path: &Path, what: &str, hint: &str) -> Result<()> {
    match elf_is_static(path) {
        Ok(Some(true)) => Ok(()),
        Ok(Some(false)) => bail!("{what} {} is dynamically linked: {hint}", path.display()),
        Ok(None) => bail!(
            "{what} {} is not an x86-64 ELF executable: {hint}",
            path.display()
        ),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("{what} {} is missing: {hint}", path.display())
        }
        Err(e) => Err(e).with_context(|| format!("reading {what} {}", path.display())),
    }
}

fn workloads_image(dir: &Path, busybox: &Path) -> Result<ImageBuilder> {
    let mut b = ImageBuilder::new(WORKLOADS_REF)
        .dir("/bin")
        .dir_mode("/tmp", 0o1777)
        .dir_mode("/root", 0o700)
        .file("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644)
        .file("/etc/group", b"root:x:0:\n", 0o644)
        .file("/bin/busybox", busybox, 0o755)
        .env("PATH", "/bin")
        .workdir("/")
        .cmd(["/bin/counter"])
        .label("org.opencontainers.image.title", "gpu-ckpt test workloads");
    for name in WORKLOADS {
        let path = dir.join(name);
        check_static(&path, "workload", STATIC_HINT)?;
        b = b.file(format!("/bin/{name}"), path, 0o755);
    }
    for applet in APPLETS {
        b = b.symlink(format!("/bin/{applet}"), "busybox");
    }
    Ok(b)
}

fn gpu_workloads_image(dir: &Path, busybox: &Path) -> Result<ImageBuilder> {
    let mut elfs = Vec::new();
    let mut b = ImageBuilder::new(GPU_WORKLOADS_REF)
        .dir_mode("/tmp", 0o1777)
        .dir_mode("/root", 0o700)
        .dir("/run")
        .file("/etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n", 0o644)
        .file("/etc/group", b"root:x:0:\n", 0o644)
        .file("/usr/bin/busybox", busybox, 0o755)
        .symlink("/bin", "usr/bin")
        .env("PATH", "/usr/local/bin:/usr/bin:/bin")
        .workdir("/")
        .cmd(["/usr/bin/gpu-train"])
        .label(
            "org.opencontainers.image.title",
            "gpu-ckpt GPU test workloads",
        );
    for name in GPU_WORKLOADS {
        let path = dir.join(name);
        match elf_is_static(&path) {
            Ok(Some(false)) => {}
            Ok(Some(true)) => bail!(
                "GPU workload {} is statically linked: {DYNAMIC_HINT}",
                path.display()
            ),
            Ok(None) => bail!(
                "GPU workload {} is not an x86-64 ELF executable: {DYNAMIC_HINT}",
                path.display()
            ),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                bail!("GPU workload {} is missing: {DYNAMIC_HINT}", path.display())
            }
            Err(e) => {
                return Err(e).with_context(|| format!("reading GPU workload {}", path.display()))
            }
        }
        b = b.file(format!("/usr/bin/{name}"), path.as_path(), 0o755);
        elfs.push(path);
    }
    elfs.extend(
        SIM_DRIVER_LIBS
            .iter()
            .map(|l| dir.join(l))
            .filter(|p| p.is_file()),
    );
    let dirs: Vec<PathBuf> = HOST_LIB_DIRS.iter().map(PathBuf::from).collect();
    let libs = HostLibraries::resolve_except(&elfs, GLIBC_LIBS, &dirs, RUN_TIME_LIBS)
        .context("finding the shared libraries of the GPU workloads")?;
    b = b.merged_usr_libraries(&libs);
    for applet in APPLETS {
        b = b.symlink(format!("/usr/bin/{applet}"), "busybox");
    }
    Ok(b)
}

/// Reference of the node installer's image: the Helm chart's default `image.repository`, tagged
/// with its `appVersion` (the workspace version).
const NODE_INSTALLER_REF: &str = concat!(
    "ghcr.io/gpu-ckpt/gpu-ckpt-node-installer:",
    env!("CARGO_PKG_VERSION")
);
const NODE_INSTALLER: &str = "gpu-ckpt-node-installer";
/// The node agent (the chart's agent DaemonSet runs it from this image), beside the installer.
const AGENT: &str = "gpu-ckpt-agent";
/// What the installer copies onto a node from /payload (runtime-class/installer/README.md).
const PAYLOAD_FILES: &[&str] = &[
    "containerd-shim-gpu-ckpt-v1",
    "gpu-ckpt",
    "gpu-ckpt-hook",
    "criu/criu",
    "criu/lib/ld-linux-x86-64.so.2",
];

fn node_installer_image(bins: &Path, payload: &Path, busybox: &Path) -> Result<ImageBuilder> {
    let installer = bins.join(NODE_INSTALLER);
    let agent = bins.join(AGENT);
    let hint = "build them with `make payload`";
    for p in [installer.clone(), agent.clone()]
        .into_iter()
        .chain(PAYLOAD_FILES.iter().map(|b| payload.join(b)))
    {
        if !p.is_file() {
            bail!("{} is missing: {hint}", p.display());
        }
    }
    let dirs: Vec<PathBuf> = HOST_LIB_DIRS.iter().map(PathBuf::from).collect();
    let libs = HostLibraries::resolve(&[installer.clone(), agent.clone()], &[], &dirs)
        .context("finding the shared libraries of gpu-ckpt-node-installer and gpu-ckpt-agent")?;
    let b = ImageBuilder::new(NODE_INSTALLER_REF)
        .dir_mode("/tmp", 0o1777)
        .file("/usr/bin/busybox", busybox, 0o755)
        .symlink("/bin", "usr/bin")
        .symlink("/usr/bin/sh", "busybox")
        .symlink("/usr/bin/nsenter", "busybox")
        .symlink("/usr/bin/sleep", "busybox")
        .file(
            format!("/usr/bin/{NODE_INSTALLER}"),
            installer.as_path(),
            0o755,
        )
        .file(format!("/usr/bin/{AGENT}"), agent.as_path(), 0o755)
        .merged_usr_libraries(&libs)
        .env("PATH", "/usr/bin:/bin")
        .workdir("/")
        .entrypoint([format!("/usr/bin/{NODE_INSTALLER}")])
        .cmd(["install"])
        .label("org.opencontainers.image.title", "gpu-ckpt node installer");
    add_tree(b, payload, "/payload")
}

/// `dir`'s files (their modes kept) and links under `at` in the image.
fn add_tree(mut b: ImageBuilder, dir: &Path, at: &str) -> Result<ImageBuilder> {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .and_then(|d| d.collect::<std::io::Result<Vec<_>>>())
        .with_context(|| format!("reading {}", dir.display()))?;
    entries.sort_by_key(|e| e.file_name());
    for e in entries {
        let path = e.path();
        let name = e.file_name();
        let to = format!("{at}/{}", name.to_string_lossy());
        let meta = std::fs::symlink_metadata(&path)
            .with_context(|| format!("reading {}", path.display()))?;
        if meta.is_dir() {
            b = add_tree(b.dir(to.clone()), &path, &to)?;
        } else if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path)?;
            b = b.symlink(to, target.to_string_lossy().into_owned());
        } else {
            use std::os::unix::fs::PermissionsExt;
            b = b.file(to, path.as_path(), meta.permissions().mode() & 0o755);
        }
    }
    Ok(b)
}

fn pause_image(dir: &Path) -> Result<ImageBuilder> {
    let path = dir.join("pause");
    check_static(&path, "workload", STATIC_HINT)?;
    Ok(ImageBuilder::new(PAUSE_REF)
        .file("/pause", path, 0o755)
        .cmd(["/pause"]))
}

/// `localhost:5000/gpu-ckpt/workloads:1` -> `workloads-1`.
fn file_stem(reference: &str, tag: &str) -> String {
    let repo = reference
        .strip_suffix(&format!(":{tag}"))
        .unwrap_or(reference);
    let name = repo.rsplit('/').next().unwrap_or(repo);
    format!("{name}-{tag}")
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    match run(&args) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gpu-ckpt-images: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Writes `blobs` into `out` as the OCI layout tarball `<stem>.tar` (and the layout directory
/// `<stem>` with `layout_dirs`) and prints its reference, digest and tarball; returns what was
/// written and the stem.
fn write_image(blobs: &ImageBlobs, out: &Path, layout_dirs: bool) -> Result<(BuiltImage, String)> {
    let summary = blobs.summary();
    let stem = file_stem(&summary.reference, &summary.tag);
    let tar = out.join(format!("{stem}.tar"));
    if layout_dirs {
        blobs.write_layout(&out.join(&stem))?;
    }
    blobs.write_tarball(&tar)?;
    println!(
        "{} {} {}",
        summary.reference,
        summary.manifest_digest,
        tar.display()
    );
    let built = BuiltImage {
        tarball: Some(tar),
        ..summary
    };
    Ok((built, stem))
}

fn run(args: &Args) -> Result<()> {
    check_static(
        &args.busybox,
        "busybox",
        "install the static build with `apt-get install busybox-static`",
    )?;
    std::fs::create_dir_all(&args.out)
        .with_context(|| format!("creating {}", args.out.display()))?;
    let out = args
        .out
        .canonicalize()
        .with_context(|| format!("resolving {}", args.out.display()))?;
    if let Some(bins) = &args.node_installer_bins {
        let payload = args.payload.as_deref().context("--payload is required")?;
        let img = node_installer_image(bins, payload, &args.busybox)?;
        write_image(&img.build()?, &out, args.layout_dirs)?;
        return Ok(());
    }
    let workloads_dir = args
        .workloads_dir
        .as_deref()
        .context("--workloads-dir is required")?;

    let gpu_dir = match &args.gpu_workloads_dir {
        Some(d) => d.clone(),
        None => std::env::current_exe()
            .context("locating this program")?
            .parent()
            .map(Path::to_path_buf)
            .context("locating this program's directory")?,
    };
    let images = [
        workloads_image(workloads_dir, &args.busybox)?,
        pause_image(workloads_dir)?,
        gpu_workloads_image(&gpu_dir, &args.busybox)?,
    ];
    let mut listed = Vec::new();
    for img in &images {
        let (built, stem) = write_image(&img.build()?, &out, args.layout_dirs)?;
        listed.push(json!({
            "reference": built.reference,
            "digest": built.manifest_digest,
            "config_digest": built.config_digest,
            "tar": format!("{stem}.tar"),
        }));
    }
    let index = out.join("images.json");
    let text = serde_json::to_string_pretty(&json!({ "images": listed }))? + "\n";
    let tmp = out.join("images.json.tmp");
    std::fs::write(&tmp, text).with_context(|| format!("writing {}", tmp.display()))?;
    std::fs::rename(&tmp, &index).with_context(|| format!("writing {}", index.display()))?;
    println!("wrote {}", index.display());
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stems() {
        assert_eq!(file_stem(WORKLOADS_REF, "1"), "workloads-1");
        assert_eq!(file_stem(PAUSE_REF, "1"), "pause-1");
        assert_eq!(file_stem(GPU_WORKLOADS_REF, "1"), "gpu-workloads-1");
        // The chart deploys this image by default.
        let chart = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../runtime-class/chart/gpu-ckpt/Chart.yaml"
        ))
        .unwrap();
        let version = env!("CARGO_PKG_VERSION");
        assert!(
            chart.contains(&format!("appVersion: \"{version}\"")),
            "{chart}"
        );
        let values = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../runtime-class/chart/gpu-ckpt/values.yaml"
        ))
        .unwrap();
        let (repo, tag) = NODE_INSTALLER_REF.rsplit_once(':').unwrap();
        assert_eq!(tag, version);
        assert!(
            values.contains(&format!("repository: {repo}\n")),
            "{values}"
        );
        assert_eq!(
            file_stem(NODE_INSTALLER_REF, version),
            format!("gpu-ckpt-node-installer-{version}")
        );
        assert_eq!(WORKLOADS_REF, test_containers::stack::WORKLOADS_IMAGE);
        assert_eq!(PAUSE_REF, test_containers::stack::PAUSE_IMAGE);
        assert_eq!(
            GPU_WORKLOADS_REF,
            test_containers::stack::GPU_WORKLOADS_IMAGE
        );
    }
}
