//! The in-process replica pool: one OS thread per worker, a shared work queue, ordered results.
//!
//! A worker's error fails one item (it goes to another worker), unless the error is a
//! [`StopRun`]: then the whole run ends (a results file that cannot be written makes every
//! further item wasted work).

use std::collections::VecDeque;
use std::io::IsTerminal;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use indicatif::{MultiProgress, ProgressBar, ProgressDrawTarget, ProgressStyle};

use crate::{DistError, Result};

/// The error a [`Worker`] returns. Any `std::error::Error + Send + Sync` converts into it, and so
/// do `String` and `&str` (`Err("out of memory".into())`).
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// An error that ends the whole run, not one item: a worker returns it (boxed, as its
/// [`Worker::process`] error: `Err(StopRun::new(e).into())`) when going on would only waste
/// work — the file its results go to cannot be written (a full disk), so every further item
/// would be computed and lost.
///
/// The pool recognises it by downcasting the returned [`BoxError`] (it must be the error
/// itself, not wrapped in another): the item fails with this reason, no worker is handed
/// another item, the items still queued fail with "the run stopped", items in flight on other
/// workers finish, and [`ReplicaPool::run`] returns [`DistError::RunStopped`].
#[derive(Debug)]
pub struct StopRun {
    cause: BoxError,
}

impl StopRun {
    /// A stop caused by `cause` (its message is the run's error message).
    pub fn new(cause: impl Into<BoxError>) -> Self {
        StopRun {
            cause: cause.into(),
        }
    }

    /// The cause.
    pub fn cause(&self) -> &(dyn std::error::Error + Send + Sync + 'static) {
        self.cause.as_ref()
    }
}

impl std::fmt::Display for StopRun {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.cause.fmt(f)
    }
}

impl std::error::Error for StopRun {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(self.cause.as_ref())
    }
}

/// One replica: owns its device and model and processes one item at a time.
///
/// The pool moves each worker onto its own OS thread, so workers must be `Send`. Because the pool
/// uses scoped threads, a worker may borrow (`&mut Replica`) instead of own: the replica is then
/// still usable after [`ReplicaPool::run`] returns.
pub trait Worker<I, O>: Send {
    /// A name for logs, reports and the progress bar, e.g. `"GPU 0"`.
    fn name(&self) -> String;
    /// Processes one item. An error (or a panic) makes the pool retry the item on another worker;
    /// a [`StopRun`] error ends the whole run.
    fn process(&mut self, item: &I) -> Result<O, BoxError>;
}

/// One failed attempt at an item, or the reason it could not be attempted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemError {
    /// Index of the worker that failed, `None` when the pool itself gave up on the item.
    pub worker: Option<usize>,
    /// Name of that worker (`"pool"` when `worker` is `None`).
    pub worker_name: String,
    /// The error message.
    pub message: String,
}

impl std::fmt::Display for ItemError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "[{}] {}", self.worker_name, self.message)
    }
}

/// The outcome of one item. A failed item never carries a made-up output.
#[derive(Debug, Clone, PartialEq)]
pub enum ItemResult<O> {
    /// The item was processed.
    Done {
        /// What the worker returned.
        output: O,
        /// Index of the worker that processed it.
        worker: usize,
    },
    /// Every attempt failed, or no worker was left to try it. `errors` is never empty.
    Failed {
        /// The errors, in the order they happened.
        errors: Vec<ItemError>,
    },
}

impl<O> ItemResult<O> {
    /// Whether the item was processed.
    pub fn is_done(&self) -> bool {
        matches!(self, ItemResult::Done { .. })
    }

    /// The output, if the item was processed.
    pub fn output(&self) -> Option<&O> {
        match self {
            ItemResult::Done { output, .. } => Some(output),
            ItemResult::Failed { .. } => None,
        }
    }

    /// The output, or the errors of every attempt.
    pub fn into_result(self) -> std::result::Result<O, Vec<ItemError>> {
        match self {
            ItemResult::Done { output, .. } => Ok(output),
            ItemResult::Failed { errors } => Err(errors),
        }
    }
}

/// Options of [`ReplicaPool::run`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolOptions {
    /// Draw progress bars (one per worker plus a total with ETA) on stderr. They are hidden
    /// anyway when stderr is not a terminal.
    pub progress: bool,
    /// A worker whose `process` fails (or panics) stops taking items. A panicking worker always
    /// stops. With `false`, a failing worker keeps taking items, but never one it already failed.
    pub stop_worker_on_error: bool,
    /// Most attempts per item. `None`: one attempt per worker (the first, then every other worker
    /// once). A worker never retries an item it has already failed.
    pub max_attempts: Option<usize>,
    /// What the items are called on the total bar (e.g. `"prompts"`).
    pub label: String,
}

impl Default for PoolOptions {
    fn default() -> Self {
        Self {
            progress: true,
            stop_worker_on_error: true,
            max_attempts: None,
            label: "items".to_string(),
        }
    }
}

/// What one worker did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerReport {
    /// The worker's name.
    pub name: String,
    /// Items it processed.
    pub items_done: usize,
    /// Attempts of it that failed.
    pub items_failed: usize,
    /// Why it stopped taking items early, if it did.
    pub stopped: Option<String>,
    /// Time spent inside `process`.
    pub busy: Duration,
}

/// One failed attempt, as logged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureRecord {
    /// Input index of the item.
    pub item: usize,
    /// Index of the worker.
    pub worker: usize,
    /// Name of the worker.
    pub worker_name: String,
    /// The error message.
    pub message: String,
    /// Whether the item went back to the queue for another worker.
    pub requeued: bool,
}

/// Summary of a pool run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PoolReport {
    /// One entry per worker, in the order given.
    pub workers: Vec<WorkerReport>,
    /// Every failed attempt, in the order they happened.
    pub failures: Vec<FailureRecord>,
    /// Items processed.
    pub items_done: usize,
    /// Items that came back as [`ItemResult::Failed`].
    pub items_failed: usize,
    /// Wall time of the run.
    pub elapsed: Duration,
}

/// Results (in input order) and report of [`ReplicaPool::run`].
#[derive(Debug, Clone, PartialEq)]
pub struct PoolOutput<O> {
    /// One result per input item, in input order.
    pub results: Vec<ItemResult<O>>,
    /// What happened.
    pub report: PoolReport,
}

/// Runs items over workers, one OS thread per worker, sharing one work queue.
#[derive(Debug, Clone, Copy, Default)]
pub struct ReplicaPool;

struct State<O> {
    queue: VecDeque<usize>,
    in_flight: usize,
    results: Vec<Option<ItemResult<O>>>,
    errors: Vec<Vec<ItemError>>,
    alive: Vec<bool>,
    workers: Vec<WorkerReport>,
    failures: Vec<FailureRecord>,
    done: usize,
    failed: usize,
    /// Set when a worker returned [`StopRun`]: (worker name, item, message).
    stopped: Option<(String, usize, String)>,
}

impl<O> State<O> {
    fn eligible(&self, item: usize, w: usize) -> bool {
        self.alive[w] && !self.errors[item].iter().any(|e| e.worker == Some(w))
    }

    fn can_run(&self, item: usize, max_attempts: usize) -> bool {
        self.errors[item].len() < max_attempts
            && (0..self.alive.len()).any(|w| self.eligible(item, w))
    }

    fn finalize_failed(&mut self, item: usize, max_attempts: usize) {
        let mut errors = std::mem::take(&mut self.errors[item]);
        if errors.len() < max_attempts {
            let n = self.alive.len();
            let stopped = self.alive.iter().filter(|a| !**a).count();
            errors.push(ItemError {
                worker: None,
                worker_name: "pool".to_string(),
                message: format!(
                    "no worker left to try this item: {stopped} of {n} workers stopped after \
                     errors and every running worker already failed it; see the earlier \
                     worker errors"
                ),
            });
        }
        self.results[item] = Some(ItemResult::Failed { errors });
        self.failed += 1;
    }

    /// Fails every queued item: the run stopped (`reason`).
    fn stop_all(&mut self, reason: &str) -> usize {
        let queued: Vec<usize> = self.queue.drain(..).collect();
        for &item in &queued {
            let mut errors = std::mem::take(&mut self.errors[item]);
            errors.push(ItemError {
                worker: None,
                worker_name: "pool".to_string(),
                message: format!("not run: the run stopped: {reason}"),
            });
            self.results[item] = Some(ItemResult::Failed { errors });
            self.failed += 1;
        }
        queued.len()
    }

    /// Fails every queued item that no running worker may take any more.
    fn sweep(&mut self, max_attempts: usize) -> usize {
        let queued: Vec<usize> = self.queue.drain(..).collect();
        let mut swept = 0;
        for item in queued {
            if self.can_run(item, max_attempts) {
                self.queue.push_back(item);
            } else {
                self.finalize_failed(item, max_attempts);
                swept += 1;
            }
        }
        swept
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        format!("panicked: {s}")
    } else if let Some(s) = payload.downcast_ref::<String>() {
        format!("panicked: {s}")
    } else {
        "panicked".to_string()
    }
}

struct Progress {
    _multi: MultiProgress,
    workers: Vec<ProgressBar>,
    total: ProgressBar,
}

impl Progress {
    fn new(names: &[String], n_items: usize, opts: &PoolOptions) -> Self {
        let visible = opts.progress && std::io::stderr().is_terminal();
        let multi = if visible {
            MultiProgress::with_draw_target(ProgressDrawTarget::stderr())
        } else {
            MultiProgress::with_draw_target(ProgressDrawTarget::hidden())
        };
        let width = names.iter().map(|n| n.len() + 2).max().unwrap_or(0).max(7);
        let worker_style =
            ProgressStyle::with_template(&format!("{{prefix:>{width}}} {{pos}} done {{msg}}"))
                .unwrap_or_else(|_| ProgressStyle::default_bar());
        let total_style = ProgressStyle::with_template(&format!(
            "{{prefix:>{width}}} [{{wide_bar}}] {{pos}}/{{len}} {} ({{per_sec}}, ETA {{eta}})",
            opts.label
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> ");
        let workers = names
            .iter()
            .map(|name| {
                let bar = multi.add(ProgressBar::no_length());
                bar.set_style(worker_style.clone());
                bar.set_prefix(format!("[{name}]"));
                bar
            })
            .collect();
        let total = multi.add(ProgressBar::new(n_items as u64));
        total.set_style(total_style);
        total.set_prefix("[total]");
        Self {
            _multi: multi,
            workers,
            total,
        }
    }
}

impl ReplicaPool {
    /// Runs `items` over `workers` and returns one result per item, in input order.
    ///
    /// Each worker gets its own OS thread and pulls the next item from a shared queue, so a
    /// faster worker processes more items. When `process` fails (or panics), the failure is logged
    /// and recorded in the report, the item goes back to the queue for a worker that has not yet
    /// failed it (up to [`PoolOptions::max_attempts`]), and, with
    /// [`PoolOptions::stop_worker_on_error`], the failing worker stops. An item that no worker
    /// could process comes back as [`ItemResult::Failed`] with every error; when all workers have
    /// stopped, the items still queued come back as `Failed` with that reason.
    ///
    /// A worker that returns a [`StopRun`] ends the run: no more items are handed out, the
    /// queued ones fail, and once the items in flight are finished the call returns
    /// [`DistError::RunStopped`] naming the worker, the item and the cause.
    ///
    /// Errors: [`DistError::NoWorkers`] when there are items but no workers,
    /// [`DistError::ZeroAttempts`] when `max_attempts` is `Some(0)`,
    /// [`DistError::RunStopped`].
    pub fn run<I, O, W>(workers: Vec<W>, items: Vec<I>, opts: &PoolOptions) -> Result<PoolOutput<O>>
    where
        I: Sync,
        O: Send,
        W: Worker<I, O>,
    {
        let start = Instant::now();
        if opts.max_attempts == Some(0) {
            return Err(DistError::ZeroAttempts);
        }
        let n_items = items.len();
        let n_workers = workers.len();
        let names: Vec<String> = workers.iter().map(|w| w.name()).collect();
        if n_items == 0 {
            return Ok(PoolOutput {
                results: Vec::new(),
                report: PoolReport {
                    workers: names.into_iter().map(new_worker_report).collect(),
                    failures: Vec::new(),
                    items_done: 0,
                    items_failed: 0,
                    elapsed: start.elapsed(),
                },
            });
        }
        if n_workers == 0 {
            return Err(DistError::NoWorkers { items: n_items });
        }
        let max_attempts = opts.max_attempts.unwrap_or(n_workers);
        tracing::info!(
            items = n_items,
            workers = n_workers,
            max_attempts,
            "replica pool starting"
        );

        let state = Mutex::new(State {
            queue: (0..n_items).collect(),
            in_flight: 0,
            results: (0..n_items).map(|_| None).collect(),
            errors: vec![Vec::new(); n_items],
            alive: vec![true; n_workers],
            workers: names.iter().cloned().map(new_worker_report).collect(),
            failures: Vec::new(),
            done: 0,
            failed: 0,
            stopped: None,
        });
        let cvar = Condvar::new();
        let progress = Progress::new(&names, n_items, opts);
        let items = &items;

        std::thread::scope(|scope| {
            for (w, worker) in workers.into_iter().enumerate() {
                let ctx = WorkerCtx {
                    w,
                    name: names[w].clone(),
                    state: &state,
                    cvar: &cvar,
                    progress: &progress,
                    max_attempts,
                    stop_on_error: opts.stop_worker_on_error,
                };
                let spawned = std::thread::Builder::new()
                    .name(format!("fleet-worker-{w}"))
                    .spawn_scoped(scope, move || ctx.run(worker, items));
                if let Err(e) = spawned {
                    let reason = format!("could not start a thread for it: {e}");
                    tracing::error!(worker = %names[w], "{reason}");
                    let mut st = lock(&state);
                    st.alive[w] = false;
                    st.workers[w].stopped = Some(reason);
                    let swept = st.sweep(max_attempts);
                    progress.total.inc(swept as u64);
                    cvar.notify_all();
                }
            }
        });

        let st = state.into_inner().unwrap_or_else(PoisonError::into_inner);
        if let Some((worker, item, message)) = st.stopped {
            progress.total.abandon();
            return Err(DistError::RunStopped {
                worker,
                item,
                message,
            });
        }
        progress.total.finish();
        let results: Vec<ItemResult<O>> = st
            .results
            .into_iter()
            .map(|r| {
                r.unwrap_or_else(|| ItemResult::Failed {
                    errors: vec![ItemError {
                        worker: None,
                        worker_name: "pool".to_string(),
                        message: "the pool ended without running this item (internal error)"
                            .to_string(),
                    }],
                })
            })
            .collect();
        let items_done = results.iter().filter(|r| r.is_done()).count();
        let report = PoolReport {
            workers: st.workers,
            failures: st.failures,
            items_done,
            items_failed: n_items - items_done,
            elapsed: start.elapsed(),
        };
        tracing::info!(
            done = report.items_done,
            failed = report.items_failed,
            elapsed_s = report.elapsed.as_secs_f64(),
            "replica pool finished"
        );
        Ok(PoolOutput { results, report })
    }
}

fn new_worker_report(name: String) -> WorkerReport {
    WorkerReport {
        name,
        items_done: 0,
        items_failed: 0,
        stopped: None,
        busy: Duration::ZERO,
    }
}

struct WorkerCtx<'a, O> {
    w: usize,
    name: String,
    state: &'a Mutex<State<O>>,
    cvar: &'a Condvar,
    progress: &'a Progress,
    max_attempts: usize,
    stop_on_error: bool,
}

impl<O> WorkerCtx<'_, O> {
    fn next_item(&self) -> Option<usize> {
        let mut st = lock(self.state);
        loop {
            if !st.alive[self.w] || st.stopped.is_some() {
                return None;
            }
            if let Some(pos) = st.queue.iter().position(|&i| st.eligible(i, self.w)) {
                let item = st.queue.remove(pos)?;
                st.in_flight += 1;
                return Some(item);
            }
            if st.queue.is_empty() && st.in_flight == 0 {
                return None;
            }
            st = self.cvar.wait(st).unwrap_or_else(PoisonError::into_inner);
        }
    }

    fn run<I, W: Worker<I, O>>(self, mut worker: W, items: &[I]) {
        let bar = &self.progress.workers[self.w];
        while let Some(item) = self.next_item() {
            let t0 = Instant::now();
            let outcome = catch_unwind(AssertUnwindSafe(|| worker.process(&items[item])));
            let busy = t0.elapsed();
            let mut st = lock(self.state);
            st.in_flight -= 1;
            st.workers[self.w].busy += busy;
            let (message, panicked, stop_run) = match outcome {
                Ok(Ok(output)) => {
                    st.results[item] = Some(ItemResult::Done {
                        output,
                        worker: self.w,
                    });
                    st.done += 1;
                    st.workers[self.w].items_done += 1;
                    bar.inc(1);
                    self.progress.total.inc(1);
                    self.cvar.notify_all();
                    continue;
                }
                Ok(Err(e)) => (e.to_string(), false, e.downcast_ref::<StopRun>().is_some()),
                Err(payload) => (panic_message(payload.as_ref()), true, false),
            };
            st.workers[self.w].items_failed += 1;
            st.errors[item].push(ItemError {
                worker: Some(self.w),
                worker_name: self.name.clone(),
                message: message.clone(),
            });
            if stop_run {
                st.failures.push(FailureRecord {
                    item,
                    worker: self.w,
                    worker_name: self.name.clone(),
                    message: message.clone(),
                    requeued: false,
                });
                st.workers[self.w].stopped =
                    Some(format!("item {item} stopped the run: {message}"));
                st.finalize_failed(item, 0);
                if st.stopped.is_none() {
                    st.stopped = Some((self.name.clone(), item, message.clone()));
                }
                let swept = st.stop_all(&message);
                tracing::error!(worker = %self.name, item, "the run stops: {message}");
                bar.abandon_with_message(format!("stopped the run: {message}"));
                self.progress.total.inc(1 + swept as u64);
                self.cvar.notify_all();
                return;
            }
            let stop = self.stop_on_error || panicked;
            if stop {
                st.alive[self.w] = false;
                st.workers[self.w].stopped = Some(format!("item {item} failed: {message}"));
            }
            // After a stop nothing goes back to the queue: no worker will take it.
            let requeued = st.stopped.is_none() && st.can_run(item, self.max_attempts);
            tracing::warn!(
                worker = %self.name,
                item,
                requeued,
                "worker failed on item: {message}"
            );
            st.failures.push(FailureRecord {
                item,
                worker: self.w,
                worker_name: self.name.clone(),
                message: message.clone(),
                requeued,
            });
            let mut finished = 0;
            if requeued {
                st.queue.push_back(item);
            } else {
                st.finalize_failed(item, self.max_attempts);
                finished += 1;
            }
            if stop {
                tracing::error!(worker = %self.name, "worker stops taking items after: {message}");
                bar.abandon_with_message(format!("stopped: {message}"));
                finished += st.sweep(self.max_attempts);
            }
            self.progress.total.inc(finished as u64);
            self.cvar.notify_all();
            if stop {
                return;
            }
        }
        bar.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    /// Doubles items; from item `stop_from` on it returns a [`StopRun`] (as a worker whose
    /// results file cannot be written does); at `fail_at` an ordinary error.
    struct Doubler {
        id: usize,
        stop_from: Option<u64>,
        fail_at: Option<u64>,
        processed: Arc<AtomicUsize>,
    }

    impl Worker<u64, u64> for Doubler {
        fn name(&self) -> String {
            format!("w{}", self.id)
        }

        fn process(&mut self, item: &u64) -> Result<u64, BoxError> {
            self.processed.fetch_add(1, Ordering::SeqCst);
            if self.stop_from.is_some_and(|s| *item >= s) {
                let cause = std::io::Error::other("cannot append to out.jsonl: No space left");
                return Err(StopRun::new(cause).into());
            }
            if self.fail_at == Some(*item) {
                return Err("an ordinary failure".into());
            }
            Ok(item * 2)
        }
    }

    fn quiet() -> PoolOptions {
        PoolOptions {
            progress: false,
            stop_worker_on_error: false,
            ..PoolOptions::default()
        }
    }

    #[test]
    fn a_stop_run_error_ends_the_whole_run() {
        let processed = Arc::new(AtomicUsize::new(0));
        let worker = Doubler {
            id: 0,
            stop_from: Some(3),
            fail_at: None,
            processed: processed.clone(),
        };
        let err = ReplicaPool::run(vec![worker], (0..100u64).collect(), &quiet()).unwrap_err();
        // One worker takes items in order: 0, 1, 2 done, 3 stops the run, 4..100 never run.
        assert_eq!(processed.load(Ordering::SeqCst), 4);
        match &err {
            DistError::RunStopped {
                worker,
                item,
                message,
            } => {
                assert_eq!((worker.as_str(), *item), ("w0", 3));
                assert!(message.contains("No space left"), "{message}");
            }
            other => panic!("expected RunStopped, got {other}"),
        }
        let text = err.to_string();
        assert!(text.contains("out.jsonl") && text.contains("w0"), "{text}");
    }

    #[test]
    fn with_several_workers_no_item_is_handed_out_after_a_stop() {
        let processed = Arc::new(AtomicUsize::new(0));
        // Every worker stops the run at the first item it takes: the first stop ends the run,
        // the others finish what they hold and are handed nothing more.
        let workers: Vec<Doubler> = (0..3)
            .map(|id| Doubler {
                id,
                stop_from: Some(0),
                fail_at: None,
                processed: processed.clone(),
            })
            .collect();
        let out = ReplicaPool::run(workers, (0..1000u64).collect(), &quiet());
        let Err(DistError::RunStopped { item, .. }) = out else {
            panic!("expected RunStopped");
        };
        assert!(item < 3, "one of the first items stopped it: {item}");
        assert!(processed.load(Ordering::SeqCst) <= 3, "{processed:?}");
    }

    #[test]
    fn an_ordinary_error_still_fails_only_its_item() {
        let processed = Arc::new(AtomicUsize::new(0));
        let worker = Doubler {
            id: 0,
            stop_from: None,
            fail_at: Some(3),
            processed: processed.clone(),
        };
        let out = ReplicaPool::run(vec![worker], (0..10u64).collect(), &quiet()).unwrap();
        assert_eq!(processed.load(Ordering::SeqCst), 10);
        assert_eq!(out.report.items_done, 9);
        assert!(!out.results[3].is_done());
        assert_eq!(out.results[4].output(), Some(&8));
    }
}
