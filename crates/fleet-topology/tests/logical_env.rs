//! Issue 24: a child process whose parent meant logical devices never runs on the physical GPUs
//! instead: a mapping in FLEET_LOGICAL_GPUS that does not parse is an error naming it.
//! Process-wide state: a test binary of its own.

use fleet_topology::logical::LOGICAL_GPUS_ENV;

#[test]
fn a_mapping_from_the_parent_that_does_not_parse_is_an_error() {
    std::env::set_var(LOGICAL_GPUS_ENV, "not json");
    let e = fleet_topology::discover().unwrap_err().to_string();
    assert!(
        e.contains(LOGICAL_GPUS_ENV) && e.contains("not json"),
        "{e}"
    );
}
