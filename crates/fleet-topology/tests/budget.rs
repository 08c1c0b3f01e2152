//! Budget parsing in accelerate's `max_memory` style.

use fleet_topology::*;

#[test]
fn sizes_and_fractions() {
    let p = |s: &str| s.parse::<MemoryLimit>().unwrap();
    assert_eq!(p("10GiB"), MemoryLimit::Bytes(10 * GIB));
    assert_eq!(p("10GB"), MemoryLimit::Bytes(10_000_000_000));
    assert_eq!(p("500MiB"), MemoryLimit::Bytes(500 * MIB));
    assert_eq!(p("500mb"), MemoryLimit::Bytes(500_000_000));
    assert_eq!(p(" 1.5 GiB "), MemoryLimit::Bytes(3 * GIB / 2));
    assert_eq!(p("1024"), MemoryLimit::Bytes(1024));
    assert_eq!(p("0.9"), MemoryLimit::Fraction(0.9));
    assert_eq!(p("90%"), MemoryLimit::Fraction(0.9));
    assert_eq!(p("0.5").resolve(10 * GIB), 5 * GIB);
    assert_eq!(
        p("20GiB").resolve(10 * GIB),
        10 * GIB,
        "capped at the total"
    );
    assert_eq!(parse_bytes("12GiB").unwrap(), 12 * GIB);
}

#[test]
fn bad_values_are_named() {
    for bad in [
        "", "GiB", "10XB", "1.5", "-3GiB", "0GiB", "0", "0%", "0.0", "150%", "1.2.3GB", "ten",
    ] {
        let err = bad.parse::<MemoryLimit>().unwrap_err();
        assert!(
            matches!(&err, TopologyError::BadMemorySize { value, .. } if value == bad),
            "{bad}: {err}"
        );
        assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
    }
    let err = parse_bytes("0.9").unwrap_err().to_string();
    assert!(err.contains("0.9") && err.contains("unit"), "{err}");
}

#[test]
fn max_memory_maps() {
    let m: MaxMemory = "0=10GiB, cuda:1=10GB 2:500MiB,3=0.9,cpu=64GiB"
        .parse()
        .unwrap();
    assert_eq!(
        m.get(DeviceLocation::Cuda(0)),
        Some(MemoryLimit::Bytes(10 * GIB))
    );
    assert_eq!(
        m.get(DeviceLocation::Cuda(1)),
        Some(MemoryLimit::Bytes(10_000_000_000))
    );
    assert_eq!(
        m.get(DeviceLocation::Cuda(2)),
        Some(MemoryLimit::Bytes(500 * MIB))
    );
    assert_eq!(m.budget(DeviceLocation::Cuda(3), 100 * GIB), 90 * GIB);
    assert!(m.allows_cpu_offload());
    assert_eq!(m.budget(DeviceLocation::Cpu, u64::MAX), 64 * GIB);
    // No entry: the total less the default reserve (10%, at least 1 GiB).
    assert_eq!(m.budget(DeviceLocation::Cuda(4), 100 * GIB), 90 * GIB);
    assert_eq!(m.budget(DeviceLocation::Cuda(4), 8 * GIB), 7 * GIB);
    assert_eq!(default_reserve(12 * GIB), 12 * GIB / 10);
    // No cpu entry: nothing offloaded.
    let empty = MaxMemory::new();
    assert!(!empty.allows_cpu_offload());
    assert_eq!(empty.budget(DeviceLocation::Cpu, 64 * GIB), 0);

    let pairs = MaxMemory::from_pairs([("0", "10GiB"), ("cpu", "1TiB")]).unwrap();
    assert_eq!(pairs.entries().count(), 2);

    let err = "tpu=1GiB".parse::<MaxMemory>().unwrap_err().to_string();
    assert!(err.contains("tpu") && err.contains("cuda:0"), "{err}");
    let err = "0=lots".parse::<MaxMemory>().unwrap_err().to_string();
    assert!(err.contains("lots"), "{err}");
    let err = "10GiB".parse::<MaxMemory>().unwrap_err().to_string();
    assert!(err.contains("10GiB"), "{err}");
}

#[test]
fn a_device_given_twice_is_an_error_naming_the_key() {
    for (text, first, second) in [
        ("0=10GiB,0=20GiB", "0", "0"),
        ("0=10GiB,1=0.5,cuda:0=20GiB", "0", "cuda:0"),
        ("cpu=64GiB cpu=32GiB", "cpu", "cpu"),
    ] {
        let err = text.parse::<MaxMemory>().unwrap_err();
        assert!(
            matches!(&err, TopologyError::DuplicateMaxMemoryKey { first: f, second: s, .. }
                if f == first && s == second),
            "{text}: {err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("`{second}`")) && msg.contains("two entries"),
            "{msg}"
        );
    }
    let err = MaxMemory::from_pairs([("1", "1GiB"), ("cuda:1", "2GiB")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("cuda:1") && err.contains("`1`"), "{err}");
}

#[test]
fn a_zero_budget_is_an_error_that_says_what_to_do() {
    for (text, key, value) in [
        ("0=0", "0", "0"),
        ("0=10GiB,cuda:1=0GiB", "cuda:1", "0GiB"),
        ("2=0%", "2", "0%"),
        ("3=0.0", "3", "0.0"),
    ] {
        let err = text.parse::<MaxMemory>().unwrap_err();
        assert!(
            matches!(&err, TopologyError::ZeroBudget { key: k, value: v, .. } if k == key && v == value),
            "{text}: {err}"
        );
        let msg = err.to_string();
        assert!(
            msg.contains(&format!("`{key}={value}`")) && msg.contains("--gpu-ids"),
            "{msg}"
        );
    }
    let msg = "cpu=0".parse::<MaxMemory>().unwrap_err().to_string();
    assert!(msg.contains("leave the cpu entry out"), "{msg}");
}
