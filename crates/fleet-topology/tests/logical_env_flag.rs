//! Issue 24: `FLEET_LOGICAL_GPUS` also takes `--logical-gpus`'s own form, so that a test binary
//! (the parity tests with their layers split) runs on logical devices without a fleet parent.
//! Process-wide state: a test binary of its own.

use fleet_topology::logical::{installed, LOGICAL_GPUS_ENV};

#[test]
fn the_flag_form_in_the_environment_is_the_mapping() {
    std::env::set_var(LOGICAL_GPUS_ENV, "3:2GiB@1");
    let l = installed().expect("the flag form parses");
    assert_eq!(l.devices.len(), 3);
    assert!(l.devices.iter().all(|d| d.physical == 1));
    assert!(l.source.contains(LOGICAL_GPUS_ENV), "{}", l.source);
}
