//! The simulated world: the MDP's own model. Everything it produces is labelled
//! [`SIMULATION`]; it says what the MDP predicts, not what a real model on real questions does.
//!
//! A Retrieve makes progress with probability p_s; an answer given at progress `U` is right
//! with probability sigma(U / U_max). Each question `i` has its own random streams, derived
//! from the run seed and `i` alone ([`derive_seed`]), so results do not depend on batch order
//! or on the other questions. Streams are common to all strategies and all sweep points:
//! question `i`'s k-th retrieval succeeds or fails alike for every strategy, and its answer
//! draw is one uniform number `z_i` (right when `z_i < sigma(U)`), so a strategy that ends at
//! a higher `U` is right on a superset of questions (common random numbers: comparisons
//! between strategies carry less noise than independent draws would).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::params::{MdpParams, ParamError};
use crate::strategy::{Action, Episode, EpisodeError, EpisodeRecord, Outcome, Strategy};

/// The label every simulated output carries.
pub const SIMULATION: &str = "simulation";

/// The random streams of one question.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum Stream {
    /// Retrieval success coins.
    Retrieval = 1,
    /// The answer's correctness draw.
    Answer = 2,
    /// The strategy's own choices (Random).
    Strategy = 3,
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The seed of one question's stream: a SplitMix64 mix of the run seed, the question index
/// and the stream, so neighbouring questions and streams get unrelated seeds.
pub fn derive_seed(run_seed: u64, question: u64, stream: Stream) -> u64 {
    splitmix64(splitmix64(splitmix64(run_seed) ^ question) ^ (stream as u64))
}

/// The MDP's discounted return of an episode: each Retrieve or Reason at step `t` (from 0)
/// earns `-gamma^t mu c`, the answer at step `T` earns `gamma^T terminal_reward`.
pub fn discounted_return(params: &MdpParams, record: &EpisodeRecord, terminal_reward: f64) -> f64 {
    let mut total = 0.0;
    let mut discount = 1.0;
    for step in &record.trace {
        match step.action {
            Action::Retrieve => total -= discount * params.mu * params.c_r,
            Action::Reason => total -= discount * params.mu * params.c_p,
            Action::Terminate => {
                total += discount * terminal_reward;
                break;
            }
        }
        discount *= params.gamma;
    }
    total
}

/// One simulated question.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SimulatedQuestion {
    /// Always [`SIMULATION`].
    pub world: String,
    /// The question's index.
    pub index: u64,
    /// Whether the simulated answer is right (drawn with probability sigma(U / U_max)).
    pub correct: bool,
    /// sigma(final U / U_max): the probability of being right, without the draw's noise.
    pub expected_accuracy: f64,
    /// The MDP's discounted objective for this episode with the expected terminal reward,
    /// `sum_t -gamma^t mu c(a_t) + gamma^T sigma(U_T)` ([`discounted_return`]): what ARGO
    /// maximises in expectation, and what V(0) predicts.
    pub discounted_objective: f64,
    /// The episode.
    pub episode: EpisodeRecord,
}

/// The MDP's model of the world, with a run seed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulatedWorld {
    params: MdpParams,
    seed: u64,
}

impl SimulatedWorld {
    /// A world with `params` (checked) and run seed `seed`.
    pub fn new(params: MdpParams, seed: u64) -> Result<Self, ParamError> {
        params.validate()?;
        Ok(SimulatedWorld { params, seed })
    }

    /// The parameters.
    pub fn params(&self) -> &MdpParams {
        &self.params
    }

    /// The run seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// Runs question `index` with `strategy` through the same poll/record loop a real runner
    /// uses.
    pub fn run_question(
        &self,
        strategy: &Strategy,
        step_cap: u32,
        index: u64,
    ) -> Result<SimulatedQuestion, EpisodeError> {
        let mut coins = ChaCha8Rng::seed_from_u64(derive_seed(self.seed, index, Stream::Retrieval));
        let mut answer = ChaCha8Rng::seed_from_u64(derive_seed(self.seed, index, Stream::Answer));
        let mut episode = Episode::new(
            strategy.clone(),
            &self.params,
            step_cap,
            derive_seed(self.seed, index, Stream::Strategy),
        );
        while let Some(action) = episode.next_action() {
            let outcome = match action {
                Action::Retrieve => Outcome::Retrieved {
                    progress: coins.random::<f64>() < self.params.p_s,
                },
                Action::Reason => Outcome::Reasoned,
                Action::Terminate => Outcome::Terminated,
            };
            episode.record(outcome)?;
        }
        let record = episode.finish()?;
        let expected_accuracy = self.params.sigma(record.final_u);
        let correct = answer.random::<f64>() < expected_accuracy;
        Ok(SimulatedQuestion {
            world: SIMULATION.to_string(),
            index,
            correct,
            expected_accuracy,
            discounted_objective: discounted_return(&self.params, &record, expected_accuracy),
            episode: record,
        })
    }

    /// Runs questions `0..n_questions` with `strategy`.
    pub fn run(
        &self,
        strategy: &Strategy,
        step_cap: u32,
        n_questions: u64,
    ) -> Result<Vec<SimulatedQuestion>, EpisodeError> {
        (0..n_questions)
            .map(|i| self.run_question(strategy, step_cap, i))
            .collect()
    }
}
