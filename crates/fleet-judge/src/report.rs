//! The report of a run (or of merged shards): per-category statistics, overall figures, the
//! configuration, as `report.json` and `report.md` (written atomically) and a chart
//! (`chart.png`, `chart.svg`).
//!
//! Per item, the metric values come from its records (`scores.jsonl`):
//! - scheme `single`: `score` = X of `Score: X`;
//! - scheme `viescore`: `SC` = min of the `sc` list, `PQ` = min of the `pq` list,
//!   `O` = sqrt(SC x PQ) (VIEScore's `evaluate`, GEdit-Bench's `calculate_statistics.py`).
//!
//! A call whose reply did not parse contributes nothing to any mean: its metric (and `O`,
//! which needs both) is left out for that item, and the item is counted in `parse_failed`.
//! An item with a call the judge failed on (recorded as failed, with the reason: no reply) is
//! counted in `judge_failed`; one with a call that has no record (the run did not finish) in
//! `not_scored`. Per category and metric: n, mean, std, median, min, max. The
//! std is the **population** standard deviation (divide by n), as `np.std` with its default
//! `ddof=0` in the original scorer (`src/evaluation/scorer.py:55`, Thomas-uestc/
//! image_edit_benchmark at 0299191); the median is the middle value, or the mean of the two
//! middle values, as `np.median`. Overall: the pooled statistics over all items (the original
//! scorer's "overall") and the mean of the category means (GEdit-Bench's figure: the mean over
//! its groups). Best and worst category by the mean of the primary metric (`score`, or `O`).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use fleet_dist::ShardSpec;
use fleet_runs::RunsError;
use serde::{Deserialize, Serialize};

use crate::judge::{Decoding, Sampling};
use crate::prompts::{PromptSetId, Scheme};
use crate::records::{read_records, Record, RecordsError, RunInfo, RUN_FILE, SCORES_FILE};

/// The JSON report's file name.
pub const REPORT_JSON: &str = "report.json";
/// The Markdown report's file name.
pub const REPORT_MD: &str = "report.md";
/// The chart (PNG).
pub const CHART_PNG: &str = "chart.png";
/// The chart (SVG).
pub const CHART_SVG: &str = "chart.svg";

/// How the std is computed, stated in every report.
pub const STD_KIND: &str = "population standard deviation (ddof=0), as np.std in the original scorer (src/evaluation/scorer.py:55)";

/// Errors of the report.
#[derive(Debug, thiserror::Error)]
pub enum ReportError {
    /// Reading the run's files.
    #[error(transparent)]
    Records(#[from] RecordsError),
    /// Writing the report atomically.
    #[error(transparent)]
    Runs(#[from] RunsError),
    /// The directory holds no finished run.
    #[error("{dir} has no {file}: run edit-score into it first (or merge the shards into it)")]
    NotARun {
        /// The directory.
        dir: PathBuf,
        /// The file missing.
        file: &'static str,
    },
    /// The chart could not be drawn.
    #[error("cannot draw the chart {path}: {message}")]
    Plot {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
}

/// n, mean, std (population), median, min, max of some values.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stats {
    /// How many values.
    pub n: usize,
    /// Their mean.
    pub mean: f64,
    /// Their population standard deviation (divide by n).
    pub std: f64,
    /// Their median (mean of the two middle values when n is even).
    pub median: f64,
    /// The smallest.
    pub min: f64,
    /// The largest.
    pub max: f64,
}

impl Stats {
    /// The statistics of `values`; `None` when there are none.
    pub fn of(values: &[f64]) -> Option<Stats> {
        if values.is_empty() {
            return None;
        }
        let n = values.len();
        let mean = values.iter().sum::<f64>() / n as f64;
        let var = values.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n as f64;
        let mut sorted = values.to_vec();
        sorted.sort_by(f64::total_cmp);
        let median = if n % 2 == 1 {
            sorted[n / 2]
        } else {
            (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
        };
        Some(Stats {
            n,
            mean,
            std: var.sqrt(),
            median,
            min: sorted[0],
            max: sorted[n - 1],
        })
    }
}

/// One category.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CategoryReport {
    /// The category as loaded.
    pub category: String,
    /// Its display label (`物理 (physical)`).
    pub label: String,
    /// Its chart label (ASCII where the prompt set maps it).
    pub chart_label: String,
    /// Items of the category in the run.
    pub items: usize,
    /// Statistics per metric (absent: no value).
    pub stats: BTreeMap<String, Stats>,
    /// Items whose every call has a record but at least one reply did not parse.
    pub parse_failed: usize,
    /// Parse failures per call.
    pub parse_failed_calls: BTreeMap<String, usize>,
    /// Items with a call that has no record.
    pub not_scored: usize,
    /// Items with a call the judge failed on (recorded as failed; no reply).
    #[serde(default)]
    pub judge_failed: usize,
    /// Calls that were retried after a reply that did not parse.
    pub retried: usize,
}

/// One metric over all items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OverallMetric {
    /// The metric.
    pub metric: String,
    /// Pooled over all items (the original scorer's "overall").
    pub pooled: Option<Stats>,
    /// The mean of the categories' means (GEdit-Bench's figure), over categories with a value.
    pub mean_of_category_means: Option<f64>,
    /// Categories with a value.
    pub categories: usize,
}

/// A category picked out by its mean.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Extreme {
    /// The category.
    pub category: String,
    /// Its label.
    pub label: String,
    /// The mean of the primary metric.
    pub mean: f64,
}

/// What was run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReportConfig {
    /// The prompt set.
    pub prompt_set: PromptSetId,
    /// Its scheme.
    pub scheme: Scheme,
    /// The calls per item.
    pub calls: Vec<String>,
    /// The decoding.
    pub decoding: Decoding,
    /// The decoding in words.
    pub decoding_text: String,
    /// The retry policy.
    pub retry: Option<Sampling>,
    /// Whether edits were resized to their source.
    pub resize_edited_to_source: bool,
    /// transformers' image-processor backend (`None`: not recorded by the run).
    #[serde(default)]
    pub image_backend: Option<String>,
    /// The shard (`0/1` for a whole run or a merge).
    pub shard: ShardSpec,
    /// Items in the whole benchmark.
    pub benchmark_items: usize,
}

/// The report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Report {
    /// The metrics, in order (`score`; or `SC`, `PQ`, `O`).
    pub metrics: Vec<String>,
    /// The metric best/worst are chosen by (`score` or `O`).
    pub primary: String,
    /// Per category, in benchmark order.
    pub categories: Vec<CategoryReport>,
    /// Per metric, over all items.
    pub overall: Vec<OverallMetric>,
    /// The category with the highest mean of the primary metric.
    pub best: Option<Extreme>,
    /// The category with the lowest.
    pub worst: Option<Extreme>,
    /// Items in the run (this shard, or all merged shards).
    pub items: usize,
    /// Items with a value of the primary metric.
    pub items_scored: usize,
    /// Items whose calls all have records but at least one did not parse.
    pub parse_failed: usize,
    /// Items with a call without a record.
    pub not_scored: usize,
    /// Items with a call the judge failed on (recorded as failed; `--retry-failed` judges them
    /// again).
    #[serde(default)]
    pub judge_failed: usize,
    /// Calls retried.
    pub retried: usize,
    /// Benchmark items skipped at load, by kind.
    pub skipped: BTreeMap<String, usize>,
    /// Their total.
    pub skipped_total: usize,
    /// Lines of `scores.jsonl` that did not parse (their calls count as not scored).
    pub unreadable_lines: usize,
    /// How the std is computed.
    pub std_kind: String,
    /// The configuration.
    pub config: ReportConfig,
    /// The judge's model id.
    pub model_id: String,
    /// The commit of the code that made the report.
    pub commit: String,
}

/// The metrics of a scheme, and the primary one.
pub fn metrics_of(scheme: Scheme) -> (Vec<&'static str>, &'static str) {
    match scheme {
        Scheme::Single => (vec!["score"], "score"),
        Scheme::Viescore => (vec!["SC", "PQ", "O"], "O"),
    }
}

/// An item's records, by call.
#[derive(Default)]
struct ItemRecords<'a> {
    category: String,
    calls: BTreeMap<&'a str, &'a Record>,
}

impl Report {
    /// Builds the report from a run's records (`scores.jsonl`) and summary (`run.json`).
    /// Records of calls the run does not have are ignored.
    pub fn build(records: &[Record], info: &RunInfo, commit: &str) -> Report {
        let (metrics, primary) = metrics_of(info.scheme);
        let n_calls = info.calls.len().max(1) as u64;
        let mut sorted: Vec<&Record> = records
            .iter()
            .filter(|r| info.calls.contains(&r.call))
            .collect();
        sorted.sort_by_key(|r| r.index);
        // Items in index order; categories in order of first appearance.
        let mut items: BTreeMap<u64, ItemRecords<'_>> = BTreeMap::new();
        let mut order: Vec<String> = Vec::new();
        for r in &sorted {
            let e = items.entry(r.index / n_calls).or_default();
            e.category = r.category.clone();
            e.calls.insert(r.call.as_str(), r);
            if !order.contains(&r.category) {
                order.push(r.category.clone());
            }
        }
        for c in info.items_by_category.keys() {
            if !order.contains(c) {
                order.push(c.clone());
            }
        }

        let mut values: BTreeMap<&str, BTreeMap<&str, Vec<f64>>> = BTreeMap::new();
        let mut complete: BTreeMap<&str, usize> = BTreeMap::new();
        let mut failed_items: BTreeMap<&str, usize> = BTreeMap::new();
        let mut judge_failed: BTreeMap<&str, usize> = BTreeMap::new();
        let mut failed_calls: BTreeMap<&str, BTreeMap<String, usize>> = BTreeMap::new();
        let mut retried: BTreeMap<&str, usize> = BTreeMap::new();
        let mut seen: BTreeMap<&str, usize> = BTreeMap::new();
        for it in items.values() {
            let cat = it.category.as_str();
            *seen.entry(cat).or_insert(0) += 1;
            let all_recorded = info.calls.iter().all(|c| it.calls.contains_key(c.as_str()));
            let mut any_failed = false;
            let mut any_judge_failed = false;
            for r in it.calls.values() {
                if r.judge_failed() {
                    any_judge_failed = true;
                } else if !r.parsed() {
                    any_failed = true;
                    *failed_calls
                        .entry(cat)
                        .or_default()
                        .entry(r.call.clone())
                        .or_insert(0) += 1;
                }
                if r.retry.is_some() {
                    *retried.entry(cat).or_insert(0) += 1;
                }
            }
            if all_recorded {
                *complete.entry(cat).or_insert(0) += 1;
                if any_judge_failed {
                    *judge_failed.entry(cat).or_insert(0) += 1;
                } else if any_failed {
                    *failed_items.entry(cat).or_insert(0) += 1;
                }
            }
            let value = |call: &str| {
                it.calls
                    .get(call)
                    .filter(|r| r.parsed())
                    .and_then(|r| r.score)
            };
            let v = values.entry(cat).or_default();
            match info.scheme {
                Scheme::Single => {
                    if let Some(x) = value("score") {
                        v.entry("score").or_default().push(x);
                    }
                }
                Scheme::Viescore => {
                    let (sc, pq) = (value("sc"), value("pq"));
                    if let Some(x) = sc {
                        v.entry("SC").or_default().push(x);
                    }
                    if let Some(x) = pq {
                        v.entry("PQ").or_default().push(x);
                    }
                    if let (Some(a), Some(b)) = (sc, pq) {
                        v.entry("O").or_default().push((a * b).sqrt());
                    }
                }
            }
        }

        let mut categories = Vec::new();
        for c in &order {
            let cat = c.as_str();
            let n_items = info
                .items_by_category
                .get(c)
                .copied()
                .unwrap_or(0)
                .max(seen.get(cat).copied().unwrap_or(0));
            let stats = metrics
                .iter()
                .filter_map(|m| {
                    values
                        .get(cat)
                        .and_then(|v| v.get(m))
                        .and_then(|v| Stats::of(v))
                        .map(|s| (m.to_string(), s))
                })
                .collect();
            categories.push(CategoryReport {
                category: c.clone(),
                label: info
                    .category_labels
                    .get(c)
                    .cloned()
                    .unwrap_or_else(|| c.clone()),
                chart_label: info
                    .chart_labels
                    .get(c)
                    .cloned()
                    .unwrap_or_else(|| c.clone()),
                items: n_items,
                stats,
                parse_failed: failed_items.get(cat).copied().unwrap_or(0),
                parse_failed_calls: failed_calls.get(cat).cloned().unwrap_or_default(),
                not_scored: n_items - complete.get(cat).copied().unwrap_or(0).min(n_items),
                judge_failed: judge_failed.get(cat).copied().unwrap_or(0),
                retried: retried.get(cat).copied().unwrap_or(0),
            });
        }

        let overall = metrics
            .iter()
            .map(|m| {
                let pooled: Vec<f64> = order
                    .iter()
                    .filter_map(|c| values.get(c.as_str()).and_then(|v| v.get(m)))
                    .flatten()
                    .copied()
                    .collect();
                let means: Vec<f64> = categories
                    .iter()
                    .filter_map(|c| c.stats.get(*m).map(|s| s.mean))
                    .collect();
                OverallMetric {
                    metric: m.to_string(),
                    pooled: Stats::of(&pooled),
                    mean_of_category_means: (!means.is_empty())
                        .then(|| means.iter().sum::<f64>() / means.len() as f64),
                    categories: means.len(),
                }
            })
            .collect();

        let mut best: Option<Extreme> = None;
        let mut worst: Option<Extreme> = None;
        for c in &categories {
            if let Some(s) = c.stats.get(primary) {
                let e = Extreme {
                    category: c.category.clone(),
                    label: c.label.clone(),
                    mean: s.mean,
                };
                if best.as_ref().is_none_or(|b| s.mean > b.mean) {
                    best = Some(e.clone());
                }
                if worst.as_ref().is_none_or(|w| s.mean < w.mean) {
                    worst = Some(e);
                }
            }
        }

        let items_scored = categories
            .iter()
            .filter_map(|c| c.stats.get(primary).map(|s| s.n))
            .sum();
        let skipped_total = info.skipped.values().sum();
        Report {
            metrics: metrics.iter().map(|m| m.to_string()).collect(),
            primary: primary.to_string(),
            items: categories.iter().map(|c| c.items).sum(),
            items_scored,
            parse_failed: categories.iter().map(|c| c.parse_failed).sum(),
            not_scored: categories.iter().map(|c| c.not_scored).sum(),
            judge_failed: categories.iter().map(|c| c.judge_failed).sum(),
            retried: categories.iter().map(|c| c.retried).sum(),
            categories,
            overall,
            best,
            worst,
            skipped: info.skipped.clone(),
            skipped_total,
            unreadable_lines: 0,
            std_kind: STD_KIND.to_string(),
            config: ReportConfig {
                prompt_set: info.prompt_set.clone(),
                scheme: info.scheme,
                calls: info.calls.clone(),
                decoding: info.decoding,
                decoding_text: info.decoding.describe(),
                retry: info.retry,
                resize_edited_to_source: info.resize_edited_to_source,
                image_backend: info.image_backend.clone(),
                shard: info.shard,
                benchmark_items: info.benchmark_items,
            },
            model_id: info.model_id.clone(),
            commit: commit.to_string(),
        }
    }

    /// Builds the report of an output directory (a run's or a merge's): its `run.json` and
    /// `scores.jsonl`.
    pub fn from_dir(dir: &Path, commit: &str) -> Result<Report, ReportError> {
        for file in [RUN_FILE, SCORES_FILE] {
            if !dir.join(file).is_file() {
                return Err(ReportError::NotARun {
                    dir: dir.to_path_buf(),
                    file,
                });
            }
        }
        let info = RunInfo::read(&dir.join(RUN_FILE))?;
        let (records, bad) = read_records(&dir.join(SCORES_FILE))?;
        let mut report = Report::build(&records, &info, commit);
        report.unreadable_lines = bad.len();
        Ok(report)
    }

    /// The metric's statistics over all items.
    pub fn overall(&self, metric: &str) -> Option<&OverallMetric> {
        self.overall.iter().find(|o| o.metric == metric)
    }

    /// The category's report.
    pub fn category(&self, category: &str) -> Option<&CategoryReport> {
        self.categories.iter().find(|c| c.category == category)
    }

    /// The report as Markdown.
    pub fn to_markdown(&self) -> String {
        let mut s = String::new();
        let c = &self.config;
        let _ = writeln!(
            s,
            "# edit-score: {} v{} ({})\n",
            c.prompt_set.name, c.prompt_set.version, c.scheme
        );
        let _ = writeln!(s, "- model: `{}`", self.model_id);
        let _ = writeln!(
            s,
            "- prompt set: `{}` v{}, hash `{}`",
            c.prompt_set.name, c.prompt_set.version, c.prompt_set.hash
        );
        let _ = writeln!(s, "- decoding: {}", c.decoding_text);
        match &c.retry {
            Some(r) => {
                let _ = writeln!(
                    s,
                    "- retry of a reply that does not parse: once, sampled (temperature={}, top_p={}, top_k={}, seed={})",
                    r.temperature,
                    r.top_p.map_or("off".to_string(), |p| p.to_string()),
                    r.top_k.map_or("off".to_string(), |k| k.to_string()),
                    r.seed
                );
            }
            None => {
                let _ = writeln!(s, "- retry of a reply that does not parse: none");
            }
        }
        if c.resize_edited_to_source {
            let _ = writeln!(
                s,
                "- edited images resized to the source size (bicubic), as GEdit-Bench's scorer does"
            );
        }
        if let Some(b) = &c.image_backend {
            let _ = writeln!(
                s,
                "- images prepared as transformers' `{b}` image-processor backend does"
            );
        }
        let _ = writeln!(s, "- commit: `{}`", self.commit);
        let _ = writeln!(
            s,
            "- items: {} in this report ({}; benchmark of {}), {} with a value of {}, {} with a reply that did not parse (left out of the means), {} the judge failed on (recorded with the reason; `--retry-failed` judges them again), {} not scored; {} call(s) retried",
            self.items,
            if c.shard.is_single() {
                "whole run".to_string()
            } else {
                c.shard.to_string()
            },
            c.benchmark_items,
            self.items_scored,
            self.primary,
            self.parse_failed,
            self.judge_failed,
            self.not_scored,
            self.retried
        );
        let skipped = if self.skipped.is_empty() {
            "none".to_string()
        } else {
            self.skipped
                .iter()
                .map(|(k, n)| format!("{n} {k}"))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            s,
            "- benchmark items skipped at load: {} ({skipped})",
            self.skipped_total
        );
        if self.unreadable_lines > 0 {
            let _ = writeln!(
                s,
                "- {} unreadable line(s) in scores.jsonl (their calls count as not scored)",
                self.unreadable_lines
            );
        }
        let _ = writeln!(s, "- std: {}\n", self.std_kind);

        let f = |x: f64| format!("{x:.3}");
        let _ = writeln!(s, "## Per category\n");
        match c.scheme {
            Scheme::Single => {
                let _ = writeln!(
                    s,
                    "| category | n | mean | std | median | min | max | parse failures | not scored | judge failed |"
                );
                let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
                for cat in &self.categories {
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {} |",
                        cat.label,
                        stats_cells(cat.stats.get("score")),
                        cat.parse_failed,
                        cat.not_scored,
                        cat.judge_failed
                    );
                }
            }
            Scheme::Viescore => {
                let _ = writeln!(
                    s,
                    "| category | n (O) | SC mean | SC std | PQ mean | PQ std | O mean | O std | O median | O min | O max | parse failures (sc/pq) | not scored | judge failed |"
                );
                let _ = writeln!(
                    s,
                    "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
                );
                for cat in &self.categories {
                    let get = |m: &str, g: fn(&Stats) -> f64| {
                        cat.stats.get(m).map_or("—".to_string(), |s| f(g(s)))
                    };
                    let pf = |call: &str| cat.parse_failed_calls.get(call).copied().unwrap_or(0);
                    let _ = writeln!(
                        s,
                        "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({}/{}) | {} | {} |",
                        cat.label,
                        cat.stats.get("O").map_or(0, |s| s.n),
                        get("SC", |s| s.mean),
                        get("SC", |s| s.std),
                        get("PQ", |s| s.mean),
                        get("PQ", |s| s.std),
                        get("O", |s| s.mean),
                        get("O", |s| s.std),
                        get("O", |s| s.median),
                        get("O", |s| s.min),
                        get("O", |s| s.max),
                        cat.parse_failed,
                        pf("sc"),
                        pf("pq"),
                        cat.not_scored,
                        cat.judge_failed
                    );
                }
            }
        }
        let _ = writeln!(s, "\n## Overall\n");
        let _ = writeln!(
            s,
            "| metric | n | pooled mean | pooled std | median | min | max | mean of category means ({} categories) |",
            self.overall.first().map_or(0, |o| o.categories)
        );
        let _ = writeln!(s, "|---|---:|---:|---:|---:|---:|---:|---:|");
        for o in &self.overall {
            let _ = writeln!(
                s,
                "| {} | {} | {} |",
                o.metric,
                stats_cells(o.pooled.as_ref()),
                o.mean_of_category_means.map_or("—".to_string(), f)
            );
        }
        let _ = writeln!(s);
        match (&self.best, &self.worst) {
            (Some(b), Some(w)) => {
                let _ = writeln!(
                    s,
                    "Best category by mean {}: **{}** ({}); worst: **{}** ({}).",
                    self.primary,
                    b.label,
                    f(b.mean),
                    w.label,
                    f(w.mean)
                );
            }
            _ => {
                let _ = writeln!(s, "No category has a {} value yet.", self.primary);
            }
        }
        let _ = writeln!(
            s,
            "\nChart: `{CHART_PNG}` / `{CHART_SVG}` (bars: mean per category; whiskers: ±1 std; n: items with a value)."
        );
        s
    }

    /// Writes `report.json`, `report.md`, `chart.png` and `chart.svg` into `dir`, each
    /// atomically; returns the paths.
    pub fn write(&self, dir: &Path) -> Result<Vec<PathBuf>, ReportError> {
        let json = dir.join(REPORT_JSON);
        let md = dir.join(REPORT_MD);
        fleet_runs::write_json_atomic(&json, self)?;
        fleet_runs::write_atomic(&md, self.to_markdown().as_bytes())?;
        let mut out = vec![json, md];
        out.extend(crate::chart::write_chart(dir, self)?);
        Ok(out)
    }
}

/// The `n | mean | std | median | min | max` cells of a Markdown row (dashes without values).
fn stats_cells(st: Option<&Stats>) -> String {
    match st {
        None => "0 | — | — | — | — | —".to_string(),
        Some(s) => format!(
            "{} | {:.3} | {:.3} | {:.3} | {:.3} | {:.3}",
            s.n, s.mean, s.std, s.median, s.min, s.max
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stats_match_numpy() {
        // np.mean / np.std (ddof=0) / np.median of [2, 4, 4, 4, 5, 5, 7, 9]: 5, 2, 4.5.
        let s = Stats::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]).unwrap();
        assert_eq!(s.n, 8);
        assert_eq!(s.mean, 5.0);
        assert_eq!(s.std, 2.0);
        assert_eq!(s.median, 4.5);
        assert_eq!((s.min, s.max), (2.0, 9.0));
        let s = Stats::of(&[3.0, 1.0, 2.0]).unwrap();
        assert_eq!(s.median, 2.0);
        assert!(Stats::of(&[]).is_none());
        let one = Stats::of(&[7.5]).unwrap();
        assert_eq!((one.std, one.median), (0.0, 7.5));
    }
}
