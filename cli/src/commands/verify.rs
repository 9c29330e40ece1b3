//! `gpu-ckpt verify`: every digest (every differing file named), and the signature and its
//! signer as a node with these keys would hold them.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::time::Instant;

use anyhow::Result;
use image_format::archive;
use image_format::manifest::MANIFEST_FILE;
use image_format::oci;
use image_format::safe::Limits;

use super::input::Input;
use super::node::no_manifest;
use super::trust::{self, TrustArgs};
use crate::output::{OutputArgs, Report, Text};
use crate::progress::{human, Bar};

#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// Archive, OCI image (layout directory or tarball), or checkpoint directory.
    pub path: PathBuf,
    #[command(flatten)]
    pub out: OutputArgs,
    #[command(flatten)]
    pub trust: TrustArgs,
    /// With --key or --trusted-keys: accept an unsigned checkpoint, as the handler option
    /// AllowUnsigned = true does. (Without them, an unsigned checkpoint verifies, and its
    /// signer line says it is unsigned.)
    #[arg(long)]
    pub allow_unsigned: bool,
}

pub fn run(a: &VerifyArgs) -> Result<Report> {
    let start = Instant::now();
    let path = a.path.as_path();
    let input = Input::of(path)?;
    // The signature first: a manifest whose signature does not hold, or whose signer a node
    // with these keys refuses, is not verified further.
    let signer = match input {
        Input::Image => serde_json::json!({
            "summary": "see the archive (gpu-ckpt extract IMAGE --archive OUT)"}),
        Input::Dir { manifest: false } => return Err(no_manifest(path)),
        Input::Dir { manifest: true } => {
            let file = path.join(MANIFEST_FILE);
            let json =
                std::fs::read(&file).map_err(|e| image_format::Error::io("reading", &file, e))?;
            trust::signer_report(Some(&json), &a.trust)
        }
        Input::File => {
            let info = archive::read_info(path, Limits::default())?;
            trust::signer_report(info.manifest_json.as_deref(), &a.trust)
        }
    };
    if let Some(refused) = trust::refusal(&signer, &a.trust, a.allow_unsigned) {
        return Err(refused.into());
    }
    let mut bar = Bar::new("verify");
    let checked = match input {
        Input::Dir { .. } => {
            image_format::manifest::verify_dir_every(path, &mut |d, t| bar.update(d, t)).map(|m| {
                let b: u64 = m.files.values().map(|f| f.size).sum();
                (format!("{} files match the manifest", m.files.len()), b)
            })
        }
        Input::Image => verify_image(path, &mut bar),
        Input::File => {
            archive::verify_archive_every(path, Limits::default(), &mut |d, t| bar.update(d, t))
                .map(|r| (archive_summary(&r), r.bytes))
        }
    };
    bar.finish();
    let (summary, bytes) = checked?;
    let secs = start.elapsed().as_secs_f64();
    let mut t = Text::default();
    t.line(format!("verify ok: {summary}"));
    t.line(format!(
        "signer: {}",
        signer["summary"].as_str().unwrap_or_default()
    ));
    let data = serde_json::json!({"ok": true, "summary": summary, "bytes": bytes,
        "seconds": secs, "signer": signer});
    Ok(Report::new(t.0, data))
}

fn archive_summary(r: &archive::VerifyReport) -> String {
    format!(
        "{} checkpoint files match the manifest; {} other members ({}) are not covered by it",
        r.files_verified,
        r.uncovered.len(),
        r.uncovered.keys().cloned().collect::<Vec<_>>().join(", ")
    )
}

/// An image: its layer against its digest, and, in the same pass, the archive the layer is
/// against its manifest (every differing file named).
fn verify_image(path: &Path, bar: &mut Bar) -> image_format::Result<(String, u64)> {
    let (tx, rx) = sync_channel::<Vec<u8>>(16);
    std::thread::scope(|s| {
        let checker = s.spawn(move || {
            let mut r = ChannelReader {
                rx,
                buf: Vec::new(),
                at: 0,
            };
            let res = archive::verify_stream(&mut r, 0, Limits::default(), &mut |_, _| {});
            if res.is_ok() {
                // The tar's end-of-archive padding: read it, so that the layer is hashed whole.
                let _ = io::copy(&mut r, &mut io::sink());
            }
            res
        });
        let mut w = ChannelWriter {
            tx: Some(tx),
            stopped: false,
        };
        let layer = oci::write_layer(path, &mut w, Limits::default(), &mut |d, t| {
            bar.update(d, t)
        });
        let stopped = w.stopped;
        drop(w);
        let inner = checker.join().unwrap_or_else(|_| {
            Err(image_format::Error::Oci {
                what: "layer".into(),
                reason: "the archive's verification panicked".into(),
            })
        });
        match (layer, inner) {
            // The checker stopped reading: its error is the cause.
            (Err(_), Err(e)) if stopped => Err(e),
            (Err(e), _) => Err(e),
            (Ok(_), Err(e)) => Err(e),
            (Ok(n), Ok(r)) => Ok((
                format!(
                    "image layer digest ok ({}); the archive in it: {}",
                    human(n),
                    archive_summary(&r)
                ),
                n,
            )),
        }
    })
}

/// The layer's bytes, handed to the archive's verification in another thread.
struct ChannelWriter {
    tx: Option<SyncSender<Vec<u8>>>,
    /// The reader went away (its verification ended early).
    stopped: bool,
}

impl Write for ChannelWriter {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let sent = self
            .tx
            .as_ref()
            .is_some_and(|tx| tx.send(b.to_vec()).is_ok());
        if !sent {
            self.stopped = true;
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the archive's verification stopped",
            ));
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

struct ChannelReader {
    rx: Receiver<Vec<u8>>,
    buf: Vec<u8>,
    at: usize,
}

impl Read for ChannelReader {
    fn read(&mut self, out: &mut [u8]) -> io::Result<usize> {
        while self.at == self.buf.len() {
            match self.rx.recv() {
                Ok(b) => {
                    self.buf = b;
                    self.at = 0;
                }
                Err(_) => return Ok(0),
            }
        }
        let n = out.len().min(self.buf.len() - self.at);
        out[..n].copy_from_slice(&self.buf[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}
