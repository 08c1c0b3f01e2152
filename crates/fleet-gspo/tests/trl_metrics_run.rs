//! Issue 23, end to end: the metrics a real (tiny, CPU) training run writes keep the
//! per-generation-batch and per-step conventions the `fleet_gspo::metrics` module docs state.
//!
//! The bundled model and task (assets/gspo-default, configs/gspo/default.toml): completions
//! of at most one token, so most are truncated, which `mask_truncated_completions` turns into
//! empty rows.

use std::path::{Path, PathBuf};

use fleet_gspo::{prepare, GspoConfig, RunOptions, StepMetrics};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Trains `steps` optimizer steps of the embedded default with `overrides`; returns the lines
/// of metrics.jsonl.
fn run(out: &Path, steps: u64, overrides: &[&str]) -> Vec<StepMetrics> {
    let mut config = GspoConfig::from_toml_file(&repo().join("configs/gspo/default.toml")).unwrap();
    config.output_dir = out.to_path_buf();
    config.max_steps = Some(steps);
    config.save_steps = 1000;
    for o in overrides {
        config.apply_assignment(o).unwrap();
    }
    let model = repo().join("assets/gspo-default");
    let opts = RunOptions {
        model: model.display().to_string(),
        revision: None,
        dataset: model.join("train.jsonl"),
        dtype: candle_core::DType::F32,
        preset: "auto".parse().unwrap(),
        gpu_ids: None,
        max_memory: Default::default(),
        gradient_checkpointing: false,
        resume: false,
        resume_from_checkpoint: None,
        overwrite: false,
        plan_only: false,
        topology: None,
        dist: None,
    };
    let prepared = prepare(&config, &opts).unwrap();
    let mut trainer = prepared.trainer.unwrap();
    let mut seen = Vec::new();
    trainer
        .train(&mut |m: &StepMetrics| seen.push(m.clone()))
        .unwrap();
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let written: Vec<StepMetrics> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(written, seen, "the file holds what the loop reported");
    written
}

#[test]
fn a_run_logs_per_batch_values_on_each_of_its_steps_and_trls_loss_beside_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    // The default: steps_per_generation 4, gradient_accumulation_steps 1: 4 optimizer steps
    // per generation batch; off-policy, so the clip ratios can be non-zero.
    let m = run(
        &tmp.path().join("masked"),
        8,
        &["mask_truncated_completions=true"],
    );
    assert_eq!(m.len(), 8);
    // generation_batch is 1-based: steps 1-4 train on the first batch, 5-8 on the second.
    let batches: Vec<u64> = m.iter().map(|r| r.generation_batch).collect();
    assert_eq!(batches, vec![1, 1, 1, 1, 2, 2, 2, 2]);
    for chunk in m.chunks(4) {
        let first = &chunk[0];
        for r in chunk {
            // Values of the generation batch: repeated, not split over its steps.
            assert_eq!(r.unparsed_answers, first.unparsed_answers);
            assert_eq!(r.failed_rewards, first.failed_rewards);
            assert_eq!(r.reward, first.reward);
            assert_eq!(r.frac_reward_zero_std, first.frac_reward_zero_std);
            assert_eq!(r.completions, first.completions);
            assert_eq!(r.num_tokens, first.num_tokens);
        }
        // Generation happens in the first step of the batch only.
        assert!(first.timings.generation_seconds > 0.0);
        assert!(chunk[1..]
            .iter()
            .all(|r| r.timings.generation_seconds == 0.0));
    }
    assert!(m[4].num_tokens > m[3].num_tokens, "cumulative over batches");
    for (i, r) in m.iter().enumerate() {
        // HF's epoch grows by one step's share at every step.
        let per_step = m[0].epoch;
        assert!(
            (r.epoch - per_step * (i + 1) as f64).abs() < 1e-9,
            "{} {}",
            r.epoch,
            per_step
        );
        // TRL's step_time leaves out clipping and AdamW; the phases add up to the wall time.
        assert!(r.step_time > 0.0 && r.step_time <= r.timings.wall_seconds());
        for f in [
            r.clip_ratio_low_mean,
            r.clip_ratio_high_mean,
            r.clip_ratio_region_mean,
        ] {
            assert!((0.0..=1.0).contains(&f));
        }
        assert!(r.entropy.is_some_and(f64::is_finite));
    }
    // Most completions are truncated and masked: TRL's loss divides by all rows, the optimised
    // one by the non-empty ones, so they differ.
    assert!(m[0].completions.clipped_ratio > 0.5);
    assert!(m
        .iter()
        .any(|r| (r.loss - r.loss_nonempty_mean.unwrap()).abs() > 1e-9));

    // Without masking every row is in the loss: the two are the same number.
    let plain = run(&tmp.path().join("plain"), 4, &[]);
    for r in &plain {
        assert_eq!(Some(r.loss), r.loss_nonempty_mean);
    }
}

#[test]
fn rollouts_streamed_through_fewer_decode_slots_are_the_same_rollouts() {
    // max_num_seqs 3: the generation batch's completions stream through three decode slots,
    // refilled as they finish; each completion depends on its own seed only, so the training
    // run is the same one.
    let tmp = tempfile::tempdir().unwrap();
    let longer = "max_completion_length=6";
    let all = run(
        &tmp.path().join("all"),
        4,
        &[longer, "num_scheduler_steps=1"],
    );
    // Three slots; three slots reading tokens back every 4 steps (vLLM's
    // num_scheduler_steps); all slots at the default (a read every 8 steps).
    for (name, extra) in [
        ("streamed", &["max_num_seqs=3", "num_scheduler_steps=1"][..]),
        ("bursts", &["max_num_seqs=3", "num_scheduler_steps=4"][..]),
        ("default", &[][..]),
    ] {
        let mut overrides = vec![longer];
        overrides.extend(extra);
        let streamed = run(&tmp.path().join(name), 4, &overrides);
        assert_eq!(all.len(), streamed.len());
        for (a, s) in all.iter().zip(&streamed) {
            assert_eq!(a.completions, s.completions, "{name}");
            assert_eq!(a.reward, s.reward, "{name}");
            assert_eq!(a.num_tokens, s.num_tokens, "{name}");
            assert_eq!(a.loss, s.loss, "{name}");
            assert_eq!(a.grad_norm, s.grad_norm, "{name}");
        }
    }
}

/// `padding_free` (packed sequences) trains the same run as the padded layout: the same
/// completions, losses, entropies and gradient norms, step by step, to float rounding (the
/// packed passes batch their products differently).
#[test]
fn a_padding_free_run_matches_the_padded_run() {
    let tmp = tempfile::tempdir().unwrap();
    let args = ["max_completion_length=6", "num_iterations=2"];
    let padded = run(&tmp.path().join("padded"), 4, &args);
    let packed_args = [args[0], args[1], "padding_free=true"];
    let packed = run(&tmp.path().join("packed"), 4, &packed_args);
    assert_eq!(padded.len(), packed.len());
    let close = |a: f64, b: f64, what: &str, step: usize| {
        assert!(
            (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1e-3),
            "step {step}: {what} {a} (padded) against {b} (packed)"
        );
    };
    for (i, (a, b)) in padded.iter().zip(&packed).enumerate() {
        assert_eq!(a.completions, b.completions, "step {i}: the same rollouts");
        close(a.loss, b.loss, "loss", i);
        close(a.grad_norm, b.grad_norm, "grad_norm", i);
        close(a.entropy.unwrap(), b.entropy.unwrap(), "entropy", i);
    }
}

/// Off-policy (4 optimizer steps per generation batch), the micro-batches before a batch's
/// first optimizer step take the update's own log-probs as their old ones instead of a pass of
/// their own: the run is the same to the bit, every logged value but the clocks.
#[test]
fn old_logprobs_from_the_updates_own_forward_change_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let switch = &fleet_gspo::trainer::OWN_OLD_LOGP;
    let overrides = ["learning_rate=0.05"];
    switch.force(Some(false));
    let with_pass = run(&tmp.path().join("pass"), 8, &overrides);
    switch.force(Some(true));
    let own = run(&tmp.path().join("own"), 8, &overrides);
    switch.force(None);
    let values = |m: &[StepMetrics]| -> Vec<serde_json::Value> {
        m.iter()
            .map(|r| {
                let mut v = serde_json::to_value(r).unwrap();
                let o = v.as_object_mut().unwrap();
                for clock in StepMetrics::CLOCK_FIELDS {
                    o.remove(clock);
                }
                v
            })
            .collect()
    };
    assert_eq!(values(&with_pass), values(&own));
    // The later steps of a batch read the old log-probs: the policy has moved by then.
    assert!(
        own.iter().any(|r| r.ratio_mean.is_some_and(|x| x != 1.0)),
        "no step saw a ratio other than 1: the test would not see a wrong old log-prob"
    );
}
