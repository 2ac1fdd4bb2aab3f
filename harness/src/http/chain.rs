//! A chain of HTTP filters, as Envoy's filter manager runs an `http_filters` list: each filter
//! is a [`Plugin`], a request on worker `w` runs in VM `w` of every plugin.
//!
//! * Request: headers and body go through the filters in order. What a filter lets go (its
//!   `Continue`, or a later `proxy_continue_stream`) is passed to the next; what it holds stays
//!   until it continues, and its body callbacks keep receiving chunks meanwhile
//!   (`allow_on_headers_stop_iteration: true`). A filter's context is created when the request
//!   headers reach it, as in Envoy.
//! * After the last filter the request is the upstream request ([`ChainStream::upstream_request`]).
//! * Response: headers and body go through the filters in reverse order.
//! * A local reply from filter `r` runs through `r`'s response callbacks, then through the
//!   filters before `r` in reverse order, and becomes the downstream response.
//! * End of stream ([`ChainStream::finish`]): as Envoy, `proxy_on_log` for every filter (a filter
//!   the request never reached gets its context created for it), then `proxy_on_done` and
//!   `proxy_on_delete` for every filter.
//!
//! Filters can release a held request later (a tick, another stream's end): call
//! [`ChainStream::pump`] after anything that may have run guest code.
//!
//! Not modelled: trailers; a local reply from filter `r` after a later filter saw the request
//! headers is not shown to that later filter (Envoy would run it first).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::http::driver::Side;
use crate::http::headers::HeaderMap;
use crate::http::state::LocalReply;
use crate::http::state::{Direction, StreamEvent};
use crate::http::stream::HttpStream;
use crate::plugin::Plugin;
use crate::vm::counts::{CallCounts, HostCallNames};

/// An ordered list of filters (plugins). Cheap to clone.
#[derive(Clone, Default)]
pub struct FilterChain {
    filters: Arc<Vec<(String, Plugin)>>,
}

impl FilterChain {
    /// An empty chain.
    pub fn new() -> FilterChain {
        FilterChain::default()
    }

    /// Appends a filter.
    pub fn filter(self, name: &str, plugin: Plugin) -> FilterChain {
        let mut filters = Arc::unwrap_or_clone(self.filters);
        filters.push((name.to_owned(), plugin));
        FilterChain {
            filters: Arc::new(filters),
        }
    }

    /// Number of filters.
    pub fn len(&self) -> usize {
        self.filters.len()
    }

    /// Whether the chain has no filter.
    pub fn is_empty(&self) -> bool {
        self.filters.is_empty()
    }

    /// The filters' names, in order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.filters.iter().map(|(name, _)| name.as_str())
    }

    /// Filter `index`'s plugin.
    pub fn plugin(&self, index: usize) -> Option<&Plugin> {
        self.filters.get(index).map(|(_, p)| p)
    }

    /// The position of the filter named `name`.
    pub fn position(&self, name: &str) -> Option<usize> {
        self.filters.iter().position(|(n, _)| n == name)
    }

    /// Each filter's [`Plugin::call_counts`], in chain order.
    pub fn call_counts(&self) -> Vec<CallCounts> {
        self.filters.iter().map(|(_, p)| p.call_counts()).collect()
    }

    /// Each filter's [`Plugin::host_call_names`], in chain order.
    pub fn host_call_names(&self) -> Vec<HostCallNames> {
        self.filters
            .iter()
            .map(|(_, p)| p.host_call_names())
            .collect()
    }

    /// The number of workers every filter has a VM for.
    pub fn workers(&self) -> usize {
        self.filters
            .iter()
            .map(|(_, p)| p.vm_count())
            .min()
            .unwrap_or(0)
    }

    /// A new request on worker `worker` (VM `worker` of every filter). No filter context is
    /// created yet.
    pub fn stream(&self, worker: usize) -> Result<ChainStream> {
        for (_, plugin) in self.filters.iter() {
            if worker >= plugin.vm_count() {
                return Err(Error::NoSuchVm {
                    vm: worker,
                    count: plugin.vm_count(),
                });
            }
        }
        let n = self.filters.len();
        Ok(ChainStream {
            chain: self.clone(),
            worker,
            streams: (0..n).map(|_| None).collect(),
            properties: Vec::new(),
            request: Pipe::new(Side::Request, (0..n).collect(), Source::external()),
            response: None,
            reply_from: None,
            upstream_taken: false,
            time: vec![Duration::ZERO; n],
            finished: false,
        })
    }

    /// Moves every filter's virtual clock forward (firing due ticks).
    pub fn advance(&self, by: Duration) -> Result<()> {
        for (_, plugin) in self.filters.iter() {
            plugin.advance(by)?;
        }
        Ok(())
    }

    /// Moves every filter's virtual clock to `when` (never backwards).
    pub fn advance_to(&self, when: std::time::SystemTime) -> Result<()> {
        for (_, plugin) in self.filters.iter() {
            if let Ok(by) = when.duration_since(plugin.now()) {
                plugin.advance(by)?;
            }
        }
        Ok(())
    }

    /// Delivers the real callouts' answers that arrived, for every filter.
    pub fn deliver_http_responses(&self) -> Result<usize> {
        let mut n = 0;
        for (_, plugin) in self.filters.iter() {
            n += plugin.deliver_http_responses()?;
        }
        Ok(n)
    }
}

/// Where a request stands in the chain.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ChainState {
    /// Filter `at` holds the request (headers or body).
    Held { at: usize },
    /// The request went through every filter: [`ChainStream::upstream_request`].
    Upstream,
    /// Filter `from` answered with a local reply.
    LocalReply { from: usize },
    /// A filter reset the stream (`proxy_close_stream`).
    Reset { by: usize },
}

/// The request as it leaves the last filter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UpstreamRequest {
    pub headers: HeaderMap,
    pub body: Vec<u8>,
}

/// Response output for the client since the last [`ChainStream::take_downstream`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Downstream {
    /// The response headers, the first time they are available.
    pub headers: Option<HeaderMap>,
    /// Body bytes not taken before.
    pub body: Vec<u8>,
    /// The response is complete.
    pub end: bool,
}

/// Where a pipe's input comes from.
#[derive(Debug, Clone)]
enum Source {
    /// The client (request) or the upstream (response).
    External {
        headers: Option<HeaderMap>,
        body: Vec<u8>,
        eos: bool,
    },
    /// What a filter let go in the pipe's direction (a local reply's response).
    Filter(usize),
}

impl Source {
    fn external() -> Source {
        Source::External {
            headers: None,
            body: Vec::new(),
            eos: false,
        }
    }
}

/// What one filter of a pipe was given.
#[derive(Debug, Clone, Default)]
struct Fed {
    headers: Option<HeaderMap>,
    body: usize,
    eos: bool,
}

/// One direction through the chain.
#[derive(Debug, Clone)]
struct Pipe {
    side: Side,
    order: Vec<usize>,
    fed: Vec<Fed>,
    source: Source,
    /// Output bytes handed to the sink.
    taken_body: usize,
    taken_headers: bool,
    ended: bool,
}

impl Pipe {
    fn new(side: Side, order: Vec<usize>, source: Source) -> Pipe {
        Pipe {
            side,
            fed: vec![Fed::default(); order.len()],
            order,
            source,
            taken_body: 0,
            taken_headers: false,
            ended: false,
        }
    }
}

/// What a filter let go in one direction.
struct Output {
    headers: Option<HeaderMap>,
    body_len: usize,
    eos: bool,
}

fn direction(state: &crate::http::state::StreamState, side: Side) -> &Direction {
    match side {
        Side::Request => &state.request,
        Side::Response => &state.response,
    }
}

/// One request through a [`FilterChain`].
pub struct ChainStream {
    chain: FilterChain,
    worker: usize,
    streams: Vec<Option<HttpStream>>,
    properties: Vec<(Vec<String>, Vec<u8>)>,
    request: Pipe,
    response: Option<Pipe>,
    reply_from: Option<usize>,
    upstream_taken: bool,
    time: Vec<Duration>,
    finished: bool,
}

impl ChainStream {
    /// The worker (VM index) the request runs on.
    pub fn worker(&self) -> usize {
        self.worker
    }

    /// Sets a property on every filter's stream (now, and on those created later), e.g.
    /// `(&["source", "address"], "127.0.0.1:50000")`.
    pub fn set_property(&mut self, path: &[&str], value: impl Into<Vec<u8>>) -> Result<()> {
        let value = value.into();
        for stream in self.streams.iter().flatten() {
            if !stream.is_finished() {
                stream.set_property(path, value.clone())?;
            }
        }
        let path: Vec<String> = path.iter().map(|s| (*s).to_owned()).collect();
        self.properties.retain(|(p, _)| *p != path);
        self.properties.push((path, value));
        Ok(())
    }

    /// Request headers from the client, then a pump.
    pub fn send_request_headers(&mut self, headers: HeaderMap, end_of_stream: bool) -> Result<()> {
        if let Source::External {
            headers: h, eos, ..
        } = &mut self.request.source
        {
            *h = Some(headers);
            *eos = end_of_stream;
        }
        self.pump()
    }

    /// A request body chunk from the client, then a pump.
    pub fn send_request_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Result<()> {
        if let Source::External { body, eos, .. } = &mut self.request.source {
            body.extend_from_slice(chunk);
            *eos = end_of_stream;
        }
        self.pump()
    }

    /// Headers and a whole body (the end of the request).
    pub fn send_request(&mut self, headers: HeaderMap, body: &[u8]) -> Result<()> {
        if body.is_empty() {
            return self.send_request_headers(headers, true);
        }
        if let Source::External {
            headers: h,
            body: b,
            eos,
        } = &mut self.request.source
        {
            *h = Some(headers);
            b.extend_from_slice(body);
            *eos = true;
        }
        self.pump()
    }

    /// Response headers from the upstream (after [`ChainState::Upstream`]), then a pump.
    pub fn send_response_headers(&mut self, headers: HeaderMap, end_of_stream: bool) -> Result<()> {
        if self.response.is_none() && self.reply_from.is_none() {
            let order = (0..self.chain.len()).rev().collect();
            self.response = Some(Pipe::new(Side::Response, order, Source::external()));
        }
        if let Some(Pipe {
            source: Source::External {
                headers: h, eos, ..
            },
            ..
        }) = &mut self.response
        {
            *h = Some(headers);
            *eos = end_of_stream;
        }
        self.pump()
    }

    /// A response body chunk from the upstream, then a pump.
    pub fn send_response_body(&mut self, chunk: &[u8], end_of_stream: bool) -> Result<()> {
        if let Some(Pipe {
            source: Source::External { body, eos, .. },
            ..
        }) = &mut self.response
        {
            body.extend_from_slice(chunk);
            *eos = end_of_stream;
        }
        self.pump()
    }

    /// Passes on whatever the filters let go since the last call (a held request released by
    /// a tick or by another stream, a local reply sent from a root context).
    pub fn pump(&mut self) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        if self.reply_from.is_none() && self.reset_by().is_none() {
            self.pump_pipe(Side::Request)?;
            if let Some(from) = self.find_local_reply() {
                self.reply_from = Some(from);
                let order = (0..from).rev().collect();
                self.response = Some(Pipe::new(Side::Response, order, Source::Filter(from)));
            }
        }
        if self.response.is_some() && self.reset_by().is_none() {
            self.pump_pipe(Side::Response)?;
        }
        Ok(())
    }

    /// Where the request stands.
    pub fn state(&self) -> ChainState {
        if let Some(by) = self.reset_by() {
            return ChainState::Reset { by };
        }
        if let Some(from) = self.reply_from {
            return ChainState::LocalReply { from };
        }
        let n = self.request.order.len();
        if n == 0 || self.pipe_output(&self.request, n).is_some_and(|o| o.eos) {
            return ChainState::Upstream;
        }
        let at = (0..n)
            .find(|&p| {
                !self
                    .pipe_output(&self.request, p + 1)
                    .is_some_and(|o| o.eos)
            })
            .unwrap_or(0);
        ChainState::Held { at }
    }

    /// The request as the last filter let it go, once all of it has (headers and the whole
    /// body); `None` before that.
    pub fn upstream_request(&self) -> Option<UpstreamRequest> {
        let n = self.request.order.len();
        let out = self.pipe_output(&self.request, n)?;
        if !out.eos || self.reply_from.is_some() {
            return None;
        }
        let headers = out.headers?;
        let body = self.pipe_body(&self.request, n, 0);
        Some(UpstreamRequest { headers, body })
    }

    /// Like [`ChainStream::upstream_request`], but only the first time it is available.
    pub fn take_upstream_request(&mut self) -> Option<UpstreamRequest> {
        if self.upstream_taken {
            return None;
        }
        let request = self.upstream_request()?;
        self.upstream_taken = true;
        Some(request)
    }

    /// The local reply and the filter that sent it.
    pub fn local_reply(&self) -> Option<(usize, LocalReply)> {
        let from = self.reply_from?;
        let reply = self.streams.get(from)?.as_ref()?.local_reply()?;
        Some((from, reply))
    }

    /// The response for the client that is new since the last call.
    pub fn take_downstream(&mut self) -> Downstream {
        let Some(pipe) = &self.response else {
            return Downstream::default();
        };
        let n = pipe.order.len();
        let Some(out) = self.pipe_output(pipe, n) else {
            return Downstream::default();
        };
        let mut taken = Downstream::default();
        if !pipe.taken_headers {
            taken.headers = out.headers.clone();
        }
        if out.headers.is_some() {
            taken.body = self.pipe_body(pipe, n, pipe.taken_body);
        }
        taken.end = out.eos && out.headers.is_some() && !pipe.ended;
        if let Some(pipe) = &mut self.response {
            pipe.taken_headers |= taken.headers.is_some();
            pipe.taken_body += taken.body.len();
            pipe.ended |= taken.end;
        }
        taken
    }

    /// Time spent in each filter's callbacks so far (wall clock, guest and host).
    pub fn filter_time(&self) -> &[Duration] {
        &self.time
    }

    /// Filter `index`'s stream, once the request reached it.
    pub fn filter_stream(&self, index: usize) -> Option<&HttpStream> {
        self.streams.get(index)?.as_ref()
    }

    /// The request headers filter `index` was given (as the filters before it left them).
    pub fn request_headers_into(&self, index: usize) -> Option<&HeaderMap> {
        let p = self.request.order.iter().position(|&i| i == index)?;
        self.request.fed.get(p)?.headers.as_ref()
    }

    /// Ends the request: `proxy_on_log` for every filter, then `proxy_on_done` and
    /// `proxy_on_delete` for every filter, in chain order. A filter that fails (a trap) does
    /// not stop the others; the first error is returned.
    pub fn finish(&mut self) -> Result<()> {
        if self.finished {
            return Ok(());
        }
        self.finished = true;
        let mut first_error = None;
        for i in 0..self.chain.len() {
            let created = self.stream_at(i).map(|_| ());
            if let Err(e) = created.and_then(|()| self.logged(i)) {
                first_error.get_or_insert(e);
            }
        }
        for i in 0..self.chain.len() {
            if let Some(stream) = self.streams.get(i).and_then(Option::as_ref) {
                if stream.is_finished() {
                    continue;
                }
                let start = Instant::now();
                let destroyed = stream.destroy();
                self.time[i] += start.elapsed();
                if let Err(e) = destroyed {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Whether [`ChainStream::finish`] ran.
    pub fn is_finished(&self) -> bool {
        self.finished
    }

    fn logged(&mut self, i: usize) -> Result<()> {
        let Some(stream) = self.streams.get(i).and_then(Option::as_ref) else {
            return Ok(());
        };
        let start = Instant::now();
        let result = stream.log_phase();
        self.time[i] += start.elapsed();
        result
    }

    /// Filter `i`'s stream, created (with the chain's properties) on first use.
    fn stream_at(&mut self, i: usize) -> Result<&HttpStream> {
        if self.streams.get(i).is_some_and(Option::is_none) {
            let plugin = self.chain.plugin(i).ok_or(Error::NoSuchVm {
                vm: i,
                count: self.chain.len(),
            })?;
            let start = Instant::now();
            let stream = plugin.http_stream(self.worker);
            self.time[i] += start.elapsed();
            let stream = stream?;
            for (path, value) in &self.properties {
                let path: Vec<&str> = path.iter().map(String::as_str).collect();
                stream.set_property(&path, value.clone())?;
            }
            self.streams[i] = Some(stream);
        }
        self.streams
            .get(i)
            .and_then(Option::as_ref)
            .ok_or(Error::NoSuchVm {
                vm: i,
                count: self.chain.len(),
            })
    }

    fn reset_by(&self) -> Option<usize> {
        self.streams.iter().position(|s| {
            s.as_ref().is_some_and(|s| {
                s.events()
                    .iter()
                    .any(|e| matches!(e, StreamEvent::Closed(_)))
            })
        })
    }

    fn find_local_reply(&self) -> Option<usize> {
        self.streams
            .iter()
            .position(|s| s.as_ref().is_some_and(|s| s.local_reply().is_some()))
    }

    /// The output of position `p - 1` of `pipe` (position 0: the pipe's source).
    fn pipe_output(&self, pipe: &Pipe, p: usize) -> Option<Output> {
        if p == 0 {
            return match &pipe.source {
                Source::External { headers, body, eos } => Some(Output {
                    headers: headers.clone(),
                    body_len: body.len(),
                    eos: *eos && headers.is_some(),
                }),
                Source::Filter(i) => self.filter_output(*i, pipe.side, true),
            };
        }
        let fed = pipe.fed.get(p - 1)?;
        let i = *pipe.order.get(p - 1)?;
        self.filter_output(i, pipe.side, fed.eos)
    }

    fn filter_output(&self, i: usize, side: Side, eos_in: bool) -> Option<Output> {
        let stream = self.streams.get(i)?.as_ref()?;
        Some(stream.with_state(|s| {
            let d = direction(s, side);
            let headers = d.forwarded_headers.clone();
            let passed = headers.is_some() && !d.buffering;
            Output {
                eos: passed && (eos_in || d.closed),
                headers,
                body_len: d.forwarded_body.len(),
            }
        }))
    }

    fn pipe_body(&self, pipe: &Pipe, p: usize, from: usize) -> Vec<u8> {
        let slice = |body: &[u8]| body.get(from..).map(<[u8]>::to_vec).unwrap_or_default();
        if p == 0 {
            return match &pipe.source {
                Source::External { body, .. } => slice(body),
                Source::Filter(i) => self.filter_body(*i, pipe.side, from),
            };
        }
        match pipe.order.get(p - 1) {
            Some(&i) => self.filter_body(i, pipe.side, from),
            None => Vec::new(),
        }
    }

    fn filter_body(&self, i: usize, side: Side, from: usize) -> Vec<u8> {
        match self.streams.get(i).and_then(Option::as_ref) {
            Some(stream) => stream.with_state(|s| {
                direction(s, side)
                    .forwarded_body
                    .get(from..)
                    .map(<[u8]>::to_vec)
                    .unwrap_or_default()
            }),
            None => Vec::new(),
        }
    }

    /// Feeds each filter of a pipe what the one before it let go, until nothing moves.
    fn pump_pipe(&mut self, side: Side) -> Result<()> {
        let len = match side {
            Side::Request => self.request.order.len(),
            Side::Response => self.response.as_ref().map_or(0, |p| p.order.len()),
        };
        for p in 0..len {
            let pipe = match side {
                Side::Request => &self.request,
                Side::Response => match &self.response {
                    Some(pipe) => pipe,
                    None => return Ok(()),
                },
            };
            let Some(input) = self.pipe_output(pipe, p) else {
                return Ok(());
            };
            let Some(headers) = input.headers.clone() else {
                return Ok(());
            };
            let i = pipe.order[p];
            let fed = pipe.fed[p].clone();
            let new_body = if input.body_len > fed.body {
                self.pipe_body(pipe, p, fed.body)
            } else {
                Vec::new()
            };
            if side == Side::Request {
                self.stream_at(i)?;
            }
            let Some(stream) = self.streams.get(i).and_then(Option::as_ref) else {
                return Ok(());
            };
            let start = Instant::now();
            let mut now_fed = fed.clone();
            let result = (|| -> Result<()> {
                if fed.headers.is_none() {
                    let eos = input.eos && new_body.is_empty() && input.body_len == 0;
                    now_fed.headers = Some(headers.clone());
                    now_fed.eos = eos;
                    stream.send_headers_map(side, headers, eos)?;
                }
                if !new_body.is_empty() {
                    now_fed.body += new_body.len();
                    now_fed.eos = input.eos;
                    stream.send_body_on(side, &new_body, input.eos)?;
                } else if input.eos && !now_fed.eos {
                    now_fed.eos = true;
                    stream.send_body_on(side, &[], true)?;
                }
                Ok(())
            })();
            self.time[i] += start.elapsed();
            match side {
                Side::Request => self.request.fed[p] = now_fed,
                Side::Response => {
                    if let Some(pipe) = &mut self.response {
                        pipe.fed[p] = now_fed;
                    }
                }
            }
            result?;
            if side == Side::Request && self.find_local_reply().is_some() {
                return Ok(());
            }
        }
        Ok(())
    }
}
