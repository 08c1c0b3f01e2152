//! Issue 24: a run directory's manifest made on logical devices says so, so that no record
//! made on them passes for one of real GPUs. Process-wide state: a test binary of its own.

use fleet_runs::Manifest;
use fleet_topology::logical::{install, LogicalGpus, LABEL, LOGICAL_GPUS_ENV};

#[test]
fn manifests_made_on_logical_devices_say_so() {
    std::env::remove_var(LOGICAL_GPUS_ENV);
    assert!(!Manifest::new("test").about.contains_key("logical_devices"));
    install(LogicalGpus::parse_flag("3:16GiB").unwrap()).unwrap();
    let m = Manifest::new("test");
    let said = m.about["logical_devices"].as_str().unwrap();
    assert!(
        said.contains(LABEL)
            && said.contains("3 devices")
            && said.contains("--logical-gpus 3:16GiB"),
        "{said}"
    );
}
