//! A blocking connection to the daemon, used by both libraries, the control commands and tests.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;

use crate::proto::{self, Reply, Request, Role};

/// Request failed: the connection broke (`Io`), or the daemon answered with an error code.
#[derive(Debug, thiserror::Error)]
pub enum CallError {
    #[error("gpu-ckpt-simgpu connection: {0}")]
    Io(#[from] io::Error),
    #[error("{msg} (CUresult {code})")]
    Driver { code: u32, msg: String },
    #[error("unexpected reply from gpu-ckpt-simgpu: {0}")]
    Unexpected(String),
}

impl CallError {
    /// The CUresult this error stands for (a broken connection is CUDA_ERROR_OPERATING_SYSTEM,
    /// as when the real driver's device node goes away).
    pub fn code(&self) -> u32 {
        match self {
            CallError::Io(_) => crate::cuerr::cu::OPERATING_SYSTEM,
            CallError::Driver { code, .. } => *code,
            CallError::Unexpected(_) => crate::cuerr::cu::UNKNOWN,
        }
    }
}

pub struct Client {
    pub stream: UnixStream,
}

impl Client {
    pub fn connect(socket: &Path, role: Role) -> Result<Client, CallError> {
        let stream = UnixStream::connect(socket)?;
        let mut c = Client { stream };
        c.ok(&Request::Hello { role })?;
        Ok(c)
    }

    /// Sends a request and reads the reply header; an `Err` reply becomes `CallError::Driver`.
    pub fn call(&mut self, req: &Request) -> Result<Reply, CallError> {
        proto::send(&mut self.stream, req)?;
        self.reply()
    }

    fn reply(&mut self) -> Result<Reply, CallError> {
        match proto::recv(&mut self.stream)? {
            Reply::Err { code, msg } => Err(CallError::Driver { code, msg }),
            r => Ok(r),
        }
    }

    /// A request whose only good answer is `Ok`.
    pub fn ok(&mut self, req: &Request) -> Result<(), CallError> {
        match self.call(req)? {
            Reply::Ok => Ok(()),
            r => Err(CallError::Unexpected(format!("{r:?}"))),
        }
    }

    /// A copy the daemon makes straight from or into this process's memory: `true` when it did,
    /// `false` when it cannot (the caller then sends the bytes through the socket).
    fn direct(&mut self, req: &Request) -> Result<bool, CallError> {
        match self.call(req) {
            Ok(Reply::Ok) => Ok(true),
            Err(CallError::Driver { code, .. }) if code == crate::cuerr::cu::OPERATING_SYSTEM => {
                Ok(false)
            }
            Ok(r) => Err(CallError::Unexpected(format!("{r:?}"))),
            Err(e) => Err(e),
        }
    }

    /// Host to device: the daemon reads a large copy from this process's memory itself;
    /// otherwise (or if it cannot) the header, then the bytes.
    pub fn htod(&mut self, dst: u64, src: &[u8]) -> Result<(), CallError> {
        if src.len() >= proto::DIRECT_MIN
            && self.direct(&Request::HtoDDirect {
                dst,
                len: src.len() as u64,
                addr: src.as_ptr() as u64,
            })?
        {
            return Ok(());
        }
        proto::send(
            &mut self.stream,
            &Request::HtoD {
                dst,
                len: src.len() as u64,
            },
        )?;
        self.stream.write_all(src)?;
        match self.reply()? {
            Reply::Ok => Ok(()),
            r => Err(CallError::Unexpected(format!("{r:?}"))),
        }
    }

    /// Device to host into `dst`: a large copy written by the daemon straight into this
    /// process's memory, else (or if it cannot) through the socket.
    pub fn dtoh(&mut self, dst: &mut [u8], src: u64) -> Result<(), CallError> {
        if dst.len() >= proto::DIRECT_MIN
            && self.direct(&Request::DtoHDirect {
                src,
                len: dst.len() as u64,
                addr: dst.as_mut_ptr() as u64,
            })?
        {
            return Ok(());
        }
        match self.call(&Request::DtoH {
            src,
            len: dst.len() as u64,
        })? {
            Reply::Data { len } if len == dst.len() as u64 => {
                self.stream.read_exact(dst)?;
                Ok(())
            }
            r => Err(CallError::Unexpected(format!("{r:?}"))),
        }
    }
}
