//! Issue 24: a logical-device mapping installs after the devices were listed (as a test binary
//! or a tool does), is passed on to child processes, and a second, different one is refused.
//! Process-wide state: a test binary of its own.

use fleet_topology::logical::{install, installed, LogicalGpus, LOGICAL_GPUS_ENV};

#[test]
fn a_mapping_installs_after_devices_were_listed_and_only_once() {
    std::env::remove_var(LOGICAL_GPUS_ENV);
    // The devices are listed first: no mapping yet.
    let _ = fleet_topology::discover();
    assert!(installed().is_none());
    let l = LogicalGpus::parse_flag("2:1GiB").unwrap();
    install(l.clone()).unwrap();
    assert_eq!(installed().map(|i| &i.devices), Some(&l.devices));
    // Child processes get it through the environment.
    let passed: LogicalGpus =
        serde_json::from_str(&std::env::var(LOGICAL_GPUS_ENV).unwrap()).unwrap();
    assert_eq!(passed, l);
    // The same again is fine; another is refused, naming both.
    install(l).unwrap();
    let e = install(LogicalGpus::parse_flag("3").unwrap()).unwrap_err();
    let e = e.to_string();
    assert!(
        e.contains("--logical-gpus 3") && e.contains("--logical-gpus 2:1GiB"),
        "{e}"
    );
}
