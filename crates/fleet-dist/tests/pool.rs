use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fleet_dist::{BoxError, DistError, ItemResult, PoolOptions, ReplicaPool, Worker};

fn opts() -> PoolOptions {
    PoolOptions {
        progress: false,
        ..PoolOptions::default()
    }
}

/// Squares items, sleeping `delay` per item; fails on items in `fail_on`, or panics if `panic`.
struct Sq {
    id: usize,
    delay: Duration,
    fail_on: Vec<u64>,
    panic: bool,
    /// Raised when this worker has failed an item.
    failed: Arc<AtomicBool>,
    /// Hold the first item until this flag is raised (at most ten seconds), so a test
    /// decides which worker gets work first instead of racing for it.
    wait_for: Option<Arc<AtomicBool>>,
}

impl Sq {
    fn new(id: usize, delay_ms: u64) -> Self {
        Self {
            id,
            delay: Duration::from_millis(delay_ms),
            fail_on: Vec::new(),
            panic: false,
            failed: Arc::new(AtomicBool::new(false)),
            wait_for: None,
        }
    }
}

impl Worker<u64, (u64, usize)> for Sq {
    fn name(&self) -> String {
        format!("GPU {}", self.id)
    }
    fn process(&mut self, item: &u64) -> Result<(u64, usize), BoxError> {
        if let Some(flag) = self.wait_for.take() {
            let deadline = Instant::now() + Duration::from_secs(10);
            while !flag.load(Ordering::SeqCst) && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
        }
        std::thread::sleep(self.delay);
        if self.fail_on.contains(item) {
            self.failed.store(true, Ordering::SeqCst);
            if self.panic {
                panic!("boom on {item}");
            }
            return Err(format!("CUDA out of memory on item {item}").into());
        }
        Ok((item * item, self.id))
    }
}

#[test]
fn results_in_input_order() {
    let workers = vec![Sq::new(0, 1), Sq::new(1, 0), Sq::new(2, 2)];
    let items: Vec<u64> = (0..50).collect();
    let out = ReplicaPool::run(workers, items, &opts()).unwrap();
    assert_eq!(out.results.len(), 50);
    for (i, r) in out.results.iter().enumerate() {
        let (sq, _) = r.output().expect("done");
        assert_eq!(*sq, (i * i) as u64);
    }
    assert_eq!(out.report.items_done, 50);
    assert_eq!(out.report.items_failed, 0);
    let total: usize = out.report.workers.iter().map(|w| w.items_done).sum();
    assert_eq!(total, 50);
    assert_eq!(out.report.workers[1].name, "GPU 1");
}

#[test]
fn faster_worker_takes_more_items() {
    let workers = vec![Sq::new(0, 1), Sq::new(1, 12)];
    let items: Vec<u64> = (0..40).collect();
    let out = ReplicaPool::run(workers, items, &opts()).unwrap();
    let fast = out.report.workers[0].items_done;
    let slow = out.report.workers[1].items_done;
    assert_eq!(fast + slow, 40);
    assert!(fast > slow, "fast {fast} slow {slow}");
    // The worker recorded in each result agrees with the per-worker counts.
    let by_fast = out
        .results
        .iter()
        .filter(|r| matches!(r, ItemResult::Done { worker: 0, .. }))
        .count();
    assert_eq!(by_fast, fast);
}

#[test]
fn failed_item_is_retried_on_another_worker_and_failing_worker_stops() {
    let mut bad = Sq::new(0, 0);
    bad.fail_on = (0..100).collect();
    let mut good = Sq::new(1, 1);
    good.wait_for = Some(bad.failed.clone());
    let workers = vec![bad, good];
    let items: Vec<u64> = (0..10).collect();
    let out = ReplicaPool::run(workers, items, &opts()).unwrap();
    assert_eq!(out.report.items_done, 10);
    assert!(out.results.iter().all(|r| r.is_done()));
    let w0 = &out.report.workers[0];
    assert_eq!(w0.items_done, 0);
    assert_eq!(w0.items_failed, 1, "stops after its first failure");
    assert!(w0.stopped.as_deref().unwrap().contains("out of memory"));
    assert_eq!(out.report.failures.len(), 1);
    assert!(out.report.failures[0].requeued);
    assert_eq!(out.report.workers[1].items_done, 10);
}

#[test]
fn worker_keeps_going_when_configured() {
    let mut bad = Sq::new(0, 0);
    bad.fail_on = vec![3];
    let mut good = Sq::new(1, 3);
    good.wait_for = Some(bad.failed.clone());
    let workers = vec![bad, good];
    let items: Vec<u64> = (0..20).collect();
    let o = PoolOptions {
        stop_worker_on_error: false,
        ..opts()
    };
    let out = ReplicaPool::run(workers, items, &o).unwrap();
    assert!(out.results.iter().all(|r| r.is_done()));
    assert!(out.report.workers[0].stopped.is_none());
    assert!(out.report.workers[0].items_done > 0);
    // Item 3 can only have been done by worker 1.
    assert!(matches!(out.results[3], ItemResult::Done { worker: 1, .. }));
}

#[test]
fn item_failing_everywhere_is_failed_with_every_error() {
    let workers: Vec<Sq> = (0..3)
        .map(|i| {
            let mut w = Sq::new(i, 1);
            w.fail_on = vec![7];
            w
        })
        .collect();
    let items: Vec<u64> = (0..10).collect();
    let o = PoolOptions {
        stop_worker_on_error: false,
        ..opts()
    };
    let out = ReplicaPool::run(workers, items, &o).unwrap();
    assert_eq!(out.report.items_done, 9);
    assert_eq!(out.report.items_failed, 1);
    match &out.results[7] {
        ItemResult::Failed { errors } => {
            assert_eq!(errors.len(), 3, "{errors:?}");
            let mut ws: Vec<_> = errors.iter().map(|e| e.worker.unwrap()).collect();
            ws.sort();
            assert_eq!(ws, vec![0, 1, 2]);
            assert!(errors.iter().all(|e| e.message.contains("item 7")));
        }
        other => panic!("expected Failed, got {other:?}"),
    }
}

#[test]
fn max_attempts_limits_retries() {
    let workers: Vec<Sq> = (0..3)
        .map(|i| {
            let mut w = Sq::new(i, 0);
            w.fail_on = vec![0];
            w
        })
        .collect();
    let o = PoolOptions {
        stop_worker_on_error: false,
        max_attempts: Some(2),
        ..opts()
    };
    let out = ReplicaPool::run(workers, vec![0u64], &o).unwrap();
    match &out.results[0] {
        ItemResult::Failed { errors } => assert_eq!(errors.len(), 2),
        other => panic!("expected Failed, got {other:?}"),
    }
}

#[test]
fn all_workers_dead_leaves_remaining_items_failed_with_reason() {
    let workers: Vec<Sq> = (0..2)
        .map(|i| {
            let mut w = Sq::new(i, 1);
            w.fail_on = (0..100).collect();
            w
        })
        .collect();
    let items: Vec<u64> = (0..6).collect();
    let out = ReplicaPool::run(workers, items, &opts()).unwrap();
    assert_eq!(out.report.items_done, 0);
    assert_eq!(out.report.items_failed, 6);
    for r in &out.results {
        match r {
            ItemResult::Failed { errors } => {
                assert!(!errors.is_empty());
                // Items that no worker tried carry the pool's reason.
                if errors.iter().all(|e| e.worker.is_none()) {
                    assert!(errors[0].message.contains("no worker left"));
                }
            }
            other => panic!("expected Failed, got {other:?}"),
        }
    }
    assert!(out.report.workers.iter().all(|w| w.stopped.is_some()));
}

#[test]
fn panicking_worker_is_caught_and_stopped() {
    let mut bad = Sq::new(0, 0);
    bad.fail_on = vec![0, 1, 2];
    bad.panic = true;
    let workers = vec![bad, Sq::new(1, 2)];
    let out = ReplicaPool::run(workers, (0..5u64).collect(), &opts()).unwrap();
    assert!(out.results.iter().all(|r| r.is_done()));
    let w0 = &out.report.workers[0];
    assert!(w0.stopped.as_deref().unwrap().contains("panicked: boom"));
}

#[test]
fn no_workers_is_an_error_and_no_items_is_fine() {
    let err = ReplicaPool::run(Vec::<Sq>::new(), vec![1u64], &opts()).unwrap_err();
    assert!(matches!(err, DistError::NoWorkers { items: 1 }));
    assert!(err.to_string().contains("at least one worker"));
    let out = ReplicaPool::run(vec![Sq::new(0, 0)], Vec::<u64>::new(), &opts()).unwrap();
    assert!(out.results.is_empty());
    let zero = PoolOptions {
        max_attempts: Some(0),
        ..opts()
    };
    assert!(matches!(
        ReplicaPool::run(vec![Sq::new(0, 0)], vec![1u64], &zero),
        Err(DistError::ZeroAttempts)
    ));
}

/// A worker that borrows its replica, which stays usable after the run.
struct Borrowing<'a> {
    calls: &'a AtomicUsize,
}

impl Worker<u32, u32> for Borrowing<'_> {
    fn name(&self) -> String {
        "GPU b".into()
    }
    fn process(&mut self, item: &u32) -> Result<u32, BoxError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        Ok(item + 1)
    }
}

#[test]
fn workers_may_borrow() {
    let calls = AtomicUsize::new(0);
    let workers = vec![Borrowing { calls: &calls }, Borrowing { calls: &calls }];
    let out = ReplicaPool::run(workers, vec![1, 2, 3], &opts()).unwrap();
    let got: Vec<u32> = out
        .results
        .into_iter()
        .map(|r| r.into_result().unwrap())
        .collect();
    assert_eq!(got, vec![2, 3, 4]);
    assert_eq!(calls.load(Ordering::SeqCst), 3);
}
