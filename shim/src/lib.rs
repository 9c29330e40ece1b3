//! gpu-ckpt's containerd shim: the task service over runc, and checkpoint and restore with
//! device state.
//!
//! The binary `containerd-shim-gpu-ckpt-v1` is [`service::Service`] run by the containerd-shim
//! crate; each module is one role:
//!
//! - [`service`]: containerd's `start`/`delete` actions, grouping one shim per pod;
//! - [`task`]: the Task API mapped onto containers, and the exit handler;
//! - [`container`]: one container's operations (create, start, exec, kill, delete, checkpoint,
//!   restore), one file each, as steps with their undo; the modules below are the steps they
//!   call, and never call back into a container; [`bundle`]: the bundle and its spec, read
//!   once at Create, and the CRI annotation keys; [`device`]: the device steps (GPU processes,
//!   lock, checkpoint, restore, unlock, GPU pairs); [`device_worker`]: the driver's calls in a
//!   child process, each bounded; [`unsupported`]: what the driver cannot checkpoint (MIG,
//!   NCCL, MPS), refused before the lock; [`memory_room`]: host memory for the staged device
//!   memory; [`driver_files`]: the driver files they map, recorded and held at a
//!   restore; [`checkpoint`]: CRIU options;
//!   [`annotations`]: `gpu-ckpt.io/` keys;
//! - [`process`]: a process's state and exit; [`restore`]: the restore handler's own restore;
//!   [`verify_gate`]: holds restored tasks until their page images are verified;
//! - [`runc`]: every runc invocation;
//! - [`stdio`]: pipes and terminals between the container and containerd's fifos, a `file://`
//!   log file or a `binary://` logging binary;
//! - [`stats`]: cgroup v1/v2 metrics; [`oom`]: OOM-kill events; [`events`]: ordered event publishing;
//! - [`trust`]: signatures, trusted keys, namespaces and restore sources;
//!   [`rootfs_changes`]: the signed copy of a container's rootfs changes;
//! - [`sub_mounts`]: mounts below the spec's bind mounts, mapped for CRIU across a restore;
//!   [`mount_check`]: a restore's mounts held to the new spec (flags, masks, new mounts);
//!   [`device_nodes`]: its `/dev` holding the spec's device nodes; [`restored_root`]: the
//!   restored init's root, walked without following links;
//! - [`restored_annotations`]: a containerd restore's annotations held to the signed record;
//!   [`pod_network`]: the pod's addresses, recorded and held for established TCP connections;
//! - [`options`]: runtime options; [`error`]: errors and their ttrpc codes.

pub mod annotations;
pub mod bundle;
pub mod checkpoint;
pub mod container;
pub mod criu;
pub mod criu_exit;
pub mod device;
pub mod device_nodes;
pub mod device_storage;
pub mod device_worker;
pub mod driver_files;
pub mod error;
pub mod events;
pub mod features;
pub mod logging;
pub mod memory_room;
pub mod mount_check;
pub mod nccl;
pub mod oom;
pub mod options;
pub mod pod_network;
pub mod private_dir;
pub mod process;
pub mod record;
pub mod restore;
pub mod restored_annotations;
pub mod restored_root;
pub mod rootfs_changes;
pub mod runc;
pub mod service;
pub mod spec_check;
pub mod stats;
pub mod stdio;
pub mod sub_mounts;
pub mod task;
pub mod telemetry;
pub mod trust;
pub mod unsupported;
pub mod verify_gate;
pub mod watchdog;
