//! The picker behind the ext_proc stream: kvoy-shared's [`Router`], configured from the same
//! JSON as the prefix-affinity filter, keeping its own outstanding work per endpoint as the
//! simulated kvoy does (`policy/kvoy.rs`). One picker serves every stream, like one EPP.

use std::net::SocketAddr;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use kvoy_shared::prefix_affinity::{ConfigError, PluginConfig, RouteError, Router};
use kvoy_shared::request::{Api, RequestError};
use kvoy_shared::{Charge, EndpointId, Outstanding, OutstandingDelta};
use prost::Message as _;

use super::grpc::{Code, Status};
use super::proto::{
    processing_request::Request, processing_response::Response, BodyResponse, CommonResponse,
    HeaderMutation, HeaderValue, HeaderValueOption, HeadersResponse, HttpStatus, ImmediateResponse,
    ProcessingRequest, ProcessingResponse, TrailersResponse, OVERWRITE_IF_EXISTS_OR_ADD,
};

pub use kvoy_shared::protocol::DESTINATION_HEADER;

/// What one ext_proc stream (one HTTP request) has told the picker so far.
#[derive(Debug, Default)]
pub struct StreamState {
    api: Option<Api>,
    /// Body pieces before the last one (only if Envoy streams; BUFFERED sends one).
    body: BytesMut,
    /// What the decision charged to the outstanding table, released once.
    charged: Option<(EndpointId, Charge)>,
}

pub struct Picker {
    router: Router,
    /// By endpoint id.
    outstanding: Vec<Outstanding>,
    /// Decisions per endpoint id, for the benchmark's check that requests arrived there.
    routed: Vec<u64>,
    /// The outstanding table's clock starts here.
    epoch: Instant,
}

impl Picker {
    pub fn new(config_json: &[u8], seed: u64) -> Result<Picker, ConfigError> {
        let router = Router::new(PluginConfig::from_json(config_json)?, seed);
        let n = router.pool().id_bound();
        Ok(Picker {
            router,
            outstanding: vec![Outstanding::default(); n],
            routed: vec![0; n],
            epoch: Instant::now(),
        })
    }

    /// Requests routed to each pool member so far.
    pub fn routed(&self) -> Vec<(SocketAddr, u64)> {
        self.router
            .pool()
            .iter()
            .map(|(id, e)| (e.address, self.routed.get(id.index()).copied().unwrap_or(0)))
            .collect()
    }

    /// Requests counted outstanding now, over the pool.
    pub fn outstanding_requests(&self) -> u64 {
        self.outstanding.iter().map(|o| u64::from(o.requests)).sum()
    }

    /// Decodes one message of the stream and answers it. The body is not copied: prost slices
    /// it out of `message`.
    pub fn handle(
        &mut self,
        stream: &mut StreamState,
        message: Bytes,
    ) -> Result<ProcessingResponse, Status> {
        let request = ProcessingRequest::decode(message)
            .map_err(|e| Status::new(Code::InvalidArgument, format!("ProcessingRequest: {e}")))?;
        let response = match request.request {
            Some(Request::RequestHeaders(h)) => {
                stream.api = h
                    .headers
                    .iter()
                    .flat_map(|m| &m.headers)
                    .find(|h| h.key == ":path")
                    .and_then(|h| std::str::from_utf8(h.bytes()).ok())
                    .and_then(Api::from_path);
                Response::RequestHeaders(HeadersResponse::default())
            }
            Some(Request::RequestBody(b)) => {
                let limit = self.router.config().max_body_bytes;
                let size = stream.body.len().saturating_add(b.body.len());
                if size > limit {
                    // Refused as the router refuses a body over its bound (413), before it is
                    // held: a streamed body cannot grow the picker's memory without bound.
                    stream.body = BytesMut::new();
                    let e = RouteError::BadRequest(RequestError::TooLarge { size, limit });
                    refusal(e.status(), e.code(), e.body())
                } else if !b.end_of_stream {
                    stream.body.extend_from_slice(&b.body);
                    Response::RequestBody(BodyResponse::default())
                } else if stream.body.is_empty() {
                    self.route(stream, &b.body)
                } else {
                    stream.body.extend_from_slice(&b.body);
                    let body = std::mem::take(&mut stream.body);
                    self.route(stream, &body)
                }
            }
            // Not asked for by the benchmark's configuration; answered so that another
            // processing mode still works. The answer begins: the request's work is done.
            Some(Request::ResponseHeaders(_)) => {
                self.end(stream);
                Response::ResponseHeaders(HeadersResponse::default())
            }
            Some(Request::ResponseBody(_)) => Response::ResponseBody(BodyResponse::default()),
            Some(Request::RequestTrailers(_)) => Response::RequestTrailers(TrailersResponse {}),
            Some(Request::ResponseTrailers(_)) => Response::ResponseTrailers(TrailersResponse {}),
            None => {
                return Err(Status::new(
                    Code::InvalidArgument,
                    "ProcessingRequest names no part of the request",
                ))
            }
        };
        Ok(ProcessingResponse {
            response: Some(response),
        })
    }

    /// Routes a whole body: the destination header, or the router's refusal as a local reply.
    fn route(&mut self, stream: &mut StreamState, body: &[u8]) -> Response {
        let Some(api) = stream.api else {
            // Not an inference API: nothing to route (the filter passes such requests by).
            return Response::RequestBody(BodyResponse::default());
        };
        let now = self.epoch.elapsed();
        match self.router.route_body(api, body, &self.outstanding, now) {
            Ok(decision) => {
                let id = decision.endpoint;
                let Some(endpoint) = self.router.pool().get(id) else {
                    return refusal(500, "internal", "the router chose no pool member".into());
                };
                let header = HeaderValue {
                    key: DESTINATION_HEADER.into(),
                    value: String::new(),
                    raw_value: endpoint.address_text.as_bytes().to_vec(),
                };
                if let Some(o) = self.outstanding.get_mut(id.index()) {
                    o.apply(OutstandingDelta::sent(decision.charge), now);
                }
                if let Some(n) = self.routed.get_mut(id.index()) {
                    *n += 1;
                }
                stream.charged = Some((id, decision.charge));
                Response::RequestBody(BodyResponse {
                    response: Some(CommonResponse {
                        header_mutation: Some(HeaderMutation {
                            set_headers: vec![HeaderValueOption {
                                header: Some(header),
                                append_action: OVERWRITE_IF_EXISTS_OR_ADD,
                            }],
                        }),
                    }),
                })
            }
            Err(e) => refusal(e.status(), e.code(), e.body()),
        }
    }

    /// The stream is over (or the answer began): releases what its decision charged, once.
    /// With the response phases skipped (the benchmark's configuration) the picker never sees
    /// the answer, so this is the ext_proc stream's end, which Envoy closes once it has nothing
    /// more to send: the count covers routing, not generation.
    pub fn end(&mut self, stream: &mut StreamState) {
        if let Some((id, charge)) = stream.charged.take() {
            let now = self.epoch.elapsed();
            if let Some(o) = self.outstanding.get_mut(id.index()) {
                o.apply(OutstandingDelta::finished(charge, false), now);
            }
        }
    }
}

fn refusal(status: u16, code: &str, body: String) -> Response {
    Response::ImmediateResponse(ImmediateResponse {
        status: Some(HttpStatus {
            code: i32::from(status),
        }),
        headers: Some(HeaderMutation {
            set_headers: vec![HeaderValueOption {
                header: Some(HeaderValue {
                    key: "content-type".into(),
                    value: String::new(),
                    raw_value: b"application/json".to_vec(),
                }),
                append_action: OVERWRITE_IF_EXISTS_OR_ADD,
            }],
        }),
        body: body.into_bytes(),
        details: format!("kvoy_ext_proc_{code}"),
    })
}
