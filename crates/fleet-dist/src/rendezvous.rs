//! The TCP rendezvous: every rank meets rank 0, which checks that all run the same config and
//! commit and hands out the NCCL unique id.
//!
//! Rank 0 listens on `0.0.0.0:master_port` (`[::]` when `master_addr` is an IPv6 literal).
//! Every other rank connects to `master_addr:master_port`, retrying until the timeout (rank 0
//! may start later), and says hello: rank, world size, config fingerprint and description, host
//! and pid. Rank 0 waits for every rank; a rank that does not arrive within the timeout is named
//! in the error. A duplicate rank, another world size or another fingerprint is refused: rank 0
//! fails, and every rank that arrives (the offender included) fails with the same message,
//! which names the rank and both descriptions. Then rank 0 sends its payload to every rank and
//! the heartbeat starts ([`crate::Group`]).

use std::collections::BTreeSet;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::time::{Duration, Instant};

use crate::group::{Group, PeerInfo, Timing};
use crate::wire::{self, tag, Header, MAGIC};
use crate::{DistError, Result, World};

/// Failure timeout in seconds (decimals allowed), read by
/// [`RendezvousOptions::with_env_overrides`].
pub const TIMEOUT_ENV: &str = "FLEET_DIST_TIMEOUT";
/// Rendezvous timeout in seconds, read by [`RendezvousOptions::with_env_overrides`].
pub const RENDEZVOUS_TIMEOUT_ENV: &str = "FLEET_DIST_RENDEZVOUS_TIMEOUT";
/// How long rank 0 waits for every rank to arrive, by default.
pub const DEFAULT_RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(300);
/// How often ranks beat, by default.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// How long a silent or absent peer is tolerated, by default.
pub const DEFAULT_FAILURE_TIMEOUT: Duration = Duration::from_secs(180);

/// Settings of the rendezvous and of the failure detection after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RendezvousOptions {
    /// Digest of everything that must match on all ranks (config, commit); compared byte for
    /// byte with rank 0's.
    pub fingerprint: String,
    /// Human summary of the same (e.g. `commit 1a2b3c, config 9f8e...`), shown when the
    /// fingerprints differ.
    pub describe: String,
    /// How long rank 0 waits for every rank, and other ranks try to reach rank 0.
    pub timeout: Duration,
    /// How often ranks send heartbeats.
    pub heartbeat_interval: Duration,
    /// A peer silent for this long, or a collective contribution this late, is a failure.
    pub failure_timeout: Duration,
}

impl Default for RendezvousOptions {
    fn default() -> Self {
        RendezvousOptions {
            fingerprint: String::new(),
            describe: String::new(),
            timeout: DEFAULT_RENDEZVOUS_TIMEOUT,
            heartbeat_interval: DEFAULT_HEARTBEAT_INTERVAL,
            failure_timeout: DEFAULT_FAILURE_TIMEOUT,
        }
    }
}

impl RendezvousOptions {
    /// Default timings with this fingerprint and description.
    pub fn new(fingerprint: impl Into<String>, describe: impl Into<String>) -> Self {
        RendezvousOptions {
            fingerprint: fingerprint.into(),
            describe: describe.into(),
            ..Default::default()
        }
    }

    /// Applies [`TIMEOUT_ENV`] (`FLEET_DIST_TIMEOUT`, the failure timeout) and
    /// [`RENDEZVOUS_TIMEOUT_ENV`] (`FLEET_DIST_RENDEZVOUS_TIMEOUT`) from the process
    /// environment, in seconds; unset or empty leaves the value.
    pub fn with_env_overrides(self) -> Result<Self> {
        self.with_env_overrides_from(&|v| std::env::var(v).ok())
    }

    /// [`RendezvousOptions::with_env_overrides`] with a lookup function (for tests).
    pub fn with_env_overrides_from(mut self, env: &dyn Fn(&str) -> Option<String>) -> Result<Self> {
        let secs = |var: &str| -> Result<Option<Duration>> {
            let Some(v) = env(var).filter(|v| !v.trim().is_empty()) else {
                return Ok(None);
            };
            match v.trim().parse::<f64>() {
                Ok(s) if s.is_finite() && s > 0.0 && s < 1e9 => {
                    Ok(Some(Duration::from_secs_f64(s)))
                }
                _ => Err(DistError::BadEnvValue {
                    var: var.into(),
                    value: v,
                    expected: "a positive number of seconds".into(),
                }),
            }
        };
        if let Some(d) = secs(TIMEOUT_ENV)? {
            self.failure_timeout = d;
        }
        if let Some(d) = secs(RENDEZVOUS_TIMEOUT_ENV)? {
            self.timeout = d;
        }
        Ok(self)
    }

    /// Timeouts positive; the failure timeout at least twice the heartbeat interval (a beat
    /// late by one interval must not count as a failure).
    pub fn validate(&self) -> Result<()> {
        let bad =
            |field: &'static str, problem: String| Err(DistError::BadOption { field, problem });
        if self.timeout.is_zero() {
            return bad(
                "RendezvousOptions::timeout",
                "is 0: give rank 0 time to start and every rank time to arrive (default 300 s)"
                    .into(),
            );
        }
        if self.heartbeat_interval.is_zero() {
            return bad(
                "RendezvousOptions::heartbeat_interval",
                "is 0: use a positive interval (default 1 s)".into(),
            );
        }
        if self.failure_timeout < self.heartbeat_interval * 2 {
            return bad(
                "RendezvousOptions::failure_timeout",
                format!(
                    "{} is less than twice heartbeat_interval {}: raise it ({} or the option) or beat more often",
                    wire::secs(self.failure_timeout),
                    wire::secs(self.heartbeat_interval),
                    TIMEOUT_ENV
                ),
            );
        }
        Ok(())
    }
}

/// Why a rendezvous failed; rank 0 sends it to every rank that arrived, so all fail with the
/// same message.
#[derive(Debug, Clone, PartialEq, thiserror::Error, serde::Serialize, serde::Deserialize)]
pub enum RendezvousFault {
    /// Ranks that did not arrive in time.
    #[error("{} of {world_size} did not arrive at rank 0 ({addr}:{port}) within {waited_secs:.1} s: check that they started (their logs), that they reach MASTER_ADDR:MASTER_PORT, and that they all use the same world size; or raise the rendezvous timeout ({})", ranks_phrase(missing), RENDEZVOUS_TIMEOUT_ENV)]
    Missing {
        /// The absent ranks.
        missing: Vec<usize>,
        /// Number of ranks expected.
        world_size: usize,
        /// Rank 0's address as the ranks were told.
        addr: String,
        /// Rank 0's port.
        port: u16,
        /// How long rank 0 waited.
        waited_secs: f64,
    },
    /// A rank with another config or commit.
    #[error("rank {rank} (host {host}, pid {pid}) runs another config or commit than rank 0: rank {rank} has `{theirs}` (fingerprint {theirs_fingerprint}), rank 0 has `{ours}` (fingerprint {ours_fingerprint}); start every rank from the same commit with the same config")]
    ConfigMismatch {
        /// The rank that differs.
        rank: usize,
        /// Its host.
        host: String,
        /// Its pid.
        pid: u32,
        /// Its description.
        theirs: String,
        /// Its fingerprint.
        theirs_fingerprint: String,
        /// Rank 0's description.
        ours: String,
        /// Rank 0's fingerprint.
        ours_fingerprint: String,
    },
    /// A rank started with another world size.
    #[error("rank {rank} (host {host}, pid {pid}) was started with a world size of {theirs} but rank 0 with {ours}: give every node the same --nnodes and --nproc-per-node (WORLD_SIZE)")]
    WorldSizeMismatch {
        /// The rank that differs.
        rank: usize,
        /// Its host.
        host: String,
        /// Its pid.
        pid: u32,
        /// Its world size.
        theirs: usize,
        /// Rank 0's world size.
        ours: usize,
    },
    /// Two processes claim the same rank.
    #[error("rank {rank} was claimed twice, by host {first_host} pid {first_pid} and by host {second_host} pid {second_pid}: each process needs its own rank (check --node-rank / NODE_RANK on every node, and that no old run is still alive)")]
    DuplicateRank {
        /// The rank.
        rank: usize,
        /// First claimant's host.
        first_host: String,
        /// First claimant's pid.
        first_pid: u32,
        /// Second claimant's host.
        second_host: String,
        /// Second claimant's pid.
        second_pid: u32,
    },
    /// A process that arrived after every rank had joined.
    #[error("host {host} pid {pid} tried to join as rank {rank} after all {world_size} ranks had joined (rank {rank} is host {holder_host} pid {holder_pid}): each process needs its own rank; is an old run or a second launcher still alive?")]
    AlreadyComplete {
        /// The rank claimed.
        rank: usize,
        /// The world size of the running job.
        world_size: usize,
        /// The latecomer's host.
        host: String,
        /// The latecomer's pid.
        pid: u32,
        /// Host of the process that holds the rank (empty when the rank is out of range).
        holder_host: String,
        /// Pid of the process that holds the rank (0 when the rank is out of range).
        holder_pid: u32,
    },
    /// Rank 0 itself claimed by another process, or a rank beyond the world.
    #[error("host {host} pid {pid} says it is rank {rank} of {world_size}, which rank 0 cannot accept: ranks other than 0 must be in 1..{world_size}")]
    BadRank {
        /// The rank claimed.
        rank: usize,
        /// The world size it claimed.
        world_size: usize,
        /// Its host.
        host: String,
        /// Its pid.
        pid: u32,
    },
}

fn ranks_phrase(ranks: &[usize]) -> String {
    let list: Vec<String> = ranks.iter().map(|r| r.to_string()).collect();
    match ranks.len() {
        1 => format!("rank {}", list[0]),
        n if n <= 16 => format!("ranks {}", list.join(", ")),
        n => format!("{n} ranks ({}, ...)", list[..16].join(", ")),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
enum Channel {
    Collective,
    Heartbeat,
}

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Hello {
    channel: Channel,
    rank: usize,
    world_size: usize,
    fingerprint: String,
    describe: String,
    host: String,
    pid: u32,
    /// Pairs the two connections of one process.
    nonce: u64,
}

impl Hello {
    fn info(&self) -> PeerInfo {
        PeerInfo {
            rank: self.rank,
            host: self.host.clone(),
            pid: self.pid,
        }
    }
}

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Welcome {
    peers: Vec<PeerInfo>,
}

/// Meets the other ranks of `world` (see the module docs) and returns the [`Group`] with its
/// collectives and heartbeat running. Rank 0 passes `root_payload` (the NCCL unique id); the
/// others pass `None` (ignored otherwise). A world of one returns at once, without the network.
pub fn rendezvous(
    world: &World,
    opts: &RendezvousOptions,
    root_payload: Option<Vec<u8>>,
) -> Result<Group> {
    world.validate()?;
    opts.validate()?;
    let me = PeerInfo {
        rank: world.rank,
        host: wire::hostname(),
        pid: std::process::id(),
    };
    let timing = Timing {
        heartbeat_interval: opts.heartbeat_interval,
        failure_timeout: opts.failure_timeout,
    };
    if world.world_size == 1 {
        return Ok(Group::solo(
            world.clone(),
            root_payload.unwrap_or_default(),
            me,
        ));
    }
    if world.rank == 0 {
        serve(world, opts, me, root_payload.unwrap_or_default(), timing)
    } else {
        join(world, opts, me, timing)
    }
}

fn bind_addr(world: &World) -> SocketAddr {
    let ip = match world.master_addr.trim_matches(['[', ']']).parse::<IpAddr>() {
        Ok(IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        _ => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
    };
    SocketAddr::new(ip, world.master_port)
}

struct Arrival {
    stream: TcpStream,
    hello: Hello,
}

/// Rank 0.
fn serve(
    world: &World,
    opts: &RendezvousOptions,
    me: PeerInfo,
    payload: Vec<u8>,
    timing: Timing,
) -> Result<Group> {
    let n = world.world_size;
    let addr = bind_addr(world);
    let listener = TcpListener::bind(addr).map_err(|source| DistError::Listen {
        addr: addr.to_string(),
        port: world.master_port,
        source,
    })?;
    listener
        .set_nonblocking(true)
        .map_err(|source| DistError::Listen {
            addr: addr.to_string(),
            port: world.master_port,
            source,
        })?;
    tracing::info!("rank 0 waits for {} ranks on {addr}", n - 1);
    let start = Instant::now();
    let deadline = start + opts.timeout;
    let mut mains: Vec<Option<Arrival>> = (0..n).map(|_| None).collect();
    let mut hbs: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut seen: BTreeSet<usize> = BTreeSet::new();
    let mut fault: Option<RendezvousFault> = None;
    let mut refused: Vec<TcpStream> = Vec::new();

    let complete = |mains: &[Option<Arrival>], hbs: &[Option<TcpStream>]| {
        (1..n).all(|r| mains[r].is_some() && hbs[r].is_some())
    };
    loop {
        if fault.is_none() && complete(&mains, &hbs) {
            break;
        }
        if fault.is_some() && (1..n).all(|r| seen.contains(&r)) {
            break;
        }
        if Instant::now() >= deadline {
            break;
        }
        let (stream, from) = match listener.accept() {
            Ok(x) => x,
            Err(e)
                if e.kind() == io::ErrorKind::WouldBlock
                    || e.kind() == io::ErrorKind::Interrupted =>
            {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(e) => {
                tracing::warn!("rank 0: accept failed: {e}");
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
        };
        let Some(hello) = read_hello(&stream) else {
            tracing::warn!(
                "rank 0: ignored a connection from {from} that did not speak fleet-dist"
            );
            continue;
        };
        match hello.channel {
            Channel::Collective => {
                let r = hello.rank;
                let check = check_hello(world, opts, &hello, &mains);
                if r > 0 && r < n {
                    seen.insert(r);
                }
                let mut stream = stream;
                if let Some(f) = check {
                    let _ = wire::write_json(&mut stream, tag::REJECT, &f);
                    refused.push(stream);
                    if fault.is_none() {
                        for a in mains.iter_mut().flatten() {
                            let _ = wire::write_json(&mut a.stream, tag::REJECT, &f);
                        }
                        fault = Some(f);
                    }
                } else if let Some(f) = &fault {
                    let _ = wire::write_json(&mut stream, tag::REJECT, f);
                    refused.push(stream);
                } else {
                    mains[r] = Some(Arrival { stream, hello });
                }
            }
            Channel::Heartbeat => {
                let r = hello.rank;
                let pairs = r < n
                    && mains[r]
                        .as_ref()
                        .is_some_and(|a| a.hello.nonce == hello.nonce);
                if pairs && hbs[r].is_none() {
                    hbs[r] = Some(stream);
                } else {
                    tracing::warn!(
                        "rank 0: ignored a heartbeat connection claiming rank {r} from {from}"
                    );
                }
            }
        }
    }
    let waited = start.elapsed();
    let fault = fault.or_else(|| {
        let missing: Vec<usize> = (1..n)
            .filter(|&r| mains[r].is_none() || hbs[r].is_none())
            .collect();
        (!missing.is_empty()).then(|| RendezvousFault::Missing {
            missing,
            world_size: n,
            addr: world.master_addr.clone(),
            port: world.master_port,
            waited_secs: waited.as_secs_f64(),
        })
    });
    if let Some(f) = fault {
        for a in mains.iter_mut().flatten() {
            let _ = wire::write_json(&mut a.stream, tag::REJECT, &f);
        }
        // Let the refusals leave before the sockets close.
        for s in mains.iter().flatten().map(|a| &a.stream).chain(&refused) {
            let _ = s.shutdown(std::net::Shutdown::Write);
        }
        return Err(DistError::from(f));
    }

    let mut peers = vec![me];
    peers.extend(
        mains
            .iter()
            .skip(1)
            .map(|a| a.as_ref().unwrap().hello.info()),
    );
    let welcome = Welcome {
        peers: peers.clone(),
    };
    let mut main_streams: Vec<Option<TcpStream>> = vec![None];
    for (r, a) in mains.into_iter().enumerate().skip(1) {
        let mut a = a.unwrap();
        let sent = a
            .stream
            .set_write_timeout(Some(opts.failure_timeout))
            .and_then(|_| wire::write_json(&mut a.stream, tag::WELCOME, &welcome))
            .and_then(|_| {
                wire::write_frame(
                    &mut a.stream,
                    Header::new(tag::DATA, 0, 0, payload.len() as u64),
                    &payload,
                )
            });
        if let Err(e) = sent {
            return Err(DistError::RendezvousLost {
                rank: 0,
                peer: format!("rank {r} (host {}, pid {})", a.hello.host, a.hello.pid),
                problem: format!("could not send it the welcome: {e}"),
            });
        }
        main_streams.push(Some(a.stream));
    }
    tracing::info!("rendezvous of {n} ranks done in {}", wire::secs(waited));
    let group = Group::start(
        world.clone(),
        peers.clone(),
        payload,
        main_streams,
        hbs,
        timing,
    )
    .map_err(|e| DistError::RendezvousLost {
        rank: 0,
        peer: "the heartbeat".into(),
        problem: format!("could not start its threads: {e}"),
    })?;
    refuse_latecomers(listener, peers, group.running_flag());
    Ok(group)
}

/// Keeps the port while the group runs and refuses every process that still tries to join
/// (a duplicate rank that came late, an old run), so it fails with a message instead of
/// retrying until its timeout.
fn refuse_latecomers(
    listener: TcpListener,
    peers: Vec<PeerInfo>,
    running: impl Fn() -> bool + Send + 'static,
) {
    let spawned = std::thread::Builder::new()
        .name("fleet-dist-door".into())
        .spawn(move || {
            while running() {
                match listener.accept() {
                    Ok((stream, from)) => {
                        let Some(hello) = read_hello(&stream) else {
                            continue;
                        };
                        if hello.channel != Channel::Collective {
                            continue;
                        }
                        let holder = peers.get(hello.rank);
                        let fault = RendezvousFault::AlreadyComplete {
                            rank: hello.rank,
                            world_size: peers.len(),
                            host: hello.host.clone(),
                            pid: hello.pid,
                            holder_host: holder.map_or(String::new(), |p| p.host.clone()),
                            holder_pid: holder.map_or(0, |p| p.pid),
                        };
                        tracing::warn!("rank 0 refused {from}: {fault}");
                        let mut stream = stream;
                        let _ = wire::write_json(&mut stream, tag::REJECT, &fault);
                        let _ = stream.shutdown(std::net::Shutdown::Write);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
    if let Err(e) = spawned {
        tracing::warn!("rank 0 cannot keep the rendezvous port to refuse latecomers: {e}");
    }
}

/// The first frame of a new connection: the magic, then a hello (5 s at most).
fn read_hello(stream: &TcpStream) -> Option<Hello> {
    let mut s = stream;
    s.set_nonblocking(false).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    let mut magic = [0u8; 8];
    s.read_exact(&mut magic).ok()?;
    if &magic != MAGIC {
        return None;
    }
    let h = wire::read_header(&mut s).ok()?;
    if h.tag != tag::HELLO {
        return None;
    }
    wire::read_json(&mut s, h).ok()
}

fn check_hello(
    world: &World,
    opts: &RendezvousOptions,
    h: &Hello,
    mains: &[Option<Arrival>],
) -> Option<RendezvousFault> {
    if h.world_size != world.world_size {
        return Some(RendezvousFault::WorldSizeMismatch {
            rank: h.rank,
            host: h.host.clone(),
            pid: h.pid,
            theirs: h.world_size,
            ours: world.world_size,
        });
    }
    if h.rank == 0 || h.rank >= world.world_size {
        return Some(RendezvousFault::BadRank {
            rank: h.rank,
            world_size: h.world_size,
            host: h.host.clone(),
            pid: h.pid,
        });
    }
    if let Some(first) = &mains[h.rank] {
        return Some(RendezvousFault::DuplicateRank {
            rank: h.rank,
            first_host: first.hello.host.clone(),
            first_pid: first.hello.pid,
            second_host: h.host.clone(),
            second_pid: h.pid,
        });
    }
    if h.fingerprint != opts.fingerprint {
        return Some(RendezvousFault::ConfigMismatch {
            rank: h.rank,
            host: h.host.clone(),
            pid: h.pid,
            theirs: h.describe.clone(),
            theirs_fingerprint: h.fingerprint.clone(),
            ours: opts.describe.clone(),
            ours_fingerprint: opts.fingerprint.clone(),
        });
    }
    None
}

/// Connects to rank 0, retrying until `deadline`.
fn connect(world: &World, deadline: Instant, started: Instant) -> Result<TcpStream> {
    let mut backoff = Duration::from_millis(20);
    let mut last_error = String::from("no attempt");
    loop {
        match (world.master_addr.as_str(), world.master_port).to_socket_addrs() {
            Ok(addrs) => {
                for addr in addrs {
                    let left = deadline.saturating_duration_since(Instant::now());
                    let attempt = left.clamp(Duration::from_millis(100), Duration::from_secs(5));
                    match TcpStream::connect_timeout(&addr, attempt) {
                        Ok(s) => return Ok(s),
                        Err(e) => last_error = format!("{addr}: {e}"),
                    }
                }
            }
            Err(e) => last_error = format!("cannot resolve `{}`: {e}", world.master_addr),
        }
        if Instant::now() >= deadline {
            return Err(DistError::Connect {
                rank: world.rank,
                addr: world.master_addr.clone(),
                port: world.master_port,
                waited_secs: started.elapsed().as_secs_f64(),
                last_error,
            });
        }
        std::thread::sleep(backoff.min(deadline.saturating_duration_since(Instant::now())));
        backoff = (backoff * 2).min(Duration::from_millis(500));
    }
}

fn send_hello(s: &mut TcpStream, hello: &Hello) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.write_all(MAGIC)?;
    wire::write_json(s, tag::HELLO, hello)
}

/// Ranks other than 0.
fn join(world: &World, opts: &RendezvousOptions, me: PeerInfo, timing: Timing) -> Result<Group> {
    let started = Instant::now();
    let deadline = started + opts.timeout;
    let nonce = (u64::from(me.pid) << 32)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    let mut hello = Hello {
        channel: Channel::Collective,
        rank: world.rank,
        world_size: world.world_size,
        fingerprint: opts.fingerprint.clone(),
        describe: opts.describe.clone(),
        host: me.host.clone(),
        pid: me.pid,
        nonce,
    };
    let lost = |problem: String| DistError::RendezvousLost {
        rank: world.rank,
        peer: format!("rank 0 at {}:{}", world.master_addr, world.master_port),
        problem,
    };
    let mut main = connect(world, deadline, started)?;
    send_hello(&mut main, &hello).map_err(|e| lost(format!("could not say hello: {e}")))?;
    hello.channel = Channel::Heartbeat;
    let mut hb = connect(
        world,
        deadline.max(Instant::now() + Duration::from_secs(10)),
        started,
    )?;
    send_hello(&mut hb, &hello).map_err(|e| {
        lost(format!(
            "could not say hello on the heartbeat connection: {e}"
        ))
    })?;

    // Rank 0 answers when every rank has arrived, or refuses at its own deadline, which falls
    // within `timeout` of our connecting.
    let wait = opts.timeout + Duration::from_secs(10);
    main.set_read_timeout(Some(wait))
        .map_err(|e| lost(e.to_string()))?;
    let read_err = |e: io::Error| {
        if wire::is_timeout(&e) {
            lost(format!(
                "no answer within {} (is another program listening on that port?)",
                wire::secs(wait)
            ))
        } else if wire::is_closed(&e) {
            lost(
                "rank 0 closed the connection during the rendezvous (see rank 0's log for why)"
                    .into(),
            )
        } else {
            lost(e.to_string())
        }
    };
    let h = wire::read_header(&mut main).map_err(read_err)?;
    match h.tag {
        tag::WELCOME => {}
        tag::REJECT => {
            let fault: RendezvousFault = wire::read_json(&mut main, h).map_err(read_err)?;
            return Err(DistError::from(fault));
        }
        other => return Err(lost(format!("unexpected answer (frame tag {other})"))),
    }
    let welcome: Welcome = wire::read_json(&mut main, h).map_err(read_err)?;
    let h = wire::read_header(&mut main).map_err(read_err)?;
    if h.tag != tag::DATA {
        return Err(lost(format!(
            "unexpected frame tag {} instead of the root payload",
            h.tag
        )));
    }
    let payload = wire::read_payload(&mut main, h.len, u64::MAX).map_err(read_err)?;
    if welcome.peers.len() != world.world_size {
        return Err(lost(format!(
            "rank 0 lists {} ranks, this rank expects {}",
            welcome.peers.len(),
            world.world_size
        )));
    }
    Group::start(
        world.clone(),
        welcome.peers,
        payload,
        vec![Some(main)],
        vec![Some(hb)],
        timing,
    )
    .map_err(|e| lost(format!("could not start the heartbeat: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_overrides_and_validation() {
        let env = |pairs: &'static [(&'static str, &'static str)]| {
            move |k: &str| {
                pairs
                    .iter()
                    .find(|(n, _)| *n == k)
                    .map(|(_, v)| v.to_string())
            }
        };
        let o = RendezvousOptions::new("fp", "d")
            .with_env_overrides_from(&env(&[(TIMEOUT_ENV, "2.5"), (RENDEZVOUS_TIMEOUT_ENV, "7")]))
            .unwrap();
        assert_eq!(o.failure_timeout, Duration::from_millis(2500));
        assert_eq!(o.timeout, Duration::from_secs(7));
        o.validate().unwrap();
        let e = RendezvousOptions::default()
            .with_env_overrides_from(&env(&[(TIMEOUT_ENV, "soon")]))
            .unwrap_err()
            .to_string();
        assert!(e.contains("FLEET_DIST_TIMEOUT=`soon`"), "{e}");
        let mut o = RendezvousOptions::default();
        assert_eq!(o.failure_timeout, Duration::from_secs(180));
        o.failure_timeout = Duration::from_millis(1500);
        let e = o.validate().unwrap_err().to_string();
        assert!(
            e.contains("failure_timeout") && e.contains("heartbeat_interval"),
            "{e}"
        );
    }

    #[test]
    fn faults_name_the_ranks() {
        let f = RendezvousFault::Missing {
            missing: vec![2],
            world_size: 3,
            addr: "h".into(),
            port: 1,
            waited_secs: 2.0,
        };
        assert!(
            f.to_string().starts_with("rank 2 of 3 did not arrive"),
            "{f}"
        );
        let f = RendezvousFault::Missing {
            missing: vec![1, 3],
            world_size: 4,
            addr: "h".into(),
            port: 1,
            waited_secs: 2.0,
        };
        assert!(f.to_string().starts_with("ranks 1, 3 of 4"), "{f}");
    }
}
