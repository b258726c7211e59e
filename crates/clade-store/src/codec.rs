//! Small, size-capped binary encoding for the store's on-disk formats (pack index, manifest, tree).
//!
//! Fixed little-endian fields, a magic and a format version at the start of every file, and a decoder that
//! never panics or over-allocates on hostile input: every length is checked against the bytes that remain.

/// Appends fixed-width little-endian fields to a buffer.
#[derive(Default)]
pub(crate) struct Enc {
    pub buf: Vec<u8>,
}

impl Enc {
    pub fn with_magic(magic: &[u8; 8], version: u32) -> Self {
        let mut e = Enc { buf: Vec::new() };
        e.bytes(magic);
        e.u32(version);
        e
    }
    pub fn u8(&mut self, v: u8) {
        self.buf.push(v);
    }
    pub fn u16(&mut self, v: u16) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u32(&mut self, v: u32) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn u64(&mut self, v: u64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn i64(&mut self, v: i64) {
        self.buf.extend_from_slice(&v.to_le_bytes());
    }
    pub fn bytes(&mut self, b: &[u8]) {
        self.buf.extend_from_slice(b);
    }
    /// A u32 length, then the bytes.
    pub fn blob(&mut self, b: &[u8]) {
        self.u32(b.len() as u32);
        self.bytes(b);
    }
}

/// Why a decode failed (turned into [`crate::StoreError::Corrupt`] by the caller, who knows the file).
#[derive(Debug)]
pub(crate) enum DecodeError {
    Short(&'static str),
    BadMagic,
    Newer(u32),
    Bad(String),
}

impl std::fmt::Display for DecodeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            DecodeError::Short(what) => write!(f, "truncated while reading {what}"),
            DecodeError::BadMagic => f.write_str("wrong magic (not a clade store file)"),
            DecodeError::Newer(v) => write!(f, "format version {v} is newer than this clade"),
            DecodeError::Bad(s) => f.write_str(s),
        }
    }
}

/// Reads fixed-width fields, checking every length.
pub(crate) struct Dec<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    pub fn new(buf: &'a [u8]) -> Self {
        Dec { buf, pos: 0 }
    }
    /// Check magic and return the version (rejecting versions above `known`).
    pub fn magic(&mut self, magic: &[u8; 8], known: u32) -> Result<u32, DecodeError> {
        if self.take(8, "magic")? != magic {
            return Err(DecodeError::BadMagic);
        }
        let v = self.u32("version")?;
        if v > known {
            return Err(DecodeError::Newer(v));
        }
        Ok(v)
    }
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }
    pub fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], DecodeError> {
        if self.remaining() < n {
            return Err(DecodeError::Short(what));
        }
        let s = &self.buf[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, what: &'static str) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N, what)?);
        Ok(a)
    }
    pub fn u8(&mut self, what: &'static str) -> Result<u8, DecodeError> {
        Ok(self.arr::<1>(what)?[0])
    }
    pub fn u16(&mut self, what: &'static str) -> Result<u16, DecodeError> {
        Ok(u16::from_le_bytes(self.arr(what)?))
    }
    pub fn u32(&mut self, what: &'static str) -> Result<u32, DecodeError> {
        Ok(u32::from_le_bytes(self.arr(what)?))
    }
    pub fn u64(&mut self, what: &'static str) -> Result<u64, DecodeError> {
        Ok(u64::from_le_bytes(self.arr(what)?))
    }
    pub fn i64(&mut self, what: &'static str) -> Result<i64, DecodeError> {
        Ok(i64::from_le_bytes(self.arr(what)?))
    }
    pub fn id(&mut self, what: &'static str) -> Result<[u8; 32], DecodeError> {
        self.arr(what)
    }
    pub fn blob(&mut self, what: &'static str) -> Result<&'a [u8], DecodeError> {
        let n = self.u32(what)? as usize;
        self.take(n, what)
    }
    /// A count of items each at least `item_size` bytes, checked against what remains (no huge allocations).
    pub fn count(&mut self, item_size: usize, what: &'static str) -> Result<usize, DecodeError> {
        let n = self.u32(what)? as usize;
        if n.saturating_mul(item_size) > self.remaining() {
            return Err(DecodeError::Short(what));
        }
        Ok(n)
    }
    pub fn end(&self) -> Result<(), DecodeError> {
        if self.remaining() != 0 {
            return Err(DecodeError::Bad(format!("{} trailing bytes", self.remaining())));
        }
        Ok(())
    }
}
