//! Writes the seed inputs in `fuzz/seeds/TARGET/`: text seeds as written here, binary ones
//! made by the repo's own encoders (`SnapshotDelta::encode_format`, `encode_batch`). The
//! output is committed; rerun after a wire format changes:
//!
//! ```text
//! cargo run --manifest-path fuzz/Cargo.toml --example gen_seeds
//! ```
//!
//! Other fixture directories are read as seeds as they are (`scripts/fuzz.sh`):
//! `testdata/kvevents/` and `aggregator/tests/fixtures/k8s/`.

use std::fs;
use std::net::SocketAddr;
use std::path::Path;

use kvoy_kvevents::{encode_batch, BlockHash, EventBatch, KvEvent, Medium, WireForm};
use kvoy_shared::snapshot::{EndpointStatus, SnapshotDelta, SnapshotFormat, SnapshotHistory};
use kvoy_shared::Role;

fn write(target: &str, name: &str, bytes: impl AsRef<[u8]>) {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("seeds")
        .join(target);
    fs::create_dir_all(&dir).expect("seed directory");
    fs::write(dir.join(name), bytes).expect("seed file");
}

fn status(slot: u16, address: &str) -> EndpointStatus {
    EndpointStatus {
        slot,
        address: address.parse::<SocketAddr>().expect("address"),
        models: vec!["meta-llama/Llama-3.1-8B-Instruct".into(), "sql-lora".into()],
        ready: true,
        stale: false,
        waiting: 3,
        running: 17,
        kv_cache_usage: 0.4375,
        block_size: 16,
        capacity_blocks: 27_536,
        cached_blocks: [9_000, 1_200, 0],
        cache_generation: 2,
        prefix_hit_rate: Some(0.62),
        prefill_tokens_per_s: Some(24_000.0),
        role: Role::Decode,
    }
}

fn snapshots() {
    let mut history = SnapshotHistory::new(0x1234_5678);
    let first = vec![
        status(0, "10.0.0.1:8000"),
        status(1, "[fd00::7]:8000"),
        EndpointStatus {
            role: Role::Prefill,
            ..status(2, "10.0.0.2:8000")
        },
    ];
    history.update(first.clone());
    for (format, name) in [
        (SnapshotFormat::V1, "full-v1"),
        (SnapshotFormat::V2, "full-v2"),
        (SnapshotFormat::V3, "full-v3"),
    ] {
        let mut out = Vec::new();
        history
            .delta_since(None, None)
            .encode_format(format, &mut out);
        write("snapshot", name, out);
    }
    let v = history.version();
    let mut second = first;
    second[0].waiting = 9;
    second[0].prefix_hit_rate = None;
    second.remove(1);
    second.push(EndpointStatus {
        stale: true,
        ready: false,
        prefill_tokens_per_s: None,
        models: vec![],
        ..status(5, "10.0.0.9:8001")
    });
    history.update(second);
    let mut out = Vec::new();
    history
        .delta_since(Some(history.epoch()), Some(v))
        .encode(&mut out);
    write("snapshot", "incremental-v3", out);
    let mut out = Vec::new();
    SnapshotDelta {
        epoch: 1,
        base: None,
        version: 0,
        upserts: vec![],
        removed: vec![],
    }
    .encode(&mut out);
    write("snapshot", "empty", out);
}

fn kv_events() {
    let batch = EventBatch {
        ts: 1_700_000_000.25,
        events: vec![
            KvEvent::BlockStored {
                block_hashes: vec![BlockHash::from_u64(u64::MAX), BlockHash::from_i64(-7)],
                parent_block_hash: Some(BlockHash::from_u64(42)),
                token_ids: (0..32).collect(),
                block_size: 16,
                lora_id: Some(3),
                medium: Medium::Cpu,
                lora_name: Some("sql-lora".into()),
                group_idx: Some(1),
            },
            KvEvent::BlockRemoved {
                block_hashes: vec![BlockHash::from_canonical([0xab; 32])],
                medium: Medium::Other("NVME".into()),
                group_idx: None,
            },
            KvEvent::AllBlocksCleared,
            KvEvent::Unknown {
                type_name: "BlockPinned".into(),
            },
        ],
        data_parallel_rank: Some(1),
    };
    write(
        "kv_events",
        "encoded-map",
        encode_batch(&batch, WireForm::Map),
    );
    write(
        "kv_events",
        "encoded-array",
        encode_batch(&batch, WireForm::Array),
    );
}

fn request_bodies() {
    for (name, body) in [
        (
            "chat",
            r#"{"model":"m","stream":true,"user":"u1","cache_salt":"s","messages":[{"role":"system","content":"You are kvoy."},{"role":"user","content":[{"type":"text","text":"hi \"there\" \u00e9"},{"type":"image_url","image_url":{"url":"data:x"}}]},{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{}"}}]}],"tools":[{"type":"function","function":{"name":"f"}}],"stream_options":{"include_usage":true}}"#,
        ),
        (
            "completions",
            r#"{"model":"m","prompt":["a",[1,2,3],"b"],"max_tokens":16,"temperature":0.5e-1}"#,
        ),
        (
            "responses",
            r#"{"model":"m","instructions":"be brief","previous_response_id":"resp_1","conversation":{"id":"conv_1"},"input":[{"type":"message","role":"user","content":[{"type":"input_text","text":"hi"}]},{"type":"function_call_output","call_id":"c1","output":"42"},"plain"]}"#,
        ),
        (
            "responses-string",
            r#"{"model":"m","input":"hello","conversation":"conv_2"}"#,
        ),
        (
            "escaped-keys",
            r#"{"mod\u0065l":"m","messages":[],"model":"n"}"#,
        ),
    ] {
        write("request_body", name, body);
    }
}

fn session() {
    // Byte 0 picks the chunking of the response body (see `kvoy_fuzz::chunking`); the whole
    // input is also read as a token, and as `name\0cookie-header`.
    write("session", "token", "MTAuMC4wLjc6ODAwMA==");
    write("session", "token-url-safe", " W2ZkMDA6OjddOjgwMDA ");
    write(
        "session",
        "cookie",
        "kvoy-session\u{0}a=b; kvoy-session=\"abc\" ; c=",
    );
    write(
        "session",
        "response-json",
        b"\x03\x10\x80\xf0{\"id\":\"resp_67ccd2bed1ec8190\",\"object\":\"response\",\"output\":[{\"id\":\"msg_1\"}]}",
    );
    write(
        "session",
        "response-sse",
        "\u{2}\u{40}\u{90}event: response.created\ndata: {\"type\":\"response.created\",\"response\":{\"id\" : \"resp_abc\",\"status\":\"in_progress\"}}\n\n",
    );
}

fn usage() {
    write(
        "usage",
        "chat",
        b"\x02\x60\xc0{\"choices\":[],\"usage\":{\"prompt_tokens\": 1234,\"completion_tokens\":5,\"prompt_tokens_details\":{\"cached_tokens\":0}}}",
    );
    write(
        "usage",
        "responses-sse",
        "\u{1}\u{80}event: response.completed\ndata: {\"response\":{\"usage\":{\"input_tokens\":77,\"output_tokens\":3}}}\n\n",
    );
    write(
        "usage",
        "stream-end",
        "\u{0}data: {\"usage\":{\"prompt_tokens\":9",
    );
}

fn prometheus() {
    write(
        "prometheus",
        "vllm",
        r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 4.0
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 2.0
vllm:num_requests_waiting{engine="1",model_name="meta-llama/Llama-3.1-8B-Instruct"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.3125
vllm:gpu_cache_usage_perc{engine="0",model_name="m"} 0.3125
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 123456.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 100000.0
vllm:prompt_tokens_total{engine="0",model_name="m"} 5000.0
vllm:generation_tokens_total{engine="0",model_name="m"} 700.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 1.25
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 7.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.125
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 7.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 21000.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 7.0
vllm:cache_config_info{block_size="16",num_gpu_blocks="27536",num_cpu_blocks="None",engine="0"} 1.0
vllm:lora_requests_info{max_lora="4",waiting_lora_adapters="chat-lora",running_lora_adapters="sql-lora,fr-lora"} 1.7409513e+09
"#,
    );
    write(
        "prometheus",
        "sglang",
        "# TYPE sglang:num_queue_reqs gauge\r\nsglang:num_queue_reqs{model_name=\"m\",dp_rank=\"0\"} 3\r\nsglang:num_running_reqs{model_name=\"m\"} 5 1712345678000\r\nsglang:token_usage{model_name=\"m\"} 0.5\r\nsglang:page_size 64\r\nsglang:max_total_num_tokens 640000\r\nsglang:prompt_tokens_total 10 1712345678.5\r\nsglang:cached_tokens_total 4\r\n",
    );
    write(
        "prometheus",
        "openmetrics",
        "# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name=\"a\\\\b \\\"q\\\" \\n\"} NaN\nvllm:num_requests_waiting{} +Inf\nvllm:prompt_tokens_total 7 # {trace_id=\"x\"} 1.0\n# EOF\nafter 1\n",
    );
}

fn k8s() {
    write(
        "k8s_json",
        "pool-and-pods",
        r#"{"apiVersion":"v1","kind":"List","spec":{"selector":{"matchLabels":{"app":"vllm","tier":"gpu"}},"targetPorts":[{"number":8000},{"number":8001},{"number":8000}]},"items":[{"metadata":{"name":"a","labels":{"app":"vllm","tier":"gpu"}},"status":{"phase":"Running","podIP":" 10.0.0.1 ","conditions":[{"type":"Ready","status":"True"}]}},{"metadata":{"name":"b","labels":{"app":"vllm","tier":"gpu"},"deletionTimestamp":"2026-01-01T00:00:00Z"},"status":{"phase":"Running","podIP":"fd00::2","conditions":[{"type":"Ready","status":"True"}]}},{"metadata":{"name":"c","labels":{"app":"vllm"}},"status":{"phase":"Pending"}}]}"#,
    );
}

/// Decision batches as proxies and the aggregator exchange them.
fn decisions() {
    use kvoy_shared::prefix::BlockKey;
    use kvoy_shared::relay::{DecisionBatch, RelayedDecision, RelayedRemoval, Removals};
    use kvoy_shared::Tier;
    let encode = |batch: DecisionBatch| {
        let mut out = Vec::new();
        batch.encode(&mut out);
        out
    };
    write("decisions", "empty", encode(DecisionBatch::default()));
    let v4: SocketAddr = "10.0.0.1:8000".parse().expect("address");
    let v6: SocketAddr = "[2001:db8::2]:8000"
        .parse()
        .unwrap_or_else(|_| unreachable!());
    write(
        "decisions",
        "two",
        encode(DecisionBatch {
            proxy: 7,
            cursor: 42,
            decisions: vec![
                RelayedDecision {
                    endpoint: v4,
                    keys: (1..=16).map(BlockKey).collect(),
                    routed_at_ms: None,
                },
                RelayedDecision {
                    endpoint: v6,
                    keys: vec![],
                    routed_at_ms: None,
                },
            ],
            removals: None,
        }),
    );
    write(
        "decisions",
        "with-removals",
        encode(DecisionBatch {
            proxy: 0,
            cursor: 3,
            decisions: vec![RelayedDecision {
                endpoint: v4,
                keys: vec![BlockKey(1)],
                routed_at_ms: None,
            }],
            removals: Some(Removals {
                cursor: 9,
                removals: vec![RelayedRemoval {
                    endpoint: v6,
                    keys: (4..=6).map(BlockKey).collect(),
                    offloaded_to: None,
                }],
            }),
        }),
    );
    write(
        "decisions",
        "with-times",
        encode(DecisionBatch {
            proxy: 5,
            cursor: 0,
            decisions: vec![RelayedDecision {
                endpoint: v4,
                keys: vec![BlockKey(1), BlockKey(2)],
                routed_at_ms: Some(1_796_416_089_869),
            }],
            removals: None,
        }),
    );
    write(
        "decisions",
        "with-offloads",
        encode(DecisionBatch {
            proxy: 0,
            cursor: 3,
            decisions: vec![],
            removals: Some(Removals {
                cursor: 9,
                removals: vec![
                    RelayedRemoval {
                        endpoint: v6,
                        keys: (4..=6).map(BlockKey).collect(),
                        offloaded_to: Some(Tier::Cpu),
                    },
                    RelayedRemoval {
                        endpoint: v4,
                        keys: vec![BlockKey(8)],
                        offloaded_to: None,
                    },
                    RelayedRemoval {
                        endpoint: v4,
                        keys: vec![BlockKey(9)],
                        offloaded_to: Some(Tier::Storage),
                    },
                ],
            }),
        }),
    );
}

fn main() {
    decisions();
    snapshots();
    kv_events();
    request_bodies();
    session();
    usage();
    prometheus();
    k8s();
    println!("seeds written to {}/seeds", env!("CARGO_MANIFEST_DIR"));
}
