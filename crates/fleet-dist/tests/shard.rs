use std::collections::HashMap;

use fleet_dist::{DistError, ShardSource, ShardSpec};

fn env(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
    let map: HashMap<String, String> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    move |k: &str| map.get(k).cloned()
}

#[test]
fn precedence_args_slurm_torchrun_single() {
    let all = env(&[
        ("SLURM_PROCID", "1"),
        ("SLURM_NTASKS", "4"),
        ("RANK", "2"),
        ("WORLD_SIZE", "8"),
    ]);
    let s = ShardSpec::from_env_and_args(Some(3), Some(0), &all).unwrap();
    assert_eq!((s.index, s.count, s.source), (0, 3, ShardSource::Args));
    let s = ShardSpec::from_env_and_args(None, None, &all).unwrap();
    assert_eq!((s.index, s.count, s.source), (1, 4, ShardSource::Slurm));
    let torch = env(&[("RANK", "2"), ("WORLD_SIZE", "8")]);
    let s = ShardSpec::from_env_and_args(None, None, &torch).unwrap();
    assert_eq!((s.index, s.count, s.source), (2, 8, ShardSource::Torchrun));
    let s = ShardSpec::from_env_and_args(None, None, &env(&[])).unwrap();
    assert_eq!((s.index, s.count, s.source), (0, 1, ShardSource::Single));
    let s = ShardSpec::from_env_and_args(
        None,
        None,
        &env(&[("SLURM_PROCID", "0"), ("SLURM_NPROCS", "2")]),
    )
    .unwrap();
    assert_eq!((s.index, s.count), (0, 2));
    // Empty values count as unset.
    let s = ShardSpec::from_env_and_args(None, None, &env(&[("RANK", ""), ("WORLD_SIZE", "")]))
        .unwrap();
    assert!(s.is_single());
}

#[test]
fn validation_errors_name_the_culprit() {
    let none = env(&[]);
    let e = ShardSpec::from_env_and_args(Some(2), Some(2), &none).unwrap_err();
    assert!(matches!(
        e,
        DistError::ShardIndexOutOfRange {
            index: 2,
            count: 2,
            ..
        }
    ));
    assert!(e.to_string().contains("--shard-index"));
    let e = ShardSpec::from_env_and_args(Some(0), Some(0), &none).unwrap_err();
    assert!(matches!(e, DistError::ZeroShards { .. }));
    let e = ShardSpec::from_env_and_args(Some(2), None, &none).unwrap_err();
    assert!(e.to_string().contains("--shard-index"), "{e}");
    let e = ShardSpec::from_env_and_args(None, None, &env(&[("RANK", "x"), ("WORLD_SIZE", "2")]))
        .unwrap_err();
    assert!(matches!(&e, DistError::BadEnvNumber { var, .. } if var == "RANK"));
    assert!(e.to_string().contains("RANK=`x`"), "{e}");
    let e = ShardSpec::from_env_and_args(None, None, &env(&[("WORLD_SIZE", "-1"), ("RANK", "0")]))
        .unwrap_err();
    assert!(e.to_string().contains("WORLD_SIZE"));
    let e = ShardSpec::from_env_and_args(None, None, &env(&[("SLURM_PROCID", "3")])).unwrap_err();
    assert!(e.to_string().contains("SLURM_NPROCS") || e.to_string().contains("SLURM_NTASKS"));
    let e = ShardSpec::from_env_and_args(
        None,
        None,
        &env(&[("SLURM_PROCID", "4"), ("SLURM_NTASKS", "4")]),
    )
    .unwrap_err();
    assert!(e.to_string().contains("SLURM_PROCID"), "{e}");
    assert!(ShardSpec::new(1, 1).is_err());
}

#[test]
fn select_partitions_items_exactly_once() {
    for count in 1..=9 {
        for n in [0usize, 1, 2, 7, 8, 9, 10, 100, 101] {
            let mut seen = vec![0u32; n];
            let mut next = 0;
            let mut sizes = Vec::new();
            for index in 0..count {
                let r = ShardSpec::new(index, count).unwrap().select(n);
                assert_eq!(r.start, next, "contiguous and in order");
                next = r.end;
                sizes.push(r.len());
                for i in r {
                    seen[i] += 1;
                }
            }
            assert_eq!(next, n);
            assert!(seen.iter().all(|&c| c == 1), "count {count} n {n}");
            let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(hi - lo <= 1);
        }
    }
    // Stable: the same inputs give the same range.
    assert_eq!(ShardSpec::new(1, 3).unwrap().select(10), 4..7);
}
