//! The ranks after the rendezvous: TCP collectives in a star around rank 0, and failure
//! detection by heartbeat.
//!
//! Every rank other than 0 holds two connections to rank 0, made by [`crate::rendezvous()`]:
//!
//! - the **collective** connection. Rank 0 reads the contributions in rank order, combines them
//!   (sums in rank order, so every rank gets bitwise the same result whatever the arrival order)
//!   and sends the result back. Buffers stream through 64 KiB chunks.
//! - the **heartbeat** connection, served by background threads, so a rank blocked in NCCL or a
//!   long computation is still watched. Beats go both ways every `heartbeat_interval`. Rank 0
//!   declares a peer failed when its connection closes without a goodbye or no beat arrives
//!   within `failure_timeout`, tells every other rank, and fails itself; a rank that loses rank 0
//!   fails naming rank 0.
//!
//! "Fails" calls the handler set by [`Group::on_failure`]; the default prints
//! `error: rank K (host H, pid P) ...: exiting` and exits with [`FAILURE_EXIT_CODE`] — exiting is
//! the only way out of a thread blocked inside NCCL. A collective that sees a peer go away, or
//! waits more than `failure_timeout` for a contribution, fails the same way (after the handler
//! returns, it returns [`DistError::PeerFailed`]).
//!
//! A clean end: [`Group::finish`] on every rank. Ranks other than 0 say goodbye and stop
//! watching; rank 0 waits until every rank has said goodbye (still watching them). Dropping a
//! group without `finish` closes its connections, which its peers report as a failure — the
//! right outcome when a rank leaves through an error — except on rank 0 once every other rank has
//! said goodbye.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::wire::{self, tag, Header};
use crate::{DistError, Result, World};

/// Exit status of a rank that the default failure handler ends (`EX_TEMPFAIL`).
pub const FAILURE_EXIT_CODE: i32 = 75;

/// Bytes per chunk when streaming collective buffers.
const CHUNK: usize = 64 * 1024;

/// What a failure handler gets: [`Group::on_failure`].
pub type FailureHandler = Box<dyn Fn(&PeerFailure) + Send + Sync>;

type SharedHandler = Arc<dyn Fn(&PeerFailure) + Send + Sync>;

/// One rank of the group, as it introduced itself at the rendezvous.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerInfo {
    /// Global rank.
    pub rank: usize,
    /// Host name of its machine.
    pub host: String,
    /// Process id on that machine.
    pub pid: u32,
}

/// A rank that died, stalled or broke the protocol.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PeerFailure {
    /// The rank at fault.
    pub rank: usize,
    /// Its host.
    pub host: String,
    /// Its process id.
    pub pid: u32,
    /// What happened, e.g. `exited: its connection closed without a goodbye (seen by rank 0)`.
    pub reason: String,
}

impl PeerFailure {
    fn of(peer: &PeerInfo, reason: String) -> Self {
        PeerFailure {
            rank: peer.rank,
            host: peer.host.clone(),
            pid: peer.pid,
            reason,
        }
    }
}

impl std::fmt::Display for PeerFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "rank {} (host {}, pid {}) {}",
            self.rank, self.host, self.pid, self.reason
        )
    }
}

/// Timing of the heartbeat, from [`crate::RendezvousOptions`].
#[derive(Debug, Clone, Copy)]
pub(crate) struct Timing {
    pub heartbeat_interval: Duration,
    pub failure_timeout: Duration,
}

struct State {
    /// Rank 0: which peers said goodbye. Others: index 0 = rank 0.
    done: Vec<bool>,
    failure: Option<PeerFailure>,
    /// This rank is finishing or dropped its group: errors are no failures any more.
    closing: bool,
    /// The handler has returned for `failure`.
    handled: bool,
}

struct Inner {
    rank: usize,
    peers: Vec<PeerInfo>,
    timing: Timing,
    state: Mutex<State>,
    cv: Condvar,
    handler: Mutex<SharedHandler>,
    /// Heartbeat writers by rank (rank 0: every peer; others: index 0).
    hb_out: Vec<Option<Mutex<TcpStream>>>,
    /// Clones of every connection, to shut them down from any thread.
    shut: Vec<TcpStream>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl Inner {
    fn timeout_hint(&self) -> String {
        format!(
            "the failure timeout is {}: raise it with {} or RendezvousOptions::failure_timeout if ranks may legitimately be this far apart",
            wire::secs(self.timing.failure_timeout),
            crate::rendezvous::TIMEOUT_ENV
        )
    }

    /// Records a failure, tells the other ranks (rank 0), runs the handler, then shuts every
    /// connection so a collective blocked on one returns. Only the first failure counts.
    fn fail(&self, pf: PeerFailure) {
        {
            let mut st = lock(&self.state);
            if st.closing || st.failure.is_some() {
                return;
            }
            st.failure = Some(pf.clone());
            self.cv.notify_all();
        }
        tracing::error!(rank = self.rank, "{pf}");
        if self.rank == 0 {
            let done = lock(&self.state).done.clone();
            for (r, out) in self.hb_out.iter().enumerate() {
                if let Some(out) = out {
                    // The culprit too: alive but out of step, it learns why.
                    if !done[r] {
                        let mut s = lock(out);
                        let _ = s.set_write_timeout(Some(Duration::from_secs(2)));
                        let _ = wire::write_json(&mut *s, tag::FAIL, &pf);
                    }
                }
            }
        }
        let handler = lock(&self.handler).clone();
        handler(&pf);
        {
            let mut st = lock(&self.state);
            st.handled = true;
            self.cv.notify_all();
        }
        for s in &self.shut {
            let _ = s.shutdown(Shutdown::Both);
        }
    }

    fn failure(&self) -> Option<PeerFailure> {
        lock(&self.state).failure.clone()
    }

    /// The failure, once its handler has returned: a collective must not return before the
    /// handler (by default, `exit`) has run on another thread.
    fn failure_handled(&self) -> Option<PeerFailure> {
        let st = lock(&self.state);
        st.failure.as_ref()?;
        let st = self
            .cv
            .wait_while(st, |s| !s.handled)
            .unwrap_or_else(|e| e.into_inner());
        st.failure.clone()
    }

    /// Waits up to `d` for a failure to be recorded (by another thread).
    fn wait_failure(&self, d: Duration) -> Option<PeerFailure> {
        let st = lock(&self.state);
        let (st, _) = self
            .cv
            .wait_timeout_while(st, d, |s| s.failure.is_none() && !s.closing)
            .unwrap_or_else(|e| e.into_inner());
        drop(st);
        self.failure_handled()
    }

    fn close_all(&self) {
        {
            let mut st = lock(&self.state);
            st.closing = true;
            self.cv.notify_all();
        }
        for s in &self.shut {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// Beats to every watched peer every `heartbeat_interval`.
fn sender(inner: Arc<Inner>) {
    loop {
        {
            let st = lock(&inner.state);
            let (st, _) = inner
                .cv
                .wait_timeout_while(st, inner.timing.heartbeat_interval, |s| {
                    !s.closing && s.failure.is_none()
                })
                .unwrap_or_else(|e| e.into_inner());
            if st.closing || st.failure.is_some() {
                return;
            }
        }
        let done = lock(&inner.state).done.clone();
        for (r, out) in inner.hb_out.iter().enumerate() {
            if let Some(out) = out {
                if !done[r] {
                    let _ =
                        wire::write_frame(&mut *lock(out), Header::new(tag::BEAT, 0, 0, 0), &[]);
                }
            }
        }
    }
}

/// Watches one peer's heartbeat connection.
fn watcher(inner: Arc<Inner>, peer: usize, mut s: TcpStream) {
    let info = inner.peers[peer].clone();
    let seen_by = if inner.rank == 0 {
        " (seen by rank 0)"
    } else {
        ""
    };
    let _ = s.set_read_timeout(Some(inner.timing.failure_timeout));
    loop {
        let res = wire::read_header(&mut s).and_then(|h| match h.tag {
            tag::BEAT => wire::read_payload(&mut s, h.len, wire::MAX_CONTROL).map(|_| None),
            tag::DONE => Ok(Some(Ok(()))),
            tag::FAIL => wire::read_json::<PeerFailure>(&mut s, h).map(|pf| Some(Err(pf))),
            other => Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("unexpected frame tag {other} on the heartbeat connection"),
            )),
        });
        match res {
            Ok(None) => {}
            Ok(Some(Ok(()))) => {
                let mut st = lock(&inner.state);
                st.done[peer] = true;
                inner.cv.notify_all();
                drop(st);
                let _ = s.shutdown(Shutdown::Both);
                return;
            }
            Ok(Some(Err(pf))) => {
                inner.fail(pf);
                return;
            }
            Err(e) => {
                {
                    let st = lock(&inner.state);
                    if st.closing || st.done[peer] || st.failure.is_some() {
                        return;
                    }
                }
                let reason = if wire::is_timeout(&e) {
                    format!(
                        "stopped responding: no heartbeat for {}{seen_by}; {}",
                        wire::secs(inner.timing.failure_timeout),
                        inner.timeout_hint()
                    )
                } else if wire::is_closed(&e) {
                    format!("exited: its connection closed without a goodbye{seen_by}")
                } else {
                    format!("was lost: heartbeat connection failed ({e}){seen_by}")
                };
                inner.fail(PeerFailure::of(&info, reason));
                return;
            }
        }
    }
}

/// Collective operations, as named in messages and frames.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
enum Op {
    Barrier = 1,
    Broadcast = 2,
    AllGather = 3,
    SumF32 = 4,
    SumF64 = 5,
}

impl Op {
    fn name(code: u8) -> &'static str {
        match code {
            1 => "barrier",
            2 => "broadcast_bytes",
            3 => "all_gather_bytes",
            4 => "all_reduce_sum_f32",
            5 => "all_reduce_sum_f64",
            _ => "an unknown collective",
        }
    }
}

/// Numbers summed by the all-reduces.
trait Elem: Copy + std::ops::Add<Output = Self> {
    const SIZE: usize;
    const OP: Op;
    fn put(self, out: &mut [u8]);
    fn get(b: &[u8]) -> Self;
}

impl Elem for f32 {
    const SIZE: usize = 4;
    const OP: Op = Op::SumF32;
    fn put(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes())
    }
    fn get(b: &[u8]) -> Self {
        f32::from_le_bytes(b.try_into().unwrap())
    }
}

impl Elem for f64 {
    const SIZE: usize = 8;
    const OP: Op = Op::SumF64;
    fn put(self, out: &mut [u8]) {
        out.copy_from_slice(&self.to_le_bytes())
    }
    fn get(b: &[u8]) -> Self {
        f64::from_le_bytes(b.try_into().unwrap())
    }
}

struct Coll {
    /// Collective connections by rank (rank 0: every peer; others: index 0).
    streams: Vec<Option<TcpStream>>,
    seq: u64,
    scratch: Vec<u8>,
    /// Set when a local misuse left the connections in an unknown state.
    broken: Option<String>,
}

/// The ranks of a job after the rendezvous: collectives, the root payload, failure detection.
/// Made by [`crate::rendezvous()`]; `Send + Sync`, collectives may be called from any one thread
/// at a time (calls are serialized).
pub struct Group {
    world: World,
    rank: usize,
    world_size: usize,
    peers: Vec<PeerInfo>,
    payload: Vec<u8>,
    inner: Option<Arc<Inner>>,
    coll: Mutex<Coll>,
    watcher_thread: Mutex<Option<JoinHandle<()>>>,
    finished: AtomicBool,
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Group")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .field("payload_len", &self.payload.len())
            .finish()
    }
}

impl Group {
    /// A world of one: no connections, collectives return their input.
    pub(crate) fn solo(world: World, payload: Vec<u8>, me: PeerInfo) -> Self {
        Group {
            world,
            rank: 0,
            world_size: 1,
            peers: vec![me],
            payload,
            inner: None,
            coll: Mutex::new(Coll {
                streams: vec![None],
                seq: 0,
                scratch: Vec::new(),
                broken: None,
            }),
            watcher_thread: Mutex::new(None),
            finished: AtomicBool::new(false),
        }
    }

    /// Starts the heartbeat threads. `main` and `hb` are indexed by rank: on rank 0 every other
    /// rank's connections, elsewhere index 0 only.
    pub(crate) fn start(
        world: World,
        peers: Vec<PeerInfo>,
        payload: Vec<u8>,
        main: Vec<Option<TcpStream>>,
        hb: Vec<Option<TcpStream>>,
        timing: Timing,
    ) -> io::Result<Self> {
        let rank = world.rank;
        let n = peers.len();
        let mut shut = Vec::new();
        let mut hb_out = Vec::with_capacity(n);
        let mut hb_in = Vec::with_capacity(n);
        for s in main.iter().flatten() {
            s.set_nodelay(true)?;
            let wait = if rank == 0 {
                timing.failure_timeout
            } else {
                // Rank 0 may wait a whole failure_timeout for another rank before it answers.
                timing.failure_timeout * 2 + Duration::from_secs(5)
            };
            s.set_read_timeout(Some(wait))?;
            s.set_write_timeout(Some(wait))?;
            shut.push(s.try_clone()?);
        }
        for s in hb {
            match s {
                Some(s) => {
                    s.set_nodelay(true)?;
                    s.set_write_timeout(Some(timing.failure_timeout))?;
                    shut.push(s.try_clone()?);
                    hb_out.push(Some(Mutex::new(s.try_clone()?)));
                    hb_in.push(Some(s));
                }
                None => {
                    hb_out.push(None);
                    hb_in.push(None);
                }
            }
        }
        let me = peers[rank].clone();
        let default_rank = me.rank;
        let inner = Arc::new(Inner {
            rank,
            peers,
            timing,
            state: Mutex::new(State {
                done: vec![false; n],
                failure: None,
                closing: false,
                handled: false,
            }),
            cv: Condvar::new(),
            handler: Mutex::new(Arc::new(move |pf: &PeerFailure| {
                eprintln!("error: {pf}: exiting (this is rank {default_rank})");
                exit_now(FAILURE_EXIT_CODE);
            })),
            hb_out,
            shut,
        });
        let mut watcher_thread = None;
        for (peer, s) in hb_in.into_iter().enumerate() {
            if let Some(s) = s {
                let inner = inner.clone();
                let h = std::thread::Builder::new()
                    .name(format!("fleet-dist-watch-{peer}"))
                    .spawn(move || watcher(inner, peer, s))?;
                if rank != 0 {
                    watcher_thread = Some(h);
                }
            }
        }
        {
            let inner = inner.clone();
            std::thread::Builder::new()
                .name("fleet-dist-beat".into())
                .spawn(move || sender(inner))?;
        }
        Ok(Group {
            world,
            rank,
            world_size: n,
            peers: inner.peers.clone(),
            payload,
            inner: Some(inner),
            coll: Mutex::new(Coll {
                streams: main,
                seq: 0,
                scratch: Vec::new(),
                broken: None,
            }),
            watcher_thread: Mutex::new(watcher_thread),
            finished: AtomicBool::new(false),
        })
    }

    /// Whether the group is still running (not finished, dropped or failed), for background
    /// helpers of the rendezvous.
    pub(crate) fn running_flag(&self) -> impl Fn() -> bool + Send + 'static {
        let inner = self.inner.clone();
        move || {
            inner.as_ref().is_some_and(|i| {
                let st = lock(&i.state);
                !st.closing && st.failure.is_none()
            })
        }
    }

    /// The world this group was made for.
    pub fn world(&self) -> &World {
        &self.world
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Every rank's host and pid, by rank.
    pub fn peers(&self) -> &[PeerInfo] {
        &self.peers
    }

    /// What rank 0 passed to the rendezvous as `root_payload` (the NCCL unique id), the same
    /// bytes on every rank; empty when rank 0 passed `None`.
    pub fn root_payload(&self) -> &[u8] {
        &self.payload
    }

    /// Replaces the failure handler (default: print `error: ...: exiting` to stderr and exit
    /// with [`FAILURE_EXIT_CODE`]). It runs once, on a background thread or inside a
    /// collective, with the first failure; when it returns, every connection is shut and
    /// collectives return [`DistError::PeerFailed`].
    pub fn on_failure(&self, handler: FailureHandler) {
        if let Some(inner) = &self.inner {
            *lock(&inner.handler) = Arc::from(handler);
        }
    }

    /// The failure seen so far, if any.
    pub fn failure(&self) -> Option<PeerFailure> {
        self.inner.as_ref().and_then(|i| i.failure())
    }

    /// Ends the group cleanly. Other ranks: say goodbye to rank 0 and stop watching it (waits at
    /// most `failure_timeout` for rank 0 to acknowledge). Rank 0: wait until every other rank
    /// has said goodbye, still watching them, then close. Errors with the failure if one
    /// happened (and the handler returned).
    pub fn finish(self) -> Result<()> {
        self.finished.store(true, Ordering::SeqCst);
        let Some(inner) = self.inner.clone() else {
            return Ok(());
        };
        if self.rank == 0 {
            let st = lock(&inner.state);
            let st = inner
                .cv
                .wait_while(st, |s| {
                    s.failure.is_none() && !s.done.iter().skip(1).all(|&d| d)
                })
                .unwrap_or_else(|e| e.into_inner());
            drop(st);
            let failure = inner.failure_handled();
            inner.close_all();
            return failure.map_or(Ok(()), |pf| Err(DistError::PeerFailed(pf)));
        }
        {
            if let Some(pf) = inner.failure_handled() {
                inner.close_all();
                return Err(DistError::PeerFailed(pf));
            }
            let mut st = lock(&inner.state);
            st.closing = true;
            inner.cv.notify_all();
        }
        if let Some(out) = &inner.hb_out[0] {
            let s = lock(out);
            let _ = wire::write_frame(&mut &*s, Header::new(tag::DONE, 0, 0, 0), &[]);
            let _ = s.shutdown(Shutdown::Write);
        }
        // Rank 0 closes the heartbeat connection on our goodbye; the watcher sees it and ends.
        if let Some(h) = lock(&self.watcher_thread).take() {
            let _ = h.join();
        }
        inner.close_all();
        Ok(())
    }

    fn check_usable(&self, coll: &Coll) -> Result<()> {
        if let Some(pf) = self.inner.as_ref().and_then(|i| i.failure_handled()) {
            return Err(DistError::PeerFailed(pf));
        }
        if let Some(why) = &coll.broken {
            return Err(DistError::GroupBroken {
                rank: self.rank,
                why: why.clone(),
            });
        }
        Ok(())
    }

    /// A peer lost inside a collective: fail (handler), then the error to return.
    fn lost(&self, peer: usize, op: Op, seq: u64, what: &str, e: io::Error) -> DistError {
        let inner = self.inner.as_ref().expect("a group of one has no peers");
        if let Some(pf) = inner.failure_handled() {
            return DistError::PeerFailed(pf);
        }
        if self.rank != 0 && wire::is_closed(&e) {
            // Rank 0 closes everything when it fails on another rank's account, right after
            // telling us why on the heartbeat connection: prefer that message.
            let grace = inner.timing.failure_timeout.min(Duration::from_secs(1));
            if let Some(pf) = inner.wait_failure(grace) {
                return DistError::PeerFailed(pf);
            }
        }
        let name = Op::name(op as u8);
        if self.rank == 0 && lock(&inner.state).done[peer] {
            let pf = PeerFailure::of(
                &inner.peers[peer],
                format!("has finished (Group::finish) but rank 0 called {name} #{seq}: every rank must call the same collectives before finishing"),
            );
            inner.fail(pf.clone());
            return DistError::PeerFailed(inner.failure_handled().unwrap_or(pf));
        }
        let wait = if self.rank == 0 {
            inner.timing.failure_timeout
        } else {
            inner.timing.failure_timeout * 2 + Duration::from_secs(5)
        };
        let seen_by = if self.rank == 0 {
            " (seen by rank 0)".to_string()
        } else {
            format!(" (seen by rank {})", self.rank)
        };
        let reason = if wire::is_timeout(&e) {
            format!(
                "did not {what} {name} #{seq} within {}{seen_by}; {}",
                wire::secs(wait),
                inner.timeout_hint()
            )
        } else if wire::is_closed(&e) {
            format!("exited: its connection closed during {name} #{seq}{seen_by}")
        } else {
            format!("was lost during {name} #{seq}: {e}{seen_by}")
        };
        let pf = PeerFailure::of(&inner.peers[peer], reason);
        inner.fail(pf.clone());
        DistError::PeerFailed(inner.failure_handled().unwrap_or(pf))
    }

    /// A peer that called another collective, or the same with another length.
    fn mismatch(&self, peer: usize, reason: String) -> DistError {
        let inner = self.inner.as_ref().expect("a group of one has no peers");
        let pf = PeerFailure::of(&inner.peers[peer], format!("{reason} (seen by rank 0)"));
        inner.fail(pf.clone());
        DistError::PeerFailed(inner.failure_handled().unwrap_or(pf))
    }

    /// Rank 0: reads one contribution from every other rank in rank order, checking op, seq and
    /// (when given) length; `consume` reads the payload.
    fn root_collect(
        &self,
        streams: &mut [Option<TcpStream>],
        op: Op,
        seq: u64,
        expect_len: Option<u64>,
        mut consume: impl FnMut(usize, &mut TcpStream, u64) -> io::Result<()>,
    ) -> Result<()> {
        let timeout = self.inner.as_ref().unwrap().timing.failure_timeout;
        let deadline = Instant::now() + timeout;
        for (r, s) in streams.iter_mut().enumerate().skip(1) {
            let s = s.as_mut().expect("rank 0 has a connection to every rank");
            let wait = deadline
                .saturating_duration_since(Instant::now())
                .max(Duration::from_millis(50));
            let h = s
                .set_read_timeout(Some(wait))
                .and_then(|_| wire::read_header(s))
                .map_err(|e| self.lost(r, op, seq, "contribute to", e))?;
            let _ = s.set_read_timeout(Some(timeout));
            if h.tag != tag::DATA || h.op != op as u8 || h.seq != seq {
                return Err(self.mismatch(
                    r,
                    format!(
                        "called {} #{} while rank 0 called {} #{seq}: every rank must call the same collectives in the same order",
                        Op::name(h.op),
                        h.seq,
                        Op::name(op as u8)
                    ),
                ));
            }
            if let Some(len) = expect_len {
                if h.len != len {
                    return Err(self.mismatch(
                        r,
                        format!(
                            "called {} #{seq} with {} bytes while rank 0 has {len}: every rank must pass buffers of the same length",
                            Op::name(op as u8),
                            h.len
                        ),
                    ));
                }
            }
            consume(r, s, h.len).map_err(|e| self.lost(r, op, seq, "contribute to", e))?;
        }
        Ok(())
    }

    /// Rank 0: sends the same result to every other rank.
    fn root_send(
        &self,
        streams: &mut [Option<TcpStream>],
        op: Op,
        seq: u64,
        bytes: &[u8],
    ) -> Result<()> {
        for (r, s) in streams.iter_mut().enumerate().skip(1) {
            let s = s.as_mut().expect("rank 0 has a connection to every rank");
            wire::write_frame(
                s,
                Header::new(tag::DATA, op as u8, seq, bytes.len() as u64),
                bytes,
            )
            .map_err(|e| self.lost(r, op, seq, "receive the result of", e))?;
        }
        Ok(())
    }

    /// Other ranks: sends a contribution of `len` bytes written by `fill` (which writes to the
    /// stream), then reads rank 0's answer header.
    fn exchange(
        &self,
        coll: &mut Coll,
        op: Op,
        seq: u64,
        len: u64,
        fill: impl FnOnce(&mut TcpStream, &mut Vec<u8>) -> io::Result<()>,
    ) -> Result<Header> {
        let Coll {
            streams, scratch, ..
        } = &mut *coll;
        let s = streams[0]
            .as_mut()
            .expect("a rank has a connection to rank 0");
        s.write_all(&Header::new(tag::DATA, op as u8, seq, len).encode())
            .and_then(|_| fill(s, scratch))
            .map_err(|e| self.lost(0, op, seq, "take the contribution of this rank to", e))?;
        let h = wire::read_header(s).map_err(|e| self.lost(0, op, seq, "answer", e))?;
        if h.tag != tag::DATA || h.op != op as u8 || h.seq != seq {
            let why = format!(
                "rank {} called {} #{seq} but rank 0 answered {} #{}: every rank must call the same collectives in the same order",
                self.rank,
                Op::name(op as u8),
                Op::name(h.op),
                h.seq
            );
            coll.broken = Some(why.clone());
            return Err(DistError::CollectiveMismatch {
                rank: self.rank,
                problem: why,
            });
        }
        Ok(h)
    }

    fn begin(&self) -> Result<(MutexGuard<'_, Coll>, u64)> {
        let mut coll = lock(&self.coll);
        self.check_usable(&coll)?;
        coll.seq += 1;
        let seq = coll.seq;
        Ok((coll, seq))
    }

    /// Returns once every rank has called `barrier`.
    pub fn barrier(&self) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let (mut coll, seq) = self.begin()?;
        if self.rank == 0 {
            self.root_collect(&mut coll.streams, Op::Barrier, seq, Some(0), |_, _, _| {
                Ok(())
            })?;
            self.root_send(&mut coll.streams, Op::Barrier, seq, &[])
        } else {
            let h = self.exchange(&mut coll, Op::Barrier, seq, 0, |_, _| Ok(()))?;
            self.read_reply(&mut coll, Op::Barrier, seq, h, Some(0))
                .map(|_| ())
        }
    }

    /// Reads an answer payload of the expected length (None: any).
    fn read_reply(
        &self,
        coll: &mut Coll,
        op: Op,
        seq: u64,
        h: Header,
        expect: Option<u64>,
    ) -> Result<Vec<u8>> {
        if let Some(len) = expect {
            if h.len != len {
                let why = format!(
                    "rank 0 answered {} #{seq} with {} bytes, rank {} expected {len}",
                    Op::name(op as u8),
                    h.len,
                    self.rank
                );
                coll.broken = Some(why.clone());
                return Err(DistError::CollectiveMismatch {
                    rank: self.rank,
                    problem: why,
                });
            }
        }
        let s = coll.streams[0].as_mut().unwrap();
        wire::read_payload(s, h.len, u64::MAX).map_err(|e| self.lost(0, op, seq, "answer", e))
    }

    /// Rank 0's `data` on every rank. Rank 0 passes `Some(bytes)`; the others' argument is
    /// ignored (pass `None`).
    pub fn broadcast_bytes(&self, data: Option<Vec<u8>>) -> Result<Vec<u8>> {
        if self.rank == 0 && data.is_none() {
            return Err(DistError::BadCall {
                rank: 0,
                problem: "broadcast_bytes(None) on rank 0: rank 0 must pass Some(bytes), the data every rank receives".into(),
            });
        }
        if self.world_size == 1 {
            return Ok(data.unwrap_or_default());
        }
        let (mut coll, seq) = self.begin()?;
        if self.rank == 0 {
            let data = data.unwrap_or_default();
            self.root_collect(&mut coll.streams, Op::Broadcast, seq, Some(0), |_, _, _| {
                Ok(())
            })?;
            self.root_send(&mut coll.streams, Op::Broadcast, seq, &data)?;
            Ok(data)
        } else {
            let h = self.exchange(&mut coll, Op::Broadcast, seq, 0, |_, _| Ok(()))?;
            self.read_reply(&mut coll, Op::Broadcast, seq, h, None)
        }
    }

    /// Every rank's `data`, in rank order, on every rank (lengths may differ).
    pub fn all_gather_bytes(&self, data: Vec<u8>) -> Result<Vec<Vec<u8>>> {
        if self.world_size == 1 {
            return Ok(vec![data]);
        }
        let (mut coll, seq) = self.begin()?;
        let n = self.world_size;
        if self.rank == 0 {
            let mut parts: Vec<Vec<u8>> = Vec::with_capacity(n);
            parts.push(data);
            self.root_collect(&mut coll.streams, Op::AllGather, seq, None, |_, s, len| {
                parts.push(wire::read_payload(s, len, u64::MAX)?);
                Ok(())
            })?;
            let total: usize = parts.iter().map(|p| p.len()).sum();
            let mut out = Vec::with_capacity(8 * n + total);
            for p in &parts {
                out.extend_from_slice(&(p.len() as u64).to_le_bytes());
            }
            for p in &parts {
                out.extend_from_slice(p);
            }
            self.root_send(&mut coll.streams, Op::AllGather, seq, &out)?;
            Ok(parts)
        } else {
            let h = self.exchange(&mut coll, Op::AllGather, seq, data.len() as u64, |s, _| {
                s.write_all(&data)
            })?;
            let bytes = self.read_reply(&mut coll, Op::AllGather, seq, h, None)?;
            decode_gather(&bytes, n).ok_or_else(|| {
                let why =
                    format!("rank 0's answer to all_gather_bytes #{seq} does not hold {n} parts");
                coll.broken = Some(why.clone());
                DistError::CollectiveMismatch {
                    rank: self.rank,
                    problem: why,
                }
            })
        }
    }

    /// Element-wise sum over all ranks, in place, bitwise the same on every rank: rank 0 adds
    /// the contributions in rank order (`((x0 + x1) + x2) + ...`) and sends the sum back.
    pub fn all_reduce_sum_f32(&self, data: &mut [f32]) -> Result<()> {
        self.all_reduce_sum(data)
    }

    /// [`Group::all_reduce_sum_f32`] for `f64`.
    pub fn all_reduce_sum_f64(&self, data: &mut [f64]) -> Result<()> {
        self.all_reduce_sum(data)
    }

    fn all_reduce_sum<T: Elem>(&self, data: &mut [T]) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let (mut coll, seq) = self.begin()?;
        let len = (data.len() * T::SIZE) as u64;
        let per_chunk = CHUNK / T::SIZE;
        if self.rank == 0 {
            let Coll {
                streams, scratch, ..
            } = &mut *coll;
            scratch.resize(CHUNK, 0);
            self.root_collect(streams, T::OP, seq, Some(len), |_, s, _| {
                for block in data.chunks_mut(per_chunk) {
                    let buf = &mut scratch[..block.len() * T::SIZE];
                    s.read_exact(buf)?;
                    for (x, b) in block.iter_mut().zip(buf.chunks_exact(T::SIZE)) {
                        *x = *x + T::get(b);
                    }
                }
                Ok(())
            })?;
            scratch.clear();
            scratch.resize(data.len() * T::SIZE, 0);
            for (x, b) in data.iter().zip(scratch.chunks_exact_mut(T::SIZE)) {
                x.put(b);
            }
            let bytes = std::mem::take(scratch);
            let res = self.root_send(streams, T::OP, seq, &bytes);
            *scratch = bytes;
            scratch.truncate(CHUNK);
            res
        } else {
            let h = self.exchange(&mut coll, T::OP, seq, len, |s, scratch| {
                scratch.resize(CHUNK, 0);
                for block in data.chunks(per_chunk) {
                    let buf = &mut scratch[..block.len() * T::SIZE];
                    for (x, b) in block.iter().zip(buf.chunks_exact_mut(T::SIZE)) {
                        x.put(b);
                    }
                    s.write_all(buf)?;
                }
                Ok(())
            })?;
            if h.len != len {
                let why = format!(
                    "rank 0 answered {} #{seq} with {} bytes, rank {} has {len}",
                    Op::name(T::OP as u8),
                    h.len,
                    self.rank
                );
                coll.broken = Some(why.clone());
                return Err(DistError::CollectiveMismatch {
                    rank: self.rank,
                    problem: why,
                });
            }
            let Coll {
                streams, scratch, ..
            } = &mut *coll;
            let s = streams[0].as_mut().unwrap();
            let res: io::Result<()> = (|| {
                for block in data.chunks_mut(per_chunk) {
                    let buf = &mut scratch[..block.len() * T::SIZE];
                    s.read_exact(buf)?;
                    for (x, b) in block.iter_mut().zip(buf.chunks_exact(T::SIZE)) {
                        *x = T::get(b);
                    }
                }
                Ok(())
            })();
            res.map_err(|e| self.lost(0, T::OP, seq, "answer", e))
        }
    }
}

fn decode_gather(bytes: &[u8], n: usize) -> Option<Vec<Vec<u8>>> {
    let head = bytes.get(..8 * n)?;
    let lens: Vec<usize> = head
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().unwrap()) as usize)
        .collect();
    let mut at = 8 * n;
    let mut out = Vec::with_capacity(n);
    for len in lens {
        out.push(bytes.get(at..at.checked_add(len)?)?.to_vec());
        at += len;
    }
    (at == bytes.len()).then_some(out)
}

impl Drop for Group {
    fn drop(&mut self) {
        if self.finished.load(Ordering::SeqCst) {
            return;
        }
        if let Some(inner) = &self.inner {
            inner.close_all();
        }
    }
}

/// Ends the process at once. Not `std::process::exit`: it runs the C exit handlers, and the
/// CUDA runtime's would wait for this process's GPU work — an NCCL kernel waiting on the dead
/// rank never finishes, so the survivor would hang in its exit.
fn exit_now(code: i32) -> ! {
    use std::io::Write;
    let _ = std::io::stdout().flush();
    let _ = std::io::stderr().flush();
    // SAFETY: _exit takes no pointers and does not return.
    unsafe { libc::_exit(code) }
}
