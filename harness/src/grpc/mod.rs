//! gRPC callouts as Envoy makes them: the records of `proxy_grpc_call` / `proxy_grpc_stream`
//! the test answers ([`driver`] delivers the answers), and how the service argument is read
//! ([`service`]).

mod driver;
mod service;

pub(crate) use service::{read_service, ServiceArg};

use std::ops::Deref;
use std::time::Duration;

use crate::http::headers::HeaderMap;

/// Where a gRPC callout goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrpcTarget {
    /// A cluster name (what the Rust SDK passes) or `envoy_grpc.cluster_name` of a proto.
    Cluster(String),
    /// `google_grpc.target_uri` of a serialized `GrpcService`.
    GoogleGrpc(String),
}

/// What every gRPC callout records: who made it, its token, where it goes and what it opened
/// with. [`GrpcCall`] and [`GrpcStream`] carry one and read as one (`call.token`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcOpening {
    /// The VM that made the callout; the answers go back to it.
    pub vm: usize,
    /// The context that made the callout (the answers go to it, or to the root context if it
    /// has ended).
    pub context_id: u32,
    /// The token `proxy_grpc_call` (Envoy's sequence 5, 9, 13, ...) or `proxy_grpc_stream`
    /// (6, 10, 14, ...) returned.
    pub token: u32,
    pub target: GrpcTarget,
    /// The service argument when it was a serialized `GrpcService` (not a cluster name).
    pub service_proto: Option<Vec<u8>>,
    pub service_name: String,
    pub method: String,
    pub initial_metadata: HeaderMap,
}

/// A unary call made with `proxy_grpc_call`, waiting for [`crate::Plugin::respond_grpc_call`]
/// or [`crate::Plugin::fail_grpc_call`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcCall {
    pub opening: GrpcOpening,
    pub message: Vec<u8>,
    pub timeout: Duration,
}

/// A stream opened with `proxy_grpc_stream`, fed by the test with
/// [`crate::Plugin::grpc_stream_initial_metadata`], [`crate::Plugin::grpc_stream_message`],
/// [`crate::Plugin::grpc_stream_trailing_metadata`] and [`crate::Plugin::close_grpc_stream`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GrpcStream {
    pub opening: GrpcOpening,
    /// Messages the filter sent with `proxy_grpc_send`, in order.
    pub messages: Vec<Vec<u8>>,
    /// The filter ended its side (`proxy_grpc_send` with end_stream, or `proxy_grpc_close`).
    pub half_closed: bool,
    /// The filter called `proxy_grpc_close` (Envoy's `local_closed_`): the stream is forgotten
    /// when the remote side closes too.
    pub local_closed: bool,
    /// The test closed the stream; Envoy keeps it until the filter closes its side.
    pub remote_closed: bool,
}

impl Deref for GrpcCall {
    type Target = GrpcOpening;

    fn deref(&self) -> &GrpcOpening {
        &self.opening
    }
}

impl Deref for GrpcStream {
    type Target = GrpcOpening;

    fn deref(&self) -> &GrpcOpening {
        &self.opening
    }
}

/// What a test delivers to a call or stream.
#[derive(Debug, Clone)]
pub(crate) enum GrpcDelivery {
    InitialMetadata(HeaderMap),
    Message(Vec<u8>),
    TrailingMetadata(HeaderMap),
    /// gRPC status code and message (`proxy_get_status` reads them during the callback).
    Close(u32, String),
}
