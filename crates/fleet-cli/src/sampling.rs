//! The sampling flags, spelled and checked the same way by every binary.

use fleet_models::SamplingParams;

/// `--temperature`, `--top-k`, `--top-p`, `--min-p`, `--repetition-penalty` (transformers'
/// `generate` names and conventions),
/// checked by [`SamplingParams::from_flags`]: the same values are accepted, turned off or
/// refused everywhere. Negative numbers reach the check (and its message) instead of being
/// taken for flags.
#[derive(clap::Args, Debug, Clone, Default, PartialEq)]
pub struct SamplingArgs {
    /// Softmax temperature, >= 0 (0 = greedy).
    #[arg(long, allow_negative_numbers = true)]
    pub temperature: Option<f64>,
    /// Keep only the k most likely tokens; 0 turns the filter off (as in transformers).
    #[arg(long, allow_negative_numbers = true)]
    pub top_k: Option<i64>,
    /// Keep the smallest set of tokens whose probability reaches p, in (0, 1]; 1 turns it off.
    #[arg(long, allow_negative_numbers = true)]
    pub top_p: Option<f64>,
    /// Keep the tokens at least min-p times as likely as the most likely one, in [0, 1]; 0
    /// turns it off.
    #[arg(long, allow_negative_numbers = true)]
    pub min_p: Option<f64>,
    /// transformers' repetition penalty on the prompt's and the reply's tokens, > 0; 1 turns it
    /// off (greedy decoding is penalised too).
    #[arg(long, allow_negative_numbers = true)]
    pub repetition_penalty: Option<f64>,
}

impl SamplingArgs {
    /// Whether any of the flags was given.
    pub fn any(&self) -> bool {
        self.temperature.is_some()
            || self.top_k.is_some()
            || self.top_p.is_some()
            || self.min_p.is_some()
            || self.repetition_penalty.is_some()
    }

    /// The checked settings: `default_temperature` where `--temperature` is absent, the
    /// filters that are off as `None`.
    pub fn params(&self, default_temperature: f64, seed: u64) -> anyhow::Result<SamplingParams> {
        Ok(SamplingParams::from_flags(
            self.temperature.unwrap_or(default_temperature),
            self.top_k,
            self.top_p,
            self.min_p,
            self.repetition_penalty,
            seed,
        )?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        sampling: SamplingArgs,
    }

    #[test]
    fn negative_values_get_the_real_error() {
        let cli = Cli::try_parse_from(["x", "--temperature", "-1"]).unwrap();
        let e = cli.sampling.params(0.0, 0).unwrap_err().to_string();
        assert!(e.contains("--temperature -1") && e.contains(">= 0"), "{e}");
        let cli = Cli::try_parse_from(["x", "--top-k", "-3"]).unwrap();
        assert!(cli.sampling.params(1.0, 0).is_err());
    }

    #[test]
    fn zero_top_k_and_unit_top_p_turn_the_filters_off() {
        let cli = Cli::try_parse_from(["x", "--top-k", "0", "--top-p", "1"]).unwrap();
        let p = cli.sampling.params(0.7, 5).unwrap();
        assert_eq!(
            (p.top_k, p.top_p, p.temperature, p.seed),
            (None, None, 0.7, 5)
        );
        let cli = Cli::try_parse_from(["x", "--top-p", "2"]).unwrap();
        let e = cli.sampling.params(1.0, 0).unwrap_err().to_string();
        assert!(e.contains("--top-p 2"), "{e}");
    }
}
