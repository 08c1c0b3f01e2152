//! The placement planner: which GPUs hold which layers of which replica.
//!
//! Every replica is a chain of devices with contiguous layer ranges: the embedding (and vision
//! tower) with the first range, the final norm and lm_head with the last. A chain of `k`
//! devices has `k - 1` boundaries, so the fewest devices that fit give the fewest boundaries.
//! Within a chain the layers are balanced by memory: the split minimises the largest share of
//! a device's budget that any device uses (found by bisection on that share, each step a greedy
//! fill, which is exact because layers are alike).
//!
//! A device fits when weights + KV cache + workspace + context overhead ([`DeviceCost`]) is at
//! most its budget ([`MaxMemory::budget`]).
//!
//! Modes ([`PlanMode`]):
//! * `single`: one replica on the first GPU;
//! * `data-parallel`: a replica on every GPU (each must hold the whole model);
//! * `layer-sharded`: one replica on the fewest GPUs that fit (then the CPU, if the budget has
//!   a `cpu` entry and all GPUs are not enough);
//! * `hybrid`: replicas of shard groups of a given size, or of the smallest size that fits;
//! * `auto`: the most throughput: as many replicas as fit, each on as few GPUs as possible,
//!   grouping GPUs that have peer access with one another.
//!
//! Errors name the placement flags that every fleet binary shares for these settings:
//! `--gpu-mode` ([`PlanRequest::mode`]), `--gpu-ids` ([`Topology::select`]) and `--max-memory`
//! ([`PlanRequest::max_memory`]). The workload is named by its values, not by flags, since each
//! binary derives it from flags of its own.

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::Serialize;

use crate::budget::MaxMemory;
use crate::memory::{
    format_bytes, DType, DeviceCost, DevicePart, ModelShape, Workload, CONTEXT_OVERHEAD_BYTES,
};
use crate::topology::Topology;
use crate::{DeviceLocation, DeviceMap, TopologyError};

/// How replicas are laid out on the GPUs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum PlanMode {
    /// One replica on the first GPU.
    Single,
    /// One replica per GPU.
    DataParallel,
    /// One replica over the fewest GPUs that hold it.
    LayerSharded,
    /// Replicas of shard groups; `None` = the smallest group size that fits.
    Hybrid {
        /// GPUs per replica.
        group_size: Option<usize>,
    },
    /// As many replicas as fit, each on as few GPUs as possible.
    Auto,
}

impl fmt::Display for PlanMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PlanMode::Single => write!(f, "single"),
            PlanMode::DataParallel => write!(f, "data-parallel"),
            PlanMode::LayerSharded => write!(f, "layer-sharded"),
            PlanMode::Hybrid { group_size: None } => write!(f, "hybrid"),
            PlanMode::Hybrid {
                group_size: Some(g),
            } => write!(f, "hybrid:{g}"),
            PlanMode::Auto => write!(f, "auto"),
        }
    }
}

impl FromStr for PlanMode {
    type Err = TopologyError;

    /// Parses `single`, `data-parallel` (`dp`), `layer-sharded` (`sharded`), `hybrid`,
    /// `hybrid:N` (N GPUs per replica) or `auto`; `_` and `-` are interchangeable.
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase().replace('_', "-");
        let bad = || TopologyError::BadMode {
            value: s.to_string(),
        };
        Ok(match t.as_str() {
            "single" => PlanMode::Single,
            "data-parallel" | "dp" | "data" => PlanMode::DataParallel,
            "layer-sharded" | "sharded" | "layer" => PlanMode::LayerSharded,
            "hybrid" => PlanMode::Hybrid { group_size: None },
            "auto" => PlanMode::Auto,
            _ => {
                let n = t.strip_prefix("hybrid:").ok_or_else(bad)?;
                let g: usize = n.parse().map_err(|_| bad())?;
                if g == 0 {
                    return Err(bad());
                }
                PlanMode::Hybrid {
                    group_size: Some(g),
                }
            }
        })
    }
}

/// What to plan for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanRequest {
    /// Layout of replicas.
    pub mode: PlanMode,
    /// Element type of weights and KV cache.
    pub dtype: DType,
    /// The batch each replica is sized for.
    pub workload: Workload,
    /// Per-device budgets (and the `cpu` entry that allows offload).
    pub max_memory: MaxMemory,
}

impl Default for PlanRequest {
    /// Auto mode, bf16, [`Workload::default`], default reserves, no offload.
    fn default() -> Self {
        PlanRequest {
            mode: PlanMode::Auto,
            dtype: DType::Bf16,
            workload: Workload::default(),
            max_memory: MaxMemory::new(),
        }
    }
}

/// What one device of a replica holds and needs.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct DevicePlan {
    /// The device.
    pub device: DeviceLocation,
    /// Decoder layers it holds.
    pub layers: Range<usize>,
    /// It holds the embedding (and vision tower).
    pub embed: bool,
    /// It holds the final norm and lm_head.
    pub head: bool,
    /// Bytes it needs, by kind.
    pub cost: DeviceCost,
    /// Bytes the budget allows.
    pub budget: u64,
    /// `budget - cost.total()`.
    pub headroom: u64,
}

/// One replica: its device map and per-device bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ReplicaPlan {
    /// The map the model loader consumes.
    pub device_map: DeviceMap,
    /// Each device of the chain, in order.
    pub devices: Vec<DevicePlan>,
}

/// A placement: replicas of the model over a topology.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Name of the topology planned on.
    pub topology: String,
    /// The mode asked for.
    pub mode: PlanMode,
    /// Element type.
    pub dtype: DType,
    /// The batch each replica is sized for.
    pub workload: Workload,
    /// The replicas.
    pub replicas: Vec<ReplicaPlan>,
    /// GPUs that hold nothing.
    pub idle: Vec<DeviceLocation>,
    /// Where the weight sizes come from: the checkpoint's safetensors headers (exact) or
    /// config.json (the formulas of [`ModelShape`]).
    pub weights_from: String,
}

impl Plan {
    /// GPUs per replica (of the first replica; all replicas of a plan have the same size
    /// except after cpu offload, where there is only one).
    pub fn group_size(&self) -> usize {
        self.replicas.first().map_or(0, |r| r.devices.len())
    }

    /// The largest paged KV pool (bytes over the whole model, as
    /// [`Workload::kv_pool_bytes`]) that every replica holds within its budgets in place of
    /// the KV the plan charged: each device's headroom plus that KV, scaled from its layers to
    /// the whole model; the tightest device decides. `None` when no device holds a layer.
    pub fn kv_pool_room(&self) -> Option<u64> {
        self.replicas
            .iter()
            .filter_map(|r| {
                let layers: usize = r.devices.iter().map(|d| d.layers.len()).sum();
                r.devices
                    .iter()
                    .filter(|d| !d.layers.is_empty())
                    .map(|d| {
                        let room = u128::from(d.headroom + d.cost.kv_cache);
                        (room * layers as u128 / d.layers.len() as u128).min(u128::from(u64::MAX))
                            as u64
                    })
                    .min()
            })
            .min()
    }
}

impl fmt::Display for Plan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "{} replica(s) of {} GPU(s) on {} ({} mode, {}, batch {} x {} tokens)",
            self.replicas.len(),
            self.group_size(),
            self.topology,
            self.mode,
            self.dtype,
            self.workload.batch,
            self.workload.seq_len
        )?;
        writeln!(f, "weights sized from {}", self.weights_from)?;
        for (i, r) in self.replicas.iter().enumerate() {
            writeln!(f, "replica {i}: {}", r.device_map)?;
            for d in &r.devices {
                writeln!(
                    f,
                    "  {}: layers {}..{}{}{} weights {} kv {} workspace {} overhead {} / budget {} (headroom {})",
                    d.device,
                    d.layers.start,
                    d.layers.end,
                    if d.embed { " +embed" } else { "" },
                    if d.head { " +head" } else { "" },
                    format_bytes(d.cost.weights),
                    format_bytes(d.cost.kv_cache),
                    format_bytes(d.cost.workspace),
                    format_bytes(d.cost.overhead),
                    format_bytes(d.budget),
                    format_bytes(d.headroom),
                )?;
            }
        }
        if !self.idle.is_empty() {
            let idle: Vec<_> = self.idle.iter().map(|d| d.to_string()).collect();
            writeln!(f, "idle: {}", idle.join(", "))?;
        }
        Ok(())
    }
}

/// A device of a candidate chain and its budget.
#[derive(Debug, Clone, Copy)]
struct Slot {
    device: DeviceLocation,
    budget: u64,
}

struct Ctx<'a> {
    shape: &'a ModelShape,
    req: &'a PlanRequest,
}

impl Ctx<'_> {
    fn cost(&self, slot: Slot, layers: usize, first: bool, last: bool) -> DeviceCost {
        self.shape.device_cost(
            DevicePart {
                layers,
                embed: first,
                head: last,
                gpu: slot.device != DeviceLocation::Cpu,
            },
            self.req.dtype,
            &self.req.workload,
        )
    }

    /// Greedy fill at utilisation `ratio`: layer counts per device, or `None`.
    fn fill(&self, chain: &[Slot], ratio: f64) -> Option<Vec<usize>> {
        let k = chain.len();
        let total = self.shape.num_layers;
        let mut counts = Vec::with_capacity(k);
        let mut start = 0;
        for (i, &slot) in chain.iter().enumerate() {
            let cap = (slot.budget as f64 * ratio) as u64;
            let (first, last) = (i == 0, i == k - 1);
            let fits = |n| self.cost(slot, n, first, last).total() <= cap;
            if last {
                let n = total - start;
                if !fits(n) {
                    return None;
                }
                counts.push(n);
            } else {
                let max_n = total - start - (k - 1 - i);
                let mut n = 0;
                while n < max_n && fits(n + 1) {
                    n += 1;
                }
                if n == 0 {
                    return None;
                }
                counts.push(n);
                start += n;
            }
        }
        Some(counts)
    }

    /// Among the splits whose every device stays within `ratio` of its budget, the one with
    /// the smallest sum of squared utilisations (so the spare memory is spread out rather
    /// than left on the last device). Dynamic programming over (device, layers covered).
    fn smooth(&self, chain: &[Slot], ratio: f64) -> Option<Vec<usize>> {
        let k = chain.len();
        let total = self.shape.num_layers;
        const NONE: f64 = f64::INFINITY;
        // best[i][j]: least cost of putting layers 0..j on devices 0..i (each at least one).
        let mut best = vec![vec![NONE; total + 1]; k + 1];
        let mut from = vec![vec![0usize; total + 1]; k + 1];
        best[0][0] = 0.0;
        for i in 0..k {
            let slot = chain[i];
            let cap = slot.budget as f64 * ratio;
            let (first, last) = (i == 0, i == k - 1);
            for j0 in 0..total {
                if best[i][j0] == NONE {
                    continue;
                }
                let hi = if last { total } else { total - (k - 1 - i) };
                for j in (j0 + 1)..=hi {
                    if last && j != total {
                        continue;
                    }
                    let used = self.cost(slot, j - j0, first, last).total() as f64;
                    if used > cap {
                        break;
                    }
                    let u = used / (slot.budget.max(1)) as f64;
                    let v = best[i][j0] + u * u;
                    if v < best[i + 1][j] {
                        best[i + 1][j] = v;
                        from[i + 1][j] = j0;
                    }
                }
            }
        }
        if best[k][total] == NONE {
            return None;
        }
        let mut counts = vec![0; k];
        let mut j = total;
        for i in (1..=k).rev() {
            let j0 = from[i][j];
            counts[i - 1] = j - j0;
            j = j0;
        }
        Some(counts)
    }

    /// The memory-balanced split of the model over `chain` (every device gets a layer), or
    /// `None` when it does not fit.
    fn fit(&self, chain: &[Slot]) -> Option<ReplicaPlan> {
        if chain.is_empty() || chain.len() > self.shape.num_layers {
            return None;
        }
        self.fill(chain, 1.0)?;
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            if self.fill(chain, mid).is_some() {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        let counts = self.smooth(chain, hi).or_else(|| self.fill(chain, hi))?;
        let k = chain.len();
        let mut devices = Vec::with_capacity(k);
        let mut layers = Vec::with_capacity(self.shape.num_layers);
        let mut start = 0;
        for (i, (&slot, &n)) in chain.iter().zip(&counts).enumerate() {
            let cost = self.cost(slot, n, i == 0, i == k - 1);
            devices.push(DevicePlan {
                device: slot.device,
                layers: start..start + n,
                embed: i == 0,
                head: i == k - 1,
                cost,
                budget: slot.budget,
                headroom: slot.budget.saturating_sub(cost.total()),
            });
            layers.extend(std::iter::repeat_n(slot.device, n));
            start += n;
        }
        Some(ReplicaPlan {
            device_map: DeviceMap {
                embed: chain[0].device,
                layers,
                head: chain[k - 1].device,
            },
            devices,
        })
    }
}

/// Disjoint groups of `g` GPU positions (indices into `topo.gpus`), each built from GPUs with
/// peer access to one another where the topology has such GPUs left, else in order.
pub(crate) fn groups_of(topo: &Topology, g: usize) -> Vec<Vec<usize>> {
    let idx = |p: usize| match topo.gpus[p].location {
        DeviceLocation::Cuda(n) => n,
        DeviceLocation::Cpu => usize::MAX,
    };
    let mut unused: Vec<usize> = (0..topo.gpus.len()).collect();
    let mut out = Vec::new();
    while unused.len() >= g && g > 0 {
        let mut group = vec![unused[0]];
        for &v in &unused[1..] {
            if group.len() == g {
                break;
            }
            if group.iter().all(|&m| topo.peers(idx(m), idx(v))) {
                group.push(v);
            }
        }
        for &v in &unused[1..] {
            if group.len() == g {
                break;
            }
            if !group.contains(&v) {
                group.push(v);
            }
        }
        unused.retain(|v| !group.contains(v));
        out.push(group);
    }
    out
}

/// Plans replicas of the model `shape` on `topology` as `request` asks.
///
/// Errors when nothing fits ([`TopologyError::DoesNotFit`], with the bytes needed and
/// available per device and the ways out), when the topology has no GPU and no offload is
/// allowed, when the mode's group size is impossible, or when the budgets give a device no
/// memory or name a GPU that is not in `topology`.
pub fn plan(
    shape: &ModelShape,
    topology: &Topology,
    request: &PlanRequest,
) -> Result<Plan, TopologyError> {
    request.workload.validate()?;
    check_budgets(&request.max_memory, topology)?;
    let ctx = Ctx {
        shape,
        req: request,
    };
    let slots: Vec<Slot> = topology
        .gpus
        .iter()
        .map(|g| Slot {
            device: g.location,
            budget: request.max_memory.budget(g.location, g.total_bytes),
        })
        .collect();
    let n = slots.len();
    let chain_of = |group: &[usize]| -> Vec<Slot> { group.iter().map(|&p| slots[p]).collect() };
    let fitting = |g: usize| -> Vec<ReplicaPlan> {
        groups_of(topology, g)
            .iter()
            .filter_map(|grp| ctx.fit(&chain_of(grp)))
            .collect()
    };
    let offload = || -> Option<ReplicaPlan> {
        if !request.max_memory.allows_cpu_offload() {
            return None;
        }
        let cpu = Slot {
            device: DeviceLocation::Cpu,
            budget: request
                .max_memory
                .budget(DeviceLocation::Cpu, topology.cpu_bytes.unwrap_or(u64::MAX)),
        };
        let mut chain = slots.clone();
        chain.push(cpu);
        ctx.fit(&chain)
    };

    let replicas: Vec<ReplicaPlan> = match request.mode {
        PlanMode::Single => {
            let one = slots.first().and_then(|&s| ctx.fit(&[s]));
            match one {
                Some(r) => vec![r],
                None => {
                    let first = slots.first().copied();
                    let mut chain: Vec<Slot> = first.into_iter().collect();
                    if request.max_memory.allows_cpu_offload() {
                        chain.push(Slot {
                            device: DeviceLocation::Cpu,
                            budget: request.max_memory.budget(
                                DeviceLocation::Cpu,
                                topology.cpu_bytes.unwrap_or(u64::MAX),
                            ),
                        });
                    }
                    match ctx.fit(&chain) {
                        Some(r) if chain.len() > 1 => vec![r],
                        _ => return Err(not_fit(&ctx, topology, &slots[..n.min(1)])),
                    }
                }
            }
        }
        PlanMode::DataParallel => {
            let mut out = Vec::new();
            for &s in &slots {
                match ctx.fit(&[s]) {
                    Some(r) => out.push(r),
                    None => return Err(not_fit(&ctx, topology, &[s])),
                }
            }
            out
        }
        PlanMode::LayerSharded => match (1..=n).find_map(|g| fitting(g).into_iter().next()) {
            Some(r) => vec![r],
            None => match offload() {
                Some(r) => vec![r],
                None => return Err(not_fit(&ctx, topology, &slots)),
            },
        },
        PlanMode::Hybrid {
            group_size: Some(g),
        } => {
            if g > n {
                return Err(TopologyError::GroupTooLarge {
                    group_size: g,
                    gpus: n,
                });
            }
            let out = fitting(g);
            if out.is_empty() {
                return Err(not_fit(
                    &ctx,
                    topology,
                    &chain_of(&groups_of(topology, g)[0]),
                ));
            }
            out
        }
        PlanMode::Hybrid { group_size: None } => {
            match (1..=n).map(fitting).find(|r| !r.is_empty()) {
                Some(out) => out,
                None => return Err(not_fit(&ctx, topology, &slots)),
            }
        }
        PlanMode::Auto => {
            let mut best: Vec<ReplicaPlan> = Vec::new();
            for g in 1..=n {
                // More replicas need smaller groups; once g > n / (best + 1) none can win.
                if best.len() * g >= n && !best.is_empty() {
                    break;
                }
                let r = fitting(g);
                if r.len() > best.len() {
                    best = r;
                }
            }
            if best.is_empty() {
                match offload() {
                    Some(r) => vec![r],
                    None => return Err(not_fit(&ctx, topology, &slots)),
                }
            } else {
                best
            }
        }
    };
    if replicas.is_empty() {
        return Err(TopologyError::NoGpus {
            topology: topology.name.clone(),
        });
    }
    let used: Vec<DeviceLocation> = replicas
        .iter()
        .flat_map(|r| r.devices.iter().map(|d| d.device))
        .collect();
    let idle = slots
        .iter()
        .map(|s| s.device)
        .filter(|d| !used.contains(d))
        .collect();
    Ok(Plan {
        topology: topology.name.clone(),
        mode: request.mode,
        dtype: request.dtype,
        workload: request.workload,
        replicas,
        idle,
        weights_from: weights_from(shape),
    })
}

/// Where the weight sizes of `shape` come from, for reports.
pub(crate) fn weights_from(shape: &ModelShape) -> String {
    match &shape.checkpoint {
        Some(c) => format!(
            "the safetensors headers of {} file(s) ({} parameters, exact)",
            c.files.len(),
            format_params(c.total())
        ),
        None => format!(
            "config.json ({} parameters, estimated)",
            format_params(shape.total_params())
        ),
    }
}

/// Budgets the plan can honour: none of no memory (a device the caller meant to leave out,
/// which `--gpu-ids` does), none for a GPU that is not in `topology` (a typo, or ids taken as
/// renumbered after `--gpu-ids`; an entry that would silently do nothing).
pub(crate) fn check_budgets(
    max_memory: &MaxMemory,
    topology: &Topology,
) -> Result<(), TopologyError> {
    let ids = topology.gpu_ids();
    for (device, limit) in max_memory.entries() {
        if limit.is_zero() {
            return Err(TopologyError::ZeroBudget {
                device,
                key: device.to_string(),
                value: "0".into(),
            });
        }
        if let DeviceLocation::Cuda(id) = device {
            if !ids.contains(&id) {
                return Err(TopologyError::MaxMemoryGpuNotPlanned { id, ids });
            }
        }
    }
    Ok(())
}

/// A parameter count people read at a glance: `7.616B`, `494.03M`, or the count itself.
pub(crate) fn format_params(n: u64) -> String {
    if n >= 100_000_000 {
        format!("{:.3}B", n as f64 / 1e9)
    } else if n >= 100_000 {
        format!("{:.2}M", n as f64 / 1e6)
    } else {
        n.to_string()
    }
}

/// The error for a model that fits nowhere: the need, the budgets of `chain`, the ways out.
fn not_fit(ctx: &Ctx<'_>, topology: &Topology, chain: &[Slot]) -> TopologyError {
    let shape = ctx.shape;
    let req = ctx.req;
    if chain.is_empty() {
        return TopologyError::NoGpus {
            topology: topology.name.clone(),
        };
    }
    let whole = ctx.cost(chain[0], shape.num_layers, true, true);
    let needed = whole.total();
    let available: Vec<(DeviceLocation, u64)> =
        chain.iter().map(|s| (s.device, s.budget)).collect();
    let budgets: Vec<String> = chain
        .iter()
        .map(|s| {
            let total = topology
                .gpus
                .iter()
                .find(|g| g.location == s.device)
                .map_or(0, |g| g.total_bytes);
            format!(
                "{} {} of {}",
                s.device,
                format_bytes(s.budget),
                format_bytes(total)
            )
        })
        .collect();
    let per_gpu = chain
        .iter()
        .map(|s| s.budget.saturating_sub(CONTEXT_OVERHEAD_BYTES))
        .max()
        .unwrap_or(0)
        .max(1);
    let gpus_needed = needed
        .saturating_sub(CONTEXT_OVERHEAD_BYTES)
        .div_ceil(per_gpu);
    let mut ways = Vec::new();
    if req.dtype == DType::F32 {
        let half = shape.total_weight_bytes(DType::Bf16);
        ways.push(format!(
            "use bf16 or f16 (weights {} instead of {})",
            format_bytes(half),
            format_bytes(whole.weights)
        ));
    }
    match req.mode {
        PlanMode::Single | PlanMode::DataParallel | PlanMode::Hybrid { .. }
            if (chain.len() as u64) < gpus_needed && (topology.gpus.len() as u64) >= gpus_needed =>
        {
            ways.push(format!(
                "shard it: --gpu-mode layer-sharded or auto (about {gpus_needed} of these GPUs hold it)"
            ))
        }
        _ => ways.push(format!(
            "more GPUs (about {gpus_needed} GPUs with this budget; {} given)",
            topology.gpus.len()
        )),
    }
    if !req.max_memory.allows_cpu_offload() {
        ways.push("cpu offload (add an entry such as cpu=64GiB to --max-memory)".into());
    } else {
        ways.push("a larger cpu entry in --max-memory".into());
    }
    ways.push(format!(
        "a smaller workload (batch {} x {} tokens: KV cache {}, workspace {})",
        req.workload.batch,
        req.workload.seq_len,
        format_bytes(whole.kv_cache),
        format_bytes(whole.workspace)
    ));
    ways.push("larger --max-memory entries (the default keeps 10% or 1 GiB free per GPU)".into());
    let detail = format!(
        "one replica needs {} in {} (weights {}, KV cache {}, workspace {}, plus {} context per GPU); budgets: {}. Ways out: {}",
        format_bytes(needed),
        req.dtype,
        format_bytes(whole.weights),
        format_bytes(whole.kv_cache),
        format_bytes(whole.workspace),
        format_bytes(CONTEXT_OVERHEAD_BYTES),
        budgets.join(", "),
        ways.join("; ")
    );
    TopologyError::DoesNotFit {
        model: format!(
            "{} ({:.1}B parameters)",
            if shape.model_type.is_empty() {
                "the model"
            } else {
                &shape.model_type
            },
            shape.total_params() as f64 / 1e9
        ),
        mode: req.mode.to_string(),
        needed_bytes: needed,
        available,
        detail,
    }
}
