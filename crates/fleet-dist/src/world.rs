//! Process ranks: where this process sits in a data-parallel job.
//!
//! A [`World`] comes from the environment a launcher leaves behind ([`World::from_env`]):
//!
//! 1. torchrun's variables — `RANK`, `WORLD_SIZE`, `LOCAL_RANK`, `LOCAL_WORLD_SIZE`,
//!    `GROUP_RANK` (or `NODE_RANK`), `GROUP_WORLD_SIZE`, `MASTER_ADDR`, `MASTER_PORT`. fleet's own
//!    launcher ([`crate::launch()`]) sets the same variables plus `FLEET_LAUNCHER=1`, which makes the
//!    world report [`Launcher::Fleet`]. These take precedence, so ranks started by `gspo-train
//!    --nproc-per-node N` inside a SLURM job see their own rank, not the SLURM task's.
//! 2. SLURM's variables — `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`, `SLURM_NODEID`,
//!    `SLURM_NNODES` (or `SLURM_JOB_NUM_NODES`), tasks per node from `SLURM_NTASKS_PER_NODE`,
//!    `SLURM_STEP_TASKS_PER_NODE` or `SLURM_TASKS_PER_NODE` (`4(x2),2`), the master from
//!    `MASTER_ADDR` or the first host of `SLURM_JOB_NODELIST` / `SLURM_NODELIST`
//!    ([`expand_nodelist`]), the port from `MASTER_PORT` or [`DEFAULT_MASTER_PORT`].
//! 3. Nothing: `None` (the caller runs as [`World::single`]).
//!
//! Empty values count as unset. Errors name the variable and its value.

use std::collections::HashMap;
use std::fmt;

use crate::{DistError, Result};

/// Port of rank 0's rendezvous server when neither `MASTER_PORT` nor a flag gives one (torchrun's
/// default too). Two jobs sharing a first node need different ports: set `MASTER_PORT`.
pub const DEFAULT_MASTER_PORT: u16 = 29500;

/// Variable fleet's launcher sets (`1`) in its ranks' environments.
pub const FLEET_LAUNCHER_ENV: &str = "FLEET_LAUNCHER";

/// How a process learned its place in the world.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Launcher {
    /// No launcher: one process, rank 0 of 1.
    Single,
    /// fleet's own launcher (`--nproc-per-node`, [`crate::launch()`]): torchrun's variables plus
    /// `FLEET_LAUNCHER=1`.
    Fleet,
    /// torchrun (or anything else that sets `RANK`/`WORLD_SIZE`/`LOCAL_RANK`).
    Torchrun,
    /// One SLURM task per rank (`srun`): `SLURM_PROCID` and friends.
    Slurm,
    /// Built by the caller from its own flags (`--nnodes/--node-rank/--master-addr`).
    Manual,
}

impl fmt::Display for Launcher {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Launcher::Single => "single process",
            Launcher::Fleet => "fleet launcher",
            Launcher::Torchrun => "torchrun",
            Launcher::Slurm => "SLURM",
            Launcher::Manual => "manual",
        })
    }
}

/// This process's place in a data-parallel job: one rank per GPU, ranks numbered
/// `0..world_size`, grouped by node.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct World {
    /// Global rank, in `0..world_size`. Rank 0 serves the rendezvous.
    pub rank: usize,
    /// Number of ranks in the job.
    pub world_size: usize,
    /// Rank on this node, in `0..local_world_size` (picks the GPU when the launcher did not).
    pub local_rank: usize,
    /// Number of ranks on this node.
    pub local_world_size: usize,
    /// This node's index, in `0..nnodes`.
    pub node_rank: usize,
    /// Number of nodes.
    pub nnodes: usize,
    /// Host of rank 0 (name or address), where the rendezvous server listens.
    pub master_addr: String,
    /// Port of rank 0's rendezvous server.
    pub master_port: u16,
    /// Where these values came from.
    pub launcher: Launcher,
}

impl World {
    /// One process alone: rank 0 of 1 on `127.0.0.1:`[`DEFAULT_MASTER_PORT`].
    pub fn single() -> Self {
        World {
            rank: 0,
            world_size: 1,
            local_rank: 0,
            local_world_size: 1,
            node_rank: 0,
            nnodes: 1,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            launcher: Launcher::Single,
        }
    }

    /// Rank 0 (writes checkpoints and logs, serves the rendezvous).
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// More than one rank.
    pub fn is_distributed(&self) -> bool {
        self.world_size > 1
    }

    /// The world described by the process environment, if any; see the module docs for the
    /// variables and their precedence.
    pub fn from_env() -> Result<Option<World>> {
        let env: HashMap<String, String> = std::env::vars_os()
            .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
            .collect();
        Self::from_env_map(&env)
    }

    /// [`World::from_env`] on a map (for tests, or an environment read elsewhere).
    pub fn from_env_map(env: &HashMap<String, String>) -> Result<Option<World>> {
        let env = Env(env);
        if let Some(world) = from_torchrun(&env)? {
            return Ok(Some(world));
        }
        from_slurm(&env)
    }

    /// Checks the numbers against each other: sizes at least 1, `rank < world_size`,
    /// `local_rank < local_world_size <= world_size`, `node_rank < nnodes <= world_size`, a
    /// master address and a non-zero port. [`World::from_env`] has already done this; call it on
    /// a world built by hand ([`Launcher::Manual`]).
    pub fn validate(&self) -> Result<()> {
        let named = |what: &str| format!("{what} ({} world)", self.launcher);
        for (what, v) in [
            ("world_size", self.world_size),
            ("local_world_size", self.local_world_size),
            ("nnodes", self.nnodes),
        ] {
            if v == 0 {
                return Err(DistError::BadWorld {
                    problem: format!("{} is 0: it must be at least 1", named(what)),
                });
            }
        }
        let below = |what: &str, v: usize, limit_name: &str, limit: usize| {
            if v >= limit {
                Err(DistError::BadWorld {
                    problem: format!(
                        "{} = {v} is not below {limit_name} = {limit}: it counts from 0, so use a value in 0..{limit}",
                        named(what)
                    ),
                })
            } else {
                Ok(())
            }
        };
        below("rank", self.rank, "world_size", self.world_size)?;
        below(
            "local_rank",
            self.local_rank,
            "local_world_size",
            self.local_world_size,
        )?;
        below("node_rank", self.node_rank, "nnodes", self.nnodes)?;
        if self.local_world_size > self.world_size || self.nnodes > self.world_size {
            return Err(DistError::BadWorld {
                problem: format!(
                    "{}: local_world_size = {} and nnodes = {} cannot exceed world_size = {}",
                    named("sizes"),
                    self.local_world_size,
                    self.nnodes,
                    self.world_size
                ),
            });
        }
        if self.master_addr.trim().is_empty() {
            return Err(DistError::BadWorld {
                problem: format!(
                    "{} is empty: give rank 0's host (MASTER_ADDR or --master-addr)",
                    named("master_addr")
                ),
            });
        }
        if self.master_port == 0 {
            return Err(DistError::BadWorld {
                problem: format!(
                    "{} is 0: give a fixed port that every rank uses (MASTER_PORT or --master-port)",
                    named("master_port")
                ),
            });
        }
        Ok(())
    }
}

impl fmt::Display for World {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "rank {} of {} (local {} of {}, node {} of {}, master {}:{}, {})",
            self.rank,
            self.world_size,
            self.local_rank,
            self.local_world_size,
            self.node_rank,
            self.nnodes,
            self.master_addr,
            self.master_port,
            self.launcher
        )
    }
}

/// Environment lookups with "empty = unset".
struct Env<'a>(&'a HashMap<String, String>);

impl Env<'_> {
    fn get(&self, var: &str) -> Option<&str> {
        self.0.get(var).map(|v| v.trim()).filter(|v| !v.is_empty())
    }

    /// First of `vars` that is set: (name, value).
    fn first<'v>(&self, vars: &[&'v str]) -> Option<(&'v str, &str)> {
        vars.iter().find_map(|&v| self.get(v).map(|x| (v, x)))
    }

    fn num(&self, var: &str) -> Result<Option<usize>> {
        self.get(var).map(|v| parse_num(var, v)).transpose()
    }

    fn require_num(&self, var: &str, because: &str) -> Result<usize> {
        match self.get(var) {
            Some(v) => parse_num(var, v),
            None => Err(DistError::IncompletePair {
                given: because.into(),
                missing: var.into(),
            }),
        }
    }

    fn port(&self) -> Result<u16> {
        match self.get("MASTER_PORT") {
            None => Ok(DEFAULT_MASTER_PORT),
            Some(v) => match v.parse::<u16>() {
                Ok(p) if p > 0 => Ok(p),
                _ => Err(DistError::BadEnvValue {
                    var: "MASTER_PORT".into(),
                    value: v.into(),
                    expected: "a TCP port in 1..=65535".into(),
                }),
            },
        }
    }
}

fn parse_num(var: &str, v: &str) -> Result<usize> {
    v.parse::<usize>().map_err(|_| DistError::BadEnvNumber {
        var: var.into(),
        value: v.into(),
    })
}

fn checked(world: World, source: &str) -> Result<Option<World>> {
    world.validate().map_err(|e| match e {
        DistError::BadWorld { problem } => DistError::BadWorld {
            problem: format!("{problem} (from {source})"),
        },
        other => other,
    })?;
    Ok(Some(world))
}

fn from_torchrun(env: &Env) -> Result<Option<World>> {
    let trigger = env.first(&["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"]);
    let Some((given, _)) = trigger else {
        return Ok(None);
    };
    let rank = env.require_num("RANK", given)?;
    let world_size = env.require_num("WORLD_SIZE", given)?;
    let local_rank = env.require_num("LOCAL_RANK", given)?;
    let local_world_size = match env.num("LOCAL_WORLD_SIZE")? {
        Some(n) => n,
        // Older launchers (torch.distributed.launch) omit it; one node is the only safe guess.
        None => match env.num("GROUP_WORLD_SIZE")? {
            Some(g) if g > 0 && world_size % g == 0 => world_size / g,
            _ => {
                return Err(DistError::IncompletePair {
                    given: "LOCAL_RANK".into(),
                    missing: "LOCAL_WORLD_SIZE".into(),
                })
            }
        },
    };
    let nnodes = match env.num("GROUP_WORLD_SIZE")? {
        Some(n) => n,
        None if local_world_size > 0 => world_size.div_ceil(local_world_size),
        None => 1,
    };
    let node_rank = match env.first(&["GROUP_RANK", "NODE_RANK"]) {
        Some((var, v)) => parse_num(var, v)?,
        None if local_world_size > 0 => rank / local_world_size,
        None => 0,
    };
    let master_addr = match env.get("MASTER_ADDR") {
        Some(a) => a.to_string(),
        None if nnodes <= 1 => "127.0.0.1".to_string(),
        None => {
            return Err(DistError::IncompletePair {
                given: format!("{given} (a world of {nnodes} nodes)"),
                missing: "MASTER_ADDR".into(),
            })
        }
    };
    let launcher = if env.get(FLEET_LAUNCHER_ENV) == Some("1") {
        Launcher::Fleet
    } else {
        Launcher::Torchrun
    };
    let source = if launcher == Launcher::Fleet {
        "fleet launcher's RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE"
    } else {
        "RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE"
    };
    checked(
        World {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            nnodes,
            master_addr,
            master_port: env.port()?,
            launcher,
        },
        source,
    )
}

fn from_slurm(env: &Env) -> Result<Option<World>> {
    let Some(procid) = env.get("SLURM_PROCID") else {
        return Ok(None);
    };
    let rank = parse_num("SLURM_PROCID", procid)?;
    let world_size = match env.first(&["SLURM_NTASKS", "SLURM_NPROCS"]) {
        Some((var, v)) => parse_num(var, v)?,
        None => {
            return Err(DistError::IncompletePair {
                given: "SLURM_PROCID".into(),
                missing: "SLURM_NTASKS".into(),
            })
        }
    };
    let local_rank = env.require_num("SLURM_LOCALID", "SLURM_PROCID")?;
    let nodelist = env.first(&[
        "SLURM_JOB_NODELIST",
        "SLURM_NODELIST",
        "SLURM_STEP_NODELIST",
    ]);
    let per_node = match env.first(&["SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE"]) {
        Some((var, v)) => Some((
            var,
            v,
            parse_tasks_per_node(v).map_err(|reason| DistError::BadEnvValue {
                var: var.into(),
                value: v.into(),
                expected: format!("a SLURM task count list such as `4(x2),2` ({reason})"),
            })?,
        )),
        None => None,
    };
    let nnodes = match env.first(&[
        "SLURM_STEP_NUM_NODES",
        "SLURM_NNODES",
        "SLURM_JOB_NUM_NODES",
    ]) {
        Some((var, v)) => parse_num(var, v)?,
        None => match (&per_node, nodelist) {
            (Some((_, _, counts)), _) => counts.len(),
            (None, Some((var, list))) => expand_nodelist(list).map_err(|e| with_var(e, var))?.len(),
            (None, None) => 1,
        },
    };
    let node_rank = match env.num("SLURM_NODEID")? {
        Some(n) => n,
        None if nnodes == 1 => 0,
        None => {
            return Err(DistError::IncompletePair {
                given: format!("SLURM_PROCID (a job of {nnodes} nodes)"),
                missing: "SLURM_NODEID".into(),
            })
        }
    };
    let local_world_size = if let Some(n) = env.num("SLURM_NTASKS_PER_NODE")? {
        n
    } else if let Some((var, value, counts)) = &per_node {
        match counts.get(node_rank) {
            Some(&n) => n,
            None => {
                return Err(DistError::BadEnvValue {
                    var: (*var).into(),
                    value: (*value).into(),
                    expected: format!(
                        "a task count for node {node_rank} (SLURM_NODEID), but it lists {} nodes",
                        counts.len()
                    ),
                })
            }
        }
    } else if nnodes == 1 {
        world_size
    } else {
        return Err(DistError::IncompletePair {
            given: format!("SLURM_PROCID (a job of {nnodes} nodes)"),
            missing: "SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE".into(),
        });
    };
    let master_addr = match (env.get("MASTER_ADDR"), nodelist) {
        (Some(a), _) => a.to_string(),
        (None, Some((var, list))) => expand_nodelist(list)
            .map_err(|e| with_var(e, var))?
            .into_iter()
            .next()
            .expect("expand_nodelist returns at least one host"),
        (None, None) if nnodes == 1 => "127.0.0.1".into(),
        (None, None) => {
            return Err(DistError::IncompletePair {
                given: format!("SLURM_PROCID (a job of {nnodes} nodes)"),
                missing: "MASTER_ADDR or SLURM_JOB_NODELIST".into(),
            })
        }
    };
    checked(
        World {
            rank,
            world_size,
            local_rank,
            local_world_size,
            node_rank,
            nnodes,
            master_addr,
            master_port: env.port()?,
            launcher: Launcher::Slurm,
        },
        "SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID/SLURM_NODEID",
    )
}

fn with_var(e: DistError, var: &str) -> DistError {
    match e {
        DistError::BadNodelist { list, reason } => DistError::BadNodelist {
            list: format!("{var}={list}"),
            reason,
        },
        other => other,
    }
}

/// Expands SLURM's compressed host list: `gpu[01-03,07]` → `gpu01 gpu02 gpu03 gpu07` (zero
/// padding kept), comma-separated groups (`a1,b[1-2]` → `a1 b1 b2`), several bracket groups in
/// one name (`r[1-2]n[3-4]` → `r1n3 r1n4 r2n3 r2n4`), plain names. Order is kept, duplicates
/// too. Errors on unbalanced or nested brackets, empty names or ranges, and ranges that run
/// backwards (`[5-3]`).
pub fn expand_nodelist(s: &str) -> Result<Vec<String>> {
    let bad = |reason: String| DistError::BadNodelist {
        list: s.to_string(),
        reason,
    };
    let s_trim = s.trim();
    if s_trim.is_empty() {
        return Err(bad("it is empty".into()));
    }
    // Split on the commas outside brackets.
    let mut items = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s_trim.char_indices() {
        match c {
            '[' => {
                if depth > 0 {
                    return Err(bad(format!("nested `[` at byte {i}")));
                }
                depth += 1;
            }
            ']' => {
                if depth == 0 {
                    return Err(bad(format!("`]` without `[` at byte {i}")));
                }
                depth -= 1;
            }
            ',' if depth == 0 => {
                items.push(&s_trim[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    if depth != 0 {
        return Err(bad("a `[` is never closed".into()));
    }
    items.push(&s_trim[start..]);

    let mut hosts = Vec::new();
    for item in items {
        let item = item.trim();
        if item.is_empty() {
            return Err(bad(
                "it has an empty host name (two commas in a row?)".into()
            ));
        }
        // Parts: literal text and bracket groups, expanded as a cartesian product.
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            match rest.find('[') {
                None => {
                    names.iter_mut().for_each(|n| n.push_str(rest));
                    rest = "";
                }
                Some(open) => {
                    let lit = &rest[..open];
                    names.iter_mut().for_each(|n| n.push_str(lit));
                    let close = open
                        + rest[open..]
                            .find(']')
                            .expect("brackets were checked to balance");
                    let values = expand_ranges(&rest[open + 1..close]).map_err(bad)?;
                    names = names
                        .iter()
                        .flat_map(|n| values.iter().map(move |v| format!("{n}{v}")))
                        .collect();
                    rest = &rest[close + 1..];
                }
            }
        }
        hosts.extend(names);
    }
    Ok(hosts)
}

/// `01-03,07` → `01 02 03 07`.
fn expand_ranges(body: &str) -> std::result::Result<Vec<String>, String> {
    if body.trim().is_empty() {
        return Err("it has an empty bracket group `[]`".into());
    }
    let mut out = Vec::new();
    for part in body.split(',') {
        let part = part.trim();
        let num = |t: &str| -> std::result::Result<u64, String> {
            if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
                return Err(format!(
                    "`{part}` in `[{body}]` is not a number or a range such as `01-04`"
                ));
            }
            t.parse::<u64>()
                .map_err(|_| format!("`{t}` in `[{body}]` is too large"))
        };
        match part.split_once('-') {
            None => {
                num(part)?;
                out.push(part.to_string());
            }
            Some((lo_s, hi_s)) => {
                let (lo, hi) = (num(lo_s)?, num(hi_s)?);
                if hi < lo {
                    return Err(format!("range `{part}` in `[{body}]` runs backwards"));
                }
                if hi - lo > 100_000 {
                    return Err(format!(
                        "range `{part}` in `[{body}]` has more than 100000 hosts"
                    ));
                }
                let width = lo_s.len();
                out.extend((lo..=hi).map(|v| format!("{v:0width$}")));
            }
        }
    }
    Ok(out)
}

/// SLURM's tasks-per-node list: `4(x2),2` → `[4, 4, 2]`. The error is a reason, without the
/// variable (the caller names it).
pub fn parse_tasks_per_node(s: &str) -> std::result::Result<Vec<usize>, String> {
    let mut out = Vec::new();
    for part in s.split(',') {
        let part = part.trim();
        let (count, repeat) = match part.split_once('(') {
            None => (part, 1usize),
            Some((c, r)) => {
                let r = r
                    .strip_suffix(')')
                    .and_then(|r| r.trim().strip_prefix('x'))
                    .ok_or_else(|| format!("`{part}` is not of the form `N` or `N(xM)`"))?;
                let r: usize = r
                    .trim()
                    .parse()
                    .map_err(|_| format!("the repeat in `{part}` is not a number"))?;
                (c.trim(), r)
            }
        };
        let count: usize = count
            .parse()
            .map_err(|_| format!("`{part}` does not start with a task count"))?;
        if repeat == 0 || repeat > 1_000_000 {
            return Err(format!("the repeat in `{part}` is out of range"));
        }
        out.extend(std::iter::repeat_n(count, repeat));
    }
    Ok(out)
}

/// The GPUs of this rank among the `visible` ones when one process per GPU was started by a
/// launcher that shows every rank all of the node's GPUs (torchrun, SLURM without
/// `--gpus-per-task`): local rank `k` of `n` takes the `k`-th of `n` equal slices, as
/// torchrun's `cuda:LOCAL_RANK` convention does for one GPU per rank. `None` when the rank sees
/// one GPU or none (fleet's launcher sets CUDA_VISIBLE_DEVICES per rank) or runs alone on its
/// node.
pub fn rank_gpus(world: &World, visible: &[usize]) -> Result<Option<Vec<usize>>> {
    let n = world.local_world_size;
    if visible.len() <= 1 || n <= 1 {
        return Ok(None);
    }
    if !visible.len().is_multiple_of(n) {
        return Err(DistError::UnevenGpus {
            visible: visible.to_vec(),
            local_world_size: n,
        });
    }
    let per = visible.len() / n;
    let k = world.local_rank;
    Ok(Some(visible[k * per..(k + 1) * per].to_vec()))
}

/// The distributed environment in accelerate's words, for the start of a run: the mode
/// (several GPUs or CPUs, or one), the collectives' `backend`, the launcher, the process and node
/// counts, this process's indices and its `device`.
pub fn describe_environment(world: &World, backend: &str, device: &str) -> String {
    let mode = if world.world_size > 1 {
        if device.starts_with("cuda") {
            "MULTI_GPU"
        } else {
            "MULTI_CPU"
        }
    } else if device.starts_with("cuda") {
        "NO (one GPU)"
    } else {
        "NO (CPU)"
    };
    format!(
        "Distributed environment: {mode}  Backend: {backend}  Launcher: {}\n\
         Number of processes: {}\nNumber of nodes: {}\nProcess index: {}\nLocal process index: \
         {}\nDevice: {device}",
        world.launcher, world.world_size, world.nnodes, world.rank, world.local_rank
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> HashMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn world(pairs: &[(&str, &str)]) -> World {
        World::from_env_map(&env(pairs)).unwrap().unwrap()
    }

    fn err(pairs: &[(&str, &str)]) -> String {
        World::from_env_map(&env(pairs)).unwrap_err().to_string()
    }

    #[test]
    fn nothing_set_is_none_and_single_is_rank_0_of_1() {
        assert_eq!(World::from_env_map(&env(&[])).unwrap(), None);
        assert_eq!(
            World::from_env_map(&env(&[("RANK", ""), ("SLURM_PROCID", " ")])).unwrap(),
            None,
            "empty values count as unset"
        );
        let w = World::single();
        assert!(w.is_main() && !w.is_distributed());
        w.validate().unwrap();
        assert_eq!(w.launcher.to_string(), "single process");
    }

    #[test]
    fn torchrun_variables() {
        let w = world(&[
            ("RANK", "5"),
            ("WORLD_SIZE", "8"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "4"),
            ("GROUP_RANK", "1"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "1234"),
        ]);
        assert_eq!(
            w,
            World {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                nnodes: 2,
                master_addr: "node0".into(),
                master_port: 1234,
                launcher: Launcher::Torchrun,
            }
        );
        assert!(!w.is_main() && w.is_distributed());
        // NODE_RANK works as GROUP_RANK; without either, rank / local_world_size.
        let w = world(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
        ]);
        assert_eq!(
            (w.node_rank, w.nnodes, w.master_port),
            (1, 2, DEFAULT_MASTER_PORT)
        );
        // One node: MASTER_ADDR defaults to the loopback.
        let w = world(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert_eq!(w.master_addr, "127.0.0.1");
    }

    #[test]
    fn fleet_launcher_marker_and_precedence_over_slurm() {
        let w = world(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("NODE_RANK", "0"),
            ("FLEET_LAUNCHER", "1"),
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_LOCALID", "0"),
        ]);
        assert_eq!((w.rank, w.launcher), (1, Launcher::Fleet));
    }

    #[test]
    fn torchrun_errors_name_the_variable() {
        let e = err(&[("RANK", "1")]);
        assert!(e.contains("RANK is set but WORLD_SIZE is not"), "{e}");
        let e = err(&[("LOCAL_RANK", "0")]);
        assert!(e.contains("LOCAL_RANK is set but RANK is not"), "{e}");
        let e = err(&[("RANK", "x1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert!(e.contains("RANK=`x1`"), "{e}");
        let e = err(&[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "0"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(
            e.contains("rank") && e.contains("= 2 is not below world_size = 2"),
            "{e}"
        );
        let e = err(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(
            e.contains("local_rank") && e.contains("3 is not below"),
            "{e}"
        );
        let e = err(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
            ("MASTER_PORT", "70000"),
        ]);
        assert!(e.contains("MASTER_PORT=`70000`"), "{e}");
        let e = err(&[
            ("RANK", "1"),
            ("WORLD_SIZE", "4"),
            ("LOCAL_RANK", "1"),
            ("LOCAL_WORLD_SIZE", "2"),
        ]);
        assert!(e.contains("MASTER_ADDR"), "{e}");
        let e = err(&[("RANK", "0"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "0")]);
        assert!(e.contains("LOCAL_WORLD_SIZE"), "{e}");
    }

    #[test]
    fn slurm_variables_with_compressed_lists() {
        let w = world(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NODEID", "1"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "4(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[01-03,07]"),
        ]);
        assert_eq!(
            w,
            World {
                rank: 5,
                world_size: 8,
                local_rank: 1,
                local_world_size: 4,
                node_rank: 1,
                nnodes: 2,
                master_addr: "gpu01".into(),
                master_port: DEFAULT_MASTER_PORT,
                launcher: Launcher::Slurm,
            }
        );
        // Uneven nodes: this node's entry; MASTER_ADDR/MASTER_PORT win over the node list.
        let w = world(&[
            ("SLURM_PROCID", "8"),
            ("SLURM_NTASKS", "9"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "2"),
            ("SLURM_JOB_NUM_NODES", "3"),
            ("SLURM_TASKS_PER_NODE", "4(x2),1"),
            ("SLURM_NODELIST", "n[1-3]"),
            ("MASTER_ADDR", "10.0.0.1"),
            ("MASTER_PORT", "4000"),
        ]);
        assert_eq!(
            (
                w.local_world_size,
                w.nnodes,
                w.master_addr.as_str(),
                w.master_port
            ),
            (1, 3, "10.0.0.1", 4000)
        );
        // SLURM_NTASKS_PER_NODE wins; no node count: one node.
        let w = world(&[
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "2"),
        ]);
        assert_eq!(
            (
                w.nnodes,
                w.node_rank,
                w.local_world_size,
                w.master_addr.as_str()
            ),
            (1, 0, 2, "127.0.0.1")
        );
    }

    #[test]
    fn slurm_errors_name_the_variable() {
        let e = err(&[("SLURM_PROCID", "0")]);
        assert!(
            e.contains("SLURM_PROCID is set but SLURM_NTASKS is not"),
            "{e}"
        );
        let e = err(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "2")]);
        assert!(e.contains("SLURM_LOCALID"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "1(y2)"),
        ]);
        assert!(e.contains("SLURM_TASKS_PER_NODE=`1(y2)`"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", "2"),
            ("SLURM_TASKS_PER_NODE", "1(x2)"),
            ("SLURM_JOB_NODELIST", "gpu[01-"),
        ]);
        assert!(e.contains("SLURM_JOB_NODELIST=gpu[01-"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "4"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
        ]);
        assert!(e.contains("= 4 is not below world_size = 4"), "{e}");
        assert!(e.contains("SLURM"), "{e}");
        let e = err(&[
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "4"),
            ("SLURM_LOCALID", "0"),
            ("SLURM_NODEID", "0"),
            ("SLURM_NNODES", "2"),
        ]);
        assert!(e.contains("SLURM_TASKS_PER_NODE"), "{e}");
    }

    #[test]
    fn nodelists_expand() {
        let x = |s: &str| expand_nodelist(s).unwrap();
        assert_eq!(x("gpu[01-03,07]"), ["gpu01", "gpu02", "gpu03", "gpu07"]);
        assert_eq!(x("a1,b[1-2]"), ["a1", "b1", "b2"]);
        assert_eq!(x("r[1-2]n[3-4]"), ["r1n3", "r1n4", "r2n3", "r2n4"]);
        assert_eq!(x("node"), ["node"]);
        assert_eq!(x("n[8-10]"), ["n8", "n9", "n10"]);
        assert_eq!(x("n[098-101]"), ["n098", "n099", "n100", "n101"]);
        assert_eq!(x("a-1.x,b[2].y"), ["a-1.x", "b2.y"]);
        assert_eq!(x("c[1-2]-ib,d"), ["c1-ib", "c2-ib", "d"]);
        for bad in [
            "",
            "gpu[01-03",
            "gpu01-03]",
            "g[[1]]",
            "g[]",
            "g[3-1]",
            "g[a-b]",
            "a,,b",
            "g[1-]",
        ] {
            let e = expand_nodelist(bad).unwrap_err().to_string();
            assert!(e.contains("SLURM node list"), "{bad}: {e}");
        }
    }

    #[test]
    fn tasks_per_node_lists() {
        assert_eq!(parse_tasks_per_node("4(x2)").unwrap(), [4, 4]);
        assert_eq!(parse_tasks_per_node("2(x3),1").unwrap(), [2, 2, 2, 1]);
        assert_eq!(parse_tasks_per_node("8").unwrap(), [8]);
        assert!(parse_tasks_per_node("4(2)").is_err());
        assert!(parse_tasks_per_node("x").is_err());
        assert!(parse_tasks_per_node("4(x0)").is_err());
    }

    #[test]
    fn validate_catches_hand_built_worlds() {
        let mut w = World::single();
        w.launcher = Launcher::Manual;
        w.node_rank = 1;
        let e = w.validate().unwrap_err().to_string();
        assert!(
            e.contains("node_rank (manual world) = 1 is not below nnodes = 1"),
            "{e}"
        );
        let mut w = World::single();
        w.master_port = 0;
        assert!(w
            .validate()
            .unwrap_err()
            .to_string()
            .contains("master_port"));
    }
}

#[cfg(test)]
mod rank_gpus_tests {
    use super::*;

    fn world(local_rank: usize, local_world_size: usize) -> World {
        World {
            rank: local_rank,
            world_size: local_world_size,
            local_rank,
            local_world_size,
            ..World::single()
        }
    }

    #[test]
    fn a_rank_that_sees_every_gpu_of_its_node_takes_its_own() {
        // torchrun's convention: local rank k uses cuda:k.
        assert_eq!(
            rank_gpus(&world(1, 4), &[0, 1, 2, 3]).unwrap(),
            Some(vec![1])
        );
        // Two GPUs per rank (a sharded policy per rank).
        assert_eq!(
            rank_gpus(&world(1, 2), &[0, 1, 2, 3]).unwrap(),
            Some(vec![2, 3])
        );
        // fleet's launcher shows each rank one GPU; a lone rank keeps what it sees.
        assert_eq!(rank_gpus(&world(3, 4), &[5]).unwrap(), None);
        assert_eq!(rank_gpus(&world(0, 1), &[0, 1]).unwrap(), None);
        assert_eq!(rank_gpus(&world(0, 4), &[]).unwrap(), None);
        let err = rank_gpus(&world(0, 3), &[0, 1, 2, 3])
            .unwrap_err()
            .to_string();
        assert!(err.contains("cannot be shared equally"), "{err}");
        assert!(err.contains("CUDA_VISIBLE_DEVICES"), "{err}");
    }
}
