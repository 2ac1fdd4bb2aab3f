//! A scriptable proxy-wasm filter for the harness's own tests.
//!
//! The plugin configuration is `;`-separated words: `tick=<ms>` arms a tick, `queue` registers
//! queue "q", `fail` makes `on_configure` return false, `panic` panics there. Each request names
//! what to do in `x-test-action`; results come back as request headers (`x-*`) or log lines.
//! gRPC callouts (`grpc-*` actions) report their callbacks as `grpc ...` log lines. With the
//! word `tcp` the plugin is a network filter instead: the data itself says what to do (see
//! `TcpProbe`), and every callback logs a `tcp ...` line.

// It exercises the SDK's own accessors on purpose (the harness must answer them as Envoy does);
// the filters' ban on the UTF-8-trapping header getters (clippy.toml) is not for it.
#![allow(clippy::disallowed_methods)]

use std::collections::hash_map::RandomState;
use std::hash::BuildHasher;
use std::time::{Duration, UNIX_EPOCH};

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext, StreamContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType, PeerType};

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Trace);
    proxy_wasm::set_root_context(|_| Box::new(Root { queue: None, tcp: false }));
}}

struct Root {
    queue: Option<u32>,
    /// A network filter (configuration word `tcp`).
    tcp: bool,
}

impl Context for Root {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body: usize, _trailers: usize) {
        let status = self
            .get_http_call_response_header(":status")
            .unwrap_or_default();
        let text = self
            .get_http_call_response_body(0, body)
            .unwrap_or_default();
        log::info!(
            "root callout {token}: status={status} headers={headers} body={}",
            String::from_utf8_lossy(&text)
        );
    }
}

impl RootContext for Root {
    fn on_vm_start(&mut self, _size: usize) -> bool {
        let config = self.get_vm_configuration().unwrap_or_default();
        log::info!("vm_start config={}", String::from_utf8_lossy(&config));
        true
    }

    fn on_configure(&mut self, _size: usize) -> bool {
        let config = self.get_plugin_configuration().unwrap_or_default();
        let config = String::from_utf8_lossy(&config).into_owned();
        log::info!("configure config={config}");
        for word in config.split(';') {
            match word.split_once('=') {
                Some(("tick", ms)) => {
                    self.set_tick_period(Duration::from_millis(ms.parse().unwrap_or(0)))
                }
                Some(("callout", upstream)) => {
                    let headers = vec![
                        (":method", "GET"),
                        (":path", "/snapshot"),
                        (":authority", "agg"),
                    ];
                    match self.dispatch_http_call(
                        upstream,
                        headers,
                        None,
                        vec![],
                        Duration::from_secs(1),
                    ) {
                        Ok(token) => log::info!("root dispatched {token}"),
                        Err(status) => log::warn!("root dispatch failed: {status:?}"),
                    }
                }
                _ => match word {
                    "queue" => self.queue = Some(self.register_shared_queue("q")),
                    "tcp" => self.tcp = true,
                    "fail" => return false,
                    "panic" => panic!("configure panicked on purpose"),
                    _ => {}
                },
            }
        }
        true
    }

    fn on_tick(&mut self) {
        let now = self
            .get_current_time()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let id = hostcalls::define_metric(MetricType::Counter, "guest_ticks").unwrap_or(0);
        let _ = hostcalls::increment_metric(id, 1);
        log::info!("tick at {}", now.as_millis());
    }

    fn on_queue_ready(&mut self, queue: u32) {
        while let Ok(Some(item)) = self.dequeue_shared_queue(queue) {
            log::info!("queue item {}", String::from_utf8_lossy(&item));
        }
    }

    fn create_http_context(&self, context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Probe {
            context_id,
            callout: None,
        }))
    }

    fn create_stream_context(&self, context_id: u32) -> Option<Box<dyn StreamContext>> {
        Some(Box::new(TcpProbe { context_id }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(if self.tcp {
            ContextType::StreamContext
        } else {
            ContextType::HttpContext
        })
    }
}

struct Probe {
    context_id: u32,
    callout: Option<u32>,
}

impl Probe {
    fn run(&mut self, action: &str) -> Action {
        match action {
            "local-reply" => {
                self.send_http_response(403, vec![("x-reason", "denied")], Some(b"go away"));
                return Action::Pause;
            }
            "panic" => panic!("request headers panicked on purpose"),
            "shared" => self.shared_data(),
            "enqueue" => {
                let queue = self.resolve_shared_queue("", "q");
                let result = queue.map(|q| self.enqueue_shared_queue(q, Some(b"hello")));
                self.set_http_request_header("x-enqueue", Some(&format!("{result:?}")));
            }
            "callout" => {
                let headers = vec![
                    (":method", "POST"),
                    (":path", "/score"),
                    (":authority", "svc"),
                ];
                let token = self.dispatch_http_call(
                    "scorer",
                    headers,
                    Some(b"ping"),
                    vec![],
                    Duration::from_millis(250),
                );
                self.set_http_request_header("x-callout", Some(&format!("{token:?}")));
                self.callout = token.ok();
                return Action::Pause;
            }
            "callout-bad" => {
                let headers = vec![(":method", "GET"), (":path", "/x")];
                let token = self.dispatch_http_call(
                    "scorer",
                    headers,
                    None,
                    vec![],
                    Duration::from_secs(1),
                );
                self.set_http_request_header("x-callout", Some(&format!("{token:?}")));
            }
            "property" => {
                let value = self.get_property(vec!["upstream", "address"]);
                let text =
                    value.map_or("none".into(), |v| String::from_utf8_lossy(&v).into_owned());
                self.set_http_request_header("x-prop", Some(&text));
                let path = self
                    .get_property(vec!["request", "path"])
                    .unwrap_or_default();
                self.set_http_request_header("x-prop-path", Some(&String::from_utf8_lossy(&path)));
                self.set_property(vec!["kvoy", "note"], Some(b"set-by-guest"));
            }
            "foreign" => {
                let result = self.call_foreign_function("echo", Some(b"args"));
                let text = format!(
                    "{:?}",
                    result.map(|r| r.map(|b| String::from_utf8_lossy(&b).into_owned()))
                );
                self.set_http_request_header("x-foreign", Some(&text));
                let missing = self.call_foreign_function("missing", None);
                self.set_http_request_header("x-foreign-missing", Some(&format!("{missing:?}")));
            }
            "metrics" => self.metrics(),
            "time" => {
                let now = self
                    .get_current_time()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                self.set_http_request_header("x-time-ms", Some(&now.as_millis().to_string()));
                let std_now = std::time::SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                self.set_http_request_header(
                    "x-wasi-time-ms",
                    Some(&std_now.as_millis().to_string()),
                );
            }
            "random" => {
                let hash = RandomState::new().hash_one("kvoy");
                self.set_http_request_header("x-random", Some(&hash.to_string()));
            }
            "stdio" => {
                println!("hello from stdout");
                eprintln!("hello from stderr");
            }
            "continue" => return Action::Continue,
            _ => return self.grpc(action),
        }
        Action::Pause
    }

    /// The gRPC actions; statuses come back as `x-grpc-*` request headers.
    fn grpc(&mut self, action: &str) -> Action {
        let metadata: Vec<(&str, &[u8])> = vec![("x-md", b"1")];
        match action.split_once(':') {
            Some(("grpc-close", token)) => {
                let result = hostcalls::close_grpc_stream(token.parse().unwrap_or(0));
                self.set_http_request_header("x-grpc-close", Some(&format!("{result:?}")));
                return Action::Continue;
            }
            Some(("grpc-call", cluster)) => {
                let token = self.dispatch_grpc_call(
                    cluster,
                    "kvoy.Scorer",
                    "Score",
                    metadata,
                    Some(b"ping"),
                    Duration::from_millis(250),
                );
                self.set_http_request_header("x-grpc-call", Some(&format!("{token:?}")));
                return if token.is_ok() {
                    Action::Pause
                } else {
                    Action::Continue
                };
            }
            _ => {}
        }
        match action {
            "grpc-stream" => {
                let token = self.open_grpc_stream("scorer", "kvoy.Events", "Watch", metadata);
                self.set_http_request_header("x-grpc-stream", Some(&format!("{token:?}")));
                if let Ok(token) = token {
                    let sent = hostcalls::send_grpc_stream_message(token, Some(b"hello"), false);
                    self.set_http_request_header("x-grpc-send", Some(&format!("{sent:?}")));
                }
            }
            "grpc-misuse" => {
                let call = self
                    .dispatch_grpc_call("scorer", "s", "m", vec![], None, Duration::ZERO)
                    .unwrap_or(0);
                let on_call = hostcalls::send_grpc_stream_message(call, Some(b"x"), false);
                let unknown = hostcalls::send_grpc_stream_message(1002, Some(b"x"), false);
                let cancel = hostcalls::cancel_grpc_call(call);
                let again = hostcalls::cancel_grpc_call(call);
                let close = hostcalls::close_grpc_stream(1002);
                let report = format!(
                    "call={call} send-on-call={on_call:?} send-unknown={unknown:?} \
                     cancel={cancel:?} cancel-again={again:?} close-unknown={close:?}"
                );
                self.set_http_request_header("x-grpc-misuse", Some(&report));
            }
            _ => return Action::Pause,
        }
        Action::Continue
    }

    fn shared_data(&mut self) {
        let (value, cas) = self.get_shared_data("k");
        let first = self.set_shared_data("k", Some(b"v1"), cas);
        let (_, cas1) = self.get_shared_data("k");
        let second = self.set_shared_data("k", Some(b"v2"), cas1);
        let stale = self.set_shared_data("k", Some(b"v3"), cas1);
        let (now, _) = self.get_shared_data("k");
        let report = format!(
            "before={:?} first={first:?} second={second:?} stale={stale:?} now={:?}",
            value.map(|v| String::from_utf8_lossy(&v).into_owned()),
            now.map(|v| String::from_utf8_lossy(&v).into_owned()),
        );
        self.set_http_request_header("x-shared", Some(&report));
    }

    fn metrics(&mut self) {
        let counter = hostcalls::define_metric(MetricType::Counter, "guest_requests").unwrap_or(0);
        let gauge = hostcalls::define_metric(MetricType::Gauge, "guest_inflight").unwrap_or(0);
        let histogram =
            hostcalls::define_metric(MetricType::Histogram, "guest_latency").unwrap_or(0);
        let _ = hostcalls::increment_metric(counter, 1);
        let _ = hostcalls::record_metric(gauge, 5);
        let _ = hostcalls::increment_metric(gauge, -2);
        let _ = hostcalls::record_metric(histogram, 42);
        let report = format!(
            "counter={:?} gauge={:?} histogram={:?}",
            hostcalls::get_metric(counter),
            hostcalls::get_metric(gauge),
            hostcalls::get_metric(histogram)
        );
        self.set_http_request_header("x-metrics", Some(&report));
    }
}

impl Context for Probe {
    fn on_http_call_response(&mut self, token: u32, headers: usize, body: usize, _trailers: usize) {
        // After a failure there is no response map: reading it is BadArgument (an SDK panic), as
        // in Envoy.
        let status = match headers {
            0 => "none".into(),
            _ => self
                .get_http_call_response_header(":status")
                .unwrap_or_default(),
        };
        let text = self
            .get_http_call_response_body(0, body)
            .unwrap_or_default();
        let (code, message) = self.get_grpc_status();
        let report = format!(
            "token={token} status={status} body={} code={code} message={message:?}",
            String::from_utf8_lossy(&text)
        );
        self.set_http_request_header("x-callout-result", Some(&report));
        self.resume_http_request();
    }

    fn on_grpc_call_response(&mut self, token: u32, status: u32, size: usize) {
        let body = self
            .get_grpc_call_response_body(0, size)
            .unwrap_or_default();
        let (code, message) = self.get_grpc_status();
        let report = format!(
            "token={token} status={status} body={} code={code} message={message:?}",
            text(&body)
        );
        log::info!("grpc call context={} {report}", self.context_id);
        self.set_http_request_header("x-grpc-result", Some(&report));
        self.resume_http_request();
    }

    fn on_grpc_stream_initial_metadata(&mut self, token: u32, count: u32) {
        let pairs = metadata_text(self.get_grpc_stream_initial_metadata());
        log::info!("grpc stream {token} initial count={count} {pairs}");
    }

    fn on_grpc_stream_message(&mut self, token: u32, size: usize) {
        self.grpc_stream_message(token, size);
    }

    fn on_grpc_stream_trailing_metadata(&mut self, token: u32, count: u32) {
        let pairs = metadata_text(self.get_grpc_stream_trailing_metadata());
        log::info!("grpc stream {token} trailing count={count} {pairs}");
    }

    fn on_grpc_stream_close(&mut self, token: u32, status: u32) {
        let (code, message) = self.get_grpc_status();
        log::info!("grpc stream {token} closed status={status} code={code} message={message:?}");
    }
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

fn metadata_text(pairs: Vec<(String, Vec<u8>)>) -> String {
    let pairs: Vec<String> = pairs
        .into_iter()
        .map(|(k, v)| format!("{k}={}", text(&v)))
        .collect();
    pairs.join(",")
}

impl Probe {
    fn grpc_stream_message(&mut self, token: u32, size: usize) {
        let message = self.get_grpc_stream_message(0, size).unwrap_or_default();
        let message = text(&message);
        log::info!(
            "grpc stream {token} context={} message={message}",
            self.context_id
        );
        let reply = match message.as_str() {
            "close" => hostcalls::close_grpc_stream(token),
            "cancel" => hostcalls::cancel_grpc_stream(token),
            _ => hostcalls::send_grpc_stream_message(token, Some(b"ack"), message == "last"),
        };
        log::info!("grpc stream {token} reply={reply:?}");
    }
}

impl HttpContext for Probe {
    fn on_http_request_headers(&mut self, headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_request_header("x-seen-headers", Some(&headers.to_string()));
        // A client cannot choose its own destination.
        self.set_http_request_header("x-gateway-destination-endpoint", None);
        let action = self
            .get_http_request_header("x-test-action")
            .unwrap_or_default();
        self.run(&action)
    }

    fn on_http_request_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_request_body(0, size).unwrap_or_default();
        if body == b"reject" {
            self.send_http_response(400, vec![], Some(b"rejected body"));
            return Action::Pause;
        }
        if body == b"panic" {
            panic!("body panicked on purpose");
        }
        self.set_http_request_header("x-body", Some(&String::from_utf8_lossy(&body)));
        self.set_http_request_header("x-body-size", Some(&size.to_string()));
        Action::Continue
    }

    fn on_http_response_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        self.set_http_response_header("x-filtered", Some("1"));
        let served = self
            .get_property(vec!["upstream", "address"])
            .unwrap_or_default();
        if !served.is_empty() {
            self.set_http_response_header("x-served-by", Some(&String::from_utf8_lossy(&served)));
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, size: usize, end_of_stream: bool) -> Action {
        if !end_of_stream {
            return Action::Pause;
        }
        let body = self.get_http_response_body(0, size).unwrap_or_default();
        self.set_http_response_body(0, size, &body.to_ascii_uppercase());
        Action::Continue
    }

    fn on_log(&mut self) {
        let path = self.get_http_request_header(":path").unwrap_or_default();
        let status = self.get_http_response_header(":status").unwrap_or_default();
        log::info!(
            "on_log context={} path={path} status={status}",
            self.context_id
        );
    }
}

/// A network filter. Downstream data ending in `hold` is held (`Pause`); `release` resumes
/// what is held; `rewrite` and `append` change the data; `close` / `close-upstream` close the
/// connection. Upstream data ending in `hold` is held; `upper` is upper-cased.
struct TcpProbe {
    context_id: u32,
}

impl Context for TcpProbe {
    fn on_done(&mut self) -> bool {
        log::info!("tcp done context={}", self.context_id);
        true
    }
}

impl StreamContext for TcpProbe {
    fn on_new_connection(&mut self) -> Action {
        log::info!("tcp new context={}", self.context_id);
        Action::Continue
    }

    fn on_downstream_data(&mut self, size: usize, end_of_stream: bool) -> Action {
        let data = text(&self.get_downstream_data(0, size).unwrap_or_default());
        log::info!("tcp downstream size={size} eos={end_of_stream} data={data}");
        match data.as_str() {
            "rewrite" => self.set_downstream_data(0, size, b"REWRITTEN"),
            "append" => self.set_downstream_data(size, 0, b"+tail"),
            "close" => self.close_downstream(),
            "close-upstream" => self.close_upstream(),
            _ if data.ends_with("hold") => return Action::Pause,
            _ if data.ends_with("release") => {
                self.resume_downstream();
                return Action::Pause;
            }
            _ => {}
        }
        Action::Continue
    }

    fn on_downstream_close(&mut self, peer: PeerType) {
        log::info!("tcp downstream close {peer:?} context={}", self.context_id);
    }

    fn on_upstream_data(&mut self, size: usize, end_of_stream: bool) -> Action {
        let data = self.get_upstream_data(0, size).unwrap_or_default();
        log::info!(
            "tcp upstream size={size} eos={end_of_stream} data={}",
            text(&data)
        );
        if data.ends_with(b"hold") {
            return Action::Pause;
        }
        if data == b"upper" {
            self.set_upstream_data(0, size, &data.to_ascii_uppercase());
        }
        Action::Continue
    }

    fn on_upstream_close(&mut self, peer: PeerType) {
        log::info!("tcp upstream close {peer:?}");
    }

    fn on_log(&mut self) {
        log::info!("tcp log context={}", self.context_id);
    }
}
