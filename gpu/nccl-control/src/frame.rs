//! Frames: a 4-byte big-endian length, then that many bytes of JSON.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::{Duration, Instant};

use serde::de::DeserializeOwned;
use serde::Serialize;

use crate::{ControlError, MAX_FRAME};

/// Writes `msg` as one frame. A message over [`MAX_FRAME`] is refused before anything is written.
pub fn write_frame<W: Write, T: Serialize>(w: &mut W, msg: &T) -> Result<(), ControlError> {
    let body = serde_json::to_vec(msg).map_err(ControlError::Encode)?;
    if body.len() > MAX_FRAME {
        return Err(ControlError::TooLarge {
            len: body.len(),
            max: MAX_FRAME,
            sending: true,
        });
    }
    let mut frame = Vec::with_capacity(4 + body.len());
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    w.write_all(&frame).map_err(ControlError::io("write"))?;
    w.flush().map_err(ControlError::io("flush"))
}

/// Reads one frame and decodes it. A length over [`MAX_FRAME`] is refused before its body is
/// read; the end of the stream before a frame is [`ControlError::Closed`], inside one
/// [`ControlError::Truncated`].
pub fn read_frame<R: Read, T: DeserializeOwned>(r: &mut R) -> Result<T, ControlError> {
    read_frame_within(r, 0)
}

/// [`read_frame`] on a reader whose reads time out after `timeout_ms` (for the error's text).
fn read_frame_within<R: Read, T: DeserializeOwned>(
    r: &mut R,
    timeout_ms: u64,
) -> Result<T, ControlError> {
    let mut len = [0u8; 4];
    match fill(r, &mut len) {
        Ok(()) => {}
        Err((0, e)) if e.kind() == io::ErrorKind::UnexpectedEof => {
            return Err(ControlError::Closed)
        }
        Err((0, e)) if is_timeout(&e) => return Err(ControlError::Timeout { ms: timeout_ms }),
        Err((got, source)) => {
            return Err(ControlError::Truncated {
                got,
                want: 4,
                source,
            })
        }
    }
    let len = u32::from_be_bytes(len) as usize;
    if len > MAX_FRAME {
        return Err(ControlError::TooLarge {
            len,
            max: MAX_FRAME,
            sending: false,
        });
    }
    let mut body = vec![0u8; len];
    fill(r, &mut body).map_err(|(got, source)| ControlError::Truncated {
        got: 4 + got,
        want: 4 + len,
        source,
    })?;
    serde_json::from_slice(&body).map_err(ControlError::Malformed)
}

/// Reads exactly `buf.len()` bytes; on failure, how many arrived and why it stopped.
fn fill<R: Read>(r: &mut R, buf: &mut [u8]) -> Result<(), (usize, io::Error)> {
    let mut got = 0;
    while got < buf.len() {
        match r.read(&mut buf[got..]) {
            Ok(0) => return Err((got, io::ErrorKind::UnexpectedEof.into())),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err((got, e)),
        }
    }
    Ok(())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// One end of a control connection: a Unix stream with frame I/O and timeouts.
#[derive(Debug)]
pub struct Connection {
    stream: UnixStream,
}

impl Connection {
    /// Connects to the socket at `path` without ever waiting: a listener whose queue is full
    /// (nobody accepts) fails at once (`EAGAIN`), as a missing one does, so that a caller that
    /// tries again on a timer is never stuck in `connect` (nor frozen there by a checkpoint).
    pub fn connect(path: &Path) -> Result<Connection, ControlError> {
        use std::os::fd::FromRawFd;
        use std::os::unix::ffi::OsStrExt;
        let bytes = path.as_os_str().as_bytes();
        // SAFETY: a plain C struct; all zeroes is a valid (empty) address.
        let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
        if bytes.len() >= addr.sun_path.len() || bytes.contains(&0) {
            return Err(ControlError::Io {
                op: "connect",
                source: io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("{} is not a usable socket path", path.display()),
                ),
            });
        }
        addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
        for (d, s) in addr.sun_path.iter_mut().zip(bytes) {
            *d = *s as libc::c_char;
        }
        let flags = libc::SOCK_STREAM | libc::SOCK_CLOEXEC | libc::SOCK_NONBLOCK;
        // SAFETY: socket(2) with constant arguments.
        let fd = unsafe { libc::socket(libc::AF_UNIX, flags, 0) };
        if fd < 0 {
            return Err(ControlError::io("socket")(io::Error::last_os_error()));
        }
        // SAFETY: a descriptor just made and owned by nothing else: the stream closes it.
        let stream = unsafe { UnixStream::from_raw_fd(fd) };
        let len = std::mem::size_of::<libc::sa_family_t>() + bytes.len() + 1;
        // SAFETY: a valid address of `len` bytes for this socket.
        let r = unsafe {
            libc::connect(
                fd,
                (&addr as *const libc::sockaddr_un).cast(),
                len as libc::socklen_t,
            )
        };
        if r != 0 {
            return Err(ControlError::io("connect")(io::Error::last_os_error()));
        }
        stream
            .set_nonblocking(false)
            .map_err(ControlError::io("set blocking"))?;
        Ok(Connection { stream })
    }

    /// Wraps an accepted or connected stream.
    pub fn new(stream: UnixStream) -> Connection {
        Connection { stream }
    }

    /// A second handle on the same connection (one thread reads while another writes).
    pub fn try_clone(&self) -> Result<Connection, ControlError> {
        let stream = self.stream.try_clone().map_err(ControlError::io("clone"))?;
        Ok(Connection { stream })
    }

    /// Sends `msg`; a write that blocks longer than `timeout` (None: no bound) fails.
    pub fn send<T: Serialize>(
        &mut self,
        msg: &T,
        timeout: Option<Duration>,
    ) -> Result<(), ControlError> {
        self.stream
            .set_write_timeout(timeout.map(nonzero))
            .map_err(ControlError::io("set write timeout"))?;
        write_frame(&mut self.stream, msg)
    }

    /// Receives one message. With a timeout, [`ControlError::Timeout`] when no frame begins in
    /// time (the connection stays usable); a frame that began must go on arriving, each read
    /// within the same timeout, or the result is [`ControlError::Truncated`].
    pub fn recv<T: DeserializeOwned>(
        &mut self,
        timeout: Option<Duration>,
    ) -> Result<T, ControlError> {
        self.stream
            .set_read_timeout(timeout.map(nonzero))
            .map_err(ControlError::io("set read timeout"))?;
        let ms = timeout.map_or(0, |t| t.as_millis() as u64);
        read_frame_within(&mut self.stream, ms)
    }

    /// Receives one message that must arrive whole by `deadline`: one bound for the frame,
    /// however slowly its bytes come ([`ControlError::Timeout`] when none had come,
    /// [`ControlError::Truncated`] when some had).
    pub fn recv_by<T: DeserializeOwned>(&mut self, deadline: Instant) -> Result<T, ControlError> {
        let ms = deadline
            .saturating_duration_since(Instant::now())
            .as_millis() as u64;
        let mut r = ByDeadline {
            stream: &self.stream,
            deadline,
        };
        read_frame_within(&mut r, ms)
    }

    /// Closes both directions (the peer sees the end of the stream; other handles on the
    /// connection too).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    /// The underlying stream.
    pub fn stream(&self) -> &UnixStream {
        &self.stream
    }
}

/// Reads of a stream, each bounded by what is left until one deadline.
struct ByDeadline<'a> {
    stream: &'a UnixStream,
    deadline: Instant,
}

impl Read for ByDeadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.stream.set_read_timeout(Some(nonzero(left)))?;
        let mut s = self.stream;
        s.read(buf)
    }
}

/// A socket timeout of zero means "none" to the kernel: the smallest bound instead.
fn nonzero(d: Duration) -> Duration {
    d.max(Duration::from_millis(1))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{LayerMsg, ShimMsg, Split};
    use std::io::Cursor;

    fn frame_of(body: &[u8]) -> Vec<u8> {
        let mut v = (body.len() as u32).to_be_bytes().to_vec();
        v.extend_from_slice(body);
        v
    }

    #[test]
    fn every_message_round_trips() {
        let layer = vec![
            LayerMsg::Hello {
                version: 1,
                pid: 42,
                nccl_version: 23206,
                resumed: Some("t1".into()),
            },
            LayerMsg::Comm {
                id: 3,
                key: "ab/1".into(),
                rank: 1,
                nranks: 2,
                cuda_dev: 0,
                split: Some(Split {
                    parent: 1,
                    color: 1,
                    key: -1,
                }),
            },
            LayerMsg::CommGone { id: 3 },
            LayerMsg::Holding {
                issued: vec![(1, 7), (3, 0)],
            },
            LayerMsg::Quiesced { comms: vec![1, 3] },
            LayerMsg::Released { suspended: true },
            LayerMsg::Released { suspended: false },
            LayerMsg::UniqueId {
                key: "k".into(),
                id: "00".repeat(128),
            },
            LayerMsg::Rebuilt,
            LayerMsg::Failed {
                comm: Some(1),
                rank: Some(0),
                message: "stuck".into(),
            },
        ];
        let shim = vec![
            ShimMsg::Welcome { token: "t".into() },
            ShimMsg::Quiesce { deadline_ms: 1 },
            ShimMsg::Drain {
                targets: vec![(1, 8)],
                deadline_ms: 2,
            },
            ShimMsg::Release,
            ShimMsg::Disconnect,
            ShimMsg::Resume,
            ShimMsg::Rebuild {
                ids: vec![("a".into(), "b".into())],
            },
            ShimMsg::Go,
            ShimMsg::NewUniqueId { key: "k".into() },
        ];
        let mut buf = Vec::new();
        for m in &layer {
            write_frame(&mut buf, m).unwrap();
        }
        for m in &shim {
            write_frame(&mut buf, m).unwrap();
        }
        let mut r = Cursor::new(buf);
        for m in &layer {
            assert_eq!(&read_frame::<_, LayerMsg>(&mut r).unwrap(), m);
        }
        for m in &shim {
            assert_eq!(&read_frame::<_, ShimMsg>(&mut r).unwrap(), m);
        }
        assert!(matches!(
            read_frame::<_, ShimMsg>(&mut r),
            Err(ControlError::Closed)
        ));
    }

    #[test]
    fn limit_is_inclusive_and_checked_before_the_body() {
        // A body of exactly MAX_FRAME bytes passes the length check (then fails as JSON: it is
        // a string with no end).
        let mut body = vec![b' '; MAX_FRAME];
        body[0] = b'"';
        let at_limit = frame_of(&body);
        assert!(matches!(
            read_frame::<_, ShimMsg>(&mut Cursor::new(at_limit)),
            Err(ControlError::Malformed(_))
        ));
        // One more byte is refused from the header alone: only 4 bytes are consumed.
        let over = (MAX_FRAME as u32 + 1).to_be_bytes();
        let mut r = Cursor::new(over.to_vec());
        match read_frame::<_, ShimMsg>(&mut r) {
            Err(ControlError::TooLarge { len, max, sending }) => {
                assert_eq!((len, max, sending), (MAX_FRAME + 1, MAX_FRAME, false))
            }
            other => panic!("expected TooLarge, got {other:?}"),
        }
        assert_eq!(r.position(), 4);
        let huge = u32::MAX.to_be_bytes();
        assert!(matches!(
            read_frame::<_, ShimMsg>(&mut Cursor::new(huge.to_vec())),
            Err(ControlError::TooLarge { .. })
        ));
    }

    #[test]
    fn oversize_message_is_not_sent() {
        let big = LayerMsg::Failed {
            comm: None,
            rank: None,
            message: "x".repeat(MAX_FRAME),
        };
        let mut buf = Vec::new();
        assert!(matches!(
            write_frame(&mut buf, &big),
            Err(ControlError::TooLarge { sending: true, .. })
        ));
        assert!(buf.is_empty());
        // The largest message that fits goes through.
        let overhead = serde_json::to_vec(&LayerMsg::Failed {
            comm: None,
            rank: None,
            message: String::new(),
        })
        .unwrap()
        .len();
        let fits = LayerMsg::Failed {
            comm: None,
            rank: None,
            message: "x".repeat(MAX_FRAME - overhead),
        };
        write_frame(&mut buf, &fits).unwrap();
        assert_eq!(buf.len(), 4 + MAX_FRAME);
        assert_eq!(
            read_frame::<_, LayerMsg>(&mut Cursor::new(buf)).unwrap(),
            fits
        );
    }

    #[test]
    fn malformed_and_truncated_frames_are_refused() {
        for body in [
            &b"not json"[..],
            br#"{"Unknown":{}}"#,
            br#"{"Quiesce":{"deadline_ms":"soon"}}"#,
            br#"{"Quiesce":{}}"#,
            br#""Go" trailing"#,
            b"",
        ] {
            let r = read_frame::<_, ShimMsg>(&mut Cursor::new(frame_of(body)));
            assert!(
                matches!(r, Err(ControlError::Malformed(_))),
                "{:?}: {r:?}",
                String::from_utf8_lossy(body)
            );
        }
        // A layer message is not a shim message.
        let mut buf = Vec::new();
        write_frame(&mut buf, &LayerMsg::Released { suspended: true }).unwrap();
        assert!(matches!(
            read_frame::<_, ShimMsg>(&mut Cursor::new(buf)),
            Err(ControlError::Malformed(_))
        ));
        // Cut in the header, and in the body.
        assert!(matches!(
            read_frame::<_, ShimMsg>(&mut Cursor::new(vec![0, 0])),
            Err(ControlError::Truncated {
                got: 2,
                want: 4,
                ..
            })
        ));
        let mut cut = frame_of(br#""Go""#);
        cut.truncate(6);
        assert!(matches!(
            read_frame::<_, ShimMsg>(&mut Cursor::new(cut)),
            Err(ControlError::Truncated {
                got: 6,
                want: 8,
                ..
            })
        ));
    }

    #[test]
    fn connection_timeouts_on_a_socket() {
        let (a, b) = UnixStream::pair().unwrap();
        let (mut a, mut b) = (Connection::new(a), Connection::new(b));
        // Nothing sent: a timeout, and the connection stays usable.
        let t0 = Instant::now();
        assert!(matches!(
            b.recv::<ShimMsg>(Some(Duration::from_millis(50))),
            Err(ControlError::Timeout { ms: 50 })
        ));
        assert!(t0.elapsed() >= Duration::from_millis(45));
        a.send(&ShimMsg::Go, Some(Duration::from_secs(1))).unwrap();
        assert_eq!(b.recv::<ShimMsg>(None).unwrap(), ShimMsg::Go);
        // A frame that stalls after its header is cut short, not waited for forever.
        use std::io::Write as _;
        a.stream.write_all(&10u32.to_be_bytes()).unwrap();
        a.stream.write_all(b"{").unwrap();
        assert!(matches!(
            b.recv::<ShimMsg>(Some(Duration::from_millis(50))),
            Err(ControlError::Truncated {
                got: 5,
                want: 14,
                ..
            })
        ));
        // The peer's close is seen as Closed.
        drop(a);
        let (c, d) = UnixStream::pair().unwrap();
        let mut d = Connection::new(d);
        drop(c);
        assert!(matches!(
            d.recv::<ShimMsg>(Some(Duration::from_millis(50))),
            Err(ControlError::Closed)
        ));
        // A listener nobody accepts from: connecting fails at once when its queue is full,
        // never waits.
        let dir = std::env::temp_dir().join(format!("nccl-control-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("full.sock");
        let _ = std::fs::remove_file(&path);
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        let p = path.clone();
        std::thread::spawn(move || {
            let mut held = Vec::new();
            let end = loop {
                match Connection::connect(&p) {
                    Ok(c) => held.push(c),
                    Err(e) => break (held.len(), e.to_string()),
                }
                if held.len() > 100_000 {
                    break (held.len(), String::new());
                }
            };
            let _ = tx.send(end);
        });
        let (queued, err) = rx
            .recv_timeout(Duration::from_secs(10))
            .expect("connect waited on a full listen queue");
        assert!(queued > 0, "{err}");
        assert!(
            err.starts_with("control socket connect:"),
            "{queued}: {err}"
        );
        drop(listener);
        assert!(Connection::connect(&path).is_err(), "no listener");
        let _ = std::fs::remove_dir_all(&dir);
        // An oversize header on a socket is refused without waiting for the body.
        let (mut e, f) = UnixStream::pair().unwrap();
        let mut f = Connection::new(f);
        e.write_all(&(1u32 << 20).to_be_bytes()).unwrap();
        assert!(matches!(
            f.recv::<ShimMsg>(None),
            Err(ControlError::TooLarge { .. })
        ));
    }

    #[test]
    fn a_frame_trickled_in_ends_at_the_one_deadline() {
        let (a, b) = UnixStream::pair().unwrap();
        let mut reader = Connection::new(b);
        let writer = std::thread::spawn(move || {
            let mut a = a;
            // A byte every 100 ms: each read is quick, the frame never ends.
            let _ = a.write_all(&[0, 0, 0, 50]);
            for _ in 0..40 {
                std::thread::sleep(Duration::from_millis(100));
                if a.write_all(b" ").is_err() {
                    return;
                }
            }
        });
        let t = Instant::now();
        let r = reader.recv_by::<LayerMsg>(Instant::now() + Duration::from_millis(700));
        assert!(matches!(r, Err(ControlError::Truncated { .. })), "{r:?}");
        assert!(
            t.elapsed() < Duration::from_millis(1500),
            "{:?}",
            t.elapsed()
        );
        drop(reader);
        writer.join().unwrap();
    }
}
