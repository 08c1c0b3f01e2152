//! Ranks as real processes, for real: this test program is its own launcher and its own rank
//! (`harness = false`; `FLEET_DIST_TEST_ROLE` selects the role). The test runs the launcher role
//! in a child process and reads its output — the ranks' lines come through with their
//! `[rank K] ` prefix — and the reports the ranks write to a temporary directory.

use std::collections::HashMap;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use fleet_dist::{
    launch_with_grace, pick_free_port, rendezvous, strip_launcher_args, LaunchSpec, Launcher,
    RendezvousOptions, World,
};

const ROLE: &str = "FLEET_DIST_TEST_ROLE";
const SCENARIO: &str = "FLEET_DIST_TEST_SCENARIO";
const OUT: &str = "FLEET_DIST_TEST_OUT";
const NPROC: &str = "FLEET_DIST_TEST_NPROC";
const NNODES: &str = "FLEET_DIST_TEST_NNODES";
const NODE_RANK: &str = "FLEET_DIST_TEST_NODE_RANK";
const PORT: &str = "FLEET_DIST_TEST_PORT";
const GPU_IDS: &str = "FLEET_DIST_TEST_GPU_IDS";

const LEN: usize = 200_000;

fn main() {
    match std::env::var(ROLE).as_deref() {
        Ok("launcher") => launcher_role(),
        Ok("rank") => rank_role(),
        _ => {}
    }
    let t = Instant::now();
    let tests: [(&str, fn()); 7] = [
        ("three_launched_ranks_agree", three_launched_ranks_agree),
        (
            "a_closed_stdout_does_not_stop_the_launcher",
            a_closed_stdout_does_not_stop_the_launcher,
        ),
        (
            "a_rank_that_never_arrives_is_named",
            a_rank_that_never_arrives_is_named,
        ),
        (
            "a_rank_with_another_config_fails_every_rank",
            a_rank_with_another_config_fails_every_rank,
        ),
        (
            "a_dead_rank_ends_the_others_within_the_timeout",
            a_dead_rank_ends_the_others_within_the_timeout,
        ),
        (
            "a_stalled_rank_is_detected_and_killed",
            a_stalled_rank_is_detected_and_killed,
        ),
        (
            "two_launchers_make_one_world_of_two_nodes",
            two_launchers_make_one_world_of_two_nodes,
        ),
    ];
    for (name, test) in tests {
        let t = Instant::now();
        test();
        println!("test {name} ... ok ({:.1} s)", t.elapsed().as_secs_f64());
    }
    println!(
        "ranks: {} tests passed in {:.1} s",
        tests.len(),
        t.elapsed().as_secs_f64()
    );
}

// ---------------------------------------------------------------- roles

fn env_usize(var: &str, default: usize) -> usize {
    std::env::var(var)
        .ok()
        .map_or(default, |v| v.parse().unwrap())
}

/// Runs `launch` for this node and exits with the report's code.
fn launcher_role() -> ! {
    let nproc = env_usize(NPROC, 3);
    let gpu_ids = std::env::var(GPU_IDS)
        .ok()
        .map(|v| v.split(',').map(|x| x.parse().unwrap()).collect());
    // Our own flags are stripped before the ranks see the arguments.
    let raw: Vec<String> = ["--nproc-per-node", "3", "--tag", "x y", "--standalone"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let spec = LaunchSpec {
        nproc_per_node: nproc,
        nnodes: env_usize(NNODES, 1),
        node_rank: env_usize(NODE_RANK, 0),
        master_addr: "127.0.0.1".into(),
        master_port: env_usize(PORT, 0) as u16,
        gpu_ids,
        program: std::env::current_exe().unwrap(),
        args: strip_launcher_args(&raw, &["--nproc-per-node"], &["--standalone"]),
        env: vec![
            (ROLE.into(), "rank".into()),
            // The launcher sets 0 whatever the caller asks.
            ("NCCL_NVLS_ENABLE".into(), "1".into()),
        ],
    };
    let report = launch_with_grace(&spec, Duration::from_millis(1000)).unwrap();
    // Not println!: the closed-stdout test closes ours.
    let say = |s: String| {
        let _ = writeln!(std::io::stdout(), "{s}");
    };
    say(format!("REPORT {report}"));
    if let Some(f) = &report.first_failure {
        say(format!("FIRST_FAILURE rank={} code={:?}", f.rank, f.code()));
        let e = report.clone().into_result().unwrap_err().to_string();
        say(format!("INTO_RESULT {e}"));
    } else {
        report.clone().into_result().unwrap();
    }
    for r in &report.ranks {
        say(format!(
            "EXIT rank={} code={:?} signal={:?} killed={}",
            r.rank,
            r.code(),
            r.signal(),
            r.killed_by_launcher
        ));
    }
    std::process::exit(report.exit_code());
}

fn rank_role() -> ! {
    let world = World::from_env()
        .unwrap()
        .expect("the launcher sets RANK etc.");
    let scenario = std::env::var(SCENARIO).unwrap();
    let out = PathBuf::from(std::env::var(OUT).unwrap());
    let mut opts = RendezvousOptions::new("fp-A", "commit aaa, config A")
        .with_env_overrides()
        .unwrap();
    opts.heartbeat_interval = Duration::from_millis(200);
    if scenario == "config" && world.rank == 1 {
        opts.fingerprint = "fp-B".into();
        opts.describe = "commit bbb, config B".into();
    }
    if scenario == "missing" && world.rank == 2 {
        println!("rank 2 stays away");
        std::process::exit(0);
    }
    let payload = world.is_main().then(|| b"nccl-unique-id-0123".to_vec());
    let group = match rendezvous(&world, &opts, payload) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("rendezvous error: {e}");
            std::process::exit(3);
        }
    };
    println!("rank {} joined", world.rank);
    match scenario.as_str() {
        "ok" | "nodes" => {
            let mut x = contribution(world.rank);
            group.all_reduce_sum_f32(&mut x).unwrap();
            let mut y = vec![world.rank as f64 + 0.25; 3];
            group.all_reduce_sum_f64(&mut y).unwrap();
            let gathered = group
                .all_gather_bytes(format!("r{}", world.rank).into_bytes())
                .unwrap();
            let b = group
                .broadcast_bytes(world.is_main().then(|| b"hello".to_vec()))
                .unwrap();
            group.barrier().unwrap();
            let env = |k: &str| std::env::var(k).unwrap_or_default();
            let report = serde_json::json!({
                "rank": world.rank,
                "world_size": world.world_size,
                "local_rank": world.local_rank,
                "local_world_size": world.local_world_size,
                "node_rank": world.node_rank,
                "nnodes": world.nnodes,
                "launcher_fleet": world.launcher == Launcher::Fleet,
                "cuda_visible_devices": env("CUDA_VISIBLE_DEVICES"),
                "nccl_nvls_enable": env("NCCL_NVLS_ENABLE"),
                "args": std::env::args().skip(1).collect::<Vec<_>>(),
                "payload": String::from_utf8_lossy(group.root_payload()),
                "sum_bits": x.iter().map(|v| v.to_bits()).fold(0u64, |h, b| h.wrapping_mul(1_000_003).wrapping_add(b as u64)),
                "sum_first": x[..4].iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "sum_f64": y,
                "gathered": gathered.iter().map(|g| String::from_utf8_lossy(g).into_owned()).collect::<Vec<_>>(),
                "broadcast": String::from_utf8_lossy(&b),
            });
            std::fs::write(
                out.join(format!("rank{}.json", world.rank)),
                serde_json::to_vec(&report).unwrap(),
            )
            .unwrap();
            group.finish().unwrap();
            std::process::exit(0);
        }
        "dead" | "abort" | "stall" => {
            group.barrier().unwrap();
            let victim = if scenario == "stall" { 1 } else { 2 };
            if world.rank == victim {
                std::thread::sleep(Duration::from_millis(300));
                if scenario == "dead" {
                    eprintln!("rank {victim} dies now");
                    std::process::exit(7);
                }
                if scenario == "abort" {
                    eprintln!("rank {victim} aborts now");
                    std::process::abort();
                }
                eprintln!("rank {victim} stops itself now");
                let pid = std::process::id().to_string();
                Command::new("kill").args(["-STOP", &pid]).status().unwrap();
                std::thread::sleep(Duration::from_secs(120));
            } else if world.rank == 0 {
                // Blocked in a collective the victim never joins.
                let e = group.barrier().unwrap_err();
                eprintln!("barrier returned: {e}");
            } else {
                // Busy elsewhere (a long computation, NCCL): only the heartbeat can tell.
                std::thread::sleep(Duration::from_secs(120));
            }
            eprintln!(
                "rank {} was not stopped by the failure detection",
                world.rank
            );
            std::process::exit(99);
        }
        other => panic!("unknown scenario {other}"),
    }
}

fn contribution(rank: usize) -> Vec<f32> {
    (0..LEN)
        .map(|i| ((i * 31 + rank * 977) % 1013) as f32 * 0.0137 - 1.0 / (rank + 3) as f32)
        .collect()
}

// ---------------------------------------------------------------- helpers

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// Starts the launcher role with `env` and waits for it (at most `limit`).
fn spawn_launcher(scenario: &str, out: &Path, env: &[(&str, String)]) -> std::process::Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.env(ROLE, "launcher")
        .env(SCENARIO, scenario)
        .env(OUT, out)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("FLEET_DIST_TIMEOUT")
        .env_remove("FLEET_DIST_RENDEZVOUS_TIMEOUT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

fn wait(mut child: std::process::Child, limit: Duration) -> Run {
    let t = Instant::now();
    let mut so = child.stdout.take().unwrap();
    let mut se = child.stderr.take().unwrap();
    let a = std::thread::spawn(move || {
        let mut s = String::new();
        so.read_to_string(&mut s).unwrap();
        s
    });
    let b = std::thread::spawn(move || {
        let mut s = String::new();
        se.read_to_string(&mut s).unwrap();
        s
    });
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("launcher still running after {limit:?}; stderr so far unavailable (killed)");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let elapsed = t.elapsed();
    let run = Run {
        code: status.code(),
        stdout: a.join().unwrap(),
        stderr: b.join().unwrap(),
        elapsed,
    };
    eprintln!(
        "--- launcher exit {:?} after {:.1} s\n--- stdout\n{}--- stderr\n{}---",
        run.code,
        run.elapsed.as_secs_f64(),
        run.stdout,
        run.stderr
    );
    run
}

fn run_launcher(scenario: &str, out: &Path, env: &[(&str, String)], limit: Duration) -> Run {
    wait(spawn_launcher(scenario, out, env), limit)
}

fn read_report(out: &Path, rank: usize) -> serde_json::Value {
    let p = out.join(format!("rank{rank}.json"));
    serde_json::from_slice(&std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap()
}

fn lines_of<'a>(text: &'a str, prefix: &str) -> Vec<&'a str> {
    text.lines().filter(|l| l.starts_with(prefix)).collect()
}

// ---------------------------------------------------------------- tests

/// (a) 3 ranks through `launch`: rendezvous, payload, identical sums, all-gather, broadcast;
/// each rank saw its RANK/LOCAL_RANK/CUDA_VISIBLE_DEVICES and NCCL_NVLS_ENABLE=0.
fn three_launched_ranks_agree() {
    let dir = tempfile::tempdir().unwrap();
    let port = pick_free_port().unwrap();
    let run = run_launcher(
        "ok",
        dir.path(),
        &[
            (PORT, port.to_string()),
            (NPROC, "3".into()),
            (GPU_IDS, "2,0,1".into()),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(0));
    assert!(run.stdout.contains("REPORT all 3 ranks exited with code 0"));
    for r in 0..3 {
        assert!(
            run.stdout
                .contains(&format!("[rank {r}] rank {r} joined\n")),
            "rank {r}'s output is forwarded with its prefix"
        );
    }
    let expected: Vec<f32> = {
        let c: Vec<Vec<f32>> = (0..3).map(contribution).collect();
        (0..LEN).map(|i| (c[0][i] + c[1][i]) + c[2][i]).collect()
    };
    let hash = expected.iter().map(|v| v.to_bits()).fold(0u64, |h, b| {
        h.wrapping_mul(1_000_003).wrapping_add(b as u64)
    });
    for r in 0..3 {
        let rep = read_report(dir.path(), r);
        assert_eq!(rep["rank"], r);
        assert_eq!(rep["world_size"], 3);
        assert_eq!(rep["local_rank"], r);
        assert_eq!(rep["local_world_size"], 3);
        assert_eq!(rep["nnodes"], 1);
        assert_eq!(rep["launcher_fleet"], true);
        assert_eq!(rep["cuda_visible_devices"], ["2", "0", "1"][r]);
        assert_eq!(rep["nccl_nvls_enable"], "0");
        assert_eq!(rep["args"], serde_json::json!(["--tag", "x y"]));
        assert_eq!(rep["payload"], "nccl-unique-id-0123");
        assert_eq!(
            rep["sum_bits"], hash,
            "rank {r}: sum differs from ((x0 + x1) + x2)"
        );
        assert_eq!(rep["sum_f64"], serde_json::json!([3.75, 3.75, 3.75]));
        assert_eq!(rep["gathered"], serde_json::json!(["r0", "r1", "r2"]));
        assert_eq!(rep["broadcast"], "hello");
    }
}

/// The launcher's stdout closed (a `| head` that ended): forwarding goes on silently, the
/// ranks finish, the launcher exits 0.
fn a_closed_stdout_does_not_stop_the_launcher() {
    let dir = tempfile::tempdir().unwrap();
    let mut child = spawn_launcher(
        "ok",
        dir.path(),
        &[
            (PORT, pick_free_port().unwrap().to_string()),
            (NPROC, "2".into()),
        ],
    );
    drop(child.stdout.take());
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    let status = child.wait().unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_eq!(read_report(dir.path(), 1)["rank"], 1);
}

/// (b) Rank 2 never calls the rendezvous: ranks 0 and 1 fail after the timeout naming it.
fn a_rank_that_never_arrives_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_launcher(
        "missing",
        dir.path(),
        &[
            (PORT, pick_free_port().unwrap().to_string()),
            ("FLEET_DIST_RENDEZVOUS_TIMEOUT", "2".into()),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(3));
    for r in 0..2 {
        let lines = lines_of(&run.stderr, &format!("[rank {r}] rendezvous error:"));
        assert_eq!(lines.len(), 1, "rank {r}");
        assert!(
            lines[0].contains("rank 2 of 3 did not arrive at rank 0 (127.0.0.1:"),
            "{}",
            lines[0]
        );
    }
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
}

/// (c) Rank 1 runs another config: every rank fails with a message naming it and both
/// descriptions.
fn a_rank_with_another_config_fails_every_rank() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_launcher(
        "config",
        dir.path(),
        &[(PORT, pick_free_port().unwrap().to_string())],
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(3));
    for r in 0..3 {
        let lines = lines_of(&run.stderr, &format!("[rank {r}] rendezvous error:"));
        assert_eq!(lines.len(), 1, "rank {r}");
        let l = lines[0];
        assert!(
            l.contains("rank 1 (host ") && l.contains("runs another config or commit than rank 0"),
            "{l}"
        );
        assert!(
            l.contains("`commit bbb, config B`") && l.contains("`commit aaa, config A`"),
            "{l}"
        );
    }
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
}

/// (d) Rank 2 exits after the rendezvous while rank 0 waits in a barrier and rank 1 sleeps:
/// both exit 75 within the failure timeout, naming rank 2.
fn a_dead_rank_ends_the_others_within_the_timeout() {
    for (scenario, first, code) in [
        ("dead", "FIRST_FAILURE rank=2 code=Some(7)", 7),
        ("abort", "FIRST_FAILURE rank=2 code=None", 128 + 6),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let run = run_launcher(
            scenario,
            dir.path(),
            &[
                (PORT, pick_free_port().unwrap().to_string()),
                ("FLEET_DIST_TIMEOUT", "3".into()),
            ],
            Duration::from_secs(30),
        );
        assert!(
            run.stdout.contains(first),
            "{scenario}: the dead rank fails first"
        );
        assert_eq!(run.code, Some(code), "{scenario}");
        assert!(
            run.stdout
                .contains("INTO_RESULT ranks failed on this node (first failure: rank 2 (pid"),
            "{scenario}"
        );
        for r in 0..2 {
            assert!(
                run.stdout.contains(&format!(
                    "EXIT rank={r} code=Some(75) signal=None killed=false"
                )),
                "{scenario}: rank {r} ends itself through the failure handler"
            );
            let lines = lines_of(&run.stderr, &format!("[rank {r}] error: rank 2 (host "));
            assert_eq!(lines.len(), 1, "{scenario}: rank {r}");
            assert!(lines[0].contains("exited"), "{}", lines[0]);
            assert!(
                lines[0].ends_with(&format!("exiting (this is rank {r})")),
                "{}",
                lines[0]
            );
        }
        assert!(!run.stderr.contains("not stopped by the failure detection"));
        assert!(run.elapsed < Duration::from_secs(8), "{:?}", run.elapsed);
    }
}

/// (e) Rank 1 stops itself (SIGSTOP): after the failure timeout (3 s) ranks 0 and 2 exit naming
/// it, and the launcher kills the stopped rank after its grace period.
fn a_stalled_rank_is_detected_and_killed() {
    let dir = tempfile::tempdir().unwrap();
    let run = run_launcher(
        "stall",
        dir.path(),
        &[
            (PORT, pick_free_port().unwrap().to_string()),
            ("FLEET_DIST_TIMEOUT", "3".into()),
        ],
        Duration::from_secs(30),
    );
    assert_eq!(run.code, Some(75));
    for r in [0, 2] {
        assert!(
            run.stdout.contains(&format!("EXIT rank={r} code=Some(75)")),
            "rank {r}"
        );
        let lines = lines_of(&run.stderr, &format!("[rank {r}] error: rank 1 (host "));
        assert_eq!(lines.len(), 1, "rank {r}");
        assert!(
            lines[0].contains("stopped responding: no heartbeat for 3.0 s")
                || lines[0].contains("did not contribute to barrier #2 within 3.0 s"),
            "{}",
            lines[0]
        );
    }
    assert!(run
        .stdout
        .contains("EXIT rank=1 code=None signal=Some(9) killed=true"));
    assert!(run.elapsed >= Duration::from_secs(3), "{:?}", run.elapsed);
    assert!(run.elapsed < Duration::from_secs(10), "{:?}", run.elapsed);
}

/// (f) Two launchers, nnodes = 2, one rank each, over 127.0.0.1: one world of two.
fn two_launchers_make_one_world_of_two_nodes() {
    let dir = tempfile::tempdir().unwrap();
    let port = pick_free_port().unwrap().to_string();
    let node = |rank: usize| {
        spawn_launcher(
            "nodes",
            dir.path(),
            &[
                (PORT, port.clone()),
                (NPROC, "1".into()),
                (NNODES, "2".into()),
                (NODE_RANK, rank.to_string()),
            ],
        )
    };
    // Node 1 first: its rank waits for rank 0.
    let second = node(1);
    std::thread::sleep(Duration::from_millis(300));
    let first = node(0);
    let runs = [
        wait(first, Duration::from_secs(30)),
        wait(second, Duration::from_secs(30)),
    ];
    let mut sums = HashMap::new();
    for (r, run) in runs.iter().enumerate() {
        assert_eq!(run.code, Some(0), "node {r}");
        assert!(run.stdout.contains(&format!("[rank {r}] rank {r} joined")));
        let rep = read_report(dir.path(), r);
        assert_eq!(rep["world_size"], 2);
        assert_eq!(rep["nnodes"], 2);
        assert_eq!(rep["node_rank"], r);
        assert_eq!(rep["local_rank"], 0);
        assert_eq!(rep["local_world_size"], 1);
        assert_eq!(rep["cuda_visible_devices"], "0");
        assert_eq!(rep["payload"], "nccl-unique-id-0123");
        assert_eq!(rep["gathered"], serde_json::json!(["r0", "r1"]));
        sums.insert(r, rep["sum_bits"].clone());
    }
    assert_eq!(sums[&0], sums[&1]);
}
