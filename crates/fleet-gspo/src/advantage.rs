//! Group-relative advantages, as TRL's `_generate_and_score_completions` computes them
//! (`multi_objective_aggregation = "sum_then_normalize"`, fact sheet B2).
//!
//! Rewards come in group order: the G completions of a prompt are consecutive. For each group,
//! `A_i = (r_i − mean) / (std + 1e-4)`, where mean and std are over the group's *valid* rewards
//! and std is unbiased (Bessel's correction, TRL's `nanstd`):
//!
//! - `scale_rewards = "group"`: std of the group;
//! - `"batch"`: std of the whole batch's valid rewards (the mean stays per group);
//! - `"none"` (Dr. GRPO): no division, `A_i = r_i − mean`.
//!
//! A missing reward (`None`: a reward function failed or gave `None`) is left out of its
//! group's mean and std, gets advantage 0 and is counted ([`GroupAdvantages::failed_rewards`]),
//! as TRL does with NaN rewards and `nan_to_num`. A group with fewer than 2 valid rewards has no
//! std (TRL: NaN, hence advantage 0): every completion in it gets 0, and the group is counted
//! in [`GroupAdvantages::groups_too_small`].
//!
//! A group whose valid rewards are all equal gets advantages of exactly 0 (TRL's float
//! arithmetic can leave `r − mean` at ±1 ulp, e.g. three rewards of 0.1; here the group is
//! recognised and set to 0, so that loss and gradient are exactly 0, fact sheet W5).
//!
//! Statistics are computed in f64 and the advantages rounded to f32 at the end (TRL computes in
//! float32 tensors; the difference is below f32 resolution of the result).
//!
//! Across processes, rewards are gathered before this is called (TRL gathers from all ranks,
//! then each rank takes its slice of the advantages), so "batch" means the global batch.

use serde::{Deserialize, Serialize};

use crate::config::ScaleRewards;

/// TRL's epsilon added to the std.
pub const STD_EPS: f64 = 1e-4;

/// `torch.isclose(std, 0)` with the default tolerances: `|std| <= atol (1e-8) + rtol·0`.
const ZERO_STD_ATOL: f64 = 1e-8;

/// Errors of [`group_advantages`]: caller bugs, named with the values at fault.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum AdvantageError {
    /// A group size below 2.
    #[error("num_generations = {num_generations}: group advantages need at least 2 completions per prompt")]
    GroupTooSmall {
        /// The group size given.
        num_generations: usize,
    },
    /// Rewards that do not split into whole groups.
    #[error("{len} rewards do not split into groups of num_generations = {num_generations}: pass the G completions of each prompt, consecutively")]
    NotWholeGroups {
        /// Rewards given.
        len: usize,
        /// The group size.
        num_generations: usize,
    },
    /// No rewards.
    #[error("no rewards: a batch needs at least one group")]
    Empty,
    /// A reward that is NaN or infinite.
    #[error("reward {index} is {value}: rewards must be finite; a reward that could not be computed is None")]
    NonFinite {
        /// Its position in the batch.
        index: usize,
        /// The value.
        value: f64,
    },
}

/// Advantages of a batch and the statistics TRL logs about them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupAdvantages {
    /// One advantage per completion, in the input order.
    pub advantages: Vec<f32>,
    /// Number of groups (prompts).
    pub num_groups: usize,
    /// TRL `frac_reward_zero_std`: the fraction of groups whose std `isclose` 0 (group std in
    /// "group" and "none" modes; in "batch" mode the batch std, so 0 or 1). A group with fewer
    /// than 2 valid rewards has no std and does not count as zero-std.
    pub frac_reward_zero_std: f64,
    /// Completions whose reward is `None`.
    pub failed_rewards: usize,
    /// Groups with fewer than 2 valid rewards (all their advantages are 0).
    pub groups_too_small: usize,
    /// TRL `reward`: mean of the valid rewards; `None` when there are none.
    pub reward_mean: Option<f64>,
    /// TRL `reward_std`: unbiased std of the valid rewards over the whole batch (not a mean of
    /// group stds); `None` with fewer than 2.
    pub reward_std: Option<f64>,
}

/// Mean and unbiased std of the present values (TRL's `nanmean` / `nanstd`); `(None, None)`
/// when none are present, std `None` when fewer than 2.
pub fn nan_mean_std(values: &[Option<f64>]) -> (Option<f64>, Option<f64>) {
    let valid: Vec<f64> = values.iter().flatten().copied().collect();
    mean_std(&valid)
}

fn mean_std(valid: &[f64]) -> (Option<f64>, Option<f64>) {
    let n = valid.len();
    if n == 0 {
        return (None, None);
    }
    let mean = valid.iter().sum::<f64>() / n as f64;
    if n < 2 {
        return (Some(mean), None);
    }
    let var = valid.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1) as f64;
    (Some(mean), Some(var.sqrt()))
}

/// Computes the advantages of `rewards` (groups of `num_generations` consecutive completions)
/// with the given scaling; see the module docs.
pub fn group_advantages(
    rewards: &[Option<f64>],
    num_generations: usize,
    scale: ScaleRewards,
) -> Result<GroupAdvantages, AdvantageError> {
    let g = num_generations;
    if g < 2 {
        return Err(AdvantageError::GroupTooSmall { num_generations: g });
    }
    if rewards.is_empty() {
        return Err(AdvantageError::Empty);
    }
    if !rewards.len().is_multiple_of(g) {
        return Err(AdvantageError::NotWholeGroups {
            len: rewards.len(),
            num_generations: g,
        });
    }
    if let Some((index, value)) = rewards
        .iter()
        .enumerate()
        .find_map(|(i, r)| r.filter(|v| !v.is_finite()).map(|v| (i, v)))
    {
        return Err(AdvantageError::NonFinite { index, value });
    }
    let (reward_mean, reward_std) = nan_mean_std(rewards);
    let num_groups = rewards.len() / g;
    let mut advantages = vec![0f32; rewards.len()];
    let mut zero_std_groups = 0usize;
    let mut groups_too_small = 0usize;
    for (k, group) in rewards.chunks(g).enumerate() {
        let valid: Vec<f64> = group.iter().flatten().copied().collect();
        let (mean, std) = mean_std(&valid);
        let all_equal = valid.windows(2).all(|w| w[0] == w[1]);
        let group_std = if valid.len() >= 2 && all_equal {
            Some(0.0)
        } else {
            std
        };
        let scale_std = match scale {
            ScaleRewards::Batch => reward_std,
            ScaleRewards::Group | ScaleRewards::None => group_std,
        };
        if scale_std.is_some_and(|s| s.abs() <= ZERO_STD_ATOL) {
            zero_std_groups += 1;
        }
        let (Some(mean), Some(_)) = (mean, group_std) else {
            groups_too_small += 1;
            continue;
        };
        if all_equal {
            continue;
        }
        for (j, r) in group.iter().enumerate() {
            let Some(r) = r else { continue };
            let centred = r - mean;
            let a = match scale {
                ScaleRewards::None => centred,
                // `scale_std` is Some: the group has 2 valid rewards, so the batch does too.
                _ => centred / (scale_std.unwrap_or(f64::NAN) + STD_EPS),
            };
            advantages[k * g + j] = a as f32;
        }
    }
    Ok(GroupAdvantages {
        advantages,
        num_groups,
        frac_reward_zero_std: zero_std_groups as f64 / num_groups as f64,
        failed_rewards: rewards.iter().filter(|r| r.is_none()).count(),
        groups_too_small,
        reward_mean,
        reward_std,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn some(v: &[f64]) -> Vec<Option<f64>> {
        v.iter().map(|&x| Some(x)).collect()
    }

    #[test]
    fn known_numeric_example_group_scaling() {
        // Group 1: [1, 0, 0, 1]: mean 0.5, unbiased std sqrt(1/3).
        // Group 2: [2, 4, 6, 8]: mean 5, unbiased std sqrt(20/3).
        let r = some(&[1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0]);
        let a = group_advantages(&r, 4, ScaleRewards::Group).unwrap();
        let s1 = (1.0f64 / 3.0).sqrt() + 1e-4;
        let s2 = (20.0f64 / 3.0).sqrt() + 1e-4;
        let expected = [
            0.5 / s1,
            -0.5 / s1,
            -0.5 / s1,
            0.5 / s1,
            -3.0 / s2,
            -1.0 / s2,
            1.0 / s2,
            3.0 / s2,
        ];
        for (got, want) in a.advantages.iter().zip(expected) {
            assert_eq!(*got, want as f32);
        }
        assert_eq!(a.advantages[0], 0.865_875_4);
        assert_eq!(a.num_groups, 2);
        assert_eq!(a.frac_reward_zero_std, 0.0);
        assert_eq!(a.reward_mean, Some(22.0 / 8.0));
        // Batch std over all 8 rewards, not a mean of group stds.
        let m = 22.0 / 8.0;
        let var = [1.0, 0.0, 0.0, 1.0, 2.0, 4.0, 6.0, 8.0]
            .iter()
            .map(|x: &f64| (x - m) * (x - m))
            .sum::<f64>()
            / 7.0;
        assert!((a.reward_std.unwrap() - var.sqrt()).abs() < 1e-12);
    }

    #[test]
    fn batch_scaling_keeps_group_means_and_divides_by_the_batch_std() {
        let r = some(&[1.0, 0.0, 2.0, 4.0]);
        let a = group_advantages(&r, 2, ScaleRewards::Batch).unwrap();
        let std = a.reward_std.unwrap() + 1e-4;
        let expected = [0.5 / std, -0.5 / std, -1.0 / std, 1.0 / std];
        for (got, want) in a.advantages.iter().zip(expected) {
            assert_eq!(*got, want as f32);
        }
        assert_eq!(a.frac_reward_zero_std, 0.0);
    }

    #[test]
    fn dr_grpo_none_gives_r_minus_mean() {
        let r = some(&[1.0, 0.0, 0.0, 0.0, 3.0, 3.0, 3.0, 3.0]);
        let a = group_advantages(&r, 4, ScaleRewards::None).unwrap();
        assert_eq!(
            a.advantages,
            vec![0.75, -0.25, -0.25, -0.25, 0.0, 0.0, 0.0, 0.0]
        );
        assert_eq!(
            a.frac_reward_zero_std, 0.5,
            "the group std still feeds the metric"
        );
    }

    #[test]
    fn zero_std_groups_get_exactly_zero_and_are_counted() {
        // 0.1 three times: the float mean is not exactly 0.1, the advantage still is 0.
        let r = some(&[0.1, 0.1, 0.1, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0]);
        let a = group_advantages(&r, 3, ScaleRewards::Group).unwrap();
        assert!(a.advantages[..6].iter().all(|&x| x == 0.0));
        assert!(a.advantages[6..].iter().all(|&x| x != 0.0));
        assert!((a.frac_reward_zero_std - 2.0 / 3.0).abs() < 1e-12);
        let all = group_advantages(&some(&[1.0; 4]), 2, ScaleRewards::Batch).unwrap();
        assert_eq!(all.frac_reward_zero_std, 1.0);
        assert!(all.advantages.iter().all(|&x| x == 0.0));
    }

    #[test]
    fn a_none_is_left_out_of_its_groups_stats_and_counted() {
        let r = vec![Some(1.0), None, Some(0.0), Some(0.0)];
        let a = group_advantages(&r, 4, ScaleRewards::Group).unwrap();
        // Stats over [1, 0, 0]: mean 1/3, unbiased std sqrt(1/3).
        let std = (1.0f64 / 3.0).sqrt() + 1e-4;
        assert_eq!(a.advantages[0], ((1.0 - 1.0 / 3.0) / std) as f32);
        assert_eq!(a.advantages[1], 0.0);
        assert_eq!(a.advantages[2], ((0.0 - 1.0 / 3.0) / std) as f32);
        assert_eq!(a.failed_rewards, 1);
        assert_eq!(a.groups_too_small, 0);
        assert_eq!(a.reward_mean, Some(1.0 / 3.0));
    }

    #[test]
    fn groups_with_fewer_than_two_valid_rewards_get_zero() {
        let r = vec![Some(5.0), None, None, None, Some(1.0), Some(0.0)];
        for scale in [ScaleRewards::Group, ScaleRewards::Batch, ScaleRewards::None] {
            let a = group_advantages(&r, 2, scale).unwrap();
            assert_eq!(&a.advantages[..4], &[0.0, 0.0, 0.0, 0.0], "{scale}");
            assert_ne!(a.advantages[4], 0.0);
            assert_eq!(a.groups_too_small, 2);
            assert_eq!(a.failed_rewards, 3);
        }
        let none = group_advantages(&[None, None], 2, ScaleRewards::Group).unwrap();
        assert_eq!(none.reward_mean, None);
        assert_eq!(none.reward_std, None);
        assert_eq!(none.frac_reward_zero_std, 0.0);
    }

    #[test]
    fn caller_errors_are_named() {
        assert!(matches!(
            group_advantages(&some(&[1.0, 2.0, 3.0]), 2, ScaleRewards::Group),
            Err(AdvantageError::NotWholeGroups {
                len: 3,
                num_generations: 2
            })
        ));
        assert!(matches!(
            group_advantages(&some(&[1.0]), 1, ScaleRewards::Group),
            Err(AdvantageError::GroupTooSmall { .. })
        ));
        assert!(matches!(
            group_advantages(&[], 2, ScaleRewards::Group),
            Err(AdvantageError::Empty)
        ));
        assert!(matches!(
            group_advantages(&[Some(1.0), Some(f64::NAN)], 2, ScaleRewards::Group),
            Err(AdvantageError::NonFinite { index: 1, .. })
        ));
    }

    #[test]
    fn nan_mean_std_matches_trl() {
        assert_eq!(nan_mean_std(&[]), (None, None));
        assert_eq!(nan_mean_std(&[Some(2.0), None]), (Some(2.0), None));
        let (m, s) = nan_mean_std(&[Some(1.0), None, Some(3.0)]);
        assert_eq!(m, Some(2.0));
        assert!((s.unwrap() - 2f64.sqrt()).abs() < 1e-15);
    }
}
