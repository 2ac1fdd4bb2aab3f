//! The configured pool: endpoints, their addresses and the models they serve.

use std::fmt;
use std::net::SocketAddr;

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
    /// Static load figures; the aggregator replaces them with live ones.
    pub static_load: EndpointLoad,
}

impl Endpoint {
    pub fn serves(&self, model: &str) -> bool {
        self.models.iter().any(|m| m == model)
    }
}

/// What is known of an endpoint's load, besides this proxy's own in-flight count.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct EndpointLoad {
    /// Requests waiting in the server's queue, when known.
    pub waiting: Option<u32>,
    /// KV-cache use in [0, 1], when known.
    pub kv_cache_usage: Option<f64>,
}

/// The endpoints a proxy may route to; nothing outside it is ever chosen.
#[derive(Clone, Debug, PartialEq)]
pub struct Pool {
    endpoints: Vec<Endpoint>,
}

impl Pool {
    pub(crate) fn new(endpoints: Vec<Endpoint>) -> Self {
        Pool { endpoints }
    }

    pub fn len(&self) -> usize {
        self.endpoints.len()
    }

    pub fn is_empty(&self) -> bool {
        self.endpoints.is_empty()
    }

    pub fn get(&self, id: EndpointId) -> Option<&Endpoint> {
        self.endpoints.get(id.index())
    }

    pub fn iter(&self) -> impl Iterator<Item = (EndpointId, &Endpoint)> {
        self.endpoints
            .iter()
            .enumerate()
            .map(|(i, e)| (EndpointId(i as u16), e))
    }

    /// The pool member with this `ip:port`, if any. Used to validate addresses that come
    /// from outside (upstream properties, session tokens): anything else is not ours.
    pub fn find(&self, address: &str) -> Option<EndpointId> {
        let addr: SocketAddr = address.trim().parse().ok()?;
        self.endpoints
            .iter()
            .position(|e| e.address == addr)
            .map(|i| EndpointId(i as u16))
    }

    /// Ids of the endpoints serving `model`, written into `out` (cleared first).
    pub fn serving(&self, model: &str, out: &mut Vec<EndpointId>) {
        out.clear();
        out.extend(
            self.iter()
                .filter(|(_, e)| e.serves(model))
                .map(|(id, _)| id),
        );
    }

    /// Ids of every endpoint, written into `out` (cleared first).
    pub fn all(&self, out: &mut Vec<EndpointId>) {
        out.clear();
        out.extend((0..self.endpoints.len()).map(|i| EndpointId(i as u16)));
    }
}
