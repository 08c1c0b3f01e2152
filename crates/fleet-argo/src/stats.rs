//! Small statistics: the Wilson score interval for a proportion, and means.

/// z for a two-sided 95% interval (the 0.975 quantile of the standard normal).
pub const Z_95: f64 = 1.959_963_984_540_054;

/// The Wilson score interval for `successes` out of `trials` at normal quantile `z`; None when
/// `trials` is 0 or `successes > trials`.
///
/// Unlike the normal-approximation interval it stays inside `[0, 1]` and does not collapse to
/// a point at 0 or `trials` successes.
pub fn wilson_interval(successes: u64, trials: u64, z: f64) -> Option<(f64, f64)> {
    if trials == 0 || successes > trials {
        return None;
    }
    let n = trials as f64;
    let p = successes as f64 / n;
    let z2 = z * z;
    let denom = 1.0 + z2 / n;
    let centre = (p + z2 / (2.0 * n)) / denom;
    let half = z * (p * (1.0 - p) / n + z2 / (4.0 * n * n)).sqrt() / denom;
    Some(((centre - half).max(0.0), (centre + half).min(1.0)))
}

/// The mean of `values`; None when empty.
pub fn mean(values: impl IntoIterator<Item = f64>) -> Option<f64> {
    let (sum, n) = values
        .into_iter()
        .fold((0.0, 0u64), |(s, n), v| (s + v, n + 1));
    (n > 0).then(|| sum / n as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wilson_matches_reference_values() {
        // 8 of 10 at 95%: (0.4902, 0.9433) (Wilson 1927; e.g. Newcombe 1998, table I).
        let (lo, hi) = wilson_interval(8, 10, Z_95).unwrap();
        assert!((lo - 0.4902).abs() < 1e-4, "{lo}");
        assert!((hi - 0.9433).abs() < 1e-4, "{hi}");
        // 0 of 10: lower bound 0, upper 0.2775.
        let (lo, hi) = wilson_interval(0, 10, Z_95).unwrap();
        assert_eq!(lo, 0.0);
        assert!((hi - 0.2775).abs() < 1e-4, "{hi}");
        assert_eq!(wilson_interval(0, 0, Z_95), None);
        assert_eq!(wilson_interval(3, 2, Z_95), None);
    }

    #[test]
    fn mean_of_empty_is_none() {
        assert_eq!(mean([]), None);
        assert_eq!(mean([1.0, 2.0, 3.0]), Some(2.0));
    }
}
