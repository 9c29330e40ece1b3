//! One module per subcommand of `gpu-ckpt`: its flags (clap) and its `run`, which returns a
//! [`Report`](crate::output::Report) or an error for the command's main to print. Shared parts:
//! [`input`] (what a path holds), [`node`] (this node's GPUs, for the compatibility verdict),
//! [`trust`] (who signed a checkpoint and whether this node trusts them).

pub mod build;
pub mod compat;
pub mod completion;
pub mod device;
pub mod events;
pub mod extract;
pub mod input;
pub mod inspect;
pub mod key;
pub mod node;
pub mod pull;
pub mod trust;
pub mod verify;
