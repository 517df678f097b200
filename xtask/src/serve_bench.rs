//! `cargo xtask serve-bench`: kvq-serve and llama.cpp's llama-server driven by one load
//! generator on loopback, same model, same threads, same requests.
//!
//! For each server config (kvq's default cache, INT8, llama.cpp's f16, q8_0 and q4_0 caches)
//! it starts the server, waits for `/health`, and measures over OpenAI's streaming
//! `/v1/completions` (`ignore_eos`, greedy):
//! - one sequence at each depth (a prompt of about D tokens, then G tokens): decode tokens/s,
//!   from the first streamed token to the last;
//! - C concurrent clients, each with a distinct prompt of P words and G tokens out: aggregate
//!   generated tokens/s over the wall time, and p50/p99 time to first token and inter-token
//!   latency;
//! - KV bytes per token from the config (kvq: its bits per value, every parameter counted;
//!   llama.cpp: 16, 8.5 and 4.5 bits);
//! - for kvq's decode at each depth, the memory floor of a step: the model file's bytes and
//!   the cache's bytes at that depth over the one-thread read rate, measured in the same run
//!   ([`read_rate`], measured by the release server build).
//!
//! The table goes to stdout and `target/serve-bench.md`.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// What one run measures.
pub struct Plan {
    pub model: PathBuf,
    pub text: PathBuf,
    pub threads: usize,
    pub depths: Vec<usize>,
    pub depth_tokens: usize,
    pub clients: Vec<usize>,
    pub prompt_words: usize,
    pub output_tokens: usize,
    pub configs: Vec<String>,
    /// One thread's read rate in GB/s ([`read_rate`]), measured before the servers start.
    pub read_gbs: f64,
}

/// What one server measured: its rows of the main table, and of the floor table.
pub struct Measured {
    pub rows: Vec<String>,
    pub floors: Vec<String>,
}

/// One thread's read rate from memory in GB/s, as the optimized server build measures it
/// (`kvq-serve --read-rate`: `kvq::baseline::read_rate`, the loop `kvq bench` times). A loop
/// here would run at xtask's own optimization level, slower than memory on some machines, and
/// make every floor look farther than it is.
pub fn read_rate(kvq_serve: &Path) -> Result<f64, String> {
    let out = Command::new(kvq_serve)
        .arg("--read-rate")
        .output()
        .map_err(|e| format!("{}: {e}", kvq_serve.display()))?;
    let text = String::from_utf8_lossy(&out.stdout);
    text.trim()
        .parse::<f64>()
        .ok()
        .filter(|r| out.status.success() && r.is_finite() && *r > 0.0)
        .ok_or_else(|| format!("{} --read-rate printed {text:?}", kvq_serve.display()))
}

/// One server under test.
pub struct Server {
    pub name: String,
    child: Child,
    port: u16,
    pub kv_bits: f64,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free port on loopback.
pub fn free_port() -> Result<u16, String> {
    let l = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
    Ok(l.local_addr().map_err(|e| e.to_string())?.port())
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(3600)))
        .build()
        .into()
}

/// Starts `cmd` (listening on `port`) and waits for its `/health`.
pub fn start(name: &str, mut cmd: Command, port: u16, log: &Path, kv_bits: f64) -> Result<Server, String> {
    let log_file = std::fs::File::create(log).map_err(|e| format!("{}: {e}", log.display()))?;
    cmd.stdout(Stdio::null()).stderr(log_file);
    eprintln!("xtask: running {cmd:?}");
    let child = cmd.spawn().map_err(|e| format!("{cmd:?}: {e}"))?;
    let mut server = Server { name: name.to_string(), child, port, kv_bits };
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        if let Ok(r) = agent().get(&format!("http://127.0.0.1:{port}/health")).call()
            && r.status().as_u16() == 200
        {
            break;
        }
        if let Ok(Some(status)) = server.child.try_wait() {
            return Err(format!("{name} exited with {status} before it was ready; see {}", log.display()));
        }
        if Instant::now() > deadline {
            return Err(format!("{name} was not ready in 300 s; see {}", log.display()));
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    // kvq's bits per value come from its metrics.
    if server.kv_bits == 0.0 {
        let mut r =
            agent().get(&format!("http://127.0.0.1:{port}/metrics")).call().map_err(|e| e.to_string())?;
        let text = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
        server.kv_bits = text
            .lines()
            .find_map(|l| l.strip_prefix("kvq_cache_bits_per_value "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(f64::NAN);
    }
    Ok(server)
}

/// One streamed completion: when it was sent, when each piece came, and the token counts.
struct Stream {
    sent: Instant,
    pieces: Vec<Instant>,
    prompt_tokens: usize,
    completion_tokens: usize,
}

fn stream(port: u16, prompt: &str, max_tokens: usize) -> Result<Stream, String> {
    let body = json!({
        "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true,
        "stream": true, "stream_options": { "include_usage": true },
    });
    let sent = Instant::now();
    let r = agent()
        .post(&format!("http://127.0.0.1:{port}/v1/completions"))
        .header("content-type", "application/json")
        .send(body.to_string())
        .map_err(|e| e.to_string())?;
    if r.status().as_u16() != 200 {
        let status = r.status();
        let body = r.into_body().read_to_string().unwrap_or_default();
        return Err(format!("status {status}: {body}"));
    }
    let mut s = Stream { sent, pieces: Vec::new(), prompt_tokens: 0, completion_tokens: 0 };
    for line in BufReader::new(r.into_body().into_reader()).lines() {
        let line = line.map_err(|e| e.to_string())?;
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data.trim() == "[DONE]" {
            break;
        }
        let v: Value = serde_json::from_str(data).map_err(|e| format!("{e}: {data}"))?;
        if v["choices"][0]["text"].as_str().is_some_and(|t| !t.is_empty()) {
            s.pieces.push(Instant::now());
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            s.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
            s.completion_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
        }
    }
    if s.completion_tokens == 0 {
        s.completion_tokens = s.pieces.len();
    }
    Ok(s)
}

fn words(text: &str, skip: usize, n: usize) -> String {
    text.split_whitespace().cycle().skip(skip).take(n).collect::<Vec<_>>().join(" ")
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    v[((v.len() - 1) as f64 * p).round() as usize]
}

/// The rows of one server.
pub fn measure(server: &Server, plan: &Plan, text: &str) -> Result<Measured, String> {
    let (mut rows, mut floors) = (Vec::new(), Vec::new());
    let model_bytes = std::fs::metadata(&plan.model).map_err(|e| e.to_string())?.len() as f64;
    for &depth in &plan.depths {
        // About 1.3 tokens per word of English prose; each prompt starts elsewhere in the text,
        // so that no server's prompt cache serves one from another.
        // A prompt that the text's words make longer than the context (the model's 8192 at
        // a depth of 8000) is cut by 4% until the server takes it.
        let mut n_words = depth * 10 / 13;
        let s = loop {
            let prompt =
                if depth == 0 { "Once upon a time".to_string() } else { words(text, 31 * depth, n_words) };
            match stream(server.port, &prompt, plan.depth_tokens) {
                Err(e) if depth > 0 && e.contains("400") && n_words > depth / 2 => n_words -= n_words / 25,
                other => break other?,
            }
        };
        let span = match (s.pieces.first(), s.pieces.last()) {
            (Some(a), Some(b)) if s.completion_tokens > 1 => b.duration_since(*a).as_secs_f64(),
            _ => f64::NAN,
        };
        let tps = (s.completion_tokens.saturating_sub(1)) as f64 / span;
        eprintln!("xtask: {} depth {} ({} tokens): {tps:.1} tokens/s", server.name, depth, s.prompt_tokens);
        rows.push(format!(
            "| {} | one sequence, depth {} | {tps:.1} tokens/s | | |",
            server.name, s.prompt_tokens
        ));
        if server.name.starts_with("kvq") && depth > 0 && plan.read_gbs > 0.0 {
            let cache =
                s.prompt_tokens as f64 * metric(server.port, "kvq_cache_values_per_token")? * server.kv_bits
                    / 8.0;
            let floor = (model_bytes + cache) / (plan.read_gbs * 1e9) * 1e3;
            let step = 1e3 / tps;
            floors.push(format!(
                "| {} | {} | {step:.1} ms | {:.0} + {:.0} MB: {floor:.1} ms | {:.2}x |",
                server.name,
                s.prompt_tokens,
                model_bytes / 1e6,
                cache / 1e6,
                step / floor
            ));
        }
    }
    for &clients in &plan.clients {
        let start = Instant::now();
        let results: Vec<Result<Stream, String>> = std::thread::scope(|sc| {
            let handles: Vec<_> = (0..clients)
                .map(|i| {
                    let prompt =
                        format!("Run {clients}, reader {i}: {}", words(text, 997 * i, plan.prompt_words));
                    sc.spawn(move || stream(server.port, &prompt, plan.output_tokens))
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap_or_else(|_| Err("client panicked".into()))).collect()
        });
        let wall = start.elapsed().as_secs_f64();
        let results: Vec<Stream> = results.into_iter().collect::<Result<_, _>>()?;
        let generated: usize = results.iter().map(|s| s.completion_tokens).sum();
        let mut ttft: Vec<f64> = results
            .iter()
            .filter_map(|s| s.pieces.first().map(|t| t.duration_since(s.sent).as_secs_f64()))
            .collect();
        let mut itl: Vec<f64> = results
            .iter()
            .flat_map(|s| s.pieces.windows(2).map(|w| w[1].duration_since(w[0]).as_secs_f64() * 1e3))
            .collect();
        let prompt_tokens = results.iter().map(|s| s.prompt_tokens).max().unwrap_or(0);
        let agg = generated as f64 / wall;
        let (t50, t99) = (percentile(&mut ttft, 0.5), percentile(&mut ttft, 0.99));
        let (i50, i99) = (percentile(&mut itl, 0.5), percentile(&mut itl, 0.99));
        eprintln!("xtask: {} {clients} clients: {agg:.1} tokens/s, TTFT p50 {t50:.2} s", server.name);
        rows.push(format!(
            "| {} | {clients} clients, prompts of ~{prompt_tokens} tokens, {} out | {agg:.1} tokens/s | {t50:.2} / {t99:.2} s | {i50:.0} / {i99:.0} ms |",
            server.name, plan.output_tokens
        ));
    }
    Ok(Measured { rows, floors })
}

/// The report's header and the KV-size lines.
pub fn report(plan: &Plan, m: &Measured, servers: &[(String, f64)], machine: &str) -> String {
    let rows = &m.rows;
    let mut out = format!(
        "# serve-bench\n\nModel {}, {} threads, {machine}. Greedy, `ignore_eos`, streamed.\n\n\
         | server | load | generated | TTFT p50 / p99 | inter-token p50 / p99 |\n|---|---|---|---|---|\n",
        plan.model.display(),
        plan.threads
    );
    for r in rows {
        out += r;
        out.push('\n');
    }
    out += "\n| server | KV bits per value |\n|---|---|\n";
    for (name, bits) in servers {
        out += &format!("| {name} | {bits:.2} |\n");
    }
    if !m.floors.is_empty() {
        out += &format!(
            "\nDecode against its memory floor: the model file and the cache at that depth read once \
             per step at one thread's read rate, {:.1} GB/s in this run.\n\n\
             | server | depth | a step | floor | x floor |\n|---|---|---|---|---|\n",
            plan.read_gbs
        );
        for f in &m.floors {
            out += f;
            out.push('\n');
        }
    }
    out
}

fn metric(port: u16, name: &str) -> Result<f64, String> {
    let mut r = agent().get(&format!("http://127.0.0.1:{port}/metrics")).call().map_err(|e| e.to_string())?;
    let text = r.body_mut().read_to_string().map_err(|e| e.to_string())?;
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .ok_or_else(|| format!("no {name} in the metrics of port {port}"))
}

/// Time to the first token of `prompt` (one token asked for), and its prompt tokens.
fn first_token(port: u16, prompt: &str) -> Result<(f64, usize), String> {
    let s = stream(port, prompt, 1)?;
    let t = s.pieces.first().map_or(f64::NAN, |p| p.duration_since(s.sent).as_secs_f64());
    Ok((t, s.prompt_tokens))
}

/// `--prefix-store URL`: two kvq-serve processes (`a`, `b`) on one store. For each prefix
/// length L, A answers a prompt of about L tokens cold (it prefills everything) and writes its
/// blocks; B answers the same prompt from the store, then again from its own prefix cache.
/// Times to first token, and the bytes A wrote per stored token against an f16 store of the
/// same tokens.
pub fn store(
    a: &Server,
    b: &Server,
    url: &str,
    prefixes: &[usize],
    text: &str,
) -> Result<Vec<String>, String> {
    let mut rows = Vec::new();
    for &len in prefixes {
        let written = metric(a.port, "kvq_store_bytes_written_total")?;
        let prefixes_before = metric(a.port, "kvq_store_prefixes_written_total")?;
        let mut n_words = len * 10 / 13;
        let (prompt, (cold, tokens)) = loop {
            let prompt = words(text, 53 * len, n_words);
            match first_token(a.port, &prompt) {
                Err(e) if e.contains("400") && n_words > len / 2 => n_words -= n_words / 25,
                other => break (prompt, other?),
            }
        };
        // A's writer: done once the prefix's head (written after its blocks) is in.
        let deadline = Instant::now() + Duration::from_secs(120);
        while metric(a.port, "kvq_store_prefixes_written_total")? <= prefixes_before {
            if Instant::now() > deadline {
                return Err(format!("A wrote nothing to {url} for the {tokens}-token prompt"));
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        let stored_bytes = metric(a.port, "kvq_store_bytes_written_total")? - written;
        let reused = metric(b.port, "kvq_store_tokens_reused_total")?;
        let (from_store, _) = first_token(b.port, &prompt)?;
        let stored_tokens = metric(b.port, "kvq_store_tokens_reused_total")? - reused;
        if stored_tokens == 0.0 {
            return Err(format!("B read nothing from {url} for the {tokens}-token prompt"));
        }
        let own = metric(b.port, "kvq_prefix_hits_total")?;
        let (from_own, _) = first_token(b.port, &prompt)?;
        if metric(b.port, "kvq_prefix_hits_total")? <= own {
            return Err(format!("B's own prefix cache missed the {tokens}-token prompt"));
        }
        let f16_per_token = 2.0 * metric(a.port, "kvq_cache_values_per_token")?;
        let per_token = stored_bytes / stored_tokens;
        eprintln!(
            "xtask: {url}, {tokens} tokens: cold {cold:.3} s, from the store {from_store:.3} s, own cache {from_own:.3} s; {per_token:.0} bytes/token"
        );
        rows.push(format!(
            "| {url} | {tokens} ({stored_tokens} stored) | {cold:.3} s | {from_store:.3} s ({:.0}x) | {from_own:.3} s | {per_token:.0} B ({:.2}x f16's {f16_per_token:.0} B) |",
            cold / from_store,
            per_token / f16_per_token
        ));
    }
    Ok(rows)
}
