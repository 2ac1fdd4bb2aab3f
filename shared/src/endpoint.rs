//! The configured pool: endpoints, their addresses and the models they serve.

use fnv::FnvHashMap;
use std::fmt;
use std::net::SocketAddr;

use crate::allow::{Allowlist, Refusal};
use crate::prefix_affinity::config::RefusedEndpoint;

/// Index of an endpoint in the configured pool. Every VM of a proxy loads the same
/// configuration, so an id means the same endpoint on every worker thread.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct EndpointId(pub u16);

impl EndpointId {
    pub fn index(self) -> usize {
        usize::from(self.0)
    }
}

impl fmt::Display for EndpointId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "#{}", self.0)
    }
}

/// One model server replica.
#[derive(Clone, Debug, PartialEq)]
pub struct Endpoint {
    pub address: SocketAddr,
    /// `address` as written in the destination header (`ip:port`), rendered once.
    pub address_text: String,
    pub models: Vec<String>,
    /// Load figures: static ones from the configuration, or live ones from the aggregator.
    pub load: EndpointLoad,
    pub health: Health,
    /// Changes whenever the server's cache was dropped (from the aggregator; 0 otherwise):
    /// what the prefix index believes of the endpoint is then void.
    pub cache_generation: u32,
    /// Tokens the server reports holding in its caches, every tier (from the aggregator,
    /// which counts its KV events; `None` when nobody counts them or it reports none): the
    /// prefix index never believes the endpoint holds more than this.
    pub cached_tokens: Option<u64>,
    /// Which stages of a disaggregated request it takes (decode only unless told).
    pub role: Role,
}

/// The stages of a request an endpoint serves, as llm-d's `llm-d.ai/role` pod label names
/// them (llm-d/llm-d-router at ebab687, `pkg/epp/framework/plugins/scheduling/filter/bylabel/
/// roles.go`): an unlabelled pod decodes and is never a prefill target, so the default is
/// [`Role::Decode`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Role {
    /// Runs whole requests, or the decode half of a disaggregated one.
    #[default]
    Decode,
    /// Only prefills for a decode endpoint (a request is never sent to it to be answered).
    Prefill,
    /// Either (`prefill-decode`, `both`).
    Both,
}

impl Role {
    /// The role for a value of the `llm-d.ai/role` label (`None`: no label); `None` for a
    /// value that names neither stage (e.g. `encode`): such a pod takes no text request.
    pub fn from_llmd_label(value: Option<&str>) -> Option<Role> {
        match value {
            None => Some(Role::Decode),
            Some("decode") => Some(Role::Decode),
            Some("prefill" | "encode-prefill") => Some(Role::Prefill),
            Some("prefill-decode" | "both" | "encode-prefill-decode") => Some(Role::Both),
            Some(_) => None,
        }
    }

    /// The name used in configuration and reports.
    pub fn name(self) -> &'static str {
        match self {
            Role::Decode => "decode",
            Role::Prefill => "prefill",
            Role::Both => "both",
        }
    }

    /// Parses [`Role::name`].
    pub fn from_name(name: &str) -> Option<Role> {
        match name {
            "decode" => Some(Role::Decode),
            "prefill" => Some(Role::Prefill),
            "both" => Some(Role::Both),
            _ => None,
        }
    }

    /// Takes requests to answer (aggregated, or the decode half).
    pub fn decodes(self) -> bool {
        matches!(self, Role::Decode | Role::Both)
    }

    /// Can prefill for another endpoint.
    pub fn prefills(self) -> bool {
        matches!(self, Role::Prefill | Role::Both)
    }
}

impl Endpoint {
    /// An endpoint with no load figures, ready.
    pub fn new(address: SocketAddr, models: Vec<String>) -> Self {
        Endpoint {
            address,
            address_text: address.to_string(),
            models,
            load: EndpointLoad::default(),
            health: Health::Ready,
            cache_generation: 0,
            cached_tokens: None,
            role: Role::Decode,
        }
    }

    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }
}

/// Whether an endpoint should get new work, as the aggregator sees it. Candidates are taken
/// from the best tier that has any: ready, then stale, then not ready. So stale and failing
/// endpoints are avoided, yet a pool whose aggregator cannot see anything still routes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Health {
    /// Scraped recently and successfully (static endpoints are always ready).
    #[default]
    Ready,
    /// Scrapes succeed but the metrics are older than the aggregator's threshold.
    Stale,
    /// Scrapes fail.
    NotReady,
}

/// What is known of an endpoint's load, besides this proxy's own in-flight count.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EndpointLoad {
    /// Requests waiting in the server's queue, when known.
    pub waiting: Option<u32>,
    /// Requests the server is running, when known (with `waiting`: everything it holds, from
    /// every proxy, this one's included).
    pub running: Option<u32>,
    /// KV-cache use in [0, 1], when known.
    pub kv_cache_usage: Option<f64>,
    /// The endpoint's prefill rate in prompt tokens per second, when known: configured for a
    /// static endpoint, or estimated by the aggregator from the server's metrics.
    pub prefill_tokens_per_s: Option<f64>,
    /// The endpoint's KV cache in tokens, when known: configured for a static endpoint, or
    /// the server's own figure through the aggregator.
    pub kv_capacity_tokens: Option<u32>,
}

/// The endpoints a proxy may route to; nothing outside it is ever chosen. Ids may have holes
/// (the aggregator's slots of removed endpoints).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Pool {
    slots: Vec<Option<Endpoint>>,
    count: usize,
    /// Each member's id by address (outstanding work is shared by address).
    ids: FnvHashMap<SocketAddr, EndpointId>,
}

impl Pool {
    /// A pool with ids `0..endpoints.len()` in order.
    pub fn new(endpoints: Vec<Endpoint>) -> Self {
        let count = endpoints.len();
        Pool {
            slots: endpoints.into_iter().map(Some).collect(),
            count,
            ids: FnvHashMap::default(),
        }
        .indexed()
    }

    /// Fills the address map (a repeated address keeps its lowest id).
    fn indexed(mut self) -> Pool {
        self.ids.clear();
        for (i, e) in self.slots.iter().enumerate() {
            if let Some(e) = e {
                self.ids.entry(e.address).or_insert(EndpointId(i as u16));
            }
        }
        self
    }

    /// A pool with the given ids; on a repeated id the last entry wins. Ids beyond
    /// [`crate::MAX_ENDPOINTS`] are dropped.
    pub fn with_ids(endpoints: impl IntoIterator<Item = (EndpointId, Endpoint)>) -> Self {
        let mut slots: Vec<Option<Endpoint>> = Vec::new();
        for (id, e) in endpoints {
            if id.index() >= crate::MAX_ENDPOINTS {
                continue;
            }
            if slots.len() <= id.index() {
                slots.resize(id.index() + 1, None);
            }
            slots[id.index()] = Some(e);
        }
        let count = slots.iter().flatten().count();
        Pool {
            slots,
            count,
            ids: FnvHashMap::default(),
        }
        .indexed()
    }

    /// This pool without the endpoints `allowed` refuses, and with at most `max` endpoints
    /// (the lowest ids kept); what was left out is appended to `refused`.
    pub fn admit(
        mut self,
        allowed: &Allowlist,
        max: usize,
        refused: &mut Vec<RefusedEndpoint>,
    ) -> Pool {
        let mut kept = 0;
        for slot in &mut self.slots {
            let Some(e) = slot else {
                continue;
            };
            let verdict = match allowed.check(e.address) {
                Ok(()) if kept >= max => Err(Refusal::TooMany),
                v => v,
            };
            match verdict {
                Ok(()) => kept += 1,
                Err(reason) => {
                    refused.push(RefusedEndpoint {
                        address: e.address,
                        reason,
                    });
                    *slot = None;
                }
            }
        }
        while self.slots.last().is_some_and(Option::is_none) {
            self.slots.pop();
        }
        self.count = kept;
        self.indexed()
    }

    /// Number of endpoints.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// One more than the largest id (the size of per-id tables).
    pub fn id_bound(&self) -> usize {
        self.slots.len()
    }

    pub fn get(&self, id: EndpointId) -> Option<&Endpoint> {
        self.slots.get(id.index()).and_then(Option::as_ref)
    }

    pub fn iter(&self) -> impl Iterator<Item = (EndpointId, &Endpoint)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, e)| e.as_ref().map(|e| (EndpointId(i as u16), e)))
    }

    /// The pool member with this `ip:port`, if any. Used to validate addresses that come
    /// from outside (upstream properties, session tokens): anything else is not ours.
    pub fn find(&self, address: &str) -> Option<EndpointId> {
        let addr: SocketAddr = address.trim().parse().ok()?;
        self.id_of(addr)
    }

    /// The pool member at `address`, if any.
    pub fn id_of(&self, address: SocketAddr) -> Option<EndpointId> {
        self.ids.get(&address).copied()
    }

    /// Ids of the healthiest endpoints (see [`Health`]) that match, into `out` (cleared).
    fn best(&self, matches: impl Fn(&Endpoint) -> bool, out: &mut Vec<EndpointId>) {
        out.clear();
        let Some(best) = self
            .iter()
            .filter(|(_, e)| matches(e))
            .map(|(_, e)| e.health)
            .min()
        else {
            return;
        };
        out.extend(
            self.iter()
                .filter(|(_, e)| e.health == best && matches(e))
                .map(|(id, _)| id),
        );
    }

    /// Ids of the healthiest endpoints serving `model` that answer requests (role decode or
    /// both), written into `out` (cleared first).
    pub fn serving(&self, model: &str, out: &mut Vec<EndpointId>) {
        self.best(|e| e.role.decodes() && e.serves(model), out);
    }

    /// Ids of the healthiest endpoints serving `model` that prefill for others (role prefill
    /// or both), written into `out` (cleared first).
    pub fn prefilling(&self, model: &str, out: &mut Vec<EndpointId>) {
        self.best(|e| e.role.prefills() && e.serves(model), out);
    }

    /// Whether any member prefills for others: the pool is disaggregated.
    pub fn has_prefill_role(&self) -> bool {
        self.iter().any(|(_, e)| e.role.prefills())
    }

    /// Ids of the healthiest endpoints that answer requests (every role but prefill),
    /// written into `out` (cleared first).
    pub fn all(&self, out: &mut Vec<EndpointId>) {
        self.best(|e| e.role.decodes(), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(port: u16, model: &str, health: Health) -> Endpoint {
        Endpoint {
            health,
            ..Endpoint::new(SocketAddr::from(([10, 0, 0, 1], port)), vec![model.into()])
        }
    }

    #[test]
    fn sparse_ids_and_health_tiers() {
        let pool = Pool::with_ids([
            (EndpointId(4), ep(4, "a", Health::Stale)),
            (EndpointId(1), ep(1, "a", Health::NotReady)),
            (EndpointId(2), ep(2, "b", Health::NotReady)),
            (EndpointId(9999), ep(9, "a", Health::Ready)),
        ]);
        assert_eq!((pool.len(), pool.id_bound()), (3, 5));
        assert!(pool.get(EndpointId(0)).is_none());
        assert_eq!(pool.find("10.0.0.1:4"), Some(EndpointId(4)));
        assert_eq!(pool.find("10.0.0.1:9"), None, "dropped: id out of range");
        let mut out = Vec::new();
        pool.serving("a", &mut out);
        assert_eq!(out, [EndpointId(4)], "stale beats not ready");
        pool.serving("b", &mut out);
        assert_eq!(
            out,
            [EndpointId(2)],
            "not ready is still better than nothing"
        );
        pool.serving("c", &mut out);
        assert!(out.is_empty());
        pool.all(&mut out);
        assert_eq!(out, [EndpointId(4)]);
    }

    #[test]
    fn roles_split_who_answers_from_who_prefills() {
        let with = |port, role| Endpoint {
            role,
            ..ep(port, "m", Health::Ready)
        };
        let pool = Pool::new(vec![
            with(0, Role::Decode),
            with(1, Role::Prefill),
            with(2, Role::Both),
        ]);
        let mut out = Vec::new();
        pool.serving("m", &mut out);
        assert_eq!(
            out,
            [EndpointId(0), EndpointId(2)],
            "a prefill server answers nothing"
        );
        pool.prefilling("m", &mut out);
        assert_eq!(out, [EndpointId(1), EndpointId(2)]);
        assert!(pool.has_prefill_role());
        assert!(!Pool::new(vec![with(0, Role::Decode)]).has_prefill_role());
    }

    #[test]
    fn llmd_role_labels() {
        assert_eq!(
            Role::from_llmd_label(None),
            Some(Role::Decode),
            "unlabelled decodes"
        );
        for (v, r) in [
            ("decode", Role::Decode),
            ("prefill", Role::Prefill),
            ("encode-prefill", Role::Prefill),
            ("prefill-decode", Role::Both),
            ("both", Role::Both),
            ("encode-prefill-decode", Role::Both),
        ] {
            assert_eq!(Role::from_llmd_label(Some(v)), Some(r), "{v}");
        }
        assert_eq!(Role::from_llmd_label(Some("encode")), None);
        assert_eq!(Role::from_llmd_label(Some("")), None);
        for r in [Role::Decode, Role::Prefill, Role::Both] {
            assert_eq!(Role::from_name(r.name()), Some(r));
        }
    }
}
