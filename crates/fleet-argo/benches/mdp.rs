//! The MDP solver (value iteration to the tolerance) at the default parameters and grid, and
//! on a grid four times finer: the sweep solves it once per c_r point.

use criterion::{criterion_group, criterion_main, Criterion};
use fleet_argo::{solve, MdpParams, SolverConfig};
use std::hint::black_box;

fn bench(c: &mut Criterion) {
    let params = MdpParams::default();
    let solver = SolverConfig::default();
    c.bench_function("solve/default grid", |b| {
        b.iter(|| solve(black_box(&params), black_box(&solver)).unwrap())
    });
    let fine = SolverConfig {
        grid_points: solver.grid_points * 4,
        ..solver
    };
    c.bench_function("solve/4x grid", |b| {
        b.iter(|| solve(black_box(&params), black_box(&fine)).unwrap())
    });
}

criterion_group!(benches, bench);
criterion_main!(benches);
