//! fleet's local launcher: N ranks of one program on this node, one GPU each.
//!
//! [`launch`] starts `nproc_per_node` children of `program args` with torchrun's variables
//! (`RANK = node_rank * nproc_per_node + local_rank`, `WORLD_SIZE = nnodes * nproc_per_node`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `NODE_RANK`, `GROUP_RANK`, `GROUP_WORLD_SIZE`,
//! `MASTER_ADDR`, `MASTER_PORT`), `FLEET_LAUNCHER=1`, `NCCL_NVLS_ENABLE=0` (NVLink multicast is
//! never used; set unconditionally, over the caller's `env`) and `CUDA_VISIBLE_DEVICES` = the
//! rank's GPU. Children's output is forwarded line by line with a `[rank K] ` prefix. When a
//! rank fails, the others get a grace period to notice (through the heartbeat of
//! [`crate::Group`]) and exit; then they are killed.
//!
//! Several nodes by hand: run the launcher on each with the same `nnodes`, `master_addr` and
//! `master_port` and its own `node_rank`.

use std::collections::BTreeSet;
use std::fmt;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use crate::world::{DEFAULT_MASTER_PORT, FLEET_LAUNCHER_ENV};
use crate::FAILURE_EXIT_CODE;
use crate::{DistError, Result};

/// How long the other ranks get after one fails before they are killed, by default. They are
/// expected to notice through the heartbeat well before (see `failure_timeout`).
pub const DEFAULT_GRACE_PERIOD: Duration = Duration::from_secs(30);

/// What [`launch`] starts on this node.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchSpec {
    /// Ranks on this node (one GPU each).
    pub nproc_per_node: usize,
    /// Nodes in the job (each runs a launcher with the same `nproc_per_node`).
    pub nnodes: usize,
    /// This node's index, in `0..nnodes`.
    pub node_rank: usize,
    /// Rank 0's host, as every node reaches it.
    pub master_addr: String,
    /// Rank 0's rendezvous port.
    pub master_port: u16,
    /// GPU of each local rank, as indices into this process's visible GPUs (its
    /// `CUDA_VISIBLE_DEVICES` when set); `None`: local rank `k` gets GPU `k`. Its length must be
    /// `nproc_per_node`, without repeats.
    pub gpu_ids: Option<Vec<usize>>,
    /// The program every rank runs (usually `std::env::current_exe()`).
    pub program: PathBuf,
    /// Its arguments (usually this process's, less the launcher's flags:
    /// [`strip_launcher_args`]).
    pub args: Vec<String>,
    /// Extra environment for every rank; the rank variables above are set after it and win.
    pub env: Vec<(String, String)>,
}

impl Default for LaunchSpec {
    /// One rank on one node, master `127.0.0.1:29500`, no program yet.
    fn default() -> Self {
        LaunchSpec {
            nproc_per_node: 1,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            gpu_ids: None,
            program: PathBuf::new(),
            args: Vec::new(),
            env: Vec::new(),
        }
    }
}

impl LaunchSpec {
    /// Checks the spec: counts at least 1, `node_rank < nnodes`, `gpu_ids` of length
    /// `nproc_per_node` without repeats, a master address, a non-zero port, a program.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |field: &'static str, problem: String| Err(DistError::BadLaunch { field, problem });
        if self.nproc_per_node == 0 {
            return bad(
                "nproc_per_node",
                "is 0: start at least one rank per node (--nproc-per-node)".into(),
            );
        }
        if self.nnodes == 0 {
            return bad(
                "nnodes",
                "is 0: a job has at least one node (--nnodes)".into(),
            );
        }
        if self.node_rank >= self.nnodes {
            return bad(
                "node_rank",
                format!(
                    "= {} is not below nnodes = {}: number the nodes 0..{} (--node-rank)",
                    self.node_rank, self.nnodes, self.nnodes
                ),
            );
        }
        if let Some(ids) = &self.gpu_ids {
            if ids.len() != self.nproc_per_node {
                return bad(
                    "gpu_ids",
                    format!(
                        "lists {} GPUs ({ids:?}) for nproc_per_node = {}: give one GPU per local rank (--gpu-ids), or leave it out to use GPUs 0..{}",
                        ids.len(),
                        self.nproc_per_node,
                        self.nproc_per_node
                    ),
                );
            }
            let mut seen = BTreeSet::new();
            for id in ids {
                if !seen.insert(id) {
                    return bad(
                        "gpu_ids",
                        format!("lists GPU {id} twice ({ids:?}): each rank needs a GPU of its own"),
                    );
                }
            }
        }
        if self.master_addr.trim().is_empty() {
            return bad(
                "master_addr",
                "is empty: give rank 0's host (--master-addr)".into(),
            );
        }
        if self.master_port == 0 {
            return bad(
                "master_port",
                "is 0: give a port every node uses (--master-port)".into(),
            );
        }
        if self.program.as_os_str().is_empty() {
            return bad(
                "program",
                "is empty: give the program each rank runs".into(),
            );
        }
        Ok(())
    }

    /// The variables [`launch`] sets for local rank `local_rank`. `parent_visible` is this
    /// process's `CUDA_VISIBLE_DEVICES` (`None` when unset): GPU indices are looked up in it, so
    /// a launcher that sees `4,5,6,7` gives local rank 0 GPU `4`; an empty value (no GPU
    /// visible) is passed on as is.
    pub fn rank_env(
        &self,
        local_rank: usize,
        parent_visible: Option<&str>,
    ) -> Result<Vec<(String, String)>> {
        let gpu = self
            .gpu_ids
            .as_ref()
            .map_or(local_rank, |ids| ids[local_rank]);
        let visible = match parent_visible {
            None => gpu.to_string(),
            Some(list) if list.trim().is_empty() => String::new(),
            Some(list) => {
                let entries: Vec<&str> = list.split(',').map(str::trim).collect();
                match entries.get(gpu) {
                    Some(e) => e.to_string(),
                    None => {
                        return Err(DistError::BadLaunch {
                            field: "gpu_ids",
                            problem: format!(
                                "local rank {local_rank} needs GPU {gpu}, but CUDA_VISIBLE_DEVICES=`{list}` shows {} GPUs: pick GPUs in 0..{} (--gpu-ids) or start fewer ranks",
                                entries.len(),
                                entries.len()
                            ),
                        })
                    }
                }
            }
        };
        let rank = self.node_rank * self.nproc_per_node + local_rank;
        let s = |k: &str, v: String| (k.to_string(), v);
        Ok(vec![
            s("RANK", rank.to_string()),
            s(
                "WORLD_SIZE",
                (self.nnodes * self.nproc_per_node).to_string(),
            ),
            s("LOCAL_RANK", local_rank.to_string()),
            s("LOCAL_WORLD_SIZE", self.nproc_per_node.to_string()),
            s("NODE_RANK", self.node_rank.to_string()),
            s("GROUP_RANK", self.node_rank.to_string()),
            s("GROUP_WORLD_SIZE", self.nnodes.to_string()),
            s("MASTER_ADDR", self.master_addr.clone()),
            s("MASTER_PORT", self.master_port.to_string()),
            s(FLEET_LAUNCHER_ENV, "1".into()),
            s("NCCL_NVLS_ENABLE", "0".into()),
            s("CUDA_VISIBLE_DEVICES", visible),
        ])
    }
}

/// How one rank ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankExit {
    /// Global rank.
    pub rank: usize,
    /// Rank on this node.
    pub local_rank: usize,
    /// Its process id.
    pub pid: u32,
    /// Its exit status.
    pub status: ExitStatus,
    /// The launcher killed it after the grace period.
    pub killed_by_launcher: bool,
}

impl RankExit {
    /// Exited with code 0.
    pub fn success(&self) -> bool {
        self.status.success()
    }

    /// Exit code, when it exited (not killed by a signal).
    pub fn code(&self) -> Option<i32> {
        self.status.code()
    }

    /// The signal that ended it, if one did.
    pub fn signal(&self) -> Option<i32> {
        #[cfg(unix)]
        {
            std::os::unix::process::ExitStatusExt::signal(&self.status)
        }
        #[cfg(not(unix))]
        {
            None
        }
    }
}

impl fmt::Display for RankExit {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} (pid {}) ", self.rank, self.pid)?;
        match (self.code(), self.signal()) {
            (Some(FAILURE_EXIT_CODE), _) => write!(
                f,
                "exited with code {FAILURE_EXIT_CODE} (ended by the failure detection: another rank failed, its message names it)"
            )?,
            (Some(c), _) => write!(f, "exited with code {c}")?,
            (None, Some(s)) => write!(f, "was killed by signal {s}{}", signal_name(s))?,
            _ => write!(f, "ended with {}", self.status)?,
        }
        if self.killed_by_launcher {
            write!(f, " (killed by the launcher after the grace period)")?;
        }
        Ok(())
    }
}

fn signal_name(s: i32) -> &'static str {
    match s {
        1 => " (SIGHUP)",
        2 => " (SIGINT)",
        6 => " (SIGABRT)",
        9 => " (SIGKILL)",
        11 => " (SIGSEGV)",
        15 => " (SIGTERM)",
        _ => "",
    }
}

/// How the ranks of this node ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchReport {
    /// Every local rank, in rank order.
    pub ranks: Vec<RankExit>,
    /// The first rank seen to fail (non-zero exit or a signal), if any. Among ranks seen ending
    /// in the same poll (10 ms apart), one that did not exit with [`FAILURE_EXIT_CODE`] (the
    /// code of ranks ended by the failure detection because of another) is preferred, and a
    /// rank that fails for its own reason after such ranks replaces them: the cause.
    pub first_failure: Option<RankExit>,
}

impl LaunchReport {
    /// Every rank exited with code 0.
    pub fn success(&self) -> bool {
        self.ranks.iter().all(RankExit::success)
    }

    /// A status for the launcher to exit with: 0 on success, else the first failure's code
    /// (128 + signal when it was killed by one).
    pub fn exit_code(&self) -> i32 {
        match &self.first_failure {
            None if self.success() => 0,
            None => 1,
            Some(f) => f
                .code()
                .or_else(|| f.signal().map(|s| 128 + s))
                .filter(|&c| c != 0)
                .unwrap_or(1),
        }
    }
}

impl LaunchReport {
    /// The report when every rank succeeded, else [`DistError::RanksFailed`] with it.
    pub fn into_result(self) -> Result<Self> {
        if self.success() {
            Ok(self)
        } else {
            Err(DistError::RanksFailed {
                report: Box::new(self),
            })
        }
    }
}

impl fmt::Display for LaunchReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.first_failure {
            None => write!(f, "all {} ranks exited with code 0", self.ranks.len())?,
            Some(first) => write!(f, "first failure: {first}")?,
        }
        for r in &self.ranks {
            write!(f, "\n  {r}")?;
        }
        Ok(())
    }
}

/// A TCP port free on this machine right now (bind to port 0, read, release), for tests and
/// single-node runs that need no fixed port. Another process may take it before it is used.
pub fn pick_free_port() -> Result<u16> {
    let l = TcpListener::bind(("0.0.0.0", 0)).map_err(|e| DistError::Listen {
        addr: "0.0.0.0:0".into(),
        port: 0,
        source: e,
    })?;
    Ok(l.local_addr()
        .map_err(|e| DistError::Listen {
            addr: "0.0.0.0:0".into(),
            port: 0,
            source: e,
        })?
        .port())
}

/// `args` less the launcher's own flags: each of `flags_with_value` as `--flag value` or
/// `--flag=value`, each of `bare_flags` as `--flag`. Everything from a `--` on is kept as is.
/// Pass the arguments without the program name (`std::env::args().skip(1)`).
pub fn strip_launcher_args(
    args: &[String],
    flags_with_value: &[&str],
    bare_flags: &[&str],
) -> Vec<String> {
    let mut out = Vec::with_capacity(args.len());
    let mut i = 0;
    while i < args.len() {
        let a = args[i].as_str();
        if a == "--" {
            out.extend(args[i..].iter().cloned());
            break;
        }
        if flags_with_value.contains(&a) {
            i += 2;
            continue;
        }
        let with_eq = a
            .split_once('=')
            .is_some_and(|(flag, _)| flags_with_value.contains(&flag));
        if with_eq || bare_flags.contains(&a) {
            i += 1;
            continue;
        }
        out.push(args[i].clone());
        i += 1;
    }
    out
}

/// Writes `prefix + line` (newline added when missing) in one call; errors (a closed stdout)
/// are ignored, and reading goes on so the child never blocks on a full pipe.
fn forward(mut from: impl Read, prefix: String, to_stderr: bool) {
    let mut reader = BufReader::new(&mut from);
    let mut line = Vec::new();
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        let mut out = Vec::with_capacity(prefix.len() + line.len() + 1);
        out.extend_from_slice(prefix.as_bytes());
        out.extend_from_slice(&line);
        if !out.ends_with(b"\n") {
            out.push(b'\n');
        }
        if to_stderr {
            let _ = std::io::stderr().lock().write_all(&out);
        } else {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(&out).and_then(|_| o.flush());
        }
    }
}

fn note(msg: &str) {
    let _ = writeln!(std::io::stderr().lock(), "[launcher] {msg}");
}

/// Starts the ranks of this node (see the module docs), forwards their output, waits for all
/// and reports how each ended. When one fails, the others get [`DEFAULT_GRACE_PERIOD`] and are
/// then killed ([`launch_with_grace`] to choose). Errors only when the spec is invalid or a rank
/// cannot be started (the ranks already started are killed); failed ranks are in the report
/// ([`LaunchReport::into_result`] turns them into an error).
pub fn launch(spec: &LaunchSpec) -> Result<LaunchReport> {
    launch_with_grace(spec, DEFAULT_GRACE_PERIOD)
}

/// [`launch`] with the time the other ranks may run on after one failed, before they are
/// killed.
pub fn launch_with_grace(spec: &LaunchSpec, grace_period: Duration) -> Result<LaunchReport> {
    spec.validate()?;
    let parent_visible = std::env::var("CUDA_VISIBLE_DEVICES").ok();
    let envs: Vec<Vec<(String, String)>> = (0..spec.nproc_per_node)
        .map(|l| spec.rank_env(l, parent_visible.as_deref()))
        .collect::<Result<_>>()?;
    let (tx, rx) = mpsc::channel::<()>();
    let mut children: Vec<Child> = Vec::with_capacity(spec.nproc_per_node);
    let mut forwarders = 0;
    for (local, env) in envs.iter().enumerate() {
        let rank = spec.node_rank * spec.nproc_per_node + local;
        let spawned = Command::new(&spec.program)
            .args(&spec.args)
            .envs(spec.env.iter().map(|(k, v)| (k, v)))
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn();
        let mut child = match spawned {
            Ok(c) => c,
            Err(source) => {
                for c in &mut children {
                    let _ = c.kill();
                    let _ = c.wait();
                }
                return Err(DistError::Spawn {
                    rank,
                    program: spec.program.clone(),
                    source,
                });
            }
        };
        let prefix = format!("[rank {rank}] ");
        if let Some(out) = child.stdout.take() {
            let (tx, prefix) = (tx.clone(), prefix.clone());
            forwarders += 1;
            std::thread::spawn(move || {
                forward(out, prefix, false);
                let _ = tx.send(());
            });
        }
        if let Some(err) = child.stderr.take() {
            let tx = tx.clone();
            forwarders += 1;
            std::thread::spawn(move || {
                forward(err, prefix, true);
                let _ = tx.send(());
            });
        }
        children.push(child);
    }
    drop(tx);

    let n = children.len();
    let rank_of = |local: usize| spec.node_rank * spec.nproc_per_node + local;
    let mut exits: Vec<Option<RankExit>> = vec![None; n];
    let mut first_failure: Option<RankExit> = None;
    let mut kill_at: Option<Instant> = None;
    loop {
        let mut newly_failed: Vec<RankExit> = Vec::new();
        for (local, child) in children.iter_mut().enumerate() {
            if exits[local].is_some() {
                continue;
            }
            let status = match child.try_wait() {
                Ok(Some(s)) => s,
                Ok(None) => continue,
                // Cannot happen for our own children; treat as gone.
                Err(_) => match child.wait() {
                    Ok(s) => s,
                    Err(_) => continue,
                },
            };
            let exit = RankExit {
                rank: rank_of(local),
                local_rank: local,
                pid: child.id(),
                status,
                killed_by_launcher: false,
            };
            if !status.success() {
                newly_failed.push(exit.clone());
            }
            exits[local] = Some(exit);
        }
        if first_failure.is_none() && !newly_failed.is_empty() {
            // Ranks seen ending in the same poll: the cause is the one that was not ended by
            // the failure detection (exit code FAILURE_EXIT_CODE).
            let exit = newly_failed
                .iter()
                .find(|e| e.code() != Some(FAILURE_EXIT_CODE))
                .unwrap_or(&newly_failed[0])
                .clone();
            let running = exits.iter().filter(|e| e.is_none()).count();
            if running > 0 {
                note(&format!(
                    "{exit}; the {running} other rank(s) still running here have {:.1} s to stop before they are killed",
                    grace_period.as_secs_f64()
                ));
            } else {
                note(&exit.to_string());
            }
            first_failure = Some(exit);
            kill_at = Some(Instant::now() + grace_period);
        } else if first_failure
            .as_ref()
            .is_some_and(|f| f.code() == Some(FAILURE_EXIT_CODE))
        {
            // The first rank seen ending was ended by the failure detection: the cause is a
            // rank that ends later for its own reason (a core dump makes an aborted rank slow
            // to exit).
            if let Some(cause) = newly_failed
                .iter()
                .find(|e| e.code() != Some(FAILURE_EXIT_CODE))
            {
                note(&format!("{cause}: the cause of the failure"));
                first_failure = Some(cause.clone());
            }
        }
        if exits.iter().all(Option::is_some) {
            break;
        }
        if kill_at.is_some_and(|t| Instant::now() >= t) {
            for (local, child) in children.iter_mut().enumerate() {
                if exits[local].is_none() {
                    let _ = child.kill();
                    if let Ok(status) = child.wait() {
                        let exit = RankExit {
                            rank: rank_of(local),
                            local_rank: local,
                            pid: child.id(),
                            status,
                            killed_by_launcher: true,
                        };
                        note(&exit.to_string());
                        exits[local] = Some(exit);
                    }
                }
            }
            continue;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    // Let the last lines through; a grandchild holding a pipe open must not hold us forever.
    let until = Instant::now() + Duration::from_secs(2);
    for _ in 0..forwarders {
        if rx
            .recv_timeout(until.saturating_duration_since(Instant::now()))
            .is_err()
        {
            break;
        }
    }
    Ok(LaunchReport {
        ranks: exits.into_iter().map(Option::unwrap).collect(),
        first_failure,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn strs(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn strips_flags_with_values_and_bare_flags() {
        let args = strs(&[
            "--config",
            "a.toml",
            "--nproc-per-node",
            "4",
            "--gpu-ids=1,2",
            "--standalone",
            "--set",
            "x=1",
            "--master-port=9",
            "--",
            "--nproc-per-node",
            "2",
        ]);
        let out = strip_launcher_args(
            &args,
            &["--nproc-per-node", "--gpu-ids", "--master-port"],
            &["--standalone"],
        );
        assert_eq!(
            out,
            strs(&[
                "--config",
                "a.toml",
                "--set",
                "x=1",
                "--",
                "--nproc-per-node",
                "2"
            ])
        );
        // A value flag at the end without its value.
        assert_eq!(
            strip_launcher_args(&strs(&["a", "--nnodes"]), &["--nnodes"], &[]),
            strs(&["a"])
        );
        // Prefixes of a flag are not the flag.
        assert_eq!(
            strip_launcher_args(&strs(&["--nnodes-x=1"]), &["--nnodes"], &[]),
            strs(&["--nnodes-x=1"])
        );
    }

    #[test]
    fn rank_env_numbers_ranks_and_maps_gpus() {
        let spec = LaunchSpec {
            nproc_per_node: 2,
            nnodes: 3,
            node_rank: 1,
            master_addr: "node0".into(),
            master_port: 4000,
            gpu_ids: Some(vec![3, 1]),
            program: "x".into(),
            env: vec![("NCCL_NVLS_ENABLE".into(), "1".into())],
            ..Default::default()
        };
        spec.validate().unwrap();
        let env: std::collections::HashMap<_, _> =
            spec.rank_env(1, None).unwrap().into_iter().collect();
        assert_eq!(env["RANK"], "3");
        assert_eq!(env["WORLD_SIZE"], "6");
        assert_eq!(env["LOCAL_RANK"], "1");
        assert_eq!(env["LOCAL_WORLD_SIZE"], "2");
        assert_eq!(env["NODE_RANK"], "1");
        assert_eq!(env["GROUP_RANK"], "1");
        assert_eq!(env["MASTER_ADDR"], "node0");
        assert_eq!(env["MASTER_PORT"], "4000");
        assert_eq!(env["FLEET_LAUNCHER"], "1");
        assert_eq!(env["NCCL_NVLS_ENABLE"], "0");
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "1");
        // The child reads them back as the same world.
        let w = crate::World::from_env_map(&env).unwrap().unwrap();
        assert_eq!((w.rank, w.world_size, w.node_rank, w.nnodes), (3, 6, 1, 3));
        assert_eq!(w.launcher, crate::Launcher::Fleet);
        // Through the parent's CUDA_VISIBLE_DEVICES.
        let env: std::collections::HashMap<_, _> = spec
            .rank_env(0, Some("4,5,6,7"))
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "7");
        let e = spec.rank_env(0, Some("0,1")).unwrap_err().to_string();
        assert!(
            e.contains("needs GPU 3") && e.contains("CUDA_VISIBLE_DEVICES=`0,1`"),
            "{e}"
        );
        let default_gpus = LaunchSpec {
            nproc_per_node: 2,
            program: "x".into(),
            ..Default::default()
        };
        let env: std::collections::HashMap<_, _> = default_gpus
            .rank_env(1, None)
            .unwrap()
            .into_iter()
            .collect();
        assert_eq!(env["CUDA_VISIBLE_DEVICES"], "1");
    }

    #[test]
    fn invalid_specs_name_the_field() {
        let ok = LaunchSpec {
            nproc_per_node: 2,
            program: "x".into(),
            ..Default::default()
        };
        let e = |s: LaunchSpec| s.validate().unwrap_err().to_string();
        let msg = e(LaunchSpec {
            gpu_ids: Some(vec![0]),
            ..ok.clone()
        });
        assert!(
            msg.contains("gpu_ids")
                && msg.contains("lists 1 GPUs")
                && msg.contains("nproc_per_node = 2"),
            "{msg}"
        );
        let msg = e(LaunchSpec {
            gpu_ids: Some(vec![1, 1]),
            ..ok.clone()
        });
        assert!(msg.contains("GPU 1 twice"), "{msg}");
        let msg = e(LaunchSpec {
            node_rank: 1,
            ..ok.clone()
        });
        assert!(
            msg.contains("node_rank = 1 is not below nnodes = 1"),
            "{msg}"
        );
        let msg = e(LaunchSpec {
            nproc_per_node: 0,
            ..ok.clone()
        });
        assert!(msg.contains("nproc_per_node"), "{msg}");
        let msg = e(LaunchSpec {
            program: PathBuf::new(),
            ..ok
        });
        assert!(msg.contains("program"), "{msg}");
    }

    #[test]
    fn free_ports_are_nonzero() {
        assert_ne!(pick_free_port().unwrap(), 0);
    }
}
