//! Plots of the cost sweep (Graphs 1.A-1.C), PNG and SVG, drawn by fleet-plot: ARGO's colours,
//! line styles and series.

use std::path::{Path, PathBuf};

pub use fleet_plot::{
    format_tick, tick_count, wrap_label, write_chart, LineChart, LineStyle, Marker, MarkerShape,
    RGBColor, Series, MAX_MARKERS,
};
#[cfg(test)]
use fleet_plot::{integer_range, LEGEND_CHARS, LEGEND_SAMPLE, LEGEND_WIDTH, MAX_TICKS, SIZE};

use crate::simulate::SIMULATION;
use crate::strategy::StrategyKind;
use crate::summary::OutputError;
use crate::sweep::{ExperimentConfig, SweepResult};

fn color_for(kind: StrategyKind, i: usize) -> RGBColor {
    match kind {
        StrategyKind::Argo => RGBColor(0x2E, 0x86, 0xAB),
        StrategyKind::AlwaysRetrieve => RGBColor(0xA2, 0x3B, 0x72),
        StrategyKind::AlwaysReason => RGBColor(0xF1, 0x8F, 0x01),
        StrategyKind::Random { .. } => RGBColor(0x6A, 0x99, 0x4E),
        StrategyKind::FixedK { .. } => {
            let fixed = [
                RGBColor(0xC7, 0x3E, 0x1D),
                RGBColor(0x55, 0x55, 0x55),
                RGBColor(0x8E, 0x6C, 0x8A),
            ];
            fixed[i % fixed.len()]
        }
    }
}

/// Line and marker of the `i`-th strategy of a sweep chart. ARGO: solid, thick, filled
/// circles. The others, in drawing order: each its own marker shape, drawn as an outline that
/// shrinks from one series to the next, and a dashed line that thins and changes its dash, so
/// that two strategies with identical results (Always-Retrieve and a Fixed-K with K at the step
/// limit) both stay visible, the later drawn inside the earlier, without moving any point.
pub fn strategy_style(i: usize, argo: bool) -> (LineStyle, Marker) {
    if argo {
        return (
            LineStyle::solid(3),
            Marker {
                shape: MarkerShape::Circle,
                size: 5,
                filled: true,
            },
        );
    }
    const DASHES: [(u32, u32); 4] = [(12, 4), (7, 4), (3, 3), (14, 3)];
    let width = 3u32.saturating_sub(i as u32 / 2).max(1);
    let shapes = &MarkerShape::ALL[1..];
    (
        LineStyle::dashed(
            width,
            DASHES[i % DASHES.len()].0,
            DASHES[i % DASHES.len()].1,
        ),
        Marker {
            shape: shapes[i % shapes.len()],
            size: 9u32.saturating_sub(i as u32).max(4),
            filled: false,
        },
    )
}

/// The plot files' stems.
pub mod stems {
    /// Graph 1.A: accuracy vs c_r.
    pub const ACCURACY_VS_C_R: &str = "simulation_graph1a_accuracy_vs_c_r";
    /// Graph 1.B: retrieval calls vs c_r.
    pub const RETRIEVALS_VS_C_R: &str = "simulation_graph1b_retrievals_vs_c_r";
    /// Graph 1.C: accuracy vs mean cost per question.
    pub const ACCURACY_VS_COST: &str = "simulation_graph1c_accuracy_vs_cost";
}

/// Graph 1.C's series: each strategy's points (one per c_r, in c_r order) sorted by cost, so
/// that the line runs left to right instead of doubling back where a larger c_r costs less.
pub fn by_cost(mut series: Vec<Series>) -> Vec<Series> {
    for s in &mut series {
        s.sort_by_x();
    }
    series
}

/// Draws Graph 1.A (accuracy vs c_r, Wilson 95% bars), Graph 1.B (retrieval calls vs c_r) and
/// Graph 1.C (accuracy vs mean cost per question), each as PNG and SVG, into `dir`.
pub fn plot_sweep(
    dir: &Path,
    result: &SweepResult,
    config: &ExperimentConfig,
) -> Result<Vec<PathBuf>, OutputError> {
    let m = &config.mdp;
    let subtitle = format!(
        "{SIMULATION}: the MDP's own model, not real questions | {} questions per point, seed {}\n\
         delta_r {} delta_p {} p_s {} c_p {} mu {} gamma {} | {}",
        config.sweep.n_questions,
        config.sweep.seed,
        m.delta_r,
        m.delta_p,
        m.p_s,
        m.c_p,
        m.mu,
        m.gamma,
        m.quality.describe()
    );
    let kinds: Vec<StrategyKind> = result
        .points
        .first()
        .map(|p| p.results.iter().map(|s| s.strategy).collect())
        .unwrap_or_default();
    let series_of = |f: &dyn Fn(f64, &crate::summary::StrategySummary) -> (f64, f64),
                     with_ci: bool| {
        kinds
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let rows: Vec<_> = result
                    .points
                    .iter()
                    .filter_map(|p| {
                        p.results
                            .iter()
                            .find(|s| s.strategy == kind)
                            .map(|s| (p.c_r, s))
                    })
                    .collect();
                let (line, marker) = strategy_style(i, kind == StrategyKind::Argo);
                Series {
                    label: kind.label(),
                    color: color_for(kind, i),
                    line,
                    marker: Some(marker),
                    points: rows.iter().map(|&(c, s)| f(c, s)).collect(),
                    intervals: with_ci.then(|| {
                        rows.iter()
                            .map(|(_, s)| (s.accuracy_ci95[0], s.accuracy_ci95[1]))
                            .collect()
                    }),
                }
            })
            .collect::<Vec<_>>()
    };
    let mut written = Vec::new();
    let accuracy = LineChart {
        title: format!("Graph 1.A [{SIMULATION}]: accuracy vs retrieval cost"),
        subtitle: subtitle.clone(),
        x_label: "retrieval cost c_r".into(),
        y_label: "accuracy (Wilson 95% CI)".into(),
        series: series_of(&|c, s| (c, s.accuracy), true),
        x_integer: false,
    };
    written.extend(write_chart(dir, stems::ACCURACY_VS_C_R, &accuracy, false)?);
    let retrievals = LineChart {
        title: format!("Graph 1.B [{SIMULATION}]: retrieval calls vs retrieval cost"),
        subtitle: subtitle.clone(),
        x_label: "retrieval cost c_r".into(),
        y_label: "mean retrieval calls per question".into(),
        series: series_of(&|c, s| (c, s.mean_retrievals), false),
        x_integer: false,
    };
    written.extend(write_chart(
        dir,
        stems::RETRIEVALS_VS_C_R,
        &retrievals,
        true,
    )?);
    let frontier = LineChart {
        title: format!("Graph 1.C [{SIMULATION}]: accuracy vs cost (a point per c_r)"),
        subtitle,
        x_label: "mean cost per question (c_r * retrievals + c_p * reasons)".into(),
        y_label: "accuracy (Wilson 95% CI)".into(),
        series: by_cost(series_of(&|_, s| (s.mean_cost, s.accuracy), true)),
        x_integer: false,
    };
    written.extend(write_chart(dir, stems::ACCURACY_VS_COST, &frontier, false)?);
    Ok(written)
}

/// Graphs 1.A (accuracy vs c_r), 1.B (retrieval calls vs c_r) and 1.C (accuracy vs cost) of a
/// real run, PNG and SVG, into `dir` with stems `real_graph1*`; `subtitle` names the model,
/// dataset and sample. Strategies keep the order in which they first appear in `results`.
pub fn plot_real_sweep(
    dir: &Path,
    results: &[crate::runner::RealSummary],
    subtitle: &str,
) -> Result<Vec<PathBuf>, OutputError> {
    let mut kinds: Vec<StrategyKind> = Vec::new();
    for r in results {
        if !kinds.contains(&r.summary.strategy) {
            kinds.push(r.summary.strategy);
        }
    }
    let series_of = |f: &dyn Fn(&crate::runner::RealSummary) -> (f64, f64), with_ci: bool| {
        kinds
            .iter()
            .enumerate()
            .map(|(i, &kind)| {
                let mut rows: Vec<&crate::runner::RealSummary> = results
                    .iter()
                    .filter(|r| r.summary.strategy == kind)
                    .collect();
                rows.sort_by(|a, b| a.c_r.total_cmp(&b.c_r));
                let (line, marker) = strategy_style(i, kind == StrategyKind::Argo);
                Series {
                    label: kind.label(),
                    color: color_for(kind, i),
                    line,
                    marker: Some(marker),
                    points: rows.iter().map(|r| f(r)).collect(),
                    intervals: with_ci.then(|| {
                        rows.iter()
                            .map(|r| (r.summary.accuracy_ci95[0], r.summary.accuracy_ci95[1]))
                            .collect()
                    }),
                }
            })
            .collect::<Vec<_>>()
    };
    let subtitle = format!("real: a model answering questions | {subtitle}");
    let mut written = Vec::new();
    let accuracy = LineChart {
        title: "Graph 1.A [real]: accuracy vs retrieval cost".into(),
        subtitle: subtitle.clone(),
        x_label: "retrieval cost c_r".into(),
        y_label: "accuracy (Wilson 95% CI)".into(),
        series: series_of(&|r| (r.c_r, r.summary.accuracy), true),
        x_integer: false,
    };
    written.extend(write_chart(
        dir,
        "real_graph1a_accuracy_vs_c_r",
        &accuracy,
        false,
    )?);
    let retrievals = LineChart {
        title: "Graph 1.B [real]: retrieval calls vs retrieval cost".into(),
        subtitle: subtitle.clone(),
        x_label: "retrieval cost c_r".into(),
        y_label: "mean retrieval calls per question".into(),
        series: series_of(&|r| (r.c_r, r.summary.mean_retrievals), false),
        x_integer: false,
    };
    written.extend(write_chart(
        dir,
        "real_graph1b_retrievals_vs_c_r",
        &retrievals,
        true,
    )?);
    let frontier = LineChart {
        title: "Graph 1.C [real]: accuracy vs cost (a point per c_r)".into(),
        subtitle,
        x_label: "mean cost per question (c_r * retrievals + c_p * reasons)".into(),
        y_label: "accuracy (Wilson 95% CI)".into(),
        series: by_cost(series_of(
            &|r| (r.summary.mean_cost, r.summary.accuracy),
            true,
        )),
        x_integer: false,
    };
    written.extend(write_chart(
        dir,
        "real_graph1c_accuracy_vs_cost",
        &frontier,
        false,
    )?);
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runner::RealSummary;
    use crate::summary::StrategySummary;

    /// The left edge of the legend column, in pixels of the whole image.
    const LEGEND_X: i32 = (SIZE.0 - LEGEND_WIDTH) as i32;

    /// The value of attribute `name` in the opening tag `tag`.
    fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
        let key = format!(" {name}=\"");
        let start = tag.find(&key)? + key.len();
        let len = tag[start..].find('"')?;
        Some(&tag[start..start + len])
    }

    fn num(tag: &str, name: &str) -> i32 {
        attr(tag, name)
            .unwrap_or_else(|| panic!("no {name} in {tag}"))
            .parse()
            .unwrap_or_else(|e| panic!("{name} in {tag}: {e}"))
    }

    /// The opening tags `<name ...>` of `svg`, each with what follows it.
    fn tags<'a>(svg: &'a str, name: &str) -> Vec<(&'a str, &'a str)> {
        let open = format!("<{name} ");
        svg.match_indices(&open)
            .map(|(i, _)| {
                let end = i + svg[i..].find('>').expect("an unclosed tag");
                (&svg[i..=end], &svg[end + 1..])
            })
            .collect()
    }

    /// A `<polyline>` as plotters writes paths: stroke colour, stroke width, points.
    #[derive(Debug, Clone, PartialEq)]
    struct Polyline {
        stroke: String,
        width: i32,
        points: Vec<(i32, i32)>,
    }

    impl Polyline {
        fn closed(&self) -> bool {
            self.points.len() > 2 && self.points.first() == self.points.last()
        }

        fn in_legend(&self) -> bool {
            self.points.iter().all(|p| p.0 >= LEGEND_X)
        }

        fn in_plot(&self) -> bool {
            self.points.iter().all(|p| p.0 < LEGEND_X)
        }

        /// Length along the path, in pixels.
        fn length(&self) -> f64 {
            self.points
                .windows(2)
                .map(|w| {
                    let (dx, dy) = ((w[1].0 - w[0].0) as f64, (w[1].1 - w[0].1) as f64);
                    dx.hypot(dy)
                })
                .sum()
        }

        /// The points relative to the first one: the shape wherever it is drawn.
        fn shape(&self) -> Vec<(i32, i32)> {
            let (x0, y0) = self.points[0];
            self.points.iter().map(|&(x, y)| (x - x0, y - y0)).collect()
        }
    }

    fn polylines(svg: &str) -> Vec<Polyline> {
        tags(svg, "polyline")
            .into_iter()
            .map(|(tag, _)| Polyline {
                stroke: attr(tag, "stroke").unwrap().to_string(),
                width: num(tag, "stroke-width"),
                points: attr(tag, "points")
                    .unwrap()
                    .split_whitespace()
                    .map(|p| {
                        let (x, y) = p.split_once(',').unwrap();
                        (x.parse().unwrap(), y.parse().unwrap())
                    })
                    .collect(),
            })
            .collect()
    }

    /// A `<text>`: its position, anchor, baseline shift, rotation and content.
    #[derive(Debug, Clone)]
    struct Text {
        x: i32,
        anchor: String,
        dy: String,
        rotated: bool,
        content: String,
    }

    fn texts(svg: &str) -> Vec<Text> {
        tags(svg, "text")
            .into_iter()
            .map(|(tag, rest)| Text {
                x: num(tag, "x"),
                anchor: attr(tag, "text-anchor").unwrap().to_string(),
                dy: attr(tag, "dy").unwrap().to_string(),
                rotated: attr(tag, "transform").is_some(),
                content: rest[..rest.find("</text>").unwrap()].trim().to_string(),
            })
            .collect()
    }

    /// The x axis' tick labels (centred under the axis, not rotated).
    fn x_tick_labels(svg: &str) -> Vec<String> {
        texts(svg)
            .into_iter()
            .filter(|t| t.anchor == "middle" && t.dy == "0.76em" && !t.rotated)
            .map(|t| t.content)
            .collect()
    }

    /// The y axis' tick labels (right-aligned left of the axis).
    fn y_tick_labels(svg: &str) -> Vec<String> {
        texts(svg)
            .into_iter()
            .filter(|t| t.anchor == "end" && t.dy == "0.5ex")
            .map(|t| t.content)
            .collect()
    }

    /// The lines of text in the legend column, top to bottom.
    fn legend_lines(svg: &str) -> Vec<String> {
        texts(svg)
            .into_iter()
            .filter(|t| t.x >= LEGEND_X)
            .map(|t| t.content)
            .collect()
    }

    fn hex(c: RGBColor) -> String {
        format!("#{:02X}{:02X}{:02X}", c.0, c.1, c.2)
    }

    fn chart(series: Vec<Series>, x_integer: bool) -> LineChart {
        LineChart {
            title: "a test chart".into(),
            subtitle: "made by a unit test".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            series,
            x_integer,
        }
    }

    fn render(chart: &LineChart) -> String {
        let dir = tempfile::tempdir().unwrap();
        let files = write_chart(dir.path(), "chart", chart, false).unwrap();
        assert_eq!(files.len(), 2);
        assert!(std::fs::metadata(&files[0]).unwrap().len() > 0);
        std::fs::read_to_string(&files[1]).unwrap()
    }

    #[test]
    fn sorting_by_x_keeps_each_interval_with_its_point_and_breaks_ties_by_y() {
        // A strategy's (cost, accuracy) in c_r order: a larger c_r may cost less.
        let points = vec![(3.0, 0.7), (1.0, 0.5), (2.0, 0.9), (1.0, 0.4), (0.5, 0.6)];
        let intervals: Vec<(f64, f64)> = points
            .iter()
            .enumerate()
            .map(|(k, &(_, y))| (y - 0.01 * (k + 1) as f64, y + 0.01 * (k + 1) as f64))
            .collect();
        let with_ci = Series {
            label: "ARGO".into(),
            color: RGBColor(1, 2, 3),
            line: LineStyle::solid(3),
            marker: None,
            points: points.clone(),
            intervals: Some(intervals.clone()),
        };
        let without_ci = Series {
            intervals: None,
            label: "Always-Reason".into(),
            ..with_ci.clone()
        };
        let sorted = by_cost(vec![with_ci.clone(), without_ci]);
        let expected = [4usize, 3, 1, 2, 0];
        assert_eq!(
            sorted[0].points,
            expected.iter().map(|&k| points[k]).collect::<Vec<_>>()
        );
        assert_eq!(
            sorted[0].intervals,
            Some(expected.iter().map(|&k| intervals[k]).collect())
        );
        for (&(_, y), &(lo, hi)) in sorted[0]
            .points
            .iter()
            .zip(sorted[0].intervals.as_ref().unwrap())
        {
            assert!(lo < y && y < hi, "interval {lo}..{hi} left its point {y}");
        }
        assert!(sorted[0]
            .points
            .windows(2)
            .all(|w| w[0].0 < w[1].0 || (w[0].0 == w[1].0 && w[0].1 <= w[1].1)));
        assert_eq!(sorted[1].points, sorted[0].points);
        assert_eq!(sorted[1].intervals, None);
        assert_eq!(
            (&sorted[0].label, sorted[0].line),
            (&with_ci.label, with_ci.line)
        );
        // Sorting sorted points changes nothing.
        assert_eq!(by_cost(sorted.clone()), sorted);
    }

    fn real(kind: StrategyKind, c_r: f64, accuracy: f64, half: f64, cost: f64) -> RealSummary {
        RealSummary {
            c_r,
            summary: StrategySummary {
                strategy: kind,
                label: kind.label(),
                n_questions: 100,
                correct: (accuracy * 100.0).round() as u64,
                accuracy,
                accuracy_ci95: [accuracy - half, accuracy + half],
                expected_accuracy: None,
                mean_cost: cost,
                mean_weighted_cost: cost,
                mean_net: None,
                mean_discounted_objective: None,
                mean_steps: 2.0,
                mean_retrievals: 1.0,
                mean_successful_retrievals: 0.5,
                mean_reasons: 1.0,
                mean_final_u: 0.5,
                forced_terminations: 0,
            },
            unparsed: 0,
            llm_calls: 200,
            cache_hits: 0,
            prompt_tokens: 1000,
            new_tokens: 100,
            context_trimmed_questions: 0,
        }
    }

    #[test]
    fn graph_1c_joins_each_strategy_left_to_right_by_cost_with_its_intervals_on_its_points() {
        // ARGO's cost is not monotone in c_r (c_r 0.2 costs least, 0.4 most): joined in c_r
        // order its line would double back.
        let argo = [
            (0.1, 0.80, 0.02, 0.6),
            (0.2, 0.70, 0.04, 0.3),
            (0.4, 0.90, 0.06, 0.9),
            (0.8, 0.75, 0.08, 0.45),
        ];
        let mut results: Vec<RealSummary> = argo
            .iter()
            .map(|&(c, a, h, cost)| real(StrategyKind::Argo, c, a, h, cost))
            .collect();
        for &(c, ..) in &argo {
            results.push(real(StrategyKind::AlwaysRetrieve, c, 0.6, 0.05, 3.0 * c));
        }
        let dir = tempfile::tempdir().unwrap();
        let files = plot_real_sweep(dir.path(), &results, "a test").unwrap();
        assert_eq!(files.len(), 6);
        let svg =
            std::fs::read_to_string(dir.path().join("real_graph1c_accuracy_vs_cost.svg")).unwrap();
        let blue = hex(color_for(StrategyKind::Argo, 0));
        let lines: Vec<Polyline> = polylines(&svg)
            .into_iter()
            .filter(|p| p.stroke == blue && p.in_plot())
            .collect();
        assert_eq!(lines.len(), 1, "ARGO is one solid line: {lines:?}");
        let line = &lines[0];
        assert_eq!(line.points.len(), argo.len());
        assert!(
            line.points.windows(2).all(|w| w[0].0 < w[1].0),
            "the line runs back: {:?}",
            line.points
        );
        // Its error bars: a vertical line per point, centred on that point (the intervals are
        // symmetric and the accuracies differ, so a bar left behind by the sort would be
        // centred elsewhere).
        let bars: Vec<(i32, i32, i32)> = tags(&svg, "line")
            .into_iter()
            .map(|(tag, _)| tag)
            .filter(|tag| attr(tag, "stroke") == Some(blue.as_str()))
            .filter(|tag| num(tag, "x1") == num(tag, "x2") && num(tag, "y1") != num(tag, "y2"))
            .map(|tag| (num(tag, "x1"), num(tag, "y1"), num(tag, "y2")))
            .collect();
        assert_eq!(bars.len(), argo.len(), "{bars:?}");
        let mut heights = Vec::new();
        for &(x, y) in &line.points {
            let &(_, y1, y2) = bars
                .iter()
                .find(|b| (b.0 - x).abs() <= 1)
                .unwrap_or_else(|| panic!("no error bar at x {x}: {bars:?}"));
            assert!(
                ((y1 + y2) as f64 / 2.0 - y as f64).abs() <= 1.0,
                "bar {y1}..{y2} is not centred on its point at y {y}"
            );
            heights.push((y1 - y2).abs());
        }
        // In cost order (0.3, 0.45, 0.6, 0.9) the half-widths are 0.04, 0.08, 0.02, 0.06.
        assert!(
            heights[2] < heights[0] && heights[0] < heights[3] && heights[3] < heights[1],
            "{heights:?}"
        );
        // Graph 1.A keeps c_r order, which is x order there.
        let svg_a =
            std::fs::read_to_string(dir.path().join("real_graph1a_accuracy_vs_c_r.svg")).unwrap();
        let a: Vec<Polyline> = polylines(&svg_a)
            .into_iter()
            .filter(|p| p.stroke == blue && p.in_plot())
            .collect();
        assert_eq!(a.len(), 1);
        assert!(a[0].points.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn every_strategy_style_differs_from_the_others_and_argos_from_all() {
        let others: Vec<(LineStyle, Marker)> = (0..6).map(|i| strategy_style(i, false)).collect();
        for (i, a) in others.iter().enumerate() {
            assert!(a.0.dash.is_some(), "series {i} is not dashed: {a:?}");
            assert!(
                !a.1.filled,
                "series {i}'s marker hides what is beneath it: {a:?}"
            );
            assert_ne!(a.1.shape, MarkerShape::Circle, "ARGO's shape");
            for (j, b) in others.iter().enumerate().skip(i + 1) {
                assert_ne!(
                    (a.1.shape, a.1.size, a.0.dash),
                    (b.1.shape, b.1.size, b.0.dash),
                    "series {i} and {j} look alike"
                );
                // A later series is drawn inside an earlier one, so both show where their
                // points coincide.
                assert!(b.1.size < a.1.size, "series {j} is not smaller than {i}");
            }
        }
        // Up to five other strategies (the default set has four) each get their own shape.
        for window in others.windows(5) {
            let shapes: Vec<MarkerShape> = window.iter().map(|s| s.1.shape).collect();
            for (k, s) in shapes.iter().enumerate() {
                assert!(!shapes[k + 1..].contains(s), "{shapes:?}");
            }
        }
        for i in 0..6 {
            let argo = strategy_style(i, true);
            assert_eq!(argo, strategy_style(0, true), "ARGO's style is fixed");
            assert_eq!(argo.0.dash, None);
            assert!(argo.1.filled);
            assert_eq!(argo.1.shape, MarkerShape::Circle);
            for other in &others {
                assert_ne!(
                    (argo.1.shape, argo.1.size, argo.0.dash),
                    (other.1.shape, other.1.size, other.0.dash)
                );
            }
        }
    }

    #[test]
    fn integer_axis_ticks_are_whole_numbers_without_decimals_and_never_minus_zero() {
        assert_eq!(format_tick(200.0, 210.0, true), "200");
        assert_eq!(format_tick(0.0, 210.0, true), "0");
        assert_eq!(format_tick(-0.0, 210.0, true), "0");
        assert_eq!(format_tick(-1e-12, 210.0, true), "0");
        assert_eq!(format_tick(199.999_999_9, 210.0, true), "200");
        assert_eq!(format_tick(-3.0, 10.0, true), "-3");
        // No label off the whole numbers.
        assert_eq!(format_tick(2.5, 10.0, true), "");
        assert_eq!(format_tick(0.5, 2.0, true), "");
        assert_eq!(format_tick(f64::NAN, 10.0, true), "");
        for span in [1.0, 1.5, 2.0, 2.9, 3.0, 5.5, 7.0, 8.0, 20.0, 1000.0] {
            let n = tick_count(span, true);
            assert!(
                n as f64 <= span + 1.0,
                "{n} ticks on a whole-number axis {span} wide"
            );
            assert!((2..=MAX_TICKS).contains(&n), "{n} ticks at span {span}");
        }
        assert_eq!(tick_count(0.3, false), MAX_TICKS);
        assert_eq!(tick_count(1000.0, false), MAX_TICKS);
    }

    #[test]
    fn float_axis_ticks_drop_trailing_zeros_and_never_show_minus_zero() {
        assert_eq!(format_tick(-0.000_000_1, 1.0, false), "0");
        assert_eq!(format_tick(-0.0, 1.0, false), "0");
        assert_eq!(format_tick(1e-17, 0.5, false), "0");
        assert_eq!(format_tick(0.25, 1.0, false), "0.25");
        assert_eq!(format_tick(0.1 + 0.2, 1.0, false), "0.3");
        assert_eq!(format_tick(-0.25, 1.0, false), "-0.25");
        assert_eq!(format_tick(1.0, 1.0, false), "1");
        assert_eq!(format_tick(1234.0, 2000.0, false), "1234");
        assert_eq!(format_tick(0.0003, 0.001, false), "0.0003");
        assert_eq!(format_tick(f64::INFINITY, 1.0, false), "");
    }

    #[test]
    fn wrapped_labels_keep_words_whole_within_the_width_unless_a_word_is_longer() {
        assert_eq!(
            wrap_label("moving average over 10 steps", 22),
            ["moving average over 10", "steps"]
        );
        assert_eq!(wrap_label("ARGO", 22), ["ARGO"]);
        assert_eq!(wrap_label("", 22), [""]);
        let long = "Fixed-K(k=3) with an_extraordinarily_long_identifier_here and more words";
        let lines = wrap_label(long, 12);
        assert!(lines.len() > 1);
        for line in &lines {
            assert!(
                line.chars().count() <= 12 || !line.contains(' '),
                "{line:?} is too long"
            );
            assert_eq!(line.trim(), line);
        }
        assert!(lines.contains(&"an_extraordinarily_long_identifier_here".to_string()));
        assert_eq!(
            lines.join(" ").split(' ').collect::<Vec<_>>(),
            long.split_whitespace().collect::<Vec<_>>()
        );
    }

    #[test]
    fn legend_entries_draw_each_series_line_and_marker_as_the_plot_does() {
        let solid = RGBColor(0x11, 0x22, 0x33);
        let dashed = RGBColor(0x44, 0x55, 0x66);
        let long_label = "Fixed-K(k=3), drawn dashed with outlined squares";
        let c = chart(
            vec![
                Series {
                    label: "ARGO".into(),
                    color: solid,
                    line: LineStyle::solid(3),
                    marker: Some(Marker {
                        shape: MarkerShape::Circle,
                        size: 5,
                        filled: true,
                    }),
                    points: vec![(0.0, 0.0), (1.0, 1.0), (2.0, 0.5)],
                    intervals: None,
                },
                Series {
                    label: long_label.into(),
                    color: dashed,
                    line: LineStyle::dashed(3, 7, 4),
                    marker: Some(Marker {
                        shape: MarkerShape::Square,
                        size: 8,
                        filled: false,
                    }),
                    points: vec![(0.0, 0.5), (1.0, 0.2), (2.0, 0.9)],
                    intervals: None,
                },
            ],
            false,
        );
        let svg = render(&c);
        let all = polylines(&svg);
        let of = |color: RGBColor, legend: bool| -> Vec<Polyline> {
            all.iter()
                .filter(|p| p.stroke == hex(color))
                .filter(|p| if legend { p.in_legend() } else { p.in_plot() })
                .cloned()
                .collect()
        };

        // The solid series: one unbroken line of its width, in the plot and in the legend,
        // and the same filled circles.
        let (plot, legend) = (of(solid, false), of(solid, true));
        assert_eq!(plot.len(), 1, "{plot:?}");
        assert_eq!(legend.len(), 1, "{legend:?}");
        assert_eq!((plot[0].width, legend[0].width), (3, 3));
        assert_eq!(legend[0].length(), LEGEND_SAMPLE as f64);
        let circles: Vec<(i32, i32)> = tags(&svg, "circle")
            .into_iter()
            .filter(|(t, _)| attr(t, "fill") == Some(hex(solid).as_str()))
            .map(|(t, _)| (num(t, "cx"), num(t, "r")))
            .collect();
        assert_eq!(circles.len(), 3 + 1, "{circles:?}");
        assert!(circles.iter().any(|c| c.0 >= LEGEND_X));
        assert!(circles.iter().all(|c| c.1 == 5), "{circles:?}");

        // The dashed series: dashes of the same width and length in both places, and the
        // same outlined square.
        let (plot, legend) = (of(dashed, false), of(dashed, true));
        let dashes = |v: &[Polyline]| -> Vec<Polyline> {
            v.iter().filter(|p| !p.closed()).cloned().collect()
        };
        let markers = |v: &[Polyline]| -> Vec<Polyline> {
            v.iter().filter(|p| p.closed()).cloned().collect()
        };
        let (plot_dashes, legend_dashes) = (dashes(&plot), dashes(&legend));
        assert!(plot_dashes.len() > 10, "{plot_dashes:?}");
        assert!(
            legend_dashes.len() >= 3,
            "the legend's sample is not dashed: {legend_dashes:?}"
        );
        for d in plot_dashes.iter().chain(&legend_dashes) {
            assert_eq!(d.width, 3, "{d:?}");
            assert!(d.length() <= 7.0 + 1.5, "a dash longer than 7 px: {d:?}");
        }
        let legend_ink: f64 = legend_dashes.iter().map(Polyline::length).sum();
        assert!(
            legend_ink < 0.8 * LEGEND_SAMPLE as f64,
            "no gaps in the legend's sample: {legend_dashes:?}"
        );
        let (plot_markers, legend_markers) = (markers(&plot), markers(&legend));
        assert_eq!(plot_markers.len(), 3, "{plot_markers:?}");
        assert_eq!(legend_markers.len(), 1, "{legend_markers:?}");
        for m in &plot_markers {
            assert_eq!(m.shape(), legend_markers[0].shape());
            assert_eq!(m.width, legend_markers[0].width);
        }
        assert_eq!(legend_markers[0].points.len(), 5, "a square, closed");

        // Legend text: the long label wrapped to the column, every word kept.
        let lines = legend_lines(&svg);
        assert_eq!(lines[0], "ARGO");
        assert!(lines.len() > 2, "{lines:?}");
        for line in &lines {
            assert!(line.chars().count() <= LEGEND_CHARS, "{line:?}");
        }
        assert_eq!(lines[1..].join(" "), long_label);
    }

    #[test]
    fn a_chart_whose_x_is_a_single_whole_number_still_renders_with_whole_ticks() {
        let (lo, hi) = integer_range([5.0, 5.0].into_iter());
        assert!(hi - lo >= 2.0 && lo < 5.0 && 5.0 < hi, "{lo}..{hi}");
        let (lo, hi) = integer_range(std::iter::empty());
        assert!(hi - lo >= 2.0, "{lo}..{hi}");
        // An edit-score chart of one category: every point at x = 5, y either side of 0.
        let c = chart(
            vec![Series {
                label: "mean score".into(),
                color: RGBColor(0x2E, 0x86, 0xAB),
                line: LineStyle::solid(2),
                marker: Some(Marker {
                    shape: MarkerShape::Circle,
                    size: 4,
                    filled: true,
                }),
                points: vec![(5.0, -0.3), (5.0, 0.0), (5.0, 0.3)],
                intervals: None,
            }],
            true,
        );
        let svg = render(&c);
        let xs = x_tick_labels(&svg);
        assert!(xs.contains(&"5".to_string()), "{xs:?}");
        for label in &xs {
            assert!(
                label.parse::<i64>().is_ok() && label != "-0",
                "x tick {label:?} is not a whole number"
            );
        }
        let ys = y_tick_labels(&svg);
        assert!(ys.contains(&"0".to_string()), "{ys:?}");
        for label in &ys {
            let v: f64 = label.parse().unwrap_or_else(|_| panic!("y tick {label:?}"));
            assert!(v != 0.0 || label == "0", "y tick {label:?}");
        }
    }
}
