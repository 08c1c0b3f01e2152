//! Frames on the rendezvous, collective and heartbeat connections.
//!
//! Every frame is an 18-byte header — tag (u8), op (u8), sequence number (u64 LE), payload
//! length (u64 LE) — followed by the payload. A connection starts with [`MAGIC`] and a hello.

use std::io::{self, Read, Write};

/// First bytes a rank sends on a new connection (protocol name and version).
pub(crate) const MAGIC: &[u8; 8] = b"FLEETD01";

/// Largest JSON control payload accepted (hellos, welcomes, failures).
pub(crate) const MAX_CONTROL: u64 = 1 << 20;

/// Frame tags.
pub(crate) mod tag {
    /// Rank → rank 0: hello (JSON).
    pub const HELLO: u8 = 1;
    /// Rank 0 → rank: welcome (JSON), then a DATA frame with the root payload.
    pub const WELCOME: u8 = 2;
    /// Rank 0 → rank: rendezvous refused (JSON `RendezvousFault`).
    pub const REJECT: u8 = 3;
    /// Collective data.
    pub const DATA: u8 = 4;
    /// Heartbeat.
    pub const BEAT: u8 = 5;
    /// Heartbeat connection: this rank finished cleanly.
    pub const DONE: u8 = 6;
    /// Rank 0 → rank, heartbeat connection: a peer failed (JSON `PeerFailure`).
    pub const FAIL: u8 = 7;
}

/// One frame header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Header {
    pub tag: u8,
    pub op: u8,
    pub seq: u64,
    pub len: u64,
}

impl Header {
    pub const SIZE: usize = 18;

    pub fn new(tag: u8, op: u8, seq: u64, len: u64) -> Self {
        Header { tag, op, seq, len }
    }

    pub fn encode(&self) -> [u8; Self::SIZE] {
        let mut b = [0u8; Self::SIZE];
        b[0] = self.tag;
        b[1] = self.op;
        b[2..10].copy_from_slice(&self.seq.to_le_bytes());
        b[10..18].copy_from_slice(&self.len.to_le_bytes());
        b
    }

    pub fn decode(b: &[u8; Self::SIZE]) -> Self {
        Header {
            tag: b[0],
            op: b[1],
            seq: u64::from_le_bytes(b[2..10].try_into().unwrap()),
            len: u64::from_le_bytes(b[10..18].try_into().unwrap()),
        }
    }
}

/// Writes a header and a payload (one `write_all` for small payloads).
pub(crate) fn write_frame(w: &mut impl Write, h: Header, payload: &[u8]) -> io::Result<()> {
    debug_assert_eq!(h.len, payload.len() as u64);
    if payload.len() <= 4096 {
        let mut buf = Vec::with_capacity(Header::SIZE + payload.len());
        buf.extend_from_slice(&h.encode());
        buf.extend_from_slice(payload);
        w.write_all(&buf)
    } else {
        w.write_all(&h.encode())?;
        w.write_all(payload)
    }
}

/// A frame whose payload is `value` as JSON.
pub(crate) fn write_json(
    w: &mut impl Write,
    tag: u8,
    value: &impl serde::Serialize,
) -> io::Result<()> {
    let bytes = serde_json::to_vec(value).map_err(io::Error::other)?;
    write_frame(w, Header::new(tag, 0, 0, bytes.len() as u64), &bytes)
}

pub(crate) fn read_header(r: &mut impl Read) -> io::Result<Header> {
    let mut b = [0u8; Header::SIZE];
    r.read_exact(&mut b)?;
    Ok(Header::decode(&b))
}

/// Reads a payload of `len` bytes, refusing more than `max`.
pub(crate) fn read_payload(r: &mut impl Read, len: u64, max: u64) -> io::Result<Vec<u8>> {
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes is larger than the {max} expected"),
        ));
    }
    let mut buf = vec![0u8; len as usize];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// Reads a JSON control payload.
pub(crate) fn read_json<T: serde::de::DeserializeOwned>(
    r: &mut impl Read,
    h: Header,
) -> io::Result<T> {
    let bytes = read_payload(r, h.len, MAX_CONTROL)?;
    serde_json::from_slice(&bytes).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))
}

/// Whether an I/O error is a read/write timeout.
pub(crate) fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Whether an I/O error means the other end went away.
pub(crate) fn is_closed(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe
            | io::ErrorKind::NotConnected
    )
}

/// This machine's host name (for messages that name a rank).
pub(crate) fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok().filter(|s| !s.is_empty()))
        .unwrap_or_else(|| "unknown-host".into())
}

/// Seconds with one decimal, for messages.
pub(crate) fn secs(d: std::time::Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}
