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
        "", "GiB", "10XB", "1.5", "-3GiB", "0GiB", "150%", "1.2.3GB", "ten",
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
