//! Plots of the cost sweep, PNG and SVG, with plotters.
//!
//! plotters is built without its system-font backend; the text uses a small subset of DejaVu
//! Sans embedded in the binary (`assets/fonts/`, licence beside it) and registered at run time,
//! so drawing needs no fontconfig or freetype.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::simulate::SIMULATION;
use crate::strategy::StrategyKind;
use crate::summary::OutputError;
use crate::sweep::{ExperimentConfig, SweepResult};

/// The embedded font: DejaVu Sans 2.37, subset to Latin, Greek and a few symbols.
static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans-subset.ttf");
/// The family name plots ask for.
const FAMILY: &str = "sans-serif";

static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();

fn register_embedded_font() -> Result<(), String> {
    REGISTERED
        .get_or_init(|| {
            register_font(FAMILY, FontStyle::Normal, FONT)
                .map_err(|_| "the embedded font does not parse".to_string())
        })
        .clone()
}

/// One line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text.
    pub label: String,
    /// Line colour.
    pub color: RGBColor,
    /// Drawn thicker and solid (ARGO); others are dashed.
    pub emphasis: bool,
    /// `(x, y)` points in x order.
    pub points: Vec<(f64, f64)>,
    /// Optional `(low, high)` per point, drawn as vertical error bars.
    pub intervals: Option<Vec<(f64, f64)>>,
}

/// A line chart.
#[derive(Debug, Clone, PartialEq)]
pub struct LineChart {
    /// Title.
    pub title: String,
    /// Caption under the title (parameters).
    pub subtitle: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// The lines.
    pub series: Vec<Series>,
}

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

fn padded_range(values: impl Iterator<Item = f64>, floor_zero: bool) -> (f64, f64) {
    let (mut lo, mut hi) = values.fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if !lo.is_finite() || !hi.is_finite() {
        return (0.0, 1.0);
    }
    if floor_zero {
        lo = lo.min(0.0);
    }
    let span = (hi - lo).max(1e-6);
    lo -= 0.05 * span;
    hi += 0.08 * span;
    if floor_zero && lo < 0.0 {
        lo = lo.max(-0.02 * span);
    }
    (lo, hi)
}

fn draw_chart<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    chart: &LineChart,
    floor_zero: bool,
) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let (title_area, rest) = root.split_vertically(TITLE_HEIGHT);
    let (body, legend_area) = rest.split_horizontally(SIZE.0 - LEGEND_WIDTH);
    title_area
        .draw_text(
            &chart.title,
            &TextStyle::from((FAMILY, 24).into_font()).color(&BLACK),
            (20, 8),
        )
        .map_err(err)?;
    let grey = RGBColor(0x44, 0x44, 0x44);
    for (i, line) in chart.subtitle.lines().enumerate() {
        title_area
            .draw_text(
                line,
                &TextStyle::from((FAMILY, 14).into_font()).color(&grey),
                (20, 40 + 18 * i as i32),
            )
            .map_err(err)?;
    }

    let xs = chart
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|p| p.0));
    let (x_lo, x_hi) = padded_range(xs, false);
    let ys = chart.series.iter().flat_map(|s| {
        let pts = s.points.iter().map(|p| p.1);
        let ivs = s
            .intervals
            .iter()
            .flat_map(|v| v.iter().flat_map(|&(a, b)| [a, b]));
        pts.chain(ivs).collect::<Vec<_>>()
    });
    let (y_lo, y_hi) = padded_range(ys, floor_zero);

    let mut ctx = ChartBuilder::on(&body)
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d(x_lo..x_hi, y_lo..y_hi)
        .map_err(err)?;
    ctx.configure_mesh()
        .x_desc(chart.x_label.as_str())
        .y_desc(chart.y_label.as_str())
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 16))
        .light_line_style(RGBColor(0xEE, 0xEE, 0xEE))
        .x_labels(8)
        .y_labels(8)
        .draw()
        .map_err(err)?;

    for s in &chart.series {
        let color = s.color;
        let width = if s.emphasis { 3 } else { 2 };
        let style = ShapeStyle::from(&color).stroke_width(width);
        if let Some(ivs) = &s.intervals {
            ctx.draw_series(s.points.iter().zip(ivs).map(|(&(x, y), &(lo, hi))| {
                ErrorBar::new_vertical(x, lo, y, hi, color.mix(0.6).stroke_width(1), 6)
            }))
            .map_err(err)?;
        }
        if s.emphasis {
            ctx.draw_series(LineSeries::new(s.points.iter().copied(), style))
                .map_err(err)?;
        } else {
            ctx.draw_series(DashedLineSeries::new(s.points.iter().copied(), 8, 4, style))
                .map_err(err)?;
        }
        // Markers only where they can be told apart (a training curve of a thousand steps is
        // a line).
        if s.points.len() <= MAX_MARKERS {
            ctx.draw_series(s.points.iter().map(|&(x, y)| {
                Circle::new((x, y), if s.emphasis { 5 } else { 4 }, color.filled())
            }))
            .map_err(err)?;
        }
    }

    // The legend sits in its own column so it never hides a line.
    let text = TextStyle::from((FAMILY, 15).into_font()).color(&BLACK);
    for (i, s) in chart.series.iter().enumerate() {
        let y = 40 + 28 * i as i32;
        let width = if s.emphasis { 3 } else { 2 };
        legend_area
            .draw(&PathElement::new(
                vec![(8, y), (36, y)],
                s.color.stroke_width(width),
            ))
            .map_err(err)?;
        legend_area
            .draw(&Circle::new((22, y), 4, s.color.filled()))
            .map_err(err)?;
        legend_area
            .draw_text(&s.label, &text, (44, y - 9))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Series with more points than this are drawn without point markers.
const MAX_MARKERS: usize = 100;

/// Pixel size of every plot.
const SIZE: (u32, u32) = (1100, 660);
/// Height of the title block.
const TITLE_HEIGHT: u32 = 84;
/// Width of the legend column.
const LEGEND_WIDTH: u32 = 190;

/// Draws `chart` to `<stem>.png` and `<stem>.svg` in `dir`; returns both paths.
pub fn write_chart(
    dir: &Path,
    stem: &str,
    chart: &LineChart,
    floor_zero: bool,
) -> Result<Vec<PathBuf>, OutputError> {
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    let plot_err = |path: &Path, message: String| OutputError::Plot {
        path: path.to_path_buf(),
        message,
    };
    register_embedded_font().map_err(|m| plot_err(&png, m))?;
    // Draw to temporary names and rename, so a reader never sees half a plot.
    let png_tmp = dir.join(format!(".{stem}.png.tmp-{}.png", std::process::id()));
    let svg_tmp = dir.join(format!(".{stem}.svg.tmp-{}.svg", std::process::id()));
    {
        let root = BitMapBackend::new(&png_tmp, SIZE).into_drawing_area();
        draw_chart(&root, chart, floor_zero).map_err(|m| plot_err(&png, m))?;
    }
    {
        let root = SVGBackend::new(&svg_tmp, SIZE).into_drawing_area();
        draw_chart(&root, chart, floor_zero).map_err(|m| plot_err(&svg, m))?;
    }
    std::fs::rename(&png_tmp, &png).map_err(|e| OutputError::io(&png, e))?;
    std::fs::rename(&svg_tmp, &svg).map_err(|e| OutputError::io(&svg, e))?;
    Ok(vec![png, svg])
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
                Series {
                    label: kind.label(),
                    color: color_for(kind, i),
                    emphasis: kind == StrategyKind::Argo,
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
    };
    written.extend(write_chart(dir, stems::ACCURACY_VS_C_R, &accuracy, false)?);
    let retrievals = LineChart {
        title: format!("Graph 1.B [{SIMULATION}]: retrieval calls vs retrieval cost"),
        subtitle: subtitle.clone(),
        x_label: "retrieval cost c_r".into(),
        y_label: "mean retrieval calls per question".into(),
        series: series_of(&|c, s| (c, s.mean_retrievals), false),
    };
    written.extend(write_chart(
        dir,
        stems::RETRIEVALS_VS_C_R,
        &retrievals,
        true,
    )?);
    let frontier = LineChart {
        title: format!("Graph 1.C [{SIMULATION}]: accuracy vs cost per question"),
        subtitle,
        x_label: "mean cost per question (c_r * retrievals + c_p * reasons)".into(),
        y_label: "accuracy (Wilson 95% CI)".into(),
        series: series_of(&|_, s| (s.mean_cost, s.accuracy), true),
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
                Series {
                    label: kind.label(),
                    color: color_for(kind, i),
                    emphasis: kind == StrategyKind::Argo,
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
    };
    written.extend(write_chart(
        dir,
        "real_graph1b_retrievals_vs_c_r",
        &retrievals,
        true,
    )?);
    let frontier = LineChart {
        title: "Graph 1.C [real]: accuracy vs cost per question".into(),
        subtitle,
        x_label: "mean cost per question (c_r * retrievals + c_p * reasons)".into(),
        y_label: "accuracy (Wilson 95% CI)".into(),
        series: series_of(&|r| (r.summary.mean_cost, r.summary.accuracy), true),
    };
    written.extend(write_chart(
        dir,
        "real_graph1c_accuracy_vs_cost",
        &frontier,
        false,
    )?);
    Ok(written)
}
