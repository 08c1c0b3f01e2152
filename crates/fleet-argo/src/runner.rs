//! Real runs: strategies answering questions with an LLM and a retriever.
//!
//! Every (question, strategy, c_r) triple is a *job* with its own [`Episode`]. Up to
//! `max_in_flight` jobs are in flight; each asks its next LLM call (Decomposer for Retrieve,
//! Reasoner for Reason, Synthesizer for Terminate) as soon as its last one returned and its
//! retrieval is done. With an LLM that streams (continuous batching) no job waits for others;
//! one that does not answers everything asked since its last answer as a batch (lock-step
//! rounds). The sub-queries of the replies that came back together are embedded in one batch
//! and searched once. Outcomes come from evidence: a Retrieve makes progress when it returns
//! chunks not seen before for that job with cosine similarity at or above the threshold.
//!
//! Finished jobs are appended to `records.jsonl` at once (one line each, flushed), and a run
//! started again with the same records file skips the jobs already there: a killed run resumes
//! where it stopped. The answer is parsed from the Synthesizer's text only; an answer that
//! does not parse is recorded as unparsed and counted wrong.

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use candle_core::Device;
use fleet_models::embedder::SentenceEmbedder;
use fleet_models::ChatMessage;
use fleet_runs::{JsonlLog, TailRepair};
use serde::{Deserialize, Serialize};

use crate::answer::{parse_answer_with_options, ParsedAnswer};
use crate::dataset::Question;
use crate::index::{Hit, IndexError, VectorIndex};
use crate::llm::{Llm, LlmError, LlmRequest, LockStep};
use crate::prompts::{Component, EvidenceView, OptionView, PromptContext, PromptError, Prompts};
use crate::strategy::{Episode, EpisodeError, EpisodeRecord, Outcome, Strategy};
use crate::summary::Tally;
use crate::{Action, MdpParams, StrategyKind};

/// Errors of a real run.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The LLM failed.
    #[error(transparent)]
    Llm(#[from] LlmError),
    /// Retrieval failed.
    #[error(transparent)]
    Index(#[from] IndexError),
    /// A prompt did not render.
    #[error(transparent)]
    Prompt(#[from] PromptError),
    /// The episode bookkeeping was misused (a bug).
    #[error(transparent)]
    Episode(#[from] EpisodeError),
    /// The embedder failed.
    #[error(transparent)]
    Model(#[from] fleet_models::ModelError),
    /// The records file could not be read or written.
    #[error(transparent)]
    Records(#[from] fleet_runs::RunsError),
}

/// The retrieval side: embedder, index, how many chunks and what counts as new evidence.
pub struct Retriever<'a> {
    /// Embeds the sub-queries.
    pub embedder: &'a SentenceEmbedder,
    /// The corpus.
    pub index: &'a VectorIndex,
    /// Where the similarity product runs.
    pub device: Device,
    /// Chunks returned per query.
    pub top_k: usize,
    /// Cosine similarity a chunk needs to count as evidence.
    pub threshold: f32,
    /// What makes a Retrieve count as progress.
    pub progress: ProgressRule,
    /// Hits of queries searched before: a sub-query comes back whenever a cached Decomposer
    /// reply is replayed (other strategies, other sweep points), and its search is exact.
    memo: Mutex<HashMap<String, Vec<Hit>>>,
}

/// What makes a Retrieve count as progress. Either way the retrieval must bring chunks not
/// seen before for the question at or above the similarity threshold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum ProgressRule {
    /// New chunks above the threshold are progress.
    #[default]
    Similarity,
    /// The LLM is asked (the `judge` prompt) whether the new chunks help; "yes" is progress.
    LlmJudge,
}

impl std::str::FromStr for ProgressRule {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "similarity" => Ok(ProgressRule::Similarity),
            "llm-judge" => Ok(ProgressRule::LlmJudge),
            _ => Err(format!(
                "unknown progress rule `{s}`: use similarity or llm-judge"
            )),
        }
    }
}

/// Whether a judge's reply says yes: its first word, after any `<think>` block.
fn judged_yes(reply: &str) -> bool {
    let text = match reply.rfind("</think>") {
        Some(i) => &reply[i + "</think>".len()..],
        None => reply,
    };
    text.trim_start()
        .split(|c: char| !c.is_alphabetic())
        .next()
        .is_some_and(|w| w.eq_ignore_ascii_case("yes"))
}

impl<'a> Retriever<'a> {
    /// A retriever over `index` whose queries `embedder` embeds; the similarity product runs
    /// on `device`.
    pub fn new(
        embedder: &'a SentenceEmbedder,
        index: &'a VectorIndex,
        device: Device,
        top_k: usize,
        threshold: f32,
        progress: ProgressRule,
    ) -> Self {
        Retriever {
            embedder,
            index,
            device,
            top_k,
            threshold,
            progress,
            memo: Mutex::new(HashMap::new()),
        }
    }

    /// Hits for each query, best first. Queries searched before are answered from memory;
    /// the rest are embedded and searched in one batch (each distinct query once).
    pub fn search(&self, queries: &[String]) -> Result<Vec<Vec<Hit>>, RunError> {
        let mut memo = self.memo.lock().unwrap_or_else(|e| e.into_inner());
        let mut queued: HashSet<&str> = HashSet::new();
        let mut missing: Vec<String> = Vec::new();
        for q in queries {
            if !memo.contains_key(q) && queued.insert(q) {
                missing.push(q.clone());
            }
        }
        if !missing.is_empty() {
            let vectors = self.embedder.embed_vecs(&missing)?;
            let hits = self.index.search(&vectors, self.top_k, &self.device)?;
            memo.extend(missing.into_iter().zip(hits));
        }
        Ok(queries.iter().map(|q| memo[q].clone()).collect())
    }
}

/// One unit of work: a question answered by a strategy under one world (its `c_r`).
#[derive(Clone)]
pub struct Job {
    /// The question.
    pub question: Arc<Question>,
    /// The strategy (for ARGO, solved for `params`).
    pub strategy: Strategy,
    /// The world's parameters (progress steps, costs).
    pub params: MdpParams,
    /// Most Retrieve/Reason steps before the answer is forced.
    pub step_cap: u32,
    /// Seeds the strategy's own random stream (Random(p)).
    pub seed: u64,
}

impl Job {
    /// The job's key in the records file: strategy, c_r and question id.
    pub fn key(&self) -> String {
        record_key(&self.strategy.kind(), self.params.c_r, &self.question.id)
    }
}

fn record_key(strategy: &StrategyKind, c_r: f64, question: &str) -> String {
    format!("{}|c_r={c_r}|{question}", strategy.label())
}

/// One finished job: a line of `records.jsonl`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct QuestionRecord {
    /// [`Job::key`].
    pub key: String,
    /// The question's id.
    pub question_id: String,
    /// The strategy.
    pub strategy: StrategyKind,
    /// The retrieval cost of the world.
    pub c_r: f64,
    /// The parsed answer (or why it did not parse).
    pub answer: ParsedAnswer,
    /// The correct option (0-based).
    pub correct_option: usize,
    /// Whether the parsed answer is the correct option (false when unparsed).
    pub correct: bool,
    /// The episode: steps, retrievals, cost, trace.
    pub episode: EpisodeRecord,
    /// Sub-queries asked.
    pub queries: Vec<String>,
    /// Notes written.
    pub notes: Vec<String>,
    /// Chunks gathered as evidence (ids in the index).
    pub evidence: Vec<u64>,
    /// The Synthesizer's full reply.
    pub final_text: String,
    /// LLM calls made for this job (cache hits included).
    pub llm_calls: u32,
    /// Of those, answered from the cache.
    pub cache_hits: u32,
    /// Prompt tokens of its calls.
    pub prompt_tokens: u64,
    /// Tokens generated for its calls (cached replies count their tokens too).
    pub new_tokens: u64,
    /// Evidence chunks and notes left out of prompts to fit the model's context (summed over
    /// the job's calls; 0 when everything fitted).
    #[serde(default)]
    pub context_trimmed: u32,
}

/// Appends finished jobs to a JSONL file and knows which are done.
///
/// The file is a [`fleet_runs::JsonlLog`]: a line torn by a kill is cut off before the next
/// append, so the job it belonged to runs again and its new record reads back. The caller
/// holds the output directory ([`fleet_runs::RunDir`]), which makes it the only writer and
/// guarantees the records were made by this model and these settings.
pub struct RecordsFile {
    log: JsonlLog,
    done: HashMap<String, QuestionRecord>,
    /// What was wrong with the file when it was opened (a torn last line repaired, unreadable
    /// lines), for the user; `None` when nothing was.
    pub problems: Option<String>,
    /// How the torn last line left by a kill was repaired, if there was one.
    pub repair: Option<TailRepair>,
    /// Complete lines that did not parse (left in place; their jobs run again).
    pub bad_lines: usize,
}

impl RecordsFile {
    /// Opens (or creates) `path`, reading the records already in it.
    pub fn open(path: &Path) -> Result<Self, RunError> {
        let (log, contents) = JsonlLog::open::<QuestionRecord>(path)?;
        let problems = contents.problems(path);
        let done = contents
            .records
            .into_iter()
            .map(|r| (r.key.clone(), r))
            .collect();
        Ok(RecordsFile {
            log,
            done,
            problems,
            repair: contents.repair,
            bad_lines: contents.bad_lines.len(),
        })
    }

    /// Whether the job with this key is recorded.
    pub fn is_done(&self, key: &str) -> bool {
        self.done.contains_key(key)
    }

    /// The record of a key.
    pub fn get(&self, key: &str) -> Option<&QuestionRecord> {
        self.done.get(key)
    }

    /// Records read or appended so far.
    pub fn len(&self) -> usize {
        self.done.len()
    }

    /// Whether nothing is recorded.
    pub fn is_empty(&self) -> bool {
        self.done.is_empty()
    }

    fn append(&mut self, record: QuestionRecord) -> Result<(), RunError> {
        self.log.append(&record)?;
        self.done.insert(record.key.clone(), record);
        Ok(())
    }
}

/// A job in flight.
struct Active {
    job: Job,
    episode: Episode,
    queries: Vec<String>,
    notes: Vec<String>,
    evidence: Vec<Hit>,
    seen: HashSet<u64>,
    llm_calls: u32,
    cache_hits: u32,
    prompt_tokens: u64,
    new_tokens: u64,
    context_trimmed: u32,
}

/// What a run did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RunProgress {
    /// Jobs given.
    pub jobs: usize,
    /// Jobs skipped because the records file had them.
    pub resumed: usize,
    /// Jobs run now.
    pub ran: usize,
    /// Polls of the LLM (lock-step rounds when the LLM does not stream).
    pub rounds: usize,
    /// Milliseconds in LLM calls (rendering, cache, generation).
    pub llm_ms: u64,
    /// Milliseconds in retrieval (embedding sub-queries, searching).
    pub retrieval_ms: u64,
}

/// What [`run_jobs`] reports as it goes (for progress bars).
#[derive(Debug)]
pub enum RunEvent<'a> {
    /// The jobs already in the records file, skipped (once, before the first round).
    Resumed(usize),
    /// A job finished and was recorded.
    Finished(&'a QuestionRecord),
    /// The LLM was polled and its replies handled (a lock-step round when it does not
    /// stream).
    Round {
        /// Polls so far.
        round: usize,
        /// Jobs in flight during the round.
        in_flight: usize,
        /// Jobs not started yet.
        waiting: usize,
    },
}

/// What a job's outstanding LLM call is for.
enum Purpose {
    /// The call that carries out the job's action.
    Action(Action),
    /// The judge's verdict on `fresh`, the chunks the job's last retrieval found.
    Judge(Vec<Hit>),
}

/// Runs `jobs` and appends each finished one to `records`. Jobs already in `records` are
/// skipped. Up to `max_in_flight` jobs (at least 1) advance at once; each asks its next LLM
/// call as soon as its last one returns (and its retrieval is done), so with an LLM that
/// streams ([`Llm::stream`]: continuous batching) no job waits for a round of others. An
/// LLM that does not stream answers everything asked since its last answer as one batch
/// (lock-step rounds). A job's calls and records are the same either way: each depends only
/// on the job's own earlier replies. `on_event` hears of skipped jobs, each finished job and
/// each poll of the LLM (progress bars).
pub fn run_jobs(
    jobs: Vec<Job>,
    llm: &dyn Llm,
    retriever: &Retriever<'_>,
    prompts: &Prompts,
    records: &mut RecordsFile,
    max_in_flight: usize,
    on_event: &mut dyn FnMut(RunEvent<'_>),
) -> Result<RunProgress, RunError> {
    let mut progress = RunProgress {
        jobs: jobs.len(),
        ..RunProgress::default()
    };
    let mut waiting: std::collections::VecDeque<Job> = jobs
        .into_iter()
        .filter(|j| {
            let done = records.is_done(&j.key());
            progress.resumed += usize::from(done);
            !done
        })
        .collect();
    on_event(RunEvent::Resumed(progress.resumed));
    let mut stream = match llm.stream()? {
        Some(stream) => stream,
        None => Box::new(LockStep::new(llm)),
    };
    // Jobs in flight by slot; `ready` are those whose next action is to be asked.
    let mut slots: Vec<Option<Active>> = Vec::new();
    let mut ready: Vec<usize> = Vec::new();
    let mut calls: HashMap<u64, (usize, Purpose)> = HashMap::new();
    let max_in_flight = max_in_flight.max(1);
    loop {
        let mut in_flight = slots.iter().filter(|s| s.is_some()).count();
        while in_flight < max_in_flight {
            let Some(job) = waiting.pop_front() else {
                break;
            };
            let episode = Episode::new(job.strategy.clone(), &job.params, job.step_cap, job.seed);
            let active = Active {
                job,
                episode,
                queries: Vec::new(),
                notes: Vec::new(),
                evidence: Vec::new(),
                seen: HashSet::new(),
                llm_calls: 0,
                cache_hits: 0,
                prompt_tokens: 0,
                new_tokens: 0,
                context_trimmed: 0,
            };
            let slot = match slots.iter().position(Option::is_none) {
                Some(free) => {
                    slots[free] = Some(active);
                    free
                }
                None => {
                    slots.push(Some(active));
                    slots.len() - 1
                }
            };
            ready.push(slot);
            in_flight += 1;
        }
        if ready.is_empty() && calls.is_empty() {
            break;
        }
        progress.rounds += 1;
        let llm_started = Instant::now();
        // 1. Every ready job's next action and its LLM call; prompts too long for the
        // model's context leave out their oldest evidence and notes.
        if !ready.is_empty() {
            let mut actions = Vec::with_capacity(ready.len());
            let mut requests = Vec::with_capacity(ready.len());
            for &slot in &ready {
                let a = slots[slot].as_mut().expect("a ready job is in flight");
                let action = a.episode.next_action().unwrap_or(Action::Terminate);
                requests.push(request_for(
                    a,
                    component_of(action),
                    retriever.index,
                    prompts,
                    0,
                    0,
                )?);
                actions.push(action);
            }
            let fits = llm.fits(&requests)?;
            for (i, &slot) in ready.iter().enumerate() {
                let a = slots[slot].as_mut().expect("a ready job is in flight");
                if !fits[i] {
                    let (request, trimmed) =
                        fitted_request(a, component_of(actions[i]), retriever.index, prompts, llm)?;
                    a.context_trimmed += trimmed;
                    requests[i] = request;
                }
            }
            for ((slot, action), request) in ready.drain(..).zip(actions).zip(requests) {
                let ticket = stream.submit(request)?;
                calls.insert(ticket, (slot, Purpose::Action(action)));
            }
        }
        let replies = stream.poll()?;
        progress.llm_ms += llm_started.elapsed().as_millis() as u64;
        // 2. The replies: notes, answers, and the sub-queries to search.
        let mut searching: Vec<(usize, String)> = Vec::new();
        let mut finished: Vec<(usize, String)> = Vec::new();
        for (ticket, reply) in replies {
            let (slot, purpose) = calls
                .remove(&ticket)
                .expect("the LLM answers the tickets it gave");
            let a = slots[slot]
                .as_mut()
                .expect("a job with a call is in flight");
            a.llm_calls += 1;
            a.cache_hits += u32::from(reply.cached);
            a.prompt_tokens += reply.prompt_tokens as u64;
            a.new_tokens += reply.new_tokens as u64;
            match purpose {
                Purpose::Action(Action::Retrieve) => {
                    searching.push((slot, clean_query(&reply.text, &a.job.question.question)));
                }
                Purpose::Action(Action::Reason) => {
                    a.notes.push(reply.text.trim().to_string());
                    a.episode.record(Outcome::Reasoned)?;
                    ready.push(slot);
                }
                Purpose::Action(Action::Terminate) => {
                    a.episode.record(Outcome::Terminated)?;
                    finished.push((slot, reply.text));
                }
                Purpose::Judge(fresh) => {
                    add_evidence(a, fresh, judged_yes(&reply.text))?;
                    ready.push(slot);
                }
            }
        }
        // 3. The retrievals of the replies in one batch. With an LLM judge, a retrieval that
        // found new chunks asks whether they help before it counts.
        if !searching.is_empty() {
            let queries: Vec<String> = searching.iter().map(|(_, q)| q.clone()).collect();
            let retrieval_started = Instant::now();
            let hits = retriever.search(&queries)?;
            progress.retrieval_ms += retrieval_started.elapsed().as_millis() as u64;
            let mut judging = Vec::new();
            for ((slot, query), hits) in searching.into_iter().zip(hits) {
                let a = slots[slot].as_mut().expect("a searching job is in flight");
                let fresh: Vec<Hit> = hits
                    .into_iter()
                    .filter(|h| h.score >= retriever.threshold && !a.seen.contains(&h.id))
                    .collect();
                a.queries.push(query);
                if retriever.progress == ProgressRule::LlmJudge && !fresh.is_empty() {
                    judging.push((slot, fresh));
                } else {
                    let made_progress = !fresh.is_empty();
                    add_evidence(a, fresh, made_progress)?;
                    ready.push(slot);
                }
            }
            let judge_started = Instant::now();
            for (slot, fresh) in judging {
                let a = slots[slot].as_ref().expect("a judged job is in flight");
                let request = judge_request(a, &fresh, retriever.index, prompts)?;
                let ticket = stream.submit(request)?;
                calls.insert(ticket, (slot, Purpose::Judge(fresh)));
            }
            progress.llm_ms += judge_started.elapsed().as_millis() as u64;
        }
        // 4. Finished jobs, recorded.
        for (slot, text) in finished {
            let a = slots[slot].take().expect("a finished job was in flight");
            let record = finish(a, text)?;
            on_event(RunEvent::Finished(&record));
            records.append(record)?;
            progress.ran += 1;
        }
        on_event(RunEvent::Round {
            round: progress.rounds,
            in_flight,
            waiting: waiting.len(),
        });
    }
    Ok(progress)
}

/// A retrieval's outcome for job `a`: the chunks it found new are evidence from now on.
fn add_evidence(a: &mut Active, fresh: Vec<Hit>, made_progress: bool) -> Result<(), RunError> {
    for h in fresh {
        a.seen.insert(h.id);
        a.evidence.push(h);
    }
    a.episode.record(Outcome::Retrieved {
        progress: made_progress,
    })?;
    Ok(())
}

/// The LLM component that carries out `action`.
fn component_of(action: Action) -> Component {
    match action {
        Action::Retrieve => Component::Decomposer,
        Action::Reason => Component::Reasoner,
        Action::Terminate => Component::Synthesizer,
    }
}

/// The LLM request of `component` for job `a`, within the model's context: while the
/// rendered prompt plus its token limit does not fit, the oldest evidence chunk is left out
/// (then the oldest note). Returns the request and how many items were left out.
fn fitted_request(
    a: &Active,
    component: Component,
    index: &VectorIndex,
    prompts: &Prompts,
    llm: &dyn Llm,
) -> Result<(LlmRequest, u32), RunError> {
    let (mut skip_evidence, mut skip_notes) = (0, 0);
    loop {
        let request = request_for(a, component, index, prompts, skip_evidence, skip_notes)?;
        if llm.fits(std::slice::from_ref(&request))?[0] {
            return Ok((request, (skip_evidence + skip_notes) as u32));
        }
        if skip_evidence < a.evidence.len() {
            skip_evidence += 1;
        } else if skip_notes < a.notes.len() {
            skip_notes += 1;
        } else {
            // Nothing left to drop: the LLM reports the prompt that does not fit.
            return Ok((request, (skip_evidence + skip_notes) as u32));
        }
    }
}

/// The LLM request of `component` for job `a`, leaving out the first `skip_evidence` chunks
/// and `skip_notes` notes.
fn request_for(
    a: &Active,
    component: Component,
    index: &VectorIndex,
    prompts: &Prompts,
    skip_evidence: usize,
    skip_notes: usize,
) -> Result<LlmRequest, RunError> {
    let ctx = context(
        a,
        &a.evidence[skip_evidence..],
        &a.notes[skip_notes..],
        index,
    );
    chat_request(prompts, component, &ctx)
}

/// The judge's request for job `a` about the chunks `fresh` a retrieval just found.
fn judge_request(
    a: &Active,
    fresh: &[Hit],
    index: &VectorIndex,
    prompts: &Prompts,
) -> Result<LlmRequest, RunError> {
    let ctx = context(a, fresh, &a.notes, index);
    chat_request(prompts, Component::Judge, &ctx)
}

/// What the templates see for job `a`, with `evidence` and `notes` as given.
fn context<'c>(
    a: &'c Active,
    evidence: &[Hit],
    notes: &'c [String],
    index: &'c VectorIndex,
) -> PromptContext<'c> {
    let q = &a.job.question;
    PromptContext {
        question: &q.question,
        options: q
            .options
            .iter()
            .enumerate()
            .map(|(i, text)| OptionView {
                label: (i + 1).to_string(),
                text,
            })
            .collect(),
        notes,
        evidence: evidence
            .iter()
            .filter_map(|h| {
                index.chunk(h.id).map(|c| EvidenceView {
                    text: &c.text,
                    source: &c.source,
                    score: h.score,
                })
            })
            .collect(),
        queries: &a.queries,
    }
}

/// `component`'s prompt for `ctx` as a chat request: the system message, then the rendered user
/// message, with the component's token limit.
fn chat_request(
    prompts: &Prompts,
    component: Component,
    ctx: &PromptContext<'_>,
) -> Result<LlmRequest, RunError> {
    let mut messages = Vec::with_capacity(2);
    if !prompts.system.is_empty() {
        messages.push(ChatMessage::new("system", prompts.system.clone()));
    }
    messages.push(ChatMessage::new("user", prompts.render(component, ctx)?));
    Ok(LlmRequest {
        messages,
        max_new_tokens: prompts.template(component).max_new_tokens,
    })
}

/// The sub-query from the Decomposer's reply: its first non-empty line without quotes or a
/// `Query:` prefix; the question itself when the reply is empty (so retrieval still runs).
fn clean_query(reply: &str, question: &str) -> String {
    let line = reply
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("");
    let line = line
        .strip_prefix("Query:")
        .or_else(|| line.strip_prefix("query:"))
        .unwrap_or(line)
        .trim()
        .trim_matches(|c| c == '"' || c == '\'' || c == '`')
        .trim();
    if line.is_empty() {
        question.to_string()
    } else {
        line.to_string()
    }
}

fn finish(a: Active, final_text: String) -> Result<QuestionRecord, RunError> {
    let q = &a.job.question;
    let answer = parse_answer_with_options(&final_text, &q.options);
    let correct = answer.index() == Some(q.correct);
    Ok(QuestionRecord {
        key: a.job.key(),
        question_id: q.id.clone(),
        strategy: a.job.strategy.kind(),
        c_r: a.job.params.c_r,
        answer,
        correct_option: q.correct,
        correct,
        episode: a.episode.finish()?,
        queries: a.queries,
        notes: a.notes,
        evidence: a.evidence.iter().map(|h| h.id).collect(),
        final_text,
        llm_calls: a.llm_calls,
        cache_hits: a.cache_hits,
        prompt_tokens: a.prompt_tokens,
        new_tokens: a.new_tokens,
        context_trimmed: a.context_trimmed,
    })
}

/// One strategy at one `c_r` over the records of a run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RealSummary {
    /// The world's retrieval cost.
    pub c_r: f64,
    /// Accuracy (with its 95% interval), cost, steps, retrievals.
    #[serde(flatten)]
    pub summary: crate::summary::StrategySummary,
    /// Answers that did not parse (counted wrong).
    pub unparsed: u64,
    /// LLM calls (cache hits included).
    pub llm_calls: u64,
    /// Of those, answered from the cache.
    pub cache_hits: u64,
    /// Prompt tokens.
    pub prompt_tokens: u64,
    /// Generated tokens.
    pub new_tokens: u64,
    /// Questions whose prompts had evidence or notes left out to fit the context.
    pub context_trimmed_questions: u64,
}

/// Summaries per (strategy, c_r) of `records`, in the order strategies and c_r values first
/// appear.
pub fn summarize(records: &[&QuestionRecord]) -> Vec<RealSummary> {
    struct Acc {
        c_r: f64,
        tally: Tally,
        unparsed: u64,
        llm_calls: u64,
        cache_hits: u64,
        prompt_tokens: u64,
        new_tokens: u64,
        trimmed: u64,
    }
    let mut order: Vec<String> = Vec::new();
    let mut accs: HashMap<String, Acc> = HashMap::new();
    for r in records {
        let key = format!("{}|{}", r.strategy.label(), r.c_r);
        let acc = accs.entry(key.clone()).or_insert_with(|| {
            order.push(key.clone());
            Acc {
                c_r: r.c_r,
                tally: Tally::new(r.strategy),
                unparsed: 0,
                llm_calls: 0,
                cache_hits: 0,
                prompt_tokens: 0,
                new_tokens: 0,
                trimmed: 0,
            }
        });
        acc.tally.add(&r.episode, r.correct, None);
        acc.unparsed += u64::from(r.answer.index().is_none());
        acc.llm_calls += u64::from(r.llm_calls);
        acc.cache_hits += u64::from(r.cache_hits);
        acc.prompt_tokens += r.prompt_tokens;
        acc.new_tokens += r.new_tokens;
        acc.trimmed += u64::from(r.context_trimmed > 0);
    }
    order
        .iter()
        .filter_map(|k| {
            let a = &accs[k];
            Some(RealSummary {
                c_r: a.c_r,
                summary: a.tally.finish()?,
                unparsed: a.unparsed,
                llm_calls: a.llm_calls,
                cache_hits: a.cache_hits,
                prompt_tokens: a.prompt_tokens,
                new_tokens: a.new_tokens,
                context_trimmed_questions: a.trimmed,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn judge_replies() {
        assert!(judged_yes("Yes."));
        assert!(judged_yes("  yes, it does"));
        assert!(judged_yes("<think>hmm no</think>\nYES"));
        assert!(!judged_yes("No"));
        assert!(!judged_yes("yesterday"));
        assert!(!judged_yes(""));
        assert!(!judged_yes("It says yes"));
    }

    #[test]
    fn query_is_the_first_line_without_decoration() {
        assert_eq!(
            clean_query("\n  Query: \"E2 setup\"\nmore", "Q?"),
            "E2 setup"
        );
        assert_eq!(clean_query("   \n", "Q?"), "Q?");
        assert_eq!(clean_query("`A1 policy`", "Q?"), "A1 policy");
    }
}
