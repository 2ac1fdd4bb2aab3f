//! Network (TCP) filters: the test's handle on one connection ([`connection`]), driven through
//! the guest by [`driver`] as Envoy's wasm network filter does, with its host-side state in
//! [`state`].

pub(crate) mod connection;
pub(crate) mod driver;
pub(crate) mod state;
