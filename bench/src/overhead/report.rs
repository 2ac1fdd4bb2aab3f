//! The overhead report's views: a Markdown table and an SVG chart of the added latency.

use std::fmt::Write;

use super::{Cell, OverheadReport};
use crate::report::svg::{Chart, Series};
use crate::report::table;

/// The design's targets for the added p50 (DESIGN.md): 0.1 ms at 8k-token prompts, 0.3 ms at
/// 100k, flat up to 150 concurrent requests.
pub const TARGET_P50_MS: [(u32, f64); 2] = [(8_000, 0.1), (100_000, 0.3)];

/// Issue 17: kvoy's added p50 at most this fraction of the external picker's, at every size.
pub const TARGET_OVER_EXT_PROC: f64 = 0.2;

fn ms(v: f64) -> String {
    if v.abs() < 10.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.1}")
    }
}

fn signed(v: f64) -> String {
    if v >= 0.0 {
        format!("+{}", ms(v))
    } else {
        ms(v)
    }
}

/// The Markdown summary.
pub fn summary(r: &OverheadReport) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "# kvoy-bench overhead\n");
    let _ = writeln!(
        s,
        "Added latency of Envoy with the kvoy filters over plain Envoy (`ROUND_ROBIN`, no \
         filter), same {} echo backends, {}, {} workers each; keep-alive clients, non-streamed \
         completions with a one-token reply, every prompt distinct; the proxies alternate in {} \
         rounds per row; the kvoy filter runs {}. Latencies in milliseconds.\n",
        r.backends,
        r.envoy,
        r.workers,
        r.rounds,
        r.stages.describe()
    );
    let direct = r.measured("direct");
    let mut columns = vec![
        "prompt tokens",
        "body",
        "concurrency",
        "Envoy p50 / p99",
        "kvoy p50 / p99",
        "**added p50**",
        "added p99",
        "kvoy req/s vs Envoy",
    ];
    if direct {
        columns.push("direct p50");
    }
    columns.push("errors");
    let _ = writeln!(s, "{}", table::head(&columns, 0));
    for (tokens, conc) in r.grid() {
        let (Some(e), Some(k)) = (r.cell(tokens, conc, "envoy"), r.cell(tokens, conc, "kvoy"))
        else {
            continue;
        };
        let errors: usize = r
            .cells
            .iter()
            .filter(|c| c.prompt_tokens == tokens && c.concurrency == conc)
            .map(|c| c.errors)
            .sum();
        let _ = write!(
            s,
            "| {} | {} KB | {} | {} / {} | {} / {} | **{}** | {} | {} |",
            tokens,
            e.body_bytes / 1024,
            conc,
            ms(e.latency.p50_ms),
            ms(e.latency.p99_ms),
            ms(k.latency.p50_ms),
            ms(k.latency.p99_ms),
            signed(k.latency.p50_ms - e.latency.p50_ms),
            signed(k.latency.p99_ms - e.latency.p99_ms),
            ratio(k.requests_per_s, e.requests_per_s),
        );
        if direct {
            let d = r
                .cell(tokens, conc, "direct")
                .map_or("-".into(), |d| ms(d.latency.p50_ms));
            let _ = write!(s, " {d} |");
        }
        let _ = writeln!(s, " {errors} |");
    }
    let _ = writeln!(s, "\nTargets (DESIGN.md): added p50 <= 0.1 ms at 8k-token prompts, <= 0.3 ms at 100k, flat up to 150 concurrent requests.\n");
    for (tokens, target) in TARGET_P50_MS {
        for (t, conc) in r.grid() {
            if t != tokens {
                continue;
            }
            if let Some((p50, _)) = r.added_ms(t, conc) {
                let verdict = if p50 <= target { "met" } else { "missed" };
                let _ = writeln!(
                    s,
                    "- {tokens} tokens, concurrency {conc}: added p50 {} ms against {target} ms: {verdict}",
                    signed(p50)
                );
            }
        }
    }
    floor_section(&mut s, r);
    ext_proc_section(&mut s, r);
    cpu_section(&mut s, r);
    host_call_section(&mut s, r);
    let errors: Vec<String> = r
        .cells
        .iter()
        .filter_map(|c| {
            c.first_error.as_ref().map(|e| {
                format!(
                    "- {} at {} tokens, concurrency {}: {} errors, first: {e}",
                    c.proxy, c.prompt_tokens, c.concurrency, c.errors
                )
            })
        })
        .collect();
    if !errors.is_empty() {
        let _ = writeln!(s, "\nErrors:\n\n{}", errors.join("\n"));
    }
    s
}

fn ratio(part: f64, whole: f64) -> String {
    if whole > 0.0 {
        format!("{:.2}x", part / whole)
    } else {
        "-".into()
    }
}

/// One row of a table that puts kvoy beside another proxy: the three cells of a grid point.
struct Beside<'a> {
    tokens: u32,
    conc: usize,
    envoy: &'a Cell,
    kvoy: &'a Cell,
    other: &'a Cell,
}

impl Beside<'_> {
    /// What `cell`'s proxy adds to plain Envoy's p50 and p99, milliseconds, signed.
    fn added(&self, cell: &Cell) -> (String, String) {
        (
            signed(cell.latency.p50_ms - self.envoy.latency.p50_ms),
            signed(cell.latency.p99_ms - self.envoy.latency.p99_ms),
        )
    }

    /// `cell`'s requests per second against plain Envoy's.
    fn throughput(&self, cell: &Cell) -> String {
        ratio(cell.requests_per_s, self.envoy.requests_per_s)
    }
}

/// A section that puts kvoy beside `other`, both over plain Envoy, written only when `other`
/// was measured: `intro`, then a table of `columns` with a row from `row` for every grid point
/// where all three were measured, in grid order.
fn beside_section(
    s: &mut String,
    r: &OverheadReport,
    other: &str,
    intro: &str,
    columns: &[&str],
    row: impl Fn(&Beside<'_>) -> String,
) {
    if !r.measured(other) {
        return;
    }
    let _ = writeln!(s, "{intro}");
    let _ = writeln!(s, "{}", table::head(columns, 0));
    for (tokens, conc) in r.grid() {
        let (Some(envoy), Some(kvoy), Some(other)) = (
            r.cell(tokens, conc, "envoy"),
            r.cell(tokens, conc, "kvoy"),
            r.cell(tokens, conc, other),
        ) else {
            continue;
        };
        let b = Beside {
            tokens,
            conc,
            envoy,
            kvoy,
            other,
        };
        let _ = writeln!(s, "| {} | {} | {} |", b.tokens, b.conc, row(&b));
    }
}

/// kvoy next to the wasm floor (the minimal body-routing filter in kvoy's bootstrap), both
/// over plain Envoy: how much of what kvoy adds any such filter would add on this Envoy.
fn floor_section(s: &mut String, r: &OverheadReport) {
    let intro = "\n## The wasm floor\n\n\
         kvoy's bootstrap with `kvoy_floor.wasm` (`bench/floor/`) in the filter's place: it holds \
         the headers, lets Envoy buffer the body, copies it into the VM, hashes it and sets the \
         destination header; no parsing, index, shared data or metrics. What it adds is the cost \
         of any filter that routes on the body in this Envoy's V8; the last column is kvoy's own \
         work.\n";
    let columns = [
        "prompt tokens",
        "concurrency",
        "floor added p50",
        "kvoy added p50",
        "floor req/s vs Envoy",
        "kvoy req/s vs Envoy",
        "**kvoy p50 - floor p50**",
    ];
    beside_section(s, r, "floor", intro, &columns, |b| {
        format!(
            "{} | {} | {} | {} | **{}**",
            b.added(b.other).0,
            b.added(b.kvoy).0,
            b.throughput(b.other),
            b.throughput(b.kvoy),
            signed(b.kvoy.latency.p50_ms - b.other.latency.p50_ms),
        )
    });
}

/// kvoy next to the external picker (Envoy's ext_proc filter and the same picker over gRPC),
/// both over plain Envoy.
fn ext_proc_section(s: &mut String, r: &OverheadReport) {
    let intro = "\n## The external picker (ext_proc)\n\n\
         The same kvoy-shared picker served natively as an Envoy ext_proc server on 127.0.0.1 \
         (`envoy.filters.http.ext_proc`, gRPC over HTTP/2, request headers sent, body BUFFERED, \
         the destination header set in the body's answer, no response phase; \
         `bench/envoy/extproc.yaml`): what an EPP-style deployment costs at best. Every request \
         was checked to arrive at the endpoint the picker chose. kvoy is the `kvoy` filter as \
         `envoy/kvoy.yaml` runs it. \
         Added over plain Envoy, milliseconds:\n";
    let versus_column =
        format!("**kvoy added p50 / ext_proc's** (target <= {TARGET_OVER_EXT_PROC})");
    let columns = [
        "prompt tokens",
        "concurrency",
        "kvoy added p50 / p99",
        "ext_proc added p50 / p99",
        "kvoy req/s vs Envoy",
        "ext_proc req/s vs Envoy",
        versus_column.as_str(),
    ];
    beside_section(s, r, "ext_proc", intro, &columns, |b| {
        let versus = r
            .kvoy_over_ext_proc(b.tokens, b.conc)
            .map_or("-".into(), |f| {
                let verdict = if f <= TARGET_OVER_EXT_PROC {
                    "met"
                } else {
                    "missed"
                };
                format!("{f:.2} ({verdict})")
            });
        let (kvoy_p50, kvoy_p99) = b.added(b.kvoy);
        let (ext_p50, ext_p99) = b.added(b.other);
        format!(
            "{kvoy_p50} / {kvoy_p99} | {ext_p50} / {ext_p99} | {} | {} | **{versus}**",
            b.throughput(b.kvoy),
            b.throughput(b.other),
        )
    });
}

/// Each Envoy's CPU time per request, and what kvoy and the floor add to plain Envoy's: on a
/// machine whose cores are shared by the client, the backends and every proxy, the concurrent
/// rows' throughput is CPU per request, and this is the part of it each proxy's own process
/// spent.
fn cpu_section(s: &mut String, r: &OverheadReport) {
    let cpu = |c: Option<&Cell>| c.and_then(|c| c.envoy_cpu_us_per_request);
    let rows: Vec<(u32, usize, f64, f64)> = r
        .grid()
        .into_iter()
        .filter_map(|(t, c)| {
            Some((
                t,
                c,
                cpu(r.cell(t, c, "envoy"))?,
                cpu(r.cell(t, c, "kvoy"))?,
            ))
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let floor = r.measured("floor");
    let ext_proc = r.measured("ext_proc");
    let _ = writeln!(
        s,
        "\n## CPU per request\n\n\
         The Envoy process's CPU time (all threads, user and system, from \
         `/proc/PID/task/*/schedstat`) over the measured loads, divided by the requests \
         answered, microseconds. On these shared cores the concurrent rows' throughput is CPU \
         per request; this is each proxy's own share of it.{}\n",
        if ext_proc {
            " ext_proc's is Envoy's alone: its picker runs in the benchmark's process."
        } else {
            ""
        }
    );
    let mut columns = vec![
        "prompt tokens",
        "concurrency",
        "Envoy",
        "kvoy",
        "**kvoy added**",
    ];
    if floor {
        columns.extend(["floor", "floor added", "kvoy - floor"]);
    }
    if ext_proc {
        columns.push("ext_proc's Envoy");
    }
    let _ = writeln!(s, "{}", table::head(&columns, 0));
    for (t, c, e, k) in rows {
        let _ = write!(s, "| {t} | {c} | {e:.0} | {k:.0} | **{:+.0}**", k - e);
        if floor {
            match cpu(r.cell(t, c, "floor")) {
                Some(f) => {
                    let _ = write!(s, " | {f:.0} | {:+.0} | {:+.0}", f - e, k - f);
                }
                None => s.push_str(" | - | - | -"),
            }
        }
        if ext_proc {
            match cpu(r.cell(t, c, "ext_proc")) {
                Some(x) => {
                    let _ = write!(s, " | {x:.0}");
                }
                None => s.push_str(" | -"),
            }
        }
        s.push_str(" |\n");
    }
}

/// What one host call costs on this Envoy: the floor with `r.host_calls` more clock reads, and
/// more shared-data reads, per request against the plain floor, per call, in CPU and p50.
fn host_call_section(s: &mut String, r: &OverheadReport) {
    if r.host_calls == 0 {
        return;
    }
    let n = f64::from(r.host_calls);
    // Per call: Envoy CPU (us) and p50 (us) of `proxy` over the floor's.
    let per_call = |floor: &Cell, calls: Option<&Cell>| {
        let Some(calls) = calls else {
            return "-".to_owned();
        };
        let cpu = match (
            floor.envoy_cpu_us_per_request,
            calls.envoy_cpu_us_per_request,
        ) {
            (Some(f), Some(k)) => format!("{:.2}", (k - f) / n),
            _ => "-".into(),
        };
        format!(
            "**{cpu}** / {:.2}",
            (calls.latency.p50_ms - floor.latency.p50_ms) * 1e3 / n
        )
    };
    let rows: Vec<String> = r
        .grid()
        .into_iter()
        .filter_map(|(t, c)| {
            let floor = r.cell(t, c, "floor")?;
            Some(format!(
                "| {t} | {c} | {} | {} | {} |",
                ms(floor.latency.p50_ms),
                per_call(floor, r.cell(t, c, super::FLOOR_CALLS)),
                per_call(floor, r.cell(t, c, super::FLOOR_SHARED)),
            ))
        })
        .collect();
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "\n## What one host call costs\n\n\
         The floor against itself making {} more host calls per request, side by side in the \
         same rounds, per call: clock reads (`proxy_get_current_time_nanoseconds`: no data \
         copied, no allocation in the VM), the cost of one crossing from the VM into Envoy and \
         back; and reads of a 64-byte shared-data value (Envoy's process-wide lock, the copy, \
         and one more VM entry: Envoy allocates its answer in the VM). Envoy's CPU per call, \
         then the p50 per call, microseconds.\n",
        r.host_calls
    );
    let columns = [
        "prompt tokens",
        "concurrency",
        "floor p50, ms",
        "**a clock read**: CPU / p50, us",
        "**a shared-data read**: CPU / p50, us",
    ];
    let _ = writeln!(s, "{}", table::head(&columns, 0));
    for row in rows {
        let _ = writeln!(s, "{row}");
    }
}

/// Added latency (p50 solid, p99 dashed) against the prompt size, one line per concurrency.
pub fn chart(r: &OverheadReport) -> String {
    const COLORS: [&str; 6] = [
        "#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b",
    ];
    let mut concurrency: Vec<usize> = r.grid().into_iter().map(|(_, c)| c).collect();
    concurrency.sort_unstable();
    concurrency.dedup();
    let mut series = Vec::new();
    for (q, dashed) in [(0usize, false), (1, true)] {
        for (i, &conc) in concurrency.iter().enumerate() {
            let points = r
                .grid()
                .into_iter()
                .filter(|&(_, c)| c == conc)
                .filter_map(|(t, c)| {
                    r.added_ms(t, c)
                        .map(|a| (f64::from(t) / 1000.0, if q == 0 { a.0 } else { a.1 }))
                })
                .collect();
            series.push(Series {
                label: format!("concurrency {conc} {}", if dashed { "p99" } else { "p50" }),
                color: COLORS[i % COLORS.len()],
                dashed,
                bold: false,
                points,
            });
        }
    }
    Chart {
        title: "Latency kvoy's filters add over plain Envoy".into(),
        x_label: "prompt size, thousands of tokens".into(),
        y_label: "added latency, ms (p50 solid, p99 dashed)".into(),
        log_y: false,
        y_max: None,
        series,
    }
    .render()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::super::{Latency, Stages};
    use super::*;

    fn cell(tokens: u32, conc: usize, proxy: &str, p50: f64) -> Cell {
        Cell {
            prompt_tokens: tokens,
            body_bytes: tokens as usize * 4 + 60,
            concurrency: conc,
            proxy: proxy.into(),
            requests: 100,
            errors: 0,
            first_error: None,
            latency: Latency {
                p50_ms: p50,
                p90_ms: p50 * 1.5,
                p99_ms: p50 * 2.0,
                mean_ms: p50,
            },
            requests_per_s: 1000.0 / p50,
            envoy_cpu_us_per_request: None,
        }
    }

    fn report(cells: Vec<Cell>) -> OverheadReport {
        OverheadReport {
            tool: "kvoy-bench overhead".into(),
            envoy: "1.40.0".into(),
            workers: 2,
            backends: 4,
            rounds: 2,
            stages: Stages::ALL,
            host_calls: 0,
            cells,
        }
    }

    #[test]
    fn the_summary_states_added_latency_and_the_verdicts() {
        let r = report(vec![
            cell(8_000, 1, "envoy", 1.0),
            cell(8_000, 1, "kvoy", 1.05),
            cell(100_000, 1, "envoy", 4.0),
            cell(100_000, 1, "kvoy", 4.5),
        ]);
        assert!(!summary(&r).contains("ext_proc"));
        assert_eq!(
            r.added_ms(8_000, 1),
            Some((0.050000000000000044, 0.10000000000000009))
        );
        let md = summary(&r);
        assert!(
            md.contains("| 8000 | 31 KB | 1 | 1.00 / 2.00 | 1.05 / 2.10 | **+0.05** |"),
            "{md}"
        );
        assert!(md.contains("8000 tokens, concurrency 1: added p50 +0.05 ms against 0.1 ms: met"));
        assert!(
            md.contains("100000 tokens, concurrency 1: added p50 +0.50 ms against 0.3 ms: missed")
        );
        let svg = chart(&r);
        assert!(svg.starts_with("<svg") && svg.contains("concurrency 1 p50"));
        let json = r.to_json().unwrap();
        let back: OverheadReport = serde_json::from_str(&json).unwrap();
        // serde_json's default float parsing may differ in the last bit; compare decisions.
        assert_eq!(back.grid(), r.grid());
        assert_eq!(back.cell(100_000, 1, "kvoy").unwrap().latency.p50_ms, 4.5);
    }

    #[test]
    fn the_floor_rows_put_kvoy_next_to_the_minimal_filter() {
        let r = report(vec![
            cell(8_000, 1, "envoy", 0.20),
            cell(8_000, 1, "kvoy", 0.45),
            cell(8_000, 1, "floor", 0.30),
        ]);
        let s = summary(&r);
        assert!(s.contains("## The wasm floor"), "{s}");
        assert!(s.contains("the kvoy filter runs session, admission and prefix affinity"));
        assert!(
            s.contains("| 8000 | 1 | +0.10 | +0.25 | 0.67x | 0.44x | **+0.15** |"),
            "{s}"
        );
        let without = summary(&report(vec![
            cell(8_000, 1, "envoy", 0.20),
            cell(8_000, 1, "kvoy", 0.45),
        ]));
        assert!(!without.contains("wasm floor"));
    }

    #[test]
    fn the_ext_proc_rows_put_kvoy_next_to_the_external_picker() {
        let r = report(vec![
            cell(8_000, 1, "envoy", 1.0),
            cell(8_000, 1, "kvoy", 1.1),
            cell(8_000, 1, "ext_proc", 2.0),
            cell(100_000, 1, "envoy", 4.0),
            cell(100_000, 1, "kvoy", 4.5),
            cell(100_000, 1, "ext_proc", 5.0),
        ]);
        let f = r.kvoy_over_ext_proc(8_000, 1).unwrap();
        assert!((f - 0.1).abs() < 1e-9, "{f}");
        let md = summary(&r);
        assert!(
            md.contains(
                "| 8000 | 1 | +0.10 / +0.20 | +1.00 / +2.00 | 0.91x | 0.50x | **0.10 (met)** |"
            ),
            "{md}"
        );
        assert!(md.contains("| 100000 | 1 | +0.50 / +1.00 | +1.00 / +2.00 | 0.89x | 0.80x | **0.50 (missed)** |"), "{md}");
    }

    #[test]
    fn the_cpu_rows_give_each_envoys_time_per_request() {
        let with_cpu = |mut c: Cell, us: f64| {
            c.envoy_cpu_us_per_request = Some(us);
            c
        };
        let r = report(vec![
            with_cpu(cell(1_000, 32, "envoy", 1.8), 125.0),
            with_cpu(cell(1_000, 32, "kvoy", 3.4), 298.4),
            with_cpu(cell(1_000, 32, "floor", 2.0), 170.0),
        ]);
        let md = summary(&r);
        assert!(md.contains("## CPU per request"), "{md}");
        assert!(
            md.contains("| 1000 | 32 | 125 | 298 | **+173** | 170 | +45 | +128 |"),
            "{md}"
        );
        // Reports from before the measurement have no such section.
        let old = summary(&report(vec![
            cell(1_000, 32, "envoy", 1.8),
            cell(1_000, 32, "kvoy", 3.4),
        ]));
        assert!(!old.contains("CPU per request"), "{old}");
    }

    #[test]
    fn the_host_call_rows_divide_the_floors_difference_by_the_calls() {
        let with_cpu = |mut c: Cell, us: f64| {
            c.envoy_cpu_us_per_request = Some(us);
            c
        };
        let mut r = report(vec![
            with_cpu(cell(1_000, 32, "envoy", 1.8), 125.0),
            with_cpu(cell(1_000, 32, "kvoy", 3.4), 298.0),
            with_cpu(cell(1_000, 32, "floor", 2.0), 170.0),
            with_cpu(cell(1_000, 32, "floor_calls", 2.4), 250.0),
        ]);
        assert!(!summary(&r).contains("What one host call costs"));
        r.host_calls = 32;
        let md = summary(&r);
        assert!(md.contains("## What one host call costs"), "{md}");
        assert!(
            md.contains("| 1000 | 32 | 2.00 | **2.50** / 12.50 | - |"),
            "{md}"
        );
        r.cells
            .push(with_cpu(cell(1_000, 32, "floor_shared", 2.8), 234.0));
        let md = summary(&r);
        assert!(
            md.contains("| 1000 | 32 | 2.00 | **2.50** / 12.50 | **2.00** / 25.00 |"),
            "{md}"
        );
    }
}
