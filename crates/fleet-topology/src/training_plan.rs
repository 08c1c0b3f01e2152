//! Placement of GSPO's three models (policy, reference, reward) for training; the rules are on
//! [`plan_training`].

use std::fmt;
use std::ops::Range;
use std::str::FromStr;

use serde::Serialize;

use crate::budget::{default_reserve, MaxMemory};
use crate::memory::{format_bytes, DevicePart, ModelShape};
use crate::planner::{check_budgets, groups_of, weights_from};
use crate::topology::Topology;
use crate::training::{RoleCost, TrainingWorkload, TRAINING_CONTEXT_BYTES};
use crate::{DeviceLocation, DeviceMap, TopologyError};

/// Where the three models of a GSPO run go (the seed's names; serialized as them).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(into = "String")]
pub enum TrainingPreset {
    /// Everything on GPU 0.
    OneGpu,
    /// Policy over GPUs 0 and 1; reference and reward model on GPU 1.
    TwoGpu,
    /// Policy over GPUs 0 and 1; reference and reward model on GPU 2.
    ThreeGpu,
    /// The fewest GPUs that fit.
    Auto,
}

impl fmt::Display for TrainingPreset {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TrainingPreset::OneGpu => "1gpu",
            TrainingPreset::TwoGpu => "2gpu",
            TrainingPreset::ThreeGpu => "3gpu",
            TrainingPreset::Auto => "auto",
        })
    }
}

impl From<TrainingPreset> for String {
    fn from(p: TrainingPreset) -> String {
        p.to_string()
    }
}

impl FromStr for TrainingPreset {
    type Err = TopologyError;

    /// Parses `1gpu`, `2gpu`, `3gpu` or `auto` (any case; `1-gpu`, `1_gpu` too).
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let t = s.trim().to_ascii_lowercase().replace(['-', '_'], "");
        Ok(match t.as_str() {
            "1gpu" => TrainingPreset::OneGpu,
            "2gpu" => TrainingPreset::TwoGpu,
            "3gpu" => TrainingPreset::ThreeGpu,
            "auto" => TrainingPreset::Auto,
            _ => {
                return Err(TopologyError::BadTrainingPreset {
                    value: s.to_string(),
                })
            }
        })
    }
}

/// One of the models of a GSPO run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum TrainingRole {
    /// The model being trained.
    Policy,
    /// The frozen initial policy (KL term).
    Reference,
    /// The frozen reward model (a sequence classifier).
    Reward,
}

impl fmt::Display for TrainingRole {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TrainingRole::Policy => "policy",
            TrainingRole::Reference => "reference",
            TrainingRole::Reward => "reward",
        })
    }
}

/// What to plan a training run for.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingRequest {
    /// Where the models go.
    pub preset: TrainingPreset,
    /// The step's batches and settings.
    pub workload: TrainingWorkload,
    /// Per-device budgets.
    pub max_memory: MaxMemory,
    /// Place the reference model (set it when `beta > 0`).
    pub reference: bool,
}

impl Default for TrainingRequest {
    /// Auto, [`TrainingWorkload::default`], default reserves, no reference (beta = 0).
    fn default() -> Self {
        TrainingRequest {
            preset: TrainingPreset::Auto,
            workload: TrainingWorkload::default(),
            max_memory: MaxMemory::new(),
            reference: false,
        }
    }
}

/// One role's share of one device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RolePlacement {
    /// The model.
    pub role: TrainingRole,
    /// Its decoder layers on this device.
    pub layers: Range<usize>,
    /// The device holds its embedding.
    pub embed: bool,
    /// The device holds its final norm and head.
    pub head: bool,
    /// Bytes, by term.
    pub cost: RoleCost,
}

/// One device of a training plan: every role on it and the sum against the budget.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TrainingDevicePlan {
    /// The device.
    pub device: DeviceLocation,
    /// The roles it holds, policy first.
    pub roles: Vec<RolePlacement>,
    /// CUDA context (once per GPU, 0 on the CPU).
    pub overhead: u64,
    /// Sum of the roles' persistent terms (weights, optimizer).
    pub persistent: u64,
    /// Sum of the roles' rollout-phase terms (inference copy, KV cache, prefill workspace).
    pub rollout: u64,
    /// Sum of the roles' training-phase terms (activations).
    pub training: u64,
    /// `overhead + persistent + max(rollout, training)`.
    pub total: u64,
    /// Bytes the budget allows (`u64::MAX`: the CPU with no known limit).
    pub budget: u64,
    /// `budget - total`, 0 when over.
    pub headroom: u64,
}

impl TrainingDevicePlan {
    /// Whether the device's total is within its budget.
    pub fn fits(&self) -> bool {
        self.total <= self.budget
    }

    /// The sum of one term over the roles of this device.
    fn sum(&self, term: impl Fn(&RoleCost) -> u64) -> u64 {
        self.roles.iter().map(|r| term(&r.cost)).sum()
    }
}

/// A placement of GSPO's models: one device map per role, and each device's need.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TrainingPlan {
    /// The policy's map (layer-sharded over one or more devices).
    pub policy: DeviceMap,
    /// The reference's map (whole on one device), when placed.
    pub reference: Option<DeviceMap>,
    /// The reward model's map (whole on one device), when placed.
    pub reward: Option<DeviceMap>,
    /// Every device that holds something, in topology order.
    pub devices: Vec<TrainingDevicePlan>,
    /// GPUs that hold nothing.
    pub idle: Vec<DeviceLocation>,
    /// Name of the topology planned on.
    pub topology: String,
    /// The preset asked for.
    pub preset: TrainingPreset,
    /// The step planned for.
    pub workload: TrainingWorkload,
    /// Where the policy's (and reference's) weight sizes come from.
    pub weights_from: String,
    /// Where the reward model's weight sizes come from, when it is placed.
    pub reward_weights_from: Option<String>,
}

impl TrainingPlan {
    /// The device plan of `device`, if it holds anything.
    pub fn device(&self, device: DeviceLocation) -> Option<&TrainingDevicePlan> {
        self.devices.iter().find(|d| d.device == device)
    }

    /// GPUs that hold something.
    pub fn gpus_used(&self) -> usize {
        self.devices
            .iter()
            .filter(|d| d.device != DeviceLocation::Cpu)
            .count()
    }
}

/// The bytes of a budget for people: `unbounded` for the CPU with no known limit.
fn budget_text(budget: u64) -> String {
    if budget == u64::MAX {
        "unbounded".into()
    } else {
        format_bytes(budget)
    }
}

/// A map in one word when it is all on one device.
fn map_text(map: &DeviceMap) -> String {
    match map.devices().as_slice() {
        [one] => one.to_string(),
        _ => map.to_string(),
    }
}

impl fmt::Display for TrainingPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let w = &self.workload;
        writeln!(
            f,
            "training plan on {} (preset {}): {} compute, {} master weights, gradients and AdamW moments",
            self.topology, self.preset, w.compute_dtype, w.master_dtype
        )?;
        writeln!(
            f,
            "micro-batch {} x ({} prompt + {} completion) tokens, gradient checkpointing {}, log-softmax in chunks of {} rows; rollouts {} sequences ({} generations x {} prompts)",
            w.per_device_train_batch_size,
            w.max_prompt_length,
            w.max_completion_length,
            if w.gradient_checkpointing { "on" } else { "off" },
            w.head_chunk_rows,
            w.generation_batch(),
            w.num_generations,
            w.prompts_per_step,
        )?;
        if w.optimizer_shards > 1 {
            writeln!(
                f,
                "zero_stage = 1: this process of {} keeps about 1/{} of the AdamW moments{}",
                w.optimizer_shards,
                w.optimizer_shards,
                if w.master_dtype != w.compute_dtype && w.trainable_fraction >= 1.0 {
                    format!(
                        " and of the {} masters (the rest in {})",
                        w.master_dtype, w.compute_dtype
                    )
                } else {
                    String::new()
                }
            )?;
        }
        writeln!(f, "policy:    {}", map_text(&self.policy))?;
        match &self.reference {
            Some(m) => writeln!(f, "reference: {}", map_text(m))?,
            None => writeln!(f, "reference: not placed (no KL term: beta = 0)")?,
        }
        match &self.reward {
            Some(m) => writeln!(f, "reward:    {}", map_text(m))?,
            None => writeln!(f, "reward:    not placed (no reward model configured)")?,
        }
        writeln!(f, "policy weights sized from {}", self.weights_from)?;
        if let Some(r) = &self.reward_weights_from {
            writeln!(f, "reward model weights sized from {r}")?;
        }
        const COLS: [&str; 8] = [
            "weights",
            "gradients",
            "optimizer",
            "infer copy",
            "KV cache",
            "prefill",
            "activations",
            "peak alone",
        ];
        for d in &self.devices {
            writeln!(f)?;
            writeln!(
                f,
                "{}: total {} of budget {} ({})",
                d.device,
                format_bytes(d.total),
                budget_text(d.budget),
                if d.budget == u64::MAX {
                    "no limit known: give one with a cpu entry in --max-memory".to_string()
                } else if d.fits() {
                    format!("headroom {}", format_bytes(d.headroom))
                } else {
                    format!("over by {}", format_bytes(d.total - d.budget))
                }
            )?;
            write!(f, "  {:<10} {:<26}", "role", "holds")?;
            for c in COLS {
                write!(f, " {c:>11}")?;
            }
            writeln!(f)?;
            for r in &d.roles {
                let holds = if r.role == TrainingRole::Policy {
                    format!(
                        "layers {}..{}{}{}",
                        r.layers.start,
                        r.layers.end,
                        if r.embed { " +embed" } else { "" },
                        if r.head { " +head" } else { "" }
                    )
                } else {
                    format!("whole ({} layers)", r.layers.len())
                };
                write!(f, "  {:<10} {:<26}", r.role.to_string(), holds)?;
                let c = &r.cost;
                for v in [
                    c.weights,
                    c.gradients,
                    c.optimizer,
                    c.inference_copy,
                    c.kv_cache,
                    c.generation_workspace,
                    c.step_transients(),
                    c.peak(),
                ] {
                    write!(
                        f,
                        " {:>11}",
                        if v == 0 { "-".into() } else { format_bytes(v) }
                    )?;
                }
                writeln!(f)?;
            }
            writeln!(
                f,
                "  = context {} + persistent {} + max(rollout {}, training {})",
                format_bytes(d.overhead),
                format_bytes(d.persistent),
                format_bytes(d.rollout),
                format_bytes(d.training),
            )?;
        }
        if !self.idle.is_empty() {
            let idle: Vec<_> = self.idle.iter().map(|d| d.to_string()).collect();
            writeln!(f, "\nidle: {}", idle.join(", "))?;
        }
        Ok(())
    }
}

/// A device that can hold roles, and its budget.
#[derive(Debug, Clone, Copy)]
struct Slot {
    device: DeviceLocation,
    budget: u64,
}

impl Slot {
    fn gpu(&self) -> bool {
        self.device != DeviceLocation::Cpu
    }
}

/// Which slot holds what: the policy's chain with its layer counts, and the frozen roles.
#[derive(Debug, Clone)]
struct Layout {
    /// Slot indices of the policy's chain.
    chain: Vec<usize>,
    /// Layers on each device of the chain.
    counts: Vec<usize>,
    /// Slot index of each frozen role.
    frozen: Vec<(TrainingRole, usize)>,
}

struct Ctx<'a> {
    policy: &'a ModelShape,
    reward: Option<&'a ModelShape>,
    req: &'a TrainingRequest,
    slots: Vec<Slot>,
}

/// Sums of one device's roles.
struct Totals {
    overhead: u64,
    persistent: u64,
    rollout: u64,
    training: u64,
    total: u64,
}

impl Ctx<'_> {
    /// The frozen roles asked for, with their shapes: the reference (the policy's shape), then
    /// the reward model.
    fn frozen_roles(&self) -> Vec<(TrainingRole, &ModelShape)> {
        let mut out = Vec::new();
        if self.req.reference {
            out.push((TrainingRole::Reference, self.policy));
        }
        if let Some(r) = self.reward {
            out.push((TrainingRole::Reward, r));
        }
        out
    }

    fn frozen_shape(&self, role: TrainingRole) -> &ModelShape {
        match role {
            TrainingRole::Reward => self.reward.unwrap_or(self.policy),
            _ => self.policy,
        }
    }

    fn frozen_cost(&self, role: TrainingRole, slot: usize) -> RoleCost {
        let shape = self.frozen_shape(role);
        self.req.workload.frozen_cost(
            shape,
            DevicePart {
                layers: shape.num_layers,
                embed: true,
                head: true,
                gpu: self.slots[slot].gpu(),
            },
        )
    }

    fn policy_cost(&self, slot: usize, layers: usize, first: bool, last: bool) -> RoleCost {
        self.req.workload.policy_cost(
            self.policy,
            DevicePart {
                layers,
                embed: first,
                head: last,
                gpu: self.slots[slot].gpu(),
            },
        )
    }

    fn totals(&self, slot: usize, roles: &[RoleCost]) -> Totals {
        let persistent = roles.iter().map(RoleCost::persistent).sum();
        let rollout = roles.iter().map(RoleCost::rollout).sum();
        let training = roles.iter().map(RoleCost::training).sum();
        let overhead = if self.slots[slot].gpu() && !roles.is_empty() {
            TRAINING_CONTEXT_BYTES
        } else {
            0
        };
        Totals {
            overhead,
            persistent,
            rollout,
            training,
            total: overhead + persistent + u64::max(rollout, training),
        }
    }

    /// The roles on `slot` under `layout`, policy first, with their shares.
    fn roles_on(&self, layout: &Layout, slot: usize) -> Vec<RolePlacement> {
        let mut out = Vec::new();
        let k = layout.chain.len();
        let mut start = 0;
        for (i, (&s, &n)) in layout.chain.iter().zip(&layout.counts).enumerate() {
            if s == slot {
                out.push(RolePlacement {
                    role: TrainingRole::Policy,
                    layers: start..start + n,
                    embed: i == 0,
                    head: i == k - 1,
                    cost: self.policy_cost(slot, n, i == 0, i == k - 1),
                });
            }
            start += n;
        }
        for &(role, s) in &layout.frozen {
            if s == slot {
                out.push(RolePlacement {
                    role,
                    layers: 0..self.frozen_shape(role).num_layers,
                    embed: true,
                    head: true,
                    cost: self.frozen_cost(role, slot),
                });
            }
        }
        out
    }

    /// Device total of `slot` under `layout`.
    fn load(&self, layout: &Layout, slot: usize) -> u64 {
        let costs: Vec<RoleCost> = self
            .roles_on(layout, slot)
            .into_iter()
            .map(|r| r.cost)
            .collect();
        self.totals(slot, &costs).total
    }

    fn fits(&self, layout: &Layout) -> bool {
        (0..self.slots.len()).all(|s| self.load(layout, s) <= self.slots[s].budget)
    }

    /// Device total of chain position `i` holding `n` policy layers next to the frozen roles
    /// `frozen` assigns to its slot.
    fn chain_load(
        &self,
        chain: &[usize],
        frozen: &[(TrainingRole, usize)],
        i: usize,
        n: usize,
    ) -> u64 {
        let slot = chain[i];
        let mut costs = vec![self.policy_cost(slot, n, i == 0, i == chain.len() - 1)];
        for &(role, s) in frozen {
            if s == slot {
                costs.push(self.frozen_cost(role, slot));
            }
        }
        self.totals(slot, &costs).total
    }

    /// Greedy fill at utilisation `ratio`: as many layers on each device as stay within
    /// `ratio` of its budget, each device at least one.
    fn fill(
        &self,
        chain: &[usize],
        frozen: &[(TrainingRole, usize)],
        ratio: f64,
    ) -> Option<Vec<usize>> {
        let k = chain.len();
        let total = self.policy.num_layers;
        let mut counts = Vec::with_capacity(k);
        let mut start = 0;
        for i in 0..k {
            let budget = self.slots[chain[i]].budget;
            let cap = if budget == u64::MAX {
                u64::MAX
            } else {
                (budget as f64 * ratio) as u64
            };
            let fits = |n| self.chain_load(chain, frozen, i, n) <= cap;
            if i == k - 1 {
                let n = total - start;
                if !fits(n) {
                    return None;
                }
                counts.push(n);
            } else {
                let max_n = total - start - (k - 1 - i);
                let (mut lo, mut hi) = (0usize, max_n);
                // Largest n in 0..=max_n that fits (the cost grows with n).
                while lo < hi {
                    let mid = (lo + hi).div_ceil(2);
                    if fits(mid) {
                        lo = mid;
                    } else {
                        hi = mid - 1;
                    }
                }
                if lo == 0 {
                    return None;
                }
                counts.push(lo);
                start += lo;
            }
        }
        Some(counts)
    }

    /// The policy's layers over `chain`, balanced so that the largest share of a budget any
    /// device uses is smallest (bisection on that share, each step a greedy fill).
    fn split(&self, chain: &[usize], frozen: &[(TrainingRole, usize)]) -> Option<Vec<usize>> {
        if chain.is_empty() || chain.len() > self.policy.num_layers {
            return None;
        }
        let mut best = self.fill(chain, frozen, 1.0)?;
        let (mut lo, mut hi) = (0.0f64, 1.0f64);
        for _ in 0..40 {
            let mid = 0.5 * (lo + hi);
            match self.fill(chain, frozen, mid) {
                Some(c) => {
                    best = c;
                    hi = mid;
                }
                None => lo = mid,
            }
        }
        Some(best)
    }

    /// Near-equal layer counts over `chain`, for reporting a layout that does not fit.
    fn even(&self, chain: &[usize]) -> Vec<usize> {
        let (n, k) = (self.policy.num_layers, chain.len().max(1));
        (0..chain.len())
            .map(|g| n / k + usize::from(g < n % k))
            .collect()
    }

    /// The fixed layout of a preset: the policy's chain and the frozen roles' slot; the
    /// balanced split when it fits, else the error with the even split's needs.
    fn preset(
        &self,
        topology: &Topology,
        chain: Vec<usize>,
        frozen_slot: usize,
    ) -> Result<Layout, TopologyError> {
        let frozen: Vec<(TrainingRole, usize)> = self
            .frozen_roles()
            .into_iter()
            .map(|(r, _)| (r, frozen_slot))
            .collect();
        match self.split(&chain, &frozen) {
            Some(counts) => Ok(Layout {
                chain,
                counts,
                frozen,
            }),
            None => {
                let counts = self.even(&chain);
                Err(self.not_fit(
                    topology,
                    &Layout {
                        chain,
                        counts,
                        frozen,
                    },
                ))
            }
        }
    }

    /// Puts each frozen role on the slot among `candidates` that keeps the most bytes free
    /// after taking it, when some slot can take it (`force`: even when none can, on the slot
    /// with the most free bytes, for reporting).
    fn place_frozen(&self, layout: &mut Layout, candidates: &[usize], force: bool) -> bool {
        for (role, _) in self.frozen_roles() {
            let mut best: Option<(usize, i128)> = None;
            for &s in candidates {
                layout.frozen.push((role, s));
                let free = self.slots[s].budget as i128 - self.load(layout, s) as i128;
                layout.frozen.pop();
                if (free >= 0 || force) && best.is_none_or(|(_, f)| free > f) {
                    best = Some((s, free));
                }
            }
            match best {
                Some((s, _)) => layout.frozen.push((role, s)),
                None => return false,
            }
        }
        true
    }

    /// Auto: the fewest GPUs that fit; for each count, the policy on as few of them as
    /// possible.
    fn auto(&self, topology: &Topology) -> Result<Layout, TopologyError> {
        let n = self.slots.len();
        for m in 1..=n {
            for p in 1..=m {
                let Some(chain) = groups_of(topology, p).into_iter().next() else {
                    continue;
                };
                let mut candidates = chain.clone();
                candidates.extend((0..n).filter(|s| !chain.contains(s)).take(m - p));
                let Some(counts) = self.split(&chain, &[]) else {
                    continue;
                };
                let mut layout = Layout {
                    chain,
                    counts,
                    frozen: Vec::new(),
                };
                if !self.place_frozen(&mut layout, &candidates, false) {
                    continue;
                }
                if let Some(counts) = self.split(&layout.chain, &layout.frozen) {
                    layout.counts = counts;
                }
                if self.fits(&layout) {
                    return Ok(layout);
                }
            }
        }
        // Nothing fits: report the policy over every GPU, the frozen roles where they would
        // have gone.
        let chain: Vec<usize> = groups_of(topology, n)
            .into_iter()
            .next()
            .unwrap_or_default();
        let counts = self.even(&chain);
        let mut layout = Layout {
            chain,
            counts,
            frozen: Vec::new(),
        };
        let all: Vec<usize> = (0..n).collect();
        self.place_frozen(&mut layout, &all, true);
        Err(self.not_fit(topology, &layout))
    }

    /// The plan of a layout that fits.
    fn build(&self, topology: &Topology, layout: &Layout) -> TrainingPlan {
        let devices = self.device_plans(layout);
        let loc = |s: usize| self.slots[s].device;
        let mut layers = Vec::with_capacity(self.policy.num_layers);
        for (&s, &n) in layout.chain.iter().zip(&layout.counts) {
            layers.extend(std::iter::repeat_n(loc(s), n));
        }
        let policy = DeviceMap {
            embed: loc(layout.chain[0]),
            layers,
            head: loc(*layout.chain.last().expect("a chain has a device")),
        };
        let frozen_map = |role| {
            layout
                .frozen
                .iter()
                .find(|(r, _)| *r == role)
                .map(|&(r, s)| DeviceMap::single(loc(s), self.frozen_shape(r).num_layers))
        };
        let idle = topology
            .gpus
            .iter()
            .map(|g| g.location)
            .filter(|d| !devices.iter().any(|p| p.device == *d))
            .collect();
        TrainingPlan {
            policy,
            reference: frozen_map(TrainingRole::Reference),
            reward: frozen_map(TrainingRole::Reward),
            devices,
            idle,
            topology: topology.name.clone(),
            preset: self.req.preset,
            workload: self.req.workload,
            weights_from: weights_from(self.policy),
            reward_weights_from: self.reward.map(weights_from),
        }
    }

    /// Every slot that holds something under `layout`, with its roles and sums.
    fn device_plans(&self, layout: &Layout) -> Vec<TrainingDevicePlan> {
        let mut out = Vec::new();
        for (s, slot) in self.slots.iter().enumerate() {
            let roles = self.roles_on(layout, s);
            if roles.is_empty() {
                continue;
            }
            let costs: Vec<RoleCost> = roles.iter().map(|r| r.cost).collect();
            let t = self.totals(s, &costs);
            out.push(TrainingDevicePlan {
                device: slot.device,
                roles,
                overhead: t.overhead,
                persistent: t.persistent,
                rollout: t.rollout,
                training: t.training,
                total: t.total,
                budget: slot.budget,
                headroom: slot.budget.saturating_sub(t.total),
            });
        }
        out
    }

    /// The error for a layout that does not fit: each device's need per role and term, the
    /// budgets, and the ways out.
    fn not_fit(&self, topology: &Topology, layout: &Layout) -> TopologyError {
        let w = &self.req.workload;
        let devices = self.device_plans(layout);
        let mut needs = Vec::new();
        for d in &devices {
            let roles: Vec<String> = d
                .roles
                .iter()
                .map(|r| {
                    let c = &r.cost;
                    let mut terms = vec![format!("weights {}", format_bytes(c.weights))];
                    for (name, v) in [
                        ("gradients", c.gradients),
                        ("optimizer", c.optimizer),
                        ("inference copy", c.inference_copy),
                        ("KV cache", c.kv_cache),
                        ("prefill", c.generation_workspace),
                    ] {
                        if v > 0 {
                            terms.push(format!("{name} {}", format_bytes(v)));
                        }
                    }
                    terms.push(format!("activations {}", format_bytes(c.step_transients())));
                    let holds = if r.role == TrainingRole::Policy {
                        format!("layers {}..{}", r.layers.start, r.layers.end)
                    } else {
                        "whole model".to_string()
                    };
                    format!("{} ({holds}): {}", r.role, terms.join(", "))
                })
                .collect();
            needs.push(format!(
                "{} needs {} of {} budget {}{}: {}",
                d.device,
                format_bytes(d.total),
                budget_text(d.budget),
                topology
                    .gpus
                    .iter()
                    .find(|g| g.location == d.device)
                    .map_or(String::new(), |g| format!(
                        "(of {} total)",
                        format_bytes(g.total_bytes)
                    )),
                if d.fits() { " (fits)" } else { "" },
                roles.join("; ")
            ));
        }

        // The ways out, from the terms that make the need.
        let mut ways = Vec::new();
        let act_max = devices
            .iter()
            .map(|d| d.sum(|c| c.step_transients()))
            .max()
            .unwrap_or(0);
        ways.push(format!(
            "a smaller per_device_train_batch_size (now {}; activations up to {} per device, about proportional to it)",
            w.per_device_train_batch_size,
            format_bytes(act_max)
        ));
        if !w.gradient_checkpointing {
            let on = TrainingWorkload {
                gradient_checkpointing: true,
                ..*w
            };
            let part = DevicePart {
                layers: self.policy.num_layers,
                embed: true,
                head: true,
                gpu: true,
            };
            ways.push(format!(
                "gradient checkpointing on (the whole policy's activations {} instead of {})",
                format_bytes(on.policy_cost(self.policy, part).step_transients()),
                format_bytes(w.policy_cost(self.policy, part).step_transients())
            ));
        }
        let kv_max = devices
            .iter()
            .map(|d| d.sum(|c| c.kv_cache))
            .max()
            .unwrap_or(0);
        ways.push(format!(
            "a shorter max_completion_length (now {}; sequences of {} tokens) or fewer sequences per rollout (num_generations {} x {} prompts: KV cache up to {} per device)",
            w.max_completion_length,
            w.seq_len(),
            w.num_generations,
            w.prompts_per_step,
            format_bytes(kv_max)
        ));
        let gpus = topology.gpus.len();
        let used = devices
            .iter()
            .filter(|d| d.device != DeviceLocation::Cpu)
            .count();
        let whole = self.policy_cost(0, self.policy.num_layers, true, true);
        let per_gpu = self
            .slots
            .iter()
            .filter(|s| s.gpu())
            .map(|s| s.budget.saturating_sub(TRAINING_CONTEXT_BYTES))
            .max()
            .unwrap_or(0)
            .max(1);
        if gpus > 0 {
            // Weights and moments, with the gradients (training) or the inference copy
            // (rollouts), on whichever GPUs hold the policy.
            let state = whole.persistent() + whole.gradients.max(whole.inference_copy);
            let at_least = state.div_ceil(per_gpu);
            let mut gpu_way = format!(
                "more GPUs (the policy's weights and optimizer state with its gradients or inference copy alone are {}: at least {} GPU(s) of this budget",
                format_bytes(state),
                at_least
            );
            gpu_way.push_str(&format!("; {gpus} given)"));
            let mut presets = Vec::new();
            if self.req.preset != TrainingPreset::Auto && gpus > used {
                presets.push(format!("auto (the fewest of the {gpus} GPUs that fit)"));
            }
            if self.req.preset == TrainingPreset::OneGpu && gpus >= 2 {
                presets.push("2gpu (the policy over GPUs 0 and 1)".to_string());
            }
            if matches!(
                self.req.preset,
                TrainingPreset::OneGpu | TrainingPreset::TwoGpu
            ) && gpus >= 3
                && !self.frozen_roles().is_empty()
            {
                presets.push("3gpu (reference and reward model on GPU 2)".to_string());
            }
            if !presets.is_empty() {
                gpu_way.push_str(&format!(
                    "; another preset: --gpu-mode {}",
                    presets.join(" or ")
                ));
            }
            ways.push(gpu_way);
            ways.push(
                "larger --max-memory entries (the default keeps 10% or 1 GiB free per GPU)".into(),
            );
        } else {
            ways.push("a GPU, or a larger cpu entry in --max-memory".into());
        }
        let needed = {
            let mut all = vec![whole];
            all.extend(
                self.frozen_roles()
                    .into_iter()
                    .map(|(role, _)| self.frozen_cost(role, 0)),
            );
            self.totals(0, &all).total
        };
        let detail = format!("{}. Ways out: {}", needs.join(". "), ways.join("; "));
        TopologyError::DoesNotFit {
            model: format!(
                "GSPO training of {} ({:.1}B parameters){}{}",
                if self.policy.model_type.is_empty() {
                    "the policy"
                } else {
                    &self.policy.model_type
                },
                self.policy.total_params() as f64 / 1e9,
                if self.req.reference {
                    " with its reference"
                } else {
                    ""
                },
                match self.reward {
                    Some(r) => format!(
                        " and a reward model ({:.1}B parameters)",
                        r.total_params() as f64 / 1e9
                    ),
                    None => String::new(),
                }
            ),
            mode: self.req.preset.to_string(),
            needed_bytes: needed,
            available: devices.iter().map(|d| (d.device, d.budget)).collect(),
            detail,
        }
    }
}

/// Places the policy, its reference (when [`TrainingRequest::reference`]) and the reward model
/// (when `reward` is given; a classifier shape, [`ModelShape::with_classification_head`]) on
/// `topology` as `request`'s preset says, each device's sum over the roles within its budget.
///
/// The policy is trained, layer-sharded over one or more GPUs (a chain of contiguous layer
/// ranges, as [`crate::plan`] makes them; the split is balanced by memory, counting whatever
/// else each device holds). The reference and the reward model are frozen and each sits whole
/// on one device. Each device's need is the sum over the roles it holds ([`TrainingWorkload`]):
/// the persistent terms of every role, plus the larger of the rollout phase and the training
/// phase, plus one CUDA context per GPU ([`TRAINING_CONTEXT_BYTES`]); it fits when that is at
/// most the device's budget ([`MaxMemory::budget`]).
///
/// Presets ([`TrainingPreset`]), named by the seed; GPU numbers are positions among the GPUs
/// planned on (after `--gpu-ids`):
///
/// * `3gpu`: policy over GPUs 0 and 1, reference and reward model on GPU 2;
/// * `2gpu`: policy over GPUs 0 and 1, reference and reward model on GPU 1;
/// * `1gpu`: everything on GPU 0;
/// * `auto`: the fewest GPUs that fit. For `m = 1, 2, ...` GPUs, the policy is tried on one
///   GPU, then sharded over two (GPUs with peer access to one another first), and so on up
///   to `m`; the reference, then the reward model, go to the GPU among the `m` that keeps the
///   most memory free after taking it (the least-loaded GPU that fits); then the policy's
///   split is balanced again around them.
///
/// The reference is placed only when asked ([`TrainingRequest::reference`]: GSPO needs it only
/// for a KL term, `beta > 0`), the reward model only when its shape is given. The reference is
/// the policy's own checkpoint, so it has the policy's shape.
///
/// A topology without GPUs plans everything on the CPU (presets `auto` and `1gpu`), within the
/// `cpu` entry of `--max-memory`, else the host memory less the default reserve when it is
/// known. On a topology with GPUs nothing is offloaded to the CPU.
///
/// Errors: [`TopologyError::DoesNotFit`] naming each device's need per role and term and the
/// ways out; [`TopologyError::PresetNeedsGpus`] when the preset needs more GPUs than the
/// topology has; a workload with a zero count; budgets that give a device no memory or name a
/// GPU that is not in `topology`.
pub fn plan_training(
    policy: &ModelShape,
    reward: Option<&ModelShape>,
    topology: &Topology,
    request: &TrainingRequest,
) -> Result<TrainingPlan, TopologyError> {
    request.workload.validate()?;
    check_budgets(&request.max_memory, topology)?;
    let slots: Vec<Slot> = if topology.gpus.is_empty() {
        let budget = match (
            request.max_memory.get(DeviceLocation::Cpu),
            topology.cpu_bytes,
        ) {
            (Some(limit), total) => limit.resolve(total.unwrap_or(u64::MAX)),
            (None, Some(total)) => total - default_reserve(total),
            (None, None) => u64::MAX,
        };
        vec![Slot {
            device: DeviceLocation::Cpu,
            budget,
        }]
    } else {
        topology
            .gpus
            .iter()
            .map(|g| Slot {
                device: g.location,
                budget: request.max_memory.budget(g.location, g.total_bytes),
            })
            .collect()
    };
    let ctx = Ctx {
        policy,
        reward,
        req: request,
        slots,
    };
    let frozen = !ctx.frozen_roles().is_empty();
    let layout = if topology.gpus.is_empty() {
        if matches!(
            request.preset,
            TrainingPreset::TwoGpu | TrainingPreset::ThreeGpu
        ) {
            return Err(TopologyError::PresetNeedsGpus {
                preset: request.preset.to_string(),
                needed: 2 + usize::from(request.preset == TrainingPreset::ThreeGpu && frozen),
                available: 0,
            });
        }
        ctx.preset(topology, vec![0], 0)?
    } else {
        let (chain, frozen_slot, needed) = match request.preset {
            TrainingPreset::OneGpu => (vec![0], 0, 1),
            TrainingPreset::TwoGpu => (vec![0, 1], 1, 2),
            TrainingPreset::ThreeGpu => (vec![0, 1], 2, if frozen { 3 } else { 2 }),
            TrainingPreset::Auto => (Vec::new(), 0, 1),
        };
        if needed > ctx.slots.len() {
            return Err(TopologyError::PresetNeedsGpus {
                preset: request.preset.to_string(),
                needed,
                available: ctx.slots.len(),
            });
        }
        if chain.len() > policy.num_layers {
            return Err(TopologyError::TooManyGroups {
                layers: policy.num_layers,
                groups: chain.len(),
            });
        }
        match request.preset {
            TrainingPreset::Auto => ctx.auto(topology)?,
            _ => ctx.preset(topology, chain, frozen_slot)?,
        }
    };
    Ok(ctx.build(topology, &layout))
}
