//! The engine loop: one thread owns the [`Engine`] and runs its steps in real time (simulated
//! durations divided by the speedup); request handlers talk to it through an [`EngineHandle`].

use std::collections::HashMap;
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::engine::{
    Engine, EngineRequest, EngineStats, KvEvent, OutputKind, OutputVocab, Profile, ProfileError,
};
use crate::server::api::Usage;

/// What a request's handler hears from the engine.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Progress {
    /// The first token; `cached_tokens` prompt tokens came from the prefix cache.
    First {
        /// The token's text (shared with the vocabulary: no allocation per token).
        word: Arc<str>,
        cached_tokens: u32,
        /// When the engine produced it (what the TTFT metric counts, as in vLLM's engine).
        at: Instant,
        /// Waiting before the first scheduling, wall clock (simulated time / speedup).
        queue: Duration,
        /// First scheduling to this token, wall clock (simulated time / speedup).
        prefill: Duration,
    },
    Token {
        word: Arc<str>,
        at: Instant,
    },
    Done(Usage),
    /// The engine refused the request (e.g. a prompt larger than the model's context).
    Failed(String),
}

enum Command {
    Submit {
        prompt: Vec<u32>,
        max_tokens: u32,
        /// What the request generates.
        output: Arc<OutputVocab>,
        /// When the request reached the server: its simulated life starts there, so the real
        /// time spent reading, parsing and tokenizing it is not stretched by the speedup.
        arrived: Instant,
        progress: mpsc::UnboundedSender<Progress>,
        /// Its prompt's KV came from a prefill engine ([`Engine::submit_transferred`]).
        transferred: bool,
    },
    Reset(oneshot::Sender<bool>),
}

/// Receives the KV events of every step, in order.
pub type EventSink = Box<dyn FnMut(Vec<KvEvent>) + Send>;

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("invalid profile: {0}")]
    Profile(#[from] ProfileError),
    #[error("cannot start the engine thread: {0}")]
    Thread(#[from] std::io::Error),
}

/// A cheap, cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    commands: std_mpsc::Sender<Command>,
    stats: Arc<Mutex<EngineStats>>,
    max_model_len: u64,
}

impl EngineHandle {
    /// Starts the engine thread. `speedup` divides every simulated duration.
    pub fn start(
        profile: Profile,
        speedup: f64,
        mut sink: EventSink,
    ) -> Result<EngineHandle, StartError> {
        let (tx, rx) = std_mpsc::channel::<Command>();
        let mut engine = Engine::new(&profile)?;
        let max_model_len = engine.max_model_len();
        let stats = Arc::new(Mutex::new(engine.stats()));
        let shared = stats.clone();
        let speedup = if speedup.is_finite() && speedup > 0.0 {
            speedup
        } else {
            1.0
        };
        thread::Builder::new()
            .name(format!("kvoy-sim-engine-{}", profile.name))
            .spawn(move || run(&mut engine, &rx, speedup, &shared, &mut sink))?;
        Ok(EngineHandle {
            commands: tx,
            stats,
            max_model_len,
        })
    }

    /// The longest prompt + `max_tokens` the engine accepts.
    pub fn max_model_len(&self) -> u64 {
        self.max_model_len
    }

    /// Submits a request that generates the stand-in tokenizer's words; progress arrives on
    /// the returned channel. Dropping the receiver aborts the request at the next step.
    pub fn submit(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        arrived: Instant,
    ) -> mpsc::UnboundedReceiver<Progress> {
        self.submit_with_output(prompt, max_tokens, OutputVocab::stand_in(), arrived)
    }

    /// [`EngineHandle::submit`] for a request that generates words of `output` (a real
    /// tokenizer's).
    pub fn submit_with_output(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        output: Arc<OutputVocab>,
        arrived: Instant,
    ) -> mpsc::UnboundedReceiver<Progress> {
        self.send(prompt, max_tokens, output, arrived, false)
    }

    /// [`EngineHandle::submit_with_output`] for a request whose prompt another engine
    /// prefilled: its KV blocks are in this engine's cache when it is admitted.
    pub fn submit_transferred(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        output: Arc<OutputVocab>,
        arrived: Instant,
    ) -> mpsc::UnboundedReceiver<Progress> {
        self.send(prompt, max_tokens, output, arrived, true)
    }

    fn send(
        &self,
        prompt: Vec<u32>,
        max_tokens: u32,
        output: Arc<OutputVocab>,
        arrived: Instant,
        transferred: bool,
    ) -> mpsc::UnboundedReceiver<Progress> {
        let (tx, rx) = mpsc::unbounded_channel();
        // A stopped engine drops the sender: the handler sees a closed channel.
        let _ = self.commands.send(Command::Submit {
            prompt,
            max_tokens,
            output,
            arrived,
            progress: tx,
            transferred,
        });
        rx
    }

    /// Drops the prefix cache, as vLLM's `/reset_prefix_cache` (refused while requests run).
    pub async fn reset_cache(&self) -> bool {
        let (tx, rx) = oneshot::channel();
        if self.commands.send(Command::Reset(tx)).is_err() {
            return false;
        }
        rx.await.unwrap_or(false)
    }

    pub fn stats(&self) -> EngineStats {
        match self.stats.lock() {
            Ok(s) => *s,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }
}

/// `thread::sleep` wakes late by a fairly steady amount (timer slack, scheduling); at high
/// speedups that lateness becomes milliseconds of simulated time. This learns it (a moving
/// average) and wakes that much earlier.
#[derive(Debug, Default)]
struct Oversleep {
    average: Duration,
}

impl Oversleep {
    const MAX: Duration = Duration::from_millis(1);

    fn sleep_until(&mut self, target: Instant) {
        let wake_at = target.checked_sub(self.average).unwrap_or(target);
        let Some(wait) = wake_at.checked_duration_since(Instant::now()) else {
            return;
        };
        thread::sleep(wait);
        let late = Instant::now()
            .saturating_duration_since(wake_at)
            .min(Self::MAX);
        self.average = (self.average * 7 + late) / 8;
    }
}

/// How far behind schedule the engine may run before it stops trying to catch up.
const MAX_CATCH_UP: Duration = Duration::from_millis(250);

fn sim_now(epoch: Instant, speedup: f64) -> Duration {
    epoch.elapsed().mul_f64(speedup)
}

fn run(
    engine: &mut Engine,
    commands: &std_mpsc::Receiver<Command>,
    speedup: f64,
    stats: &Mutex<EngineStats>,
    sink: &mut EventSink,
) {
    let epoch = Instant::now();
    // When the next step is due in real time. Steps are laid end to end on this clock, so the
    // time spent delivering a step's outputs does not push every later step back (drift).
    let mut due = Instant::now();
    let mut next_id: u64 = 1;
    let mut oversleep = Oversleep::default();
    // Each running request's progress channel and the vocabulary its words come from.
    type Waiter = (mpsc::UnboundedSender<Progress>, Arc<OutputVocab>);
    let mut waiters: HashMap<u64, Waiter> = HashMap::new();
    loop {
        // Idle: block for work. Busy: take whatever arrived during the last step.
        let idle = !engine.has_work();
        let first = if !idle {
            None
        } else {
            match commands.recv() {
                Ok(c) => Some(c),
                Err(_) => return,
            }
        };
        let mut earliest: Option<Instant> = None;
        for command in first.into_iter().chain(commands.try_iter()) {
            match command {
                Command::Submit {
                    prompt,
                    max_tokens,
                    output,
                    arrived,
                    progress,
                    transferred,
                } => {
                    earliest = Some(earliest.map_or(arrived, |e: Instant| e.min(arrived)));
                    let id = next_id;
                    next_id += 1;
                    let now = sim_now(epoch, speedup);
                    let request = EngineRequest {
                        id,
                        prompt,
                        max_tokens,
                    };
                    let submitted = if transferred {
                        engine.submit_transferred(request, Some(output.clone()), now)
                    } else {
                        engine.submit_with_output(request, output.clone(), now)
                    };
                    match submitted {
                        Ok(()) => {
                            waiters.insert(id, (progress, output));
                        }
                        Err(e) => {
                            let _ = progress.send(Progress::Failed(e.to_string()));
                        }
                    }
                }
                Command::Reset(reply) => {
                    let ok = match engine.reset_cache() {
                        Ok(events) => {
                            sink(events);
                            true
                        }
                        Err(_) => false,
                    };
                    let _ = reply.send(ok);
                }
            }
        }
        if !engine.has_work() {
            publish_stats(engine, stats);
            continue;
        }
        let now = Instant::now();
        // After idling, or when too far behind to catch up, the schedule restarts from now;
        // otherwise a late step is made up by shorter sleeps.
        if idle {
            // Work resumes when the first new request arrived, not when it got here.
            due = earliest.map_or(now, |e| e.max(due).min(now));
        }
        if now.saturating_duration_since(due) > MAX_CATCH_UP {
            due = now;
        }
        let step = engine.step((due - epoch).mul_f64(speedup));
        // The step's outputs exist once its simulated time has passed.
        due += step.duration.div_f64(speedup);
        oversleep.sleep_until(due);
        let produced = Instant::now();
        // Counters first, so that a client holding its answer finds them in `/metrics`.
        publish_stats(engine, stats);
        let mut gone = Vec::new();
        for output in step.outputs {
            let id = output.id;
            let Some((waiter, vocab)) = waiters.get(&id) else {
                // Nobody to tell (cannot happen: every request has a waiter): stop it.
                if matches!(
                    output.kind,
                    OutputKind::FirstToken { .. } | OutputKind::Token { .. }
                ) {
                    gone.push(id);
                }
                continue;
            };
            let (progress, last) = match output.kind {
                OutputKind::FirstToken {
                    cached_tokens,
                    queue_time,
                    prefill_time,
                    ..
                } => (
                    Progress::First {
                        word: vocab.pick(id, 0).text.clone(),
                        cached_tokens,
                        at: produced,
                        queue: queue_time.div_f64(speedup),
                        prefill: prefill_time.div_f64(speedup),
                    },
                    false,
                ),
                OutputKind::Token { index, .. } => (
                    Progress::Token {
                        word: vocab.pick(id, index).text.clone(),
                        at: produced,
                    },
                    false,
                ),
                OutputKind::Finished { usage, .. } => (
                    Progress::Done(Usage {
                        prompt_tokens: usage.prompt_tokens,
                        completion_tokens: usage.completion_tokens,
                        cached_tokens: usage.cached_tokens,
                    }),
                    true,
                ),
                OutputKind::Preempted => continue,
            };
            let delivered = waiter.send(progress).is_ok();
            if last {
                waiters.remove(&id);
            } else if !delivered {
                gone.push(id);
            }
        }
        // Clients that went away stop consuming engine time.
        for id in gone {
            engine.abort(id);
            waiters.remove(&id);
        }
        if !step.events.is_empty() {
            sink(step.events);
        }
        publish_stats(engine, stats);
    }
}

fn publish_stats(engine: &Engine, stats: &Mutex<EngineStats>) {
    let fresh = engine.stats();
    match stats.lock() {
        Ok(mut s) => *s = fresh,
        Err(poisoned) => *poisoned.into_inner() = fresh,
    }
}
