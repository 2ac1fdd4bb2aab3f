//! The live load generator: sends a [`Plan`] through a proxy as streamed chat completions, in
//! real time, and records what each request saw into a [`Recorder`].
//!
//! Open loop: every session starts at its planned time on a thread of its own, whatever the
//! proxy's state (turns of one session follow each other, each `delay` after the previous one
//! completed, as an agent waits for its tool). Closed loop: `concurrency` workers take the
//! sessions in order, each starting the next as soon as its last one finished.
//!
//! A turn's prompt is the session's context so far plus its parts; a [`Part::Output`] is the
//! text the server actually returned for the previous turn (the simulation renders the engine's
//! tokens instead; kvoy-sim returns the same words either way).

use kvoy_shared::protocol::CHAT_COMPLETIONS_PATH;
use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvoy_testkit::load::{self, Timing};
use serde_json::json;

use crate::metrics::Recorder;
use crate::workload::{Part, Plan, Session};

/// How the plan is offered.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arrivals {
    /// Sessions start at their planned times.
    Open,
    /// This many sessions at a time, back to back.
    Closed(usize),
}

/// What one request saw.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub class: &'static str,
    /// When it was sent, from the start of the run.
    pub sent: Duration,
    pub timing: Result<Timing, String>,
    /// The server that answered (`x-served-by`).
    pub served_by: Option<String>,
}

/// Settings of one drive.
#[derive(Clone, Debug)]
pub struct Drive {
    pub proxy: SocketAddr,
    pub model: String,
    pub arrivals: Arrivals,
    /// Bound on connecting and on each read of one request.
    pub request_timeout: Duration,
    /// Bound on the whole drive: sessions not started by then are skipped, requests still
    /// running are abandoned (counted as errors).
    pub deadline: Duration,
}

/// Sends `plan` and waits for every request (bounded by `drive.deadline`). `progress` is called
/// with (requests finished, requests planned) as they finish.
pub fn run(plan: &Plan, drive: &Drive, progress: &mut dyn FnMut(usize, usize)) -> Vec<Outcome> {
    let total = plan.requests();
    let (tx, rx) = mpsc::channel::<Outcome>();
    let start = Instant::now();
    let sessions: Arc<Vec<Session>> = Arc::new(plan.sessions.clone());
    let dispatcher = {
        let sessions = Arc::clone(&sessions);
        let drive = drive.clone();
        std::thread::spawn(move || dispatch(&sessions, &drive, start, &tx))
    };
    let mut outcomes = Vec::with_capacity(total);
    while outcomes.len() < total {
        let left = drive.deadline.saturating_sub(start.elapsed());
        match rx.recv_timeout(left) {
            Ok(o) => {
                outcomes.push(o);
                progress(outcomes.len(), total);
            }
            // Every sender gone (all sessions done or skipped) or out of time.
            Err(_) => break,
        }
    }
    if dispatcher.is_finished() {
        let _ = dispatcher.join();
    }
    outcomes
}

fn spawn(f: impl FnOnce() + Send + 'static) {
    // Small stacks: an open-loop run may hold a few thousand requests in flight.
    if let Err(e) = std::thread::Builder::new().stack_size(256 * 1024).spawn(f) {
        log::error!("kvoy-bench: cannot start a request thread: {e}");
    }
}

fn dispatch(
    sessions: &Arc<Vec<Session>>,
    drive: &Drive,
    start: Instant,
    tx: &mpsc::Sender<Outcome>,
) {
    match drive.arrivals {
        Arrivals::Open => {
            for index in 0..sessions.len() {
                let at = sessions[index].start;
                if at >= drive.deadline {
                    break;
                }
                std::thread::sleep(at.saturating_sub(start.elapsed()));
                let (sessions, drive, tx) = (Arc::clone(sessions), drive.clone(), tx.clone());
                spawn(move || run_session(&sessions[index], &drive, start, &tx));
            }
        }
        Arrivals::Closed(concurrency) => {
            let next = Arc::new(Mutex::new(0usize));
            for _ in 0..concurrency.max(1) {
                let (sessions, drive, tx) = (Arc::clone(sessions), drive.clone(), tx.clone());
                let next = Arc::clone(&next);
                spawn(move || loop {
                    let index = {
                        let Ok(mut n) = next.lock() else { return };
                        let i = *n;
                        *n += 1;
                        i
                    };
                    let Some(session) = sessions.get(index) else {
                        return;
                    };
                    if start.elapsed() >= drive.deadline {
                        return;
                    }
                    run_session(session, &drive, start, &tx);
                });
            }
        }
    }
}

fn run_session(session: &Session, drive: &Drive, start: Instant, tx: &mpsc::Sender<Outcome>) {
    let mut context = String::new();
    let mut outputs: HashMap<u64, String> = HashMap::new();
    for (i, turn) in session.turns.iter().enumerate() {
        if i > 0 {
            std::thread::sleep(turn.delay);
        }
        for part in &turn.append {
            match part {
                Part::Output { request, .. } => {
                    if let Some(text) = outputs.get(request) {
                        context.push_str(text);
                    }
                }
                other => other.render(&mut context),
            }
        }
        let body = json!({
            "model": drive.model,
            "max_tokens": turn.max_tokens,
            "stream": true,
            "stream_options": {"include_usage": true},
            "messages": [{"role": "user", "content": context}],
        });
        let sent = start.elapsed();
        let timing = match serde_json::to_vec(&body) {
            Ok(bytes) => load::stream(
                drive.proxy,
                CHAT_COMPLETIONS_PATH,
                &[],
                &bytes,
                drive.request_timeout,
            )
            .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let served_by = timing
            .as_ref()
            .ok()
            .and_then(|t| t.header("x-served-by"))
            .map(str::to_owned);
        if let Ok(t) = &timing {
            outputs.insert(turn.id, output_text(t));
        }
        let failed = timing.as_ref().map_or(true, |t| t.status != 200);
        if tx
            .send(Outcome {
                class: session.class,
                sent,
                timing,
                served_by,
            })
            .is_err()
            || failed
        {
            // The run gave up on us, or the conversation cannot go on without this turn.
            return;
        }
    }
}

/// The generated text of a streamed response (its `delta.content` pieces, in order).
fn output_text(t: &Timing) -> String {
    t.output.clone()
}

/// Adds `outcomes` to `recorder`: endpoint indices by `pool` address order.
pub fn record(outcomes: &[Outcome], pool: &[SocketAddr], recorder: &mut Recorder) {
    let index: HashMap<String, usize> = pool
        .iter()
        .enumerate()
        .map(|(i, a)| (a.to_string(), i))
        .collect();
    let mut last_sent = Duration::ZERO;
    let first_served = recorder.served.len();
    for o in outcomes {
        recorder.first_arrival = Some(recorder.first_arrival.map_or(o.sent, |f| f.min(o.sent)));
        last_sent = last_sent.max(o.sent);
        let t = match &o.timing {
            Ok(t) if t.status == 200 && t.ttft.is_some() => t,
            _ => {
                recorder.rejected += 1;
                continue;
            }
        };
        let ttft = t.ttft.unwrap_or_default().as_secs_f64();
        recorder.ttft.push(ttft);
        recorder.class_ttft.entry(o.class).or_default().push(ttft);
        recorder.served.push(crate::metrics::Served {
            class: o.class,
            ttft_s: ttft,
            output_tokens: u64::from(t.tokens),
            window_output_tokens: 0,
        });
        recorder.e2e.push(t.total.as_secs_f64());
        recorder
            .itl
            .extend(t.token_gaps.iter().map(|g| g.as_secs_f32()));
        let prompt = t.prompt_tokens.unwrap_or(0);
        let cached = t.cached_tokens.unwrap_or(0);
        recorder.prompt_tokens += prompt;
        recorder.cached_tokens += cached;
        recorder.reported_cached_tokens += cached;
        recorder.output_tokens += u64::from(t.tokens);
        recorder.completed += 1;
        let done = o.sent + t.total;
        recorder.last_completion = recorder.last_completion.max(done);
        if let Some(i) = o.served_by.as_ref().and_then(|s| index.get(s)) {
            if let Some(c) = recorder.per_endpoint.get_mut(*i) {
                *c += 1;
            }
        }
    }
    // Throughput over the whole run, first arrival to last completion: a live plan of a few
    // hundred requests has no steady state, and over the arrival window alone (the
    // simulation's measure for its long stages) a policy with long queues would show almost
    // no output at all. Tokens count at their own times (the first at TTFT, the others after
    // their gaps), so an end before the last completion counts what came out by then.
    let end = recorder.last_completion.max(last_sent);
    recorder.window_end = end;
    let mut served = first_served;
    for o in outcomes {
        let Ok(t) = &o.timing else { continue };
        if t.status != 200 {
            continue;
        }
        let tokens = tokens_by(o.sent, t, end);
        recorder.window_output_tokens += tokens;
        // The requests the first pass recorded as served, in the same order.
        if t.ttft.is_some() {
            if let Some(s) = recorder.served.get_mut(served) {
                s.window_output_tokens = tokens;
            }
            served += 1;
        }
        if o.sent + t.total <= end {
            recorder.window_completed += 1;
        }
    }
}

/// Output tokens of a request sent at `sent` that had come out by `end`.
fn tokens_by(sent: Duration, t: &Timing, end: Duration) -> u64 {
    let Some(ttft) = t.ttft else { return 0 };
    let mut at = sent + ttft;
    let mut n = 0u64;
    for gap in std::iter::once(&Duration::ZERO).chain(&t.token_gaps) {
        at += *gap;
        if at > end {
            break;
        }
        n += 1;
    }
    n.min(u64::from(t.tokens))
}

/// The first error message of the outcomes, for the report.
pub fn first_error(outcomes: &[Outcome]) -> Option<String> {
    outcomes.iter().find_map(|o| match &o.timing {
        Err(e) => Some(e.clone()),
        Ok(t) if t.status != 200 => Some(format!(
            "HTTP {}: {}",
            t.status,
            String::from_utf8_lossy(&t.body)
                .chars()
                .take(200)
                .collect::<String>()
        )),
        Ok(_) => None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_count_at_their_own_times() {
        let ms = Duration::from_millis;
        let t = Timing {
            status: 200,
            ttft: Some(ms(100)),
            token_gaps: vec![ms(10); 4],
            tokens: 5,
            ..Timing::default()
        };
        // Tokens at 1.100, 1.110, 1.120, 1.130, 1.140 s.
        assert_eq!(tokens_by(ms(1000), &t, ms(1000)), 0);
        assert_eq!(tokens_by(ms(1000), &t, ms(1100)), 1);
        assert_eq!(tokens_by(ms(1000), &t, ms(1125)), 3);
        assert_eq!(tokens_by(ms(1000), &t, ms(9000)), 5);
        let no_first = Timing {
            ttft: None,
            ..t.clone()
        };
        assert_eq!(tokens_by(ms(0), &no_first, ms(9000)), 0);
    }

    #[test]
    fn record_keeps_each_served_request_for_the_slo() {
        let ms = Duration::from_millis;
        let ok = |ttft| Timing {
            status: 200,
            ttft: Some(ms(ttft)),
            token_gaps: vec![ms(10); 4],
            tokens: 5,
            total: ms(ttft + 40),
            ..Timing::default()
        };
        let outcome = |class, timing| Outcome {
            class,
            sent: ms(0),
            timing,
            served_by: None,
        };
        let outcomes = [
            outcome("chat", Ok(ok(100))),
            outcome("chat", Err("refused".into())),
            outcome("agent", Ok(ok(300))),
        ];
        let mut r = Recorder::new(1);
        record(&outcomes, &[], &mut r);
        let served: Vec<_> = r
            .served
            .iter()
            .map(|s| (s.class, s.ttft_s, s.output_tokens, s.window_output_tokens))
            .collect();
        assert_eq!(served, [("chat", 0.1, 5, 5), ("agent", 0.3, 5, 5)]);
        let slo = r.slo_figures(0.2, None);
        assert_eq!((slo.requests, slo.met_requests), (3, 1));
    }
}
