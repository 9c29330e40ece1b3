//! One process of a container, init or exec: its state machine and exit status.

use containerd_shim::{
    asynchronous::io::Stdio,
    protos::protobuf::{well_known_types::timestamp::Timestamp, MessageField},
    util::timestamp,
};
use tokio::sync::watch;

use crate::stdio::ProcessIo;

/// Where a process is in its life.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Status {
    /// Created (init: `runc create` done; exec: recorded, not started).
    Created,
    Running,
    Paused,
    Stopped,
}

/// How a process ended.
#[derive(Clone, Debug, PartialEq)]
pub struct Exit {
    /// The exit code, or 128 + the signal number.
    pub code: u32,
    pub at: Timestamp,
}

impl Exit {
    pub fn now(code: i32) -> Self {
        Self {
            code: code as u32,
            at: timestamp().unwrap_or_default(),
        }
    }

    pub fn exited_at(&self) -> MessageField<Timestamp> {
        MessageField::some(self.at.clone())
    }
}

pub struct Process {
    /// Empty for the init process.
    pub exec_id: String,
    pub stdio: Stdio,
    pub pid: i32,
    pub status: Status,
    pub io: ProcessIo,
    /// An exec's process spec (runtime-spec Process JSON).
    pub spec: Vec<u8>,
    exit: watch::Sender<Option<Exit>>,
}

impl Process {
    pub fn new(exec_id: &str, stdio: Stdio) -> Self {
        Self {
            exec_id: exec_id.to_string(),
            stdio,
            pid: 0,
            status: Status::Created,
            io: ProcessIo::default(),
            spec: Vec::new(),
            exit: watch::channel(None).0,
        }
    }

    /// Records the exit; wakes every waiter. A second exit for the same process is ignored.
    pub fn set_exited(&mut self, code: i32) -> Exit {
        if let Some(e) = self.exit.borrow().clone() {
            return e;
        }
        let exit = Exit::now(code);
        self.status = Status::Stopped;
        self.exit.send_replace(Some(exit.clone()));
        exit
    }

    pub fn exit(&self) -> Option<Exit> {
        self.exit.borrow().clone()
    }

    /// A receiver that sees the exit once it happens.
    pub fn exit_watch(&self) -> watch::Receiver<Option<Exit>> {
        self.exit.subscribe()
    }

    pub fn is_stopped(&self) -> bool {
        self.status == Status::Stopped
    }
}

/// The parent pid of `pid`, from `/proc/<pid>/stat`; `None` when it is gone.
pub fn parent_of(pid: i32) -> Option<i32> {
    Some(
        procfs::process::Process::new(pid)
            .and_then(|p| p.stat())
            .ok()?
            .ppid,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn waiters_see_the_first_exit() {
        let mut p = Process::new("", Stdio::default());
        let mut rx = p.exit_watch();
        let waiter = tokio::spawn(async move {
            rx.wait_for(Option::is_some)
                .await
                .unwrap()
                .clone()
                .unwrap()
                .code
        });
        p.set_exited(137);
        p.set_exited(0);
        assert_eq!(waiter.await.unwrap(), 137);
        assert_eq!(p.status, Status::Stopped);
        assert_eq!(p.exit().unwrap().code, 137);
    }
}
