//! Trains the small test tokenizer in `testdata/tokenizer/` (no download: the corpus is below)
//! and writes its `tokenizer.json` and `tokenizer_config.json` (with a Llama-3-style chat
//! template written for kvoy). kvoy-sim's tests load it with `--tokenizer`.
//!
//! ```sh
//! cargo run -p kvoy-sim --example train_test_tokenizer            # into testdata/tokenizer
//! cargo run -p kvoy-sim --example train_test_tokenizer -- OUT_DIR
//! ```
//!
//! The tokenizer is built like Llama 3's: byte-level BPE over Llama 3's split regex, a byte-level
//! decoder, `<|begin_of_text|>` added by the post-processor (so `add_special_tokens` prepends
//! it), and the header and end-of-turn special tokens. Training is deterministic: running this
//! again writes the same files.

use std::collections::HashSet;
use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::sequence::Sequence as PostSequence;
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, SplitDelimiterBehavior, Tokenizer};

/// Target vocabulary size (special tokens included). The corpus stops training earlier, at
/// about 1,100 tokens, when no pair of symbols occurs twice any more.
const VOCAB_SIZE: usize = 2048;

const BOS: &str = "<|begin_of_text|>";
const EOS: &str = "<|end_of_text|>";
const SPECIAL: [&str; 5] = [
    BOS,
    EOS,
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
];

/// The split regex of Llama 3's tokenizer (contractions, words with one leading non-letter,
/// up to three digits, punctuation runs, newlines, other whitespace).
const SPLIT_REGEX: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// kvoy's test chat template, in the style of Llama 3's (headers, end-of-turn tokens, content
/// stripped, tools as JSON lines) but written for these tests.
const CHAT_TEMPLATE: &str = r#"{{- bos_token }}
{%- if tools %}
    {{- '<|start_header_id|>tools<|end_header_id|>\n\n' }}
    {%- for tool in tools %}
        {{- tool | tojson }}
        {{- '\n' }}
    {%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}
        {{- raise_exception("unknown role '" ~ message['role'] ~ "' in message " ~ loop.index) }}
    {%- endif %}
    {{- '<|start_header_id|>' ~ message['role'] ~ '<|end_header_id|>\n\n' }}
    {%- if message['content'] is string %}
        {{- message['content'].strip() }}
    {%- endif %}
    {%- if message['tool_calls'] %}
        {%- for call in message['tool_calls'] %}
            {{- '\n' ~ call['function'] | tojson }}
        {%- endfor %}
    {%- endif %}
    {{- '<|eot_id|>' }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"#;

/// Hand-written prose, chat turns, JSON and code: the corpus's fixed part.
const PROSE: &str = r#"The morning train left the station a little after seven, and most of the people on it were going to work.
This is a short note about how the simulator answers a request. It reads the body, finds the model, and turns the prompt into tokens.
We keep the cache warm by sending the same long system prompt with every question, so the second request is much faster than the first.
You can ask the server for its metrics at any time; it answers with plain text that a scraper understands.
Here is what happened when the router saw three replicas: it picked the one that already held the prefix, and the time to first token dropped.
Yes, the answer is in the log. So we looked at the log, and there it was, one line for each request that was refused.
In the garden the tomatoes were late this year, but the beans grew well and the apple tree had more fruit than ever before.
For a long time nobody noticed that the clock on the wall was five minutes slow. When someone finally did, they fixed it and moved on.
A good test fails when the code is wrong and passes when it is right. One that always passes tells you nothing at all.
That afternoon the wind turned, the clouds came in from the west, and by evening the first drops of rain were on the window.
There are two kinds of errors: those caused by the client, which get a clear message, and those caused by the server, which get an apology.
If the prompt is longer than the context, the request is refused before anything is streamed back.
The baker opens the shop at six. She has bread, rolls and a small cake on the counter by half past six, and the first customers come soon after.
It was the kind of day when everything takes twice as long as planned, and still most of the work got done.
We wrote the plan on a single page: what to build, how to test it, and what to leave for later.
You should read the error message first; it usually names the field that was wrong and the values that are allowed.
This function returns the number of tokens in a text. It does not allocate, and it never panics on any input.
Here are the steps: load the file, check that it parses, build the index, and then answer the queries one by one.
So the question was not whether the cache helps but how much, and the answer depends on how often prompts share their first blocks.
In the end the team agreed that the simpler design was also the faster one, which does not happen every day.
The river was high after the storm. The bridge stayed open, but the path along the water was closed for a week.
Each block holds sixteen tokens. A block is stored once all of its tokens are known, and removed when the cache needs the space.
Our new office is on the third floor, next to the library. It has large windows, a kitchen, and a view of the park.
They walked to the top of the hill, ate their lunch in the sun, and came down by the other path before it got dark.
When the queue is long, new requests wait; when it is short, they start right away. The scheduler decides which ones run in each step.
What matters most is that the numbers are right. What matters next is that they are easy to read.
Please send the report by Friday. If that is not possible, tell me which day works, and we will plan around it.
The cat sat by the door all morning, waiting for someone to let her out, and then slept in the sun for the rest of the day.
Thank you for the quick answer. I tried the new version and it works; the only thing left is the documentation.
How do I start the server on another port? Use the listen flag with an address and a port, and the server binds to it.
Why is the first request slow? Because nothing is cached yet: every token of the prompt has to be computed once.
Can I run more than one simulator in a process? Yes, give a count, and they take consecutive ports from the one you listen on.
Is the output text random? No, it is chosen from a small list of words by a hash of the request and the position, so runs repeat exactly.
On Monday the market was quiet; on Tuesday prices jumped; by Thursday everyone had forgotten why, and the charts looked flat again.
The library keeps old maps in a cold room upstairs. Visitors may look at them on Wednesdays, with gloves, under the watchful eye of a librarian.
Bring a warm jacket, good shoes, water, a flashlight and something to eat; the mountain weather changes quickly, especially in autumn.
Configuration lives in a single file. Every option has a default, every value is checked, and an unknown key is an error rather than a surprise.
Latency is measured from arrival to the first byte, throughput in tokens per second, and memory in blocks of sixteen tokens each.
Imagine a village where every house has a different colour: yellow, blue, green, orange, purple, white and a single bright red one.
Numbers like 3, 14, 159, 2653 and 58979 show up in logs, ports like 8000 and 5557 in configuration, and years like 2024 in dates.
Writing clearly is mostly rewriting: cut what repeats, replace vague words with precise ones, and read the sentence aloud.
The orchestra tuned for a minute, the conductor lifted her hands, and the hall fell silent just before the music began.
Functions should do one thing. Modules should hold one concern. Crates should have one name that says what they are for.
Seventeen students signed up for chemistry, twelve for physics, and almost everybody for the photography workshop on Saturday.
Careful measurement beats clever guessing: run the benchmark three times, report the median, and keep the raw data.
During the winter months the harbour freezes near the shore, and fishermen wait for spring with their boats pulled up on the sand.
Tokens are not words: a long word may be split into pieces, while a short common one is usually a single token of its own.
Questions about billing, shipping or returns go to support; questions about the engine, scheduling or caching go to engineering.
"#;

/// Structured text: JSON bodies and a little code.
const STRUCTURED: &str = r#"{"model": "kvoy-demo", "messages": [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "What is a prefix cache?"}], "max_tokens": 64, "stream": true}
{"model": "kvoy-demo", "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.7}
{"id": "chatcmpl-42", "object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "A prefix cache keeps the work done for the start of a prompt."}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 31, "completion_tokens": 14, "total_tokens": 45}}
{"type": "function", "function": {"name": "get_weather", "description": "Get the weather for a city", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
{"error": {"message": "The model `other` does not exist.", "type": "NotFoundError", "param": "model", "code": "model_not_found"}}
fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() < 2 {
        eprintln!("usage: count FILE");
        return;
    }
    let text = std::fs::read_to_string(&args[1]).unwrap_or_default();
    println!("{} lines, {} words", text.lines().count(), text.split_whitespace().count());
}
def tokens_per_second(tokens, seconds):
    if seconds <= 0:
        raise ValueError("seconds must be positive")
    return tokens / seconds

for i in range(10):
    print(i, tokens_per_second(1000 * i, 2.5))
"#;

/// Words for the generated sentences.
const SUBJECTS: [&str; 16] = [
    "The server",
    "The router",
    "A client",
    "The cache",
    "This request",
    "Our team",
    "The engine",
    "Every replica",
    "The scheduler",
    "A new user",
    "The test",
    "My friend",
    "The weather",
    "That model",
    "The old man",
    "The young girl",
];
const VERBS: [&str; 16] = [
    "reads",
    "sends",
    "keeps",
    "finds",
    "counts",
    "waits for",
    "answers",
    "drops",
    "stores",
    "checks",
    "likes",
    "takes",
    "opens",
    "moves",
    "builds",
    "gets",
];
const OBJECTS: [&str; 16] = [
    "the first block",
    "a long prompt",
    "the next token",
    "all the metrics",
    "one more question",
    "the shared prefix",
    "a new file",
    "the whole day",
    "our last report",
    "the right answer",
    "some fresh bread",
    "the morning train",
    "a short story",
    "every event",
    "the open door",
    "a small cup of tea",
];
const TAILS: [&str; 16] = [
    "and then it is done.",
    "but not for long.",
    "for you and me.",
    "so we can get out early.",
    "with all of its parts.",
    "when the day is new.",
    "in less than a second.",
    "as it has done before.",
    "because that was the plan.",
    "before the next step starts.",
    "at the end of the line.",
    "from the top of the list.",
    "or so it was said.",
    "while the others wait.",
    "after the rain has stopped.",
    "without any trouble at all.",
];

/// A small deterministic generator for the sentence combinations.
struct Mix(kvoy_shared::Rng);

impl Mix {
    fn pick<'a>(&mut self, words: &[&'a str]) -> &'a str {
        // A modulo, not `Rng::below`: the committed tokenizer was trained on these draws.
        words[(self.0.next_u64() % words.len() as u64) as usize]
    }
}

/// The training texts: the fixed parts, generated sentences, and chat transcripts.
fn corpus() -> Vec<String> {
    let mut lines: Vec<String> = PROSE.lines().map(str::to_owned).collect();
    lines.extend(STRUCTURED.lines().map(str::to_owned));
    let mut mix = Mix(kvoy_shared::Rng::new(7));
    for i in 0..1500 {
        let mut s = String::new();
        let _ = write!(
            s,
            "{} {} {} {}",
            mix.pick(&SUBJECTS),
            mix.pick(&VERBS),
            mix.pick(&OBJECTS),
            mix.pick(&TAILS)
        );
        if i % 5 == 0 {
            let _ = write!(
                s,
                " It took {} ms and used {} blocks.",
                10 + i % 990,
                i % 64
            );
        }
        lines.push(s);
    }
    for i in 0..200 {
        let (question, answer) = (mix.pick(&OBJECTS), mix.pick(&TAILS));
        lines.push(format!(
            "<|start_header_id|>user<|end_header_id|>\n\nWhere is {question}?<|eot_id|>\
             <|start_header_id|>assistant<|end_header_id|>\n\nThe answer is {answer} \
             It is number {i}.<|eot_id|>"
        ));
    }
    lines
}

fn special(token: &str) -> AddedToken {
    AddedToken::from(token, true)
}

fn train() -> Result<Tokenizer> {
    let pre = Sequence::new(vec![
        Split::new(
            SplitPattern::Regex(SPLIT_REGEX.to_owned()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| anyhow!("split regex: {e}"))?
        .into(),
        ByteLevel::new(false, true, false).into(),
    ]);
    let post = PostSequence::new(vec![
        ByteLevel::new(true, false, true).into(),
        TemplateProcessing::builder()
            .try_single(format!("{BOS}:0 $A:0"))
            .map_err(|e| anyhow!("single template: {e}"))?
            .try_pair(format!("{BOS}:0 $A:0 {BOS}:1 $B:1"))
            .map_err(|e| anyhow!("pair template: {e}"))?
            .special_tokens(vec![(BOS, 0u32)])
            .build()
            .map_err(|e| anyhow!("template processing: {e}"))?
            .into(),
    ]);
    let mut tokenizer = Tokenizer::new(BPE::default());
    tokenizer
        .with_pre_tokenizer(Some(pre))
        .with_decoder(Some(ByteLevelDecoder::default()))
        .with_post_processor(Some(post));
    let alphabet: HashSet<char> = ByteLevel::alphabet().into_iter().collect();
    let mut trainer: TrainerWrapper = BpeTrainerBuilder::new()
        .vocab_size(VOCAB_SIZE)
        .min_frequency(2)
        .show_progress(false)
        .special_tokens(SPECIAL.iter().map(|t| special(t)).collect())
        .initial_alphabet(alphabet)
        .build()
        .into();
    tokenizer
        .train(&mut trainer, corpus().into_iter())
        .map_err(|e| anyhow!("training: {e}"))?;
    // Special tokens are matched in the input text before pre-tokenization, as HF's are.
    tokenizer
        .add_special_tokens(SPECIAL.map(special))
        .map_err(|e| anyhow!("special tokens: {e}"))?;
    Ok(tokenizer)
}

fn config() -> serde_json::Value {
    serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": "<|eot_id|>",
        "model_max_length": 8192,
        "clean_up_tokenization_spaces": false,
        "chat_template": CHAT_TEMPLATE,
    })
}

/// Trains the small test tokenizer and writes tokenizer.json and tokenizer_config.json
#[derive(clap::Parser)]
struct Args {
    /// Output directory [default: testdata/tokenizer]
    out_dir: Option<PathBuf>,
}

fn main() -> Result<()> {
    let dir = <Args as clap::Parser>::parse()
        .out_dir
        .unwrap_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../testdata/tokenizer"));
    std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tokenizer = train()?;
    let path = dir.join("tokenizer.json");
    tokenizer
        .save(&path, true)
        .map_err(|e| anyhow!("cannot write {}: {e}", path.display()))?;
    let config_path = dir.join("tokenizer_config.json");
    let mut text = serde_json::to_string_pretty(&config())?;
    text.push('\n');
    std::fs::write(&config_path, text)
        .with_context(|| format!("cannot write {}", config_path.display()))?;
    println!(
        "wrote {} ({} tokens) and {}",
        path.display(),
        tokenizer.get_vocab_size(true),
        config_path.display()
    );
    Ok(())
}
