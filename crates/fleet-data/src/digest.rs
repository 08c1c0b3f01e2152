//! Content digests for manifests: which weights, which data, which prompts made a record.
//!
//! 64-bit FNV-1a over little-endian 8-byte words (trailing bytes one by one), then the length:
//! stable across platforms and Rust versions, and fast enough (several GB/s per core) to run
//! over a checkpoint's weights at every load. Not cryptographic: it tells files apart, it does
//! not defend against someone forging a collision.

use std::io::Read;
use std::path::{Path, PathBuf};

const BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// Streaming FNV-1a over 8-byte words; the result does not depend on how the input is split
/// into [`Fnv64::update`] calls.
#[derive(Debug, Clone)]
pub struct Fnv64 {
    h: u64,
    pending: [u8; 8],
    n_pending: usize,
    len: u64,
}

impl Default for Fnv64 {
    fn default() -> Self {
        Self::new()
    }
}

impl Fnv64 {
    /// A fresh digest.
    pub fn new() -> Self {
        Self::continuing(BASIS)
    }

    /// A digest continuing from the state `h` (to chain several files).
    fn continuing(h: u64) -> Self {
        Fnv64 {
            h,
            pending: [0; 8],
            n_pending: 0,
            len: 0,
        }
    }

    fn word(&mut self, w: [u8; 8]) {
        self.h = (self.h ^ u64::from_le_bytes(w)).wrapping_mul(PRIME);
    }

    /// Adds bytes.
    pub fn update(&mut self, mut bytes: &[u8]) {
        self.len += bytes.len() as u64;
        if self.n_pending > 0 {
            let take = (8 - self.n_pending).min(bytes.len());
            self.pending[self.n_pending..self.n_pending + take].copy_from_slice(&bytes[..take]);
            self.n_pending += take;
            bytes = &bytes[take..];
            if self.n_pending < 8 {
                return;
            }
            self.word(self.pending);
            self.n_pending = 0;
        }
        let mut words = bytes.chunks_exact(8);
        for w in &mut words {
            self.word(w.try_into().expect("chunks of 8"));
        }
        let rest = words.remainder();
        self.pending[..rest.len()].copy_from_slice(rest);
        self.n_pending = rest.len();
    }

    /// The state after the trailing bytes and the length: the digest of everything added.
    pub fn finish(&self) -> u64 {
        let mut h = self.h;
        for &b in &self.pending[..self.n_pending] {
            h = (h ^ b as u64).wrapping_mul(PRIME);
        }
        (h ^ self.len).wrapping_mul(PRIME)
    }

    /// [`Fnv64::finish`] as 16 hex digits.
    pub fn hex(&self) -> String {
        format!("{:016x}", self.finish())
    }
}

/// The digest of one file's bytes, continuing from state `h`.
fn file_state(path: &Path, h: u64) -> std::io::Result<u64> {
    let mut f = std::fs::File::open(path)?;
    let mut d = Fnv64::continuing(h);
    let mut buf = vec![0u8; 1 << 20];
    loop {
        match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => d.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(d.finish())
}

/// The digest of a set of files' bytes, as `fnv1a64w:` + 16 hex digits.
///
/// One file: FNV-1a of its words, then its length. Several (the shards of a checkpoint): each
/// file is digested on a thread of its own and the per-file digests are folded in order, so a
/// 70B checkpoint is read at the disk's speed rather than one core's.
pub fn files_digest(files: &[PathBuf]) -> Result<String, (PathBuf, std::io::Error)> {
    let run = |p: &PathBuf| file_state(p, BASIS).map_err(|e| (p.clone(), e));
    let h = match files {
        [one] => run(one)?,
        _ => {
            let threads = std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .max(1);
            let mut states = Vec::with_capacity(files.len());
            // At most `threads` files are read at once.
            for group in files.chunks(threads) {
                let results: Vec<_> = std::thread::scope(|s| {
                    let handles: Vec<_> = group.iter().map(|p| s.spawn(move || run(p))).collect();
                    handles
                        .into_iter()
                        .map(|h| h.join().expect("digest thread panicked"))
                        .collect()
                });
                for r in results {
                    states.push(r?);
                }
            }
            let mut d = Fnv64::new();
            for s in states {
                d.update(&s.to_le_bytes());
            }
            d.finish()
        }
    };
    Ok(format!("fnv1a64w:{h:016x}"))
}

/// The digest of bytes, as 16 hex digits.
pub fn bytes_digest(bytes: &[u8]) -> String {
    let mut d = Fnv64::new();
    d.update(bytes);
    d.hex()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn result_does_not_depend_on_how_input_is_split() {
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let whole = bytes_digest(&data);
        for split in [1, 3, 7, 8, 9, 500, 999] {
            let mut d = Fnv64::new();
            for part in data.chunks(split) {
                d.update(part);
            }
            assert_eq!(d.hex(), whole, "split {split}");
        }
        assert_ne!(bytes_digest(&data[..999]), whole);
        let mut longer = data.clone();
        longer.push(0);
        assert_ne!(
            bytes_digest(&longer),
            whole,
            "a trailing zero changes the length"
        );
    }

    #[test]
    fn files_digest_sees_every_file_and_their_order() {
        let dir = tempfile::tempdir().unwrap();
        let a = dir.path().join("a");
        let b = dir.path().join("b");
        std::fs::write(&a, b"first shard").unwrap();
        std::fs::write(&b, b"second shard").unwrap();
        let ab = files_digest(&[a.clone(), b.clone()]).unwrap();
        assert_eq!(ab, files_digest(&[a.clone(), b.clone()]).unwrap());
        assert_ne!(ab, files_digest(&[b.clone(), a.clone()]).unwrap());
        assert_ne!(ab, files_digest(std::slice::from_ref(&a)).unwrap());
        std::fs::write(&b, b"second shard!").unwrap();
        assert_ne!(ab, files_digest(&[a, b]).unwrap());
        let (path, _) = files_digest(&[dir.path().join("missing")]).unwrap_err();
        assert!(path.ends_with("missing"));
    }

    #[test]
    fn one_file_matches_the_embedder_index_format() {
        // The sentence embedder's indexes store this digest of single-file checkpoints; it
        // must not change: FNV-1a words, then trailing bytes, then the length.
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("w");
        let data: Vec<u8> = (0..21u8).collect();
        std::fs::write(&p, &data).unwrap();
        let mut h = BASIS;
        for w in data.chunks_exact(8) {
            h = (h ^ u64::from_le_bytes(w.try_into().unwrap())).wrapping_mul(PRIME);
        }
        for &b in data.chunks_exact(8).remainder() {
            h = (h ^ b as u64).wrapping_mul(PRIME);
        }
        h = (h ^ data.len() as u64).wrapping_mul(PRIME);
        assert_eq!(files_digest(&[p]).unwrap(), format!("fnv1a64w:{h:016x}"));
    }
}
