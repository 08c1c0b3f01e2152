//! `edit-score merge` and `edit-score report`, and the report summary every command prints.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use fleet_cli::outln;
use fleet_judge::records::{merge_shards, MergeOptions};
use fleet_judge::report::Report;

#[derive(Args, Debug)]
pub struct MergeArgs {
    /// The merged run's directory (scores.jsonl, run.json and the report).
    #[arg(
        long = "output-dir",
        visible_alias = "output",
        alias = "out",
        value_name = "DIR"
    )]
    pub output: PathBuf,
    /// The shards' output directories (every shard 0..N of one split, same settings).
    #[arg(required = true, value_name = "SHARD_DIR")]
    pub shards: Vec<PathBuf>,
    /// Merge even when a shard has calls without a record (they count as not scored).
    #[arg(long)]
    pub allow_incomplete: bool,
    /// Replace an earlier merge in --output-dir.
    #[arg(long)]
    pub overwrite: bool,
}

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// A run's or a merge's output directory (run.json and scores.jsonl).
    #[arg(value_name = "DIR")]
    pub dir: PathBuf,
}

/// `edit-score merge`.
pub fn merge(args: &MergeArgs) -> Result<()> {
    let outcome = merge_shards(
        &args.shards,
        &args.output,
        MergeOptions {
            overwrite: args.overwrite,
            allow_incomplete: args.allow_incomplete,
        },
    )
    .with_context(|| format!("merging {} shard(s)", args.shards.len()))?;
    let r = &outcome.report;
    eprintln!(
        "merged {} shard(s): {} record(s) written, {} duplicate(s), {} malformed line(s), {} \
         index(es) missing",
        args.shards.len(),
        r.records_written,
        r.duplicates.len(),
        r.malformed.len(),
        r.missing_count
    );
    let report = Report::from_dir(&args.output, &fleet_runs::commit_id())?;
    let written = report.write(&args.output)?;
    print_report(&report)?;
    outln!("results in {}:", args.output.display())?;
    for p in written {
        outln!("  {}", p.display())?;
    }
    Ok(())
}

/// `edit-score report`.
pub fn report(args: &ReportArgs) -> Result<()> {
    let report = Report::from_dir(&args.dir, &fleet_runs::commit_id())?;
    let written = report.write(&args.dir)?;
    outln!("{}", report.to_markdown())?;
    for p in written {
        eprintln!("wrote {}", p.display());
    }
    Ok(())
}

fn fmt_mean(stats: Option<&fleet_judge::report::Stats>) -> String {
    stats.map_or("-".to_string(), |s| format!("{:.3}", s.mean))
}

/// A few lines: per category the items, the primary metric's mean and the parse failures;
/// then the overall figures.
pub fn print_report(report: &Report) -> Result<()> {
    let primary = report.primary.as_str();
    outln!(
        "{:<28} {:>6} {:>10} {:>13} {:>13} {:>11}",
        "category",
        "items",
        format!("mean {primary}"),
        "parse failed",
        "judge failed",
        "not scored"
    )?;
    for c in &report.categories {
        outln!(
            "{:<28} {:>6} {:>10} {:>13} {:>13} {:>11}",
            c.label,
            c.items,
            fmt_mean(c.stats.get(primary)),
            c.parse_failed,
            c.judge_failed,
            c.not_scored
        )?;
    }
    for o in &report.overall {
        outln!(
            "overall {}: pooled {} (n {}), mean of category means {}",
            o.metric,
            o.pooled
                .as_ref()
                .map_or("-".into(), |s| format!("{:.3}", s.mean)),
            o.pooled.as_ref().map_or(0, |s| s.n),
            o.mean_of_category_means
                .map_or("-".into(), |m| format!("{m:.3}"))
        )?;
    }
    outln!(
        "{} item(s): {} scored, {} with a reply that did not parse (counted, never given a \
         score), {} the judge failed on (--retry-failed judges them again), {} not scored, {} \
         skipped at load",
        report.items,
        report.items_scored,
        report.parse_failed,
        report.judge_failed,
        report.not_scored,
        report.skipped_total
    )?;
    Ok(())
}
