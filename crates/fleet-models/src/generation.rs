//! Batched generation over a KV cache, sampling, stop conditions and log-probabilities.
//!
//! Prompts of different lengths share one batch by left padding; each row stops on its own
//! (EOS id, stop string or `max_new_tokens`) and leaves the batch, so finished rows cost nothing.
//! [`Generator::generate_paged`] runs the same requests with continuous batching on a paged
//! cache instead: a finished row's place is refilled at once, and shared prompt prefixes are
//! computed once.

use candle_core::{DType, Tensor, D};
use serde::{Deserialize, Serialize};

use std::collections::{BTreeMap, VecDeque};

use crate::error::{ModelError, Result};
use crate::kv_blocks::{BlockPool, SequenceBlocks};
use crate::kv_cache::KvCache;
use crate::qwen::{DecodeGraph, QwenModel};
use crate::tokenizer::TextTokenizer;

/// How to pick the next token. `temperature == 0` is greedy (argmax).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SamplingParams {
    /// Softmax temperature; 0 means greedy.
    pub temperature: f64,
    /// Keep only the `k` most likely tokens (transformers applies it after temperature).
    pub top_k: Option<usize>,
    /// Keep the smallest set of tokens whose probability reaches `p`.
    pub top_p: Option<f64>,
    /// Keep the tokens whose probability is at least `min_p` times the most likely one's
    /// (transformers' `min_p`, applied after top-p).
    #[serde(default)]
    pub min_p: Option<f64>,
    /// transformers' `repetition_penalty` on every token of the prompt and the reply so far
    /// (logits divided by it when positive, multiplied when negative), before temperature.
    /// Greedy rows are penalised too.
    #[serde(default)]
    pub repetition_penalty: Option<f64>,
    /// Seed of this request's draws; the same seed gives the same tokens.
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams::greedy()
    }
}

impl SamplingParams {
    /// Argmax decoding.
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: None,
            top_p: None,
            min_p: None,
            repetition_penalty: None,
            seed: 0,
        }
    }

    /// Sampling settings as users give them, with transformers' conventions, checked: the one
    /// definition every binary's `--temperature`/`--top-k`/`--top-p`/`--min-p`/
    /// `--repetition-penalty` goes through.
    ///
    /// `temperature` >= 0 (0 = greedy); `top_k` >= 0, where 0 turns the filter off (as in
    /// transformers' `generate`); `top_p` in (0, 1], where 1 turns it off; `min_p` in [0, 1],
    /// where 0 turns it off; `repetition_penalty` > 0, where 1 turns it off. The filters that
    /// are off come back as `None`. Errors name the flag, the value and the range.
    pub fn from_flags(
        temperature: f64,
        top_k: Option<i64>,
        top_p: Option<f64>,
        min_p: Option<f64>,
        repetition_penalty: Option<f64>,
        seed: u64,
    ) -> Result<Self> {
        if !temperature.is_finite() || temperature < 0.0 {
            return Err(ModelError::BadInput(format!(
                "--temperature {temperature}: must be a number >= 0 (0 = greedy)"
            )));
        }
        let top_k = match top_k {
            Some(k) if k < 0 => {
                return Err(ModelError::BadInput(format!(
                    "--top-k {k}: must be >= 0 (0 turns the filter off, as in transformers)"
                )))
            }
            Some(0) | None => None,
            Some(k) => Some(k as usize),
        };
        let top_p = match top_p {
            Some(p) if !(p > 0.0 && p <= 1.0) => {
                return Err(ModelError::BadInput(format!(
                    "--top-p {p}: must lie in (0, 1] (1 turns the filter off)"
                )))
            }
            Some(1.0) => None,
            p => p,
        };
        let min_p = match min_p {
            Some(p) if !(0.0..=1.0).contains(&p) => {
                return Err(ModelError::BadInput(format!(
                    "--min-p {p}: must lie in [0, 1] (0 turns the filter off)"
                )))
            }
            Some(0.0) => None,
            p => p,
        };
        let repetition_penalty = match repetition_penalty {
            Some(r) if !(r.is_finite() && r > 0.0) => {
                return Err(ModelError::BadInput(format!(
                    "--repetition-penalty {r}: must be > 0 (1 turns it off)"
                )))
            }
            Some(1.0) => None,
            r => r,
        };
        Ok(SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            repetition_penalty,
            seed,
        })
    }

    /// The device sampler's row: its seed and its step `counter`.
    fn row(&self, counter: u32) -> crate::ops::RowSampling {
        // top-k 1 is the argmax, as in transformers.
        let greedy = self.temperature <= 0.0 || self.top_k == Some(1);
        crate::ops::RowSampling {
            seed: self.seed,
            counter,
            temperature: if greedy { 0.0 } else { self.temperature },
            top_k: self.top_k.map_or(0, |k| k.min(u32::MAX as usize) as u32),
            top_p: self.top_p.map_or(1.0, |p| p as f32),
            min_p: self.min_p.map_or(0.0, |p| p as f32),
            repetition_penalty: self.repetition_penalty.map_or(1.0, |r| r as f32),
        }
    }

    fn validate(&self) -> Result<()> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(ModelError::BadInput(format!(
                "temperature {} must be >= 0 (0 = greedy)",
                self.temperature
            )));
        }
        if self.top_k == Some(0) {
            return Err(ModelError::BadInput(
                "top_k 0 keeps no token; use at least 1, or none".into(),
            ));
        }
        if let Some(p) = self.top_p {
            if !(p > 0.0 && p <= 1.0) {
                return Err(ModelError::BadInput(format!("top_p {p} must be in (0, 1]")));
            }
        }
        if let Some(p) = self.min_p {
            if !(0.0..=1.0).contains(&p) {
                return Err(ModelError::BadInput(format!("min_p {p} must be in [0, 1]")));
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r.is_finite() && r > 0.0) {
                return Err(ModelError::BadInput(format!(
                    "repetition_penalty {r} must be > 0 (1 = off)"
                )));
            }
        }
        Ok(())
    }
}

/// One prompt to continue.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationRequest {
    /// The prompt's token ids (already chat-formatted if wanted).
    pub prompt_ids: Vec<u32>,
    /// The most tokens to generate.
    pub max_new_tokens: usize,
    /// How to pick tokens.
    pub sampling: SamplingParams,
    /// Stop when the generated text contains any of these (needs a tokenizer); the text is cut
    /// before the stop string.
    pub stop_strings: Vec<String>,
}

impl GenerationRequest {
    /// Greedy continuation of `prompt_ids` for up to `max_new_tokens` tokens.
    pub fn greedy(prompt_ids: Vec<u32>, max_new_tokens: usize) -> Self {
        GenerationRequest {
            prompt_ids,
            max_new_tokens,
            sampling: SamplingParams::greedy(),
            stop_strings: Vec::new(),
        }
    }
}

/// Why a row stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishReason {
    /// An EOS id was generated (it is included in `token_ids`).
    Eos,
    /// A stop string appeared.
    StopString,
    /// `max_new_tokens` were generated.
    Length,
}

/// The continuation of one request.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct GenerationOutput {
    /// New tokens only.
    pub token_ids: Vec<u32>,
    /// Their text without special tokens, cut before a stop string; empty without a tokenizer.
    pub text: String,
    /// Why generation ended.
    pub finish_reason: FinishReason,
    /// The log-probability of each of `token_ids` under the model's raw logits (before
    /// penalty, temperature and filters: vLLM's `raw_logprobs`).
    #[serde(default)]
    pub logprobs: Vec<f32>,
}

/// A piece of streamed output.
#[derive(Debug, Clone)]
pub struct StreamEvent<'a> {
    /// Index of the request in the batch.
    pub request: usize,
    /// The token just generated.
    pub token_id: u32,
    /// Text that became final with this token (may be empty mid-character).
    pub text_delta: &'a str,
}

/// A prompt pass for [`Generator::generate_with`]: `(ids, pad, cache) -> (logits, shifts)`.
pub(crate) type Prefill<'p> =
    &'p mut dyn FnMut(&[Vec<u32>], &[usize], &mut KvCache) -> Result<(Tensor, Vec<i64>)>;

/// Generates continuations for a batch of requests.
pub struct Generator<'a> {
    model: &'a QwenModel,
    tokenizer: Option<&'a TextTokenizer>,
    eos_ids: Vec<u32>,
    pad_id: u32,
}

/// The decode slots and KV blocks of [`Generator::generate_paged`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedOptions {
    /// Sequences decoded together at most.
    pub max_batch: usize,
    /// Tokens per KV block (the unit of sharing: only whole blocks of a prompt are reused).
    pub block_size: usize,
    /// KV blocks in the pool, each `block_size` tokens of every layer
    /// ([`QwenModel::paged_block_bytes`] gives their size).
    pub num_blocks: usize,
    /// Decode through fixed-address step buffers, one per batch bucket, each step captured
    /// once as CUDA graphs and replayed, where the model allows it
    /// ([`QwenModel::decode_graph_supported`]: CUDA devices — several, one graph per device
    /// segment — and a shape the paged kernel takes); elsewhere
    /// (the CPU) the plain step. The same tokens either way (greedy and
    /// seeded, tested on the GPU). On in [`PagedOptions::new`] and
    /// [`PagedOptions::for_requests`] unless the environment sets `FLEET_ENFORCE_EAGER=1`
    /// (vLLM's `enforce_eager`), which every job's generation then follows.
    pub cuda_graphs: bool,
    /// Decode steps queued before their tokens are read back (vLLM's `num_scheduler_steps`;
    /// 1: every step). With `k` > 1
    /// the running rows take `k` steps at a time, each step's tokens fed to the next on the
    /// device; the host then takes them in order, and a row that stopped inside the `k`
    /// drops the tokens after its stop (their keys and values were written, but never into a
    /// block another sequence shares). Finished rows' places are refilled every `k` steps.
    /// The tokens are the same for any `k`. Rows with a repetition penalty (whose seen tokens
    /// are read on the host) make the step a single one.
    pub sync_every: usize,
}

impl PagedOptions {
    /// `max_batch` slots, blocks of 16 tokens, `num_blocks` of them, CUDA graphs where the
    /// model takes them, each step read back.
    pub fn new(max_batch: usize, num_blocks: usize) -> Self {
        PagedOptions {
            max_batch,
            block_size: 16,
            num_blocks,
            cuda_graphs: graphs_by_default(),
            sync_every: 1,
        }
    }

    /// `max_batch` slots (at most one per request, at least one) and blocks of `block_size`
    /// for that many of the longest request at once: never a request waiting for blocks
    /// while a slot is free, and no more KV memory than a lock-step batch of them.
    pub fn for_requests(
        requests: &[GenerationRequest],
        max_batch: usize,
        block_size: usize,
    ) -> Self {
        let max_batch = max_batch.min(requests.len()).max(1);
        let longest = requests
            .iter()
            .map(|r| r.prompt_ids.len() + r.max_new_tokens)
            .max()
            .unwrap_or(1);
        PagedOptions {
            max_batch,
            block_size,
            num_blocks: max_batch * longest.div_ceil(block_size.max(1)) + 1,
            cuda_graphs: graphs_by_default(),
            sync_every: 1,
        }
    }
}

/// Whether paged generation captures CUDA graphs unless told otherwise: yes, except with
/// `FLEET_ENFORCE_EAGER=1` in the environment (the way out should a graph misbehave on some
/// driver, without a flag in every job).
fn graphs_by_default() -> bool {
    static EAGER: crate::ops::EnvSwitch = crate::ops::EnvSwitch::new("FLEET_ENFORCE_EAGER", false);
    !EAGER.on()
}

/// The decode-graph bucket of `n` live rows: powers of two up to 8, then multiples of 8 (a
/// graph per bucket, its spare rows inactive).
fn graph_bucket(n: usize) -> usize {
    if n <= 8 {
        n.next_power_of_two()
    } else {
        n.div_ceil(8) * 8
    }
}

/// The running rows' position shifts (empty where none has one: text).
fn row_shifts(running: &[Running]) -> Vec<i64> {
    if running.iter().any(|r| r.shift != 0) {
        running.iter().map(|r| r.shift).collect()
    } else {
        Vec::new()
    }
}

/// Continuous batching on a paged KV cache, driven one step at a time: requests are
/// [submitted](Generator::submit) whenever the caller has them and come back from
/// [`Generator::step`] as they finish, so a caller whose next request depends on an earlier
/// reply (ARGO's episodes) never waits for a whole batch. The cache and its block pool outlive
/// the requests: later prompts find the blocks of earlier ones (ARGO's prompts that extend an
/// earlier call's, the judge's common instruction) until other blocks are needed.
pub struct PagedSession {
    pool: BlockPool,
    cache: KvCache,
    options: PagedOptions,
    /// Submitted and not yet admitted, in submission order.
    waiting: VecDeque<Pending>,
    /// Admitted: their blocks, in the decode step's row order.
    running: Vec<Running>,
    /// Finished without a step (no tokens asked for), returned by the next step.
    done: Vec<(usize, GenerationOutput)>,
    /// Decode graphs by batch bucket; their block tables are `graph_blocks` wide.
    graphs: BTreeMap<usize, DecodeGraph>,
    graph_blocks: usize,
    next_ticket: usize,
    stats: PagedStats,
}

/// A submitted request waiting for decode slots and blocks.
struct Pending {
    request: GenerationRequest,
    row: Row,
    /// Leading prompt tokens whose ids say what their keys and values are (all of a text
    /// prompt's; a vision-language prompt's up to its first image token).
    shareable: usize,
}

/// An admitted request.
struct Running {
    request: GenerationRequest,
    row: Row,
    seq: SequenceBlocks,
    /// Position shift of its generated tokens (Qwen3-VL's `rope_delta`; 0 for text).
    shift: i64,
}

/// A paged prompt pass for [`Generator::step_with`]: `(rows, cache) -> (logits, shifts)` runs
/// each row's `(ticket, seq)` prompt tokens after `seq.cached` into their slots, in one pass,
/// and returns each row's last logits `[rows, 1, vocab]` and the position shift of the tokens
/// it generates (empty: none).
pub(crate) type PagedPrefill<'p> =
    &'p mut dyn FnMut(&[(usize, &SequenceBlocks)], &mut KvCache) -> PrefillOutput;

/// Each row's last logits and position shift (see [`PagedPrefill`]).
pub(crate) type PrefillOutput = Result<(Tensor, Vec<i64>)>;

/// Tokens (padding included) of one batched prompt pass of newly admitted requests (vLLM's
/// `max_num_batched_tokens` is of the same order): more newcomers wait for the next pass.
/// `FLEET_PREFILL_TOKENS` sets another (a prompt longer than it still gets a pass of its own).
const PREFILL_TOKENS: usize = 8192;

/// [`PREFILL_TOKENS`], or `FLEET_PREFILL_TOKENS` where it is a positive number.
static PASS_TOKENS: crate::ops::EnvCount =
    crate::ops::EnvCount::new("FLEET_PREFILL_TOKENS", PREFILL_TOKENS);

/// Tokens (padding included) of one prompt pass of continuous batching: what a memory plan
/// sizes the paged path's workspace for (a prompt longer than it gets a pass of its own).
pub fn prefill_pass_tokens() -> usize {
    PASS_TOKENS.get()
}

/// A newcomer that forks the one admitted before it with the same prompt.
struct Fork {
    /// Its place in the running sequences, and its twin's.
    new: usize,
    twin: usize,
    /// The twin's partial last block and the newcomer's copy of it.
    copy: Option<(u32, u32)>,
}

impl PagedSession {
    /// Prompt tokens found in the cache and prompt tokens asked for, over the session's life.
    pub fn hit_counts(&self) -> (u64, u64) {
        self.pool.hit_counts()
    }

    /// Whether no request is waiting, running or unreturned.
    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty() && self.done.is_empty()
    }

    /// Leading tokens of `prompt` whose keys and values the session's cache holds now (a
    /// router sends a prompt where most of it is already computed).
    pub fn cached_prefix_len(&self, prompt: &[u32]) -> usize {
        self.pool.cached_prefix_len(prompt)
    }

    /// Requests submitted and not yet returned.
    pub fn in_flight(&self) -> usize {
        self.waiting.len() + self.running.len() + self.done.len()
    }

    /// What the session did since it was made (or since [`PagedSession::take_stats`]).
    pub fn stats(&self) -> &PagedStats {
        &self.stats
    }

    /// The counters so far, reset to zero.
    pub fn take_stats(&mut self) -> PagedStats {
        std::mem::take(&mut self.stats)
    }
}

/// What a paged generation did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PagedStats {
    /// Prompt tokens of the admitted requests.
    pub prompt_tokens: usize,
    /// Of those, tokens whose keys and values were found in the cache (not computed).
    pub cached_prompt_tokens: usize,
    /// Decode steps run.
    pub decode_steps: usize,
    /// Most sequences decoding at once.
    pub max_running: usize,
    /// Decode steps captured as CUDA graphs (one per batch bucket and table width used).
    pub graphs_captured: usize,
    /// Prompt passes run (each prefills every newcomer of a step that fits it).
    pub prefill_passes: usize,
    /// Host time queuing the decode steps of bursts (`sync_every` > 1), microseconds: with
    /// nothing read back inside a burst, the host's own cost of the steps.
    pub burst_queue_us: u64,
    /// Host time waiting for the bursts' tokens, microseconds: the device's time beyond the
    /// host's. A decode step bound by the host shows little wait.
    pub burst_wait_us: u64,
}

/// Per-row state during generation.
struct Row {
    /// The request's index in its call (lock-step), or its ticket (paged).
    request: usize,
    sampling: SamplingParams,
    max_new_tokens: usize,
    stop_strings: Vec<String>,
    generated: Vec<u32>,
    logprobs: Vec<f32>,
    /// The prompt's and the generated tokens, for a repetition penalty (else empty).
    seen: Vec<u32>,
    /// Length of text already streamed.
    emitted: usize,
    text: String,
    finish: Option<FinishReason>,
}

impl Row {
    /// The row of `req`, number `request`, seeded with its seed; a request for no tokens is
    /// finished.
    fn new(request: usize, req: &GenerationRequest) -> Row {
        Row {
            request,
            sampling: req.sampling.clone(),
            max_new_tokens: req.max_new_tokens,
            stop_strings: req.stop_strings.clone(),
            generated: Vec::new(),
            logprobs: Vec::new(),
            seen: if req.sampling.repetition_penalty.is_some() {
                req.prompt_ids.clone()
            } else {
                Vec::new()
            },
            emitted: 0,
            text: String::new(),
            finish: (req.max_new_tokens == 0).then_some(FinishReason::Length),
        }
    }

    fn output(self) -> GenerationOutput {
        GenerationOutput {
            token_ids: self.generated,
            text: self.text,
            finish_reason: self.finish.unwrap_or(FinishReason::Length),
            logprobs: self.logprobs,
        }
    }
}

impl<'a> Generator<'a> {
    /// A generator that stops on `eos_ids` and pads with `pad_id` (any valid id: padded
    /// positions are masked).
    pub fn new(
        model: &'a QwenModel,
        tokenizer: Option<&'a TextTokenizer>,
        eos_ids: Vec<u32>,
        pad_id: u32,
    ) -> Self {
        Generator {
            model,
            tokenizer,
            eos_ids,
            pad_id,
        }
    }

    /// Runs all requests as one batch. `on_token` is called for every generated token.
    pub fn generate(
        &self,
        requests: &[GenerationRequest],
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<Vec<GenerationOutput>> {
        self.generate_with(requests, on_token, &mut |ids, pad, cache| {
            Ok((self.model.forward(ids, pad, cache, true)?, Vec::new()))
        })
    }

    /// [`Generator::generate`] with another prefill: `prefill(ids, pad, cache)` runs the
    /// left-padded prompts (row `r` is request `r`) and returns the last position's logits
    /// `[rows, 1, vocab]` and, for decoders whose prompt positions are not one per token
    /// (Qwen3-VL's images), each row's position shift for the decode steps (empty: none).
    pub(crate) fn generate_with(
        &self,
        requests: &[GenerationRequest],
        mut on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
        prefill: Prefill<'_>,
    ) -> Result<Vec<GenerationOutput>> {
        if requests.is_empty() {
            return Ok(Vec::new());
        }
        self.validate(requests)?;
        let max_prompt = requests
            .iter()
            .map(|r| r.prompt_ids.len())
            .max()
            .unwrap_or(0);
        let max_new = requests.iter().map(|r| r.max_new_tokens).max().unwrap_or(0);
        let mut cache = self.model.new_cache(max_prompt + max_new)?;

        let mut rows: Vec<Row> = requests
            .iter()
            .enumerate()
            .map(|(i, r)| Row::new(i, r))
            .collect();
        let mut pad: Vec<usize> = requests
            .iter()
            .map(|r| max_prompt - r.prompt_ids.len())
            .collect();
        let ids: Vec<Vec<u32>> = requests
            .iter()
            .zip(&pad)
            .map(|(r, &p)| {
                let mut row = vec![self.pad_id; p];
                row.extend_from_slice(&r.prompt_ids);
                row
            })
            .collect();
        // `active` maps cache rows to entries of `rows`, in ascending order.
        let mut active: Vec<usize> = (0..rows.len()).collect();
        let (mut logits, mut shift) = prefill(&ids, &pad, &mut cache)?;
        loop {
            let mut live = rows_at(&mut rows, &active);
            let next = self.pick(&logits, &mut live)?;
            let mut still = Vec::new();
            for (slot, row) in live.into_iter().enumerate() {
                if row.finish.is_some() {
                    continue;
                }
                if self.accept(row, next[slot], &mut on_token)? {
                    still.push(slot);
                }
            }
            if still.is_empty() {
                break;
            }
            if still.len() != active.len() {
                let keep: Vec<u32> = still.iter().map(|&s| s as u32).collect();
                cache.retain_rows(&keep)?;
                pad = still.iter().map(|&s| pad[s]).collect();
                if !shift.is_empty() {
                    shift = still.iter().map(|&s| shift[s]).collect();
                }
                active = still.iter().map(|&s| active[s]).collect();
            }
            let step: Vec<Vec<u32>> = active
                .iter()
                .map(|&ri| vec![*rows[ri].generated.last().expect("one token per active row")])
                .collect();
            logits = self
                .model
                .forward_shifted(&step, &pad, &shift, &mut cache, true)?;
        }
        Ok(rows.into_iter().map(Row::output).collect())
    }

    /// Every request's prompt, sampling and length checked before any work.
    fn validate(&self, requests: &[GenerationRequest]) -> Result<()> {
        requests
            .iter()
            .enumerate()
            .try_for_each(|(i, r)| self.validate_one(r, &format!("request {i}")))
    }

    fn validate_one(&self, r: &GenerationRequest, what: &str) -> Result<()> {
        if r.prompt_ids.is_empty() {
            return Err(ModelError::BadInput(format!("{what} has an empty prompt")));
        }
        if !r.stop_strings.is_empty() && self.tokenizer.is_none() {
            return Err(ModelError::BadInput(format!(
                "{what}: stop strings need the model's tokenizer"
            )));
        }
        r.sampling.validate()?;
        self.model
            .check_length(r.prompt_ids.len() + r.max_new_tokens, what)
    }

    /// Takes token `tok` into `row`: EOS, stop strings, streaming and the length limit.
    /// Returns whether the row goes on.
    fn accept(
        &self,
        row: &mut Row,
        (tok, logprob): (u32, f32),
        on_token: &mut Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<bool> {
        row.generated.push(tok);
        row.logprobs.push(logprob);
        if row.sampling.repetition_penalty.is_some() {
            row.seen.push(tok);
        }
        if self.eos_ids.contains(&tok) {
            row.finish = Some(FinishReason::Eos);
        }
        // The text is needed token by token only for stop strings and streaming; otherwise it
        // is decoded once, when the row ends (decoding the whole row after every token costs
        // O(n²) host time: ~0.5 s a GSPO generation batch of 64 x 256 with a real tokenizer).
        let per_token = on_token.is_some() || !row.stop_strings.is_empty();
        if per_token {
            let delta = self.update_text(row)?;
            if let Some(cb) = on_token.as_mut() {
                cb(StreamEvent {
                    request: row.request,
                    token_id: tok,
                    text_delta: &delta,
                });
            }
        }
        if row.finish.is_none() && row.generated.len() >= row.max_new_tokens {
            row.finish = Some(FinishReason::Length);
        }
        if !per_token && row.finish.is_some() {
            self.update_text(row)?;
        }
        Ok(row.finish.is_none())
    }

    /// Runs the requests with continuous batching on a paged KV cache: up to
    /// `options.max_batch` sequences decode together, a finished one's place goes at once to
    /// the next waiting request (its prompt prefilled, then decoding with the others), and a
    /// prompt's leading blocks already in the cache — the same prompt generated before, or a
    /// shared instruction — are not computed again. Outputs are in request order, and each
    /// row's tokens depend only on its request (its seed and step), not on what it was
    /// batched with.
    ///
    /// A request is admitted only when blocks for its prompt and all its `max_new_tokens` are
    /// free (no preemption); one that alone needs more blocks than the pool has is an error.
    pub fn generate_paged(
        &self,
        requests: &[GenerationRequest],
        options: &PagedOptions,
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<(Vec<GenerationOutput>, PagedStats)> {
        let mut session = self.paged_session(options)?;
        self.generate_in(&mut session, requests, on_token)
    }

    /// An empty paged session: the cache and the block pool of `options`.
    pub fn paged_session(&self, options: &PagedOptions) -> Result<PagedSession> {
        if options.max_batch == 0 || options.block_size == 0 || options.sync_every == 0 {
            return Err(ModelError::BadInput(
                "paged generation needs max_batch, block_size and sync_every of at least 1".into(),
            ));
        }
        Ok(PagedSession {
            pool: BlockPool::new(options.num_blocks, options.block_size),
            cache: self
                .model
                .new_paged_cache(options.num_blocks, options.block_size)?,
            options: *options,
            waiting: VecDeque::new(),
            running: Vec::new(),
            done: Vec::new(),
            graphs: BTreeMap::new(),
            graph_blocks: 0,
            next_ticket: 0,
            stats: PagedStats::default(),
        })
    }

    /// [`Generator::generate_paged`] in `session`, which must be idle: its blocks (and the
    /// prefixes they hold) are kept for the next call. The session must come from this
    /// generator's model; after an error, start a new one (the failed call's blocks are not
    /// returned). The stats are this call's.
    pub fn generate_in(
        &self,
        session: &mut PagedSession,
        requests: &[GenerationRequest],
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<(Vec<GenerationOutput>, PagedStats)> {
        let shareable = vec![usize::MAX; requests.len()];
        self.generate_in_with(
            session,
            requests,
            &shareable,
            on_token,
            &mut |rows, cache| self.text_prefill(rows, cache),
        )
    }

    /// [`Generator::generate_in`] with another prompt pass: `prefill` gets the requests'
    /// indices in this call (Qwen3-VL's prompts, images included); only the first
    /// `shareable[i]` tokens of request `i`'s prompt may share or leave blocks.
    pub(crate) fn generate_in_with(
        &self,
        session: &mut PagedSession,
        requests: &[GenerationRequest],
        shareable: &[usize],
        mut on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
        prefill: PagedPrefill<'_>,
    ) -> Result<(Vec<GenerationOutput>, PagedStats)> {
        if !session.is_idle() {
            return Err(ModelError::BadInput(format!(
                "generate_in needs an idle session; {} request(s) of it are in flight",
                session.in_flight()
            )));
        }
        self.validate(requests)?;
        let before = session.take_stats();
        let first = session.next_ticket;
        for (r, &share) in requests.iter().zip(shareable) {
            self.submit_sharing(session, r.clone(), share)?;
        }
        let mut out: Vec<Option<GenerationOutput>> = vec![None; requests.len()];
        // Stream events and the prompt pass name the request's index in this call, not its
        // ticket.
        let mut renumber = |e: StreamEvent<'_>| {
            if let Some(cb) = on_token.as_mut() {
                cb(StreamEvent {
                    request: e.request - first,
                    ..e
                });
            }
        };
        let mut prefill_of = |rows: &[(usize, &SequenceBlocks)], cache: &mut KvCache| {
            let renumbered: Vec<(usize, &SequenceBlocks)> = rows
                .iter()
                .map(|&(ticket, s)| (ticket - first, s))
                .collect();
            prefill(&renumbered, cache)
        };
        while !session.is_idle() {
            for (ticket, o) in self.step_with(session, Some(&mut renumber), &mut prefill_of)? {
                out[ticket - first] = Some(o);
            }
        }
        let stats = std::mem::replace(&mut session.stats, before.clone());
        session.stats.add(&stats);
        Ok((
            out.into_iter()
                .map(|o| o.expect("every submitted request comes back"))
                .collect(),
            stats,
        ))
    }

    /// Queues `request` in `session` and returns its ticket, which [`Generator::step`] gives
    /// back with its output. The request is checked now; one that alone needs more KV blocks
    /// than the pool has is refused.
    pub fn submit(&self, session: &mut PagedSession, request: GenerationRequest) -> Result<usize> {
        self.submit_sharing(session, request, usize::MAX)
    }

    /// [`Generator::submit`] where only the first `shareable` prompt tokens may share blocks.
    fn submit_sharing(
        &self,
        session: &mut PagedSession,
        request: GenerationRequest,
        shareable: usize,
    ) -> Result<usize> {
        let ticket = session.next_ticket;
        self.validate_one(&request, &format!("request {ticket}"))?;
        let need = session
            .pool
            .blocks_for(request.prompt_ids.len() + request.max_new_tokens);
        if need > session.pool.num_blocks() {
            return Err(ModelError::BadInput(format!(
                "request {ticket} needs {need} KV blocks of {} tokens (prompt {} + \
                 max_new_tokens {}) and the pool has {}: raise the KV budget or lower \
                 max_new_tokens",
                session.options.block_size,
                request.prompt_ids.len(),
                request.max_new_tokens,
                session.pool.num_blocks()
            )));
        }
        session.next_ticket += 1;
        let row = Row::new(ticket, &request);
        if row.finish.is_some() {
            session.done.push((ticket, row.output()));
        } else {
            let shareable = shareable.min(request.prompt_ids.len());
            session.waiting.push_back(Pending {
                request,
                row,
                shareable,
            });
        }
        Ok(ticket)
    }

    /// One step of `session`: a decode step for the running sequences, then waiting requests
    /// admitted into the free decode slots (their prompts prefilled; a request with the same
    /// prompt as one admitted in the same step forks it: GSPO's completions of one prompt
    /// share one prefill, its first logits and a copy of the partial last block), then one
    /// token picked for every admitted sequence. Returns the requests that finished, with
    /// their tickets; empty when nothing is in flight.
    pub fn step(
        &self,
        session: &mut PagedSession,
        on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<Vec<(usize, GenerationOutput)>> {
        self.step_with(session, on_token, &mut |rows, cache| {
            self.text_prefill(rows, cache)
        })
    }

    /// [`Generator::step`] with another prompt pass (`prefill` gets the rows' tickets).
    pub(crate) fn step_with(
        &self,
        session: &mut PagedSession,
        mut on_token: Option<&mut dyn FnMut(StreamEvent<'_>)>,
        prefill: PagedPrefill<'_>,
    ) -> Result<Vec<(usize, GenerationOutput)>> {
        let mut finished = std::mem::take(&mut session.done);
        let PagedSession {
            pool,
            cache,
            options,
            waiting,
            running,
            graphs,
            graph_blocks,
            stats,
            ..
        } = session;
        // Several decode steps of the running rows before one read (`sync_every`), the rows
        // that stopped then leaving before the newcomers come in.
        let burst = if options.sync_every > 1
            && running
                .iter()
                .all(|r| r.row.sampling.repetition_penalty.is_none())
        {
            running
                .iter()
                .map(|r| r.row.max_new_tokens - r.row.generated.len())
                .min()
                .unwrap_or(1)
                .min(options.sync_every)
        } else {
            1
        };
        let advanced = !running.is_empty() && burst > 1;
        if !running.is_empty() {
            stats.max_running = stats.max_running.max(running.len());
        }
        let mut graph = if running.is_empty() {
            None
        } else {
            self.decode_graph_for(running, pool, options, graphs, graph_blocks, cache, stats)?
        };
        if advanced {
            // `FLEET_CUDA_PROFILE_STAGE=gen.decode@n`: ncu profiles the n-th decode call (a
            // burst, or the single step below) as it runs, replayed graphs included.
            let drawn = crate::profile::profiler_window("gen.decode", || {
                self.decode_burst(running, burst, graph.take(), cache, stats)
            })?;
            stats.decode_steps += burst;
            let mut still = Vec::with_capacity(running.len());
            for (mut r, tokens) in running.drain(..).zip(drawn) {
                if self.take_tokens(pool, &mut r, tokens, &mut on_token)? {
                    still.push(r);
                } else {
                    finished.push(retire(pool, r));
                }
            }
            *running = still;
        }
        let mut parts = Vec::new();
        if !running.is_empty() && !advanced {
            let seqs: Vec<&SequenceBlocks> = running.iter().map(|r| &r.seq).collect();
            let shifts = row_shifts(running);
            let logits = crate::profile::profiler_window("gen.decode", || {
                self.model
                    .decode_paged_step(graph, &seqs, &shifts, 0, None, true, cache)
            })?;
            parts.push(logits);
            stats.decode_steps += 1;
        }
        // Admission first (blocks only): a newcomer with the same prompt as one admitted in
        // this step forks it (GSPO's completions of one prompt: one prefill, the same first
        // logits, a copy of the partial last block); a newcomer's prompt blocks are registered
        // at once, so a later newcomer with the same prefix shares them (they are written in
        // the same or an earlier pass, layer by layer before any row reads them).
        let first_new = running.len();
        let mut forks: Vec<Fork> = Vec::new();
        let mut to_prefill: Vec<usize> = Vec::new();
        while running.len() < options.max_batch {
            let Some(front) = waiting.front() else { break };
            let req = &front.request;
            // Only a prompt whose ids say all of it (no image) forks a twin.
            let whole = front.shareable >= req.prompt_ids.len();
            let twin = (first_new..running.len())
                .find(|&i| whole && running[i].request.prompt_ids == req.prompt_ids);
            let admitted = match twin {
                Some(i) => pool
                    .fork(&running[i].seq, req.max_new_tokens)
                    .map(|(seq, copy)| (seq, Some((i, copy)))),
                None => pool
                    .admit_sharing(&req.prompt_ids, req.max_new_tokens, front.shareable)
                    .map(|seq| (seq, None)),
            };
            // Not enough free blocks: the request waits for running ones to finish. (With
            // nothing running every block is free or evictable, and `submit` checked that
            // the request fits the pool.)
            let Some((mut seq, twin)) = admitted else {
                if running.is_empty() {
                    return Err(ModelError::BadInput(format!(
                        "request {} does not fit the KV pool even alone",
                        front.row.request
                    )));
                }
                break;
            };
            let Pending { request, row, .. } = waiting.pop_front().expect("the front was there");
            stats.prompt_tokens += seq.len();
            stats.cached_prompt_tokens += seq.cached;
            let written = seq.len();
            pool.register(&mut seq, written);
            match twin {
                Some((twin, copy)) => forks.push(Fork {
                    new: running.len(),
                    twin,
                    copy,
                }),
                None => to_prefill.push(running.len()),
            }
            running.push(Running {
                request,
                row,
                seq,
                shift: 0,
            });
        }
        // The prompt passes: newcomers longest uncached part first (a pass pads its rows to
        // its longest, so like lengths go together), as many per pass as PASS_TOKENS
        // (padding included) holds.
        to_prefill.sort_by_key(|&i| std::cmp::Reverse(running[i].seq.uncached()));
        let mut first_logits: Vec<Option<Tensor>> = vec![None; running.len() - first_new];
        let mut start = 0;
        while start < to_prefill.len() {
            let uncached = |i: usize| running[i].seq.uncached();
            let mut end = start + 1;
            let mut window = uncached(to_prefill[start]);
            while end < to_prefill.len() {
                let w = window.max(uncached(to_prefill[end]));
                if (end - start + 1) * w > PASS_TOKENS.get() {
                    break;
                }
                window = w;
                end += 1;
            }
            let group = &to_prefill[start..end];
            let rows: Vec<(usize, &SequenceBlocks)> = group
                .iter()
                .map(|&i| (running[i].row.request, &running[i].seq))
                .collect();
            let (logits, shifts) =
                crate::profile::time(self.model.input_device(), "gen.prefill", || {
                    prefill(&rows, cache)
                })?;
            stats.prefill_passes += 1;
            for (k, &i) in group.iter().enumerate() {
                first_logits[i - first_new] = Some(logits.narrow(0, k, 1)?);
                running[i].shift = shifts.get(k).copied().unwrap_or(0);
            }
            start = end;
        }
        for Fork { new, twin, copy } in forks {
            if let Some((from, to)) = copy {
                self.model.copy_paged_block(cache, from, to)?;
            }
            first_logits[new - first_new] = first_logits[twin - first_new].clone();
            running[new].shift = running[twin].shift;
        }
        for logits in first_logits {
            parts.push(logits.expect("every newcomer prefilled or forked"));
        }
        if parts.is_empty() {
            return Ok(finished);
        }
        stats.max_running = stats.max_running.max(running.len());
        let logits = if parts.len() == 1 {
            parts.pop().expect("one part")
        } else {
            // A graph step's logits are in the model's dtype, a prefill's in f32: widened
            // (exactly) to one dtype.
            let parts: Vec<Tensor> = parts
                .iter()
                .map(|p| p.to_dtype(DType::F32))
                .collect::<candle_core::Result<_>>()?;
            Tensor::cat(&parts, 0)?
        };
        // After a burst only the newcomers' first tokens are picked here.
        let picked_from = if advanced { first_new } else { 0 };
        let next = {
            let mut rows: Vec<&mut Row> = running[picked_from..]
                .iter_mut()
                .map(|r| &mut r.row)
                .collect();
            self.pick(&logits, &mut rows)?
        };
        let picked: Vec<Running> = running.drain(picked_from..).collect();
        let mut still: Vec<Running> = std::mem::take(running);
        for (mut r, tok) in picked.into_iter().zip(next) {
            if self.take_tokens(pool, &mut r, [tok], &mut on_token)? {
                still.push(r);
            } else {
                finished.push(retire(pool, r));
            }
        }
        *running = still;
        Ok(finished)
    }

    /// Takes a running request's new tokens in order ([`Generator::accept`]), each one that
    /// does not end it getting its slot; returns whether the request goes on (the tokens after
    /// its end are dropped).
    fn take_tokens(
        &self,
        pool: &mut BlockPool,
        r: &mut Running,
        tokens: impl IntoIterator<Item = (u32, f32)>,
        on_token: &mut Option<&mut dyn FnMut(StreamEvent<'_>)>,
    ) -> Result<bool> {
        for tok in tokens {
            if !self.accept(&mut r.row, tok, on_token)? {
                return Ok(false);
            }
            pool.append(&mut r.seq, tok.0)
                .expect("blocks for max_new_tokens are taken at admission");
        }
        Ok(true)
    }

    /// `steps` decode steps of the running rows queued back to back, each step's tokens drawn
    /// on the device and fed to the next; one read at the end. Returns each row's tokens and
    /// log-probabilities in order.
    fn decode_burst(
        &self,
        running: &[Running],
        steps: usize,
        mut graph: Option<&mut DecodeGraph>,
        cache: &mut KvCache,
        stats: &mut PagedStats,
    ) -> Result<Vec<Vec<(u32, f32)>>> {
        let queued = std::time::Instant::now();
        let seqs: Vec<&SequenceBlocks> = running.iter().map(|r| &r.seq).collect();
        let shifts = row_shifts(running);
        let seen: Vec<&[u32]> = vec![&[]; running.len()];
        let mut ids: Option<Tensor> = None;
        let mut drawn = Vec::with_capacity(steps);
        let mut last_logits: Option<Tensor> = None;
        for ahead in 0..steps {
            // No step reads the host: the last step's logits are checked after the read.
            let logits = self
                .model
                .decode_paged_step(
                    graph.as_deref_mut(),
                    &seqs,
                    &shifts,
                    ahead,
                    ids.as_ref(),
                    false,
                    cache,
                )?
                .squeeze(1)?;
            let params: Vec<crate::ops::RowSampling> = running
                .iter()
                .map(|r| r.row.sampling.row((r.row.generated.len() + ahead) as u32))
                .collect();
            let out = crate::ops::sample_tokens_on_device(&logits, &params, &seen)?;
            ids = Some(out.narrow(1, 0, 1)?.contiguous()?);
            drawn.push(out);
            last_logits = Some(logits);
        }
        // [rows, 2 * steps]: each row's (token, log-probability bits) per step.
        let drawn = Tensor::cat(&drawn, 1)?;
        let waited = std::time::Instant::now();
        stats.burst_queue_us += waited.duration_since(queued).as_micros() as u64;
        let all: Vec<Vec<u32>> = drawn.to_vec2()?;
        stats.burst_wait_us += waited.elapsed().as_micros() as u64;
        // A bad value in any step reaches the last one's logits through the cache.
        if let Some(logits) = &last_logits {
            let vocab = logits.dim(1)?;
            self.model.check_logits(logits, |first| {
                Ok(format!(
                    "the logits of row {} at the last of {steps} queued decode steps",
                    first / vocab
                ))
            })?;
        }
        Ok(all
            .into_iter()
            .map(|row| {
                row.chunks(2)
                    .map(|c| (c[0], f32::from_bits(c[1])))
                    .collect()
            })
            .collect())
    }

    /// The decode graph of the running rows' batch bucket, captured on first use; `None`
    /// where graphs are off or the model cannot capture a step
    /// ([`QwenModel::decode_graph_supported`]: the CPU, a model over several devices), which
    /// then takes the plain step. The graphs' block tables hold the longest running request's
    /// blocks; a longer newcomer makes them all again, twice as wide.
    #[allow(clippy::too_many_arguments)]
    fn decode_graph_for<'g>(
        &self,
        running: &[Running],
        pool: &BlockPool,
        options: &PagedOptions,
        graphs: &'g mut BTreeMap<usize, DecodeGraph>,
        graph_blocks: &mut usize,
        cache: &mut KvCache,
        stats: &mut PagedStats,
    ) -> Result<Option<&'g mut DecodeGraph>> {
        if !options.cuda_graphs || !self.model.decode_graph_supported(options.block_size) {
            return Ok(None);
        }
        let need = running
            .iter()
            .map(|r| pool.blocks_for(r.request.prompt_ids.len() + r.request.max_new_tokens))
            .max()
            .unwrap_or(1);
        if need > *graph_blocks {
            *graph_blocks = need.next_power_of_two();
            graphs.clear();
        }
        let bucket = graph_bucket(running.len());
        Ok(Some(match graphs.entry(bucket) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                // FLEET_PROFILE=1: the capture's share of a generation (warm-up step included).
                let g =
                    crate::profile::time(self.model.input_device(), "gen.graph_capture", || {
                        self.model.decode_graph(bucket, *graph_blocks, cache, true)
                    })?;
                stats.graphs_captured += usize::from(g.is_captured());
                e.insert(g)
            }
        }))
    }

    /// The text model's prompt pass ([`PagedPrefill`]).
    fn text_prefill(
        &self,
        rows: &[(usize, &SequenceBlocks)],
        cache: &mut KvCache,
    ) -> PrefillOutput {
        let seqs: Vec<&SequenceBlocks> = rows.iter().map(|(_, s)| *s).collect();
        Ok((self.model.prefill_paged_batch(&seqs, cache)?, Vec::new()))
    }

    /// Chooses the next token of every row from `logits` `[rows, 1, vocab]` (row `s` of the
    /// logits is `rows[s]`), with its raw log-probability: one device call for the whole batch
    /// ([`crate::ops::sample_tokens`]), whatever each row's sampling.
    fn pick(&self, logits: &Tensor, rows: &mut [&mut Row]) -> Result<Vec<(u32, f32)>> {
        let logits = logits.squeeze(1)?;
        let params: Vec<crate::ops::RowSampling> = rows
            .iter()
            .map(|r| r.sampling.row(r.generated.len() as u32))
            .collect();
        let seen: Vec<&[u32]> = rows.iter().map(|r| r.seen.as_slice()).collect();
        let (ids, logprobs) = crate::ops::sample_tokens(&logits, &params, &seen)?;
        Ok(ids.into_iter().zip(logprobs).collect())
    }

    /// Decodes the row's tokens, applies stop strings, and returns the newly final text.
    fn update_text(&self, row: &mut Row) -> Result<String> {
        let Some(tok) = self.tokenizer else {
            return Ok(String::new());
        };
        let mut text = tok.decode(&row.generated, true)?;
        if let Some(cut) = row
            .stop_strings
            .iter()
            .filter_map(|s| text.find(s.as_str()))
            .min()
        {
            text.truncate(cut);
            row.finish = Some(FinishReason::StopString);
        }
        // Hold back an incomplete UTF-8 sequence (shown as U+FFFD) and a possible stop-string
        // prefix at the end until the next token settles it.
        let mut stable = text.len();
        if row.finish.is_none() {
            if text.ends_with('\u{FFFD}') {
                stable = text.trim_end_matches('\u{FFFD}').len();
            }
            for s in &row.stop_strings {
                for k in (1..s.len()).rev() {
                    if s.is_char_boundary(k) && text[..stable].ends_with(&s[..k]) {
                        stable = stable.min(text.len() - k);
                        break;
                    }
                }
            }
        }
        let delta = if stable > row.emitted && text.is_char_boundary(row.emitted) {
            text[row.emitted..stable].to_string()
        } else {
            String::new()
        };
        row.emitted = row.emitted.max(stable);
        row.text = text;
        Ok(delta)
    }
}

/// A finished request's blocks back to the pool (its full blocks, every token's keys and
/// values written, stay findable by prefix), and its output with its ticket.
fn retire(pool: &mut BlockPool, mut r: Running) -> (usize, GenerationOutput) {
    let written = r.seq.len();
    pool.register(&mut r.seq, written);
    pool.release(r.seq);
    (r.row.request, r.row.output())
}

/// The rows at `active` (ascending indices), mutably.
fn rows_at<'r>(rows: &'r mut [Row], active: &[usize]) -> Vec<&'r mut Row> {
    let mut want = active.iter().peekable();
    rows.iter_mut()
        .enumerate()
        .filter_map(|(i, r)| {
            (want.peek() == Some(&&i)).then(|| {
                want.next();
                r
            })
        })
        .collect()
}

impl PagedStats {
    /// Adds `other`'s counts (the most running: the larger).
    fn add(&mut self, other: &PagedStats) {
        self.prompt_tokens += other.prompt_tokens;
        self.cached_prompt_tokens += other.cached_prompt_tokens;
        self.decode_steps += other.decode_steps;
        self.max_running = self.max_running.max(other.max_running);
        self.graphs_captured += other.graphs_captured;
        self.prefill_passes += other.prefill_passes;
        self.burst_queue_us += other.burst_queue_us;
        self.burst_wait_us += other.burst_wait_us;
    }
}

/// Log-probabilities of `continuation` tokens after `prompt`, for a batch of pairs: element `i`
/// of a row is `log p(continuation[i] | prompt, continuation[..i])`. No gradients.
pub fn continuation_logprobs(
    model: &QwenModel,
    pairs: &[(Vec<u32>, Vec<u32>)],
    pad_id: u32,
) -> Result<Vec<Vec<f32>>> {
    if pairs.is_empty() {
        return Ok(Vec::new());
    }
    for (i, (p, c)) in pairs.iter().enumerate() {
        if p.is_empty() || c.is_empty() {
            return Err(ModelError::BadInput(format!(
                "pair {i}: prompt and continuation must both be non-empty"
            )));
        }
    }
    let len = pairs
        .iter()
        .map(|(p, c)| p.len() + c.len())
        .max()
        .unwrap_or(0);
    let pad: Vec<usize> = pairs.iter().map(|(p, c)| len - p.len() - c.len()).collect();
    let ids: Vec<Vec<u32>> = pairs
        .iter()
        .zip(&pad)
        .map(|((p, c), &n)| {
            let mut row = vec![pad_id; n];
            row.extend_from_slice(p);
            row.extend_from_slice(c);
            row
        })
        .collect();
    // Position t predicts token t+1; the target of the last position is never read.
    let targets: Vec<u32> = ids
        .iter()
        .flat_map(|row| row.iter().skip(1).copied().chain(std::iter::once(pad_id)))
        .collect();
    model.check_length(len, "the longest prompt + continuation")?;
    let mut cache = model.new_cache(len)?;
    let logits = model.forward(&ids, &pad, &mut cache, false)?; // [b, len, vocab] f32
    let logp = candle_nn::ops::log_softmax(&logits, D::Minus1)?;
    let targets = Tensor::from_vec(targets, (pairs.len(), len, 1), logp.device())?;
    let picked: Vec<Vec<f32>> = logp
        .gather(&targets, D::Minus1)?
        .squeeze(D::Minus1)?
        .to_vec2()?;
    Ok(pairs
        .iter()
        .zip(&pad)
        .zip(picked)
        .map(|(((p, c), &n), row)| {
            let start = n + p.len() - 1;
            row[start..start + c.len()].to_vec()
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(t: f64, k: Option<usize>, p: Option<f64>) -> SamplingParams {
        SamplingParams {
            temperature: t,
            top_k: k,
            top_p: p,
            ..SamplingParams::greedy()
        }
    }

    #[test]
    fn flags_follow_transformers_conventions_and_name_the_bad_value() {
        let p = SamplingParams::from_flags(0.7, Some(0), Some(1.0), None, None, 3).unwrap();
        assert_eq!((p.top_k, p.top_p, p.seed), (None, None, 3));
        let p = SamplingParams::from_flags(1.0, Some(5), Some(0.9), None, None, 0).unwrap();
        assert_eq!((p.top_k, p.top_p), (Some(5), Some(0.9)));
        let p = SamplingParams::from_flags(1.0, None, None, Some(0.0), Some(1.0), 0).unwrap();
        assert_eq!((p.min_p, p.repetition_penalty), (None, None));
        let p = SamplingParams::from_flags(1.0, None, None, Some(0.1), Some(1.2), 0).unwrap();
        assert_eq!((p.min_p, p.repetition_penalty), (Some(0.1), Some(1.2)));
        for (t, k, tp, mp, rp, needle) in [
            (-1.0, None, None, None, None, "--temperature -1"),
            (f64::NAN, None, None, None, None, "--temperature NaN"),
            (1.0, Some(-2), None, None, None, "--top-k -2"),
            (1.0, None, Some(2.0), None, None, "--top-p 2"),
            (1.0, None, Some(0.0), None, None, "--top-p 0"),
            (1.0, None, None, Some(1.5), None, "--min-p 1.5"),
            (1.0, None, None, None, Some(0.0), "--repetition-penalty 0"),
        ] {
            let e = SamplingParams::from_flags(t, k, tp, mp, rp, 0)
                .unwrap_err()
                .to_string();
            assert!(e.contains(needle), "{e}");
        }
    }

    #[test]
    fn top_k_one_is_the_argmax_in_the_device_sampler() {
        let r = params(1.0, Some(1), None).row(3);
        assert_eq!(r.temperature, 0.0);
        let r = params(0.7, Some(20), Some(0.9)).row(3);
        assert_eq!((r.top_k, r.top_p, r.counter), (20, 0.9, 3));
        assert_eq!((r.min_p, r.repetition_penalty), (0.0, 1.0));
    }

    #[test]
    fn bad_params_are_rejected() {
        assert!(params(-1.0, None, None).validate().is_err());
        assert!(params(1.0, Some(0), None).validate().is_err());
        assert!(params(1.0, None, Some(1.5)).validate().is_err());
        assert!(params(0.7, Some(20), Some(0.9)).validate().is_ok());
        let bad_min_p = SamplingParams {
            min_p: Some(-0.1),
            ..params(1.0, None, None)
        };
        assert!(bad_min_p.validate().is_err());
    }
}
