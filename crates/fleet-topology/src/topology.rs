//! The GPUs a plan places models on: discovered ones, or virtual ones described in TOML so that
//! planning runs and is tested without a GPU.
//!
//! A topology file (see `configs/topologies/`):
//!
//! ```toml
//! name = "8x RTX 3060 12 GB"
//! peer_access = false          # optional: true = every pair of GPUs has peer access
//! # peer_groups = [[0, 1], [2, 3]]  # optional instead: peer access inside each group only
//! cpu_memory = "64GiB"         # optional: host memory, for cpu offload
//!
//! [[gpu]]
//! name = "NVIDIA GeForce RTX 3060"
//! memory = "12GiB"             # total memory of one GPU
//! count = 8                    # optional, default 1
//! ```
//!
//! GPUs are numbered `cuda:0`, `cuda:1`, ... in the order of the `[[gpu]]` entries.
//!
//! With `[[logical]]` entries the file describes logical devices on those GPUs
//! ([`crate::logical`]): the topology's devices are the logical ones, `cuda:0`, `cuda:1`, ... in
//! the order of the entries, each with its cap as its memory, and its name says "logical devices
//! on one GPU":
//!
//! ```toml
//! name = "the seed's 8x RTX 3060 12 GB, as logical devices on one H200"
//! [[gpu]]
//! name = "NVIDIA H200"
//! memory = "140GiB"
//! [[logical]]
//! gpu = 0                      # the physical GPU (default 0)
//! memory = "12GiB"             # each one's cap (default: an equal share)
//! count = 8
//! ```

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::budget::parse_bytes;
use crate::logical::{LogicalEntry, LogicalGpus, LABEL as LOGICAL_LABEL};
use crate::{DeviceInfo, DeviceLocation, TopologyError};

/// One GPU of a topology.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Gpu {
    /// Its location, `cuda:N`.
    pub location: DeviceLocation,
    /// Its name, e.g. `NVIDIA H200`.
    pub name: String,
    /// Total memory in bytes.
    pub total_bytes: u64,
}

/// Which pairs of GPUs can read each other's memory directly (NVLink or PCIe P2P).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum PeerAccess {
    /// Every pair.
    All,
    /// No pair: hidden states cross through host memory.
    None,
    /// Pairs inside each group of GPU indices.
    Groups(Vec<Vec<usize>>),
}

impl PeerAccess {
    /// Peer access as [`crate::discover`] reported it: GPUs whose reachable sets (themselves
    /// included) are equal form a group; one group of every GPU is [`PeerAccess::All`], groups
    /// of one GPU each are [`PeerAccess::None`]. A pair reported in one direction only is not
    /// counted as peers.
    pub fn from_reported(devices: &[DeviceInfo]) -> Self {
        let gpus: Vec<(usize, &DeviceInfo)> = devices
            .iter()
            .filter_map(|d| match d.location {
                DeviceLocation::Cuda(i) => Some((i, d)),
                DeviceLocation::Cpu => None,
            })
            .collect();
        let reaches = |a: usize, b: usize| {
            a == b || gpus.iter().any(|(i, d)| *i == a && d.peers.contains(&b))
        };
        let mutual = |a: usize, b: usize| reaches(a, b) && reaches(b, a);
        let mut groups: Vec<Vec<usize>> = Vec::new();
        for &(a, _) in &gpus {
            let reach_set: Vec<usize> = gpus
                .iter()
                .map(|(b, _)| *b)
                .filter(|&b| mutual(a, b))
                .collect();
            match groups.iter_mut().find(|g| {
                g.iter().all(|&m| mutual(m, a)) && {
                    let m = g[0];
                    gpus.iter()
                        .map(|(b, _)| *b)
                        .filter(|&b| mutual(m, b))
                        .eq(reach_set.iter().copied())
                }
            }) {
                Some(g) => g.push(a),
                None => groups.push(vec![a]),
            }
        }
        if groups.len() <= 1 {
            PeerAccess::All
        } else if groups.iter().all(|g| g.len() == 1) {
            PeerAccess::None
        } else {
            PeerAccess::Groups(groups)
        }
    }

    /// Whether GPUs `a` and `b` have peer access (a GPU always reaches itself).
    pub fn between(&self, a: usize, b: usize) -> bool {
        a == b
            || match self {
                PeerAccess::All => true,
                PeerAccess::None => false,
                PeerAccess::Groups(groups) => {
                    groups.iter().any(|g| g.contains(&a) && g.contains(&b))
                }
            }
    }
}

/// A set of GPUs (and optionally the host's memory) to plan on.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Topology {
    /// A name for reports.
    pub name: String,
    /// The GPUs, `cuda:0` first.
    pub gpus: Vec<Gpu>,
    /// Peer access between the GPUs.
    pub peer_access: PeerAccess,
    /// Host memory in bytes, when known (the ceiling of a `cpu` budget).
    pub cpu_bytes: Option<u64>,
    /// The logical devices these GPUs are, when they are ([`crate::logical`]); `None` for
    /// physical GPUs.
    pub logical: Option<LogicalGpus>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTopology {
    name: Option<String>,
    peer_access: Option<bool>,
    peer_groups: Option<Vec<Vec<usize>>>,
    cpu_memory: Option<String>,
    #[serde(default)]
    gpu: Vec<RawGpu>,
    #[serde(default)]
    logical: Vec<LogicalEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawGpu {
    name: String,
    memory: String,
    count: Option<usize>,
}

impl Topology {
    /// Reads a topology TOML file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, TopologyError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| TopologyError::Io {
            file: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parses the text of a topology file; `source` names it in errors.
    pub fn from_toml_str(text: &str, source: &str) -> Result<Self, TopologyError> {
        let err = |field: &str, message: String| TopologyError::TopologyFile {
            file: source.to_string(),
            field: field.to_string(),
            message,
        };
        let raw: RawTopology = toml::from_str(text).map_err(|e| {
            let line = e
                .span()
                .map(|s| text[..s.start.min(text.len())].lines().count().max(1));
            let msg = e.message().to_string();
            let field = toml_field(&msg, text, e.span().map(|s| s.start));
            err(
                &field,
                match line {
                    Some(l) => format!("line {l}: {msg}"),
                    None => msg,
                },
            )
        })?;
        if raw.gpu.is_empty() {
            return Err(err(
                "gpu",
                "no [[gpu]] entry: add one with name, memory (e.g. \"12GiB\") and count".into(),
            ));
        }
        let mut gpus = Vec::new();
        for (i, g) in raw.gpu.iter().enumerate() {
            let total = parse_bytes(&g.memory)
                .map_err(|e| err(&format!("gpu[{i}].memory"), e.to_string()))?;
            let count = g.count.unwrap_or(1);
            if count == 0 {
                return Err(err(
                    &format!("gpu[{i}].count"),
                    "count is 0: give at least 1 or remove the entry".into(),
                ));
            }
            if g.name.trim().is_empty() {
                return Err(err(&format!("gpu[{i}].name"), "name is empty".into()));
            }
            for _ in 0..count {
                gpus.push(Gpu {
                    location: DeviceLocation::Cuda(gpus.len()),
                    name: g.name.clone(),
                    total_bytes: total,
                });
            }
        }
        let peer_access = match (raw.peer_access, raw.peer_groups) {
            (Some(_), Some(_)) => {
                return Err(err(
                    "peer_groups",
                    "give either peer_access (all pairs or none) or peer_groups, not both".into(),
                ))
            }
            (_, Some(groups)) => {
                for (gi, g) in groups.iter().enumerate() {
                    if let Some(&bad) = g.iter().find(|&&i| i >= gpus.len()) {
                        return Err(err(
                            &format!("peer_groups[{gi}]"),
                            format!(
                                "GPU index {bad} does not exist: the file has {} GPUs (0..{})",
                                gpus.len(),
                                gpus.len() - 1
                            ),
                        ));
                    }
                }
                PeerAccess::Groups(groups)
            }
            (Some(true), None) => PeerAccess::All,
            (Some(false), None) | (None, None) => PeerAccess::None,
        };
        let cpu_bytes = match &raw.cpu_memory {
            Some(m) => Some(parse_bytes(m).map_err(|e| err("cpu_memory", e.to_string()))?),
            None => None,
        };
        let topology = Topology {
            name: raw
                .name
                .unwrap_or_else(|| format!("{}x {}", gpus.len(), gpus[0].name)),
            gpus,
            peer_access,
            cpu_bytes,
            logical: None,
        };
        if raw.logical.is_empty() {
            return Ok(topology);
        }
        let logical = LogicalGpus::from_entries(&raw.logical, source)?;
        topology.with_logical(logical)
    }

    /// The logical devices `logical` on this topology's GPUs (checked: each physical GPU
    /// exists and holds its devices' caps): every device `cuda:i` a logical one, its cap as its
    /// memory, all of one GPU peers of each other, the name saying [`LOGICAL_LABEL`].
    pub fn with_logical(&self, logical: LogicalGpus) -> Result<Topology, TopologyError> {
        let physical: Vec<DeviceInfo> = self
            .gpus
            .iter()
            .map(|g| DeviceInfo {
                location: g.location,
                name: g.name.clone(),
                compute_capability: None,
                total_bytes: Some(g.total_bytes),
                free_bytes: Some(g.total_bytes),
                pci_bus_id: None,
                peers: Vec::new(),
            })
            .collect();
        let infos = logical.device_infos(&physical)?;
        let mut topology = Topology::from_devices(&infos);
        topology.name = if self.name.contains(LOGICAL_LABEL) {
            self.name.clone()
        } else {
            format!("{} ({LOGICAL_LABEL})", self.name)
        };
        topology.cpu_bytes = self.cpu_bytes;
        topology.logical = Some(logical);
        Ok(topology)
    }

    /// A topology of `count` identical GPUs.
    pub fn uniform(name: &str, count: usize, total_bytes: u64, peer_access: bool) -> Self {
        Topology {
            name: format!("{count}x {name}"),
            gpus: (0..count)
                .map(|i| Gpu {
                    location: DeviceLocation::Cuda(i),
                    name: name.to_string(),
                    total_bytes,
                })
                .collect(),
            peer_access: if peer_access {
                PeerAccess::All
            } else {
                PeerAccess::None
            },
            cpu_bytes: None,
            logical: None,
        }
    }

    /// The GPUs [`crate::discover`] found (the CPU entry, if any, gives `cpu_bytes`), with the
    /// peer access the driver reported.
    pub fn from_devices(devices: &[DeviceInfo]) -> Self {
        let mut gpus = Vec::new();
        let mut cpu_bytes = None;
        for d in devices {
            match d.location {
                DeviceLocation::Cuda(_) => gpus.push(Gpu {
                    location: d.location,
                    name: d.name.clone(),
                    total_bytes: d.total_bytes.unwrap_or(0),
                }),
                DeviceLocation::Cpu => cpu_bytes = d.total_bytes,
            }
        }
        let logical = crate::logical::installed().cloned();
        Topology {
            name: if gpus.is_empty() {
                "cpu only".into()
            } else if logical.is_some() {
                format!("{}x {LOGICAL_LABEL}", gpus.len())
            } else {
                format!("{}x {}", gpus.len(), gpus[0].name)
            },
            peer_access: PeerAccess::from_reported(devices),
            gpus,
            cpu_bytes,
            logical,
        }
    }

    /// Keeps only the GPUs of `ids` (in the given order), as `--gpu-ids` does. An id the
    /// topology does not have is an error naming it and the ids there are; so is an id given
    /// twice.
    pub fn select(&self, ids: &[usize]) -> Result<Self, TopologyError> {
        let mut gpus = Vec::new();
        for &id in ids {
            let gpu = self
                .gpus
                .iter()
                .find(|g| g.location == DeviceLocation::Cuda(id))
                .ok_or_else(|| TopologyError::GpuNotInTopology {
                    id,
                    topology: self.name.clone(),
                    ids: self.gpu_ids(),
                })?;
            if gpus.contains(gpu) {
                return Err(TopologyError::DuplicateGpu { id });
            }
            gpus.push(gpu.clone());
        }
        Ok(Topology {
            name: self.name.clone(),
            gpus,
            peer_access: self.peer_access.clone(),
            cpu_bytes: self.cpu_bytes,
            logical: self.logical.clone(),
        })
    }

    /// The CUDA indices of the GPUs, in order.
    pub fn gpu_ids(&self) -> Vec<usize> {
        self.gpus
            .iter()
            .filter_map(|g| g.location.cuda_ordinal())
            .collect()
    }

    /// Whether GPUs `a` and `b` (CUDA indices) have peer access.
    pub fn peers(&self, a: usize, b: usize) -> bool {
        self.peer_access.between(a, b)
    }
}

/// The field a toml error is about: the key toml names in "missing/unknown field `x`", the key
/// on the line of a value of the wrong type, or `(toml syntax)` for a syntax error.
fn toml_field(msg: &str, text: &str, at: Option<usize>) -> String {
    for prefix in ["missing field `", "unknown field `", "duplicate key `"] {
        if let Some(rest) = msg.find(prefix).map(|i| &msg[i + prefix.len()..]) {
            if let Some(end) = rest.find('`') {
                return rest[..end].to_string();
            }
        }
    }
    if msg.starts_with("invalid type") || msg.starts_with("invalid value") {
        if let Some(at) = at.filter(|&a| a <= text.len()) {
            let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
            let line = text[start..].lines().next().unwrap_or("");
            if let Some((key, _)) = line.split_once('=') {
                return key.trim().to_string();
            }
        }
    }
    "(toml syntax)".into()
}
