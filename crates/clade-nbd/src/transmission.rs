//! The transmission phase of one connection: a reader that parses requests and spawns one task per
//! request, and a writer that sends replies in whatever order they finish.
//!
//! Data commands run on the blocking pool (the base may read from disk); replies are whole frames
//! sent through a channel to the writer, which batches them into as few syscalls as it can. A
//! per-connection byte budget bounds the memory of requests in flight.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufReader, BufWriter};
use tokio::sync::{mpsc, OwnedSemaphorePermit, Semaphore};

use crate::export::{Export, ExportError};
use crate::handshake::Negotiated;
use crate::proto::*;

/// Budget of bytes in flight per connection (requests running and replies not yet written), in
/// 4 KiB permits (64 MiB).
const BUDGET_PERMITS: u32 = 16 * 1024;

/// Why a connection's transmission phase ended abnormally.
#[derive(Debug, thiserror::Error)]
pub enum TransmissionError {
    #[error("connection I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("{0}")]
    Frame(#[from] FrameError),
}

#[derive(Clone, Copy)]
struct Mode {
    structured: bool,
    base_allocation: bool,
}

fn error_reply(mode: Mode, cookie: u64, errno: u32, msg: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    if mode.structured {
        chunk_error(&mut out, cookie, errno, msg);
    } else {
        simple_reply(&mut out, errno, cookie);
    }
    out
}

fn ok_reply(mode: Mode, cookie: u64) -> Vec<u8> {
    let mut out = Vec::with_capacity(20);
    if mode.structured {
        chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_NONE, cookie, 0);
    } else {
        simple_reply(&mut out, 0, cookie);
    }
    out
}

fn export_error(mode: Mode, req: &Request, e: &ExportError, write: bool) -> Vec<u8> {
    if let ExportError::Io { .. } = e {
        tracing::error!(cookie = req.cookie, offset = req.offset, len = req.len, "EIO: {e}");
    } else {
        tracing::debug!(cookie = req.cookie, "request refused: {e}");
    }
    error_reply(mode, req.cookie, e.errno(write), &e.to_string())
}

fn do_read(export: &Export, mode: Mode, req: &Request) -> Vec<u8> {
    let len = req.len as usize;
    let (mut out, head) = if mode.structured {
        let mut out = Vec::with_capacity(28 + len);
        chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, req.cookie, 8 + req.len);
        out.extend_from_slice(&req.offset.to_be_bytes());
        (out, 28)
    } else {
        let mut out = Vec::with_capacity(16 + len);
        simple_reply(&mut out, 0, req.cookie);
        (out, 16)
    };
    out.resize(head + len, 0);
    match export.read(req.offset, &mut out[head..]) {
        Ok(()) => out,
        Err(e) => export_error(mode, req, &e, false),
    }
}

fn do_block_status(export: &Export, mode: Mode, req: &Request) -> Vec<u8> {
    if !mode.base_allocation {
        return error_reply(mode, req.cookie, EINVAL, "no metadata context was negotiated");
    }
    if req.len == 0 {
        return error_reply(mode, req.cookie, EINVAL, "block status of an empty range");
    }
    let extents = match export.extents(req.offset, u64::from(req.len)) {
        Ok(e) => e,
        Err(e) => return export_error(mode, req, &e, false),
    };
    let take = if req.flags & CMD_FLAG_REQ_ONE != 0 { 1 } else { extents.len() };
    let mut body = META_BASE_ALLOCATION_ID.to_be_bytes().to_vec();
    for e in extents.iter().take(take) {
        let flags = if e.zero { STATE_HOLE | STATE_ZERO } else { 0 };
        // Requests are at most u32::MAX long, so every extent fits.
        body.extend_from_slice(&(e.len.min(u64::from(u32::MAX)) as u32).to_be_bytes());
        body.extend_from_slice(&flags.to_be_bytes());
    }
    let mut out = Vec::with_capacity(20 + body.len());
    chunk_header(&mut out, REPLY_FLAG_DONE, REPLY_TYPE_BLOCK_STATUS, req.cookie, body.len() as u32);
    out.extend_from_slice(&body);
    out
}

/// Runs one request to completion and returns its reply frame.
fn handle(export: &Export, mode: Mode, req: Request, payload: Vec<u8>) -> Vec<u8> {
    let len = u64::from(req.len);
    let result = match req.cmd {
        Cmd::Read => return do_read(export, mode, &req),
        Cmd::BlockStatus => return do_block_status(export, mode, &req),
        Cmd::Write => export.write(req.offset, &payload),
        Cmd::WriteZeroes => export.write_zeroes(req.offset, len),
        Cmd::Trim => export.trim(req.offset, len),
        Cmd::Flush | Cmd::Cache => Ok(()),
        Cmd::Disc | Cmd::Unknown(_) => return error_reply(mode, req.cookie, EINVAL, "unknown command"),
    };
    match result {
        Ok(()) => ok_reply(mode, req.cookie),
        Err(e) => export_error(mode, &req, &e, matches!(req.cmd, Cmd::Write | Cmd::WriteZeroes)),
    }
}

/// A reply frame and the share of the connection's budget it holds until it is written.
type Reply = (Vec<u8>, Option<OwnedSemaphorePermit>);

async fn writer<W: AsyncWrite + Unpin>(w: W, mut rx: mpsc::UnboundedReceiver<Reply>) -> std::io::Result<()> {
    let mut w = BufWriter::with_capacity(256 << 10, w);
    while let Some((frame, permit)) = rx.recv().await {
        w.write_all(&frame).await?;
        drop(permit);
        while let Ok((more, permit)) = rx.try_recv() {
            w.write_all(&more).await?;
            drop(permit);
        }
        w.flush().await?;
    }
    w.shutdown().await.ok();
    Ok(())
}

/// Serves requests read from `r`, replying on `w`, until the client disconnects or breaks the
/// framing. Pass owned halves of a socket (`UnixStream::into_split`) where you can: they need no
/// lock between reader and writer, unlike `tokio::io::split`.
pub async fn serve<R, W>(r: R, w: W, neg: Negotiated) -> Result<(), TransmissionError>
where
    R: AsyncRead + Unpin + Send + 'static,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let mode = Mode { structured: neg.structured, base_allocation: neg.base_allocation };
    let export = neg.export;
    let mut r = BufReader::with_capacity(256 << 10, r);
    let (tx, rx) = mpsc::unbounded_channel::<Reply>();
    let writer = tokio::spawn(writer(w, rx));
    let budget = Arc::new(Semaphore::new(BUDGET_PERMITS as usize));
    let mut header = [0u8; REQUEST_LEN];
    let result: Result<(), TransmissionError> = loop {
        match r.read_exact(&mut header).await {
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => break Ok(()),
            Err(e) => break Err(e.into()),
        }
        let req = match parse_request(&header) {
            Ok(req) => req,
            Err(e) => break Err(e.into()),
        };
        if req.cmd == Cmd::Disc {
            break Ok(());
        }
        let is_write = req.cmd == Cmd::Write;
        let refusal = if req.flags
            & !(CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_DF | CMD_FLAG_REQ_ONE | CMD_FLAG_FAST_ZERO)
            != 0
        {
            Some((EINVAL, "unknown command flags"))
        } else if matches!(req.cmd, Cmd::Read | Cmd::Write) && req.len > MAX_PAYLOAD {
            Some((if is_write { ENOSPC } else { EINVAL }, "request larger than the 32 MiB maximum"))
        } else if let Cmd::Unknown(_) = req.cmd {
            Some((EINVAL, "unknown command"))
        } else {
            None
        };
        if let Some((errno, msg)) = refusal {
            if is_write {
                // The payload follows the header whatever we think of it: skip it to stay in sync.
                if let Err(e) = tokio::io::copy(&mut (&mut r).take(u64::from(req.len)), &mut tokio::io::sink()).await {
                    break Err(e.into());
                }
            }
            tracing::debug!(cookie = req.cookie, ?req.cmd, "refused: {msg}");
            if tx.send((error_reply(mode, req.cookie, errno, msg), None)).is_err() {
                break Ok(());
            }
            continue;
        }
        let weight =
            if matches!(req.cmd, Cmd::Read | Cmd::Write) { (req.len / 4096).clamp(1, BUDGET_PERMITS) } else { 1 };
        let permit = match budget.clone().acquire_many_owned(weight).await {
            Ok(p) => p,
            Err(_) => break Ok(()),
        };
        let mut payload = Vec::new();
        if is_write {
            payload.resize(req.len as usize, 0);
            if let Err(e) = r.read_exact(&mut payload).await {
                break Err(e.into());
            }
        }
        let export = export.clone();
        let tx = tx.clone();
        // The request runs on the blocking pool (the base may read from disk) and hands its reply
        // straight to the writer; a send error means the connection is gone and so is the reply.
        tokio::task::spawn_blocking(move || {
            let frame = handle(&export, mode, req, payload);
            let _ = tx.send((frame, Some(permit)));
        });
    };
    drop(tx);
    // Requests in flight still hold senders: the writer ends after their replies are sent.
    let written = writer.await.map_err(std::io::Error::other)?;
    result?;
    written?;
    Ok(())
}
