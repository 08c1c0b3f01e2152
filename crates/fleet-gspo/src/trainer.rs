//! The training loop, top to bottom.
//!
//! One generation batch at a time:
//!
//! 1. draw `prompts_per_generation` prompts and sample `num_generations` completions of each
//!    with the current weights (fleet-models' inference path: KV cache, fused kernels);
//! 2. score them ([`WeightedSum`]) and turn the totals into group advantages;
//! 3. off-policy (see [`GspoConfig::is_on_policy`]), compute the old log-probs once, without
//!    gradients — except for the micro-batches before the first optimizer step, which still
//!    see the weights that generated the batch and take the update's own forward's (the same
//!    values to the bit); with `beta > 0`, the reference model's log-probs;
//! 4. shuffle the completions once and cut them into `steps_per_generation` micro-batches,
//!    each read as wide as its longest scored completion (the log-prob passes of step 3 cut
//!    them alike); `num_iterations` passes over them; every `gradient_accumulation_steps`
//!    micro-batches the gradients are clipped and AdamW takes a step; one metrics line per
//!    optimizer step.
//!
//! Checkpoints are written only at the end of a generation batch (when `save_steps` says so),
//! so a resume never needs a half-used batch: it continues with the next one, bit for bit.
//!
//! Data-parallel ([`crate::dist`]): every rank draws the same prompts, samples and scores its
//! share of the rows, and gathers the rest; each micro-batch is shared among the ranks and the
//! gradients are summed before the optimizer step, so every rank takes the same step. Only
//! rank 0 writes metrics and checkpoints.

use std::collections::BTreeMap;
use std::time::Instant;

use candle_core::{DType, Tensor};
use fleet_models::qwen::train::{ParamGrads, TokenBatch, TrainableQwen};
use fleet_models::{
    CheckpointFiles, GenerationOutput, GenerationRequest, Generator, PagedOptions, SamplingParams,
    TextModel, TextTokenizer,
};

use crate::advantage::{group_advantages, GroupAdvantages};
use crate::checkpoint::{self, CheckpointContents, TrainerState};
use crate::config::GspoConfig;
use crate::dataset::{PromptDataset, PromptSampler, Sample};
use crate::dist::{AllReduceGrads, BatchLayout, DataParallel, Shares};
use crate::loss::{
    completion_mask, masked_sum, policy_loss, LossConfig, LossInputs, LossMetrics, StepLossMetrics,
};
use crate::metrics::{
    trainer_epoch, CompletionRecord, CompletionStats, EvalMetrics, MetricsError, MetricsLog,
    StepMetrics, StepParts, StepTimings,
};
use crate::optim::{clip_grad_norm, AdamW, Gradients, LrSchedule, OptimError, OptimizerState};
use crate::prompt::RenderedPrompt;
use crate::rewards::{BatchRewards, RewardError, WeightedSum};
use crate::TrainError;

/// What rollouts need of the policy's checkpoint besides its weights. The inference model is
/// not kept here: each rollout builds it from the current weights and drops it when generation
/// ends, so its copy (the whole model in the compute dtype with f32 masters) never sits beside
/// the training step's activations.
pub struct RolloutText {
    /// tokenizer.json, when the checkpoint has one.
    pub tokenizer: Option<TextTokenizer>,
    /// Stop ids (generation_config.json's, else config.json's, else the tokenizer's).
    pub eos_ids: Vec<u32>,
    /// The padding id.
    pub pad_id: u32,
}

impl RolloutText {
    /// The tokenizer and ids of `text`; its model is dropped.
    pub fn from_text_model(text: TextModel) -> Self {
        let (eos_ids, pad_id) = (text.eos_ids(), text.pad_id());
        RolloutText {
            tokenizer: text.tokenizer,
            eos_ids,
            pad_id,
        }
    }
}

/// The prompts an evaluation generates for, rendered once.
pub struct EvalPrompts {
    /// The dataset rows.
    pub samples: Vec<Sample>,
    /// Their prompts, rendered and tokenized.
    pub prompts: Vec<RenderedPrompt>,
}

/// Everything a run trains with, loaded and placed.
pub struct Trainer {
    /// The configuration.
    pub config: GspoConfig,
    /// The policy being trained.
    pub policy: TrainableQwen,
    /// The policy's tokenizer and stop ids (the inference model is built for each rollout).
    pub text: RolloutText,
    /// The base checkpoint's files (copied into checkpoints).
    pub base: CheckpointFiles,
    /// The frozen reference model (only with `beta > 0`).
    pub reference: Option<TrainableQwen>,
    /// The reward functions.
    pub rewards: WeightedSum,
    /// The prompts.
    pub data: PromptDataset,
    /// Every sample's prompt, rendered and tokenized once.
    pub prompts: Vec<RenderedPrompt>,
    /// The evaluation prompts (`eval_strategy = "steps"`), if any.
    pub eval: Option<EvalPrompts>,
    /// Where the next generation batch's prompts come from.
    pub sampler: PromptSampler,
    /// AdamW over the policy's parameters.
    pub optimizer: AdamW,
    /// The learning rate per step.
    pub schedule: LrSchedule,
    /// Optimizer steps of the whole run.
    pub total_steps: u64,
    /// Where the run stands.
    pub state: TrainerState,
    /// One line per optimizer step (rank 0 only).
    pub metrics: Option<MetricsLog>,
    /// The same scalars as TensorBoard events (`report_to = "tensorboard"`, rank 0 only).
    pub tensorboard: Option<crate::tensorboard::EventWriter>,
    /// The logged completions (`log_completions`, rank 0 only).
    pub completions: Option<fleet_runs::JsonlLog>,
    /// Peak memory per device, for the metrics.
    pub memory: fleet_topology::MemoryWatch,
    /// The other ranks of a data-parallel run (`None`: one process).
    pub dp: Option<DataParallel>,
    /// The batch arithmetic (world size, global and per-rank batches, learning-rate scale).
    pub layout: BatchLayout,
}

/// One generation batch, scored, ready for the updates.
struct Rollouts {
    /// The dataset row of each prompt (G completions each).
    indices: Vec<usize>,
    /// Prompt ids per completion (a prompt repeated G times).
    prompts: Vec<Vec<u32>>,
    /// Completion ids (EOS included when generated).
    completions: Vec<Vec<u32>>,
    rewards: BatchRewards,
    advantages: GroupAdvantages,
    /// `[rows, completion_width]` f32.
    mask: Tensor,
    /// Masked tokens per row (0: the row is out of the loss).
    row_tokens: Vec<u64>,
    /// The micro-batches over all ranks: rows of the generation batch, shuffled once.
    micro_batches: Vec<Vec<usize>>,
    /// Where a row this rank trains on sits in `old_logp` / `ref_logp`.
    logp_pos: std::collections::HashMap<usize, usize>,
    /// Old log-probs (off-policy) of this rank's rows, `[rank rows, width]`; zeros in the
    /// rows of the first `own_old_logp` micro-batches.
    old_logp: Option<Tensor>,
    /// Leading micro-batches (of the first iteration) that run before the generation batch's
    /// first optimizer step, on the weights that generated it: their old log-probs are the
    /// update's own forward's, detached (to the bit what a pass of their own would give, a
    /// test in fleet-models checks), so no pass is spent on them.
    own_old_logp: usize,
    /// Reference log-probs (beta > 0) of this rank's rows, `[rank rows, width]`.
    ref_logp: Option<Tensor>,
    stats: CompletionStats,
    tokens: u64,
    generation_seconds: f64,
    scoring_seconds: f64,
}

/// What the loop reports after each optimizer step.
pub type OnStep<'a> = dyn FnMut(&StepMetrics) + 'a;

/// What the loop reports after each evaluation.
pub type OnEval<'a> = dyn FnMut(&EvalMetrics) + 'a;

/// Salt of the evaluation's sampling seeds: its draws never repeat a training batch's.
const EVAL_SEED: u64 = 0x6576_616c_7561_7465;

impl Trainer {
    /// Trains until `total_steps` optimizer steps are done, checkpointing (and evaluating) as
    /// configured.
    pub fn train(&mut self, on_step: &mut OnStep<'_>) -> Result<(), TrainError> {
        self.train_with(on_step, &mut |_| {})
    }

    /// [`Trainer::train`], reporting each evaluation too.
    pub fn train_with(
        &mut self,
        on_step: &mut OnStep<'_>,
        on_eval: &mut OnEval<'_>,
    ) -> Result<(), TrainError> {
        while self.state.step < self.total_steps {
            self.generation_batch(on_step, on_eval)?;
        }
        Ok(())
    }

    /// Draws, scores and trains on one generation batch; evaluates and checkpoints after it
    /// when a multiple of `eval_steps` or `save_steps` falls in it.
    pub fn generation_batch(
        &mut self,
        on_step: &mut OnStep<'_>,
        on_eval: &mut OnEval<'_>,
    ) -> Result<(), TrainError> {
        let step_before = self.state.step;
        let rollouts = self.rollouts()?;
        self.state.generation_batch += 1;
        self.state.cursor = self.sampler.cursor();
        self.state.num_tokens += rollouts.tokens;

        // A copy: the loop's optimizer step needs `self` mutably while the settings are read.
        let cfg = &self.config.clone();
        let shares = self.shares();
        let loss_config = LossConfig::from(cfg);
        let gas = cfg.gradient_accumulation_steps;

        let mut grads = ParamGrads::new();
        let mut step_loss = 0.0;
        // One entry per micro-batch of the step (TRL logs the mean of per-micro-batch values).
        let mut step_metrics = StepLossMetrics::default();
        let mut step_tokens = 0u64;
        let mut micro_in_step = 0;
        let mut step_started = Instant::now();
        let mut first_step = true;
        let mut step_in_batch = 0u64;
        let mut last_epoch = self.epoch(0);
        let mut completions_logged = false;
        // A micro-batch fitted to memory (auto_find_batch_size) runs as `split` smaller ones;
        // the loss is still normalised over the configured micro-batch (its sequences, and
        // gradient_accumulation_steps / split of them per step), as TRL computes it.
        let split = self.layout.micro_split.max(1);
        let configured_gas = (gas / split).max(1) as f64;
        for iteration in 0..cfg.num_iterations {
            for (m, micro) in rollouts.micro_batches.iter().enumerate() {
                if self.state.step >= self.total_steps {
                    return Ok(());
                }
                // This rank's share; the loss is divided by the sequences of the whole
                // configured micro-batch (over all ranks, and all parts of a split one).
                let first = m / split * split;
                let last = (first + split).min(rollouts.micro_batches.len());
                let global_sequences = rollouts.micro_batches[first..last]
                    .iter()
                    .flatten()
                    .filter(|&&i| rollouts.row_tokens[i] > 0)
                    .count() as u64;
                let rows = shares.of(micro);
                let (loss, metrics, tokens) =
                    fleet_models::profile::profiler_window("train.micro_step", || {
                        self.micro_step(
                            &rollouts,
                            rows,
                            iteration == 0 && m < rollouts.own_old_logp,
                            global_sequences,
                            &loss_config,
                            &mut grads,
                        )
                    })?;
                step_loss += loss / configured_gas;
                // The parts of a split micro-batch are one micro-batch of TRL's (one value
                // of each metric).
                if m % split == 0 {
                    step_metrics.push(metrics);
                } else {
                    step_metrics.push_part(metrics);
                }
                step_tokens += tokens;
                micro_in_step += 1;
                if micro_in_step < gas {
                    continue;
                }
                // The optimizer step, on the gradients summed over the ranks.
                self.all_reduce(
                    &mut grads,
                    &mut step_loss,
                    &mut step_tokens,
                    &mut step_metrics,
                )?;
                let optimizer_started = Instant::now();
                let (g, grad_norm) = self.clipped_gradients(&mut grads, step_loss)?;
                let lr = self.optimizer_step(&g)?;
                self.state.step += 1;
                step_in_batch += 1;
                let optimizer_seconds = optimizer_started.elapsed().as_secs_f64();
                let update_seconds = step_started.elapsed().as_secs_f64();
                let timings = StepTimings {
                    generation_seconds: if first_step {
                        rollouts.generation_seconds
                    } else {
                        0.0
                    },
                    scoring_seconds: if first_step {
                        rollouts.scoring_seconds
                    } else {
                        0.0
                    },
                    update_seconds,
                };
                let peak = self.peak_memory();
                last_epoch = self.epoch(step_in_batch);
                let record = StepMetrics::from_parts(&StepParts {
                    step: self.state.step,
                    epoch: last_epoch,
                    advantages: &rollouts.advantages,
                    rewards: &rollouts.rewards,
                    num_generations: cfg.num_generations,
                    scale_rewards: cfg.scale_rewards,
                    loss_metrics: &step_metrics,
                    completions: rollouts.stats,
                    grad_norm,
                    learning_rate: lr,
                    num_tokens: self.state.num_tokens,
                    step_tokens,
                    generation_batch: self.state.generation_batch,
                    timings,
                    optimizer_seconds,
                    peak_memory_bytes: &peak,
                });
                if let Some(metrics) = &mut self.metrics {
                    metrics.append(&record)?;
                }
                self.report(record.step, &record)?;
                if self.completions.is_some()
                    && !completions_logged
                    && self.state.step.is_multiple_of(cfg.logging_steps)
                {
                    self.log_completions(&rollouts)?;
                    completions_logged = true;
                }
                on_step(&record);
                step_loss = 0.0;
                step_metrics = StepLossMetrics::default();
                step_tokens = 0;
                micro_in_step = 0;
                first_step = false;
                step_started = Instant::now();
            }
        }
        // Evaluations at the same boundaries as checkpoints (every rank takes part), before
        // the checkpoint: the checkpoint written here holds the weights just evaluated.
        let mut new_best = false;
        let eval_crossed = self
            .config
            .eval_every()
            .is_some_and(|every| self.state.step / every > step_before / every);
        if eval_crossed && self.eval.is_some() {
            let m = self.evaluate(last_epoch)?;
            new_best = self.note_best(&m)?;
            if let Some(metrics) = &mut self.metrics {
                metrics.append_eval(&m)?;
            }
            self.report(m.step, &m)?;
            on_eval(&m);
        }
        // Checkpoints only between generation batches: a resume starts a fresh one. One is
        // written after the generation batch in which a multiple of save_steps falls (TRL's
        // steps when save_steps is a multiple of the optimizer steps per generation batch;
        // otherwise the next batch end, never drifting further). Rank 0 writes them; the
        // ranks hold the same weights.
        let save_every = match self.config.save_strategy {
            crate::config::IntervalStrategy::Steps => self.config.save_steps,
            crate::config::IntervalStrategy::No => 0,
        };
        let last = self.state.step >= self.total_steps;
        let crossed = save_every > 0 && self.state.step / save_every > step_before / save_every;
        if save_every > 0 && (last || crossed) {
            if new_best {
                // HF: a checkpoint written with a new best metric becomes the best one.
                self.state.best_model_checkpoint =
                    Some(format!("{}{}", checkpoint::PREFIX, self.state.step));
            }
            self.save()?;
        }
        Ok(())
    }

    /// `record`'s scalars to TensorBoard, when it is on ([`crate::tensorboard::scalars_of`]).
    fn report(&mut self, step: u64, record: &impl serde::Serialize) -> Result<(), TrainError> {
        let Some(tb) = &mut self.tensorboard else {
            return Ok(());
        };
        let value = serde_json::to_value(record)
            .map_err(|e| TrainError::Setup(format!("metrics for TensorBoard: {e}")))?;
        let scalars = crate::tensorboard::scalars_of(&value);
        tb.scalars(step, scalars.iter().map(|(t, v)| (t.as_str(), *v)))
            .map_err(|e| TrainError::Setup(format!("writing {}: {e}", tb.path().display())))
    }

    /// Appends the generation batch's first `num_completions_to_print` completions (all when
    /// unset) to `completions.jsonl` and writes them as the table `completions.md`
    /// (`log_completions`).
    fn log_completions(&mut self, r: &Rollouts) -> Result<(), TrainError> {
        let g = self.config.num_generations;
        let n = self
            .config
            .num_completions_to_print
            .unwrap_or(r.completions.len())
            .min(r.completions.len());
        let tokenizer = self.text.tokenizer.as_ref();
        let mut records = Vec::with_capacity(n);
        for row in 0..n {
            let index = r.indices[row / g];
            let completion = match tokenizer {
                Some(t) => t.decode(&r.completions[row], true)?,
                None => format!("{:?}", r.completions[row]),
            };
            records.push(CompletionRecord {
                step: self.state.step,
                generation_batch: self.state.generation_batch,
                id: self.data.samples[index].id.clone(),
                prompt: self.prompts[index].text.clone(),
                completion,
                rewards: r
                    .rewards
                    .per_func
                    .iter()
                    .map(|f| (f.name.clone(), f.values[row]))
                    .collect(),
                reward: r.rewards.totals[row],
                advantage: r.advantages.advantages[row],
            });
        }
        if let Some(log) = &mut self.completions {
            for rec in &records {
                log.append(rec).map_err(MetricsError::from)?;
            }
        }
        crate::metrics::write_completions_table(&self.config.output_dir, &records)?;
        Ok(())
    }

    /// Scores this rank's completions `outputs` (of `prompts`, for `samples`: one per output)
    /// and gathers every rank's completions and rewards, in row order (ranks hold consecutive
    /// rows).
    fn score_and_gather(
        &self,
        outputs: &[GenerationOutput],
        prompts: &[&str],
        samples: &[&Sample],
    ) -> Result<(Vec<Vec<u32>>, BatchRewards), TrainError> {
        let mut completions: Vec<Vec<u32>> = outputs.iter().map(|o| o.token_ids.clone()).collect();
        let texts: Vec<&str> = outputs.iter().map(|o| o.text.as_str()).collect();
        let mut rewards = self
            .rewards
            .score_batch(prompts, &texts, &completions, samples)?;
        if let Some(dp) = &self.dp {
            let part = serde_json::to_vec(&(&completions, &rewards))
                .map_err(|e| TrainError::Setup(format!("rollouts for the other ranks: {e}")))?;
            let mut all_completions = Vec::new();
            let mut parts = Vec::new();
            for bytes in dp.collective.all_gather_bytes(part)? {
                let (c, r): (Vec<Vec<u32>>, BatchRewards) = serde_json::from_slice(&bytes)
                    .map_err(|e| TrainError::Setup(format!("rollouts from another rank: {e}")))?;
                all_completions.extend(c);
                parts.push(r);
            }
            completions = all_completions;
            rewards = BatchRewards::concat(parts);
        }
        Ok((completions, rewards))
    }

    /// Generates `num_generations_eval` completions of every evaluation prompt with the
    /// current weights (sampled with the training's settings and seeds of their own, or
    /// greedy), `per_device_eval_batch_size` completions per process at a time, scores them
    /// with the training's reward functions and returns the evaluation's metrics
    /// ([`EvalMetrics`]). Nothing of it reaches the training: no weight, seed or data cursor.
    pub fn evaluate(&self, epoch: f64) -> Result<EvalMetrics, TrainError> {
        let started = Instant::now();
        let cfg = &self.config;
        let eval = self.eval.as_ref().ok_or_else(|| {
            TrainError::Setup("evaluate: the trainer has no evaluation prompts".into())
        })?;
        let k = cfg.eval_generations();
        let shares = self.shares();
        let per_chunk = (cfg.per_device_eval_batch_size * shares.world_size / k).max(1);
        let timer = Stage::start(self, "eval");
        let model = self.policy.inference_model()?;
        let generator = Generator::new(
            &model,
            self.text.tokenizer.as_ref(),
            self.text.eos_ids.clone(),
            self.text.pad_id,
        );
        let mut parts = Vec::new();
        let mut lengths = Vec::new();
        let indices: Vec<usize> = (0..eval.samples.len()).collect();
        for chunk in indices.chunks(per_chunk) {
            let mut requests = Vec::with_capacity(chunk.len() * k);
            for &p in chunk {
                for j in 0..k {
                    let row = (p * k + j) as u64;
                    let sampling = if cfg.eval_do_sample {
                        rollout_sampling(
                            cfg,
                            sampling_seed(cfg.seed ^ EVAL_SEED, self.state.step, row),
                        )
                    } else {
                        SamplingParams::greedy()
                    };
                    requests.push(GenerationRequest {
                        prompt_ids: eval.prompts[p].ids.clone(),
                        max_new_tokens: cfg.max_completion_length,
                        sampling,
                        stop_strings: Vec::new(),
                    });
                }
            }
            // Consecutive rows per rank; the last chunk need not divide evenly.
            let n = requests.len();
            let mine =
                shares.rank * n / shares.world_size..(shares.rank + 1) * n / shares.world_size;
            let outputs = generate_rollouts(
                &generator,
                &requests[mine.clone()],
                cfg.max_num_seqs,
                cfg.num_scheduler_steps,
            )?;
            let prompts: Vec<&str> = chunk
                .iter()
                .flat_map(|&p| std::iter::repeat_n(eval.prompts[p].text.as_str(), k))
                .collect();
            let samples: Vec<&Sample> = chunk
                .iter()
                .flat_map(|&p| std::iter::repeat_n(&eval.samples[p], k))
                .collect();
            let (completions, rewards) =
                self.score_and_gather(&outputs, &prompts[mine.clone()], &samples[mine])?;
            lengths.extend(completions.iter().map(Vec::len));
            parts.push(rewards);
        }
        drop(model);
        timer.stop(self)?;
        Ok(EvalMetrics::from_parts(
            (self.state.step, epoch, started.elapsed().as_secs_f64()),
            &BatchRewards::concat(parts),
            &lengths,
            k,
            cfg.eval_pass_threshold,
        ))
    }

    /// Whether `m` improves on the best `metric_for_best_model` so far (recorded in the state
    /// when it does); an error when the metric is not among the evaluation's.
    fn note_best(&mut self, m: &EvalMetrics) -> Result<bool, TrainError> {
        let Some((name, greater)) = self.config.best_metric() else {
            return Ok(false);
        };
        if !m.values.contains_key(&name) && m.get(&name).is_none() {
            let known: Vec<&str> = m.values.keys().map(String::as_str).collect();
            return Err(TrainError::Setup(format!(
                "metric_for_best_model = {name:?} is not an evaluation metric; the evaluation \
                 logs {}",
                known.join(", ")
            )));
        }
        let Some(value) = m.get(&name).filter(|v| v.is_finite()) else {
            return Ok(false);
        };
        let better = match self.state.best_metric {
            None => true,
            Some(best) => {
                if greater {
                    value > best
                } else {
                    value < best
                }
            }
        };
        if better {
            self.state.best_metric = Some(value);
            self.state.best_global_step = Some(m.step);
        }
        Ok(better)
    }

    /// Sums the step's gradients, loss, tokens and per-micro-batch loss metrics over the
    /// ranks (nothing to do in one process): every rank then holds the one-process gradient.
    fn all_reduce(
        &self,
        grads: &mut ParamGrads,
        step_loss: &mut f64,
        step_tokens: &mut u64,
        step_metrics: &mut StepLossMetrics,
    ) -> Result<(), TrainError> {
        let timer = Stage::start(self, "optim.1_all_reduce");
        if let Some(dp) = &self.dp {
            let params: Vec<candle_core::Var> = self
                .optimizer
                .params()
                .iter()
                .map(|(_, v)| v.clone())
                .collect();
            dp.collective.all_reduce_grads(grads, &params)?;
            let mut sums = [*step_loss, *step_tokens as f64];
            dp.collective.all_reduce_f64(&mut sums)?;
            *step_loss = sums[0];
            *step_tokens = sums[1] as u64;
            // Each micro-batch's counts summed over the ranks (TRL's `global_masked_mean`
            // reduces each micro-batch's sums over the processes).
            let mine = serde_json::to_vec(&*step_metrics)
                .map_err(|e| TrainError::Setup(format!("loss metrics: {e}")))?;
            let mut all: Option<StepLossMetrics> = None;
            for bytes in dp.collective.all_gather_bytes(mine)? {
                let m: StepLossMetrics = serde_json::from_slice(&bytes).map_err(|e| {
                    TrainError::Setup(format!("loss metrics from another rank: {e}"))
                })?;
                match &mut all {
                    None => all = Some(m),
                    Some(a) => a
                        .merge_rank(&m)
                        .map_err(|e| TrainError::Setup(e.to_string()))?,
                }
            }
            *step_metrics = all.unwrap_or_default();
        }
        timer.stop(self)?;
        Ok(())
    }

    /// The step's gradients (taken out of `grads`) clipped to `max_grad_norm`, and their norm
    /// before clipping. A NaN or infinite norm stops the run with the step, its loss and the
    /// first parameters whose gradient is not finite (the diagnostics), before any update.
    fn clipped_gradients(
        &self,
        grads: &mut ParamGrads,
        step_loss: f64,
    ) -> Result<(Gradients, f64), TrainError> {
        let cfg = &self.config;
        let timer = Stage::start(self, "optim.2_clip");
        let mut g = Gradients::new(std::mem::take(grads).into_vec());
        let norm = if cfg.max_grad_norm > 0.0 {
            clip_grad_norm(&mut g, cfg.max_grad_norm)
        } else {
            crate::optim::grad_norm(&g)
        };
        let grad_norm = match norm {
            Ok(n) if n.is_finite() => n,
            Ok(norm) | Err(OptimError::NonFiniteGradNorm { norm }) => {
                let names = self.optimizer.params();
                let params = g
                    .non_finite(3)?
                    .into_iter()
                    .map(|i| names[i].0.clone())
                    .collect::<Vec<_>>()
                    .join(", ");
                return Err(TrainError::NonFiniteGradients {
                    step: self.state.step + 1,
                    loss: step_loss,
                    norm,
                    params,
                });
            }
            Err(e) => return Err(e.into()),
        };
        timer.stop(self)?;
        Ok((g, grad_norm))
    }

    /// One AdamW update with `g` at this step's learning rate, which it returns. Under ZeRO
    /// stage 1 each rank updates its share of the parameters, then every rank takes the others'
    /// shares from their owners ([`crate::dist::gather_owned`]).
    fn optimizer_step(&mut self, g: &Gradients) -> Result<f64, TrainError> {
        let timer = Stage::start(self, "optim.3_adamw");
        let lr = self.schedule.lr(self.state.step) * self.layout.lr_scale;
        self.optimizer.step(g, lr)?;
        timer.stop(self)?;
        if let (Some(dp), true) = (&self.dp, self.is_sharded()) {
            let timer = Stage::start(self, "optim.4_zero_gather");
            let vars: Vec<candle_core::Var> = self
                .optimizer
                .params()
                .iter()
                .map(|(_, v)| v.clone())
                .collect();
            let tensors: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
            // Each rank's copy in its own dtype: the owner's f32 master, the others' rounding.
            let dtypes: Vec<DType> = tensors.iter().map(Tensor::dtype).collect();
            // Each parameter set as its bucket arrives: a gathered copy of the whole model
            // beside the weights did not fit a 7B run on an H100.
            crate::dist::gather_owned(
                &*dp.collective,
                &tensors,
                self.optimizer.owned(),
                &dtypes,
                |i, t| Ok(vars[i].set(&t)?),
            )?;
            timer.stop(self)?;
        }
        Ok(lr)
    }

    /// Whether the optimizer state is sharded over the ranks (ZeRO stage 1).
    fn is_sharded(&self) -> bool {
        self.optimizer.owned().iter().any(|o| !o)
    }

    /// The optimizer state a checkpoint holds: the live moments, or under ZeRO stage 1 every
    /// rank's share gathered (every rank takes part; rank 0 writes).
    fn checkpoint_optimizer_state(&self) -> Result<Option<OptimizerState>, TrainError> {
        let Some(dp) = self.dp.as_ref().filter(|_| self.is_sharded()) else {
            return Ok(None);
        };
        let owned = self.optimizer.owned();
        // Moments are in the master dtype.
        let dtypes = self.policy.master_dtypes();
        // One moment (0: exp_avg, 1: exp_avg_sq) of every parameter, gathered, on the host.
        let gather = |which: usize| -> Result<Vec<Tensor>, TrainError> {
            let tensors: Vec<Tensor> = self
                .optimizer
                .params()
                .iter()
                .enumerate()
                .map(|(i, (_, var))| match self.optimizer.moments(i) {
                    Some((m, v, _)) if owned[i] => [m, v][which].clone(),
                    // Not ours: the parameter gives the shape.
                    _ => var.as_tensor().clone(),
                })
                .collect();
            let mut out = Vec::with_capacity(tensors.len());
            crate::dist::gather_owned(&*dp.collective, &tensors, owned, &dtypes, |_, t| {
                out.push(t.to_device(&candle_core::Device::Cpu)?);
                Ok(())
            })?;
            Ok(out)
        };
        let (m, v) = (gather(0)?, gather(1)?);
        Ok(Some(
            self.optimizer.state_from(m.into_iter().zip(v).collect())?,
        ))
    }

    /// The master weights a checkpoint holds: `None` when this process holds them all, or
    /// under ZeRO stage 1's sharded masters every owner's f32 masters gathered (every rank
    /// takes part), on the host.
    fn checkpoint_masters(&self) -> Result<Option<Vec<(String, Tensor)>>, TrainError> {
        let named = self.policy.named_tensors();
        let dtypes = self.policy.master_dtypes();
        let narrowed = named.iter().zip(&dtypes).any(|((_, t), &d)| t.dtype() != d);
        let Some(dp) = self.dp.as_ref().filter(|_| narrowed) else {
            return Ok(None);
        };
        let tensors: Vec<Tensor> = named.iter().map(|(_, t)| t.clone()).collect();
        let owned = self.optimizer.owned();
        let mut full = Vec::with_capacity(tensors.len());
        crate::dist::gather_owned(&*dp.collective, &tensors, owned, &dtypes, |_, t| {
            full.push(t.to_device(&candle_core::Device::Cpu)?);
            Ok(())
        })?;
        Ok(Some(
            named.into_iter().map(|(name, _)| name).zip(full).collect(),
        ))
    }

    /// Writes a checkpoint of the current step (rank 0; under ZeRO stage 1 every rank must
    /// call it, to gather the optimizer state and the masters, and rank 0 alone writes).
    pub fn save(&mut self) -> Result<Option<std::path::PathBuf>, TrainError> {
        let gathered = self.checkpoint_optimizer_state()?;
        let masters = self.checkpoint_masters()?;
        if !self.is_main() {
            return Ok(None);
        }
        self.state.commit = fleet_runs::commit_id();
        self.state.fleet_version = fleet_runs::fleet_version();
        // The moments as they are, no copy: a checkpoint must not need the optimizer's memory
        // twice (under ZeRO the gathered copy, on the host).
        let view;
        let optimizer: &OptimizerState = match &gathered {
            Some(state) => state,
            None => {
                view = self.optimizer.state_view()?;
                &view
            }
        };
        let path = checkpoint::save(
            &self.config.output_dir,
            &CheckpointContents {
                weights: masters.unwrap_or_else(|| self.policy.named_tensors()),
                optimizer,
                state: &self.state,
                base: &self.base,
                adapter: self.policy.lora_config(),
            },
            self.config.save_total_limit,
        )?;
        Ok(Some(path))
    }

    /// With `load_best_model_at_end`: the best checkpoint's model files (weights, config,
    /// tokenizer) copied into `output_dir`, each through a temporary file, where HF's
    /// `trainer.save_model()` writes them after loading the best model; returns the best
    /// checkpoint. `None` without the setting or a best checkpoint (rank 0 only).
    pub fn export_best(&self) -> Result<Option<std::path::PathBuf>, TrainError> {
        let out = &self.config.output_dir;
        let Some(best) = self
            .state
            .best_model_checkpoint
            .as_ref()
            .filter(|_| self.config.load_best_model_at_end && self.is_main())
        else {
            return Ok(None);
        };
        let dir = out.join(best);
        let files = std::fs::read_dir(&dir).map_err(|e| {
            TrainError::Setup(format!("the best checkpoint {}: {e}", dir.display()))
        })?;
        for entry in files.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            // The model, not the training state (optimizer, trainer_state).
            if name.starts_with("optimizer") || name == "trainer_state.json" {
                continue;
            }
            let tmp = out.join(format!(".{name}.best-{}", std::process::id()));
            std::fs::copy(entry.path(), &tmp)
                .and_then(|_| std::fs::rename(&tmp, out.join(&name)))
                .map_err(|e| {
                    TrainError::Setup(format!("copying {} into {}: {e}", name, out.display()))
                })?;
        }
        Ok(Some(dir))
    }

    /// With LoRA (`use_peft`): the model with its adapters merged, written to
    /// `<output_dir>/merged` in Hugging Face layout ([`checkpoint::write_merged`]); returns
    /// the directory. `None` without LoRA (rank 0 only).
    pub fn export_merged(&self) -> Result<Option<std::path::PathBuf>, TrainError> {
        if self.policy.lora_config().is_none() || !self.is_main() {
            return Ok(None);
        }
        let weights = self.policy.merged_weights()?;
        Ok(Some(checkpoint::write_merged(
            &self.config.output_dir,
            &self.base,
            &weights,
        )?))
    }

    /// Ends a data-parallel run cleanly on this rank (every rank calls it after training);
    /// nothing for a single process.
    pub fn finish(&mut self) -> Result<(), TrainError> {
        match self.dp.take() {
            Some(dp) => dp.finish(),
            None => Ok(()),
        }
    }

    /// Whether this process writes the run's files (rank 0, or the only process).
    pub fn is_main(&self) -> bool {
        self.dp.as_ref().is_none_or(|dp| dp.world().is_main())
    }

    /// This rank's shares of the rows.
    pub fn shares(&self) -> Shares {
        self.dp
            .as_ref()
            .map_or(Shares::SINGLE, DataParallel::shares)
    }

    /// HF's `state.epoch` after the `step_in_batch`-th optimizer step (1-based) on the
    /// generation batch just drawn ([`trainer_epoch`]); the sampler's position when the layout
    /// has no whole batch per epoch.
    fn epoch(&self, step_in_batch: u64) -> f64 {
        let cursor = self.sampler.cursor();
        let per_batch = self.layout.steps_per_generation_batch as u64;
        let prompts = self.layout.prompts_per_generation.max(1);
        trainer_epoch(
            cursor.epoch,
            (cursor.position / prompts) as u64,
            step_in_batch,
            per_batch,
            self.layout
                .steps_per_epoch
                .checked_div(per_batch)
                .unwrap_or(0),
        )
        .unwrap_or_else(|| self.sampler.epoch_progress())
    }

    /// Peak memory seen so far per device (each GPU's most in use; the CPU's resident
    /// high-water mark).
    fn peak_memory(&self) -> BTreeMap<String, u64> {
        self.memory.peaks()
    }

    /// Step 1-3: sample, score, old and reference log-probs.
    fn rollouts(&mut self) -> Result<Rollouts, TrainError> {
        let cfg = self.config.clone();
        let g = cfg.num_generations;
        let started = Instant::now();
        let batch = self
            .sampler
            .next_batch(self.layout.prompts_per_generation)?;
        let samples: Vec<&Sample> = batch
            .indices
            .iter()
            .map(|&i| &self.data.samples[i])
            .collect();
        let prompt_texts: Vec<&str> = batch
            .indices
            .iter()
            .map(|&i| self.prompts[i].text.as_str())
            .collect();
        let prompt_ids: Vec<Vec<u32>> = batch
            .indices
            .iter()
            .map(|&i| self.prompts[i].ids.clone())
            .collect();
        // G samples of every prompt, each with its own seed: the same run gives the same
        // completions, also after a resume.
        let mut requests = Vec::with_capacity(samples.len() * g);
        for (p, ids) in prompt_ids.iter().enumerate() {
            for k in 0..g {
                let row = (p * g + k) as u64;
                requests.push(GenerationRequest {
                    prompt_ids: ids.clone(),
                    max_new_tokens: cfg.max_completion_length,
                    sampling: rollout_sampling(
                        &cfg,
                        sampling_seed(cfg.seed, self.state.generation_batch, row),
                    ),
                    stop_strings: Vec::new(),
                });
            }
        }
        // This rank samples and scores its share of the rows.
        let shares = self.shares();
        let mine = shares.range(requests.len());
        let timer = Stage::start(self, "rollout.inference_model");
        let model = self.policy.inference_model()?;
        timer.stop(self)?;
        let timer = Stage::start(self, "rollout.generate");
        let outputs = generate_rollouts(
            &Generator::new(
                &model,
                self.text.tokenizer.as_ref(),
                self.text.eos_ids.clone(),
                self.text.pad_id,
            ),
            &requests[mine.clone()],
            cfg.max_num_seqs,
            cfg.num_scheduler_steps,
        )?;
        // Freed before the update: the training step never holds this copy.
        drop(model);
        timer.stop(self)?;
        let generation_seconds = started.elapsed().as_secs_f64();

        let scoring = Instant::now();
        let prompts_rep: Vec<&str> = prompt_texts
            .iter()
            .flat_map(|t| std::iter::repeat_n(*t, g))
            .collect();
        let samples_rep: Vec<&Sample> = samples
            .iter()
            .flat_map(|s| std::iter::repeat_n(*s, g))
            .collect();
        let (completions, rewards) = self.score_and_gather(
            &outputs,
            &prompts_rep[mine.clone()],
            &samples_rep[mine.clone()],
        )?;
        if let Some(detail) = rewards.unscored() {
            return Err(RewardError::BatchUnscored {
                batch: self.state.generation_batch + 1,
                completions: rewards.totals.len(),
                detail,
            }
            .into());
        }
        let advantages = group_advantages(&rewards.totals, g, cfg.scale_rewards)?;
        let width = cfg.max_completion_length.max(1);
        let eos = self.text.eos_ids.clone();
        let head = self.policy_head_device();
        let cm = completion_mask(
            &completions,
            &eos,
            width,
            cfg.mask_truncated_completions,
            &head,
        )?;
        let row_tokens: Vec<u64> = cm
            .mask
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?
            .iter()
            .map(|r| r.iter().filter(|&&v| v != 0.0).count() as u64)
            .collect();
        // The micro-batches: a seeded shuffle of the rows, cut into parts of the global
        // micro-batch; this rank trains on its share of each.
        let order = crate::dataset::epoch_order(
            completions.len(),
            cfg.seed,
            self.state.generation_batch + 1,
        );
        let micro_batches: Vec<Vec<usize>> = order
            .chunks(self.layout.global_micro_batch)
            .map(<[usize]>::to_vec)
            .collect();
        let rank_rows: Vec<usize> = micro_batches
            .iter()
            .flat_map(|m| shares.of(m).iter().copied())
            .collect();
        let logp_pos = rank_rows.iter().enumerate().map(|(p, &r)| (r, p)).collect();
        let stats = CompletionStats::from_lengths(&cm.lengths, &cm.truncated);
        let prompts: Vec<Vec<u32>> = prompt_ids
            .iter()
            .flat_map(|p| std::iter::repeat_n(p.clone(), g))
            .collect();
        let tokens = prompts.iter().map(Vec::len).sum::<usize>() as u64
            + cm.lengths.iter().sum::<usize>() as u64;
        let mut rollouts = Rollouts {
            indices: batch.indices.clone(),
            prompts,
            completions,
            rewards,
            advantages,
            mask: cm.mask,
            row_tokens,
            micro_batches,
            logp_pos,
            old_logp: None,
            own_old_logp: 0,
            ref_logp: None,
            stats: stats.ok_or_else(|| {
                TrainError::Setup("a generation batch without completions".into())
            })?,
            tokens,
            generation_seconds,
            scoring_seconds: 0.0,
        };
        if !cfg.is_on_policy() {
            // LoRA's dropout makes the update's forward another draw than a plain pass: then
            // every micro-batch gets its pass.
            rollouts.own_old_logp =
                if (cfg.use_peft && cfg.lora_dropout > 0.0) || !OWN_OLD_LOGP.on() {
                    0
                } else {
                    cfg.gradient_accumulation_steps
                        .min(rollouts.micro_batches.len())
                };
            let timer = Stage::start(self, "rollout.old_logprobs");
            rollouts.old_logp =
                Some(self.all_logprobs(&self.policy, &rollouts, width, rollouts.own_old_logp)?);
            timer.stop(self)?;
        }
        if cfg.beta > 0.0 {
            let reference = self.reference.as_ref().ok_or(TrainError::NoReference)?;
            rollouts.ref_logp = Some(self.all_logprobs(reference, &rollouts, width, 0)?);
            reference.head_device().synchronize()?;
        }
        // The log-prob passes are queued asynchronously: without waiting for them here their
        // GPU time would be counted in the update's phase, where TRL's is not.
        self.policy_head_device().synchronize()?;
        rollouts.scoring_seconds = scoring.elapsed().as_secs_f64();
        Ok(rollouts)
    }

    fn policy_head_device(&self) -> candle_core::Device {
        self.policy.head_device()
    }

    /// Log-probs of this rank's rows under `model`, `[rows, width]` in `r.logp_pos` order: each
    /// micro-batch's share as the update reads it (the same rows, cut to the same
    /// [`Self::micro_width`]), so that the update's first forward gives these values to the
    /// bit; zeros past a micro-batch's width, and in the rows of the first `skip` micro-batches
    /// (not computed).
    fn all_logprobs(
        &self,
        model: &TrainableQwen,
        r: &Rollouts,
        width: usize,
        skip: usize,
    ) -> Result<Tensor, TrainError> {
        let shares = self.shares();
        let dev = self.policy_head_device();
        let mut parts = Vec::new();
        for (m, micro) in r.micro_batches.iter().enumerate() {
            let rows = shares.of(micro);
            if rows.is_empty() {
                continue;
            }
            if m < skip {
                // The passes give f32 log-probs (`ops::logp_entropy`).
                parts.push(Tensor::zeros((rows.len(), width), DType::F32, &dev)?);
                continue;
            }
            let w = self.micro_width(r, rows);
            let batch = self.token_batch(r, rows, w)?;
            let lp = model.logprobs(&batch, self.config.temperature)?;
            let lp = fleet_models::device::transfer(&lp.logp, &dev)?;
            parts.push(if w < width {
                let zeros = Tensor::zeros((rows.len(), width - w), lp.dtype(), &dev)?;
                Tensor::cat(&[lp, zeros], 1)?
            } else {
                lp
            });
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// The width a micro-batch's completions are cut to: its longest scored completion (the
    /// mask's ones; at least 1). The columns after it are masked in every row, and a
    /// position's log-prob depends on the tokens before it only, so cutting them changes no
    /// kept value — a completion batch that stopped early costs its length, not
    /// `max_completion_length` (TRL pads to the generation batch's longest).
    fn micro_width(&self, r: &Rollouts, rows: &[usize]) -> usize {
        rows.iter()
            .map(|&i| r.row_tokens[i] as usize)
            .max()
            .unwrap_or(0)
            .clamp(1, self.config.max_completion_length.max(1))
    }

    /// The rows of a micro-batch as the model reads them; completions cut or padded to `width`
    /// — or, with `padding_free`, each cut to its own scored tokens (the mask's ones: every
    /// column the loss reads) and packed (`TokenBatch::packed`).
    fn token_batch(
        &self,
        r: &Rollouts,
        rows: &[usize],
        width: usize,
    ) -> Result<TokenBatch, TrainError> {
        let prompts: Vec<Vec<u32>> = rows.iter().map(|&i| r.prompts[i].clone()).collect();
        if self.config.padding_free {
            let completions: Vec<Vec<u32>> = rows
                .iter()
                .map(|&i| {
                    let mut c = r.completions[i].clone();
                    c.resize((r.row_tokens[i] as usize).min(width), self.text.pad_id);
                    c
                })
                .collect();
            let batch = TokenBatch::packed(&prompts, &completions, self.text.pad_id)?;
            // The results' width: the longest cut completion, which `width` is (at least 1).
            debug_assert_eq!(batch.completion_len(), width);
            return Ok(batch);
        }
        let completions: Vec<Vec<u32>> = rows
            .iter()
            .map(|&i| {
                let mut c = r.completions[i].clone();
                c.resize(width, self.text.pad_id);
                c
            })
            .collect();
        Ok(TokenBatch::new(&prompts, &completions, self.text.pad_id)?)
    }

    /// One micro-batch (this rank's share of it): forward, GSPO loss, backward into `grads`.
    /// The share's loss is its sum over `global_sequences`, the micro-batch's sequences over
    /// all ranks, so that summing the ranks' gradients gives the whole micro-batch's. Returns
    /// the loss, this share's metrics (the policy's entropy added) and the tokens trained on.
    /// `own_old_logp`: the weights are still those that generated the batch, and the old
    /// log-probs are this forward's own (see `Rollouts::own_old_logp`).
    fn micro_step(
        &self,
        r: &Rollouts,
        rows: &[usize],
        own_old_logp: bool,
        global_sequences: u64,
        loss_config: &LossConfig,
        grads: &mut ParamGrads,
    ) -> Result<(f64, LossMetrics, u64), TrainError> {
        let cfg = &self.config;
        let width = self.micro_width(r, rows);
        let batch = self.token_batch(r, rows, width)?;
        let dev = self.policy_head_device();
        let idx = Tensor::from_vec(
            rows.iter().map(|&i| i as u32).collect::<Vec<_>>(),
            rows.len(),
            &dev,
        )?;
        let mask = r.mask.index_select(&idx, 0)?.narrow(1, 0, width)?;
        let pos: Vec<u32> = rows
            .iter()
            .map(|i| {
                r.logp_pos.get(i).map(|&p| p as u32).ok_or_else(|| {
                    TrainError::Setup(format!("row {i} is not among this rank's rows (a bug)"))
                })
            })
            .collect::<Result<_, _>>()?;
        let pos = Tensor::from_vec(pos, rows.len(), &dev)?;
        let old = r
            .old_logp
            .as_ref()
            .filter(|_| !own_old_logp)
            .map(|t| t.index_select(&pos, 0)?.narrow(1, 0, width))
            .transpose()?;
        let reference = r
            .ref_logp
            .as_ref()
            .map(|t| t.index_select(&pos, 0)?.narrow(1, 0, width))
            .transpose()?;
        let split = self.layout.micro_split.max(1);
        let shared = self.dp.is_some() || split > 1;
        let adv: Vec<f32> = rows.iter().map(|&i| r.advantages.advantages[i]).collect();
        let advantages = Tensor::from_vec(adv, rows.len(), &dev)?;
        // The configured accumulation (a split micro-batch's parts add up to one of its steps).
        let gas = (cfg.gradient_accumulation_steps / split).max(1) as f64;
        let mut metrics = None;
        // LoRA's dropout masks: one key per optimizer step and micro-batch (its first row),
        // so a resumed run draws the same; cleared after, for the log-prob passes.
        if cfg.use_peft && cfg.lora_dropout > 0.0 {
            let first = rows.first().copied().unwrap_or(0) as u64;
            let key = sampling_seed(cfg.seed ^ LORA_DROPOUT_SALT, self.state.step, first);
            self.policy.set_dropout_key(Some(key));
        }
        let passed = self.policy.forward_backward(
            &batch,
            cfg.temperature,
            &mut |logp| {
                let out = policy_loss(
                    &LossInputs {
                        logp,
                        old_logp: old.as_ref(),
                        ref_logp: reference.as_ref(),
                        mask: &mask,
                        advantages: &advantages,
                    },
                    loss_config,
                )?;
                // A share (of the ranks, or of a split micro-batch): its sum over the whole
                // micro-batch's sequences.
                let loss = if shared && global_sequences > 0 {
                    (out.loss * (out.metrics.num_sequences as f64 / global_sequences as f64))?
                } else {
                    out.loss
                };
                let value = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                metrics = Some(out.metrics);
                // Gradient accumulation averages the micro-batches of a step.
                Ok(((loss / gas)?, value))
            },
            grads,
        );
        self.policy.set_dropout_key(None);
        let (lp, loss) = passed?;
        let mut metrics = metrics.unwrap_or_default();
        metrics.entropy_sum = Some(
            masked_sum(&lp.entropy, &mask)
                .map_err(|e| fleet_models::ModelError::BadInput(e.to_string()))?,
        );
        let tokens = metrics.num_tokens;
        Ok((loss, metrics, tokens))
    }
}

/// A profiled stage of the loop (`FLEET_PROFILE=1`): the policy's head device is synchronized
/// at both ends, so the time is the GPU's; free when not profiling.
struct Stage {
    name: &'static str,
    started: Option<Instant>,
}

impl Stage {
    fn start(trainer: &Trainer, name: &'static str) -> Stage {
        let started = fleet_models::profile::enabled().then(|| {
            let _ = trainer.policy_head_device().synchronize();
            fleet_models::profile::begin();
            Instant::now()
        });
        Stage { name, started }
    }

    fn stop(self, trainer: &Trainer) -> Result<(), TrainError> {
        if let Some(t) = self.started {
            trainer.policy_head_device().synchronize()?;
            fleet_models::profile::record(self.name, t.elapsed().as_secs_f64());
        }
        Ok(())
    }
}

/// Whether the micro-batches before a generation batch's first optimizer step take the
/// update's own log-probs as their old ones (`Rollouts::own_old_logp`) instead of a pass of
/// their own: on unless `FLEET_OWN_OLD_LOGP=0`, which gives the measurement of both in one
/// call and a test of their equality.
pub static OWN_OLD_LOGP: fleet_models::ops::EnvSwitch =
    fleet_models::ops::EnvSwitch::new("FLEET_OWN_OLD_LOGP", true);

/// Mixed into the run seed for LoRA's dropout keys (apart from the sampling seeds).
const LORA_DROPOUT_SALT: u64 = 0x6c6f_7261_5f64_726f;

/// Blocks of this many tokens in the rollout engine's KV cache.
const ROLLOUT_BLOCK_SIZE: usize = 16;

/// Samples `requests` (a prompt's G completions side by side) with continuous batching:
/// `max_num_seqs` decode slots (unset: one per completion), a prompt prefilled once for its
/// completions admitted together, a finished completion's slot refilled at once (after at most
/// `num_scheduler_steps` steps). Each completion's tokens depend on its request (its seed)
/// only.
fn generate_rollouts(
    generator: &Generator<'_>,
    requests: &[GenerationRequest],
    max_num_seqs: Option<usize>,
    num_scheduler_steps: usize,
) -> Result<Vec<GenerationOutput>, TrainError> {
    if requests.is_empty() {
        return Ok(Vec::new());
    }
    let slots = max_num_seqs.unwrap_or(requests.len());
    let options = PagedOptions {
        sync_every: num_scheduler_steps,
        ..PagedOptions::for_requests(requests, slots, ROLLOUT_BLOCK_SIZE)
    };
    let (outputs, stats) = generator.generate_paged(requests, &options, None)?;
    tracing::debug!(
        prompt_tokens = stats.prompt_tokens,
        cached_prompt_tokens = stats.cached_prompt_tokens,
        decode_steps = stats.decode_steps,
        "rollouts generated"
    );
    Ok(outputs)
}

/// How a completion is sampled (TRL's `temperature`, `top_k`, `top_p`) with its `seed`: the
/// rollouts' and the sampled evaluation's.
fn rollout_sampling(cfg: &GspoConfig, seed: u64) -> SamplingParams {
    SamplingParams {
        temperature: cfg.temperature,
        top_k: (cfg.top_k > 0).then_some(cfg.top_k),
        top_p: (cfg.top_p < 1.0).then_some(cfg.top_p),
        seed,
        min_p: None,
        repetition_penalty: None,
    }
}

/// The sampling seed of row `row` of generation batch `batch`: SplitMix64 of the run seed
/// mixed with both, so that rows and batches get unrelated streams.
pub fn sampling_seed(seed: u64, batch: u64, row: u64) -> u64 {
    let mut z =
        seed ^ batch.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ row.wrapping_mul(0xc2b2_ae3d_27d4_eb4f);
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}
