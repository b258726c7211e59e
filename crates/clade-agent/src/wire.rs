//! Framing: how bytes on the one host connection become frames.
//!
//! Every frame is `len: u32 LE` (the bytes after it, header included) followed by an 8-byte header
//! `version: u8, kind: u8, chan: u8, flags: u8, id: u32 LE` and a body. The length prefix and the header
//! layout are frozen across wire versions, so a peer speaking a newer version can still be skipped frame by
//! frame and answered with a typed error instead of losing the connection. Control bodies (requests,
//! replies, events) are JSON; file and stdio bytes travel raw in `Data` frames, so bulk transfers cost one
//! copy per side and no encoding.
//!
//! Why not JSON lines: raw data frames keep 100 MiB transfers near socket
//! speed, and ids let many requests and process streams share the one connection.

use std::io::{self, Read, Write};

/// The wire version this crate speaks. Bump on any incompatible change to a body type.
pub const WIRE_VERSION: u8 = 1;
/// Bytes of header after the length prefix.
pub const HEADER_LEN: usize = 8;
/// Largest accepted frame (the length prefix value). Bigger frames are skipped and answered with an error.
pub const MAX_FRAME: usize = 16 << 20;
/// Size of the raw chunks the agent and the client put in one `Data` frame.
pub const DATA_CHUNK: usize = 1 << 20;
/// `flags` bit on a `Data` frame: this stream ends here (the body may be empty).
pub const FLAG_END: u8 = 1;

/// What a frame's body is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Host to agent: a JSON [`crate::Request`]; `id` is chosen by the host and echoed in the reply.
    Request = 1,
    /// Agent to host: a JSON `Result<Reply, AgentError>`, the last frame for that request id.
    Reply = 2,
    /// Agent to host: a JSON [`crate::Event`]; `id` is the process id it concerns.
    Event = 3,
    /// Raw bytes of a stream named by `chan` and `id` (request id for files, process id for stdio).
    Data = 4,
}

impl Kind {
    fn from_u8(v: u8) -> Option<Kind> {
        Some(match v {
            1 => Kind::Request,
            2 => Kind::Reply,
            3 => Kind::Event,
            4 => Kind::Data,
            _ => return None,
        })
    }
}

/// Which stream a `Data` frame belongs to (0 on control frames).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Chan {
    /// Control frames carry no stream.
    None = 0,
    /// File contents for a `read_file` / `write_file` request (id = request id).
    File = 1,
    /// Host to agent: bytes for a process's stdin (id = pid).
    Stdin = 2,
    /// Agent to host: a process's stdout, or its PTY output (id = pid).
    Stdout = 3,
    /// Agent to host: a process's stderr (id = pid).
    Stderr = 4,
}

impl Chan {
    fn from_u8(v: u8) -> Option<Chan> {
        Some(match v {
            0 => Chan::None,
            1 => Chan::File,
            2 => Chan::Stdin,
            3 => Chan::Stdout,
            4 => Chan::Stderr,
            _ => return None,
        })
    }
}

/// A decoded frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    /// Wire version of the sender.
    pub version: u8,
    /// What the body is.
    pub kind: Kind,
    /// Stream of a `Data` frame.
    pub chan: Chan,
    /// [`FLAG_END`] and future bits.
    pub flags: u8,
    /// Request id or process id.
    pub id: u32,
}

/// One whole frame.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    /// Its header.
    pub header: Header,
    /// Its body (JSON or raw bytes, depending on `header.kind`).
    pub body: Vec<u8>,
}

/// A frame that could not be accepted. The bytes it claimed were consumed, so the stream is still in step
/// (unless the length prefix itself was garbage) and the receiver answers `id` with a typed error.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WireError {
    /// The length prefix is smaller than the header.
    #[error(
        "frame length {len} is shorter than the {HEADER_LEN}-byte header: the peer is not speaking clade-agent framing"
    )]
    TooShort {
        /// The length prefix read.
        len: u32,
    },
    /// The length prefix exceeds [`MAX_FRAME`].
    #[error("frame length {len} exceeds the {max}-byte limit: split data into chunks of at most {DATA_CHUNK} bytes")]
    TooLarge {
        /// The length prefix read.
        len: u32,
        /// The limit.
        max: usize,
        /// The id from the header, when it could be read.
        id: u32,
    },
    /// The sender speaks a newer wire version.
    #[error("wire version {got} is newer than this side's {WIRE_VERSION}: upgrade clade-agent in the sandbox or speak version {WIRE_VERSION}")]
    UnsupportedVersion {
        /// The version in the header.
        got: u8,
        /// The id from the header.
        id: u32,
    },
    /// The header's kind or channel byte is unknown.
    #[error("unknown frame kind {kind} / channel {chan}")]
    BadHeader {
        /// The kind byte.
        kind: u8,
        /// The chan byte.
        chan: u8,
        /// The id from the header.
        id: u32,
    },
}

impl WireError {
    /// The request id the error concerns (0 when the header could not be read).
    pub fn id(&self) -> u32 {
        match self {
            WireError::TooShort { .. } => 0,
            WireError::TooLarge { id, .. }
            | WireError::UnsupportedVersion { id, .. }
            | WireError::BadHeader { id, .. } => *id,
        }
    }
}

/// Outcome of [`decode`] on a buffer.
#[derive(Debug, PartialEq, Eq)]
pub enum Decoded {
    /// A frame and how many bytes of the buffer it used.
    Frame(Frame, usize),
    /// A bad frame of `consumed` bytes (skip them and answer the error).
    Bad(WireError, usize),
    /// At least this many bytes in total are needed before anything can be decoded.
    Incomplete(usize),
}

fn parse_header(len: u32, h: &[u8; HEADER_LEN]) -> Result<Header, WireError> {
    let id = u32::from_le_bytes([h[4], h[5], h[6], h[7]]);
    if len as usize > MAX_FRAME {
        return Err(WireError::TooLarge { len, max: MAX_FRAME, id });
    }
    if h[0] > WIRE_VERSION {
        return Err(WireError::UnsupportedVersion { got: h[0], id });
    }
    match (Kind::from_u8(h[1]), Chan::from_u8(h[2])) {
        (Some(kind), Some(chan)) => Ok(Header { version: h[0], kind, chan, flags: h[3], id }),
        _ => Err(WireError::BadHeader { kind: h[1], chan: h[2], id }),
    }
}

/// Decodes one frame from the front of `buf` without blocking: the pure core of the reader, fuzzed.
pub fn decode(buf: &[u8]) -> Decoded {
    if buf.len() < 4 {
        return Decoded::Incomplete(4);
    }
    let len = u32::from_le_bytes([buf[0], buf[1], buf[2], buf[3]]);
    if (len as usize) < HEADER_LEN {
        return Decoded::Bad(WireError::TooShort { len }, 4 + len as usize);
    }
    if buf.len() < 4 + HEADER_LEN {
        return Decoded::Incomplete(4 + HEADER_LEN);
    }
    let mut h = [0u8; HEADER_LEN];
    h.copy_from_slice(&buf[4..4 + HEADER_LEN]);
    let total = 4 + len as usize;
    match parse_header(len, &h) {
        Err(e) => Decoded::Bad(e, total),
        Ok(_) if buf.len() < total => Decoded::Incomplete(total),
        Ok(header) => Decoded::Frame(Frame { header, body: buf[4 + HEADER_LEN..total].to_vec() }, total),
    }
}

/// Encodes the length prefix and header for a body of `body_len` bytes.
pub fn encode_header(kind: Kind, chan: Chan, flags: u8, id: u32, body_len: usize) -> [u8; 4 + HEADER_LEN] {
    let len = (HEADER_LEN + body_len) as u32;
    let mut out = [0u8; 4 + HEADER_LEN];
    out[..4].copy_from_slice(&len.to_le_bytes());
    out[4] = WIRE_VERSION;
    out[5] = kind as u8;
    out[6] = chan as u8;
    out[7] = flags;
    out[8..].copy_from_slice(&id.to_le_bytes());
    out
}

/// Encodes a whole frame into a new buffer.
pub fn encode(kind: Kind, chan: Chan, flags: u8, id: u32, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + HEADER_LEN + body.len());
    out.extend_from_slice(&encode_header(kind, chan, flags, id, body.len()));
    out.extend_from_slice(body);
    out
}

/// Writes one frame (header and body). The caller flushes and serialises writers.
pub fn write_frame(w: &mut impl Write, kind: Kind, chan: Chan, flags: u8, id: u32, body: &[u8]) -> io::Result<()> {
    if HEADER_LEN + body.len() > MAX_FRAME {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "frame body too large for one frame"));
    }
    w.write_all(&encode_header(kind, chan, flags, id, body.len()))?;
    w.write_all(body)
}

/// What [`read_frame`] got.
#[derive(Debug)]
pub enum ReadOutcome {
    /// A good frame.
    Frame(Frame),
    /// A bad frame, already skipped.
    Bad(WireError),
    /// The peer closed the stream between frames.
    Eof,
}

/// Reads one frame from a blocking stream. Bad frames are skipped whole (their claimed length is read
/// and discarded, never buffered) and returned as [`ReadOutcome::Bad`]; only I/O errors end the stream.
pub fn read_frame(r: &mut impl Read) -> io::Result<ReadOutcome> {
    let mut body = Vec::new();
    Ok(match read_frame_into(r, &mut body)? {
        BufOutcome::Frame(header, n) => {
            body.truncate(n);
            ReadOutcome::Frame(Frame { header, body })
        }
        BufOutcome::Bad(e) => ReadOutcome::Bad(e),
        BufOutcome::Eof => ReadOutcome::Eof,
    })
}

/// What [`read_frame_into`] got.
#[derive(Debug)]
pub enum BufOutcome {
    /// A good frame whose body is the first `n` bytes of the buffer.
    Frame(Header, usize),
    /// A bad frame, already skipped.
    Bad(WireError),
    /// The peer closed the stream between frames.
    Eof,
}

/// [`read_frame`] into a buffer the caller reuses, so a stream of 1 MiB data frames costs no allocation
/// (and no page faults on fresh mappings) per frame.
pub fn read_frame_into(r: &mut impl Read, buf: &mut Vec<u8>) -> io::Result<BufOutcome> {
    let mut lenb = [0u8; 4];
    let mut got = 0;
    while got < 4 {
        match r.read(&mut lenb[got..]) {
            Ok(0) if got == 0 => return Ok(BufOutcome::Eof),
            Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    let len = u32::from_le_bytes(lenb);
    if (len as usize) < HEADER_LEN {
        skip(r, len as u64)?;
        return Ok(BufOutcome::Bad(WireError::TooShort { len }));
    }
    let mut h = [0u8; HEADER_LEN];
    r.read_exact(&mut h)?;
    let body_len = len as usize - HEADER_LEN;
    match parse_header(len, &h) {
        Err(e) => {
            skip(r, body_len as u64)?;
            Ok(BufOutcome::Bad(e))
        }
        Ok(header) => {
            if buf.len() < body_len {
                buf.resize(body_len, 0);
            }
            r.read_exact(&mut buf[..body_len])?;
            Ok(BufOutcome::Frame(header, body_len))
        }
    }
}

fn skip(r: &mut impl Read, n: u64) -> io::Result<()> {
    let copied = io::copy(&mut r.take(n), &mut io::sink())?;
    if copied < n {
        return Err(io::ErrorKind::UnexpectedEof.into());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    #[test]
    fn frames_round_trip() {
        let f = encode(Kind::Data, Chan::Stdout, FLAG_END, 42, b"hello");
        match decode(&f) {
            Decoded::Frame(fr, used) => {
                assert_eq!(used, f.len());
                assert_eq!(
                    fr.header,
                    Header { version: WIRE_VERSION, kind: Kind::Data, chan: Chan::Stdout, flags: FLAG_END, id: 42 }
                );
                assert_eq!(fr.body, b"hello");
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(decode(&f[..3]), Decoded::Incomplete(4));
        assert_eq!(decode(&f[..10]), Decoded::Incomplete(12));
        assert_eq!(decode(&f[..15]), Decoded::Incomplete(f.len()));
    }

    #[test]
    fn bad_frames_are_typed_and_skipped() {
        // newer version: skipped whole, the next frame still reads
        let mut newer = encode(Kind::Request, Chan::None, 0, 7, b"{}");
        newer[4] = WIRE_VERSION + 1;
        let mut stream = newer.clone();
        stream.extend_from_slice(&encode(Kind::Request, Chan::None, 0, 8, b"{\"op\":\"hello\"}"));
        let mut c = Cursor::new(stream);
        match read_frame(&mut c).unwrap() {
            ReadOutcome::Bad(WireError::UnsupportedVersion { got, id: 7 }) => assert_eq!(got, WIRE_VERSION + 1),
            other => panic!("{other:?}"),
        }
        match read_frame(&mut c).unwrap() {
            ReadOutcome::Frame(f) => assert_eq!(f.header.id, 8),
            other => panic!("{other:?}"),
        }
        assert!(matches!(read_frame(&mut c).unwrap(), ReadOutcome::Eof));
        // too short
        assert!(matches!(decode(&[3, 0, 0, 0, 1, 2, 3]), Decoded::Bad(WireError::TooShort { len: 3 }, 7)));
        // too large
        let mut big = encode(Kind::Request, Chan::None, 0, 9, b"");
        big[..4].copy_from_slice(&((MAX_FRAME + 1) as u32).to_le_bytes());
        assert!(matches!(decode(&big), Decoded::Bad(WireError::TooLarge { id: 9, .. }, _)));
        // unknown kind
        let mut k = encode(Kind::Request, Chan::None, 0, 5, b"");
        k[5] = 99;
        assert!(matches!(decode(&k), Decoded::Bad(WireError::BadHeader { kind: 99, id: 5, .. }, 12)));
    }

    struct XorShift(u64);
    impl XorShift {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// The decoder fuzz (cargo-fuzz needs nightly, not installed here): a million seeded random frames,
    /// valid, mutated and pure noise, through `decode`, the request parser and the stream reader. It
    /// asserts no panic, that consumed counts never exceed the input, and that valid frames round-trip.
    #[test]
    fn million_random_frames() {
        let mut rng = XorShift(0x9e37_79b9_7f4a_7c15);
        let mut stream = Vec::new();
        for i in 0..1_000_000u32 {
            let r = rng.next();
            let body_len = (r % 48) as usize;
            let body: Vec<u8> = (0..body_len).map(|_| rng.next() as u8).collect();
            let mut f = encode(Kind::Request, Chan::None, 0, i, &body);
            match r >> 60 {
                0..=5 => {}
                6..=10 => {
                    let at = (rng.next() as usize) % f.len();
                    f[at] = rng.next() as u8;
                }
                11..=13 => f.truncate((rng.next() as usize) % f.len()),
                _ => f = (0..(r % 40) as usize).map(|_| rng.next() as u8).collect(),
            }
            match decode(&f) {
                Decoded::Frame(fr, used) => {
                    assert!(used <= f.len());
                    assert_eq!(fr.body.len(), used - 4 - HEADER_LEN);
                    let _ = serde_json::from_slice::<crate::Request>(&fr.body);
                }
                Decoded::Bad(_, used) => assert!(used >= 4),
                Decoded::Incomplete(n) => assert!(n > f.len()),
            }
            if i % 10 == 0 && stream.len() < 4 << 20 {
                stream.extend_from_slice(&f);
            }
        }
        let mut c = Cursor::new(stream);
        let mut frames = 0;
        while let Ok(o) = read_frame(&mut c) {
            match o {
                ReadOutcome::Eof => break,
                _ => frames += 1,
            }
        }
        assert!(frames > 0);
    }

    #[test]
    fn requests_parse_from_json() {
        let r: crate::Request = serde_json::from_str(r#"{"op":"exec","argv":["/bin/true"]}"#).unwrap();
        assert_eq!(r, crate::Request::Exec(crate::ExecSpec::new(["/bin/true"])));
        let r: crate::Request = serde_json::from_str(r#"{"op":"list_dir","path":"/"}"#).unwrap();
        assert_eq!(r, crate::Request::ListDir { path: "/".into(), depth: 1 });
        let e = crate::AgentError::UnknownOp { op: "x".into(), supported: 1 };
        let back: crate::AgentError = serde_json::from_str(&serde_json::to_string(&e).unwrap()).unwrap();
        assert_eq!(back, e);
    }
}
