//! Line charts as PNG and SVG, drawn with plotters the same way for every job: ARGO's cost
//! sweep, gspo-train's reward and loss curves.
//!
//! plotters is built without its system-font backend; the text uses a small subset of DejaVu
//! Sans embedded in the binary (`assets/fonts/`, licence beside it) and registered at run time
//! ([`register_embedded_font`]), so drawing needs no fontconfig or freetype. A chart is written
//! to temporary names and renamed, so a reader never sees half a plot.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::element::DashedPathElement;
use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

pub use plotters::style::RGBColor;

/// The embedded font: DejaVu Sans 2.37, subset to Latin, Greek and a few symbols.
static FONT: &[u8] = include_bytes!("../../../assets/fonts/DejaVuSans-subset.ttf");
/// The family name charts ask for (the embedded font is registered under it).
pub const FAMILY: &str = "sans-serif";

static REGISTERED: OnceLock<Result<(), String>> = OnceLock::new();

/// Registers the embedded font under [`FAMILY`] (once per process; later calls return the
/// first result). Every chart drawn with plotters in fleet calls it before drawing text.
pub fn register_embedded_font() -> Result<(), String> {
    REGISTERED
        .get_or_init(|| {
            register_font(FAMILY, FontStyle::Normal, FONT)
                .map_err(|_| "the embedded font does not parse".to_string())
        })
        .clone()
}

/// A chart that could not be written.
#[derive(Debug, thiserror::Error)]
pub enum PlotError {
    /// Drawing failed (the font, or plotters).
    #[error("cannot draw {path}: {message}")]
    Draw {
        /// The chart file.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// The drawn file could not be put in place.
    #[error("cannot write {path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
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
pub fn integer_range(values: impl Iterator<Item = f64>) -> (f64, f64) {
    let (lo, hi) = padded_range(values, false);
    if hi - lo < 2.0 {
        let mid = (lo + hi) / 2.0;
        (mid - 1.0, mid + 1.0)
    } else {
        (lo, hi)
    }
}

/// The tick labels the axes ask for at most (plotters picks round values).
pub const MAX_TICKS: usize = 8;

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

/// Pixel size of every chart.
pub const SIZE: (u32, u32) = (1100, 660);
/// Height of the title block.
const TITLE_HEIGHT: u32 = 84;
/// Width of the legend column (at the right edge).
pub const LEGEND_WIDTH: u32 = 250;
/// Length of a legend entry's line sample, in pixels (long enough to show its dashes).
pub const LEGEND_SAMPLE: i32 = 40;
/// Characters per legend line (15 px text beside the sample).
pub const LEGEND_CHARS: usize = 22;

/// Draws `chart` to `<stem>.png` and `<stem>.svg` in `dir`; returns both paths.
pub fn write_chart(
    dir: &Path,
    stem: &str,
    chart: &LineChart,
    floor_zero: bool,
) -> Result<Vec<PathBuf>, PlotError> {
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    let plot_err = |path: &Path, message: String| PlotError::Draw {
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
    let io = |path: &Path, source: std::io::Error| PlotError::Io {
        path: path.to_path_buf(),
        source,
    };
    std::fs::rename(&png_tmp, &png).map_err(|e| io(&png, e))?;
    std::fs::rename(&svg_tmp, &svg).map_err(|e| io(&svg, e))?;
    Ok(vec![png, svg])
}
