//! The few ext_proc messages the picker reads and writes, as prost structs written by hand:
//! only the fields it needs (prost skips the others on decode).
//!
//! Field numbers from Envoy's `api/envoy/service/ext_proc/v3/external_processor.proto` and
//! `api/envoy/config/core/v3/base.proto` (envoyproxy/envoy at commit
//! 0015fbd525e874e8afcb9193c6fca2e06f0038e3); `envoy.type.v3.HttpStatus` from
//! `api/envoy/type/v3/http_status.proto`.

/// `envoy.service.ext_proc.v3.ProcessingRequest`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingRequest {
    #[prost(oneof = "processing_request::Request", tags = "2, 3, 4, 5, 6, 7")]
    pub request: Option<processing_request::Request>,
}

pub mod processing_request {
    /// What part of the HTTP exchange this message carries.
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Request {
        #[prost(message, tag = "2")]
        RequestHeaders(super::HttpHeaders),
        #[prost(message, tag = "3")]
        ResponseHeaders(super::HttpHeaders),
        #[prost(message, tag = "4")]
        RequestBody(super::HttpBody),
        #[prost(message, tag = "5")]
        ResponseBody(super::HttpBody),
        /// `HttpTrailers`: only its presence matters here (field 1 is a `HeaderMap` too).
        #[prost(message, tag = "6")]
        RequestTrailers(super::HttpHeaders),
        #[prost(message, tag = "7")]
        ResponseTrailers(super::HttpHeaders),
    }
}

/// `envoy.service.ext_proc.v3.HttpHeaders`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpHeaders {
    #[prost(message, optional, tag = "1")]
    pub headers: Option<HeaderMap>,
    #[prost(bool, tag = "3")]
    pub end_of_stream: bool,
}

/// `envoy.service.ext_proc.v3.HttpBody`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpBody {
    #[prost(bytes = "bytes", tag = "1")]
    pub body: bytes::Bytes,
    #[prost(bool, tag = "2")]
    pub end_of_stream: bool,
}

/// `envoy.config.core.v3.HeaderMap`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMap {
    #[prost(message, repeated, tag = "1")]
    pub headers: Vec<HeaderValue>,
}

/// `envoy.config.core.v3.HeaderValue`. Envoy's ext_proc sends and expects the value in
/// `raw_value`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValue {
    #[prost(string, tag = "1")]
    pub key: String,
    #[prost(string, tag = "2")]
    pub value: String,
    #[prost(bytes = "vec", tag = "3")]
    pub raw_value: Vec<u8>,
}

impl HeaderValue {
    /// The value, from `raw_value` or else `value`.
    pub fn bytes(&self) -> &[u8] {
        if self.raw_value.is_empty() {
            self.value.as_bytes()
        } else {
            &self.raw_value
        }
    }
}

/// `envoy.config.core.v3.HeaderValueOption`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderValueOption {
    #[prost(message, optional, tag = "1")]
    pub header: Option<HeaderValue>,
    /// `HeaderAppendAction`; [`OVERWRITE_IF_EXISTS_OR_ADD`].
    #[prost(int32, tag = "3")]
    pub append_action: i32,
}

/// `HeaderValueOption.HeaderAppendAction.OVERWRITE_IF_EXISTS_OR_ADD`: a client's own value of
/// the destination header is replaced, never appended to.
pub const OVERWRITE_IF_EXISTS_OR_ADD: i32 = 2;

/// `envoy.service.ext_proc.v3.ProcessingResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ProcessingResponse {
    #[prost(oneof = "processing_response::Response", tags = "1, 2, 3, 4, 5, 6, 7")]
    pub response: Option<processing_response::Response>,
}

pub mod processing_response {
    /// The answer to one [`super::ProcessingRequest`].
    #[derive(Clone, PartialEq, prost::Oneof)]
    pub enum Response {
        #[prost(message, tag = "1")]
        RequestHeaders(super::HeadersResponse),
        #[prost(message, tag = "2")]
        ResponseHeaders(super::HeadersResponse),
        #[prost(message, tag = "3")]
        RequestBody(super::BodyResponse),
        #[prost(message, tag = "4")]
        ResponseBody(super::BodyResponse),
        #[prost(message, tag = "5")]
        RequestTrailers(super::TrailersResponse),
        #[prost(message, tag = "6")]
        ResponseTrailers(super::TrailersResponse),
        #[prost(message, tag = "7")]
        ImmediateResponse(super::ImmediateResponse),
    }
}

/// `envoy.service.ext_proc.v3.HeadersResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeadersResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `envoy.service.ext_proc.v3.BodyResponse`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct BodyResponse {
    #[prost(message, optional, tag = "1")]
    pub response: Option<CommonResponse>,
}

/// `envoy.service.ext_proc.v3.TrailersResponse` (its one field, a mutation, left out).
#[derive(Clone, PartialEq, prost::Message)]
pub struct TrailersResponse {}

/// `envoy.service.ext_proc.v3.CommonResponse` (status `CONTINUE` is 0, the default).
#[derive(Clone, PartialEq, prost::Message)]
pub struct CommonResponse {
    #[prost(message, optional, tag = "2")]
    pub header_mutation: Option<HeaderMutation>,
}

/// `envoy.service.ext_proc.v3.HeaderMutation`.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HeaderMutation {
    #[prost(message, repeated, tag = "1")]
    pub set_headers: Vec<HeaderValueOption>,
}

/// `envoy.service.ext_proc.v3.ImmediateResponse`: the router's refusal as Envoy's local reply.
#[derive(Clone, PartialEq, prost::Message)]
pub struct ImmediateResponse {
    #[prost(message, optional, tag = "1")]
    pub status: Option<HttpStatus>,
    #[prost(message, optional, tag = "2")]
    pub headers: Option<HeaderMutation>,
    #[prost(bytes = "vec", tag = "3")]
    pub body: Vec<u8>,
    #[prost(string, tag = "5")]
    pub details: String,
}

/// `envoy.type.v3.HttpStatus`: `code` is the `StatusCode` enum, whose values are the HTTP codes.
#[derive(Clone, PartialEq, prost::Message)]
pub struct HttpStatus {
    #[prost(int32, tag = "1")]
    pub code: i32,
}
