//! Which part of a job this process runs.

use std::ops::Range;

use crate::{DistError, Result};

/// Where a [`ShardSpec`] came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ShardSource {
    /// `--num-shards` and `--shard-index`.
    Args,
    /// `SLURM_PROCID` and `SLURM_NTASKS` (or `SLURM_NPROCS`).
    Slurm,
    /// `RANK` and `WORLD_SIZE` (torchrun and friends).
    Torchrun,
    /// Nothing set: one shard, the whole job.
    Single,
}

/// Shard `index` of `count`: this process runs the items [`ShardSpec::select`] returns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardSpec {
    /// This shard, in `0..count`.
    pub index: usize,
    /// Number of shards (processes) the job is split into; at least 1.
    pub count: usize,
    /// Where the values came from.
    pub source: ShardSource,
}

impl ShardSpec {
    /// A validated spec: `count >= 1` and `index < count`.
    pub fn new(index: usize, count: usize) -> Result<Self> {
        validate(
            index,
            count,
            ShardSource::Args,
            "--num-shards/--shard-index",
        )
    }

    /// The whole job in one shard.
    pub fn single() -> Self {
        Self {
            index: 0,
            count: 1,
            source: ShardSource::Single,
        }
    }

    /// Resolves the shard, first match wins:
    ///
    /// 1. `num_shards` and `shard_index` (from `--num-shards N --shard-index i`); both or neither;
    /// 2. `SLURM_PROCID` with `SLURM_NTASKS` (or `SLURM_NPROCS`);
    /// 3. `RANK` with `WORLD_SIZE`;
    /// 4. shard 0 of 1.
    ///
    /// `env` looks a variable up (empty values count as unset), so tests can pass a map. Errors
    /// name the flag or variable at fault: a count of 0, an index not below the count, a value
    /// that is not a non-negative integer, half of a pair.
    pub fn from_env_and_args(
        num_shards: Option<usize>,
        shard_index: Option<usize>,
        env: &impl Fn(&str) -> Option<String>,
    ) -> Result<Self> {
        match (num_shards, shard_index) {
            (Some(count), Some(index)) => {
                return validate(
                    index,
                    count,
                    ShardSource::Args,
                    "--num-shards/--shard-index",
                )
            }
            (Some(_), None) => {
                return Err(DistError::IncompletePair {
                    given: "--num-shards".into(),
                    missing: "--shard-index".into(),
                })
            }
            (None, Some(_)) => {
                return Err(DistError::IncompletePair {
                    given: "--shard-index".into(),
                    missing: "--num-shards".into(),
                })
            }
            (None, None) => {}
        }
        let get = |var: &str| env(var).filter(|v| !v.trim().is_empty());

        let slurm_id = get("SLURM_PROCID");
        let (ntasks_var, slurm_n) = match get("SLURM_NTASKS") {
            Some(v) => ("SLURM_NTASKS", Some(v)),
            None => ("SLURM_NPROCS", get("SLURM_NPROCS")),
        };
        if let Some(spec) = from_pair(
            ("SLURM_PROCID", slurm_id),
            (ntasks_var, slurm_n),
            ShardSource::Slurm,
        )? {
            return Ok(spec);
        }
        if let Some(spec) = from_pair(
            ("RANK", get("RANK")),
            ("WORLD_SIZE", get("WORLD_SIZE")),
            ShardSource::Torchrun,
        )? {
            return Ok(spec);
        }
        Ok(Self::single())
    }

    /// [`ShardSpec::from_env_and_args`] with the process environment.
    pub fn from_process_env(num_shards: Option<usize>, shard_index: Option<usize>) -> Result<Self> {
        Self::from_env_and_args(num_shards, shard_index, &|var| std::env::var(var).ok())
    }

    /// The items of this shard out of `n_items`: a **contiguous** range. The first
    /// `n_items % count` shards get one item more than the rest; shard sizes differ by at most
    /// one, and the ranges of shards `0..count` tile `0..n_items` in order with no gap or overlap.
    /// The split depends only on `n_items`, `index` and `count`, so it is stable across runs.
    pub fn select(&self, n_items: usize) -> Range<usize> {
        let count = self.count.max(1);
        let index = self.index.min(count - 1);
        let base = n_items / count;
        let rem = n_items % count;
        let start = index * base + index.min(rem);
        let len = base + usize::from(index < rem);
        start..start + len
    }

    /// Whether this is the only shard.
    pub fn is_single(&self) -> bool {
        self.count == 1
    }
}

impl std::fmt::Display for ShardSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "shard {}/{}", self.index, self.count)
    }
}

fn validate(index: usize, count: usize, source: ShardSource, name: &str) -> Result<ShardSpec> {
    if count == 0 {
        return Err(DistError::ZeroShards {
            source_name: name.to_string(),
        });
    }
    if index >= count {
        return Err(DistError::ShardIndexOutOfRange {
            index,
            count,
            source_name: name.to_string(),
        });
    }
    Ok(ShardSpec {
        index,
        count,
        source,
    })
}

fn parse_var(var: &str, value: &str) -> Result<usize> {
    value.trim().parse().map_err(|_| DistError::BadEnvNumber {
        var: var.to_string(),
        value: value.to_string(),
    })
}

fn from_pair(
    (index_var, index): (&str, Option<String>),
    (count_var, count): (&str, Option<String>),
    source: ShardSource,
) -> Result<Option<ShardSpec>> {
    match (index, count) {
        (None, None) => Ok(None),
        (Some(_), None) => Err(DistError::IncompletePair {
            given: index_var.to_string(),
            missing: count_var.to_string(),
        }),
        (None, Some(_)) => Err(DistError::IncompletePair {
            given: count_var.to_string(),
            missing: index_var.to_string(),
        }),
        (Some(i), Some(n)) => {
            let index = parse_var(index_var, &i)?;
            let count = parse_var(count_var, &n)?;
            validate(index, count, source, &format!("{index_var}/{count_var}")).map(Some)
        }
    }
}
