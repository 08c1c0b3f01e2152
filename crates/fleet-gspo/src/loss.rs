//! The GSPO policy loss from per-token log-probabilities, as TRL 1.16.0's `_compute_loss`
//! computes it for `loss_type = "grpo"` (`trl/trainer/grpo_trainer.py` L3083-3095 and L3153-3157),
//! with one documented difference (below), and the metrics TRL logs about it.
//!
//! # Inputs
//!
//! - `logp` `[B, T]`: log-probs of the completion tokens under the current policy, tracked
//!   (gradients flow through it), computed from logits / temperature;
//! - `old_logp` `[B, T]`: the same under the policy that generated the batch, or `None` on-policy
//!   (then `logp.detach()` is used, as TRL does: the ratio is exactly 1);
//! - `ref_logp` `[B, T]`: the reference model's, only when `beta > 0`;
//! - `mask` `[B, T]`: 1 for completion tokens up to and including the first EOS, 0 after it
//!   and for padding (and for whole rows of truncated completions when
//!   `mask_truncated_completions` is on);
//! - `advantages` `[B]`: one per sequence ([`crate::advantage`]).
//!
//! Values at masked positions never matter, not even NaN or ±inf there: they are replaced by 0
//! before anything else, so neither the loss nor the gradient sees them.
//!
//! # The loss (importance_sampling_level = "sequence", GSPO)
//!
//! ```text
//! log s_i  = Σ_t mask·(logp − old) / max(Σ_t mask, 1)          (geometric mean of token ratios)
//! s_i      = exp(log s_i),  clip(s_i) = clamp(s_i, 1 − epsilon, 1 + epsilon_high)
//! ℓ_it     = −min(s_i·A_i, clip(s_i)·A_i)  [+ beta·k3_it]
//! k3_it    = exp(ref − logp) − (ref − logp) − 1                 (added per token before aggregation)
//! L_i      = Σ_t mask·ℓ_it / max(Σ_t mask, 1)                   (per-sequence mean)
//! loss     = Σ_i L_i / max(#{i : Σ_t mask_i > 0}, 1)            (mean over non-empty sequences)
//! ```
//!
//! - `"sequence_token"` (GSPO-token): `log s_it = logp − sg[logp] + sg[log s_i]`, a per-token
//!   ratio whose value is `s_i`; with one advantage per sequence it gives the same loss and the
//!   same gradient as GSPO. **TRL 1.16.0 has no such level** (its `_compute_loss` raises for
//!   anything but `"token"` and `"sequence"`, L3084-3093); this is the form of TRL 0.24's
//!   experimental `GSPOTokenTrainer` (`trl/experimental/gspo_token/grpo_trainer.py` L75-79) and
//!   of verl. verl also clamps `log s_it` at 10 (upper only); TRL did not, and neither does this.
//! - `"token"` (GRPO): `log s_it = logp − old`, clipped per token (TRL L3084-3085).
//!
//! The clip is applied with torch's `clamp` semantics: the gradient passes for
//! `1 − epsilon <= s <= 1 + epsilon_high`, boundaries included, and is 0 outside. The min of
//! two equal terms splits the gradient between them, as torch's `min` does.
//!
//! # Where TRL and verl differ: fully masked rows
//!
//! A row whose mask is all zero (a truncated completion masked out by
//! `mask_truncated_completions`) has no tokens. **This implementation leaves it out of the
//! denominator of the mean over sequences**, as verl's `agg_loss("seq-mean-token-mean")` does.
//! TRL's `grpo` loss keeps it in (`.mean()` over all B rows, L3154, the row contributing 0),
//! which shrinks the loss of a micro-batch with masked rows. With no masked rows both give the
//! same numbers. The *metrics* do not follow this choice: they are TRL's (below), and the loss
//! fleet optimises is logged under its own name, `loss_nonempty_mean`.
//!
//! The loss is the mean over one micro-batch; with gradient accumulation the trainer divides it
//! by `gradient_accumulation_steps`, as TRL does.
//!
//! # Metrics: TRL 1.16.0's definitions
//!
//! [`LossMetrics`] holds one micro-batch's counts and sums, so that the ranks' shares of a
//! micro-batch (and the parts of a micro-batch split to fit memory) merge exactly, as TRL's
//! `global_masked_mean` (L3259-3265) sums numerator and denominator over the ranks before
//! dividing. [`StepLossMetrics`] keeps one [`LossMetrics`] per micro-batch of an optimizer step
//! and averages the micro-batches' values with equal weight, as TRL's `log` (L3302-3312) averages
//! the list `_metrics[key]` that each micro-batch appended to.
//!
//! | key | one micro-batch (all ranks) |
//! |---|---|
//! | `clip_ratio/low_mean` | `"token"`: masked tokens with `s_it < 1 − epsilon` and `A < 0` / masked tokens. `"sequence"`: rows with `s_i < 1 − epsilon` and `A < 0` / **all rows**, empty ones included (TRL's `x.shape[0]`; an empty row has `s_i = exp(0) = 1` and never clips). `"sequence_token"`: the same over masked tokens, each token carrying its sequence's `s_i`, so a sequence counts with its length (1.16.0's `global_masked_mean` over a `[B, T]` ratio, pooled over the ranks; TRL 0.24's `masked_batch_mean` gives the same on one rank but averages the ranks' means). |
//! | `clip_ratio/high_mean` | the same with `s > 1 + epsilon_high` and `A > 0` |
//! | `clip_ratio/region_mean` | low or high (disjoint) |
//! | `kl` | Σ masked k3 / max(masked tokens, 1), at every level (only with `beta > 0`). TRL 1.16.0 with `use_bias_correction_kl = False`; its default `True` (grpo:L3104-3105) multiplies each token's k3 by the importance ratio in the loss and in `kl`, which fleet does not do (its loss is the GSPO paper's and TRL's plain k3 form) |
//! | `entropy` | Σ masked entropy / max(masked tokens, 1) (the trainer adds the entropies, [`masked_sum`]) |
//! | `loss` | Σ_i L_i / rows: TRL's `grpo` loss, empty rows in the denominator |
//!
//! A denominator of 0 gives 0, as TRL's `clamp(min=1.0)` does. fleet's own:
//! `loss_nonempty_mean` (Σ_i L_i / non-empty rows, the loss optimised, averaged over the
//! configured micro-batches) and `ratio_mean` (the mean importance ratio over non-empty sequences
//! at the sequence levels, over masked tokens at `"token"`, pooled over the step).

use candle_core::{DType, Device, Tensor};
use serde::{Deserialize, Serialize};

use crate::config::{GspoConfig, ImportanceSamplingLevel};

/// Errors of [`policy_loss`]: inputs of the wrong shape, dtype or values, named with what to
/// pass instead.
#[derive(Debug, thiserror::Error)]
pub enum LossError {
    /// A tensor of the wrong shape.
    #[error("{name} has shape {got:?}, expected {expected}")]
    Shape {
        /// The input.
        name: &'static str,
        /// Its shape.
        got: Vec<usize>,
        /// The shape expected.
        expected: String,
    },
    /// Log-probs that are not f32/f64.
    #[error("{name} is {dtype:?}: log-probs must be f32 (or f64); convert them before the loss, since a 3e-4 clip range is below bf16 resolution")]
    DType {
        /// The input.
        name: &'static str,
        /// Its dtype.
        dtype: DType,
    },
    /// A mask value other than 0 or 1.
    #[error("mask[{row}][{col}] = {value}: the mask must hold only 0 and 1")]
    MaskValue {
        /// Row.
        row: usize,
        /// Column.
        col: usize,
        /// The value.
        value: f32,
    },
    /// `beta > 0` without reference log-probs, or reference log-probs with `beta = 0`.
    #[error("beta = {beta} but ref_logp is {}: {hint}", if *given { "given" } else { "missing" })]
    RefLogp {
        /// The KL coefficient.
        beta: f64,
        /// Whether ref_logp was given.
        given: bool,
        /// What to do.
        hint: &'static str,
    },
    /// A clip range or KL coefficient out of range.
    #[error("{field} = {value} is out of range: expected {expected}")]
    Config {
        /// The field.
        field: &'static str,
        /// The value.
        value: f64,
        /// The range.
        expected: &'static str,
    },
    /// No EOS token id to build a completion mask with.
    #[error("completion_mask got no EOS token ids: pass the tokenizer's EOS id(s) (generation_config.json's eos_token_id)")]
    NoEosIds,
    /// A completion longer than the mask width.
    #[error("completion {row} has {len} tokens up to its first EOS but the mask is {width} wide: use the batch's longest completion as the width")]
    CompletionTooLong {
        /// The row.
        row: usize,
        /// Its length.
        len: usize,
        /// The width asked for.
        width: usize,
    },
    /// A tensor operation failed.
    #[error("tensor operation failed in the policy loss: {0}")]
    Candle(#[from] candle_core::Error),
}

/// `?` in a loss closure of `TrainableQwen::forward_backward` keeps the error whole.
impl From<LossError> for fleet_models::ModelError {
    fn from(e: LossError) -> Self {
        fleet_models::ModelError::loss(e)
    }
}

/// The loss settings (the fields of [`GspoConfig`] the loss reads).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct LossConfig {
    /// `sequence`, `sequence_token` or `token`.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// Lower clip range.
    pub epsilon: f64,
    /// Upper clip range.
    pub epsilon_high: f64,
    /// KL coefficient.
    pub beta: f64,
}

impl From<&GspoConfig> for LossConfig {
    fn from(c: &GspoConfig) -> Self {
        LossConfig {
            importance_sampling_level: c.importance_sampling_level,
            epsilon: c.epsilon,
            epsilon_high: c.epsilon_high,
            beta: c.beta,
        }
    }
}

impl LossConfig {
    fn validate(&self) -> Result<(), LossError> {
        let bad = |field, value, expected| {
            Err(LossError::Config {
                field,
                value,
                expected,
            })
        };
        if !(self.epsilon.is_finite() && self.epsilon > 0.0 && self.epsilon < 1.0) {
            return bad("epsilon", self.epsilon, "0 < epsilon < 1");
        }
        if !(self.epsilon_high.is_finite() && self.epsilon_high > 0.0) {
            return bad("epsilon_high", self.epsilon_high, "a positive number");
        }
        if !(self.beta.is_finite() && self.beta >= 0.0) {
            return bad("beta", self.beta, "0 or more");
        }
        Ok(())
    }
}

/// The tensors of one micro-batch (see the module docs).
#[derive(Debug, Clone, Copy)]
pub struct LossInputs<'a> {
    /// `[B, T]` current log-probs, tracked.
    pub logp: &'a Tensor,
    /// `[B, T]` log-probs of the generating policy; `None` on-policy.
    pub old_logp: Option<&'a Tensor>,
    /// `[B, T]` reference log-probs; only with `beta > 0`.
    pub ref_logp: Option<&'a Tensor>,
    /// `[B, T]` completion mask of 0 and 1 (any float dtype).
    pub mask: &'a Tensor,
    /// `[B]` advantages.
    pub advantages: &'a Tensor,
}

/// What the clip counts of [`LossMetrics`] count (TRL's `global_masked_mean` denominators).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ClipUnit {
    /// Rows of the micro-batch, empty ones included (`sequence`: TRL's ratio is `[B, 1]`).
    #[default]
    Rows,
    /// Masked tokens (`token`, and `sequence_token`, whose ratio is `[B, T]`).
    Tokens,
}

/// One micro-batch's loss statistics as counts and sums: the ranks' shares of a micro-batch,
/// and the parts of one split to fit memory, [`merge`](LossMetrics::merge) into the micro-batch's
/// exactly. The fractions are TRL's per-micro-batch values (module docs).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct LossMetrics {
    /// What the clip counts count.
    pub clip_unit: ClipUnit,
    /// Units with `s < 1 − epsilon` and `A < 0`.
    pub clip_low: u64,
    /// Units with `s > 1 + epsilon_high` and `A > 0`.
    pub clip_high: u64,
    /// Units counted: all rows (`sequence`) or masked tokens (`token`, `sequence_token`).
    pub clip_total: u64,
    /// Sum of the importance ratios over non-empty sequences (sequence levels) or masked tokens
    /// (`token`): fleet's `ratio_mean`.
    pub ratio_sum: f64,
    /// Ratios in `ratio_sum`.
    pub ratio_count: u64,
    /// Sum of k3 over masked tokens (`None` when `beta = 0`).
    pub kl_sum: Option<f64>,
    /// Sum of the policy's entropy over masked tokens, when the caller added it
    /// ([`masked_sum`]); [`policy_loss`] leaves it `None`.
    pub entropy_sum: Option<f64>,
    /// Sum of the per-sequence losses `L_i` over all rows (an empty row's is 0).
    pub loss_sum: f64,
    /// Rows of the micro-batch (empty ones included).
    pub num_rows: u64,
    /// Non-empty rows: the sequences in the denominator of the loss fleet optimises.
    pub num_sequences: u64,
    /// Masked (completion) tokens.
    pub num_tokens: u64,
}

/// `n / max(d, 1)`: TRL's `clamp(min=1.0)` denominators (0 when there is nothing to count).
fn frac(n: f64, d: u64) -> f64 {
    n / d.max(1) as f64
}

impl LossMetrics {
    /// TRL `clip_ratio/low_mean` of this micro-batch.
    pub fn low_mean(&self) -> f64 {
        frac(self.clip_low as f64, self.clip_total)
    }

    /// TRL `clip_ratio/high_mean` of this micro-batch.
    pub fn high_mean(&self) -> f64 {
        frac(self.clip_high as f64, self.clip_total)
    }

    /// TRL `clip_ratio/region_mean` of this micro-batch (low and high are disjoint).
    pub fn region_mean(&self) -> f64 {
        frac((self.clip_low + self.clip_high) as f64, self.clip_total)
    }

    /// fleet's `ratio_mean`: the mean importance ratio (1 on-policy); `None` when nothing
    /// counted.
    pub fn mean_ratio(&self) -> Option<f64> {
        (self.ratio_count > 0).then(|| self.ratio_sum / self.ratio_count as f64)
    }

    /// TRL `kl` of this micro-batch: the token-masked mean of k3 (0 without tokens); `None`
    /// when `beta = 0`.
    pub fn kl_mean(&self) -> Option<f64> {
        self.kl_sum.map(|s| frac(s, self.num_tokens))
    }

    /// TRL `entropy` of this micro-batch: the token-masked mean entropy (0 without tokens);
    /// `None` when no entropy was added.
    pub fn entropy_mean(&self) -> Option<f64> {
        self.entropy_sum.map(|s| frac(s, self.num_tokens))
    }

    /// TRL's `grpo` loss of this micro-batch: `Σ_i L_i / rows`, empty rows in the denominator.
    pub fn trl_loss(&self) -> f64 {
        frac(self.loss_sum, self.num_rows)
    }

    /// The loss fleet optimises for this micro-batch: `Σ_i L_i / non-empty rows`.
    pub fn nonempty_loss(&self) -> f64 {
        frac(self.loss_sum, self.num_sequences)
    }

    /// Adds the counts of another share of the same micro-batch (another rank's rows, or
    /// another part of a micro-batch split to fit memory).
    pub fn merge(&mut self, other: &LossMetrics) {
        self.clip_unit = other.clip_unit;
        self.clip_low += other.clip_low;
        self.clip_high += other.clip_high;
        self.clip_total += other.clip_total;
        self.ratio_sum += other.ratio_sum;
        self.ratio_count += other.ratio_count;
        let add = |a: Option<f64>, b: Option<f64>| match (a, b) {
            (Some(a), Some(b)) => Some(a + b),
            (a, b) => a.or(b),
        };
        self.kl_sum = add(self.kl_sum, other.kl_sum);
        self.entropy_sum = add(self.entropy_sum, other.entropy_sum);
        self.loss_sum += other.loss_sum;
        self.num_rows += other.num_rows;
        self.num_sequences += other.num_sequences;
        self.num_tokens += other.num_tokens;
    }
}

/// The loss metrics of one optimizer step: one [`LossMetrics`] per micro-batch (over all ranks)
/// in the order they ran, `num_iterations` passes included. TRL appends one value per
/// micro-batch to `_metrics[key]` and logs their unweighted mean; so do the methods here (a
/// micro-batch of few tokens weighs as much as one of many).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StepLossMetrics {
    /// The step's micro-batches.
    pub micro_batches: Vec<LossMetrics>,
}

/// Two ranks reported different numbers of micro-batches for one optimizer step (a bug).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("loss metrics of {ours} micro-batches cannot merge with another rank's {theirs}: every rank runs every micro-batch of a step")]
pub struct MicroBatchCountMismatch {
    /// This rank's micro-batches.
    pub ours: usize,
    /// The other rank's.
    pub theirs: usize,
}

impl StepLossMetrics {
    /// Appends the next micro-batch's metrics.
    pub fn push(&mut self, m: LossMetrics) {
        self.micro_batches.push(m);
    }

    /// Merges `m` into the last micro-batch: another part of a configured micro-batch that
    /// `auto_find_batch_size` split to fit memory (TRL ran it as one, so it is one value of
    /// each metric). With no micro-batch yet it is the first.
    pub fn push_part(&mut self, m: LossMetrics) {
        match self.micro_batches.last_mut() {
            Some(last) => last.merge(&m),
            None => self.micro_batches.push(m),
        }
    }

    /// Merges another rank's metrics of the same step, micro-batch by micro-batch.
    pub fn merge_rank(&mut self, other: &StepLossMetrics) -> Result<(), MicroBatchCountMismatch> {
        if self.micro_batches.len() != other.micro_batches.len() {
            return Err(MicroBatchCountMismatch {
                ours: self.micro_batches.len(),
                theirs: other.micro_batches.len(),
            });
        }
        for (a, b) in self.micro_batches.iter_mut().zip(&other.micro_batches) {
            a.merge(b);
        }
        Ok(())
    }

    /// The unweighted mean of `f` over the micro-batches; 0 for a step without any.
    fn mean(&self, f: impl Fn(&LossMetrics) -> f64) -> f64 {
        let n = self.micro_batches.len();
        self.micro_batches.iter().map(f).sum::<f64>() / n.max(1) as f64
    }

    /// The mean of `f` over the micro-batches where it is defined; `None` if nowhere (TRL's
    /// `log` skips keys that no micro-batch appended to).
    fn mean_of_some(&self, f: impl Fn(&LossMetrics) -> Option<f64>) -> Option<f64> {
        let v: Vec<f64> = self.micro_batches.iter().filter_map(f).collect();
        (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
    }

    /// TRL `loss`: the mean over the micro-batches of `Σ_i L_i / rows`.
    pub fn loss(&self) -> f64 {
        self.mean(LossMetrics::trl_loss)
    }

    /// fleet's `loss_nonempty_mean`, the loss the gradient is of: per micro-batch
    /// `Σ_i L_i / non-empty rows`, averaged over the micro-batches.
    pub fn nonempty_loss(&self) -> f64 {
        self.mean(LossMetrics::nonempty_loss)
    }

    /// TRL `clip_ratio/low_mean`.
    pub fn low_mean(&self) -> f64 {
        self.mean(LossMetrics::low_mean)
    }

    /// TRL `clip_ratio/high_mean`.
    pub fn high_mean(&self) -> f64 {
        self.mean(LossMetrics::high_mean)
    }

    /// TRL `clip_ratio/region_mean`.
    pub fn region_mean(&self) -> f64 {
        self.mean(LossMetrics::region_mean)
    }

    /// TRL `kl` (`None` when `beta = 0`).
    pub fn kl(&self) -> Option<f64> {
        self.mean_of_some(LossMetrics::kl_mean)
    }

    /// TRL `entropy` (`None` when no entropies were added).
    pub fn entropy(&self) -> Option<f64> {
        self.mean_of_some(LossMetrics::entropy_mean)
    }

    /// All micro-batches' counts together.
    pub fn total(&self) -> LossMetrics {
        let mut m = LossMetrics::default();
        for c in &self.micro_batches {
            m.merge(c);
        }
        m
    }

    /// fleet's `ratio_mean`: pooled over the step's micro-batches.
    pub fn ratio_mean(&self) -> Option<f64> {
        self.total().mean_ratio()
    }
}

/// The loss of a micro-batch and its metrics.
#[derive(Debug, Clone)]
pub struct PolicyLoss {
    /// Scalar loss, differentiable w.r.t. `logp`.
    pub loss: Tensor,
    /// Clip, ratio and KL statistics.
    pub metrics: LossMetrics,
}

fn check_shape(
    name: &'static str,
    t: &Tensor,
    dims: &[usize],
    expected: &str,
) -> Result<(), LossError> {
    if t.dims() != dims {
        return Err(LossError::Shape {
            name,
            got: t.dims().to_vec(),
            expected: expected.to_string(),
        });
    }
    Ok(())
}

fn check_float(name: &'static str, t: &Tensor) -> Result<(), LossError> {
    match t.dtype() {
        DType::F32 | DType::F64 => Ok(()),
        dtype => Err(LossError::DType { name, dtype }),
    }
}

/// The completion mask of a batch of generated token ids, as TRL builds it (fact sheet B1).
#[derive(Debug, Clone)]
pub struct CompletionMask {
    /// `[B, width]` f32: 1 for the tokens up to and including the first EOS, 0 after it and
    /// for padding; a whole row of 0 for a truncated completion when masking them.
    pub mask: Tensor,
    /// Tokens per completion, up to and including the first EOS (TRL's completion length).
    pub lengths: Vec<usize>,
    /// Completions without an EOS (they hit the length limit; TRL's "truncated", counted in
    /// `completions/clipped_ratio` whether or not they are masked).
    pub truncated: Vec<bool>,
}

/// Builds the completion mask of `completions` (generated ids, any padding after them) over
/// `width` columns: tokens after the first id in `eos_token_ids` are dropped, and with
/// `mask_truncated_completions` a completion without EOS gets an all-zero row (it leaves the
/// loss; its reward still counts in its group's statistics, as in TRL).
pub fn completion_mask(
    completions: &[Vec<u32>],
    eos_token_ids: &[u32],
    width: usize,
    mask_truncated_completions: bool,
    device: &Device,
) -> Result<CompletionMask, LossError> {
    if eos_token_ids.is_empty() {
        return Err(LossError::NoEosIds);
    }
    let b = completions.len();
    let mut mask = vec![0f32; b * width];
    let mut lengths = Vec::with_capacity(b);
    let mut truncated = Vec::with_capacity(b);
    for (row, ids) in completions.iter().enumerate() {
        let eos = ids.iter().position(|id| eos_token_ids.contains(id));
        let len = eos.map_or(ids.len(), |p| p + 1);
        if len > width {
            return Err(LossError::CompletionTooLong { row, len, width });
        }
        lengths.push(len);
        truncated.push(eos.is_none());
        if !(mask_truncated_completions && eos.is_none()) {
            mask[row * width..row * width + len].fill(1.0);
        }
    }
    Ok(CompletionMask {
        mask: Tensor::from_vec(mask, (b, width), device)?,
        lengths,
        truncated,
    })
}

/// Computes the policy loss of one micro-batch (see the module docs).
pub fn policy_loss(inputs: &LossInputs<'_>, config: &LossConfig) -> Result<PolicyLoss, LossError> {
    config.validate()?;
    let logp = inputs.logp;
    let dims = logp.dims().to_vec();
    let [b, t] = dims[..] else {
        return Err(LossError::Shape {
            name: "logp",
            got: dims,
            expected: "[B, T] (sequences x completion tokens)".into(),
        });
    };
    let bt = format!("[{b}, {t}] like logp");
    check_float("logp", logp)?;
    let dtype = logp.dtype();
    check_shape("mask", inputs.mask, &[b, t], &bt)?;
    check_shape(
        "advantages",
        inputs.advantages,
        &[b],
        &format!("[{b}], one per sequence"),
    )?;
    if let Some(old) = inputs.old_logp {
        check_shape("old_logp", old, &[b, t], &bt)?;
        check_float("old_logp", old)?;
    }
    match (config.beta > 0.0, inputs.ref_logp) {
        (true, None) => {
            return Err(LossError::RefLogp {
                beta: config.beta,
                given: false,
                hint: "compute the reference model's log-probs, or set beta = 0",
            })
        }
        (false, Some(_)) => {
            return Err(LossError::RefLogp {
                beta: config.beta,
                given: true,
                hint: "the KL term is off: pass None (and skip the reference forward pass)",
            })
        }
        (true, Some(r)) => {
            check_shape("ref_logp", r, &[b, t], &bt)?;
            check_float("ref_logp", r)?;
        }
        (false, None) => {}
    }

    // The mask on the host: its values are checked and its row lengths counted.
    let mask_rows = inputs.mask.to_dtype(DType::F32)?.to_vec2::<f32>()?;
    let mut lens = Vec::with_capacity(b);
    for (row, values) in mask_rows.iter().enumerate() {
        let mut n = 0u64;
        for (col, &value) in values.iter().enumerate() {
            if value == 1.0 {
                n += 1;
            } else if value != 0.0 {
                return Err(LossError::MaskValue { row, col, value });
            }
        }
        lens.push(n);
    }
    let num_sequences = lens.iter().filter(|&&n| n > 0).count() as u64;
    let num_tokens: u64 = lens.iter().sum();

    let mask = inputs.mask.to_dtype(dtype)?;
    let keep = mask.ne(0.0)?;
    let zeros = logp.zeros_like()?;
    // Masked positions become 0 before anything else (no NaN/inf can leak into loss or grad).
    let logp_s = keep.where_cond(logp, &zeros)?;
    let old_s = match inputs.old_logp {
        Some(old) => keep.where_cond(&old.to_dtype(dtype)?.detach(), &zeros)?,
        None => logp_s.detach(),
    };
    let advantages = inputs.advantages.to_dtype(dtype)?.detach();
    let len_clamped = mask.sum_keepdim(1)?.maximum(1.0)?; // [B, 1]

    let log_ratio = (&logp_s - &old_s)?;
    let seq_log_ratio = (&log_ratio * &mask)?
        .sum_keepdim(1)?
        .broadcast_div(&len_clamped)?; // [B, 1]
    let log_w = match config.importance_sampling_level {
        ImportanceSamplingLevel::Sequence => seq_log_ratio.clone(),
        ImportanceSamplingLevel::SequenceToken => {
            (&logp_s - logp_s.detach())?.broadcast_add(&seq_log_ratio.detach())?
        }
        ImportanceSamplingLevel::Token => log_ratio.clone(),
    };
    let coef_1 = log_w.exp()?;
    let lo = 1.0 - config.epsilon;
    let hi = 1.0 + config.epsilon_high;
    let below = coef_1.lt(lo)?;
    let above = coef_1.gt(hi)?;
    let lo_t = coef_1.ones_like()?.affine(lo, 0.0)?;
    let hi_t = coef_1.ones_like()?.affine(hi, 0.0)?;
    let coef_2 = below.where_cond(&lo_t, &above.where_cond(&hi_t, &coef_1)?)?;
    let a = advantages.unsqueeze(1)?; // [B, 1]
    let l1 = coef_1.broadcast_mul(&a)?;
    let l2 = coef_2.broadcast_mul(&a)?;
    let mut per_token = l1.minimum(&l2)?.neg()?.broadcast_as((b, t))?;
    let mut k3_values = None;
    if config.beta > 0.0 {
        if let Some(r) = inputs.ref_logp {
            let ref_s = keep.where_cond(&r.to_dtype(dtype)?.detach(), &zeros)?;
            let d = (&ref_s - &logp_s)?;
            let k3 = ((d.exp()? - &d)? - 1.0)?;
            per_token = (per_token + k3.affine(config.beta, 0.0)?)?;
            k3_values = Some(k3);
        }
    }
    let per_seq = (per_token * &mask)?
        .sum_keepdim(1)?
        .broadcast_div(&len_clamped)?; // [B, 1]
    let per_seq_sum = per_seq.sum_all()?;
    let loss = (&per_seq_sum / (num_sequences.max(1) as f64))?;

    // Metrics, on the host (module docs: TRL's definitions).
    let lo32 = lo as f32;
    let hi32 = hi as f32;
    let adv = advantages.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let mut m = LossMetrics {
        num_rows: b as u64,
        num_sequences,
        num_tokens,
        loss_sum: per_seq_sum.to_dtype(DType::F64)?.to_scalar::<f64>()?,
        ..LossMetrics::default()
    };
    // `weight` units with ratio `s` and advantage `a`.
    let count = |s: f32, a: f32, weight: u64, m: &mut LossMetrics| {
        m.clip_total += weight;
        if s < lo32 && a < 0.0 {
            m.clip_low += weight;
        } else if s > hi32 && a > 0.0 {
            m.clip_high += weight;
        }
    };
    match config.importance_sampling_level {
        ImportanceSamplingLevel::Sequence | ImportanceSamplingLevel::SequenceToken => {
            let token_weighted =
                config.importance_sampling_level == ImportanceSamplingLevel::SequenceToken;
            m.clip_unit = if token_weighted {
                ClipUnit::Tokens
            } else {
                ClipUnit::Rows
            };
            let s = seq_log_ratio
                .exp()?
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?;
            for i in 0..b {
                let s_i = s[i][0];
                // "sequence": every row counts once, an empty one too (its ratio is exp(0) = 1);
                // "sequence_token": every masked token, with its sequence's ratio.
                let weight = if token_weighted { lens[i] } else { 1 };
                count(s_i, adv[i], weight, &mut m);
                if lens[i] > 0 {
                    m.ratio_sum += f64::from(s_i);
                    m.ratio_count += 1;
                }
            }
        }
        ImportanceSamplingLevel::Token => {
            m.clip_unit = ClipUnit::Tokens;
            let s = coef_1.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            for i in 0..b {
                for j in 0..t {
                    if mask_rows[i][j] == 1.0 {
                        count(s[i][j], adv[i], 1, &mut m);
                        m.ratio_sum += f64::from(s[i][j]);
                        m.ratio_count += 1;
                    }
                }
            }
        }
    }
    if let Some(k3) = k3_values {
        let k3 = (k3 * &mask)?
            .to_dtype(DType::F64)?
            .sum_all()?
            .to_scalar::<f64>()?;
        m.kl_sum = Some(k3);
    }
    Ok(PolicyLoss { loss, metrics: m })
}

/// `Σ mask·values` in f64, with the values at masked-out positions replaced by 0 first (so NaN
/// or ±inf there cannot leak in): what the trainer adds to [`LossMetrics::entropy_sum`] from the
/// policy's per-token entropies. `values` and `mask` are `[B, T]`.
pub fn masked_sum(values: &Tensor, mask: &Tensor) -> Result<f64, LossError> {
    if values.dims() != mask.dims() {
        return Err(LossError::Shape {
            name: "values",
            got: values.dims().to_vec(),
            expected: format!("{:?} like the mask", mask.dims()),
        });
    }
    let values = values.to_dtype(DType::F64)?;
    let mask = mask.to_dtype(DType::F64)?;
    let kept = mask.ne(0.0)?.where_cond(&values, &values.zeros_like()?)?;
    Ok((kept * mask)?.sum_all()?.to_scalar::<f64>()?)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `?` on a loss error inside `forward_backward`'s closure keeps the error whole: the
    /// trainer sees the loss's own message, not a flattened string.
    #[test]
    fn a_loss_error_converts_into_the_models_error_with_its_message() {
        let e = LossError::MaskValue {
            row: 1,
            col: 2,
            value: 0.5,
        };
        let text = e.to_string();
        let m: fleet_models::ModelError = e.into();
        assert!(matches!(m, fleet_models::ModelError::Loss(_)));
        assert_eq!(m.to_string(), text);
    }
    use candle_core::{Device, Var};

    const EPS: f64 = 3e-4;
    const EPS_HIGH: f64 = 4e-4;

    fn cfg(level: ImportanceSamplingLevel, beta: f64) -> LossConfig {
        LossConfig {
            importance_sampling_level: level,
            epsilon: EPS,
            epsilon_high: EPS_HIGH,
            beta,
        }
    }

    fn t2(rows: &[&[f32]]) -> Tensor {
        let b = rows.len();
        let t = rows[0].len();
        let flat: Vec<f32> = rows.iter().flat_map(|r| r.iter().copied()).collect();
        Tensor::from_vec(flat, (b, t), &Device::Cpu).unwrap()
    }

    fn t1(v: &[f32]) -> Tensor {
        Tensor::from_vec(v.to_vec(), v.len(), &Device::Cpu).unwrap()
    }

    /// Loss value, metrics and d loss / d logp.
    fn run(
        logp: &Tensor,
        old: Option<&Tensor>,
        reference: Option<&Tensor>,
        mask: &Tensor,
        adv: &Tensor,
        config: &LossConfig,
    ) -> (f32, LossMetrics, Vec<Vec<f32>>) {
        let var = Var::from_tensor(logp).unwrap();
        let out = policy_loss(
            &LossInputs {
                logp: var.as_tensor(),
                old_logp: old,
                ref_logp: reference,
                mask,
                advantages: adv,
            },
            config,
        )
        .unwrap();
        let grads = out.loss.backward().unwrap();
        let grad = grads
            .get(var.as_tensor())
            .cloned()
            .unwrap_or_else(|| var.as_tensor().zeros_like().unwrap());
        (
            out.loss.to_scalar::<f32>().unwrap(),
            out.metrics,
            grad.to_vec2::<f32>().unwrap(),
        )
    }

    fn close(a: f32, b: f64, tol: f64) -> bool {
        (f64::from(a) - b).abs() <= tol * (1.0 + b.abs())
    }

    #[test]
    fn sequence_ratio_is_exp_of_the_masked_mean_log_ratio_and_ignores_padding() {
        let old = t2(&[&[-1.0, -2.0, -3.0, -0.5], &[-1.0, -1.0, -1.0, -1.0]]);
        let logp = t2(&[&[-0.9, -2.1, -2.7, -0.5], &[-1.0, -0.98, -1.0, -1.0]]);
        let mask = t2(&[&[1.0, 1.0, 1.0, 0.0], &[1.0, 1.0, 0.0, 0.0]]);
        let adv = t1(&[1.0, -1.0]);
        let c = cfg(ImportanceSamplingLevel::Sequence, 0.0);
        let (loss, m, grad) = run(&logp, Some(&old), None, &mask, &adv, &c);
        // Row 0: mean log ratio (0.1 - 0.1 + 0.3) / 3 = 0.1 -> s = e^0.1, A > 0: clipped high.
        // Row 1: (0 + 0.02) / 2 = 0.01 -> s = e^0.01, A < 0: unclipped term -s·A is the min.
        let s0 = (0.1f64).exp();
        let s1 = (0.01f64).exp();
        assert!(s0 > 1.0 + EPS_HIGH);
        let l0 = -(1.0 + EPS_HIGH); // -min(s0, 1+eh)
        let l1 = s1; // -min(-s1, -(1+eh)) = s1
        assert!(close(loss, (l0 + l1) / 2.0, 1e-6), "{loss}");
        assert!(close((m.ratio_sum / 2.0) as f32, (s0 + s1) / 2.0, 1e-6));
        assert_eq!((m.clip_high, m.clip_low, m.clip_total), (1, 0, 2));
        // Row 0 is clipped: no gradient. Row 1: d/dlogp_t (s1 / 2) = s1 · mask_t / (2 · 2).
        assert!(grad[0].iter().all(|&g| g == 0.0), "{:?}", grad[0]);
        assert!(close(grad[1][0], s1 / 4.0, 1e-6) && close(grad[1][1], s1 / 4.0, 1e-6));
        assert_eq!(&grad[1][2..], &[0.0, 0.0]);

        // Anything at masked positions, NaN and infinities included, changes nothing.
        let noisy = t2(&[
            &[-0.9, -2.1, -2.7, f32::NAN],
            &[-1.0, -0.98, f32::NEG_INFINITY, 7.0],
        ]);
        let noisy_old = t2(&[
            &[-1.0, -2.0, -3.0, 9.0],
            &[-1.0, -1.0, f32::INFINITY, f32::NAN],
        ]);
        let (loss2, m2, grad2) = run(&noisy, Some(&noisy_old), None, &mask, &adv, &c);
        assert_eq!(loss2.to_bits(), loss.to_bits());
        assert_eq!(m2, m);
        assert_eq!(grad2, grad);
    }

    #[test]
    fn on_policy_the_ratio_is_exactly_one_and_nothing_clips() {
        let logp = t2(&[&[-0.3, -1.2, -0.7], &[-2.0, -0.1, -0.4]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let adv = t1(&[0.8, -1.3]);
        for level in [
            ImportanceSamplingLevel::Sequence,
            ImportanceSamplingLevel::SequenceToken,
            ImportanceSamplingLevel::Token,
        ] {
            let c = cfg(level, 0.0);
            let (loss_none, m_none, g_none) = run(&logp, None, None, &mask, &adv, &c);
            let (loss_same, m_same, g_same) = run(&logp, Some(&logp), None, &mask, &adv, &c);
            for (loss, m) in [(loss_none, &m_none), (loss_same, &m_same)] {
                assert_eq!(
                    m.ratio_sum, m.ratio_count as f64,
                    "{level}: every ratio is exactly 1"
                );
                assert_eq!((m.clip_low, m.clip_high), (0, 0), "{level}");
                assert_eq!(
                    (m.low_mean(), m.high_mean(), m.region_mean()),
                    (0.0, 0.0, 0.0)
                );
                // -mean(A) over the two sequences.
                assert!(close(loss, -(0.8 - 1.3) / 2.0, 1e-7), "{level}: {loss}");
            }
            assert_eq!(g_none, g_same, "{level}");
            // Plain policy gradient: -A_i / (2 · L_i) per token.
            assert!(
                close(g_none[0][0], -0.8 / 6.0, 1e-6),
                "{level}: {:?}",
                g_none
            );
            assert!(close(g_none[1][1], 1.3 / 4.0, 1e-6), "{level}");
            assert_eq!(g_none[1][2], 0.0);
        }
    }

    #[test]
    fn gspo_and_gspo_token_give_the_same_loss_and_gradient() {
        // Off-policy rows inside and outside the clip range, both signs of A.
        let old = t2(&[
            &[-1.0, -2.0, -0.5, -0.7],
            &[-0.3, -0.3, -0.3, -0.3],
            &[-1.5, -0.2, -0.9, -1.1],
            &[-0.8, -0.6, -0.4, -0.2],
        ]);
        let logp = t2(&[
            &[-1.0001, -1.9999, -0.5002, -0.7],
            &[-0.2, -0.35, -0.3, -0.3],
            &[-1.6, -0.25, -0.9, -1.1],
            &[-0.8, -0.6001, -0.4, -0.2],
        ]);
        let mask = t2(&[
            &[1.0, 1.0, 1.0, 0.0],
            &[1.0, 1.0, 1.0, 1.0],
            &[1.0, 1.0, 0.0, 0.0],
            &[1.0, 1.0, 1.0, 1.0],
        ]);
        let adv = t1(&[0.7, 1.2, -0.9, -0.4]);
        let (ls, ms, gs) = run(
            &logp,
            Some(&old),
            None,
            &mask,
            &adv,
            &cfg(ImportanceSamplingLevel::Sequence, 0.0),
        );
        let (lt, mt, gt) = run(
            &logp,
            Some(&old),
            None,
            &mask,
            &adv,
            &cfg(ImportanceSamplingLevel::SequenceToken, 0.0),
        );
        assert!(close(lt, f64::from(ls), 1e-6), "{ls} vs {lt}");
        // The same flags; TRL's clip ratios weigh a sequence by its tokens at "sequence_token"
        // (its ratio is [B, T]) and count rows at "sequence".
        assert_eq!(
            (ms.clip_unit, mt.clip_unit),
            (ClipUnit::Rows, ClipUnit::Tokens)
        );
        assert_eq!(ms.clip_total, 4);
        assert_eq!(mt.clip_total, 3 + 4 + 2 + 4);
        assert_eq!(
            (ms.ratio_sum, ms.ratio_count),
            (mt.ratio_sum, mt.ratio_count)
        );
        assert_eq!(ms.loss_sum.to_bits(), mt.loss_sum.to_bits());
        assert!(
            ms.clip_high + ms.clip_low > 0,
            "the example clips something"
        );
        for (rs, rt) in gs.iter().zip(&gt) {
            for (a, b) in rs.iter().zip(rt) {
                assert!(close(*b, f64::from(*a), 1e-5), "{gs:?} vs {gt:?}");
            }
        }
        assert!(gs.iter().flatten().any(|&g| g != 0.0));
    }

    #[test]
    fn zero_advantages_give_zero_loss_and_zero_gradient() {
        let old = t2(&[&[-1.0, -2.0], &[-0.5, -0.1]]);
        let logp = t2(&[&[-0.5, -2.5], &[-0.4, -0.3]]);
        let mask = t2(&[&[1.0, 1.0], &[1.0, 0.0]]);
        let adv = t1(&[0.0, 0.0]);
        for level in [
            ImportanceSamplingLevel::Sequence,
            ImportanceSamplingLevel::SequenceToken,
            ImportanceSamplingLevel::Token,
        ] {
            let (loss, _, grad) = run(&logp, Some(&old), None, &mask, &adv, &cfg(level, 0.0));
            assert_eq!(loss, 0.0, "{level}");
            assert!(
                grad.iter().flatten().all(|&g| g == 0.0),
                "{level}: {grad:?}"
            );
        }
    }

    #[test]
    fn sequences_weigh_equally_whatever_their_length() {
        // Same per-token log ratio (0.0001, inside the clip range) and advantage; lengths 6 and 2.
        let old = t2(&[&[-1.0; 6], &[-1.0; 6]]);
        let logp = t2(&[&[-0.9999; 6], &[-0.9999; 6]]);
        let mask = t2(&[&[1.0; 6], &[1.0, 1.0, 0.0, 0.0, 0.0, 0.0]]);
        let adv = t1(&[1.0, 1.0]);
        let c = cfg(ImportanceSamplingLevel::Sequence, 0.0);
        let (loss, _, grad) = run(&logp, Some(&old), None, &mask, &adv, &c);
        let s = f64::from(-0.9999f32 - -1.0f32).exp();
        assert!(close(loss, -s, 1e-6), "{loss} vs {}", -s);
        // Each sequence's gradient sums to the same total: -s / 2.
        let sum0: f32 = grad[0].iter().sum();
        let sum1: f32 = grad[1].iter().sum();
        assert!(
            close(sum0, -s / 2.0, 1e-5) && close(sum1, -s / 2.0, 1e-5),
            "{sum0} {sum1}"
        );
        // Alone, each sequence has the same loss as together.
        let (alone, _, _) = run(
            &logp.narrow(0, 1, 1).unwrap(),
            Some(&old.narrow(0, 1, 1).unwrap()),
            None,
            &mask.narrow(0, 1, 1).unwrap(),
            &adv.narrow(0, 1, 1).unwrap(),
            &c,
        );
        assert!(close(alone, f64::from(loss), 1e-6), "{alone} vs {loss}");
    }

    #[test]
    fn token_level_grpo_differs_from_gspo_off_policy() {
        // Token log ratios +0.1 and -0.1: the sequence ratio is exactly 1, the token ratios clip.
        let old = t2(&[&[-1.0, -1.0]]);
        let logp = t2(&[&[-0.9, -1.1]]);
        let mask = t2(&[&[1.0, 1.0]]);
        let adv = t1(&[1.0]);
        let (seq, ms, _) = run(
            &logp,
            Some(&old),
            None,
            &mask,
            &adv,
            &cfg(ImportanceSamplingLevel::Sequence, 0.0),
        );
        let (tok, mt, _) = run(
            &logp,
            Some(&old),
            None,
            &mask,
            &adv,
            &cfg(ImportanceSamplingLevel::Token, 0.0),
        );
        let r1 = f64::from(-0.9f32 - -1.0f32).exp();
        let r2 = f64::from(-1.1f32 - -1.0f32).exp();
        assert!(
            close(seq, -((r1.ln() + r2.ln()) / 2.0).exp(), 1e-6),
            "{seq}"
        );
        let tok_expected = -((1.0 + EPS_HIGH).min(r1) + r2.min(1.0 - EPS)) / 2.0;
        assert!(close(tok, tok_expected, 1e-6), "{tok} vs {tok_expected}");
        assert!((f64::from(seq) - f64::from(tok)).abs() > 0.01);
        assert_eq!(
            (ms.clip_unit, ms.clip_total, ms.clip_high),
            (ClipUnit::Rows, 1, 0)
        );
        assert_eq!(
            (mt.clip_unit, mt.clip_total, mt.clip_high),
            (ClipUnit::Tokens, 2, 1)
        );
    }

    #[test]
    fn clip_metrics_on_a_hand_made_off_policy_batch() {
        let old = t2(&[&[-1.0f32, -1.0][..]; 5]);
        let logp = t2(&[
            &[-1.01, -1.01],  // s = e^-0.01, A < 0: low clipped
            &[-0.99, -0.99],  // s = e^0.01,  A > 0: high clipped
            &[-0.99, -0.99],  // s = e^0.01,  A < 0: not clipped (the unclipped term wins)
            &[-0.9999, -1.0], // s = e^0.00005, inside
            &[5.0, 5.0],      // fully masked
        ]);
        let mask = t2(&[
            &[1.0, 1.0],
            &[1.0, 1.0],
            &[1.0, 1.0],
            &[1.0, 1.0],
            &[0.0, 0.0],
        ]);
        let adv = t1(&[-1.0, 1.0, -1.0, 1.0, 1.0]);
        let c = cfg(ImportanceSamplingLevel::Sequence, 0.0);
        let (loss, m, grad) = run(&logp, Some(&old), None, &mask, &adv, &c);
        // TRL counts the empty row (its ratio is exp(0) = 1, not clipped): 5 rows.
        assert_eq!((m.clip_low, m.clip_high, m.clip_total), (1, 1, 5));
        assert_eq!((m.num_rows, m.num_sequences, m.num_tokens), (5, 4, 8));
        assert_eq!(m.low_mean(), 0.2);
        assert_eq!(m.high_mean(), 0.2);
        assert_eq!(m.region_mean(), 0.4);
        // The masked row leaves the denominator: 4 sequences, not 5 (TRL would divide by 5).
        let lr = |a: f32, b: f32| f64::from(((a - -1.0f32) + (b - -1.0f32)) / 2.0);
        let s = [
            lr(-1.01, -1.01).exp(),
            lr(-0.99, -0.99).exp(),
            lr(-0.99, -0.99).exp(),
            lr(-0.9999, -1.0).exp(),
        ];
        let expected = ((1.0 - EPS) + -(1.0 + EPS_HIGH) + s[2] + -s[3]) / 4.0;
        assert!(close(loss, expected, 1e-6), "{loss} vs {expected}");
        assert!(grad[4].iter().all(|&g| g == 0.0));
        assert!(
            grad[0].iter().chain(&grad[1]).all(|&g| g == 0.0),
            "clipped rows get no gradient"
        );
    }

    #[test]
    fn k3_kl_matches_a_hand_computation() {
        let logp = t2(&[&[-1.0, -2.0, -0.5], &[-0.3, -0.7, -9.0]]);
        let reference = t2(&[&[-1.2, -1.5, -0.5], &[-0.1, -0.9, f32::NAN]]);
        let mask = t2(&[&[1.0, 1.0, 1.0], &[1.0, 1.0, 0.0]]);
        let adv = t1(&[0.0, 0.0]);
        let beta = 0.1;
        let c = cfg(ImportanceSamplingLevel::Sequence, beta);
        let (loss, m, grad) = run(&logp, None, Some(&reference), &mask, &adv, &c);
        let k3 = |r: f32, l: f32| {
            let d = f64::from(r - l);
            d.exp() - d - 1.0
        };
        let row0 = [k3(-1.2, -1.0), k3(-1.5, -2.0), k3(-0.5, -0.5)];
        let row1 = [k3(-0.1, -0.3), k3(-0.9, -0.7)];
        let mean0 = row0.iter().sum::<f64>() / 3.0;
        let mean1 = row1.iter().sum::<f64>() / 2.0;
        assert!(close(loss, beta * (mean0 + mean1) / 2.0, 1e-6), "{loss}");
        let all: f64 = row0.iter().chain(&row1).sum();
        assert!((m.kl_mean().unwrap() - all / 5.0).abs() < 1e-6);
        // d k3 / d logp = 1 - exp(ref - logp), times beta / (2 · L).
        let d = f64::from(-1.2f32 - -1.0f32);
        assert!(
            close(grad[0][0], beta * (1.0 - d.exp()) / 6.0, 1e-5),
            "{grad:?}"
        );
        assert_eq!(grad[1][2], 0.0);
        // No KL metric when beta = 0.
        let (_, m0, _) = run(
            &logp,
            None,
            None,
            &mask,
            &adv,
            &cfg(ImportanceSamplingLevel::Sequence, 0.0),
        );
        assert_eq!(m0.kl_mean(), None);
    }

    #[test]
    fn bad_inputs_are_named() {
        let logp = t2(&[&[-1.0, -2.0]]);
        let mask = t2(&[&[1.0, 1.0]]);
        let adv = t1(&[1.0]);
        let c = cfg(ImportanceSamplingLevel::Sequence, 0.0);
        let call =
            |logp: &Tensor, mask: &Tensor, adv: &Tensor, r: Option<&Tensor>, c: &LossConfig| {
                policy_loss(
                    &LossInputs {
                        logp,
                        old_logp: None,
                        ref_logp: r,
                        mask,
                        advantages: adv,
                    },
                    c,
                )
            };
        let err = call(&logp, &t2(&[&[1.0, 1.0, 0.0]]), &adv, None, &c).unwrap_err();
        assert!(
            matches!(err, LossError::Shape { name: "mask", .. }),
            "{err}"
        );
        let err = call(&logp, &mask, &t1(&[1.0, 2.0]), None, &c).unwrap_err();
        assert!(
            matches!(
                err,
                LossError::Shape {
                    name: "advantages",
                    ..
                }
            ),
            "{err}"
        );
        let err = call(&logp, &t2(&[&[1.0, 0.5]]), &adv, None, &c).unwrap_err();
        assert!(err.to_string().contains("mask[0][1] = 0.5"), "{err}");
        let bf = logp.to_dtype(DType::BF16).unwrap();
        assert!(matches!(
            call(&bf, &mask, &adv, None, &c).unwrap_err(),
            LossError::DType { .. }
        ));
        let kl = cfg(ImportanceSamplingLevel::Sequence, 0.1);
        assert!(matches!(
            call(&logp, &mask, &adv, None, &kl).unwrap_err(),
            LossError::RefLogp { given: false, .. }
        ));
        assert!(matches!(
            call(&logp, &mask, &adv, Some(&logp), &c).unwrap_err(),
            LossError::RefLogp { given: true, .. }
        ));
        let mut wide = c;
        wide.epsilon = 1.5;
        assert!(matches!(
            call(&logp, &mask, &adv, None, &wide).unwrap_err(),
            LossError::Config {
                field: "epsilon",
                ..
            }
        ));
    }

    #[test]
    fn completion_mask_keeps_the_first_eos_and_masks_truncated_rows() {
        let ids = vec![vec![5, 6, 2, 7, 2], vec![5, 6, 7, 8], vec![2, 9]];
        let m = completion_mask(&ids, &[2], 5, false, &Device::Cpu).unwrap();
        assert_eq!(m.lengths, vec![3, 4, 1]);
        assert_eq!(m.truncated, vec![false, true, false]);
        assert_eq!(
            m.mask.to_vec2::<f32>().unwrap(),
            vec![
                vec![1.0, 1.0, 1.0, 0.0, 0.0],
                vec![1.0, 1.0, 1.0, 1.0, 0.0],
                vec![1.0, 0.0, 0.0, 0.0, 0.0]
            ]
        );
        let masked = completion_mask(&ids, &[2, 8], 5, true, &Device::Cpu).unwrap();
        assert_eq!(
            masked.truncated,
            vec![false, false, false],
            "8 is an EOS id too"
        );
        let masked = completion_mask(&ids, &[2], 5, true, &Device::Cpu).unwrap();
        assert_eq!(masked.mask.to_vec2::<f32>().unwrap()[1], vec![0.0; 5]);
        assert!(matches!(
            completion_mask(&ids, &[2], 3, false, &Device::Cpu).unwrap_err(),
            LossError::CompletionTooLong {
                row: 1,
                len: 4,
                width: 3
            }
        ));
        assert!(matches!(
            completion_mask(&ids, &[], 5, false, &Device::Cpu).unwrap_err(),
            LossError::NoEosIds
        ));
    }

    #[test]
    fn metrics_merge_as_counts() {
        let mut a = LossMetrics {
            clip_low: 1,
            clip_total: 4,
            ratio_sum: 4.0,
            ratio_count: 4,
            num_rows: 4,
            num_sequences: 4,
            num_tokens: 10,
            ..LossMetrics::default()
        };
        let b = LossMetrics {
            clip_high: 2,
            clip_total: 4,
            ratio_sum: 4.4,
            ratio_count: 4,
            num_rows: 5,
            num_sequences: 4,
            num_tokens: 7,
            ..LossMetrics::default()
        };
        a.merge(&b);
        assert_eq!(
            (a.low_mean(), a.high_mean(), a.region_mean()),
            (0.125, 0.25, 0.375)
        );
        assert!((a.mean_ratio().unwrap() - 1.05).abs() < 1e-12);
        assert_eq!((a.num_rows, a.num_tokens), (9, 17));
    }
}
