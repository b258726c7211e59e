//! NBD wire format: the constants of the protocol and pure functions that parse client frames and
//! encode server frames.
//!
//! Everything here works on byte slices and never does I/O, so the request parser can be fuzzed on
//! its own (`fuzz/nbd`) and every frame the server sends is built in one place. Numbers and names
//! follow the NBD protocol document (`doc/proto.md` of the reference implementation).

/// `NBDMAGIC`, the first word a newstyle server sends.
pub const NBDMAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`, sent by the server after `NBDMAGIC` and by the client before each option.
pub const IHAVEOPT: u64 = 0x4948_4156_454F_5054;
/// Magic of every option reply.
pub const OPT_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Magic of a transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Magic of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Magic of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server to client).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags.
pub const FLAG_C_FIXED_NEWSTYLE: u32 = 1 << 0;
pub const FLAG_C_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags.
pub const TFLAG_HAS_FLAGS: u16 = 1 << 0;
pub const TFLAG_READ_ONLY: u16 = 1 << 1;
pub const TFLAG_SEND_FLUSH: u16 = 1 << 2;
pub const TFLAG_SEND_FUA: u16 = 1 << 3;
pub const TFLAG_SEND_TRIM: u16 = 1 << 5;
pub const TFLAG_SEND_WRITE_ZEROES: u16 = 1 << 6;
pub const TFLAG_SEND_DF: u16 = 1 << 7;
pub const TFLAG_CAN_MULTI_CONN: u16 = 1 << 8;
pub const TFLAG_SEND_CACHE: u16 = 1 << 10;
pub const TFLAG_SEND_FAST_ZERO: u16 = 1 << 11;

/// Option types.
pub const OPT_EXPORT_NAME: u32 = 1;
pub const OPT_ABORT: u32 = 2;
pub const OPT_LIST: u32 = 3;
pub const OPT_STARTTLS: u32 = 5;
pub const OPT_INFO: u32 = 6;
pub const OPT_GO: u32 = 7;
pub const OPT_STRUCTURED_REPLY: u32 = 8;
pub const OPT_LIST_META_CONTEXT: u32 = 9;
pub const OPT_SET_META_CONTEXT: u32 = 10;

/// Option reply types.
pub const REP_ACK: u32 = 1;
pub const REP_SERVER: u32 = 2;
pub const REP_INFO: u32 = 3;
pub const REP_META_CONTEXT: u32 = 4;
pub const REP_ERR_UNSUP: u32 = (1 << 31) + 1;
pub const REP_ERR_POLICY: u32 = (1 << 31) + 2;
pub const REP_ERR_INVALID: u32 = (1 << 31) + 3;
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) + 6;
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) + 9;

/// Info types for `NBD_OPT_INFO` / `NBD_OPT_GO`.
pub const INFO_EXPORT: u16 = 0;
pub const INFO_NAME: u16 = 1;
pub const INFO_DESCRIPTION: u16 = 2;
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;
pub const CMD_FLAG_DF: u16 = 1 << 2;
pub const CMD_FLAG_REQ_ONE: u16 = 1 << 3;
pub const CMD_FLAG_FAST_ZERO: u16 = 1 << 4;

/// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
pub const REPLY_TYPE_NONE: u16 = 0;
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
pub const REPLY_TYPE_OFFSET_HOLE: u16 = 2;
pub const REPLY_TYPE_BLOCK_STATUS: u16 = 5;
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) + 1;

/// `base:allocation` status bits.
pub const STATE_HOLE: u32 = 1 << 0;
pub const STATE_ZERO: u32 = 1 << 1;

/// The one metadata context this server offers, and its id on the wire.
pub const META_BASE_ALLOCATION: &str = "base:allocation";
pub const META_BASE_ALLOCATION_ID: u32 = 1;

/// Errno values the protocol carries.
pub const EPERM: u32 = 1;
pub const EIO: u32 = 5;
pub const ENOMEM: u32 = 12;
pub const EINVAL: u32 = 22;
pub const ENOSPC: u32 = 28;
pub const EOVERFLOW: u32 = 75;
pub const ENOTSUP: u32 = 95;
pub const ESHUTDOWN: u32 = 108;

/// Size of a request header on the wire.
pub const REQUEST_LEN: usize = 28;
/// Largest payload of one READ or WRITE this server accepts (advertised as the maximum block size).
pub const MAX_PAYLOAD: u32 = 32 << 20;
/// Largest option payload accepted during the handshake.
pub const MAX_OPTION_LEN: u32 = 64 << 10;

/// The transmission commands, with unknown types kept so the server can answer `EINVAL`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cmd {
    Read,
    Write,
    Disc,
    Flush,
    Trim,
    Cache,
    WriteZeroes,
    BlockStatus,
    Unknown(u16),
}

impl Cmd {
    /// Maps the wire type to a command.
    pub fn from_wire(t: u16) -> Cmd {
        match t {
            0 => Cmd::Read,
            1 => Cmd::Write,
            2 => Cmd::Disc,
            3 => Cmd::Flush,
            4 => Cmd::Trim,
            5 => Cmd::Cache,
            6 => Cmd::WriteZeroes,
            7 => Cmd::BlockStatus,
            other => Cmd::Unknown(other),
        }
    }
}

/// One transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub flags: u16,
    pub cmd: Cmd,
    pub cookie: u64,
    pub offset: u64,
    pub len: u32,
}

/// Why a request header could not be parsed; the connection cannot continue after either.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("request header is {0} bytes, need 28: the client sent a truncated frame")]
    Truncated(usize),
    #[error("request magic is {0:#x}, expected 0x25609513: the client is out of sync")]
    BadMagic(u32),
}

fn be16(b: &[u8], at: usize) -> u16 {
    u16::from_be_bytes([b[at], b[at + 1]])
}
fn be32(b: &[u8], at: usize) -> u32 {
    u32::from_be_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}
fn be64(b: &[u8], at: usize) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[at..at + 8]);
    u64::from_be_bytes(a)
}

/// Parses a 28-byte request header. Never panics, whatever the input.
pub fn parse_request(b: &[u8]) -> Result<Request, FrameError> {
    if b.len() < REQUEST_LEN {
        return Err(FrameError::Truncated(b.len()));
    }
    let magic = be32(b, 0);
    if magic != REQUEST_MAGIC {
        return Err(FrameError::BadMagic(magic));
    }
    Ok(Request {
        flags: be16(b, 4),
        cmd: Cmd::from_wire(be16(b, 6)),
        cookie: be64(b, 8),
        offset: be64(b, 16),
        len: be32(b, 24),
    })
}

/// Encodes a request header (used by tests, the bench and the fuzz seeds).
pub fn encode_request(flags: u16, cmd: u16, cookie: u64, offset: u64, len: u32) -> [u8; REQUEST_LEN] {
    let mut b = [0u8; REQUEST_LEN];
    b[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
    b[4..6].copy_from_slice(&flags.to_be_bytes());
    b[6..8].copy_from_slice(&cmd.to_be_bytes());
    b[8..16].copy_from_slice(&cookie.to_be_bytes());
    b[16..24].copy_from_slice(&offset.to_be_bytes());
    b[24..28].copy_from_slice(&len.to_be_bytes());
    b
}

/// Appends an option reply header and its payload.
pub fn opt_reply(out: &mut Vec<u8>, opt: u32, rep: u32, payload: &[u8]) {
    out.extend_from_slice(&OPT_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&opt.to_be_bytes());
    out.extend_from_slice(&rep.to_be_bytes());
    out.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    out.extend_from_slice(payload);
}

/// Appends a simple reply header (the data of a READ follows it).
pub fn simple_reply(out: &mut Vec<u8>, error: u32, cookie: u64) {
    out.extend_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
}

/// Appends a structured reply chunk header announcing `len` payload bytes.
pub fn chunk_header(out: &mut Vec<u8>, flags: u16, ty: u16, cookie: u64, len: u32) {
    out.extend_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    out.extend_from_slice(&flags.to_be_bytes());
    out.extend_from_slice(&ty.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&len.to_be_bytes());
}

/// Appends a final structured error chunk with a human-readable message.
pub fn chunk_error(out: &mut Vec<u8>, cookie: u64, error: u32, msg: &str) {
    let msg = &msg.as_bytes()[..msg.len().min(4096)];
    chunk_header(out, REPLY_FLAG_DONE, REPLY_TYPE_ERROR, cookie, 6 + msg.len() as u32);
    out.extend_from_slice(&error.to_be_bytes());
    out.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    out.extend_from_slice(msg);
}

/// A cursor over an option payload whose reads fail instead of panicking on short input.
pub struct Cursor<'a> {
    buf: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Cursor { buf }
    }
    pub fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.buf.len() < n {
            return None;
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Some(head)
    }
    pub fn u16(&mut self) -> Option<u16> {
        self.take(2).map(|b| be16(b, 0))
    }
    pub fn u32(&mut self) -> Option<u32> {
        self.take(4).map(|b| be32(b, 0))
    }
    /// A u32-length-prefixed string.
    pub fn string(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub fn is_empty(&self) -> bool {
        self.buf.is_empty()
    }
}

/// The export name and info requests of `NBD_OPT_INFO` / `NBD_OPT_GO`.
#[derive(Debug, PartialEq, Eq)]
pub struct InfoRequest<'a> {
    pub name: &'a [u8],
    pub infos: Vec<u16>,
}

/// Parses the payload of `NBD_OPT_INFO` / `NBD_OPT_GO`; `None` means `NBD_REP_ERR_INVALID`.
pub fn parse_info_request(data: &[u8]) -> Option<InfoRequest<'_>> {
    let mut c = Cursor::new(data);
    let name = c.string()?;
    let n = c.u16()?;
    let mut infos = Vec::with_capacity(usize::from(n));
    for _ in 0..n {
        infos.push(c.u16()?);
    }
    c.is_empty().then_some(InfoRequest { name, infos })
}

/// The export name and queries of `NBD_OPT_{LIST,SET}_META_CONTEXT`.
#[derive(Debug, PartialEq, Eq)]
pub struct MetaRequest<'a> {
    pub name: &'a [u8],
    pub queries: Vec<&'a [u8]>,
}

/// Parses a meta context option payload; `None` means `NBD_REP_ERR_INVALID`.
pub fn parse_meta_request(data: &[u8]) -> Option<MetaRequest<'_>> {
    let mut c = Cursor::new(data);
    let name = c.string()?;
    let n = c.u32()?;
    let mut queries = Vec::new();
    for _ in 0..n {
        queries.push(c.string()?);
    }
    c.is_empty().then_some(MetaRequest { name, queries })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_round_trips() {
        let b = encode_request(CMD_FLAG_FUA, 1, 0xdead_beef, 4096, 512);
        let r = parse_request(&b).unwrap();
        assert_eq!(r.cmd, Cmd::Write);
        assert_eq!(r.flags, CMD_FLAG_FUA);
        assert_eq!(r.cookie, 0xdead_beef);
        assert_eq!(r.offset, 4096);
        assert_eq!(r.len, 512);
    }

    #[test]
    fn bad_frames_are_errors() {
        let b = encode_request(0, 0, 1, 0, 1);
        assert_eq!(parse_request(&b[..27]), Err(FrameError::Truncated(27)));
        let mut bad = b;
        bad[0] = 0;
        assert!(matches!(parse_request(&bad), Err(FrameError::BadMagic(_))));
        let unk = encode_request(0, 99, 1, 0, 1);
        assert_eq!(parse_request(&unk).unwrap().cmd, Cmd::Unknown(99));
    }

    #[test]
    fn info_request_parses_and_rejects_trailing_bytes() {
        let mut d = Vec::new();
        d.extend_from_slice(&3u32.to_be_bytes());
        d.extend_from_slice(b"abc");
        d.extend_from_slice(&2u16.to_be_bytes());
        d.extend_from_slice(&INFO_BLOCK_SIZE.to_be_bytes());
        d.extend_from_slice(&INFO_NAME.to_be_bytes());
        let r = parse_info_request(&d).unwrap();
        assert_eq!(r.name, b"abc");
        assert_eq!(r.infos, vec![INFO_BLOCK_SIZE, INFO_NAME]);
        d.push(0);
        assert!(parse_info_request(&d).is_none());
        assert!(parse_info_request(&d[..5]).is_none());
    }

    #[test]
    fn meta_request_parses() {
        let mut d = Vec::new();
        d.extend_from_slice(&0u32.to_be_bytes());
        d.extend_from_slice(&1u32.to_be_bytes());
        d.extend_from_slice(&15u32.to_be_bytes());
        d.extend_from_slice(b"base:allocation");
        let r = parse_meta_request(&d).unwrap();
        assert_eq!(r.queries, vec![b"base:allocation".as_slice()]);
        assert!(parse_meta_request(&d[..d.len() - 1]).is_none());
    }
}
