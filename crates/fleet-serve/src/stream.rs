//! Continuous batching over replicas: each replica runs a paged session of its own
//! ([`fleet_models::PagedSession`]), in this process or in its replica process, and a caller
//! that asks its next question as soon as an answer returns (argo-exp's runner) submits
//! requests to them one by one and steps them all together, the processes in parallel.

use serde::{Deserialize, Serialize};
use std::collections::{HashMap, HashSet};
use std::hash::{Hash, Hasher};
use std::sync::Mutex;

use fleet_models::{
    GenerationOutput, GenerationRequest, Generator, ModelError, PagedOptions, PagedSession, Result,
    TextModel,
};

use crate::kind::Text;
use crate::process::{ReplicaProcess, StreamStep, StreamWorker};
use crate::replica::Replicas;

/// Tokens per block of a stream's paged cache (the unit of prompt sharing).
const BLOCK_SIZE: usize = 16;

/// What each replica's paged session of a stream holds and how it steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamConfig {
    /// Requests decoded together at most.
    pub max_batch: usize,
    /// The paged KV cache's bytes at most.
    pub kv_bytes: u64,
    /// Decode steps queued before their tokens are read back (vLLM's `num_scheduler_steps`;
    /// [`PagedOptions::sync_every`]): the same tokens for any value, a finished request's
    /// slot refilled up to that many steps later.
    pub num_scheduler_steps: usize,
}

impl StreamConfig {
    /// `max_batch` slots, at most `kv_bytes` of KV cache, tokens read back after every step.
    pub fn new(max_batch: usize, kv_bytes: u64) -> Self {
        StreamConfig {
            max_batch,
            kv_bytes,
            num_scheduler_steps: 1,
        }
    }
}

/// The paged session of a stream on `model`: `max_batch` decode slots, KV blocks for that many
/// requests of the model's whole context or `kv_bytes`, whichever is less, and reads of the
/// tokens every `num_scheduler_steps`.
pub fn stream_options(model: &TextModel, config: StreamConfig) -> PagedOptions {
    let context = model.model.config().max_position_embeddings;
    let block_bytes = model.model.paged_block_bytes(BLOCK_SIZE).max(1);
    let whole = config.max_batch.max(1) * context.div_ceil(BLOCK_SIZE);
    PagedOptions {
        block_size: BLOCK_SIZE,
        sync_every: config.num_scheduler_steps.max(1),
        ..PagedOptions::new(
            config.max_batch.max(1),
            whole.min((config.kv_bytes / block_bytes) as usize).max(1),
        )
    }
}

/// A paged session on a model of this process, its requests known by the caller's ids.
pub(crate) struct LocalStream<'m> {
    generator: Generator<'m>,
    session: PagedSession,
    ids: HashMap<usize, u64>,
}

impl<'m> LocalStream<'m> {
    pub(crate) fn new(model: &'m TextModel, config: StreamConfig) -> Result<Self> {
        let generator = model.generator();
        let session = generator.paged_session(&stream_options(model, config))?;
        Ok(LocalStream {
            generator,
            session,
            ids: HashMap::new(),
        })
    }

    fn submit(&mut self, id: u64, request: GenerationRequest) -> Result<()> {
        let ticket = self.generator.submit(&mut self.session, request)?;
        self.ids.insert(ticket, id);
        Ok(())
    }

    fn step(&mut self) -> Result<StreamStep> {
        let done = self
            .generator
            .step(&mut self.session, None)?
            .into_iter()
            .map(|(ticket, out)| (self.ids.remove(&ticket).expect("a submitted ticket"), out))
            .collect();
        let cached = self.session.take_stats().cached_prompt_tokens as u64;
        Ok((done, cached))
    }
}

impl StreamWorker for LocalStream<'_> {
    fn submit(&mut self, id: u64, request: serde_json::Value) -> Result<()> {
        let request: GenerationRequest = serde_json::from_value(request)
            .map_err(|e| ModelError::BadInput(format!("a request that does not parse: {e}")))?;
        LocalStream::submit(self, id, request)
    }

    fn step(&mut self) -> Result<(Vec<(u64, serde_json::Value)>, u64)> {
        let (done, cached) = LocalStream::step(self)?;
        let done = done
            .into_iter()
            .map(|(id, out)| {
                serde_json::to_value(out)
                    .map(|v| (id, v))
                    .map_err(|e| ModelError::Replicas(format!("an output: {e}")))
            })
            .collect::<Result<_>>()?;
        Ok((done, cached))
    }
}

/// Where a stream runs.
enum Place<'r> {
    Local(Box<LocalStream<'r>>),
    Process(&'r Mutex<ReplicaProcess<Text>>),
}

/// One replica's stream ([`Replicas::streams`]).
pub struct ReplicaStream<'r> {
    place: Place<'r>,
    in_flight: usize,
    /// A process's stream: hashes of the block prefixes of the prompts sent there, an estimate
    /// of what its cache holds (evictions not seen).
    sent: HashSet<u64>,
    /// A local stream's step, run by [`ReplicaStream::start_step`].
    stepped: StreamStep,
    /// Prompt tokens found in the cache since [`ReplicaStream::take_cached_prompt_tokens`].
    cached_prompt_tokens: u64,
}

impl ReplicaStream<'_> {
    /// Requests submitted and not yet returned.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Leading tokens of `prompt` whose keys and values the replica's cache holds (for a
    /// replica process, as far as the prompts sent there say).
    pub fn cached_prefix_len(&self, prompt: &[u32]) -> usize {
        match &self.place {
            Place::Local(s) => s.session.cached_prefix_len(prompt),
            Place::Process(_) => (1..=prompt.len().saturating_sub(1) / BLOCK_SIZE)
                .rev()
                .find(|&k| self.sent.contains(&prefix_hash(&prompt[..k * BLOCK_SIZE])))
                .map_or(0, |k| k * BLOCK_SIZE),
        }
    }

    /// Queues `request` under the caller's `id`.
    pub fn submit(&mut self, id: u64, request: GenerationRequest) -> Result<()> {
        match &mut self.place {
            Place::Local(s) => s.submit(id, request)?,
            Place::Process(p) => {
                for k in 1..=request.prompt_ids.len() / BLOCK_SIZE {
                    self.sent
                        .insert(prefix_hash(&request.prompt_ids[..k * BLOCK_SIZE]));
                }
                lock(p).stream_submit(id, &request)?
            }
        }
        self.in_flight += 1;
        Ok(())
    }

    /// Starts one step: a replica process is asked for it (it runs while the caller goes
    /// on), a local stream runs it now. [`ReplicaStream::finish_step`] gives the result.
    pub fn start_step(&mut self) -> Result<()> {
        match &mut self.place {
            Place::Local(s) => self.stepped = s.step()?,
            Place::Process(p) => lock(p).stream_step()?,
        }
        Ok(())
    }

    /// The requests that finished in the step [`ReplicaStream::start_step`] started.
    pub fn finish_step(&mut self) -> Result<Vec<(u64, GenerationOutput)>> {
        let (done, cached) = match &mut self.place {
            Place::Local(_) => std::mem::take(&mut self.stepped),
            Place::Process(p) => lock(p).stream_stepped()?,
        };
        self.in_flight -= done.len();
        self.cached_prompt_tokens += cached;
        Ok(done)
    }

    /// Prompt tokens whose keys and values the replica found in its cache (not computed)
    /// since the last call.
    pub fn take_cached_prompt_tokens(&mut self) -> u64 {
        std::mem::take(&mut self.cached_prompt_tokens)
    }
}

/// One step of every busy stream, the replica processes in parallel (each is asked first, the
/// streams of this process step meanwhile): the requests that finished, with their ids.
pub fn step_all(streams: &mut [ReplicaStream<'_>]) -> Result<Vec<(u64, GenerationOutput)>> {
    let busy: Vec<usize> = (0..streams.len())
        .filter(|&i| streams[i].in_flight() > 0)
        .collect();
    for &i in &busy {
        streams[i].start_step()?;
    }
    let mut done = Vec::new();
    for &i in &busy {
        done.extend(streams[i].finish_step()?);
    }
    Ok(done)
}

fn lock<'a>(p: &'a Mutex<ReplicaProcess<Text>>) -> std::sync::MutexGuard<'a, ReplicaProcess<Text>> {
    p.lock().unwrap_or_else(|e| e.into_inner())
}

fn prefix_hash(tokens: &[u32]) -> u64 {
    let mut h = std::collections::hash_map::DefaultHasher::new();
    tokens.hash(&mut h);
    h.finish()
}

impl Replicas<Text> {
    /// A stream per replica, in this process or in its replica process, each a paged session
    /// of `config` ([`stream_options`]).
    pub fn streams(&self, config: StreamConfig) -> Result<Vec<ReplicaStream<'_>>> {
        let mut out = Vec::with_capacity(self.len());
        for model in &self.models {
            out.push(Place::Local(Box::new(LocalStream::new(model, config)?)));
        }
        for p in self.processes() {
            lock(p).stream_open(config)?;
            out.push(Place::Process(p));
        }
        Ok(out
            .into_iter()
            .map(|place| ReplicaStream {
                place,
                in_flight: 0,
                sent: HashSet::new(),
                stepped: (Vec::new(), 0),
                cached_prompt_tokens: 0,
            })
            .collect())
    }
}
