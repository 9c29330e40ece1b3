//! The integration tests, one test binary: each module was its own `tests/*.rs` file, and each
//! linked the whole stack (shim, image format, clients) once more. Tests are named
//! `module::test`; run one file's tests with `cargo test --workspace --test integration -- module::`.
//! Tests of every module run at the same time (`--test-threads`): each starts its own containerd
//! node under a name no other test uses, and none sets process-wide state (environment, current
//! directory, signal handlers).

mod common;

mod admission;
mod checkpoint_cri;
mod checkpoint_ctr;
mod checkpoint_net;
mod crash_safety;
mod criu_oldest;
mod criu_version;
mod docs_commands;
mod docs_messages;
mod fleet;
mod gpu_cdi;
mod gpu_criu_plugin;
mod gpu_driver_files;
mod gpu_early_resume;
mod gpu_hang;
mod gpu_hooks;
mod gpu_memory;
mod gpu_nccl;
mod gpu_nccl_ckpt;
mod gpu_process;
mod gpu_python;
mod gpu_shim;
mod gpu_storage;
mod gpu_unsupported;
mod installer_pod;
mod k8s_manifests;
mod key_rotation;
mod log_uri;
mod metrics;
mod metrics_rules;
mod nccl_inject;
mod node_installer;
mod nonroot_caps;
mod payload_glibc;
mod records;
mod registry;
mod restarts;
mod restore_bound;
mod restore_mount;
mod restore_mounts;
mod restore_spec;
mod restore_trust;
mod restore_unsigned;
mod restore_via_create;
mod rootfs_race;
mod rro_restore;
mod runc_typed;
mod shim_binary;
mod shim_cri;
mod shim_ctr;
mod shim_features;
mod soak;
mod stack_smoke;
mod traces;
