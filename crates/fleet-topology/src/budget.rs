//! Memory budgets in the style of accelerate's `max_memory`.
//!
//! A budget maps devices to the most memory a plan may use there:
//!
//! ```text
//! 0 = "10GiB"     cuda:1 = "10GB"     2 = "500MiB"     3 = "0.9"     cpu = "64GiB"
//! ```
//!
//! Values are a size with a unit (`B`, `KB`/`MB`/`GB`/`TB` in powers of 1000, `KiB`/`MiB`/
//! `GiB`/`TiB` in powers of 1024, as accelerate reads them), a bare integer (bytes), or a
//! fraction of the device's total memory (`0.9` or `90%`). The `cpu` key gives the host memory
//! that offloaded layers may use; without it nothing is offloaded.
//!
//! A device without an entry gets its total memory less [`default_reserve`]: 10% of the total
//! or 1 GiB, whichever is larger, left for other processes, fragmentation and the allocator's
//! rounding. An explicit entry is taken as given (as accelerate does), capped at the total.
//!
//! Each device has at most one entry (`0` and `cuda:0` are one device), and no entry is zero:
//! a GPU that should hold nothing is left out of the GPUs planned on (`--gpu-ids`), and no
//! `cpu` entry means no offload. [`crate::plan`] also refuses entries for GPUs it is not
//! planning on.

use std::collections::BTreeMap;
use std::str::FromStr;

use serde::Serialize;

use crate::memory::GIB;
use crate::{DeviceLocation, TopologyError};

/// One budget value: bytes, or a fraction of the device's total memory.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub enum MemoryLimit {
    /// An absolute size.
    Bytes(u64),
    /// A fraction in (0, 1] of the device's total memory.
    Fraction(f64),
}

impl MemoryLimit {
    /// The limit in bytes on a device of `total` bytes (capped at `total`).
    pub fn resolve(&self, total: u64) -> u64 {
        match *self {
            MemoryLimit::Bytes(b) => b.min(total),
            MemoryLimit::Fraction(f) => (total as f64 * f) as u64,
        }
    }

    /// Whether it allows no memory at all (`0`, `0GiB`, `0%`).
    pub fn is_zero(&self) -> bool {
        match *self {
            MemoryLimit::Bytes(b) => b == 0,
            MemoryLimit::Fraction(f) => f <= 0.0,
        }
    }

    /// Parses like [`FromStr`] but lets a zero through, so that [`MaxMemory`] can name the
    /// entry that has it.
    fn parse_allowing_zero(s: &str) -> Result<Self, TopologyError> {
        let t = s.trim();
        let bad = |reason: &str| TopologyError::BadMemorySize {
            value: s.to_string(),
            reason: reason.to_string(),
        };
        if let Some(pct) = t.strip_suffix('%') {
            let p: f64 = pct
                .trim()
                .parse()
                .map_err(|_| bad("a percentage is a number followed by %, e.g. 90%"))?;
            if !(0.0..=100.0).contains(&p) {
                return Err(bad("a percentage must be in (0, 100]"));
            }
            return Ok(MemoryLimit::Fraction(p / 100.0));
        }
        let split = t
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let unit = unit.trim();
        if num.is_empty() {
            return Err(bad(
                "write a size such as 10GiB, 10GB, 500MiB, or a fraction such as 0.9",
            ));
        }
        let value: f64 = num
            .parse()
            .map_err(|_| bad("the number part does not parse"))?;
        if unit.is_empty() {
            if num.contains('.') {
                if !(0.0..=1.0).contains(&value) {
                    return Err(bad(
                        "a bare decimal is a fraction of the device's memory and must be in (0, 1]; add a unit (GiB, GB, MiB) for a size",
                    ));
                }
                return Ok(MemoryLimit::Fraction(value));
            }
            return Ok(MemoryLimit::Bytes(value as u64));
        }
        let mult: f64 = match unit.to_ascii_lowercase().as_str() {
            "b" => 1.0,
            "kb" => 1e3,
            "mb" => 1e6,
            "gb" => 1e9,
            "tb" => 1e12,
            "kib" => 1024.0,
            "mib" => 1024.0 * 1024.0,
            "gib" => GIB as f64,
            "tib" => GIB as f64 * 1024.0,
            _ => {
                return Err(bad(
                    "unknown unit: use B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024)",
                ))
            }
        };
        Ok(MemoryLimit::Bytes((value * mult).round() as u64))
    }
}

impl FromStr for MemoryLimit {
    type Err = TopologyError;

    /// Parses a size (`10GiB`, `10GB`, `500MiB`, bytes), or a fraction (`0.9`, `90%`); zero is
    /// refused (a budget of no memory holds nothing).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let limit = Self::parse_allowing_zero(s)?;
        if limit.is_zero() {
            return Err(TopologyError::BadMemorySize {
                value: s.to_string(),
                reason: "a budget must be larger than zero".into(),
            });
        }
        Ok(limit)
    }
}

/// Parses a size with a unit into bytes (`12GiB`, `80GB`, `500MiB`); fractions are refused.
pub fn parse_bytes(s: &str) -> Result<u64, TopologyError> {
    match s.parse::<MemoryLimit>()? {
        MemoryLimit::Bytes(b) if b > 0 => Ok(b),
        _ => Err(TopologyError::BadMemorySize {
            value: s.to_string(),
            reason: "a memory size needs a unit, e.g. 12GiB or 80GB (fractions are for budgets)"
                .into(),
        }),
    }
}

/// The default reserve on a device of `total` bytes without a budget entry: the larger of 10%
/// of the total and 1 GiB (but never more than half the device).
pub fn default_reserve(total: u64) -> u64 {
    (total / 10).max(GIB).min(total / 2)
}

/// Per-device memory limits (accelerate's `max_memory`).
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct MaxMemory {
    limits: BTreeMap<DeviceLocation, MemoryLimit>,
}

impl MaxMemory {
    /// No entries: every GPU gets its total less [`default_reserve`], nothing is offloaded.
    pub fn new() -> Self {
        Self::default()
    }

    /// Parses `(device, value)` pairs: keys `0`, `cuda:0` or `cpu`; values as [`MemoryLimit`].
    /// Errors name the entry at fault: a key that is not a device, a device given twice (`0`
    /// and `cuda:0` are one device), a value that does not parse or is zero.
    pub fn from_pairs<K: AsRef<str>, V: AsRef<str>>(
        pairs: impl IntoIterator<Item = (K, V)>,
    ) -> Result<Self, TopologyError> {
        let mut out = MaxMemory::new();
        let mut keys: BTreeMap<DeviceLocation, String> = BTreeMap::new();
        for (k, v) in pairs {
            let (key, value) = (k.as_ref(), v.as_ref());
            let device: DeviceLocation =
                key.parse().map_err(|_| TopologyError::BadMaxMemoryKey {
                    key: key.to_string(),
                })?;
            if let Some(first) = keys.get(&device) {
                return Err(TopologyError::DuplicateMaxMemoryKey {
                    device,
                    first: first.clone(),
                    second: key.to_string(),
                });
            }
            let limit = MemoryLimit::parse_allowing_zero(value)?;
            if limit.is_zero() {
                return Err(TopologyError::ZeroBudget {
                    device,
                    key: key.to_string(),
                    value: value.to_string(),
                });
            }
            keys.insert(device, key.to_string());
            out.limits.insert(device, limit);
        }
        Ok(out)
    }

    /// Sets the limit of one device (replacing any it had).
    pub fn set(&mut self, device: DeviceLocation, limit: MemoryLimit) {
        self.limits.insert(device, limit);
    }

    /// The explicit entry of `device`, if any.
    pub fn get(&self, device: DeviceLocation) -> Option<MemoryLimit> {
        self.limits.get(&device).copied()
    }

    /// Bytes a plan may use on `device` of `total` bytes: the entry if present, else the total
    /// less [`default_reserve`] for a GPU. For the CPU, 0 unless a `cpu` entry exists (no
    /// offload without asking).
    pub fn budget(&self, device: DeviceLocation, total: u64) -> u64 {
        match (self.get(device), device) {
            (Some(limit), _) => limit.resolve(total),
            (None, DeviceLocation::Cpu) => 0,
            (None, DeviceLocation::Cuda(_)) => total - default_reserve(total),
        }
    }

    /// Whether a `cpu` entry allows offloading layers to the host.
    pub fn allows_cpu_offload(&self) -> bool {
        self.limits.contains_key(&DeviceLocation::Cpu)
    }

    /// The entries, in device order.
    pub fn entries(&self) -> impl Iterator<Item = (DeviceLocation, MemoryLimit)> + '_ {
        self.limits.iter().map(|(d, l)| (*d, *l))
    }
}

impl FromStr for MaxMemory {
    type Err = TopologyError;

    /// Parses `0=10GiB,1=10GiB,cpu=64GiB` (commas or whitespace between entries; `:` after a
    /// bare index also works: `0:10GiB`).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let mut pairs = Vec::new();
        for item in s.split([',', ' ', '\n', '\t']).filter(|t| !t.is_empty()) {
            let (k, v) = item
                .split_once('=')
                .or_else(|| {
                    item.rsplit_once(':')
                        .filter(|(k, _)| !k.eq_ignore_ascii_case("cuda"))
                })
                .ok_or_else(|| TopologyError::BadMaxMemoryKey {
                    key: item.to_string(),
                })?;
            pairs.push((k.trim().to_string(), v.trim().to_string()));
        }
        Self::from_pairs(pairs)
    }
}
