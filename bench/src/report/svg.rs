//! Line charts as hand-written SVG: axes with ticks, labels, a legend, optional log y axis.

use std::fmt::Write;

use super::WorkloadReport;

/// One line of a chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    pub label: String,
    pub color: &'static str,
    pub dashed: bool,
    /// Drawn thicker (the policy under test).
    pub bold: bool,
    pub points: Vec<(f64, f64)>,
}

/// A chart.
#[derive(Clone, Debug, PartialEq)]
pub struct Chart {
    pub title: String,
    pub x_label: String,
    pub y_label: String,
    pub log_y: bool,
    /// A fixed top of a linear y axis (e.g. 1 for a rate).
    pub y_max: Option<f64>,
    pub series: Vec<Series>,
}

/// A fixed color per policy, so that every chart reads the same; kvoy stands out in red.
fn color_of(policy: &str, index: usize) -> &'static str {
    match policy {
        "kvoy" => "#d62728",
        "kvoy-aggregator" => "#ff7f0e",
        "llm-d" => "#1f77b4",
        "sglang" => "#2ca02c",
        "round-robin" => "#7f7f7f",
        "least-request" => "#8c564b",
        "random" => "#e377c2",
        _ => PALETTE[index % PALETTE.len()],
    }
}

pub const PALETTE: [&str; 8] = [
    "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// Series of more points than this are drawn without a marker on each.
const MAX_MARKERS: usize = 60;

const W: f64 = 760.0;
const H: f64 = 460.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 210.0;
const TOP: f64 = 44.0;
const BOTTOM: f64 = 62.0;

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// 1, 2 or 5 times a power of ten, about `span / 5`.
fn nice_step(span: f64) -> f64 {
    if !(span.is_finite() && span > 0.0) {
        return 1.0;
    }
    let raw = span / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let m = if f < 1.5 {
        1.0
    } else if f < 3.5 {
        2.0
    } else if f < 7.5 {
        5.0
    } else {
        10.0
    };
    m * mag
}

fn tick_label(v: f64) -> String {
    let a = v.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 1e4 {
        format!("{:.0}k", v / 1e3)
    } else if a >= 1.0 {
        let s = format!("{v:.2}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    } else {
        let s = format!("{v:.4}");
        s.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

impl Chart {
    /// The SVG document.
    pub fn render(&self) -> String {
        let points = || self.series.iter().flat_map(|s| s.points.iter().copied());
        let usable = |&(_, y): &(f64, f64)| y.is_finite() && (!self.log_y || y > 0.0);
        let x_max = points().map(|p| p.0).fold(0.0f64, f64::max).max(1e-9) * 1.05;
        let (mut y_lo, mut y_hi) = points()
            .filter(usable)
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), (_, y)| {
                (lo.min(y), hi.max(y))
            });
        if !y_lo.is_finite() {
            (y_lo, y_hi) = if self.log_y { (0.1, 1.0) } else { (0.0, 1.0) };
        }
        let (y_min, y_max, y_ticks) = if self.log_y {
            let lo = y_lo.log10().floor();
            let hi = y_hi.log10().ceil().max(lo + 1.0);
            let mut ticks = Vec::new();
            let mut e = lo;
            while e <= hi + 1e-9 {
                for m in [1.0, 2.0, 5.0] {
                    let v = m * 10f64.powf(e);
                    if v <= 10f64.powf(hi) * 1.0001 && (hi - lo <= 2.0 || m == 1.0) {
                        ticks.push(v);
                    }
                }
                e += 1.0;
            }
            (10f64.powf(lo), 10f64.powf(hi), ticks)
        } else if let Some(top) = self.y_max {
            let step = nice_step(top);
            let ticks = (0..=((top / step).round() as usize))
                .map(|i| i as f64 * step)
                .collect();
            (0.0, top, ticks)
        } else {
            let hi = y_hi.max(0.0) * 1.08;
            let step = nice_step(hi);
            let top = (hi / step).ceil() * step;
            let ticks = (0..=((top / step).round() as usize))
                .map(|i| i as f64 * step)
                .collect();
            (0.0, top.max(step), ticks)
        };
        let pw = W - LEFT - RIGHT;
        let ph = H - TOP - BOTTOM;
        let sx = |x: f64| LEFT + x / x_max * pw;
        let sy = |y: f64| {
            let f = if self.log_y {
                (y.log10() - y_min.log10()) / (y_max.log10() - y_min.log10())
            } else {
                (y - y_min) / (y_max - y_min)
            };
            TOP + ph * (1.0 - f.clamp(0.0, 1.0))
        };

        let mut s = String::new();
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
        );
        let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
        let _ = writeln!(
            s,
            r#"<text x="{}" y="24" font-size="15" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            escape(&self.title)
        );
        // Grid and ticks.
        for &t in &y_ticks {
            let y = sy(t);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e5e5e5"/><text x="{:.1}" y="{:.1}" text-anchor="end">{}</text>"##,
                LEFT + pw,
                LEFT - 6.0,
                y + 4.0,
                tick_label(t)
            );
        }
        let x_step = nice_step(x_max);
        let mut x = 0.0;
        while x <= x_max + 1e-9 {
            let px = sx(x);
            let _ = writeln!(
                s,
                r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#f0f0f0"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
                TOP + ph,
                TOP + ph + 18.0,
                tick_label(x)
            );
            x += x_step;
        }
        let _ = writeln!(
            s,
            r#"<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="black"/>"#
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
            LEFT + pw / 2.0,
            H - 18.0,
            escape(&self.x_label)
        );
        let _ = writeln!(
            s,
            r#"<text transform="translate(22 {:.1}) rotate(-90)" text-anchor="middle">{}</text>"#,
            TOP + ph / 2.0,
            escape(&self.y_label)
        );
        // Lines (the bold series last, on top), then the legend in series order.
        let dash_of = |series: &Series| {
            if series.dashed {
                r#" stroke-dasharray="6 4" stroke-opacity="0.75""#
            } else {
                ""
            }
        };
        let width_of = |series: &Series| if series.bold { 3.5 } else { 1.8 };
        let drawing_order = self
            .series
            .iter()
            .filter(|x| !x.bold)
            .chain(self.series.iter().filter(|x| x.bold));
        for series in drawing_order {
            let (dash, width) = (dash_of(series), width_of(series));
            let pts: Vec<(f64, f64)> = series.points.iter().copied().filter(usable).collect();
            let path: Vec<String> = pts
                .iter()
                .map(|&(x, y)| format!("{:.1},{:.1}", sx(x), sy(y)))
                .collect();
            if !path.is_empty() {
                let _ = writeln!(
                    s,
                    r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="{width}"{dash}/>"#,
                    path.join(" "),
                    series.color
                );
            }
            // A long series (a time series) is a line: markers would hide it.
            let markers = if pts.len() <= MAX_MARKERS {
                &pts[..]
            } else {
                &[]
            };
            for &(x, y) in markers {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{}"/>"#,
                    sx(x),
                    sy(y),
                    series.color
                );
            }
        }
        for (i, series) in self.series.iter().enumerate() {
            let (dash, width) = (dash_of(series), width_of(series));
            let ly = TOP + 10.0 + i as f64 * 18.0;
            let lx = W - RIGHT + 16.0;
            let _ = writeln!(
                s,
                r#"<line x1="{lx}" y1="{ly}" x2="{}" y2="{ly}" stroke="{}" stroke-width="{width}"{dash}/><text x="{}" y="{}">{}</text>"#,
                lx + 26.0,
                series.color,
                lx + 32.0,
                ly + 4.0,
                escape(&series.label)
            );
        }
        s.push_str("</svg>\n");
        s
    }
}

/// The three charts of a workload: TTFT (p50 dashed, p90 solid; log scale), output throughput
/// and hit rate (with the ideal), each against the offered load.
pub fn charts(w: &WorkloadReport, policies: &[String]) -> Vec<(&'static str, String)> {
    let series = |metric: &dyn Fn(&crate::metrics::RunFigures) -> f64, suffix: &str, dashed| {
        policies
            .iter()
            .enumerate()
            .map(|(i, p)| Series {
                label: format!("{p}{suffix}"),
                color: color_of(p, i),
                dashed,
                bold: p == "kvoy",
                points: w
                    .rates
                    .iter()
                    .filter_map(|&rate| w.run(p, rate).map(|r| (rate, metric(r))))
                    .collect(),
            })
            .collect::<Vec<_>>()
    };
    let x_label = format!(
        "offered load, requests/s (saturation estimate {:.1})",
        w.saturation.rate
    );
    let mut ttft = series(&|r| r.ttft_s.p90, " p90", false);
    ttft.extend(series(&|r| r.ttft_s.p50, " p50", true));
    let mut hit = series(&|r| r.hit_rate, "", false);
    hit.push(Series {
        label: "ideal".into(),
        color: "#000000",
        dashed: true,
        bold: false,
        points: w
            .rates
            .iter()
            .filter_map(|&rate| {
                w.runs
                    .iter()
                    .find(|r| r.rate == rate)
                    .map(|r| (rate, r.ideal_hit_rate))
            })
            .collect(),
    });
    vec![
        (
            "ttft",
            Chart {
                title: format!("{}: time to first token (p90 solid, p50 dashed)", w.name),
                x_label: x_label.clone(),
                y_label: "TTFT, seconds (log)".into(),
                log_y: true,
                y_max: None,
                series: ttft,
            }
            .render(),
        ),
        (
            "throughput",
            Chart {
                title: format!("{}: output throughput", w.name),
                x_label: x_label.clone(),
                y_label: "output tokens/s".into(),
                log_y: false,
                y_max: None,
                series: series(&|r| r.output_tokens_per_s, "", false),
            }
            .render(),
        ),
        (
            "hit-rate",
            Chart {
                title: format!("{}: prefix-cache hit rate", w.name),
                x_label,
                y_label: "cached prompt tokens / prompt tokens".into(),
                log_y: false,
                y_max: Some(1.0),
                series: hit,
            }
            .render(),
        ),
    ]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_axes_lines_and_legend() {
        let chart = Chart {
            title: "a < b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_y: true,
            y_max: None,
            series: vec![Series {
                label: "kvoy".into(),
                color: PALETTE[0],
                dashed: true,
                bold: true,
                points: vec![(1.0, 0.05), (2.0, 3.0), (3.0, 0.0)],
            }],
        };
        let svg = chart.render();
        assert!(svg.starts_with("<svg") && svg.ends_with("</svg>\n"));
        assert!(svg.contains("a &lt; b"));
        assert!(svg.contains("<polyline"));
        assert!(svg.contains("stroke-dasharray"));
        assert_eq!(
            svg.matches("<circle").count(),
            2,
            "the zero is off a log axis"
        );
        assert!(svg.contains(">kvoy</text>"));
    }

    #[test]
    fn long_series_have_no_markers() {
        let chart = |n: usize| {
            Chart {
                title: "t".into(),
                x_label: "x".into(),
                y_label: "y".into(),
                log_y: false,
                y_max: None,
                series: vec![Series {
                    label: "s".into(),
                    color: PALETTE[1],
                    dashed: false,
                    bold: false,
                    points: (0..n).map(|i| (i as f64, 1.0)).collect(),
                }],
            }
            .render()
        };
        assert_eq!(chart(MAX_MARKERS).matches("<circle").count(), MAX_MARKERS);
        let long = chart(MAX_MARKERS + 1);
        assert_eq!(long.matches("<circle").count(), 0);
        assert!(long.contains("<polyline"));
    }

    #[test]
    fn nice_steps() {
        assert_eq!(nice_step(10.0), 2.0);
        assert_eq!(nice_step(100.0), 20.0);
        assert_eq!(nice_step(3.0), 0.5);
        assert_eq!(tick_label(2.50), "2.5");
        assert_eq!(tick_label(20000.0), "20k");
    }
}
