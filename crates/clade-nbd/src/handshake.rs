//! The fixed-newstyle handshake: greeting, then option haggling until the client picks an export
//! with `NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`, or aborts.
//!
//! Options the server does not know get `NBD_REP_ERR_UNSUP` and haggling goes on; anything that
//! breaks the framing (a wrong magic, unknown client flags, an unknown name for EXPORT_NAME) ends
//! the connection, which is all the protocol allows there.

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::export::Export;
use crate::proto::*;
use crate::server::Exports;

/// Why a handshake ended without an export.
#[derive(Debug, thiserror::Error)]
pub enum HandshakeError {
    #[error("connection I/O during the handshake: {0}")]
    Io(#[from] std::io::Error),
    #[error("client sent unknown handshake flags {0:#x}")]
    ClientFlags(u32),
    #[error("client sent magic {0:#x} where an option (IHAVEOPT) was expected: wrong order or not NBD")]
    BadOptionMagic(u64),
    #[error("client asked for unknown export {0:?} with NBD_OPT_EXPORT_NAME")]
    UnknownExport(String),
    #[error("client aborted the handshake")]
    Aborted,
}

/// What the client and server agreed on.
pub struct Negotiated {
    pub export: Arc<Export>,
    pub structured: bool,
    pub base_allocation: bool,
}

/// Transmission flags for `export`.
pub fn transmission_flags(export: &Export) -> u16 {
    let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA | TFLAG_CAN_MULTI_CONN | TFLAG_SEND_CACHE;
    if export.read_only() {
        f |= TFLAG_READ_ONLY;
    } else {
        f |= TFLAG_SEND_TRIM | TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_FAST_ZERO;
    }
    f
}

struct Haggle<'a, S> {
    io: &'a mut S,
    exports: &'a Exports,
    structured: bool,
    base_allocation: bool,
    out: Vec<u8>,
}

enum Step {
    Continue,
    Go(Arc<Export>),
}

impl<S: AsyncRead + AsyncWrite + Unpin> Haggle<'_, S> {
    async fn reply(&mut self, opt: u32, rep: u32, payload: &[u8]) -> std::io::Result<()> {
        self.out.clear();
        opt_reply(&mut self.out, opt, rep, payload);
        self.io.write_all(&self.out).await
    }

    async fn export_info(&mut self, opt: u32, name: &[u8], export: &Export, infos: &[u16]) -> std::io::Result<()> {
        let mut p = Vec::with_capacity(12);
        p.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        p.extend_from_slice(&export.size().to_be_bytes());
        p.extend_from_slice(&transmission_flags(export).to_be_bytes());
        self.reply(opt, REP_INFO, &p).await?;
        for &info in infos {
            match info {
                INFO_BLOCK_SIZE => {
                    let mut p = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    p.extend_from_slice(&1u32.to_be_bytes());
                    p.extend_from_slice(&4096u32.to_be_bytes());
                    p.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                    self.reply(opt, REP_INFO, &p).await?;
                }
                INFO_NAME => {
                    let mut p = INFO_NAME.to_be_bytes().to_vec();
                    p.extend_from_slice(name);
                    self.reply(opt, REP_INFO, &p).await?;
                }
                _ => {}
            }
        }
        Ok(())
    }

    async fn meta(&mut self, opt: u32, data: &[u8]) -> std::io::Result<()> {
        let Some(req) = parse_meta_request(data) else {
            return self.reply(opt, REP_ERR_INVALID, b"malformed meta context request").await;
        };
        if opt == OPT_SET_META_CONTEXT && !self.structured {
            return self.reply(opt, REP_ERR_INVALID, b"negotiate structured replies first").await;
        }
        if self.exports.get(req.name).is_none() {
            return self.reply(opt, REP_ERR_UNKNOWN, b"no such export").await;
        }
        let mut selected = false;
        let list_all = opt == OPT_LIST_META_CONTEXT && req.queries.is_empty();
        let wanted = list_all
            || req.queries.iter().any(|q| {
                *q == META_BASE_ALLOCATION.as_bytes()
                    || (opt == OPT_LIST_META_CONTEXT && (*q == b"base:" || q.is_empty()))
            });
        if wanted {
            let mut p = META_BASE_ALLOCATION_ID.to_be_bytes().to_vec();
            p.extend_from_slice(META_BASE_ALLOCATION.as_bytes());
            self.reply(opt, REP_META_CONTEXT, &p).await?;
            selected = true;
        }
        if opt == OPT_SET_META_CONTEXT {
            self.base_allocation = selected;
        }
        self.reply(opt, REP_ACK, &[]).await
    }

    async fn option(&mut self, opt: u32, data: Vec<u8>, client_flags: u32) -> Result<Step, HandshakeError> {
        match opt {
            OPT_EXPORT_NAME => {
                let export = self
                    .exports
                    .get(&data)
                    .ok_or_else(|| HandshakeError::UnknownExport(String::from_utf8_lossy(&data).into_owned()))?;
                self.out.clear();
                self.out.extend_from_slice(&export.size().to_be_bytes());
                self.out.extend_from_slice(&transmission_flags(&export).to_be_bytes());
                if client_flags & FLAG_C_NO_ZEROES == 0 {
                    self.out.extend_from_slice(&[0u8; 124]);
                }
                self.io.write_all(&self.out).await?;
                return Ok(Step::Go(export));
            }
            OPT_ABORT => {
                // The client may already have closed; a failed ACK changes nothing.
                let _ = self.reply(opt, REP_ACK, &[]).await;
                return Err(HandshakeError::Aborted);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    self.reply(opt, REP_ERR_INVALID, b"NBD_OPT_LIST takes no data").await?;
                } else {
                    for name in self.exports.names() {
                        let mut p = (name.len() as u32).to_be_bytes().to_vec();
                        p.extend_from_slice(name.as_bytes());
                        self.reply(opt, REP_SERVER, &p).await?;
                    }
                    self.reply(opt, REP_ACK, &[]).await?;
                }
            }
            OPT_INFO | OPT_GO => match parse_info_request(&data) {
                None => self.reply(opt, REP_ERR_INVALID, b"malformed info request").await?,
                Some(req) => match self.exports.get(req.name) {
                    None => self.reply(opt, REP_ERR_UNKNOWN, b"no such export").await?,
                    Some(export) => {
                        self.export_info(opt, req.name, &export, &req.infos).await?;
                        self.reply(opt, REP_ACK, &[]).await?;
                        if opt == OPT_GO {
                            return Ok(Step::Go(export));
                        }
                    }
                },
            },
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    self.reply(opt, REP_ERR_INVALID, b"NBD_OPT_STRUCTURED_REPLY takes no data").await?;
                } else if self.structured {
                    self.reply(opt, REP_ERR_INVALID, b"structured replies already negotiated").await?;
                } else {
                    self.structured = true;
                    self.reply(opt, REP_ACK, &[]).await?;
                }
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => self.meta(opt, &data).await?,
            OPT_STARTTLS => self.reply(opt, REP_ERR_POLICY, b"TLS is not offered on this socket").await?,
            _ => self.reply(opt, REP_ERR_UNSUP, b"option not supported").await?,
        }
        Ok(Step::Continue)
    }
}

/// Runs the server side of the handshake on `io`.
pub async fn negotiate<S: AsyncRead + AsyncWrite + Unpin>(
    io: &mut S,
    exports: &Exports,
) -> Result<Negotiated, HandshakeError> {
    let mut greet = Vec::with_capacity(18);
    greet.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greet.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greet.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    io.write_all(&greet).await?;
    let client_flags = io.read_u32().await?;
    if client_flags & !(FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES) != 0 {
        return Err(HandshakeError::ClientFlags(client_flags));
    }
    let mut h = Haggle { io, exports, structured: false, base_allocation: false, out: Vec::new() };
    loop {
        let magic = h.io.read_u64().await?;
        if magic != IHAVEOPT {
            return Err(HandshakeError::BadOptionMagic(magic));
        }
        let opt = h.io.read_u32().await?;
        let len = h.io.read_u32().await?;
        if len > MAX_OPTION_LEN {
            // Skip the payload to stay in sync, then refuse it.
            tokio::io::copy(&mut (&mut *h.io).take(u64::from(len)), &mut tokio::io::sink()).await?;
            if opt == OPT_EXPORT_NAME {
                return Err(HandshakeError::UnknownExport("<too long>".into()));
            }
            h.reply(opt, REP_ERR_TOO_BIG, b"option payload too large").await?;
            continue;
        }
        let mut data = vec![0u8; len as usize];
        h.io.read_exact(&mut data).await?;
        if let Step::Go(export) = h.option(opt, data, client_flags).await? {
            h.io.flush().await?;
            return Ok(Negotiated { export, structured: h.structured, base_allocation: h.base_allocation });
        }
    }
}
