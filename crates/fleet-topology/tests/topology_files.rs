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
