//! SVG figures of an analysis (`kvq analyze --plot DIR`): error histograms per bit width,
//! bits per element against attention error per scheme family, and attention error per layer.
//!
//! The figures are plain SVG 1.1 written by hand (no plotting dependency): rectangles, polylines,
//! circles and text, readable in any browser.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::analysis::{Histogram, KvSpec, Report};

/// Why a figure could not be written.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum PlotError {
    /// The directory or a file in it could not be written.
    #[error("{path}: {source}")]
    Io {
        /// The path.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The report holds nothing to plot.
    #[error("nothing to plot: {0}")]
    Empty(&'static str),
}

/// An axis mapping data values to `[0, 1]`.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Scale {
    Linear {
        lo: f64,
        hi: f64,
    },
    /// Base-10 logarithmic over whole decades.
    Log {
        lo_exp: i32,
        hi_exp: i32,
    },
}

impl Scale {
    /// A linear scale over `[lo, hi]` widened to a nice tick step.
    fn linear(lo: f64, hi: f64) -> Self {
        let (lo, hi) = if hi > lo { (lo, hi) } else { (lo - 0.5, lo + 0.5) };
        let step = nice_step((hi - lo) / 5.0);
        Scale::Linear { lo: (lo / step).floor() * step, hi: (hi / step).ceil() * step }
    }

    /// A log scale covering the positive values of `values` (whole decades).
    fn log(values: impl Iterator<Item = f64>) -> Self {
        let (mut lo, mut hi) = (f64::INFINITY, f64::NEG_INFINITY);
        for v in values.filter(|v| v.is_finite() && *v > 0.0) {
            lo = lo.min(v);
            hi = hi.max(v);
        }
        if !lo.is_finite() {
            return Scale::Log { lo_exp: -1, hi_exp: 0 };
        }
        let lo_exp = lo.log10().floor() as i32;
        let hi_exp = (hi.log10().ceil() as i32).max(lo_exp + 1);
        Scale::Log { lo_exp, hi_exp }
    }

    /// `v` mapped to `[0, 1]` (values outside the range, and non-positive values on a log
    /// scale, are clamped to its ends).
    fn unit(&self, v: f64) -> f64 {
        let u = match *self {
            Scale::Linear { lo, hi } => (v - lo) / (hi - lo),
            Scale::Log { lo_exp, hi_exp } => {
                if v <= 0.0 || !v.is_finite() {
                    0.0
                } else {
                    (v.log10() - lo_exp as f64) / (hi_exp - lo_exp) as f64
                }
            }
        };
        u.clamp(0.0, 1.0)
    }

    /// Tick positions and labels.
    fn ticks(&self) -> Vec<(f64, String)> {
        match *self {
            Scale::Linear { lo, hi } => {
                let step = nice_step((hi - lo) / 5.0);
                let n = ((hi - lo) / step).round() as i64;
                (0..=n)
                    .map(|i| {
                        let v = lo + i as f64 * step;
                        (v, fmt_tick(v, step))
                    })
                    .collect()
            }
            Scale::Log { lo_exp, hi_exp } => {
                (lo_exp..=hi_exp).map(|e| (10f64.powi(e), format!("1e{e}"))).collect()
            }
        }
    }
}

/// 1, 2 or 5 times a power of ten, at least `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw > 0.0 && raw.is_finite()) {
        return 1.0;
    }
    let p = 10f64.powf(raw.log10().floor());
    [1.0, 2.0, 5.0, 10.0].into_iter().map(|m| m * p).find(|&s| s >= raw * (1.0 - 1e-9)).unwrap_or(10.0 * p)
}

fn fmt_tick(v: f64, step: f64) -> String {
    if step >= 1.0 || v == 0.0 {
        format!("{v:.0}")
    } else if step >= 0.01 {
        format!("{v:.2}")
    } else {
        format!("{v:.1e}")
    }
}

/// Distinct colours, evenly spaced in hue.
fn color(i: usize, n: usize) -> String {
    let h = 360.0 * i as f64 / n.max(1) as f64;
    format!("hsl({h:.0},65%,45%)")
}

fn escape(s: &str) -> String {
    s.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;")
}

/// An SVG document being written.
struct Svg {
    body: String,
    width: f64,
    height: f64,
}

impl Svg {
    fn new(width: f64, height: f64) -> Self {
        Self { body: String::new(), width, height }
    }

    fn text(&mut self, x: f64, y: f64, anchor: &str, size: f64, text: &str) {
        let _ = writeln!(
            self.body,
            r#"<text x="{x:.1}" y="{y:.1}" text-anchor="{anchor}" font-size="{size}">{}</text>"#,
            escape(text)
        );
    }

    fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: &str) {
        let _ = writeln!(
            self.body,
            r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{fill}"/>"#,
            w.max(0.0),
            h.max(0.0)
        );
    }

    /// A line through pixel points.
    fn polyline(&mut self, points: &[(f64, f64)], stroke: &str) {
        let line: Vec<String> = points.iter().map(|(x, y)| format!("{x:.1},{y:.1}")).collect();
        let _ = writeln!(
            self.body,
            r#"<polyline points="{}" fill="none" stroke="{stroke}" stroke-width="2"/>"#,
            line.join(" ")
        );
    }

    /// A dot: a circle, or a square for `square`, half transparent unless `solid`.
    fn dot(&mut self, x: f64, y: f64, fill: &str, square: bool, solid: bool) {
        let opacity = if solid { 1.0 } else { 0.45 };
        if square {
            let _ = writeln!(
                self.body,
                r#"<rect x="{:.1}" y="{:.1}" width="7" height="7" fill="{fill}" fill-opacity="{opacity}"/>"#,
                x - 3.5,
                y - 3.5
            );
        } else {
            let _ = writeln!(
                self.body,
                r#"<circle cx="{x:.1}" cy="{y:.1}" r="3.5" fill="{fill}" fill-opacity="{opacity}"/>"#
            );
        }
    }

    fn finish(self) -> String {
        format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" \
             font-family=\"sans-serif\">\n<rect width=\"{w}\" height=\"{h}\" fill=\"white\"/>\n{}</svg>\n",
            self.body,
            w = self.width,
            h = self.height
        )
    }
}

/// A plotting frame: a pixel rectangle with an x and a y scale.
struct Frame {
    left: f64,
    top: f64,
    width: f64,
    height: f64,
    x: Scale,
    y: Scale,
}

impl Frame {
    fn px(&self, x: f64) -> f64 {
        self.left + self.x.unit(x) * self.width
    }

    fn py(&self, y: f64) -> f64 {
        self.top + (1.0 - self.y.unit(y)) * self.height
    }

    /// Axes box, ticks with labels and grid lines, axis titles and the panel title. `x_ticks`
    /// is false for category axes, whose labels the caller writes.
    fn draw_axes(&self, svg: &mut Svg, title: &str, x_label: &str, y_label: &str, x_ticks: bool) {
        let (l, t, w, h) = (self.left, self.top, self.width, self.height);
        let _ = writeln!(
            svg.body,
            r##"<rect x="{l:.1}" y="{t:.1}" width="{w:.1}" height="{h:.1}" fill="none" stroke="#444"/>"##
        );
        for (v, label) in self.y.ticks() {
            let y = self.py(v);
            let _ = writeln!(
                svg.body,
                r##"<line x1="{l:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#ddd"/>"##,
                l + w
            );
            svg.text(l - 4.0, y + 3.5, "end", 10.0, &label);
        }
        if x_ticks {
            for (v, label) in self.x.ticks() {
                let x = self.px(v);
                let _ = writeln!(
                    svg.body,
                    r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#444"/>"##,
                    t + h,
                    t + h + 4.0
                );
                svg.text(x, t + h + 15.0, "middle", 10.0, &label);
            }
        }
        svg.text(l + w / 2.0, t - 6.0, "middle", 12.0, title);
        svg.text(l + w / 2.0, t + h + 30.0, "middle", 11.0, x_label);
        let (yx, yy) = (l - 44.0, t + h / 2.0);
        let _ = writeln!(
            svg.body,
            r#"<text x="{yx:.1}" y="{yy:.1}" text-anchor="middle" font-size="11" transform="rotate(-90 {yx:.1} {yy:.1})">{}</text>"#,
            escape(y_label)
        );
    }
}

/// Writes a legend box of coloured entries at `(x, y)`.
fn legend(svg: &mut Svg, x: f64, y: f64, entries: &[(String, String)]) {
    for (i, (label, fill)) in entries.iter().enumerate() {
        let yy = y + i as f64 * 16.0;
        svg.rect(x, yy - 9.0, 10.0, 10.0, fill);
        svg.text(x + 15.0, yy, "start", 11.0, label);
    }
}

/// A spec's family: its name with the bit widths of integer and Lloyd-Max formats removed
/// (`int4-channel/int4-token` → `int-channel/int-token`), so that one line joins its widths.
pub fn family(spec: &str) -> String {
    spec.split('/')
        .map(|part| {
            for prefix in ["int", "sym", "lloyd"] {
                if let Some(rest) = part.strip_prefix(prefix) {
                    return format!("{prefix}{}", rest.trim_start_matches(|c: char| c.is_ascii_digit()));
                }
            }
            part.to_string()
        })
        .collect::<Vec<_>>()
        .join("/")
}

/// Error histograms: one row of panels per layer and, per bit width (the first spec of each
/// width in the report, widest first), one panel for the keys and one for the values.
///
/// # Errors
/// [`PlotError::Empty`] when the report has no histograms (analyze with `histogram_bins > 0`).
pub fn error_histograms(report: &Report) -> Result<String, PlotError> {
    let first = report.layers.first().ok_or(PlotError::Empty("no layers"))?;
    // Column specs: the first row index of each K bit width, widest first.
    let mut columns: Vec<(u8, usize)> = Vec::new();
    for (i, row) in first.rows.iter().enumerate() {
        let bits = KvSpec::parse(&row.spec).map(|s| s.k.bits()).unwrap_or(0);
        if row.k_hist.is_some() && !columns.iter().any(|&(b, _)| b == bits) {
            columns.push((bits, i));
        }
    }
    if columns.is_empty() {
        return Err(PlotError::Empty("the analysis kept no error histograms"));
    }
    columns.sort_by_key(|c| std::cmp::Reverse(c.0));
    let (pw, ph, gap_x, gap_y) = (220.0, 130.0, 70.0, 75.0);
    let cols = columns.len() * 2;
    let mut svg =
        Svg::new(60.0 + cols as f64 * (pw + gap_x), 50.0 + report.layers.len() as f64 * (ph + gap_y));
    svg.text(svg.width / 2.0, 20.0, "middle", 14.0, &format!("Quantization error x̂ − x: {}", report.source));
    for (r, layer) in report.layers.iter().enumerate() {
        for (c, &(_, idx)) in columns.iter().enumerate() {
            let Some(row) = layer.rows.get(idx) else { continue };
            for (side, hist, fill) in
                [(0, &row.k_hist, "hsl(210,65%,45%)"), (1, &row.v_hist, "hsl(25,80%,50%)")]
            {
                let Some(hist) = hist else { continue };
                let left = 60.0 + (c * 2 + side) as f64 * (pw + gap_x);
                let top = 55.0 + r as f64 * (ph + gap_y);
                let title = format!("{} · {} · {}", layer.layer, row.spec, if side == 0 { "K" } else { "V" });
                histogram_panel(&mut svg, left, top, pw, ph, hist, fill, &title);
            }
        }
    }
    Ok(svg.finish())
}

#[allow(clippy::too_many_arguments)]
fn histogram_panel(
    svg: &mut Svg,
    left: f64,
    top: f64,
    width: f64,
    height: f64,
    hist: &Histogram,
    fill: &str,
    title: &str,
) {
    let total: u64 = hist.counts.iter().sum();
    let peak = hist.counts.iter().copied().max().unwrap_or(0) as f64 / total.max(1) as f64;
    let limit = if hist.limit > 0.0 { hist.limit } else { 1.0 };
    let frame = Frame {
        left,
        top,
        width,
        height,
        x: Scale::Linear { lo: -limit, hi: limit },
        y: Scale::linear(0.0, peak),
    };
    let n = hist.counts.len() as f64;
    for (i, &c) in hist.counts.iter().enumerate() {
        let x0 = -limit + 2.0 * limit * i as f64 / n;
        let x1 = -limit + 2.0 * limit * (i + 1) as f64 / n;
        let y = frame.py(c as f64 / total.max(1) as f64);
        let (px0, px1) = (frame.px(x0), frame.px(x1));
        svg.rect(px0, y, (px1 - px0 - 0.3).max(0.3), top + height - y, fill);
    }
    frame.draw_axes(svg, title, &format!("error (|max| {:.2e})", hist.limit), "fraction", false);
    svg.text(left, top + height + 15.0, "start", 10.0, &format!("{:.2e}", -limit));
    svg.text(left + width / 2.0, top + height + 15.0, "middle", 10.0, "0");
    svg.text(left + width, top + height + 15.0, "end", 10.0, &format!("{limit:.2e}"));
}

/// Bits per element (K and V, parameters included) against attention-output error, averaged
/// over the layers, one line per scheme family ([`family`]).
///
/// # Errors
/// [`PlotError::Empty`] for a report without rows.
pub fn bits_vs_error(report: &Report) -> Result<String, PlotError> {
    let first = report.layers.first().ok_or(PlotError::Empty("no layers"))?;
    if first.rows.is_empty() {
        return Err(PlotError::Empty("no specs"));
    }
    let nl = report.layers.len() as f64;
    // (family, [(bits, error)]) in order of first appearance.
    let mut families: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for (i, row) in first.rows.iter().enumerate() {
        let bits =
            report.layers.iter().map(|l| l.rows.get(i).map_or(0.0, |r| r.bits_per_element)).sum::<f64>() / nl;
        let err =
            report.layers.iter().map(|l| l.rows.get(i).map_or(0.0, |r| r.attn_rel_err)).sum::<f64>() / nl;
        let fam = family(&row.spec);
        match families.iter_mut().find(|(f, _)| *f == fam) {
            Some((_, pts)) => pts.push((bits, err)),
            None => families.push((fam, vec![(bits, err)])),
        }
    }
    for (_, pts) in &mut families {
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    let all = || families.iter().flat_map(|(_, p)| p.iter().copied());
    let max_bits = all().map(|p| p.0).fold(0.0, f64::max);
    let frame = Frame {
        left: 80.0,
        top: 50.0,
        width: 520.0,
        height: 360.0,
        x: Scale::linear(0.0, max_bits),
        y: Scale::log(all().map(|p| p.1)),
    };
    let mut svg = Svg::new(860.0, 470.0);
    frame.draw_axes(
        &mut svg,
        &format!("Bits against attention error ({} layers): {}", report.layers.len(), report.source),
        "bits per element (K and V, parameters included)",
        "attention output rel. L2 error",
        true,
    );
    let mut entries = Vec::new();
    for (i, (name, pts)) in families.iter().enumerate() {
        let c = color(i, families.len());
        let pixels: Vec<(f64, f64)> = pts.iter().map(|&(b, e)| (frame.px(b), frame.py(e))).collect();
        svg.polyline(&pixels, &c);
        for &(x, y) in &pixels {
            svg.dot(x, y, &c, false, true);
        }
        entries.push((name.clone(), c));
    }
    legend(&mut svg, 620.0, 60.0, &entries);
    Ok(svg.finish())
}

/// One configuration on a bits-against-loss chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Point {
    /// What the point is (a cache spec, a config file, a llama.cpp cache type).
    pub label: String,
    /// Bits per cached value, everything counted.
    pub bits: f64,
    /// The loss (a mean KL divergence, an error): positive, drawn on a log scale.
    pub loss: f64,
}

impl Point {
    /// Whether the point can be drawn: bits and loss positive and finite (a log scale has no
    /// place for a zero loss).
    pub fn drawable(&self) -> bool {
        self.bits.is_finite() && self.bits > 0.0 && self.loss.is_finite() && self.loss > 0.0
    }
}

/// The configurations of one system (kvq's caches, llama.cpp's cache types) on a
/// bits-against-loss chart.
#[derive(Debug, Clone, PartialEq)]
pub struct Series {
    /// The legend's name.
    pub name: String,
    /// Its points, in any order.
    pub points: Vec<Point>,
}

/// The indices of `points` on their Pareto front: the points no other point beats on both bits
/// and loss, by increasing bits. Ties keep the first point.
pub fn pareto_front(points: &[Point]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..points.len()).collect();
    order.sort_by(|&a, &b| {
        points[a].bits.total_cmp(&points[b].bits).then(points[a].loss.total_cmp(&points[b].loss))
    });
    let mut best = f64::INFINITY;
    order
        .into_iter()
        .filter(|&i| {
            let keep = points[i].loss < best;
            best = best.min(points[i].loss);
            keep
        })
        .collect()
}

/// Bits per value against a loss (log scale), one colour per series: every point drawn, each
/// series' Pareto front ([`pareto_front`]) joined by a line and labelled. Points that are not
/// [`Point::drawable`] are left out.
///
/// # Errors
/// [`PlotError::Empty`] when no series has a point that can be drawn.
pub fn bits_vs_loss(title: &str, loss_label: &str, series: &[Series]) -> Result<String, PlotError> {
    let series: Vec<(&str, Vec<Point>)> = series
        .iter()
        .map(|s| (s.name.as_str(), s.points.iter().filter(|p| p.drawable()).cloned().collect::<Vec<_>>()))
        .filter(|(_, p)| !p.is_empty())
        .collect();
    if series.is_empty() {
        return Err(PlotError::Empty("no point with positive, finite bits and loss"));
    }
    let all = || series.iter().flat_map(|(_, p)| p.iter());
    let frame = Frame {
        left: 80.0,
        top: 50.0,
        width: 620.0,
        height: 400.0,
        x: Scale::linear(0.0, all().map(|p| p.bits).fold(0.0, f64::max)),
        y: Scale::log(all().map(|p| p.loss)),
    };
    let mut svg = Svg::new(1000.0, 510.0);
    frame.draw_axes(
        &mut svg,
        title,
        "bits per value (parameters, window and sinks counted)",
        loss_label,
        true,
    );
    let mut entries = Vec::new();
    for (i, (name, points)) in series.iter().enumerate() {
        let c = color(i, series.len());
        let front = pareto_front(points);
        let pixels: Vec<(f64, f64)> =
            front.iter().map(|&j| (frame.px(points[j].bits), frame.py(points[j].loss))).collect();
        svg.polyline(&pixels, &c);
        for (j, p) in points.iter().enumerate() {
            svg.dot(frame.px(p.bits), frame.py(p.loss), &c, i % 2 == 1, front.contains(&j));
        }
        for (&j, &(x, y)) in front.iter().zip(&pixels) {
            let label: String = points[j].label.chars().take(64).collect();
            svg.text(x + 6.0, y - 5.0, "start", 9.0, &label);
        }
        entries.push((format!("{name} (line: its Pareto front)"), c));
    }
    legend(&mut svg, frame.left + frame.width + 20.0, 60.0, &entries);
    Ok(svg.finish())
}

/// Attention-output error per layer: one group of bars per layer, one bar per spec (log scale).
///
/// # Errors
/// [`PlotError::Empty`] for a report without rows.
pub fn layer_errors(report: &Report) -> Result<String, PlotError> {
    let first = report.layers.first().ok_or(PlotError::Empty("no layers"))?;
    let specs: Vec<&str> = first.rows.iter().map(|r| r.spec.as_str()).collect();
    if specs.is_empty() {
        return Err(PlotError::Empty("no specs"));
    }
    let group_w = (specs.len() as f64 * 12.0 + 30.0).max(80.0);
    let width = report.layers.len() as f64 * group_w;
    let frame = Frame {
        left: 80.0,
        top: 50.0,
        width,
        height: 320.0,
        x: Scale::Linear { lo: 0.0, hi: 1.0 },
        y: Scale::log(report.layers.iter().flat_map(|l| l.rows.iter().map(|r| r.attn_rel_err))),
    };
    let mut svg = Svg::new(width + 330.0, 440.0f64.max(70.0 + specs.len() as f64 * 16.0));
    frame.draw_axes(&mut svg, "Attention error per layer", "layer", "attention output rel. L2 error", false);
    let floor = frame.top + frame.height;
    for (l, layer) in report.layers.iter().enumerate() {
        let x0 = frame.left + l as f64 * group_w + 15.0;
        for (i, row) in layer.rows.iter().enumerate() {
            let y = frame.py(row.attn_rel_err);
            svg.rect(x0 + i as f64 * 12.0, y, 10.0, floor - y, &color(i, specs.len()));
        }
        svg.text(frame.left + (l as f64 + 0.5) * group_w, floor + 15.0, "middle", 11.0, &layer.layer);
    }
    let entries: Vec<(String, String)> =
        specs.iter().enumerate().map(|(i, s)| (s.to_string(), color(i, specs.len()))).collect();
    legend(&mut svg, frame.left + width + 20.0, 60.0, &entries);
    Ok(svg.finish())
}

/// The figures' file names, as [`write_all`] writes them.
pub const FIGURES: [&str; 3] = ["error-histograms.svg", "bits-vs-error.svg", "layer-errors.svg"];

/// Checks, before an analysis runs, that [`write_all`] may write its figures into `dir`:
/// `dir` is a directory (or absent), and every figure's path passes
/// [`kvq_quant_core::io::check_output`].
///
/// # Errors
/// [`PlotError::Io`] naming the path refused.
pub fn check_targets(dir: &Path, inputs: &[&Path], force: bool) -> Result<(), PlotError> {
    if dir.exists() && !dir.is_dir() {
        let source = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a directory");
        return Err(PlotError::Io { path: dir.to_path_buf(), source });
    }
    for name in FIGURES {
        let path = dir.join(name);
        kvq_quant_core::io::check_output(&path, inputs, force)
            .map_err(|source| PlotError::Io { path, source })?;
    }
    Ok(())
}

/// Writes the figures into `dir` (created if missing), all or none, and returns their paths:
/// `error-histograms.svg` (when the report kept histograms), `bits-vs-error.svg` and
/// `layer-errors.svg`. Each path follows [`kvq_quant_core::io::check_output`]'s rules
/// (`inputs` are the command's input files; `force` replaces files that are not writable);
/// a replaced figure keeps its permissions.
///
/// # Errors
/// [`PlotError::Io`] when the directory or a file cannot be written or is refused (nothing is
/// replaced then), [`PlotError::Empty`] for a report without rows.
pub fn write_all(
    report: &Report,
    dir: &Path,
    inputs: &[&Path],
    force: bool,
) -> Result<Vec<PathBuf>, PlotError> {
    let mut figures = vec![(FIGURES[1], bits_vs_error(report)?), (FIGURES[2], layer_errors(report)?)];
    match error_histograms(report) {
        Ok(svg) => figures.insert(0, (FIGURES[0], svg)),
        Err(PlotError::Empty(_)) => {}
        Err(e) => return Err(e),
    }
    std::fs::create_dir_all(dir).map_err(|source| PlotError::Io { path: dir.to_path_buf(), source })?;
    let files: Vec<(PathBuf, Vec<u8>)> =
        figures.into_iter().map(|(name, svg)| (dir.join(name), svg.into_bytes())).collect();
    kvq_quant_core::io::write_outputs(&files, inputs, force)
        .map_err(|(path, source)| PlotError::Io { path, source })?;
    Ok(files.into_iter().map(|(p, _)| p).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn point(label: &str, bits: f64, loss: f64) -> Point {
        Point { label: label.into(), bits, loss }
    }

    #[test]
    fn the_front_keeps_points_nothing_beats() {
        let pts = [
            point("a", 4.0, 0.01),
            point("b", 3.0, 0.05),
            point("c", 5.0, 0.02), // beaten by a
            point("d", 8.0, 0.001),
            point("e", 3.0, 0.04), // same bits as b, lower loss: b is beaten
        ];
        assert_eq!(pareto_front(&pts), [4, 0, 3]);
        assert!(pareto_front(&[]).is_empty());
    }

    #[test]
    fn a_loss_chart_draws_every_drawable_point_and_labels_the_front() {
        let kvq = Series {
            name: "kvq".into(),
            points: vec![point("int4", 5.4, 1.4e-3), point("int3", 4.5, 6.7e-3), point("worse", 6.0, 2e-3)],
        };
        let other = Series {
            name: "llama.cpp".into(),
            points: vec![point("q4_0", 4.5, 0.05), point("zero", 8.0, 0.0), point("nan", f64::NAN, 0.1)],
        };
        let svg = bits_vs_loss("title <&>", "mean KL", &[kvq, other]).unwrap();
        assert_eq!(svg.matches("<circle").count(), 3);
        assert_eq!(svg.matches("<rect x=").count(), 1 + 1 + 2, "frame, one square, two legend boxes");
        assert_eq!(svg.matches("<polyline").count(), 2);
        assert!(svg.contains(">int4<") && svg.contains(">int3<") && svg.contains(">q4_0<"));
        assert!(!svg.contains(">worse<") && !svg.contains(">zero<"), "only the front is labelled");
        assert!(svg.contains("title &lt;&amp;&gt;"));
        let empty = Series { name: "none".into(), points: vec![point("zero", 4.0, 0.0)] };
        assert!(matches!(bits_vs_loss("t", "l", &[empty]), Err(PlotError::Empty(_))));
    }

    #[test]
    fn families_drop_bit_widths() {
        assert_eq!(family("int4-channel/int4-token"), "int-channel/int-token");
        assert_eq!(family("int8-g32"), "int-g32");
        assert_eq!(family("sym4-token"), "sym-token");
        assert_eq!(family("lloyd3-g32"), "lloyd-g32");
        assert_eq!(family("fp8e4m3-token"), "fp8e4m3-token");
        assert_eq!(family("nf4-token"), "nf4-token");
    }

    #[test]
    fn scales_map_and_tick() {
        let s = Scale::linear(0.0, 9.3);
        assert_eq!(s, Scale::Linear { lo: 0.0, hi: 10.0 });
        assert_eq!(s.unit(5.0), 0.5);
        assert_eq!(
            s.ticks().iter().map(|t| t.1.as_str()).collect::<Vec<_>>(),
            ["0", "2", "4", "6", "8", "10"]
        );
        let l = Scale::log([2e-3, 0.3].into_iter());
        assert_eq!(l, Scale::Log { lo_exp: -3, hi_exp: 0 });
        assert!((l.unit(1e-2) - 1.0 / 3.0).abs() < 1e-12);
        assert_eq!(l.unit(0.0), 0.0);
        assert_eq!(l.ticks().len(), 4);
        assert_eq!(Scale::log(std::iter::empty()), Scale::Log { lo_exp: -1, hi_exp: 0 });
        assert_eq!(nice_step(0.13), 0.2);
        assert_eq!(nice_step(3.0), 5.0);
        assert_eq!(nice_step(0.0), 1.0);
    }

    #[test]
    fn histograms_count_every_element() {
        let r = [0.0f32, 0.0, 0.0, 0.0];
        let h = Histogram::of_errors(&r, &[-1.0, 1.0, 0.0, 0.25], 4);
        assert_eq!(h.limit, 1.0);
        assert_eq!(h.counts, vec![1, 0, 2, 1]);
        let z = Histogram::of_errors(&r, &r, 5);
        assert_eq!(z.counts, vec![0, 0, 4, 0, 0]);
    }
}
