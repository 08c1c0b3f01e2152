//! Rendezvous and collectives with ranks as threads of one process, on 127.0.0.1. Every group
//! gets a recording failure handler at once (the default one would end the test process).
//! Dead and stalled processes are tested with real processes in `ranks.rs`.

use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use fleet_dist::{
    pick_free_port, rendezvous, DistError, Group, Launcher, PeerFailure, RendezvousFault,
    RendezvousOptions, World,
};

fn world(rank: usize, world_size: usize, port: u16) -> World {
    World {
        rank,
        world_size,
        local_rank: rank,
        local_world_size: world_size,
        node_rank: 0,
        nnodes: 1,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        launcher: Launcher::Manual,
    }
}

fn opts(fingerprint: &str, failure_ms: u64) -> RendezvousOptions {
    RendezvousOptions {
        timeout: Duration::from_secs(10),
        heartbeat_interval: Duration::from_millis(100),
        failure_timeout: Duration::from_millis(failure_ms),
        ..RendezvousOptions::new(fingerprint, format!("config {fingerprint}"))
    }
}

type Seen = Arc<Mutex<Vec<PeerFailure>>>;

fn record(group: &Group) -> Seen {
    let seen: Seen = Arc::default();
    let s = seen.clone();
    group.on_failure(Box::new(move |pf| s.lock().unwrap().push(pf.clone())));
    seen
}

/// Runs `f(rank, group)` on `n` threads after a rendezvous; returns their results in rank order.
fn with_ranks<T: Send + 'static>(
    n: usize,
    o: RendezvousOptions,
    f: impl Fn(usize, Group, Seen) -> T + Send + Sync + 'static,
) -> Vec<T> {
    let port = pick_free_port().unwrap();
    let f = Arc::new(f);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            let (f, o) = (f.clone(), o.clone());
            thread::spawn(move || {
                let payload = (r == 0).then(|| b"nccl-unique-id".to_vec());
                let g = rendezvous(&world(r, n, port), &o, payload).unwrap();
                let seen = record(&g);
                f(r, g, seen)
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

fn contribution(rank: usize, len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| {
            ((i * 7919 + rank * 104_729) % 10_007) as f32 * 1.000_123e-3 - 5.0 / (rank + 1) as f32
        })
        .collect()
}

#[test]
fn collectives_agree_bitwise_with_a_rank_order_sum() {
    const LEN: usize = 1_000_000;
    let t = Instant::now();
    let out = with_ranks(3, opts("A", 5000), |r, g, seen| {
        assert_eq!(g.root_payload(), b"nccl-unique-id");
        assert_eq!((g.rank(), g.world_size(), g.peers().len()), (r, 3, 3));
        assert_eq!(g.world().rank, r);
        assert_eq!(g.peers()[r].pid, std::process::id());
        g.barrier().unwrap();
        let b = g
            .broadcast_bytes((r == 0).then(|| b"from root".to_vec()))
            .unwrap();
        assert_eq!(b, b"from root");
        let gathered = g.all_gather_bytes(vec![r as u8; r]).unwrap();
        assert_eq!(gathered, vec![vec![], vec![1u8], vec![2u8, 2]]);
        let mut big = contribution(r, LEN);
        g.all_reduce_sum_f32(&mut big).unwrap();
        let mut small = vec![0.1f64 * (r + 1) as f64, 1e300, -1e300];
        g.all_reduce_sum_f64(&mut small).unwrap();
        let mut empty: Vec<f32> = Vec::new();
        g.all_reduce_sum_f32(&mut empty).unwrap();
        g.barrier().unwrap();
        assert!(seen.lock().unwrap().is_empty());
        g.finish().unwrap();
        (big, small)
    });
    let expected: Vec<f32> = {
        let (a, b, c) = (
            contribution(0, LEN),
            contribution(1, LEN),
            contribution(2, LEN),
        );
        (0..LEN).map(|i| (a[i] + b[i]) + c[i]).collect()
    };
    for (r, (big, small)) in out.iter().enumerate() {
        assert!(
            big.iter()
                .zip(&expected)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "rank {r}'s sum differs from ((x0 + x1) + x2)"
        );
        let a = |r: usize| 0.1f64 * (r + 1) as f64;
        assert_eq!(small[0].to_bits(), ((a(0) + a(1)) + a(2)).to_bits());
        assert_eq!(small[1..], [3e300, -3e300]);
    }
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
}

#[test]
fn a_group_can_be_shared_between_threads() {
    fn send_sync<T: Send + Sync>() {}
    send_sync::<Group>();
    send_sync::<PeerFailure>();
    send_sync::<DistError>();
}

#[test]
fn a_world_of_one_needs_no_network() {
    let g = rendezvous(
        &World::single(),
        &RendezvousOptions::default(),
        Some(vec![9]),
    )
    .unwrap();
    assert_eq!(g.root_payload(), [9]);
    g.barrier().unwrap();
    let mut x = [1.5f32, 2.0];
    g.all_reduce_sum_f32(&mut x).unwrap();
    assert_eq!(x, [1.5, 2.0]);
    assert_eq!(g.all_gather_bytes(vec![1]).unwrap(), vec![vec![1]]);
    assert_eq!(g.broadcast_bytes(Some(vec![2])).unwrap(), vec![2]);
    assert!(matches!(
        g.broadcast_bytes(None),
        Err(DistError::BadCall { .. })
    ));
    g.finish().unwrap();
}

fn rendezvous_errors(worlds: Vec<(World, RendezvousOptions)>) -> Vec<String> {
    let handles: Vec<_> = worlds
        .into_iter()
        .map(|(w, o)| {
            thread::spawn(move || {
                rendezvous(&w, &o, None)
                    .map(|_| ())
                    .unwrap_err()
                    .to_string()
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().unwrap()).collect()
}

#[test]
fn another_config_duplicate_rank_or_world_size_fails_every_rank() {
    let port = pick_free_port().unwrap();
    let errs = rendezvous_errors(vec![
        (world(0, 3, port), opts("A", 2000)),
        (world(1, 3, port), opts("B", 2000)),
        (world(2, 3, port), opts("A", 2000)),
    ]);
    for e in &errs {
        assert!(
            e.contains("rank 1 (host") && e.contains("runs another config or commit"),
            "{e}"
        );
        assert!(e.contains("`config B`") && e.contains("`config A`"), "{e}");
    }

    // Rank 2 never comes, so the world cannot complete before the duplicate is seen.
    let port = pick_free_port().unwrap();
    let mut short = opts("A", 2000);
    short.timeout = Duration::from_millis(1500);
    let errs = rendezvous_errors(vec![
        (world(0, 3, port), short.clone()),
        (world(1, 3, port), short.clone()),
        (world(1, 3, port), short),
    ]);
    for e in &errs {
        assert!(e.contains("rank 1 was claimed twice"), "{e}");
    }

    let port = pick_free_port().unwrap();
    let errs = rendezvous_errors(vec![
        (world(0, 2, port), opts("A", 2000)),
        (world(1, 3, port), opts("A", 2000)),
    ]);
    for e in &errs {
        assert!(
            e.contains("rank 1 (host") && e.contains("world size of 3 but rank 0 with 2"),
            "{e}"
        );
    }
}

#[test]
fn a_process_that_comes_after_the_world_is_complete_is_refused() {
    let port = pick_free_port().unwrap();
    let o = opts("A", 5000);
    let handles: Vec<_> = (0..2)
        .map(|r| {
            let o = o.clone();
            thread::spawn(move || {
                let g = rendezvous(&world(r, 2, port), &o, None).unwrap();
                let seen = record(&g);
                (g, seen)
            })
        })
        .collect();
    let groups: Vec<(Group, Seen)> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    // An old run, or a second launcher, claims rank 1 again: refused at once, with a reason.
    let t = Instant::now();
    let e = rendezvous(&world(1, 2, port), &o, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("tried to join as rank 1 after all 2 ranks had joined"),
        "{e}"
    );
    assert!(e.contains(&format!("pid {}", std::process::id())), "{e}");
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    // The running world goes on.
    thread::scope(|s| {
        for (g, _) in &groups {
            s.spawn(|| g.barrier().unwrap());
        }
    });
    let finished: Vec<_> = groups
        .into_iter()
        .map(|(g, seen)| thread::spawn(move || (g.finish(), seen)))
        .collect();
    for h in finished {
        let (res, seen) = h.join().unwrap();
        res.unwrap();
        assert!(seen.lock().unwrap().is_empty());
    }
}

#[test]
fn an_absent_rank_is_named_after_the_timeout() {
    let port = pick_free_port().unwrap();
    let mut o = opts("A", 2000);
    o.timeout = Duration::from_millis(1500);
    let t = Instant::now();
    let errs = rendezvous_errors(vec![
        (world(0, 3, port), o.clone()),
        (world(2, 3, port), o.clone()),
    ]);
    for e in &errs {
        assert!(e.contains("rank 1 of 3 did not arrive"), "{e}");
    }
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    // The structured fault, for callers that match on it.
    let mut quick = o.clone();
    quick.timeout = Duration::from_millis(200);
    match rendezvous(&world(0, 2, pick_free_port().unwrap()), &quick, None) {
        Err(DistError::Rendezvous(f)) => {
            assert!(
                matches!(*f, RendezvousFault::Missing { ref missing, world_size: 2, .. } if missing == &[1]),
                "{f:?}"
            )
        }
        other => panic!("{other:?}"),
    }
    // Nobody listening: the rank names rank 0's address.
    let e = rendezvous(&world(1, 2, pick_free_port().unwrap()), &o, None)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rank 1 could not reach rank 0 at 127.0.0.1:"),
        "{e}"
    );
}

#[test]
fn a_buffer_of_another_length_fails_every_rank_naming_it() {
    let out = with_ranks(3, opts("A", 3000), |r, g, seen| {
        g.barrier().unwrap();
        let mut x = vec![1.0f32; if r == 2 { 2 } else { 3 }];
        let err = g.all_reduce_sum_f32(&mut x).unwrap_err();
        assert!(matches!(err, DistError::PeerFailed(_)), "{err}");
        // Later collectives refuse at once.
        assert!(g.barrier().is_err());
        let seen = seen.lock().unwrap().clone();
        (err.to_string(), seen)
    });
    for (r, (err, seen)) in out.iter().enumerate() {
        assert_eq!(seen.len(), 1, "rank {r}: the handler runs once: {seen:?}");
        assert_eq!(seen[0].rank, 2, "rank {r}: {seen:?}");
        assert!(
            err.contains("with 8 bytes while rank 0 has 12"),
            "rank {r}: {err}"
        );
    }
}

#[test]
fn a_rank_that_skips_a_collective_is_named_after_the_failure_timeout() {
    let t = Instant::now();
    let out = with_ranks(2, opts("A", 800), |r, g, seen| {
        if r == 0 {
            let err = g.barrier().unwrap_err().to_string();
            assert!(
                err.contains("rank 1 (host")
                    && err.contains("did not contribute to barrier #1 within 0.8 s"),
                "{err}"
            );
        } else {
            // Alive (heartbeat running) but never joins the barrier; learns from rank 0.
            let t = Instant::now();
            while seen.lock().unwrap().is_empty() && t.elapsed() < Duration::from_secs(10) {
                thread::sleep(Duration::from_millis(20));
            }
        }
        let seen = seen.lock().unwrap().clone();
        seen
    });
    for seen in out {
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].rank, 1);
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
}

#[test]
fn finish_is_clean_and_drop_without_finish_is_a_failure() {
    // Clean: ranks finish at different times; nobody sees a failure.
    let out = with_ranks(3, opts("A", 1000), |r, g, seen| {
        thread::sleep(Duration::from_millis(300 * r as u64));
        let seen2 = seen.clone();
        g.finish().unwrap();
        thread::sleep(Duration::from_millis(1500));
        let v = seen2.lock().unwrap().clone();
        v
    });
    assert!(out.iter().all(|s| s.is_empty()), "{out:?}");

    // Rank 2 leaves through an error (drops its group): ranks 0 and 1 are told it exited.
    let out = with_ranks(3, opts("A", 5000), |r, g, seen| {
        g.barrier().unwrap(); // every rank has its recording handler
        if r == 2 {
            drop(g);
            return Vec::new();
        }
        let t = Instant::now();
        while seen.lock().unwrap().is_empty() && t.elapsed() < Duration::from_secs(10) {
            thread::sleep(Duration::from_millis(20));
        }
        assert!(g.barrier().is_err());
        let v = seen.lock().unwrap().clone();
        v
    });
    for seen in &out[..2] {
        assert_eq!(seen.len(), 1, "{seen:?}");
        assert_eq!(seen[0].rank, 2);
        assert!(seen[0].reason.contains("exited"), "{}", seen[0]);
    }
}
