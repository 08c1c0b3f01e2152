//! Plots of the cost sweep, PNG and SVG, with plotters.
//!
//! plotters is built without its system-font backend; the text uses a small subset of DejaVu
//! Sans embedded in the binary (`assets/fonts/`, licence beside it) and registered at run time,
//! so drawing needs no fontconfig or freetype.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
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

/// The shape of a series' point markers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MarkerShape {
    /// ●
    Circle,
    /// ■
    Square,
    /// ▲
    TriangleUp,
    /// ◆
    Diamond,
    /// ▼
    TriangleDown,
    /// ✕ (never filled)
    Cross,
}

impl MarkerShape {
    /// Shapes in the order series get them, so that every series of a chart has its own.
    pub const ALL: [MarkerShape; 6] = [
        MarkerShape::Circle,
        MarkerShape::Square,
        MarkerShape::TriangleUp,
        MarkerShape::Diamond,
        MarkerShape::TriangleDown,
        MarkerShape::Cross,
    ];
}

/// A series' point marker: drawn at every point (when the series has at most
/// [`MAX_MARKERS`] points) and in its legend entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Marker {
    /// The shape.
    pub shape: MarkerShape,
    /// Half-width in pixels.
    pub size: u32,
    /// Filled, or drawn as an outline (an outline shows a marker of another series beneath it).
    pub filled: bool,
}

/// How a series' line is drawn (in the plot and in its legend entry alike).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LineStyle {
    /// Stroke width in pixels.
    pub width: u32,
    /// `(dash, gap)` in pixels; `None` for a solid line.
    pub dash: Option<(u32, u32)>,
}

impl LineStyle {
    /// A solid line.
    pub const fn solid(width: u32) -> LineStyle {
        LineStyle { width, dash: None }
    }

    /// A dashed line.
    pub const fn dashed(width: u32, dash: u32, gap: u32) -> LineStyle {
        LineStyle {
            width,
            dash: Some((dash, gap)),
        }
    }
}

/// One line of a chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// Legend text (wrapped to the legend column).
    pub label: String,
    /// Line and marker colour.
    pub color: RGBColor,
    /// The line.
    pub line: LineStyle,
    /// The point marker, if any.
    pub marker: Option<Marker>,
    /// `(x, y)` points, joined in this order.
    pub points: Vec<(f64, f64)>,
    /// Optional `(low, high)` per point, drawn as vertical error bars.
    pub intervals: Option<Vec<(f64, f64)>>,
}

impl Series {
    /// The marker as drawn: none on a series of more than [`MAX_MARKERS`] points (a training
    /// curve of a thousand steps is a line), and then none in its legend entry either.
    pub fn drawn_marker(&self) -> Option<Marker> {
        self.marker.filter(|_| self.points.len() <= MAX_MARKERS)
    }

    /// Sorts the points (and their intervals with them) by x, ties by y: for a chart whose x is
    /// not the swept parameter, so that the line runs left to right instead of zig-zagging.
    pub fn sort_by_x(&mut self) {
        let mut idx: Vec<usize> = (0..self.points.len()).collect();
        idx.sort_by(|&a, &b| {
            let (pa, pb) = (self.points[a], self.points[b]);
            pa.0.total_cmp(&pb.0).then(pa.1.total_cmp(&pb.1))
        });
        self.points = idx.iter().map(|&i| self.points[i]).collect();
        if let Some(iv) = &self.intervals {
            self.intervals = Some(idx.iter().map(|&i| iv[i]).collect());
        }
    }
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
    /// The lines, drawn in this order (later ones on top).
    pub series: Vec<Series>,
    /// X takes whole numbers only (steps): ticks at integers, labelled without decimals.
    pub x_integer: bool,
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

/// An axis range for whole-number values: padded, and at least 2 wide so that it has whole
/// ticks to label.
fn integer_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = padded_range(values, false);
    if hi - lo < 2.0 {
        let mid = (lo + hi) / 2.0;
        (mid - 1.0, mid + 1.0)
    } else {
        (lo, hi)
    }
}

/// The tick labels the axes ask for at most (plotters picks round values).
const MAX_TICKS: usize = 8;

/// How many ticks to ask plotters for on an axis spanning `span`: for whole-number axes at most
/// one per unit, so that every tick falls on a whole number.
pub fn tick_count(span: f64, integer: bool) -> usize {
    if integer {
        (span.floor().max(0.0) as usize + 1).clamp(2, MAX_TICKS)
    } else {
        MAX_TICKS
    }
}

/// The label of a tick at `value` on an axis spanning `span`: whole numbers without decimals on
/// an `integer` axis (`200`, not `200.0`; no label off the whole numbers); otherwise as many
/// decimals as the tick spacing needs, trailing zeros dropped; never `-0`.
pub fn format_tick(value: f64, span: f64, integer: bool) -> String {
    if !value.is_finite() {
        return String::new();
    }
    if integer {
        let r = value.round();
        if (value - r).abs() > 1e-6 * r.abs().max(1.0) {
            return String::new();
        }
        return format!("{}", r as i64);
    }
    let step = (span / MAX_TICKS as f64).abs();
    let decimals = if step > 0.0 && step.is_finite() {
        (-step.log10()).ceil().clamp(0.0, 9.0) as usize + 1
    } else {
        2
    };
    let mut text = format!("{value:.decimals$}");
    if text.contains('.') {
        text = text.trim_end_matches('0').trim_end_matches('.').to_string();
    }
    if text.parse::<f64>().is_ok_and(|v| v == 0.0) {
        return "0".into();
    }
    text
}

/// Splits `label` into lines of at most `width` characters at spaces (a longer word keeps its
/// own line).
pub fn wrap_label(label: &str, width: usize) -> Vec<String> {
    let mut lines: Vec<String> = Vec::new();
    let mut line = String::new();
    for word in label.split_whitespace() {
        if !line.is_empty() && line.chars().count() + 1 + word.chars().count() > width {
            lines.push(std::mem::take(&mut line));
        }
        if !line.is_empty() {
            line.push(' ');
        }
        line.push_str(word);
    }
    if !line.is_empty() || lines.is_empty() {
        lines.push(line);
    }
    lines
}

/// A marker's outline in pixel offsets from its centre.
enum Glyph {
    /// A circle of this radius.
    Circle(i32),
    /// A closed polygon.
    Polygon(Vec<(i32, i32)>),
    /// Open strokes.
    Strokes(Vec<Vec<(i32, i32)>>),
}

fn glyph(m: Marker) -> Glyph {
    let r = m.size as i32;
    let h = (r * 4 + 2) / 5;
    match m.shape {
        MarkerShape::Circle => Glyph::Circle(r),
        MarkerShape::Square => Glyph::Polygon(vec![(-h, -h), (h, -h), (h, h), (-h, h)]),
        MarkerShape::TriangleUp => Glyph::Polygon(vec![(0, -r), (r, r * 2 / 3), (-r, r * 2 / 3)]),
        MarkerShape::TriangleDown => {
            Glyph::Polygon(vec![(0, r), (r, -r * 2 / 3), (-r, -r * 2 / 3)])
        }
        MarkerShape::Diamond => Glyph::Polygon(vec![(0, -r), (r, 0), (0, r), (-r, 0)]),
        MarkerShape::Cross => Glyph::Strokes(vec![vec![(-h, -h), (h, h)], vec![(-h, h), (h, -h)]]),
    }
}

/// The style of marker `m` in `color`: filled, or an outline (a cross is always strokes).
fn marker_style(m: Marker, color: RGBColor) -> ShapeStyle {
    if m.filled && m.shape != MarkerShape::Cross {
        color.filled()
    } else {
        color.stroke_width(if m.size >= 6 { 2 } else { 1 })
    }
}

/// Draws marker `m` centred on pixel `at` of `area` (relative to its top-left): one code path
/// for the plot's markers and the legend's.
fn draw_marker<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    at: (i32, i32),
    m: Marker,
    color: RGBColor,
) -> Result<(), DrawingAreaErrorKind<DB::ErrorType>> {
    let style = marker_style(m, color);
    let (x, y) = at;
    let shift = |pts: Vec<(i32, i32)>| -> Vec<(i32, i32)> {
        pts.into_iter().map(|(dx, dy)| (x + dx, y + dy)).collect()
    };
    match glyph(m) {
        Glyph::Circle(r) => area.draw(&Circle::new((x, y), r, style)),
        Glyph::Polygon(pts) if m.filled => area.draw(&Polygon::new(shift(pts), style)),
        Glyph::Polygon(pts) => {
            let mut closed = shift(pts);
            closed.push(closed[0]);
            area.draw(&PathElement::new(closed, style))
        }
        Glyph::Strokes(strokes) => {
            for stroke in strokes {
                area.draw(&PathElement::new(shift(stroke), style))?;
            }
            Ok(())
        }
    }
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
    let (x_lo, x_hi) = if chart.x_integer {
        integer_range(xs)
    } else {
        padded_range(xs, false)
    };
    let ys = chart.series.iter().flat_map(|s| {
        let pts = s.points.iter().map(|p| p.1);
        let ivs = s
            .intervals
            .iter()
            .flat_map(|v| v.iter().flat_map(|&(a, b)| [a, b]));
        pts.chain(ivs).collect::<Vec<_>>()
    });
    let (y_lo, y_hi) = padded_range(ys, floor_zero);
    let (x_span, y_span) = (x_hi - x_lo, y_hi - y_lo);
    let x_fmt = |v: &f64| format_tick(*v, x_span, chart.x_integer);
    let y_fmt = |v: &f64| format_tick(*v, y_span, false);

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
        .x_labels(tick_count(x_span, chart.x_integer))
        .y_labels(MAX_TICKS)
        .x_label_formatter(&x_fmt)
        .y_label_formatter(&y_fmt)
        .draw()
        .map_err(err)?;

    for s in &chart.series {
        let color = s.color;
        let style = ShapeStyle::from(&color).stroke_width(s.line.width);
        if let Some(ivs) = &s.intervals {
            ctx.draw_series(s.points.iter().zip(ivs).map(|(&(x, y), &(lo, hi))| {
                ErrorBar::new_vertical(x, lo, y, hi, color.mix(0.6).stroke_width(1), 6)
            }))
            .map_err(err)?;
        }
        match s.line.dash {
            None => {
                ctx.draw_series(LineSeries::new(s.points.iter().copied(), style))
                    .map_err(err)?;
            }
            Some((dash, gap)) => {
                ctx.draw_series(DashedLineSeries::new(
                    s.points.iter().copied(),
                    dash,
                    gap,
                    style,
                ))
                .map_err(err)?;
            }
        }
        if let Some(m) = s.drawn_marker() {
            // In pixels on the root area, through the same function as the legend's markers.
            for p in &s.points {
                draw_marker(root, ctx.backend_coord(p), m, color).map_err(err)?;
            }
        }
    }

    // The legend sits in its own column so it never hides a line; each entry draws its
    // series' line (width, dash) and marker as the plot does.
    let text = TextStyle::from((FAMILY, 15).into_font()).color(&BLACK);
    let mut y = 40;
    for s in &chart.series {
        let style = ShapeStyle::from(&s.color).stroke_width(s.line.width);
        let sample = vec![(6, y), (LEGEND_SAMPLE + 6, y)];
        match s.line.dash {
            None => legend_area
                .draw(&PathElement::new(sample, style))
                .map_err(err)?,
            Some((dash, gap)) => legend_area
                .draw(&DashedPathElement::new(sample, dash, gap, style))
                .map_err(err)?,
        }
        if let Some(m) = s.drawn_marker() {
            draw_marker(&legend_area, (LEGEND_SAMPLE / 2 + 6, y), m, s.color).map_err(err)?;
        }
        let lines = wrap_label(&s.label, LEGEND_CHARS);
        for (k, line) in lines.iter().enumerate() {
            legend_area
                .draw_text(line, &text, (LEGEND_SAMPLE + 14, y - 9 + 18 * k as i32))
                .map_err(err)?;
        }
        y += 18 * lines.len() as i32 + 14;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Series with more points than this are drawn without point markers.
pub const MAX_MARKERS: usize = 100;

/// Pixel size of every plot.
const SIZE: (u32, u32) = (1100, 660);
/// Height of the title block.
const TITLE_HEIGHT: u32 = 84;
/// Width of the legend column.
const LEGEND_WIDTH: u32 = 250;
/// Length of a legend entry's line sample, in pixels (long enough to show its dashes).
const LEGEND_SAMPLE: i32 = 40;
/// Characters per legend line (15 px text beside the sample).
const LEGEND_CHARS: usize = 22;

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
