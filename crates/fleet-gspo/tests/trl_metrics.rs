//! Issue 23: the metrics fleet writes under TRL's names carry TRL 1.16.0's definitions.
//!
//! Every expected number below is computed by hand from TRL's formulas (file:line in
//! `trl/trainer/grpo_trainer.py` of TRL 1.16.0, and `transformers/trainer.py` of transformers
//! 5.17.0, as in the module docs of `fleet_gspo::metrics` and `fleet_gspo::loss`), on small
//! hand-made batches with mixed lengths and an empty (fully masked) row, at each importance
//! sampling level.

use std::collections::BTreeMap;

use candle_core::{Device, Tensor};
use fleet_gspo::advantage::group_advantages;
use fleet_gspo::config::{ImportanceSamplingLevel, ScaleRewards};
use fleet_gspo::loss::{
    masked_sum, policy_loss, ClipUnit, LossConfig, LossInputs, LossMetrics, StepLossMetrics,
};
use fleet_gspo::metrics::{
    trainer_epoch, trl_reward_stats, trl_reward_totals, CompletionStats, StepMetrics, StepParts,
    StepTimings,
};
use fleet_gspo::rewards::{BatchRewards, FuncScores};

const LEVELS: [ImportanceSamplingLevel; 3] = [
    ImportanceSamplingLevel::Token,
    ImportanceSamplingLevel::Sequence,
    ImportanceSamplingLevel::SequenceToken,
];

fn t2(rows: &[[f32; 4]]) -> Tensor {
    let flat: Vec<f32> = rows.iter().flatten().copied().collect();
    Tensor::from_vec(flat, (rows.len(), 4), &Device::Cpu).unwrap()
}

fn t1(v: &[f32]) -> Tensor {
    Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
}

fn cfg(level: ImportanceSamplingLevel, beta: f64) -> LossConfig {
    // TRL's defaults: epsilon 0.2, epsilon_high = epsilon.
    LossConfig {
        importance_sampling_level: level,
        epsilon: 0.2,
        epsilon_high: 0.2,
        beta,
    }
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-6 * (1.0 + b.abs())
}

/// The hand-made micro-batch: old log-probs -1 everywhere, current ones -1 + r with the token
/// log ratios r below; completion lengths 4, 2, 1 and 0 (row 3 fully masked, as
/// `mask_truncated_completions` leaves a truncated completion).
///
/// ```text
/// row  r (masked tokens)       A    log s_i (mean of r)   s_i
/// 0    +0.5 +0.5  0    0       +1   0.25                  e^0.25 = 1.28403 > 1.2: high-clipped
/// 1    -0.5  0                 -1  -0.25                  e^-0.25 = 0.77880 < 0.8: low-clipped
/// 2     0                      +1   0                     1
/// 3    (none)                  +1   0 / max(0, 1) = 0     1 (never clips)
/// ```
struct Batch {
    logp: Tensor,
    old: Tensor,
    mask: Tensor,
    adv: Tensor,
}

fn batch() -> Batch {
    let nan = f32::NAN;
    Batch {
        // Padding positions hold NaN: they must not matter.
        logp: t2(&[
            [-0.5, -0.5, -1.0, -1.0],
            [-1.5, -1.0, nan, nan],
            [-1.0, nan, nan, nan],
            [nan, nan, nan, nan],
        ]),
        old: t2(&[[-1.0; 4]; 4]),
        mask: t2(&[
            [1.0, 1.0, 1.0, 1.0],
            [1.0, 1.0, 0.0, 0.0],
            [1.0, 0.0, 0.0, 0.0],
            [0.0, 0.0, 0.0, 0.0],
        ]),
        adv: t1(&[1.0, -1.0, 1.0, 1.0]),
    }
}

fn metrics_of(b: &Batch, reference: Option<&Tensor>, config: &LossConfig) -> LossMetrics {
    policy_loss(
        &LossInputs {
            logp: &b.logp,
            old_logp: Some(&b.old),
            ref_logp: reference,
            mask: &b.mask,
            advantages: &b.adv,
        },
        config,
    )
    .unwrap()
    .metrics
}

/// TRL `clip_ratio/*` (grpo:L3259-3279) at each level, empty row and mixed lengths included.
#[test]
fn clip_ratios_are_trls_at_every_level() {
    let b = batch();
    for level in LEVELS {
        let m = metrics_of(&b, None, &cfg(level, 0.0));
        let (low, high, unit) = match level {
            // coef_1 is [B, T]: each masked token with its own ratio. Row 0's tokens have
            // ratios e^0.5, e^0.5, 1, 1 (two above 1.2, A > 0); row 1's e^-0.5, 1 (one below
            // 0.8, A < 0); row 2's 1. global_masked_mean divides by the 7 masked tokens.
            ImportanceSamplingLevel::Token => (1.0 / 7.0, 2.0 / 7.0, ClipUnit::Tokens),
            // coef_1 is [B, 1]: global_masked_mean divides by x.shape[0] = 4 rows, the empty
            // row included (fleet used to divide by the 3 non-empty ones).
            ImportanceSamplingLevel::Sequence => (1.0 / 4.0, 1.0 / 4.0, ClipUnit::Rows),
            // coef_1 is [B, T] with the sequence's ratio at every token (TRL 0.24's
            // GSPOTokenTrainer): row 0 counts 4 tokens high-clipped, row 1 2 tokens low-clipped,
            // over 7 masked tokens.
            ImportanceSamplingLevel::SequenceToken => (2.0 / 7.0, 4.0 / 7.0, ClipUnit::Tokens),
        };
        assert_eq!(m.clip_unit, unit, "{level}");
        assert!(close(m.low_mean(), low), "{level}: low {}", m.low_mean());
        assert!(
            close(m.high_mean(), high),
            "{level}: high {}",
            m.high_mean()
        );
        assert!(
            close(m.region_mean(), low + high),
            "{level}: region {}",
            m.region_mean()
        );
        assert_eq!((m.num_rows, m.num_sequences, m.num_tokens), (4, 3, 7));
    }
}

/// TRL's `loss` (grpo L3154: the mean over all B rows) and fleet's `loss_nonempty_mean`
/// (the mean over non-empty rows, the loss optimised).
#[test]
fn loss_is_trls_and_the_optimised_loss_has_its_own_name() {
    let b = batch();
    for level in LEVELS {
        let m = metrics_of(&b, None, &cfg(level, 0.0));
        // Per-token loss -min(s·A, clip(s, 0.8, 1.2)·A), token-averaged per row:
        let sum = match level {
            // row 0: tokens e^0.5 -> 1.2 (twice), 1, 1: (-1.2 - 1.2 - 1 - 1) / 4 = -1.1;
            // row 1 (A = -1): e^-0.5 -> -min(-0.6065, -0.8) = 0.8, then 1: (0.8 + 1) / 2 = 0.9;
            // row 2: -1; row 3: 0. Sum -1.2.
            ImportanceSamplingLevel::Token => -1.2,
            // row 0: -min(1.28403, 1.2) = -1.2; row 1: -min(-0.77880, -0.8) = 0.8; row 2: -1;
            // row 3: 0. Sum -1.4 (sequence_token has the same values).
            _ => -1.4,
        };
        assert!(close(m.loss_sum, sum), "{level}: {}", m.loss_sum);
        assert!(close(m.trl_loss(), sum / 4.0), "{level}: {}", m.trl_loss());
        assert!(close(m.nonempty_loss(), sum / 3.0), "{level}");
        // The loss tensor is the optimised one.
        let out = policy_loss(
            &LossInputs {
                logp: &b.logp,
                old_logp: Some(&b.old),
                ref_logp: None,
                mask: &b.mask,
                advantages: &b.adv,
            },
            &cfg(level, 0.0),
        )
        .unwrap();
        let value = f64::from(out.loss.to_scalar::<f32>().unwrap());
        assert!((value - sum / 3.0).abs() < 1e-6, "{level}: {value}");
    }
}

/// TRL `kl` (grpo L3267-3268: token-masked mean of k3 at every level) and `entropy` (L3270).
#[test]
fn kl_and_entropy_are_token_masked_means() {
    let b = batch();
    // ref − logp = ln 2 at every masked token: k3 = 2 − ln 2 − 1 = 0.3068528.
    let ln2 = std::f32::consts::LN_2;
    let reference = (&b.logp + f64::from(ln2)).unwrap();
    let k3 = 2.0 - std::f64::consts::LN_2 - 1.0;
    let nan = f32::NAN;
    // Entropies, NaN where masked: 4 × 1 + 2 × 2 + 1 × 4 = 12 over 7 tokens.
    let entropy = t2(&[
        [1.0, 1.0, 1.0, 1.0],
        [2.0, 2.0, nan, nan],
        [4.0, nan, nan, nan],
        [nan, nan, nan, nan],
    ]);
    for level in LEVELS {
        let mut m = metrics_of(&b, Some(&reference), &cfg(level, 0.1));
        assert!(
            (m.kl_mean().unwrap() - k3).abs() < 1e-6,
            "{level}: {:?}",
            m.kl_mean()
        );
        // The KL term is in the loss: each non-empty row's mean gains 0.1 · k3.
        let sum = if level == ImportanceSamplingLevel::Token {
            -1.2
        } else {
            -1.4
        };
        assert!(
            (m.trl_loss() - (sum + 3.0 * 0.1 * k3) / 4.0).abs() < 1e-6,
            "{level}: {}",
            m.trl_loss()
        );
        m.entropy_sum = Some(masked_sum(&entropy, &b.mask).unwrap());
        assert!(close(m.entropy_mean().unwrap(), 12.0 / 7.0), "{level}");
    }
    let m = metrics_of(&b, None, &cfg(ImportanceSamplingLevel::Sequence, 0.0));
    assert_eq!(m.kl_mean(), None, "no kl without beta");
    assert_eq!(m.entropy_mean(), None, "the trainer adds the entropy");
}

/// A micro-batch whose rows are all empty: every TRL denominator is clamped to 1, so the
/// fractions are 0 (not NaN), and the loss is 0.
#[test]
fn an_all_empty_micro_batch_gives_zeros() {
    let zeros = t2(&[[0.0; 4]; 2]);
    for level in LEVELS {
        let out = policy_loss(
            &LossInputs {
                logp: &zeros,
                old_logp: Some(&zeros),
                ref_logp: Some(&zeros),
                mask: &zeros,
                advantages: &t1(&[1.0, -1.0]),
            },
            &cfg(level, 0.1),
        )
        .unwrap();
        let m = out.metrics;
        assert_eq!(
            (m.low_mean(), m.high_mean(), m.region_mean()),
            (0.0, 0.0, 0.0)
        );
        assert_eq!(
            (m.kl_mean(), m.trl_loss(), m.nonempty_loss()),
            (Some(0.0), 0.0, 0.0)
        );
        assert_eq!(out.loss.to_scalar::<f32>().unwrap(), 0.0);
        // At "sequence" the 2 rows are counted; at the token levels there is nothing.
        let total = if level == ImportanceSamplingLevel::Sequence {
            2
        } else {
            0
        };
        assert_eq!(m.clip_total, total, "{level}");
    }
}

fn share(clip_high: u64, clip_total: u64, tokens: u64, entropy: f64) -> LossMetrics {
    LossMetrics {
        clip_unit: ClipUnit::Tokens,
        clip_high,
        clip_total,
        entropy_sum: Some(entropy),
        kl_sum: Some(entropy / 10.0),
        loss_sum: -(clip_high as f64),
        num_rows: 1,
        num_sequences: 1,
        num_tokens: tokens,
        ratio_sum: tokens as f64,
        ratio_count: tokens,
        ..LossMetrics::default()
    }
}

/// TRL pools each micro-batch over the ranks (global_masked_mean's reduce, grpo L3263), then
/// `log` takes the unweighted mean of the micro-batches' values (L3306-3312; hf L2175-2180 for
/// `loss`: the sum of loss / gradient_accumulation_steps, averaged over ranks).
#[test]
fn a_step_averages_micro_batches_pooled_over_ranks() {
    // Two micro-batches of two rows, one row on each of two ranks (token level).
    // Micro-batch 1: rank 0 has 1 token, clipped high; rank 1 has 3 tokens, none clipped.
    // Micro-batch 2: rank 0 has 2 tokens, both clipped; rank 1 has 2 tokens, none clipped.
    let mut rank0 = StepLossMetrics::default();
    rank0.push(share(1, 1, 1, 1.0));
    rank0.push(share(2, 2, 2, 4.0));
    let mut rank1 = StepLossMetrics::default();
    rank1.push(share(0, 3, 3, 3.0));
    rank1.push(share(0, 2, 2, 8.0));
    rank0.merge_rank(&rank1).unwrap();
    let step = rank0;
    // Per micro-batch (pooled over ranks): high 1/4 and 2/4; mean 3/8 (pooling the whole step
    // would give 3/8 here too; the entropy below tells the two apart).
    assert!(close(step.high_mean(), 0.375));
    // Entropy: (1 + 3) / 4 = 1 and (4 + 8) / 4 = 3: mean 2 (pooled: 16 / 8 = 2 as well);
    // kl: 0.1 and 0.3: mean 0.2.
    assert!(close(step.entropy().unwrap(), 2.0));
    assert!(close(step.kl().unwrap(), 0.2));
    // Loss: micro-batch 1: (-1 + 0) / 2 rows = -0.5; micro-batch 2: (-2 + 0) / 2 = -1; mean -0.75.
    assert!(close(step.loss(), -0.75));
    assert!(close(step.nonempty_loss(), -0.75));
    assert_eq!(step.total().num_sequences, 4);
    // The same shares as the two halves of one configured micro-batch split to fit memory:
    // one micro-batch of TRL's, so one value of each metric, pooled over the parts and ranks:
    // high 3/8, entropy 16 / 8 = 2, loss -3 / 4 rows.
    let mut split = StepLossMetrics::default();
    split.push(share(1, 1, 1, 1.0));
    split.push_part(share(2, 2, 2, 4.0));
    split
        .merge_rank(&{
            let mut r = StepLossMetrics::default();
            r.push(share(0, 3, 3, 3.0));
            r.push_part(share(0, 2, 2, 8.0));
            r
        })
        .unwrap();
    assert_eq!(split.micro_batches.len(), 1);
    assert!(close(split.high_mean(), 0.375));
    assert!(close(split.entropy().unwrap(), 2.0));
    assert!(close(split.loss(), -0.75));
    assert!(close(split.nonempty_loss(), -0.75));

    // Micro-batches of different token counts: TRL weighs them equally.
    let mut uneven = StepLossMetrics::default();
    uneven.push(share(1, 1, 1, 5.0)); // 1 token, high-clipped, entropy 5
    uneven.push(share(0, 9, 9, 9.0)); // 9 tokens, none clipped, entropy 1 each
                                      // TRL: (1/1 + 0/9) / 2 = 0.5 (pooling would say 1/10); entropy (5 + 1) / 2 = 3 (pooled 1.4).
    assert!(close(uneven.high_mean(), 0.5));
    assert!(close(uneven.entropy().unwrap(), 3.0));
    // fleet's own ratio_mean is pooled: 10 ratios of 1.
    assert_eq!(uneven.ratio_mean(), Some(1.0));

    // Ranks that ran different numbers of micro-batches: a bug, named.
    let mut a = StepLossMetrics::default();
    a.push(share(0, 1, 1, 1.0));
    let err = a.merge_rank(&StepLossMetrics::default()).unwrap_err();
    assert!(err.to_string().contains("1 micro-batches"), "{err}");
}

/// Empty rows at the step level: TRL counts them at "sequence" and in `loss`'s denominator.
#[test]
fn empty_rows_across_micro_batches_at_the_sequence_level() {
    let b = batch();
    let c = cfg(ImportanceSamplingLevel::Sequence, 0.0);
    let mut step = StepLossMetrics::default();
    step.push(metrics_of(&b, None, &c));
    // A second micro-batch: rows 0 and 3 of the first (one clipped high, one empty).
    let idx = Tensor::from_vec(vec![0u32, 3], 2, &Device::Cpu).unwrap();
    let pick = |t: &Tensor| t.index_select(&idx, 0).unwrap();
    let b2 = Batch {
        logp: pick(&b.logp),
        old: pick(&b.old),
        mask: pick(&b.mask),
        adv: pick(&b.adv),
    };
    step.push(metrics_of(&b2, None, &c));
    // high: 1/4 and 1/2 -> 0.375; low: 1/4 and 0 -> 0.125.
    assert!(close(step.high_mean(), 0.375));
    assert!(close(step.low_mean(), 0.125));
    // loss: -1.4 / 4 = -0.35 and -1.2 / 2 = -0.6 -> -0.475; non-empty: -1.4 / 3 and -1.2 / 1.
    assert!(close(step.loss(), -0.475));
    assert!(close(step.nonempty_loss(), (-1.4 / 3.0 - 1.2) / 2.0));
}

fn func(name: &str, weight: f64, values: &[Option<f64>], unparsed: u64) -> FuncScores {
    FuncScores {
        name: name.into(),
        weight,
        values: values.to_vec(),
        failed: values.iter().filter(|v| v.is_none()).count(),
        errors: vec![],
        unparsed,
    }
}

/// TRL's `reward`, `reward_std` and `frac_reward_zero_std` (grpo L2759-2830): `nansum` over the
/// functions that scored a completion.
#[test]
fn reward_metrics_are_trls_and_fleets_totals_have_their_own_name() {
    // Two groups of 3; `format` failed on completion 1, both functions on completion 5.
    let exact = [Some(1.0), Some(0.0), Some(1.0), Some(0.0), Some(0.0), None];
    let format = [Some(1.0), None, Some(1.0), Some(1.0), Some(1.0), None];
    let rewards = BatchRewards {
        // fleet's totals: every function needed.
        totals: vec![Some(1.5), None, Some(1.5), Some(0.5), Some(0.5), None],
        per_func: vec![
            func("exact", 1.0, &exact, 0),
            func("format", 0.5, &format, 3),
        ],
    };
    // TRL's totals: 1.5, 0 (exact only: 0 × 1), 1.5, 0.5, 0.5, NaN (nothing scored).
    assert_eq!(
        trl_reward_totals(&rewards),
        vec![Some(1.5), Some(0.0), Some(1.5), Some(0.5), Some(0.5), None]
    );
    let trl = trl_reward_stats(&rewards, 3, ScaleRewards::Group);
    // nanmean of [1.5, 0, 1.5, 0.5, 0.5] = 4 / 5 = 0.8.
    assert!(close(trl.reward.unwrap(), 0.8));
    // nanstd: squared deviations 0.49, 0.64, 0.49, 0.09, 0.09 = 1.8; / (5 − 1) = 0.45.
    assert!(close(trl.reward_std.unwrap(), 0.45f64.sqrt()));
    // Group 1 [1.5, 0, 1.5] has a std; group 2 [0.5, 0.5, NaN] has std 0: 1 of 2 groups.
    assert_eq!(trl.frac_reward_zero_std, 0.5);
    // "batch": the batch std (0.67) is not 0.
    assert_eq!(
        trl_reward_stats(&rewards, 3, ScaleRewards::Batch).frac_reward_zero_std,
        0.0
    );

    // In a record: TRL's under TRL's names, fleet's totals under their own.
    let adv = group_advantages(&rewards.totals, 3, ScaleRewards::Group).unwrap();
    let lm = StepLossMetrics::default();
    let mem = BTreeMap::new();
    let parts = |step: u64| StepParts {
        step,
        epoch: 0.5,
        advantages: &adv,
        rewards: &rewards,
        num_generations: 3,
        scale_rewards: ScaleRewards::Group,
        loss_metrics: &lm,
        completions: CompletionStats::from_lengths(&[3; 6], &[false; 6]).unwrap(),
        grad_norm: 1.0,
        learning_rate: 1e-6,
        num_tokens: 100,
        step_tokens: 18,
        generation_batch: 1,
        timings: StepTimings::default(),
        optimizer_seconds: 0.0,
        peak_memory_bytes: &mem,
    };
    let r = StepMetrics::from_parts(&parts(1));
    assert!(close(r.reward.unwrap(), 0.8));
    assert_eq!(r.frac_reward_zero_std, 0.5);
    // fleet's: [1.5, 1.5, 0.5, 0.5]: mean 1, std sqrt(1 / 3).
    assert!(close(r.reward_fully_scored.unwrap(), 1.0));
    assert!(close(
        r.reward_fully_scored_std.unwrap(),
        (1.0f64 / 3.0).sqrt()
    ));
    // rewards/<fn>/mean|std: nanmean / nanstd of each function (L2820-2825).
    assert!(close(r.reward_funcs["rewards/exact/mean"].unwrap(), 0.4));
    assert!(close(r.reward_funcs["rewards/format/mean"].unwrap(), 1.0));
    assert_eq!(r.reward_funcs["rewards/format/std"], Some(0.0));
    // Per generation batch, repeated on each of its steps: the second step of the batch
    // carries the same batch number, rewards and counts (3 unparsed answers, 2 completions
    // without a total), not a share of them.
    let r2 = StepMetrics::from_parts(&parts(2));
    for rec in [&r, &r2] {
        assert_eq!(
            (
                rec.generation_batch,
                rec.unparsed_answers,
                rec.failed_rewards
            ),
            (1, 3, 2)
        );
    }
    assert_eq!(r.reward, r2.reward);
    let v = serde_json::to_value(&r).unwrap();
    assert_eq!(v["generation_batch"], 1);
    assert_eq!(v["unparsed_answers"], 3);
    assert!(v.get("reward_fully_scored").is_some());
}

/// TRL's `completions/*` (grpo L2294-2310), with an empty completion and mixed lengths.
#[test]
fn completion_metrics_are_trls() {
    // Lengths 0 (no token: no EOS, so truncated), 3 (EOS), 5 (EOS), 8 (truncated).
    let s = CompletionStats::from_lengths(&[0, 3, 5, 8], &[true, false, false, true]).unwrap();
    assert_eq!((s.mean_length, s.min_length, s.max_length), (4.0, 0.0, 8.0));
    assert_eq!(s.clipped_ratio, 0.5);
    assert_eq!(
        (
            s.mean_terminated_length,
            s.min_terminated_length,
            s.max_terminated_length
        ),
        (4.0, 3.0, 5.0)
    );
    // None terminated: TRL logs 0 (torch.zeros(1), L2306-2307).
    let t = CompletionStats::from_lengths(&[4, 4], &[true, true]).unwrap();
    assert_eq!(
        (
            t.mean_terminated_length,
            t.max_terminated_length,
            t.clipped_ratio
        ),
        (0.0, 0.0, 1.0)
    );
    // Files written before read their `null` as that 0.
    let old = serde_json::json!({
        "completions/mean_length": 4.0, "completions/min_length": 4.0,
        "completions/max_length": 4.0, "completions/clipped_ratio": 1.0,
        "completions/mean_terminated_length": null,
        "completions/min_terminated_length": null,
        "completions/max_terminated_length": null
    });
    let back: CompletionStats = serde_json::from_value(old).unwrap();
    assert_eq!(back, t);
}

/// HF's `state.epoch` (hf L1881): micro-steps over micro-steps per epoch.
#[test]
fn epoch_is_hfs() {
    // 10 prompts, 4 per generation batch: an epoch is floor(10 / 4) = 2 batches; 2 optimizer
    // steps per batch, so 4 steps per epoch.
    // Batch 1 (epoch 0, first batch of it): steps 1 and 2 -> 1/4, 2/4.
    assert_eq!(trainer_epoch(0, 1, 1, 2, 2), Some(0.25));
    assert_eq!(trainer_epoch(0, 1, 2, 2, 2), Some(0.5));
    // Batch 2: 3/4, 1.
    assert_eq!(trainer_epoch(0, 2, 2, 2, 2), Some(1.0));
    // Batch 3 starts epoch 1: 1 + 1/4.
    assert_eq!(trainer_epoch(1, 1, 1, 2, 2), Some(1.25));
    assert_eq!(trainer_epoch(0, 1, 1, 0, 2), None);
}

/// TRL's `step_time` (grpo L1510-1518) covers the micro-steps, not the optimizer update.
#[test]
fn step_time_leaves_out_the_optimizer_update() {
    let t = StepTimings {
        generation_seconds: 2.0,
        scoring_seconds: 0.5,
        update_seconds: 1.5,
    };
    assert_eq!(t.wall_seconds(), 4.0);
    // 0.25 s of the update were clipping and AdamW.
    assert_eq!(t.trl_step_time(0.25), 3.75);
}
