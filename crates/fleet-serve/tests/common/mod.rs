//! Helpers shared by the replica tests.

use std::path::{Path, PathBuf};

use fleet_models::GenerationRequest;

/// A checkpoint under `tests/fixtures/`.
pub fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// `n` greedy requests of different prompt lengths and token limits (ids within the tiny
/// fixtures' vocabulary).
pub fn requests(n: u32) -> Vec<GenerationRequest> {
    (0..n)
        .map(|i| {
            let prompt: Vec<u32> = (0..(3 + i as usize * 2))
                .map(|j| (i * 37 + j as u32 * 11) % 990)
                .collect();
            GenerationRequest::greedy(prompt, 5 + i as usize)
        })
        .collect()
}
