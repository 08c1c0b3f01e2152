//! argo-exp: ARGO experiments.
//!
//! With no subcommand it runs the simulated cost sweep with the embedded defaults
//! (`configs/argo.toml`), prints the comparison table and writes the summary, records and
//! plots under `results/argo/simulation/`. `solve` prints the optimal policy and thresholds of
//! one MDP. Flags override the TOML config.

mod real;

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand, ValueEnum};
use fleet_argo::mdp::{self, one_step_lookahead_threshold};
use fleet_argo::params::Quality;
use fleet_argo::summary::commit_id;
use fleet_argo::sweep::{self, render_table, write_outputs, SweepSummary};
use fleet_argo::{ExperimentConfig, Mode, StrategyKind, SIMULATION};
use fleet_cli::{out, outln};

#[derive(Parser, Debug)]
#[command(
    name = "argo-exp",
    version = fleet_cli::VERSION,
    about = "ARGO experiments: solve the MDP, simulate strategies, sweep the retrieval cost",
    long_about = "ARGO experiments. With no subcommand: the simulated cost sweep with the \
                  default parameters (the MDP's own model; no weights, no GPU).",
)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    logical: fleet_cli::LogicalGpusArg,
    /// Flags of the default run (the simulated cost sweep).
    #[command(flatten)]
    sweep: SweepArgs,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Chunk and embed documents into the retrieval index (new and changed files only).
    Ingest(real::IngestArgs),
    /// Show the index's best chunks for a text.
    Query(real::QueryArgs),
    /// One strategy answering real questions with a real model (`--strategy`).
    Run(RunArgs),
    /// Every strategy of the config on the same real questions (`--sweep`: over the c_r
    /// points too).
    Compare(CompareArgs),
    /// Solve the MDP by value iteration; print the policy table, theta* and theta_cont.
    Solve(SolveArgs),
    /// Simulated cost sweep: c_r over a grid x strategies (the default command).
    Sweep(SweepArgs),
    /// Simulate every strategy at the single cost mdp.c_r.
    Simulate(SweepArgs),
}

/// Flags of `run`.
#[derive(Args, Debug)]
struct RunArgs {
    /// argo, always-retrieve, always-reason, random:P or fixed-k:K.
    #[arg(long)]
    strategy: StrategyKind,
    #[command(flatten)]
    real: real::RealArgs,
}

/// Flags of `compare`.
#[derive(Args, Debug)]
struct CompareArgs {
    /// Strategies (default: the config's list).
    #[arg(long, value_delimiter = ',')]
    strategies: Option<Vec<StrategyKind>>,
    /// Over the config's c_r points (Graph 1 data) instead of its single mdp.c_r.
    #[arg(long)]
    sweep: bool,
    #[command(flatten)]
    real: real::RealArgs,
}

#[derive(ValueEnum, Debug, Clone, Copy)]
enum ModeArg {
    Small,
    Medium,
    Full,
}

impl From<ModeArg> for Mode {
    fn from(m: ModeArg) -> Mode {
        match m {
            ModeArg::Small => Mode::Small,
            ModeArg::Medium => Mode::Medium,
            ModeArg::Full => Mode::Full,
        }
    }
}

/// Overrides of the MDP and solver sections.
#[derive(Args, Debug, Clone, Default)]
struct MdpArgs {
    /// TOML config (default: the embedded configs/argo.toml values).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Progress of a successful Retrieve.
    #[arg(long, allow_negative_numbers = true)]
    delta_r: Option<f64>,
    /// Progress of a Reason.
    #[arg(long, allow_negative_numbers = true)]
    delta_p: Option<f64>,
    /// Probability that a Retrieve makes progress.
    #[arg(long, allow_negative_numbers = true)]
    p_s: Option<f64>,
    /// Cost of a Retrieve (solve, simulate).
    #[arg(long, allow_negative_numbers = true)]
    c_r: Option<f64>,
    /// Cost of a Reason.
    #[arg(long, allow_negative_numbers = true)]
    c_p: Option<f64>,
    /// Weight of cost in the objective.
    #[arg(long, allow_negative_numbers = true)]
    mu: Option<f64>,
    /// Discount, in (0, 1].
    #[arg(long, allow_negative_numbers = true)]
    gamma: Option<f64>,
    /// Quality function: linear, sqrt, saturating:ALPHA, sigmoid:K.
    #[arg(long, value_parser = parse_quality)]
    quality: Option<Quality>,
    /// Grid points of the solver.
    #[arg(long)]
    grid_points: Option<usize>,
    /// Value-iteration tolerance.
    #[arg(long, allow_negative_numbers = true)]
    tolerance: Option<f64>,
    /// Value-iteration iteration cap.
    #[arg(long)]
    max_iterations: Option<usize>,
}

/// Flags of the simulated sweep.
#[derive(Args, Debug, Clone, Default)]
struct SweepArgs {
    #[command(flatten)]
    mdp: MdpArgs,
    /// Size preset: small (10 questions, 5 costs), medium (100, 10), full (1000, 10).
    #[arg(long, value_enum)]
    mode: Option<ModeArg>,
    /// Simulated questions per (c_r, strategy); overrides --mode.
    #[arg(long)]
    n_questions: Option<u64>,
    /// Run seed.
    #[arg(long)]
    seed: Option<u64>,
    /// Number of c_r values; overrides --mode.
    #[arg(long)]
    points: Option<usize>,
    /// Smallest c_r of the sweep.
    #[arg(long, allow_negative_numbers = true)]
    c_r_min: Option<f64>,
    /// Largest c_r of the sweep.
    #[arg(long, allow_negative_numbers = true)]
    c_r_max: Option<f64>,
    /// Most Retrieve/Reason steps per question, for every strategy.
    #[arg(long)]
    step_cap: Option<u32>,
    /// Strategies, comma-separated: argo, always-retrieve, always-reason, random:P, fixed-k:K.
    #[arg(long, value_delimiter = ',')]
    strategies: Option<Vec<StrategyKind>>,
    /// Baselines (Always-*, Random) answer once U >= this fraction of u_max.
    #[arg(long, allow_negative_numbers = true)]
    stop_progress: Option<f64>,
    /// Directory for the summary, records and plots.
    #[arg(
        long = "output-dir",
        visible_alias = "out",
        alias = "output",
        default_value = "results/argo/simulation"
    )]
    out: PathBuf,
    /// Skip writing files; print the table only.
    #[arg(long)]
    no_write: bool,
}

/// Flags of `solve`.
#[derive(Args, Debug, Clone)]
struct SolveArgs {
    #[command(flatten)]
    mdp: MdpArgs,
    /// Print every N-th grid point of the policy table (0: only the runs of actions).
    #[arg(long, default_value_t = 5)]
    every: usize,
    /// Print the solution as JSON instead of the table.
    #[arg(long)]
    json: bool,
}

fn parse_quality(s: &str) -> Result<Quality, String> {
    let (name, arg) = match s.split_once(':') {
        Some((n, a)) => (n.trim(), Some(a.trim())),
        None => (s.trim(), None),
    };
    let number = |a: Option<&str>, default: f64| -> Result<f64, String> {
        a.map(|a| {
            a.parse::<f64>()
                .map_err(|_| format!("`{a}` is not a number"))
        })
        .unwrap_or(Ok(default))
    };
    match name {
        "linear" => Ok(Quality::Linear),
        "sqrt" => Ok(Quality::Sqrt),
        "saturating" => Ok(Quality::Saturating {
            alpha: number(arg, 3.0)?,
        }),
        "sigmoid" => Ok(Quality::Sigmoid {
            k: number(arg, 10.0)?,
        }),
        _ => Err(format!(
            "unknown quality `{s}`: expected linear, sqrt, saturating:ALPHA or sigmoid:K"
        )),
    }
}

fn load_config(args: &MdpArgs) -> Result<ExperimentConfig> {
    let mut cfg = match &args.config {
        Some(path) => ExperimentConfig::from_file(path)?,
        None => ExperimentConfig::default(),
    };
    let m = &mut cfg.mdp;
    let overrides = [
        (&mut m.delta_r, args.delta_r),
        (&mut m.delta_p, args.delta_p),
        (&mut m.p_s, args.p_s),
        (&mut m.c_r, args.c_r),
        (&mut m.c_p, args.c_p),
        (&mut m.mu, args.mu),
        (&mut m.gamma, args.gamma),
    ];
    for (field, value) in overrides {
        if let Some(v) = value {
            *field = v;
        }
    }
    if let Some(q) = args.quality {
        m.quality = q;
    }
    if let Some(g) = args.grid_points {
        cfg.solver.grid_points = g;
    }
    if let Some(t) = args.tolerance {
        cfg.solver.tolerance = t;
    }
    if let Some(n) = args.max_iterations {
        cfg.solver.max_iterations = n;
    }
    Ok(cfg)
}

fn sweep_config(args: &SweepArgs) -> Result<ExperimentConfig> {
    let mut cfg = load_config(&args.mdp)?;
    if let Some(mode) = args.mode {
        cfg.apply_mode(mode.into());
    }
    let s = &mut cfg.sweep;
    if let Some(n) = args.n_questions {
        s.n_questions = n;
    }
    if let Some(seed) = args.seed {
        s.seed = seed;
    }
    if let Some(p) = args.points {
        s.points = p;
    }
    if let Some(c) = args.c_r_min {
        s.c_r_min = c;
    }
    if let Some(c) = args.c_r_max {
        s.c_r_max = c;
    }
    if let Some(cap) = args.step_cap {
        cfg.episode.step_cap = cap;
    }
    if let Some(list) = &args.strategies {
        cfg.strategies.list = list.clone();
    }
    if let Some(stop) = args.stop_progress {
        cfg.strategies.stop_progress = stop;
    }
    cfg.validate()?;
    Ok(cfg)
}

fn run_sweep(args: &SweepArgs, single_point: bool) -> Result<()> {
    let mut cfg = sweep_config(args)?;
    if single_point {
        cfg.sweep.points = 1;
        cfg.sweep.c_r_min = cfg.mdp.c_r;
        cfg.sweep.c_r_max = cfg.mdp.c_r;
        cfg.validate()?;
    }
    let started = Instant::now();
    let result = sweep::run_sweep(&cfg)?;
    let elapsed = started.elapsed().as_secs_f64();
    out!("{}", render_table(&result))?;
    outln!(
        "\n[{SIMULATION}] {} cost points x {} strategies x {} questions in {elapsed:.3} s (seed {})",
        result.points.len(),
        cfg.strategies.list.len(),
        cfg.sweep.n_questions,
        cfg.sweep.seed
    )?;
    for p in &result.points {
        if let Some(v) = &p.policy.violation {
            outln!(
                "[{SIMULATION}] note: at c_r = {:.4} the optimal policy is not two-threshold: {v}",
                p.c_r
            )?;
        }
    }
    if args.no_write {
        return Ok(());
    }
    let summary = SweepSummary::new(&result, &cfg, commit_id(), elapsed);
    let written = write_outputs(&args.out, &result, &summary)
        .with_context(|| format!("writing results under {}", args.out.display()))?;
    outln!("[{SIMULATION}] wrote:")?;
    for path in written {
        outln!("  {}", path.display())?;
    }
    Ok(())
}

fn solve(args: &SolveArgs) -> Result<()> {
    let cfg = load_config(&args.mdp)?;
    let solution = mdp::solve(&cfg.mdp, &cfg.solver)?;
    if args.json {
        let value = serde_json::json!({
            "params": cfg.mdp,
            "solver": cfg.solver,
            "summary": solution.summary(),
            "grid": (0..solution.grid.points).map(|i| solution.grid.u(i)).collect::<Vec<_>>(),
            "values": solution.values,
            "q": solution.q,
            "actions": solution.actions,
        });
        outln!("{}", serde_json::to_string_pretty(&value)?)?;
        return Ok(());
    }
    let m = &cfg.mdp;
    outln!(
        "MDP: u_max {} delta_r {} delta_p {} p_s {} c_r {} c_p {} mu {} gamma {} | {}",
        m.u_max,
        m.delta_r,
        m.delta_p,
        m.p_s,
        m.c_r,
        m.c_p,
        m.mu,
        m.gamma,
        m.quality.describe()
    )?;
    outln!(
        "value iteration: {} grid points, {} iterations, residual {:.2e} (tolerance {:.0e})",
        solution.grid.points,
        solution.iterations,
        solution.residual,
        cfg.solver.tolerance
    )?;
    outln!()?;
    if args.every > 0 {
        outln!(
            "{:>7}  {:>9}  {:>11}  {:>11}  {:>13}  action",
            "U",
            "V",
            "Q(Retrieve)",
            "Q(Reason)",
            "Q(Terminate)"
        )?;
        let last = solution.grid.points - 1;
        for i in (0..=last).filter(|&i| i % args.every == 0 || i == last) {
            let q = solution.q[i];
            outln!(
                "{:>7.4}  {:>9.5}  {:>11.5}  {:>11.5}  {:>13.5}  {}",
                solution.grid.u(i),
                solution.values[i],
                q.retrieve,
                q.reason,
                q.terminate,
                solution.actions[i]
            )?;
        }
        outln!()?;
    }
    outln!("policy: {}", solution.structure.describe())?;
    outln!("theta_cont = {:.4}", solution.theta_cont)?;
    outln!("theta*     = {:.4}", solution.theta_star)?;
    if m.quality.is_concave() {
        outln!(
            "one-step-lookahead stopping threshold = {:.4} (optimal for concave sigma)",
            one_step_lookahead_threshold(m, solution.grid.points)
        )?;
    } else {
        outln!(
            "one-step-lookahead stopping threshold = {:.4} (sigma is not concave: this rule \
             need not be optimal)",
            one_step_lookahead_threshold(m, solution.grid.points)
        )?;
    }
    match &solution.structure.violation {
        None => outln!("two-threshold form: yes")?,
        Some(v) => outln!("two-threshold form: NO: {v}")?,
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    // A replica worker started by this program's own data-parallel path serves and exits here.
    fleet_serve::serve_if_replica_worker();
    fleet_cli::init();
    let cli: Cli = fleet_cli::parse_default_command_cli();
    if let Err(e) = cli.logical.install() {
        return fleet_cli::exit(Err(e));
    }
    // Results go to stdout through fleet_cli's `out!`/`outln!`: `argo-exp | head` ends quietly.
    fleet_cli::exit(run(&cli))
}

fn run(cli: &Cli) -> Result<()> {
    match &cli.command {
        None => run_sweep(&cli.sweep, false),
        Some(Command::Sweep(args)) => run_sweep(args, false),
        Some(Command::Simulate(args)) => run_sweep(args, true),
        Some(Command::Solve(args)) => solve(args),
        Some(Command::Ingest(args)) => real::ingest(args),
        Some(Command::Query(args)) => real::query(args),
        Some(Command::Run(args)) => real::run_real(
            &args.real,
            real::Plan {
                strategies: Some(vec![args.strategy]),
                sweep: false,
            },
        ),
        Some(Command::Compare(args)) => real::run_real(
            &args.real,
            real::Plan {
                strategies: args.strategies.clone(),
                sweep: args.sweep,
            },
        ),
    }
}
