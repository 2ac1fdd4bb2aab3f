//! Envoy with the ext_proc filter (`bench/envoy/extproc.yaml`) in front of a pool, with the
//! picker serving it; both stop when dropped.

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use kvoy_testkit::{free_port, prefix_affinity_config, EnvoyProcess, PoolEndpoint, LOOPBACK_CIDR};

use super::{ExtProcServer, Picker};

const TEMPLATE: &str = include_str!("../../../envoy/extproc.yaml");

/// The template filled in.
pub fn render(listen: u16, admin: u16, picker: u16) -> String {
    TEMPLATE
        .replace("{{LISTEN_PORT}}", &listen.to_string())
        .replace("{{ADMIN_PORT}}", &admin.to_string())
        .replace("{{PICKER_PORT}}", &picker.to_string())
}

/// The picker's configuration: what the kvoy stack gives the prefix-affinity filter for the
/// same pool (its defaults, loopback destinations allowed).
pub fn picker_config(pool: &[PoolEndpoint]) -> String {
    let extra = serde_json::json!({"allowed_destinations": [{"cidr": LOOPBACK_CIDR}]});
    prefix_affinity_config(pool, None, Some(&extra))
}

pub struct ExtProcProxy {
    // Envoy first: it goes before the picker it talks to.
    envoy: EnvoyProcess,
    picker: ExtProcServer,
    listen: SocketAddr,
}

impl ExtProcProxy {
    /// Starts the picker for `pool` and Envoy with `workers` workers, and waits until Envoy
    /// is ready; files go to `dir`.
    pub fn start(
        pool: &[PoolEndpoint],
        workers: u32,
        seed: u64,
        dir: &Path,
    ) -> anyhow::Result<ExtProcProxy> {
        std::fs::create_dir_all(dir)?;
        let picker = ExtProcServer::start(Picker::new(picker_config(pool).as_bytes(), seed)?)?;
        let (listen, admin) = (free_port()?, free_port()?);
        let config = dir.join("envoy.yaml");
        std::fs::write(&config, render(listen, admin, picker.addr().port()))?;
        let mut envoy = EnvoyProcess::spawn(&config, &dir.join("envoy.log"), workers, &[])?;
        let listen = SocketAddr::from(([127, 0, 0, 1], listen));
        envoy.wait_ready(
            SocketAddr::from(([127, 0, 0, 1], admin)),
            listen,
            Duration::from_secs(60),
        )?;
        Ok(ExtProcProxy {
            envoy,
            picker,
            listen,
        })
    }

    pub fn listen(&self) -> SocketAddr {
        self.listen
    }

    /// Envoy's process (the picker runs in this one).
    pub fn envoy_pid(&self) -> u32 {
        self.envoy.pid()
    }

    /// Requests the picker routed to each pool member so far.
    pub fn routed(&self) -> Vec<(SocketAddr, u64)> {
        self.picker.routed()
    }

    /// Requests the picker counts outstanding now.
    pub fn outstanding_requests(&self) -> u64 {
        self.picker.outstanding_requests()
    }

    pub fn envoy(&self) -> &EnvoyProcess {
        &self.envoy
    }
}
