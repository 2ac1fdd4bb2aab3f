//! Output: the JSON with every figure, a Markdown summary and SVG plots.

pub mod seeds;
mod summary;
pub mod svg;
pub mod table;

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::fleet::FleetKind;
use crate::live::hop::HopFigures;
use crate::metrics::RunFigures;
use crate::saturation::{Capacity, Shape};

pub use summary::summary;

/// Everything one invocation measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    /// `kvoy-bench sim` (or another producer of the same shape).
    pub tool: &'static str,
    /// The base profile (on a mixed fleet, the fast replicas').
    pub profile: String,
    pub replicas: usize,
    /// Which replicas run slower than `profile`.
    pub fleet: FleetKind,
    pub seed: u64,
    pub scrape_interval_ms: u64,
    pub policies: Vec<String>,
    pub workloads: Vec<WorkloadReport>,
    /// Live runs: what each proxy's hop adds to a tiny request (empty in the simulation).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub hops: Vec<HopFigures>,
    /// Live runs through vLLM's router: its renders and prefix lookups per run.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub router_runs: Vec<crate::live::RouterRun>,
    /// Live runs: each real router's exact command line.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub commands: Vec<crate::live::RouterCommand>,
    /// Live runs: each run's place in the rotation, decode placement, preemptions and times.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub details: Vec<crate::live::RunDetail>,
}

/// The producers a report may name, so that `tool` stays a `&'static str` when read back.
const TOOLS: [&str; 2] = ["kvoy-bench sim", "kvoy-bench live"];

/// [`Report`] as read back from JSON.
#[derive(Deserialize)]
struct SavedReport {
    tool: String,
    profile: String,
    replicas: usize,
    /// Reports written before fleets had kinds ran uniform fleets.
    #[serde(default)]
    fleet: FleetKind,
    seed: u64,
    scrape_interval_ms: u64,
    policies: Vec<String>,
    workloads: Vec<WorkloadReport>,
    #[serde(default)]
    hops: Vec<HopFigures>,
    #[serde(default)]
    router_runs: Vec<crate::live::RouterRun>,
    #[serde(default)]
    commands: Vec<crate::live::RouterCommand>,
    #[serde(default)]
    details: Vec<crate::live::RunDetail>,
}

impl From<SavedReport> for Report {
    fn from(r: SavedReport) -> Report {
        Report {
            tool: TOOLS
                .into_iter()
                .find(|t| *t == r.tool)
                .unwrap_or("kvoy-bench"),
            profile: r.profile,
            replicas: r.replicas,
            fleet: r.fleet,
            seed: r.seed,
            scrape_interval_ms: r.scrape_interval_ms,
            policies: r.policies,
            workloads: r.workloads,
            hops: r.hops,
            router_runs: r.router_runs,
            commands: r.commands,
            details: r.details,
        }
    }
}

/// One workload's runs.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkloadReport {
    pub name: String,
    pub description: String,
    /// Measured on the plan at the nominal seed.
    pub shape: Shape,
    /// The saturation estimate (see `saturation`).
    pub saturation: Capacity,
    /// Offered rates, requests per second.
    pub rates: Vec<f64>,
    /// Every run, by rate, policy, then seed.
    pub runs: Vec<RunFigures>,
    /// The TTFT SLO the runs were judged by (absent in reports written before SLOs existed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub slo: Option<crate::slo::Slo>,
}

impl WorkloadReport {
    /// The first run of (`policy`, `rate`): on a report with several seeds, the nominal seed's;
    /// see [`seeds`] for the cells' medians.
    pub fn run(&self, policy: &str, rate: f64) -> Option<&RunFigures> {
        self.runs
            .iter()
            .find(|r| r.policy == policy && r.rate == rate)
    }

    /// The offered rate nearest to saturation (load 1).
    pub fn saturation_rate(&self) -> Option<f64> {
        let sat = self.saturation.rate;
        self.rates
            .iter()
            .copied()
            .min_by(|a, b| ((a / sat).ln().abs()).total_cmp(&(b / sat).ln().abs()))
    }
}

#[derive(Debug, thiserror::Error)]
pub enum WriteError {
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot encode the report: {0}")]
    Json(#[from] serde_json::Error),
}

/// Why a saved report could not be read back.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot read {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path} is not a kvoy-bench report: {source}")]
    Json {
        path: PathBuf,
        source: serde_json::Error,
    },
}

fn write(path: PathBuf, bytes: &[u8]) -> Result<(), WriteError> {
    std::fs::write(&path, bytes).map_err(|source| WriteError::Io { path, source })
}

impl Report {
    /// The seeds the runs ran with, in the order they first appear (runs that name none ran
    /// with `seed`).
    pub fn seeds(&self) -> Vec<u64> {
        let mut seen = Vec::new();
        for r in self.workloads.iter().flat_map(|w| &w.runs) {
            let s = r.seed.unwrap_or(self.seed);
            if !seen.contains(&s) {
                seen.push(s);
            }
        }
        if seen.is_empty() {
            seen.push(self.seed);
        }
        seen
    }

    /// Reads a `results.json` written by [`Report::write_all`].
    pub fn load(path: &Path) -> Result<Report, ReadError> {
        let text = std::fs::read_to_string(path).map_err(|source| ReadError::Io {
            path: path.to_owned(),
            source,
        })?;
        serde_json::from_str::<SavedReport>(&text)
            .map(Report::from)
            .map_err(|source| ReadError::Json {
                path: path.to_owned(),
                source,
            })
    }

    /// The JSON document (deterministic for the same report).
    pub fn to_json(&self) -> Result<String, serde_json::Error> {
        serde_json::to_string_pretty(self)
    }

    /// Writes `results.json`, `summary.md` and three SVGs per workload into `dir` (created).
    /// Returns the paths written.
    pub fn write_all(&self, dir: &Path) -> Result<Vec<PathBuf>, WriteError> {
        create(dir)?;
        let path = dir.join("results.json");
        write(path.clone(), self.to_json()?.as_bytes())?;
        let mut written = vec![path];
        written.extend(self.write_views(dir)?);
        Ok(written)
    }

    /// Writes `summary.md` and the SVGs only (the views of a `results.json` read back: the file
    /// itself is left as it is, since floats read back may differ in their last digit).
    pub fn write_views(&self, dir: &Path) -> Result<Vec<PathBuf>, WriteError> {
        create(dir)?;
        let mut written = Vec::new();
        let mut put = |name: String, bytes: &[u8]| -> Result<(), WriteError> {
            let path = dir.join(name);
            write(path.clone(), bytes)?;
            written.push(path);
            Ok(())
        };
        put("summary.md".into(), summary(self).as_bytes())?;
        // The plots show each cell's median over the seeds.
        for w in &seeds::medians(self).workloads {
            for (kind, chart) in svg::charts(w, &self.policies) {
                put(format!("{}-{kind}.svg", w.name), chart.as_bytes())?;
            }
        }
        // A live run's running sequences over time (only right after the run: the samples are
        // not saved in `results.json`).
        for (name, chart) in crate::live::tables::running_charts(self) {
            put(name, chart.as_bytes())?;
        }
        Ok(written)
    }
}

fn create(dir: &Path) -> Result<(), WriteError> {
    std::fs::create_dir_all(dir).map_err(|source| WriteError::Io {
        path: dir.to_owned(),
        source,
    })
}
