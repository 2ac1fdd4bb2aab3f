//! HTTP filters: one stream through one filter ([`stream`], driven by [`driver`] with Envoy's
//! semantics, its host-side state in [`state`]), a chain of filters ([`chain`]), header maps
//! ([`headers`]) and HTTP callouts, recorded ([`callouts`]) or sent for real ([`upstream`]).

pub(crate) mod callouts;
pub(crate) mod chain;
pub(crate) mod driver;
pub(crate) mod headers;
pub(crate) mod state;
pub(crate) mod stream;
pub(crate) mod upstream;
