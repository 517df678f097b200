//! What the server's tests share: the tiny model, a server on loopback, an HTTP client.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use kvq_serve::server::{Server, ServerConfig};
use serde_json::{Value, json};

pub fn tiny_model() -> PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvq-serve-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("tiny.gguf");
        kvq_candle::tiny::TinyModel::default().write(&path).unwrap();
        path
    })
    .clone()
}

pub fn config() -> ServerConfig {
    ServerConfig {
        model: tiny_model(),
        model_id: Some("tiny".into()),
        pool_bytes: 8 << 20,
        context: 512,
        ..ServerConfig::default()
    }
}

/// Starts a server on a free loopback port; it stops when the test process ends.
pub fn start(config: ServerConfig) -> SocketAddr {
    let server = Server::start(&config).unwrap();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    listener.set_nonblocking(true).unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            server.serve(listener, std::future::pending()).await.unwrap();
        });
    });
    addr
}

pub fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(120)))
        .build()
        .into()
}

/// POSTs `body` (raw text); returns the status, the Retry-After header and the body.
pub fn post_raw(addr: SocketAddr, path: &str, body: &str) -> (u16, Option<String>, String) {
    let mut r = agent()
        .post(&format!("http://{addr}{path}"))
        .header("content-type", "application/json")
        .send(body)
        .unwrap();
    let retry = r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_string());
    (r.status().as_u16(), retry, r.body_mut().with_config().limit(64 << 20).read_to_string().unwrap())
}

pub fn post(addr: SocketAddr, path: &str, body: Value) -> (u16, Value) {
    let (status, _, text) = post_raw(addr, path, &body.to_string());
    (status, serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")))
}

pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    let mut r = agent().get(&format!("http://{addr}{path}")).call().unwrap();
    (r.status().as_u16(), r.body_mut().read_to_string().unwrap())
}

pub fn text(v: &Value) -> String {
    v["choices"][0]["text"].as_str().unwrap().to_string()
}

pub fn completion(addr: SocketAddr, prompt: &str, max_tokens: usize) -> Value {
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({ "model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true }),
    );
    assert_eq!(status, 200, "{v}");
    v
}

/// Waits (10 s at most) for a gauge to read `value`: the engine publishes its gauges after
/// each step, a moment after the events of the step reach their clients.
pub fn settles(addr: SocketAddr, name: &str, value: f64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while metric(addr, name) != value {
        assert!(Instant::now() < deadline, "{name} stays at {}, not {value}", metric(addr, name));
        std::thread::sleep(Duration::from_millis(10));
    }
}

pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    let (_, body) = get(addr, "/metrics");
    body.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .unwrap_or_else(|| panic!("{name} in {body}"))
        .parse()
        .unwrap()
}

/// The greedy completion of a prompt of token ids.
pub fn greedy_ids(addr: SocketAddr, prompt: &[u32], max_tokens: usize) -> String {
    let (status, v) = post(
        addr,
        "/v1/completions",
        json!({ "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": true }),
    );
    assert_eq!(status, 200, "{v}");
    text(&v)
}
