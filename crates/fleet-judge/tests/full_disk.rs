//! Issue 23: a records file that cannot be written (a full disk) ends the run at its first
//! failed write, with an error naming the file, instead of judging every remaining item and
//! keeping none of it.
//!
//! The disk fills for real: this test binary (one test, so nothing else shares the process)
//! lowers its own file-size limit (`RLIMIT_FSIZE`, SIGXFSZ ignored), so a write past it fails
//! with EFBIG in the kernel, as a write to a full disk fails with ENOSPC.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use fleet_dist::{DistError, ShardSpec};
use fleet_judge::records::RECORDS_FILE;
use fleet_judge::run::{RunError, RunOptions, Session, SessionOptions};

const MODEL: &str = "test/scripted@0";

#[test]
fn a_failed_record_write_stops_the_run_at_once_and_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let items: Vec<GenItem> = (1..=60).map(|n| GenItem { n, category: "A" }).collect();
    write_benchmark(dir.path(), &items);
    let prompts = prompt_set(dir.path(), "single.toml", SINGLE_SET);
    let mut table = Table::new();
    for n in 1..=60u8 {
        table.insert((n, "score", false), Ok(format!("Score: {}", n % 10)));
    }
    let table = Arc::new(table);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let loaded = load(dir.path());
    let out = dir.path().join("out");
    let session = Session::open(&out, spec(prompts, MODEL), &SessionOptions::default()).unwrap();
    let plan = session.plan(&loaded, ShardSpec::single()).unwrap();

    // Room for a few records (each is ~600 bytes), not for 60.
    const LIMIT: u64 = 4096;
    // SAFETY: plain libc calls on this process; the test is alone in its binary.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: LIMIT,
            rlim_max: libc::RLIM_INFINITY,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    let judge = Scripted::new("judge 0", MODEL, table, seen.clone());
    let err = session
        .run(
            vec![judge],
            &plan,
            &RunOptions {
                batch_size: 2,
                progress: false,
                ..RunOptions::default()
            },
        )
        .unwrap_err();
    // SAFETY: as above; restores the limit.
    unsafe {
        let lim = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        libc::setrlimit(libc::RLIMIT_FSIZE, &lim);
    }

    let text = err.to_string();
    assert!(
        matches!(err, RunError::Dist(DistError::RunStopped { .. })),
        "{text}"
    );
    assert!(text.contains(RECORDS_FILE), "names the file: {text}");
    assert!(text.contains("judge 0"), "names the worker: {text}");
    // The batch whose record could not be written was the last one judged: the run did not go
    // on through the other batches.
    let kept = std::fs::read(out.join(RECORDS_FILE)).unwrap();
    let lines = kept.iter().filter(|&&b| b == b'\n').count();
    assert!(lines < 10, "{lines} records fit");
    let judged = seen.lock().unwrap().len();
    assert!(
        judged <= lines + 2,
        "{judged} requests judged for {lines} records kept: the run went on after the failure"
    );
    // Every record that was written is whole (the write that failed wrote nothing).
    assert!(kept.ends_with(b"\n"));
}
