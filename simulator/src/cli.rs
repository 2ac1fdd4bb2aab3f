//! Command-line options of `kvoy-sim`: one flag per knob, parsed without a framework.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};

use crate::engine::Profile;
use crate::server::HttpOptions;
use crate::tokenizer::Tokenizer;

pub const USAGE: &str = "\
kvoy-sim: a vLLM-compatible model-server simulator

usage: kvoy-sim [options]

  --listen ADDR                 HTTP address (default 127.0.0.1:8000)
  --count N                     start N simulators on consecutive ports from --listen (and
                                consecutive KV-event ports) in this process (default 1)
  --model NAME                  served model name; repeat for several (default kvoy-sim)
  --profile NAME                llama-8b-h100 (default) or qwen-32b-h100-tp2
  --speedup F                   divide every simulated duration by F (default 1)
  --seed N                      seed for fault injection (default 1)
  --default-max-tokens N        when a request sets none (default 16)
  --max-body-bytes N            larger bodies get 413 (default 33554432)
  --error-rate F                answer this fraction of completions 500 (default 0)
  --added-latency-ms N          simulated latency before a completion starts (default 0)
  --max-stored-responses N      /v1/responses kept for previous_response_id, least recently
                                used dropped first (default 10000)
  --max-stored-response-bytes N  ... and at most N bytes of their context (default 268435456)
  --kv-events-endpoint EP       ZMQ PUB endpoint for KV events, e.g. tcp://127.0.0.1:5557
  --kv-events-replay-endpoint EP  ZMQ ROUTER endpoint answering replay requests
  --kv-events-topic T           topic frame of every message (default empty, as vLLM's;
                                llm-d's convention is kv@<pod ip:port>@<model>)
  --kv-events-format F          map (default, vLLM >= mid-2026) or array (older vLLM)
  --tokenizer PATH              a Hugging Face tokenizer.json: prompts are tokenized as vLLM
                                does with it (chat messages through the model's chat template)
                                and answers are words of its vocabulary (default: a stand-in
                                of about 4 bytes per token)
  --chat-template PATH          a jinja chat template file, instead of the model's
                                (chat_template.jinja or tokenizer_config.json beside the
                                tokenizer); needs --tokenizer
 profile overrides:
  --block-size N --num-gpu-blocks N --max-num-seqs N --max-num-batched-tokens N
  --max-model-len N --prefill-tokens-per-s F --prefill-attention-s-per-token-pair F
  --step-base-s F --step-per-seq-s F --step-per-context-token-s F
  --cpu-offload-blocks N        blocks of a CPU offload tier, as vLLM's --kv-offloading-size
                                (default 0: none)
  --offload-load-tokens-per-s F  CPU-to-GPU load rate of that tier (default 200000)
  -h, --help
";

/// KV-event publishing options.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct KvEventOptions {
    pub endpoint: Option<String>,
    pub replay_endpoint: Option<String>,
    pub topic: Option<String>,
    pub array_form: bool,
}

#[derive(Debug, Clone)]
pub struct Options {
    pub listen: SocketAddr,
    pub count: u16,
    pub profile: Profile,
    pub http: HttpOptions,
    pub kv_events: KvEventOptions,
}

fn num<T: std::str::FromStr>(flag: &str, v: &str) -> Result<T> {
    v.parse()
        .map_err(|_| anyhow::anyhow!("{flag}: {v:?} is not a valid number"))
}

/// Parses the arguments after the program name. `Ok(None)` means help was asked for.
pub fn parse(args: &[String]) -> Result<Option<Options>> {
    let mut listen: SocketAddr = "127.0.0.1:8000".parse()?;
    let mut count = 1u16;
    let mut models = Vec::new();
    let mut profile_name = "llama-8b-h100".to_owned();
    let mut overrides: Vec<(String, String)> = Vec::new();
    let mut http = HttpOptions {
        models: Vec::new(),
        ..HttpOptions::default()
    };
    let mut kv = KvEventOptions::default();
    let mut tokenizer: Option<PathBuf> = None;
    let mut chat_template: Option<PathBuf> = None;
    let mut it = args.iter();
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            return Ok(None);
        }
        let value = it
            .next()
            .with_context(|| format!("{flag} needs a value\n\n{USAGE}"))?;
        match flag.as_str() {
            "--listen" => {
                listen = value
                    .parse()
                    .with_context(|| format!("--listen: {value:?} is not an ip:port address"))?
            }
            "--count" => count = num(flag, value)?,
            "--model" => models.push(value.clone()),
            "--profile" => profile_name = value.clone(),
            "--speedup" => http.speedup = num(flag, value)?,
            "--seed" => http.seed = num(flag, value)?,
            "--default-max-tokens" => http.default_max_tokens = num(flag, value)?,
            "--max-body-bytes" => http.max_body_bytes = num(flag, value)?,
            "--error-rate" => http.error_rate = num(flag, value)?,
            "--added-latency-ms" => http.added_latency = Duration::from_millis(num(flag, value)?),
            "--max-stored-responses" => http.max_stored_responses = num(flag, value)?,
            "--max-stored-response-bytes" => http.max_stored_response_bytes = num(flag, value)?,
            "--kv-events-endpoint" => kv.endpoint = Some(value.clone()),
            "--kv-events-replay-endpoint" => kv.replay_endpoint = Some(value.clone()),
            "--kv-events-topic" => kv.topic = Some(value.clone()),
            "--tokenizer" => tokenizer = Some(PathBuf::from(value)),
            "--chat-template" => chat_template = Some(PathBuf::from(value)),
            "--kv-events-format" => {
                kv.array_form = match value.as_str() {
                    "map" => false,
                    "array" => true,
                    other => bail!("--kv-events-format: {other:?} is not `map` or `array`"),
                }
            }
            f if f.starts_with("--") => overrides.push((f.to_owned(), value.clone())),
            other => bail!("unexpected argument {other:?}\n\n{USAGE}"),
        }
    }
    let mut profile = Profile::by_name(&profile_name).with_context(|| {
        format!(
            "--profile: unknown profile {profile_name:?}; known: {}",
            Profile::NAMES.join(", ")
        )
    })?;
    for (flag, v) in &overrides {
        match flag.as_str() {
            "--block-size" => profile.block_size = num(flag, v)?,
            "--num-gpu-blocks" => profile.num_gpu_blocks = num(flag, v)?,
            "--max-num-seqs" => profile.max_num_seqs = num(flag, v)?,
            "--max-num-batched-tokens" => profile.max_num_batched_tokens = num(flag, v)?,
            "--max-model-len" => profile.max_model_len = num(flag, v)?,
            "--prefill-tokens-per-s" => profile.prefill_tokens_per_s = num(flag, v)?,
            "--prefill-attention-s-per-token-pair" => {
                profile.prefill_attention_s_per_token_pair = num(flag, v)?
            }
            "--step-base-s" => profile.step_base_s = num(flag, v)?,
            "--step-per-seq-s" => profile.step_per_seq_s = num(flag, v)?,
            "--step-per-context-token-s" => profile.step_per_context_token_s = num(flag, v)?,
            "--cpu-offload-blocks" => profile.cpu_offload_blocks = num(flag, v)?,
            "--offload-load-tokens-per-s" => profile.offload_load_tokens_per_s = num(flag, v)?,
            other => bail!("unknown option {other}\n\n{USAGE}"),
        }
    }
    profile
        .validate()
        .map_err(|e| anyhow::anyhow!("invalid profile: {e}"))?;
    if !(http.speedup.is_finite() && http.speedup > 0.0) {
        bail!("--speedup must be a positive number");
    }
    if !(0.0..=1.0).contains(&http.error_rate) {
        bail!("--error-rate must be within 0..=1");
    }
    if count == 0 {
        bail!("--count must be at least 1");
    }
    if models.is_empty() {
        models.push("kvoy-sim".to_owned());
    }
    http.models = models;
    http.tokenizer = match (&tokenizer, &chat_template) {
        (Some(path), template) => Tokenizer::load(path, template.as_deref())
            .map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?,
        (None, Some(_)) => bail!("--chat-template needs --tokenizer"),
        (None, None) => Tokenizer::StandIn,
    };
    Ok(Some(Options {
        listen,
        count,
        profile,
        http,
        kv_events: kv,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(str::to_owned).collect()
    }

    #[test]
    fn overrides_apply_and_bad_values_are_named() {
        let o = parse(&args(
            "--profile qwen-32b-h100-tp2 --num-gpu-blocks 100 --speedup 20 --model a --model b",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(o.profile.num_gpu_blocks, 100);
        assert_eq!(o.http.speedup, 20.0);
        assert_eq!(o.http.models, vec!["a", "b"]);
        assert_eq!(o.http.max_stored_responses, 10_000);
        assert_eq!(o.profile.cpu_offload_blocks, 0);
        let o = parse(&args(
            "--cpu-offload-blocks 5000 --offload-load-tokens-per-s 1e5",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                o.profile.cpu_offload_blocks,
                o.profile.offload_load_tokens_per_s
            ),
            (5000, 1e5)
        );
        let o = parse(&args(
            "--max-stored-responses 3 --max-stored-response-bytes 99",
        ))
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                o.http.max_stored_responses,
                o.http.max_stored_response_bytes
            ),
            (3, 99)
        );
        for (bad, named) in [
            ("--speedup 0", "--speedup"),
            ("--profile nope", "--profile"),
            ("--num-gpu-blocks x", "--num-gpu-blocks"),
            ("--listen nowhere", "--listen"),
            ("--frobnicate 3", "--frobnicate"),
            ("--kv-events-format json", "--kv-events-format"),
            ("--count", "--count"),
            ("--cpu-offload-blocks -1", "--cpu-offload-blocks"),
            ("--offload-load-tokens-per-s 0", "offload_load_tokens_per_s"),
        ] {
            let e = parse(&args(bad)).unwrap_err().to_string();
            assert!(e.contains(named), "{bad}: {e}");
        }
        assert!(parse(&args("--help")).unwrap().is_none());
    }

    #[test]
    fn tokenizer_flags() {
        let o = parse(&args("")).unwrap().unwrap();
        assert!(o.http.tokenizer.hf().is_none(), "the stand-in by default");
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../testdata/tokenizer");
        let o = parse(&args(&format!("--tokenizer {dir}/tokenizer.json")))
            .unwrap()
            .unwrap();
        let hf = o.http.tokenizer.hf().unwrap();
        assert!(hf.chat_template().is_some());
        for (bad, named) in [
            ("--tokenizer /nonexistent/tok.json", "/nonexistent/tok.json"),
            (
                &format!("--tokenizer {dir}/tokenizer.json --chat-template /nonexistent/t.jinja"),
                "/nonexistent/t.jinja",
            ),
            (&format!("--tokenizer {dir}/README.md"), "README.md"),
            (
                &format!("--chat-template {dir}/x.jinja"),
                "--chat-template needs --tokenizer",
            ),
        ] {
            let e = parse(&args(bad)).unwrap_err().to_string();
            assert!(e.contains(named), "{bad}: {e}");
        }
    }
}
