//! GSPO reinforcement-learning fine-tuning of Qwen LLMs (arXiv 2507.18071), with TRL's
//! GRPOTrainer (`importance_sampling_level="sequence"`, `loss_type="grpo"`) and verl's `gspo`
//! policy loss as the reference behaviour.

#![warn(missing_docs)]

pub mod advantage;
pub mod config;
pub mod dataset;
pub mod loss;
pub mod optim;
pub mod rewards;
