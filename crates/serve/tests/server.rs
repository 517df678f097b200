//! `kvq-serve` on loopback with the tiny random model, driven by a real HTTP client (ureq).

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use kvq::attention::ScorePath;
use kvq_candle::{GgufTokenizer, KvStore, KvqStore, LlamaModel};
use kvq_serve::engine::Admission;
use kvq_serve::server::ServerConfig;

mod common;
use common::*;
use serde_json::{Value, json};

/// The data lines of a server-sent-events stream.
fn stream(addr: SocketAddr, path: &str, body: Value) -> Vec<String> {
    let r = agent()
        .post(&format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .unwrap();
    assert_eq!(r.status().as_u16(), 200);
    assert!(r.headers().get("content-type").unwrap().to_str().unwrap().starts_with("text/event-stream"));
    BufReader::new(r.into_body().into_reader())
        .lines()
        .map(Result::unwrap)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// Greedy decoding of `prompt` with the model and kvq's cache directly, no server: the text
/// the server must give for the same request.
fn reference(prompt: &str, max_tokens: usize) -> String {
    let path = tiny_model();
    let model = LlamaModel::load(&path).unwrap();
    let tok = GgufTokenizer::load(&path).unwrap();
    let cache = model.config().cache_builder().blocks_per_layer(64).build().unwrap();
    let mut store = KvqStore::new(cache, ScorePath::Int8).unwrap();
    let mut ids = tok.encode(prompt).unwrap();
    let mut out = Vec::new();
    let mut logits = model.forward(&mut store, &ids).unwrap();
    for _ in 0..max_tokens {
        let last: Vec<f32> = logits.get(logits.dim(0).unwrap() - 1).unwrap().to_vec1().unwrap();
        let next = last.iter().enumerate().fold(0, |b, (i, &x)| if x > last[b] { i } else { b }) as u32;
        out.push(next);
        ids.push(next);
        logits = model.forward(&mut store, &[next]).unwrap();
    }
    assert_eq!(store.len(0), ids.len());
    tok.decode_text(&out).unwrap()
}

#[test]
fn health_models_and_a_completion_equal_to_the_model_run_directly() {
    let addr = start(config());
    assert_eq!(get(addr, "/health").0, 200);
    let (status, models) = get(addr, "/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "tiny");
    let v = completion(addr, "the cache of keys and values", 12);
    assert_eq!(v["object"], "text_completion");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["usage"]["completion_tokens"], 12);
    let prompt_tokens = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(prompt_tokens > 5, "{v}");
    assert_eq!(v["usage"]["total_tokens"].as_u64().unwrap(), prompt_tokens + 12);
    assert_eq!(text(&v), reference("the cache of keys and values", 12));
}

#[test]
fn streaming_sends_the_same_text_in_pieces_then_done() {
    let addr = start(config());
    let whole = text(&completion(addr, "streams of text", 10));
    let lines = stream(
        addr,
        "/v1/completions",
        json!({ "prompt": "streams of text", "max_tokens": 10, "temperature": 0, "ignore_eos": true,
                "stream": true, "stream_options": { "include_usage": true } }),
    );
    assert_eq!(lines.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    let streamed: String = chunks.iter().filter_map(|c| c["choices"][0]["text"].as_str()).collect();
    assert_eq!(streamed, whole);
    let usage = chunks.last().unwrap();
    assert_eq!(usage["usage"]["completion_tokens"], 10);
    assert_eq!(chunks[chunks.len() - 2]["choices"][0]["finish_reason"], "length");

    // Chat: the first chunk names the role, content follows in deltas.
    let body = json!({ "messages": [{ "role": "user", "content": "hello there" }], "max_tokens": 6,
                       "temperature": 0, "ignore_eos": true });
    let (status, whole) = post(addr, "/v1/chat/completions", body.clone());
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["object"], "chat.completion");
    assert_eq!(whole["choices"][0]["message"]["role"], "assistant");
    let mut sbody = body;
    sbody["stream"] = json!(true);
    let lines = stream(addr, "/v1/chat/completions", sbody);
    assert_eq!(lines.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> =
        lines[..lines.len() - 1].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let content: String =
        chunks.iter().filter_map(|c| c["choices"][0]["delta"]["content"].as_str()).collect();
    assert_eq!(content, whole["choices"][0]["message"]["content"].as_str().unwrap());
}

#[test]
fn concurrent_requests_give_the_text_each_gives_alone() {
    let addr = start(ServerConfig { prefill_budget: 7, ..config() });
    let prompts: Vec<String> =
        (0..6).map(|i| format!("request number {i} asks {}", "more ".repeat(i * 5))).collect();
    let alone: Vec<String> = prompts.iter().map(|p| text(&completion(addr, p, 9))).collect();
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> =
            prompts.iter().map(|p| s.spawn(move || text(&completion(addr, p, 9)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(alone, together);
}

/// The bytes of a pool that holds `need · 3/2` blocks per layer, where `need` is what one
/// request of `prompt` and `max_tokens` takes; and `need`.
fn pool_for_one_and_a_half(prompt: &str, max_tokens: usize) -> (usize, usize) {
    let probe = kvq_candle::LlamaModel::load(tiny_model()).unwrap();
    pool_for_one_and_a_half_of(
        probe.config().cache_builder().blocks_per_layer(1).build().unwrap(),
        prompt,
        max_tokens,
    )
}

/// [`pool_for_one_and_a_half`] of the cache config `c`.
fn pool_for_one_and_a_half_of(
    c: kvq::cache::KvCacheConfig,
    prompt: &str,
    max_tokens: usize,
) -> (usize, usize) {
    let tok = GgufTokenizer::load(tiny_model()).unwrap();
    let tokens = tok.encode(prompt).unwrap().len() + max_tokens;
    let c = kvq::cache::KvCacheConfig { blocks_per_layer: 1, ..c };
    let need = c.blocks_for_tokens(tokens).unwrap()[0];
    let blocks = need + need / 2;
    assert!(need >= 4 && blocks < 2 * need, "{tokens} tokens take {need} blocks");
    let block_bytes: usize =
        kvq::cache::QuantizedKvCache::new(c).unwrap().memory().iter().map(|m| m.block_bytes).sum();
    (blocks * block_bytes, need)
}

#[test]
fn a_pool_for_one_request_serves_many_one_after_another() {
    let prompt = "a small pool ".repeat(20);
    // Whole-length reservations: one request at a time, nothing preempted.
    let (pool_bytes, _) = pool_for_one_and_a_half(&prompt, 30);
    let addr = start(ServerConfig { pool_bytes, admission: Admission::Full, ..config() });
    let alone = text(&completion(addr, &prompt, 30));
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..4).map(|_| s.spawn(|| text(&completion(addr, &prompt, 30)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(together.iter().all(|t| *t == alone));
    assert_eq!(metric(addr, "kvq_requests_admitted_total"), 5.0);
    assert_eq!(metric(addr, "kvq_preemptions_total"), 0.0);
    // A request the pool could never hold is refused, and the server goes on.
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({ "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": true }),
    );
    assert_eq!(status, 400, "{v}");
    assert!(v["error"]["message"].as_str().unwrap().contains("pool"), "{v}");
    assert_eq!(text(&completion(addr, &prompt, 30)), alone);
}

#[test]
fn memory_pressure_preempts_and_changes_no_output() {
    // Short prompts and long outputs: optimistic admission runs the four requests at once on
    // their prompts, and their outputs outgrow a pool for one and a half of them.
    let prompts: Vec<String> = (0..4).map(|i| format!("pressure {i}: ")).collect();
    let (pool_bytes, _) = pool_for_one_and_a_half(&prompts[0], 120);
    let addr = same_text_under_pressure(&prompts, config(), pool_bytes);
    settles(addr, "kvq_sequences_running", 0.0);
}

/// Runs `prompts` (120 tokens each) one at a time on a server of `base`, then all at once on
/// one whose pool holds `pool_bytes`: the texts must be the same, and the second server must
/// have preempted and resumed. Returns the second server.
fn same_text_under_pressure(prompts: &[String], base: ServerConfig, pool_bytes: usize) -> SocketAddr {
    let big = start(base.clone());
    let alone: Vec<String> = prompts.iter().map(|p| text(&completion(big, p, 120))).collect();
    let addr = start(ServerConfig { pool_bytes, ..base });
    let together: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> =
            prompts.iter().map(|p| s.spawn(move || text(&completion(addr, p, 120)))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(together, alone);
    assert!(metric(addr, "kvq_preemptions_total") >= 1.0);
    settles(addr, "kvq_sequences_preempted", 0.0);
    addr
}

/// The same with values in a fixed codebook, from a config file: its levels travel with the
/// preempted sequences (they once could not be exported, and such requests failed).
#[test]
fn memory_pressure_preempts_fixed_codebook_caches_too() {
    use kvq::quant::{Codebook, CodebookSource, Granularity, Kind, ParamDtype, QuantSpec};
    let levels =
        vec![-1.0, -0.7, -0.45, -0.25, -0.1, 0.02, 0.12, 0.25, 0.38, 0.5, 0.6, 0.7, 0.8, 0.88, 0.95, 1.0];
    let kind = Kind::Codebook(CodebookSource::Fixed(Codebook::new(levels).unwrap()));
    let v = QuantSpec::new(kind, 4, Granularity::PerToken, ParamDtype::F16).unwrap();
    let probe = kvq_candle::LlamaModel::load(tiny_model()).unwrap();
    let c = probe
        .config()
        .cache_builder()
        .specs("int4-channel".parse().unwrap(), v)
        .blocks_per_layer(1)
        .build()
        .unwrap();
    let path = std::env::temp_dir().join(format!("kvq-serve-codebook-{}.toml", std::process::id()));
    c.save(&path).unwrap();
    let prompts: Vec<String> = (0..4).map(|i| format!("codebook {i}: ")).collect();
    let (pool_bytes, _) = pool_for_one_and_a_half_of(c, &prompts[0], 120);
    same_text_under_pressure(
        &prompts,
        ServerConfig { cache_config: Some(path.clone()), ..config() },
        pool_bytes,
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn a_client_that_goes_away_frees_its_blocks() {
    let addr = start(config());
    let r = agent()
        .post(&format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .send(
            json!({ "prompt": "a long story", "max_tokens": 400, "ignore_eos": true, "stream": true })
                .to_string(),
        )
        .unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    let first = lines.next().unwrap().unwrap();
    assert!(first.starts_with("data: "), "{first}");
    settles(addr, "kvq_sequences_running", 1.0);
    drop(lines);
    let deadline = Instant::now() + Duration::from_secs(30);
    while metric(addr, "kvq_requests_cancelled_total") < 1.0 {
        assert!(Instant::now() < deadline, "the request was never cancelled");
        std::thread::sleep(Duration::from_millis(20));
    }
    settles(addr, "kvq_pool_blocks_used", 0.0);
    settles(addr, "kvq_sequences_running", 0.0);
    assert!(metric(addr, "kvq_generated_tokens_total") < 400.0);
    assert!(metric(addr, "kvq_cache_bits_per_value") > 4.0);
}

#[test]
fn bad_requests_get_openai_errors_and_the_server_goes_on() {
    let addr = start(ServerConfig { max_body: 64 << 10, ..config() });
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/completions", "{not json".into(), 400, None),
        ("/v1/completions", "[1, 2]".into(), 400, None),
        ("/v1/completions", json!({ "prompt": "x", "bogus": 1 }).to_string(), 400, Some("bogus")),
        ("/v1/completions", json!({ "prompt": "x", "model": "gpt-9" }).to_string(), 404, Some("model")),
        ("/v1/completions", json!({ "prompt": "x", "max_tokens": 0 }).to_string(), 400, Some("max_tokens")),
        (
            "/v1/completions",
            json!({ "prompt": "x", "max_tokens": 100000 }).to_string(),
            400,
            Some("max_tokens"),
        ),
        ("/v1/completions", json!({ "prompt": "x", "temperature": 7 }).to_string(), 400, Some("temperature")),
        ("/v1/completions", json!({ "prompt": "x", "top_p": 0 }).to_string(), 400, Some("top_p")),
        ("/v1/completions", json!({ "prompt": "x", "n": 3 }).to_string(), 400, Some("n")),
        ("/v1/completions", json!({ "prompt": [1, 2, 99999] }).to_string(), 400, Some("prompt")),
        ("/v1/completions", json!({ "prompt": "" }).to_string(), 400, Some("prompt")),
        ("/v1/completions", json!({ "prompt": "word ".repeat(600) }).to_string(), 400, Some("prompt")),
        ("/v1/completions", json!({ "prompt": "x".repeat(100 << 10) }).to_string(), 413, None),
        ("/v1/chat/completions", json!({ "messages": [] }).to_string(), 400, Some("messages")),
        (
            "/v1/chat/completions",
            json!({ "messages": [{ "role": "wizard", "content": "x" }] }).to_string(),
            400,
            Some("messages"),
        ),
        ("/v1/nothing", "{}".into(), 404, None),
    ];
    for (path, body, want, param) in cases {
        let (status, _, text) = post_raw(addr, path, &body);
        let v: Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path} {body:.80}: {e}: {text}"));
        assert_eq!(status, want, "{body:.80}: {v}");
        assert!(v["error"]["message"].is_string(), "{v}");
        if let Some(p) = param {
            assert_eq!(v["error"]["param"], p, "{body:.80}: {v}");
        }
    }
    assert_eq!(completion(addr, "still here", 3)["usage"]["completion_tokens"], 3);
}

#[test]
fn more_requests_than_allowed_get_429_with_retry_after() {
    let addr = start(ServerConfig { max_requests: 1, ..config() });
    let r = agent()
        .post(&format!("http://{addr}/v1/completions"))
        .header("content-type", "application/json")
        .send(
            json!({ "prompt": "hold the slot", "max_tokens": 300, "ignore_eos": true, "stream": true })
                .to_string(),
        )
        .unwrap();
    let mut lines = BufReader::new(r.into_body().into_reader()).lines();
    lines.next().unwrap().unwrap();
    let (status, retry, body) = post_raw(addr, "/v1/completions", &json!({ "prompt": "x" }).to_string());
    assert_eq!(status, 429, "{body}");
    assert_eq!(retry.as_deref(), Some("1"));
    let v: Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["error"]["type"], "rate_limit_error");
    drop(lines);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let (status, _, _) =
            post_raw(addr, "/v1/completions", &json!({ "prompt": "x", "max_tokens": 2 }).to_string());
        if status == 200 {
            break;
        }
        assert!(Instant::now() < deadline, "the slot was never released");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn sampling_with_a_seed_repeats_and_stop_strings_cut() {
    let addr = start(config());
    let body = json!({ "prompt": "random words", "max_tokens": 16, "temperature": 1.0, "top_k": 40,
                       "top_p": 0.95, "min_p": 0.02, "seed": 42, "ignore_eos": true });
    let (_, a) = post(addr, "/v1/completions", body.clone());
    let (_, b) = post(addr, "/v1/completions", body);
    assert_eq!(text(&a), text(&b));
    // A stop string taken from the middle of the greedy text cuts it there.
    let whole = text(&completion(addr, "cut me", 24));
    let chars: Vec<char> = whole.chars().collect();
    let stop: String = chars[chars.len() / 2..chars.len() / 2 + 2].iter().collect();
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({ "prompt": "cut me", "max_tokens": 24, "temperature": 0, "ignore_eos": true, "stop": stop }),
    );
    assert_eq!(status, 200);
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    assert_eq!(text(&v), whole[..whole.find(&stop).unwrap()]);
}

#[test]
fn a_repeated_or_extended_prompt_reuses_its_blocks_and_gives_the_same_text() {
    let addr = start(config());
    let prompt = "a shared system prompt that many requests begin with ".repeat(4);
    let first = text(&completion(addr, &prompt, 12));
    assert_eq!(metric(addr, "kvq_prefix_misses_total"), 1.0);
    assert_eq!(metric(addr, "kvq_prefix_entries"), 1.0);
    let prefilled = metric(addr, "kvq_prompt_tokens_total");
    let again = completion(addr, &prompt, 12);
    assert_eq!(text(&again), first);
    assert_eq!(metric(addr, "kvq_prefix_hits_total"), 1.0);
    let prompt_tokens = again["usage"]["prompt_tokens"].as_f64().unwrap();
    let reused = metric(addr, "kvq_prefix_tokens_reused_total");
    // Everything but the part of the last block that holds the prompt's last token.
    assert!(reused >= prompt_tokens - 32.0 && reused < prompt_tokens, "{reused} of {prompt_tokens}");
    assert_eq!(metric(addr, "kvq_prompt_tokens_total") - prefilled, prompt_tokens - reused);
    // Same text as a server without prefix caching, and as the model run directly.
    let plain = start(ServerConfig { prefix_entries: 0, ..config() });
    assert_eq!(text(&completion(plain, &prompt, 12)), first);
    assert_eq!(first, reference(&prompt, 12));
    // A prompt that goes on from the first reuses its blocks too.
    let longer = format!("{prompt} and then asks something else");
    let t = text(&completion(addr, &longer, 10));
    assert_eq!(metric(addr, "kvq_prefix_hits_total"), 2.0);
    assert_eq!(t, text(&completion(plain, &longer, 10)));
}

/// Snapshots are cut at the last block boundary before a prompt's last token; at every
/// distance from it (all 32 residues, blocks of 32 after 4 sinks, and past the first quantized
/// block) a hit gives the text of a server without prefix caching.
#[test]
fn prefix_hits_are_exact_at_every_prompt_length() {
    let addr = start(config());
    let plain = start(ServerConfig { prefix_entries: 0, ..config() });
    let ids = |n: usize| -> Vec<u32> { (0..n as u32).map(|i| 3 + (i * 7919) % 300).collect() };
    let run = |addr, prompt: &[u32]| greedy_ids(addr, prompt, 8);
    let mut hits = 0.0;
    for n in (37..=70).chain([100, 101, 131, 132, 133]) {
        let prompt = ids(n);
        let want = run(plain, &prompt);
        assert_eq!(run(addr, &prompt), want, "first, {n} tokens");
        assert_eq!(run(addr, &prompt), want, "again, {n} tokens");
        let mut longer = prompt.clone();
        longer.extend(ids(90)[50..].iter().copied());
        assert_eq!(run(addr, &longer), run(plain, &longer), "extended, {n} tokens");
        hits = metric(addr, "kvq_prefix_hits_total");
    }
    assert!(hits >= 39.0, "{hits} hits");
}

/// `kvq-serve --read-rate` prints a positive rate in GB/s and exits, without a model.
#[test]
fn the_read_rate_is_a_positive_number() {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kvq-serve"))
        .args(["--read-rate", "--model", "/nonexistent.gguf"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let rate: f64 = String::from_utf8_lossy(&out.stdout).trim().parse().unwrap();
    assert!(rate.is_finite() && rate > 0.0, "{rate}");
}
