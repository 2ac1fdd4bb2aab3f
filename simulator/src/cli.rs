//! Command-line options of `kvoy-sim`: one flag per knob (clap derive). [`Cli`] is what clap
//! parses; [`Cli::into_options`] checks what clap cannot (the profile, the tokenizer files) and
//! gives the [`Options`] the servers run with.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::error::ErrorKind;
use clap::{Args, Parser, ValueEnum};

use crate::engine::Profile;
use crate::server::HttpOptions;
use crate::tokenizer::Tokenizer;

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

/// kvoy-sim: a vLLM-compatible model-server simulator
#[derive(Debug, Parser)]
// Negative numbers reach the value parsers, whose errors name the flag.
#[command(name = "kvoy-sim", allow_negative_numbers = true)]
pub struct Cli {
    /// HTTP address
    #[arg(long, value_name = "ADDR", default_value = "127.0.0.1:8000")]
    pub listen: SocketAddr,
    /// Start N simulators on consecutive ports from --listen (and consecutive KV-event ports)
    /// in this process
    #[arg(long, value_name = "N", visible_alias = "replicas", default_value_t = 1,
          value_parser = clap::value_parser!(u16).range(1..))]
    pub count: u16,
    /// Served model name; repeat or separate with commas for several
    #[arg(
        long = "model",
        value_name = "NAME",
        value_delimiter = ',',
        default_value = "kvoy-sim"
    )]
    pub models: Vec<String>,
    /// The engine profile: llama-8b-h100 or qwen-32b-h100-tp2
    #[arg(long, value_name = "NAME", default_value = "llama-8b-h100", value_parser = profile)]
    pub profile: Profile,
    /// Divide every simulated duration by F
    #[arg(long, value_name = "F", default_value_t = 1.0, value_parser = positive_f64)]
    pub speedup: f64,
    /// Seed for fault injection
    #[arg(long, value_name = "N", default_value_t = HttpOptions::default().seed)]
    pub seed: u64,
    /// max_tokens of a request that sets none
    #[arg(long, value_name = "N", default_value_t = HttpOptions::default().default_max_tokens)]
    pub default_max_tokens: u32,
    /// Larger bodies get 413
    #[arg(long, value_name = "N", default_value_t = HttpOptions::default().max_body_bytes)]
    pub max_body_bytes: usize,
    /// Answer this fraction of completions 500
    #[arg(long, value_name = "F", default_value_t = 0.0, value_parser = fraction)]
    pub error_rate: f64,
    /// Simulated latency before a completion starts
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub added_latency_ms: u64,
    /// /v1/responses kept for previous_response_id, least recently used dropped first
    #[arg(long, value_name = "N", default_value_t = HttpOptions::default().max_stored_responses)]
    pub max_stored_responses: usize,
    /// ... and at most N bytes of their context
    #[arg(long, value_name = "N",
          default_value_t = HttpOptions::default().max_stored_response_bytes)]
    pub max_stored_response_bytes: usize,
    /// ZMQ PUB endpoint for KV events, e.g. tcp://127.0.0.1:5557
    #[arg(long, value_name = "EP")]
    pub kv_events_endpoint: Option<String>,
    /// ZMQ ROUTER endpoint answering replay requests
    #[arg(long, value_name = "EP")]
    pub kv_events_replay_endpoint: Option<String>,
    /// Topic frame of every message (default empty, as vLLM's; llm-d's convention is
    /// kv@<pod ip:port>@<model>)
    #[arg(long, value_name = "T")]
    pub kv_events_topic: Option<String>,
    /// The events' wire form
    #[arg(long, value_name = "F", value_enum, default_value_t = KvEventsFormat::Map)]
    pub kv_events_format: KvEventsFormat,
    /// A Hugging Face tokenizer.json: prompts are tokenized as vLLM does with it (chat
    /// messages through the model's chat template) and answers are words of its vocabulary
    /// (default: a stand-in of about 4 bytes per token)
    #[arg(long, value_name = "PATH")]
    pub tokenizer: Option<PathBuf>,
    /// A jinja chat template file, instead of the model's (chat_template.jinja or
    /// tokenizer_config.json beside the tokenizer); needs --tokenizer
    #[arg(long, value_name = "PATH")]
    pub chat_template: Option<PathBuf>,
    /// Its part in prefill/decode disaggregation: decode (the default) and both follow a
    /// request's x-prefiller-host-port (prefill there, pull the KV, decode here; prefill here
    /// when that fails), prefill and both answer a kv_transfer_params.do_remote_decode request
    /// with the KV's transfer parameters
    #[arg(long, value_name = "ROLE", default_value = "decode", value_parser = role)]
    pub role: kvoy_shared::Role,
    /// KV transfer rate from a prefill server, prompt tokens per second of model time (about
    /// 25 GB/s for an 8B model's 128 KiB per token)
    #[arg(long, value_name = "N", default_value_t = 200_000.0, value_parser = positive_f64)]
    pub kv_transfer_tokens_per_s: f64,
    #[command(flatten)]
    pub overrides: ProfileOverrides,
}

/// The KV events' wire form (`--kv-events-format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum KvEventsFormat {
    /// vLLM >= mid-2026
    Map,
    /// Older vLLM
    Array,
}

/// Fields of the profile that a flag replaces.
#[derive(Debug, Default, Args)]
#[command(next_help_heading = "Profile overrides")]
pub struct ProfileOverrides {
    /// Tokens per KV block
    #[arg(long, value_name = "N")]
    pub block_size: Option<u32>,
    /// KV blocks on the GPU
    #[arg(long, value_name = "N")]
    pub num_gpu_blocks: Option<u32>,
    /// Most sequences running at once
    #[arg(long, value_name = "N")]
    pub max_num_seqs: Option<u32>,
    /// Token budget per step
    #[arg(long, value_name = "N")]
    pub max_num_batched_tokens: Option<u32>,
    /// Longest prompt + output accepted
    #[arg(long, value_name = "N")]
    pub max_model_len: Option<u32>,
    /// Prefill throughput of the linear layers, tokens per second
    #[arg(long, value_name = "F")]
    pub prefill_tokens_per_s: Option<f64>,
    /// Prefill attention cost per (new token, attended token) pair, seconds
    #[arg(long, value_name = "F")]
    pub prefill_attention_s_per_token_pair: Option<f64>,
    /// Fixed cost of one step, seconds
    #[arg(long, value_name = "F")]
    pub step_base_s: Option<f64>,
    /// Cost per scheduled sequence, seconds
    #[arg(long, value_name = "F")]
    pub step_per_seq_s: Option<f64>,
    /// Decode cost per context token of each decoding sequence, seconds
    #[arg(long, value_name = "F")]
    pub step_per_context_token_s: Option<f64>,
    /// Blocks of a CPU offload tier, as vLLM's --kv-offloading-size (default 0: none)
    #[arg(long, value_name = "N")]
    pub cpu_offload_blocks: Option<u32>,
    /// CPU-to-GPU load rate of that tier (default 200000)
    #[arg(long, value_name = "F")]
    pub offload_load_tokens_per_s: Option<f64>,
}

impl ProfileOverrides {
    fn apply(&self, p: &mut Profile) {
        fn set<T: Copy>(field: &mut T, v: Option<T>) {
            if let Some(v) = v {
                *field = v;
            }
        }
        set(&mut p.block_size, self.block_size);
        set(&mut p.num_gpu_blocks, self.num_gpu_blocks);
        set(&mut p.max_num_seqs, self.max_num_seqs);
        set(&mut p.max_num_batched_tokens, self.max_num_batched_tokens);
        set(&mut p.max_model_len, self.max_model_len);
        set(&mut p.prefill_tokens_per_s, self.prefill_tokens_per_s);
        set(
            &mut p.prefill_attention_s_per_token_pair,
            self.prefill_attention_s_per_token_pair,
        );
        set(&mut p.step_base_s, self.step_base_s);
        set(&mut p.step_per_seq_s, self.step_per_seq_s);
        set(
            &mut p.step_per_context_token_s,
            self.step_per_context_token_s,
        );
        set(&mut p.cpu_offload_blocks, self.cpu_offload_blocks);
        set(
            &mut p.offload_load_tokens_per_s,
            self.offload_load_tokens_per_s,
        );
    }
}

/// `--profile`'s value parser, shared with kvoy-bench: a built-in profile by name.
pub fn profile(name: &str) -> Result<Profile, String> {
    Profile::by_name(name).ok_or_else(|| {
        format!(
            "unknown profile `{name}`; expected {}",
            Profile::NAMES.join(" or ")
        )
    })
}

/// A value parser for factors and durations, shared with kvoy-bench: a finite number above 0.
fn role(v: &str) -> Result<kvoy_shared::Role, String> {
    kvoy_shared::Role::from_name(v.trim())
        .ok_or_else(|| "expected decode, prefill or both".to_owned())
}

pub fn positive_f64(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        _ => Err("expected a number above 0".to_owned()),
    }
}

fn fraction(v: &str) -> Result<f64, String> {
    match v.trim().parse::<f64>() {
        Ok(x) if (0.0..=1.0).contains(&x) => Ok(x),
        _ => Err("expected a number within 0..=1".to_owned()),
    }
}

impl Cli {
    /// The options the servers run with: the profile with its overrides (validated) and the
    /// tokenizer loaded.
    pub fn into_options(self) -> Result<Options> {
        let mut profile = self.profile;
        self.overrides.apply(&mut profile);
        profile
            .validate()
            .map_err(|e| anyhow::anyhow!("invalid profile: {e}"))?;
        let tokenizer = match (&self.tokenizer, &self.chat_template) {
            (Some(path), template) => Tokenizer::load(path, template.as_deref())
                .map_err(|e| anyhow::anyhow!("--tokenizer: {e}"))?,
            // Not clap's `requires`: this message names both flags the way the README does.
            (None, Some(_)) => bail!("--chat-template needs --tokenizer"),
            (None, None) => Tokenizer::StandIn,
        };
        let http = HttpOptions {
            models: self.models,
            speedup: self.speedup,
            default_max_tokens: self.default_max_tokens,
            max_body_bytes: self.max_body_bytes,
            error_rate: self.error_rate,
            added_latency: Duration::from_millis(self.added_latency_ms),
            seed: self.seed,
            max_stored_responses: self.max_stored_responses,
            max_stored_response_bytes: self.max_stored_response_bytes,
            tokenizer,
            role: self.role,
            kv_transfer_tokens_per_s: self.kv_transfer_tokens_per_s,
        };
        Ok(Options {
            listen: self.listen,
            count: self.count,
            profile,
            http,
            kv_events: KvEventOptions {
                endpoint: self.kv_events_endpoint,
                replay_endpoint: self.kv_events_replay_endpoint,
                topic: self.kv_events_topic,
                array_form: self.kv_events_format == KvEventsFormat::Array,
            },
        })
    }
}

/// Parses the arguments after the program name, for callers that start simulators in-process
/// from `kvoy-sim` flags. `Ok(None)` means help was asked for; a usage error is clap's, with
/// the flag it is about.
pub fn parse(args: &[String]) -> Result<Option<Options>> {
    let argv = std::iter::once("kvoy-sim").chain(args.iter().map(String::as_str));
    match Cli::try_parse_from(argv) {
        Ok(cli) => cli.into_options().map(Some),
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            Ok(None)
        }
        Err(e) => Err(e.into()),
    }
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
