//! What every completion endpoint shares once its request is in the engine: reading the
//! engine's progress (token timings for the histograms, the request counters, the text so far)
//! and answering whole or as server-sent events. Each API only says how its bodies and events
//! look, through a [`Writer`].

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame};
use hyper::{Response, StatusCode};
use serde_json::Value;
use tokio::sync::mpsc;

use super::api::{ApiError, Usage};
use super::metrics::FinishedRequest;
use super::runtime::Progress;
use super::{error, json, HttpBody, Simulator};
use crate::engine::OutputVocab;

/// How one API writes its answer. Stream methods return SSE bytes.
pub trait Writer: Send {
    /// Called once when the generation finished, before [`Writer::whole`] or [`Writer::done`].
    fn finished(&mut self, _text: &str, _usage: &Usage) {}
    /// The JSON body of a whole (non-streamed) answer.
    fn whole(&mut self, text: &str, usage: &Usage) -> Value;
    /// Events sent as soon as the stream opens, before the engine produced anything.
    fn opening(&mut self) -> Vec<u8> {
        Vec::new()
    }
    /// The event(s) carrying one generated token.
    fn token(&mut self, word: &str) -> Vec<u8>;
    /// The events closing a finished stream.
    fn done(&mut self, text: &str, usage: &Usage) -> Vec<u8>;
    /// The events closing a stream that failed (the engine refused the request or stopped).
    fn failed(&mut self, e: &ApiError) -> Vec<u8>;
}

/// A request decoded by its API, ready for the engine.
pub struct Prepared {
    pub tokens: Vec<u32>,
    pub max_tokens: u32,
    /// The words it generates (the tokenizer's).
    pub output: Arc<OutputVocab>,
    pub stream: bool,
    pub writer: Box<dyn Writer>,
}

/// One step of a generation, as the writers see it.
enum Step {
    Token(Arc<str>),
    Done(Usage),
    Failed(ApiError),
}

/// A request in the engine: its progress channel, token timings and text so far. Dropping it
/// drops the channel, which makes the engine abort the request.
pub struct Generation {
    sim: Arc<Simulator>,
    progress: mpsc::UnboundedReceiver<Progress>,
    /// When the request arrived: TTFT counts from there, as vLLM's does.
    arrived: Instant,
    /// The first token: when, and the engine's queue and prefill times (wall clock).
    first: Option<(Instant, Duration, Duration)>,
    last: Option<Instant>,
    text: String,
}

impl Generation {
    pub fn new(
        sim: Arc<Simulator>,
        progress: mpsc::UnboundedReceiver<Progress>,
        arrived: Instant,
    ) -> Self {
        Generation {
            sim,
            progress,
            arrived,
            first: None,
            last: None,
            text: String::new(),
        }
    }

    /// The request's figures for the per-request histograms, once it is done.
    fn finished(&self, usage: &Usage) -> FinishedRequest {
        let (first_at, queue, prefill) =
            self.first
                .unwrap_or((self.arrived, Duration::ZERO, Duration::ZERO));
        let last = self.last.unwrap_or(first_at);
        FinishedRequest {
            queue,
            prefill,
            decode: last.saturating_duration_since(first_at),
            e2e: last.saturating_duration_since(self.arrived),
            prompt_tokens: usage.prompt_tokens,
            generation_tokens: usage.completion_tokens,
            cached_tokens: usage.cached_tokens,
        }
    }

    /// The next step; records the token timings (wall clock, as a client sees them) and, at
    /// the end, the request's outcome.
    async fn next(&mut self) -> Step {
        let recorder = &self.sim.recorder;
        match self.progress.recv().await {
            Some(Progress::First {
                word,
                at,
                queue,
                prefill,
                ..
            }) => {
                recorder.ttft(at.saturating_duration_since(self.arrived));
                self.first = Some((at, queue, prefill));
                self.last = Some(at);
                self.text.push_str(&word);
                Step::Token(word)
            }
            Some(Progress::Token { word, at }) => {
                if let Some(prev) = self.last {
                    recorder.inter_token(at.saturating_duration_since(prev));
                }
                self.last = Some(at);
                self.text.push_str(&word);
                Step::Token(word)
            }
            Some(Progress::Done(usage)) => {
                recorder.completed(&self.finished(&usage));
                Step::Done(usage)
            }
            Some(Progress::Failed(message)) => {
                recorder.failed();
                Step::Failed(ApiError::bad_request(message))
            }
            None => {
                recorder.failed();
                Step::Failed(ApiError {
                    status: 500,
                    kind: "InternalServerError",
                    code: "engine_stopped",
                    param: None,
                    message: "the engine stopped".into(),
                })
            }
        }
    }
}

/// Answers a generation with `writer`: one JSON body once it is done, or a stream of events.
pub async fn answer(
    generation: Generation,
    writer: Box<dyn Writer>,
    stream: bool,
) -> Response<HttpBody> {
    if stream {
        return streamed(generation, writer);
    }
    let (mut g, mut w) = (generation, writer);
    loop {
        match g.next().await {
            Step::Token(_) => {}
            Step::Done(usage) => {
                w.finished(&g.text, &usage);
                return json(StatusCode::OK, &w.whole(&g.text, &usage));
            }
            Step::Failed(e) => return error(&e),
        }
    }
}

fn streamed(mut g: Generation, mut w: Box<dyn Writer>) -> Response<HttpBody> {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let opening = w.opening();
        if !opening.is_empty() && tx.send(Bytes::from(opening)).await.is_err() {
            g.sim.recorder.failed();
            return;
        }
        loop {
            let (frame, last) = match g.next().await {
                Step::Token(word) => (w.token(&word), false),
                Step::Done(usage) => {
                    w.finished(&g.text, &usage);
                    (w.done(&g.text, &usage), true)
                }
                Step::Failed(e) => (w.failed(&e), true),
            };
            if tx.send(Bytes::from(frame)).await.is_err() {
                if !last {
                    // The client left: dropping `g` makes the engine abort the request.
                    g.sim.recorder.failed();
                }
                return;
            }
            if last {
                return;
            }
        }
    });
    let mut r = Response::new(ChannelBody(rx).boxed());
    if let Ok(v) = "text/event-stream".parse() {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

/// A response body fed by a channel of SSE frames.
struct ChannelBody(mpsc::Receiver<Bytes>);

impl Body for ChannelBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Infallible>>> {
        self.0.poll_recv(cx).map(|b| b.map(|b| Ok(Frame::data(b))))
    }
}

/// Appends `data: <json>\n\n` to `out`.
pub fn sse_data(out: &mut Vec<u8>, v: &Value) {
    out.extend_from_slice(b"data: ");
    out.extend(serde_json::to_vec(v).unwrap_or_default());
    out.extend_from_slice(b"\n\n");
}

/// Appends `event: <name>\ndata: <json>\n\n` to `out`.
pub fn sse_event(out: &mut Vec<u8>, name: &str, v: &Value) {
    out.extend_from_slice(b"event: ");
    out.extend_from_slice(name.as_bytes());
    out.push(b'\n');
    sse_data(out, v);
}
