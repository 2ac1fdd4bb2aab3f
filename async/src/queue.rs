//! Where jobs come from and results go: the [`Queue`] trait, and Redis Streams with a consumer
//! group as its implementation ([`RedisQueue`]).
//!
//! What the trait promises, and the Redis implementation keeps:
//! - a job read is *pending*, not gone, until [`Queue::finish`] writes its result (or its
//!   dead-letter entry) and acknowledges it in one atomic step (a Lua script), so a worker
//!   killed at any point loses nothing: its pending jobs are reclaimed ([`Queue::reclaim`],
//!   `XAUTOCLAIM`) once idle for `claim_idle`, and a live worker keeps its own from going idle
//!   ([`Queue::keep_alive`], `XCLAIM … JUSTID`);
//! - one result per job id: the same script sets a per-id key with `SET NX` and writes the
//!   result only if it was first, so a duplicate or a reclaimed job that had already finished
//!   produces nothing new.
//!
//! llm-d-async's sorted-set queue (score = deadline) is taken with `ZPOPMIN` there, with no
//! acknowledgement: a worker killed mid-request loses the job. Here a lane may name such a
//! set, and [`Queue::bridge`] moves its members into the lane's stream in one script
//! (`ZPOPMIN` + `XADD`), from where they are as safe as any other job.
//!
//! Which transport is next: Kafka (consumer groups with committed offsets and redelivery map
//! onto this trait directly: read = poll, finish = produce the result in a transaction with the
//! offset commit); Google Pub/Sub's ack deadlines map onto `keep_alive`, so it follows.

use std::future::Future;
use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::streams::{StreamAutoClaimReply, StreamId, StreamPendingCountReply, StreamReadReply};
use redis::{AsyncCommands, Script, Value};
use thiserror::Error;

use crate::config::Config;
use crate::job::Format;

/// A queue operation that failed (the job stays pending: the caller retries).
#[derive(Debug, Error)]
pub enum QueueError {
    /// Redis refused or is unreachable.
    #[error("redis: {0}")]
    Redis(#[from] redis::RedisError),
    /// Redis answered something this code does not expect.
    #[error("unexpected answer from redis: {0}")]
    Protocol(String),
}

/// A job read from a lane, pending until finished.
#[derive(Clone, Debug, PartialEq)]
pub struct Delivery {
    /// Its lane's index.
    pub lane: usize,
    /// Its entry id in the lane's stream.
    pub entry: String,
    /// The entry's `job` field (empty when it had none).
    pub job: Vec<u8>,
    /// How many times it has been delivered (1 the first time).
    pub deliveries: u32,
    /// The llm-d result list of a job bridged from a sorted set.
    pub result_list: Option<String>,
}

/// What a finished job leaves behind.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Its result (an answer, or an error that is the answer).
    Result(JobResult),
    /// A dead-letter entry.
    Dead(DeadLetter),
}

/// A job's result, in llm-d-async's `ResultMessage` shape (`status_code` 0: no HTTP answer).
#[derive(Clone, Debug, PartialEq)]
pub struct JobResult {
    /// The job's id.
    pub id: String,
    /// Its tenant.
    pub tenant: String,
    /// The HTTP status of the answer, 0 when there was none.
    pub status_code: u16,
    /// The answer's body, or an OpenAI-shaped error.
    pub payload: String,
    /// Why there is no HTTP answer (llm-d's codes, e.g. `INFERENCE_ERROR`).
    pub error_code: Option<String>,
    /// The error in words.
    pub error_message: Option<String>,
    /// Attempts it took.
    pub attempts: u32,
    /// When the attempt that gave the answer was sent (Unix ms; 0 for a duplicate's).
    pub started_ms: u64,
    /// The shape the job came in.
    pub format: Format,
}

impl JobResult {
    /// llm-d-async's `ResultMessage` JSON (`api/api.go`).
    pub fn llm_d_json(&self) -> String {
        let mut v = serde_json::json!({"id": self.id, "payload": self.payload});
        if self.status_code > 0 {
            v["status_code"] = self.status_code.into();
        }
        if let Some(code) = &self.error_code {
            v["error_code"] = code.as_str().into();
        }
        if let Some(message) = &self.error_message {
            v["error_message"] = message.as_str().into();
        }
        v.to_string()
    }
}

/// A dead-letter entry.
#[derive(Clone, Debug, PartialEq)]
pub struct DeadLetter {
    /// The job's id, when it had one.
    pub id: Option<String>,
    /// Its tenant, when known.
    pub tenant: Option<String>,
    /// The reason's code ([`crate::job::DeadReason::code`]).
    pub reason: &'static str,
    /// The reason in words.
    pub detail: String,
    /// The entry as it came (truncated to 64 KiB).
    pub job: Vec<u8>,
}

/// Whether a finish wrote something.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The result or dead-letter entry was written and the job acknowledged.
    Written,
    /// The job id already had one: acknowledged, nothing written.
    Duplicate,
}

/// A source of jobs with acknowledgement (see the module documentation).
pub trait Queue: Send + Sync {
    /// Creates what reading needs (consumer groups); idempotent.
    fn prepare(&self) -> impl Future<Output = Result<(), QueueError>> + Send;
    /// Up to `count` new jobs of `lane`, without waiting.
    fn read(
        &self,
        lane: usize,
        count: usize,
    ) -> impl Future<Output = Result<Vec<Delivery>, QueueError>> + Send;
    /// Up to `count` jobs of `lane` pending longer than `min_idle` (a dead worker's), now this
    /// consumer's.
    fn reclaim(
        &self,
        lane: usize,
        min_idle: Duration,
        count: usize,
    ) -> impl Future<Output = Result<Vec<Delivery>, QueueError>> + Send;
    /// Marks this consumer's pending `entries` of `lane` as alive.
    fn keep_alive(
        &self,
        lane: usize,
        entries: &[String],
    ) -> impl Future<Output = Result<(), QueueError>> + Send;
    /// Writes `outcome` and acknowledges `delivery`, atomically, once per job id.
    fn finish(
        &self,
        delivery: &Delivery,
        lane_name: &str,
        outcome: &Outcome,
    ) -> impl Future<Output = Result<Finish, QueueError>> + Send;
    /// Whether job `id` already has a result or dead-letter entry.
    fn is_done(&self, id: &str) -> impl Future<Output = Result<bool, QueueError>> + Send;
    /// Jobs in `lane` not yet read by the group, when the server says.
    fn backlog(&self, lane: usize) -> impl Future<Output = Result<Option<u64>, QueueError>> + Send;
    /// Moves up to `max` jobs of `lane`'s sorted set (if it has one) into its stream.
    fn bridge(
        &self,
        lane: usize,
        max: usize,
    ) -> impl Future<Output = Result<usize, QueueError>> + Send;
}

/// Result, dead-letter entry and acknowledgement in one step, once per id:
/// KEYS = [done key, lane stream, target]; ARGV = [group, entry, ttl s, mode, list item,
/// stream fields...]. Mode `xadd` adds the fields to the target stream, `lpush` pushes the
/// item onto the target list.
const FINISH: &str = r"
local first = redis.call('SET', KEYS[1], ARGV[2], 'NX', 'EX', ARGV[3])
if first then
  if ARGV[4] == 'lpush' then
    redis.call('LPUSH', KEYS[3], ARGV[5])
  else
    redis.call('XADD', KEYS[3], '*', unpack(ARGV, 6))
  end
end
redis.call('XACK', KEYS[2], ARGV[1], ARGV[2])
redis.call('XDEL', KEYS[2], ARGV[2])
if first then return 1 else return 0 end
";

/// llm-d's sorted set into the lane's stream: KEYS = [set, stream]; ARGV = [max, result list].
const BRIDGE: &str = r"
local items = redis.call('ZPOPMIN', KEYS[1], ARGV[1])
local n = 0
for i = 1, #items, 2 do
  redis.call('XADD', KEYS[2], '*', 'job', items[i], 'result_list', ARGV[2])
  n = n + 1
end
return n
";

/// Dead-letter entries keep at most this much of the job.
const DEAD_JOB_BYTES: usize = 64 << 10;

/// Lane streams, as the queue sees them.
#[derive(Clone, Debug)]
struct LaneKeys {
    stream: String,
    sorted_set: Option<String>,
    sorted_set_results: String,
}

/// [`Queue`] over Redis Streams.
#[derive(Clone)]
pub struct RedisQueue {
    conn: ConnectionManager,
    group: String,
    consumer: String,
    lanes: Vec<LaneKeys>,
    results: String,
    dead_letter: String,
    done_prefix: String,
    done_ttl_s: u64,
    finish: Script,
    bridge: Script,
}

impl RedisQueue {
    /// Connects to `config.redis_url` as consumer `consumer`. The connection reconnects by
    /// itself after Redis restarts; commands fail while it is away.
    pub async fn connect(config: &Config, consumer: String) -> Result<Self, QueueError> {
        let client = redis::Client::open(config.redis_url.as_str())?;
        let settings = redis::aio::ConnectionManagerConfig::new()
            .set_response_timeout(Some(Duration::from_secs(5)))
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_number_of_retries(2);
        let conn = ConnectionManager::new_with_config(client, settings).await?;
        Ok(RedisQueue {
            conn,
            group: config.group.clone(),
            consumer,
            lanes: config
                .lanes
                .iter()
                .map(|l| LaneKeys {
                    stream: l.stream.clone(),
                    sorted_set: l.sorted_set.clone(),
                    sorted_set_results: l.sorted_set_results.clone().unwrap_or_else(|| {
                        format!("{}:results", l.sorted_set.as_deref().unwrap_or(""))
                    }),
                })
                .collect(),
            results: config.results_stream.clone(),
            dead_letter: config.dead_letter_stream.clone(),
            done_prefix: config.done_prefix.clone(),
            done_ttl_s: config.done_ttl_s,
            finish: Script::new(FINISH),
            bridge: Script::new(BRIDGE),
        })
    }

    fn lane(&self, lane: usize) -> Result<&LaneKeys, QueueError> {
        self.lanes
            .get(lane)
            .ok_or_else(|| QueueError::Protocol(format!("no lane {lane}")))
    }

    fn delivery(lane: usize, entry: StreamId, deliveries: u32) -> Delivery {
        let field = |name: &str| match entry.map.get(name) {
            Some(Value::BulkString(bytes)) => Some(bytes.clone()),
            Some(Value::SimpleString(s)) => Some(s.clone().into_bytes()),
            _ => None,
        };
        Delivery {
            lane,
            job: field("job").unwrap_or_default(),
            result_list: field("result_list").and_then(|b| String::from_utf8(b).ok()),
            entry: entry.id,
            deliveries,
        }
    }

    /// The per-job key that makes its result unique (by entry for a job without an id).
    fn done_key(&self, delivery: &Delivery, id: Option<&str>) -> String {
        match id {
            Some(id) => format!("{}{id}", self.done_prefix),
            None => format!(
                "{}entry:{}:{}",
                self.done_prefix, self.lanes[delivery.lane].stream, delivery.entry
            ),
        }
    }
}

impl Queue for RedisQueue {
    async fn prepare(&self) -> Result<(), QueueError> {
        let mut conn = self.conn.clone();
        for lane in &self.lanes {
            let created: redis::RedisResult<()> = conn
                .xgroup_create_mkstream(&lane.stream, &self.group, "0")
                .await;
            match created {
                Ok(()) => {}
                Err(e) if e.code() == Some("BUSYGROUP") => {}
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }

    async fn read(&self, lane: usize, count: usize) -> Result<Vec<Delivery>, QueueError> {
        let keys = self.lane(lane)?;
        let mut conn = self.conn.clone();
        let options = redis::streams::StreamReadOptions::default()
            .group(&self.group, &self.consumer)
            .count(count);
        let reply: redis::RedisResult<Option<StreamReadReply>> = conn
            .xread_options(&[keys.stream.as_str()], &[">"], &options)
            .await;
        let reply = match reply {
            Err(e) if e.code() == Some("NOGROUP") => {
                // Redis lost the group (restarted without persistence): make it again.
                self.prepare().await?;
                return Ok(Vec::new());
            }
            other => other?,
        };
        Ok(reply
            .into_iter()
            .flat_map(|r| r.keys)
            .flat_map(|k| k.ids)
            .map(|id| Self::delivery(lane, id, 1))
            .collect())
    }

    async fn reclaim(
        &self,
        lane: usize,
        min_idle: Duration,
        count: usize,
    ) -> Result<Vec<Delivery>, QueueError> {
        let keys = self.lane(lane)?;
        let mut conn = self.conn.clone();
        let idle_ms = min_idle.as_millis() as u64;
        let mut cursor = "0-0".to_owned();
        let mut out = Vec::new();
        // Bounded: at most `count` entries, or a few rounds of the cursor.
        for _ in 0..16 {
            let reply: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                .arg(&keys.stream)
                .arg(&self.group)
                .arg(&self.consumer)
                .arg(idle_ms)
                .arg(&cursor)
                .arg("COUNT")
                .arg(count.saturating_sub(out.len()).max(1))
                .query_async(&mut conn)
                .await?;
            for entry in reply.claimed {
                // How often it was delivered, for the poison-job bound.
                let pending: StreamPendingCountReply = conn
                    .xpending_count(&keys.stream, &self.group, &entry.id, &entry.id, 1)
                    .await?;
                let deliveries = pending
                    .ids
                    .first()
                    .map_or(1, |p| u32::try_from(p.times_delivered).unwrap_or(u32::MAX));
                out.push(Self::delivery(lane, entry, deliveries));
            }
            cursor = reply.next_stream_id;
            if cursor == "0-0" || out.len() >= count {
                break;
            }
        }
        Ok(out)
    }

    async fn keep_alive(&self, lane: usize, entries: &[String]) -> Result<(), QueueError> {
        if entries.is_empty() {
            return Ok(());
        }
        let keys = self.lane(lane)?;
        let mut conn = self.conn.clone();
        for chunk in entries.chunks(500) {
            let _: Value = redis::cmd("XCLAIM")
                .arg(&keys.stream)
                .arg(&self.group)
                .arg(&self.consumer)
                .arg(0)
                .arg(chunk)
                .arg("JUSTID")
                .query_async(&mut conn)
                .await?;
        }
        Ok(())
    }

    async fn finish(
        &self,
        delivery: &Delivery,
        lane_name: &str,
        outcome: &Outcome,
    ) -> Result<Finish, QueueError> {
        let keys = self.lane(delivery.lane)?;
        let mut conn = self.conn.clone();
        let mut invocation = self.finish.prepare_invoke();
        match outcome {
            Outcome::Result(r) => {
                invocation.key(self.done_key(delivery, Some(&r.id)));
                invocation.key(&keys.stream);
                let list = delivery
                    .result_list
                    .as_deref()
                    .filter(|_| r.format == Format::LlmD);
                match list {
                    Some(list) => {
                        invocation.key(list);
                        invocation
                            .arg(&self.group)
                            .arg(&delivery.entry)
                            .arg(self.done_ttl_s)
                            .arg("lpush")
                            .arg(r.llm_d_json());
                    }
                    None => {
                        invocation.key(&self.results);
                        invocation
                            .arg(&self.group)
                            .arg(&delivery.entry)
                            .arg(self.done_ttl_s)
                            .arg("xadd")
                            .arg("")
                            .arg("id")
                            .arg(&r.id)
                            .arg("tenant")
                            .arg(&r.tenant)
                            .arg("lane")
                            .arg(lane_name)
                            .arg("status_code")
                            .arg(r.status_code)
                            .arg("payload")
                            .arg(&r.payload)
                            .arg("error_code")
                            .arg(r.error_code.as_deref().unwrap_or(""))
                            .arg("error_message")
                            .arg(r.error_message.as_deref().unwrap_or(""))
                            .arg("attempts")
                            .arg(r.attempts)
                            .arg("started_ms")
                            .arg(r.started_ms);
                    }
                }
            }
            Outcome::Dead(d) => {
                invocation.key(self.done_key(delivery, d.id.as_deref()));
                invocation.key(&keys.stream);
                invocation.key(&self.dead_letter);
                let job = &d.job[..d.job.len().min(DEAD_JOB_BYTES)];
                invocation
                    .arg(&self.group)
                    .arg(&delivery.entry)
                    .arg(self.done_ttl_s)
                    .arg("xadd")
                    .arg("")
                    .arg("id")
                    .arg(d.id.as_deref().unwrap_or(""))
                    .arg("tenant")
                    .arg(d.tenant.as_deref().unwrap_or(""))
                    .arg("lane")
                    .arg(lane_name)
                    .arg("reason")
                    .arg(d.reason)
                    .arg("detail")
                    .arg(&d.detail)
                    .arg("entry")
                    .arg(&delivery.entry)
                    .arg("deliveries")
                    .arg(delivery.deliveries)
                    .arg("job")
                    .arg(job);
            }
        }
        let written: i64 = invocation.invoke_async(&mut conn).await?;
        Ok(if written == 1 {
            Finish::Written
        } else {
            Finish::Duplicate
        })
    }

    async fn is_done(&self, id: &str) -> Result<bool, QueueError> {
        let mut conn = self.conn.clone();
        Ok(conn.exists(format!("{}{id}", self.done_prefix)).await?)
    }

    async fn backlog(&self, lane: usize) -> Result<Option<u64>, QueueError> {
        let keys = self.lane(lane)?;
        let mut conn = self.conn.clone();
        let reply: Value = redis::cmd("XINFO")
            .arg("GROUPS")
            .arg(&keys.stream)
            .query_async(&mut conn)
            .await?;
        Ok(group_lag(&reply, &self.group))
    }

    async fn bridge(&self, lane: usize, max: usize) -> Result<usize, QueueError> {
        let keys = self.lane(lane)?;
        let Some(set) = &keys.sorted_set else {
            return Ok(0);
        };
        if max == 0 {
            return Ok(0);
        }
        let mut conn = self.conn.clone();
        let moved: i64 = self
            .bridge
            .key(set)
            .key(&keys.stream)
            .arg(max)
            .arg(&keys.sorted_set_results)
            .invoke_async(&mut conn)
            .await?;
        Ok(usize::try_from(moved).unwrap_or(0))
    }
}

/// The `lag` of `group` in an `XINFO GROUPS` answer (RESP2 flat arrays or RESP3 maps).
fn group_lag(reply: &Value, group: &str) -> Option<u64> {
    let Value::Array(groups) = reply else {
        return None;
    };
    for g in groups {
        let pairs: Vec<(&Value, &Value)> = match g {
            Value::Array(items) => items
                .chunks(2)
                .filter_map(|c| Some((c.first()?, c.get(1)?)))
                .collect(),
            Value::Map(items) => items.iter().map(|(k, v)| (k, v)).collect(),
            _ => continue,
        };
        let text = |v: &Value| match v {
            Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
            Value::SimpleString(s) => Some(s.clone()),
            _ => None,
        };
        let field = |name: &str| {
            pairs
                .iter()
                .find(|(k, _)| text(k).as_deref() == Some(name))
                .map(|(_, v)| *v)
        };
        if field("name").and_then(text).as_deref() != Some(group) {
            continue;
        }
        return match field("lag") {
            Some(Value::Int(n)) => u64::try_from(*n).ok(),
            _ => None,
        };
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lag_is_read_from_either_reply_shape() {
        let bulk = |s: &str| Value::BulkString(s.as_bytes().to_vec());
        let flat = Value::Array(vec![Value::Array(vec![
            bulk("name"),
            bulk("g"),
            bulk("lag"),
            Value::Int(7),
        ])]);
        assert_eq!(group_lag(&flat, "g"), Some(7));
        assert_eq!(group_lag(&flat, "other"), None);
        let map = Value::Array(vec![Value::Map(vec![
            (bulk("name"), bulk("g")),
            (bulk("lag"), Value::Nil),
        ])]);
        assert_eq!(group_lag(&map, "g"), None);
    }

    #[test]
    fn llm_d_results_have_its_shape() {
        let r = JobResult {
            id: "a".into(),
            tenant: "t".into(),
            status_code: 0,
            payload: "{}".into(),
            error_code: Some("INFERENCE_ERROR".into()),
            error_message: Some("down".into()),
            attempts: 1,
            started_ms: 0,
            format: Format::LlmD,
        };
        let v: serde_json::Value = serde_json::from_str(&r.llm_d_json()).unwrap();
        assert_eq!(
            v,
            serde_json::json!({"id":"a","payload":"{}","error_code":"INFERENCE_ERROR","error_message":"down"})
        );
    }
}
