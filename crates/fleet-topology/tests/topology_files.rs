//! Virtual topologies from TOML.

use fleet_topology::*;

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");

#[test]
fn shipped_topologies_parse() {
    let cases = [
        ("rtx3060-8x", 8, 12 * GIB, false),
        ("h100-6x", 6, 81559 * MIB, true),
        ("h200-1x", 1, 143771 * MIB, true),
        ("h200-2x", 2, 143771 * MIB, true),
        ("h200-4x", 4, 143771 * MIB, true),
        ("h200-8x", 8, 143771 * MIB, true),
    ];
    for (name, count, bytes, peers) in cases {
        let t = Topology::from_file(format!("{ROOT}/configs/topologies/{name}.toml")).unwrap();
        assert_eq!(t.gpus.len(), count, "{name}");
        assert!(t.gpus.iter().all(|g| g.total_bytes == bytes), "{name}");
        assert_eq!(t.gpus[count - 1].location, DeviceLocation::Cuda(count - 1));
        assert_eq!(t.peers(0, count - 1), peers || count == 1, "{name}");
    }
}

#[test]
fn mixed_gpus_and_defaults() {
    let t = Topology::from_toml_str(
        r#"
        cpu_memory = "256GiB"
        [[gpu]]
        name = "A"
        memory = "24GB"
        [[gpu]]
        name = "B"
        memory = "48GiB"
        count = 2
        "#,
        "mixed.toml",
    )
    .unwrap();
    assert_eq!(t.name, "3x A");
    assert_eq!(t.gpus[0].total_bytes, 24_000_000_000);
    assert_eq!(t.gpus[2].name, "B");
    assert_eq!(t.peer_access, PeerAccess::None);
    assert_eq!(t.cpu_bytes, Some(256 * GIB));
}

fn err_of(text: &str) -> (String, String) {
    match Topology::from_toml_str(text, "bad.toml").unwrap_err() {
        e @ TopologyError::TopologyFile { .. } => {
            let TopologyError::TopologyFile { ref field, .. } = e else {
                unreachable!()
            };
            (field.clone(), e.to_string())
        }
        other => panic!("unexpected error {other}"),
    }
}

#[test]
fn malformed_files_name_file_and_field() {
    let cases = [
        ("[[gpu]]\nname = \"X\"\ncount = 2\n", "memory"),
        (
            "[[gpu]]\nname = \"X\"\nmemory = \"12 gigs\"\n",
            "gpu[0].memory",
        ),
        ("[[gpu]]\nname = \"X\"\nmemory = \"0.5\"\n", "gpu[0].memory"),
        (
            "[[gpu]]\nname = \"X\"\nmemory = \"12GiB\"\ncount = 0\n",
            "gpu[0].count",
        ),
        (
            "[[gpu]]\nname = \"X\"\nmemory = \"12GiB\"\nmemroy = 1\n",
            "memroy",
        ),
        ("[[gpu]]\nname = \"X\"\nmemory = 12\n", "memory"),
        (
            "peer_access = \"yes\"\n[[gpu]]\nname = \"X\"\nmemory = \"1GiB\"\n",
            "peer_access",
        ),
        ("name = \"empty\"\n", "gpu"),
        ("[[gpu]\nname = \"X\"\n", "(toml syntax)"),
        (
            "peer_groups = [[0, 5]]\n[[gpu]]\nname = \"X\"\nmemory = \"1GiB\"\ncount = 2\n",
            "peer_groups[0]",
        ),
        (
            "peer_access = true\npeer_groups = [[0]]\n[[gpu]]\nname = \"X\"\nmemory = \"1GiB\"\n",
            "peer_groups",
        ),
        (
            "cpu_memory = \"lots\"\n[[gpu]]\nname = \"X\"\nmemory = \"1GiB\"\n",
            "cpu_memory",
        ),
    ];
    for (text, field) in cases {
        let (got, msg) = err_of(text);
        assert!(msg.contains("bad.toml"), "{msg}");
        assert_eq!(got, field, "{msg}");
        assert!(msg.contains(field), "{msg}");
    }
    let err = Topology::from_file("/nonexistent/topo.toml")
        .unwrap_err()
        .to_string();
    assert!(err.contains("/nonexistent/topo.toml"), "{err}");
}

/// A GPU of a discovered machine that reaches `peers` directly.
fn reported_gpu(ordinal: usize, peers: &[usize]) -> fleet_topology::DeviceInfo {
    fleet_topology::DeviceInfo {
        location: fleet_topology::DeviceLocation::Cuda(ordinal),
        name: "NVIDIA H200".into(),
        compute_capability: Some((9, 0)),
        total_bytes: Some(141 << 30),
        free_bytes: Some(140 << 30),
        pci_bus_id: None,
        peers: peers.to_vec(),
    }
}

#[test]
fn live_topology_takes_peer_access_from_the_driver() {
    use fleet_topology::{PeerAccess, Topology};
    let all: Vec<_> = (0..4)
        .map(|i| reported_gpu(i, &(0..4).filter(|&j| j != i).collect::<Vec<_>>()))
        .collect();
    assert_eq!(Topology::from_devices(&all).peer_access, PeerAccess::All);

    let none: Vec<_> = (0..3).map(|i| reported_gpu(i, &[])).collect();
    assert_eq!(Topology::from_devices(&none).peer_access, PeerAccess::None);

    // Two NVLink pairs (0-1, 2-3) with no path between the pairs.
    let pairs = [
        reported_gpu(0, &[1]),
        reported_gpu(1, &[0]),
        reported_gpu(2, &[3]),
        reported_gpu(3, &[2]),
    ];
    let t = Topology::from_devices(&pairs);
    assert_eq!(
        t.peer_access,
        PeerAccess::Groups(vec![vec![0, 1], vec![2, 3]])
    );
    assert!(t.peers(0, 1) && t.peers(3, 2) && !t.peers(1, 2));

    // Access reported in one direction only is not peer access.
    let one_way = [reported_gpu(0, &[1]), reported_gpu(1, &[])];
    assert_eq!(
        Topology::from_devices(&one_way).peer_access,
        PeerAccess::None
    );
}
