//! The report's chart: per category, a bar per metric (the mean) with ±1 std whiskers and the
//! number of items with a value; PNG and SVG, drawn with plotters in fleet-plot's font (no
//! system fonts: a DejaVu Sans subset embedded and registered by
//! [`fleet_plot::register_embedded_font`]; the subset has no CJK glyphs, so categories are
//! labelled by the prompt set's ASCII template names where it maps them).

use std::path::{Path, PathBuf};

use fleet_plot::{register_embedded_font, FAMILY};
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::report::{Report, ReportError, CHART_PNG, CHART_SVG};

/// Pixel size.
const SIZE: (u32, u32) = (1100, 660);
/// Height of the title block.
const TITLE_HEIGHT: u32 = 92;
/// Height of the category labels under the plot.
const LABEL_HEIGHT: u32 = 56;
/// The score scale.
const TOP: f64 = 10.0;

fn metric_color(metric: &str, i: usize) -> RGBColor {
    match metric {
        "score" | "SC" => RGBColor(0x2E, 0x86, 0xAB),
        "PQ" => RGBColor(0xF1, 0x8F, 0x01),
        "O" => RGBColor(0x6A, 0x99, 0x4E),
        _ => [RGBColor(0xA2, 0x3B, 0x72), RGBColor(0x55, 0x55, 0x55)][i % 2],
    }
}

/// `"a"`, `"a and b"`, `"a, b and c"`.
fn list(names: &[String]) -> String {
    match names {
        [] => String::new(),
        [one] => one.clone(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// The chart's title: the prompt set, its scheme, and every metric the bars draw (`mean SC, PQ
/// and O per category`), not only the primary one.
pub fn chart_title(report: &Report) -> String {
    let c = &report.config;
    let drawn = if report.metrics.is_empty() {
        list(std::slice::from_ref(&report.primary))
    } else {
        list(&report.metrics)
    };
    format!(
        "edit-score: {} v{} ({}), mean {drawn} per category",
        c.prompt_set.name, c.prompt_set.version, c.scheme
    )
}

fn draw<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, report: &Report) -> Result<(), String> {
    let err = |e: DrawingAreaErrorKind<DB::ErrorType>| e.to_string();
    root.fill(&WHITE).map_err(err)?;
    let (title_area, rest) = root.split_vertically(TITLE_HEIGHT);
    let (body, labels_area) = rest.split_vertically(SIZE.1 - TITLE_HEIGHT - LABEL_HEIGHT);
    title_area
        .draw_text(
            &chart_title(report),
            &TextStyle::from((FAMILY, 22).into_font()).color(&BLACK),
            (20, 8),
        )
        .map_err(err)?;
    let grey = RGBColor(0x44, 0x44, 0x44);
    let commit: String = report.commit.chars().take(12).collect();
    let subtitle = [
        format!("model {} | {}", report.model_id, report.config.decoding_text),
        format!(
            "bars: mean; whiskers: +/-1 std (population); n: items with a value of {} | {} items, {} parse failures, {} judge failures, {} not scored | commit {commit}",
            report.primary, report.items, report.parse_failed, report.judge_failed, report.not_scored
        ),
    ];
    for (i, line) in subtitle.iter().enumerate() {
        title_area
            .draw_text(
                line,
                &TextStyle::from((FAMILY, 13).into_font()).color(&grey),
                (20, 38 + 18 * i as i32),
            )
            .map_err(err)?;
    }

    let n_cat = report.categories.len().max(1);
    let metrics = &report.metrics;
    let mut ctx = ChartBuilder::on(&body)
        .margin(16)
        .margin_right(150)
        .x_label_area_size(4)
        .y_label_area_size(56)
        .build_cartesian_2d(0f64..n_cat as f64, 0f64..TOP + 1.0)
        .map_err(err)?;
    ctx.configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .y_desc("score (0-10)")
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 15))
        .light_line_style(RGBColor(0xEE, 0xEE, 0xEE))
        .y_labels(11)
        .draw()
        .map_err(err)?;

    let k = metrics.len().max(1) as f64;
    let group = 0.8;
    let width = group / k;
    let text = TextStyle::from((FAMILY, 13).into_font()).color(&BLACK);
    for (ci, cat) in report.categories.iter().enumerate() {
        let left = ci as f64 + (1.0 - group) / 2.0;
        for (mi, m) in metrics.iter().enumerate() {
            let Some(s) = cat.stats.get(m) else { continue };
            let color = metric_color(m, mi);
            let x0 = left + mi as f64 * width;
            let x1 = x0 + width * 0.92;
            let mean = s.mean.clamp(0.0, TOP);
            ctx.draw_series(std::iter::once(Rectangle::new(
                [(x0, 0.0), (x1, mean)],
                color.mix(0.85).filled(),
            )))
            .map_err(err)?;
            let xm = (x0 + x1) / 2.0;
            let lo = (s.mean - s.std).clamp(0.0, TOP);
            let hi = (s.mean + s.std).clamp(0.0, TOP);
            ctx.draw_series(std::iter::once(ErrorBar::new_vertical(
                xm,
                lo,
                mean,
                hi,
                BLACK.stroke_width(1),
                8,
            )))
            .map_err(err)?;
        }
        // n over the group: the primary metric's count.
        let n = cat.stats.get(&report.primary).map_or(0, |s| s.n);
        let top = cat
            .stats
            .values()
            .map(|s| (s.mean + s.std).min(TOP))
            .fold(0.0f64, f64::max);
        let n_text = if metrics.len() > 1 {
            format!("n({})={n}", report.primary)
        } else {
            format!("n={n}")
        };
        ctx.draw_series(std::iter::once(Text::new(
            n_text,
            (ci as f64 + 0.38, top + 0.45),
            text.clone(),
        )))
        .map_err(err)?;
        // The label under the group, staggered when there are many categories.
        let (px, _) = ctx.backend_coord(&(ci as f64 + 0.5, 0.0));
        let (rx, _) = labels_area.get_base_pixel();
        let label = &cat.chart_label;
        let approx = (label.chars().count() as i32) * 7;
        let row = if n_cat > 6 { (ci % 2) as i32 } else { 0 };
        labels_area
            .draw_text(
                label,
                &TextStyle::from((FAMILY, 13).into_font()).color(&BLACK),
                (px - rx - approx / 2, 4 + 20 * row),
            )
            .map_err(err)?;
    }

    // Legend, right of the plot.
    let (lx, ly) = (SIZE.0 as i32 - 140, 40);
    for (mi, m) in metrics.iter().enumerate() {
        let y = ly + 26 * mi as i32;
        let color = metric_color(m, mi);
        body.draw(&Rectangle::new(
            [(lx, y - 7), (lx + 22, y + 7)],
            color.mix(0.85).filled(),
        ))
        .map_err(err)?;
        body.draw_text(m, &text, (lx + 30, y - 8)).map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Draws the report's chart to `chart.png` and `chart.svg` in `dir` (each drawn to a temporary
/// name and renamed, so a reader never sees half a chart); returns both paths.
pub fn write_chart(dir: &Path, report: &Report) -> Result<Vec<PathBuf>, ReportError> {
    let png = dir.join(CHART_PNG);
    let svg = dir.join(CHART_SVG);
    let plot_err = |path: &Path, message: String| ReportError::Plot {
        path: path.to_path_buf(),
        message,
    };
    register_embedded_font().map_err(|m| plot_err(&png, m))?;
    let pid = std::process::id();
    let png_tmp = dir.join(format!(".{CHART_PNG}.tmp-{pid}.png"));
    let svg_tmp = dir.join(format!(".{CHART_SVG}.tmp-{pid}.svg"));
    {
        let root = BitMapBackend::new(&png_tmp, SIZE).into_drawing_area();
        draw(&root, report).map_err(|m| plot_err(&png, m))?;
    }
    {
        let root = SVGBackend::new(&svg_tmp, SIZE).into_drawing_area();
        draw(&root, report).map_err(|m| plot_err(&svg, m))?;
    }
    for (tmp, path) in [(&png_tmp, &png), (&svg_tmp, &svg)] {
        std::fs::rename(tmp, path).map_err(|e| plot_err(path, e.to_string()))?;
    }
    Ok(vec![png, svg])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_lists_read_as_english() {
        let names = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        assert_eq!(list(&names(&["score"])), "score");
        assert_eq!(list(&names(&["SC", "O"])), "SC and O");
        assert_eq!(list(&names(&["SC", "PQ", "O"])), "SC, PQ and O");
    }
}
