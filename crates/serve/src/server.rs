//! The HTTP side: routes, limits, streaming, and the start-up that loads the model and starts
//! the engine thread.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use futures_util::stream::{self, Stream};
use kvq::attention::ScorePath;
use kvq::cache::KvCacheConfig;
use kvq_candle::{GgufTokenizer, LlamaModel, Weights};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use crate::api::{
    self, ApiError, CHAT_FIELDS, COMPLETION_FIELDS, ChatRequest, Checked, CompletionRequest, Prompt, Usage,
};
use crate::chat::ChatTemplate;
use crate::engine::{Admission, Engine, EngineConfig, Event, FinishReason, Prefill, Request, Stats};
use crate::prefix::{self, Geometry};
use crate::store::{Fetched, PrefixStore};

/// What the server is started with.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// The GGUF model.
    pub model: PathBuf,
    /// The model's id in the API (default: the file's stem).
    pub model_id: Option<String>,
    /// A cache config (TOML, as `kvq recommend` writes it); kvq's defaults when `None`.
    pub cache_config: Option<PathBuf>,
    /// K/V specs (`int4-channel-p8/int4-token-p8`), instead of a config file.
    pub specs: Option<String>,
    /// The pool's size in bytes (whole blocks of every layer are taken from it).
    pub pool_bytes: usize,
    /// Requests decoded together at most.
    pub max_running: usize,
    /// Prompt tokens prefilled per step.
    pub prefill_budget: usize,
    /// Requests in flight at most (running, waiting, or being answered); more get a 429.
    pub max_requests: usize,
    /// Largest request body in bytes.
    pub max_body: usize,
    /// Longest sequence served (0: the model's context length).
    pub context: usize,
    /// Weights as stored, or dequantized to f32.
    pub weights: Weights,
    /// The cache's attention path.
    pub path: ScorePath,
    /// Prefix snapshots kept at most (0 turns prefix caching off).
    pub prefix_entries: usize,
    /// How much of a request's length admission reserves.
    pub admission: Admission,
    /// How prompt chunks attend.
    pub prefill: Prefill,
    /// Threads of the engine's own rayon pool (the matrix products and the attention), the
    /// engine's thread among them.
    pub threads: usize,
    /// A block store shared with other processes ([`crate::store::open`]'s URL; empty: the
    /// default directory), or none.
    pub prefix_store: Option<String>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            model: PathBuf::from("target/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
            model_id: None,
            cache_config: None,
            specs: None,
            pool_bytes: 1 << 30,
            max_running: 16,
            prefill_budget: 512,
            max_requests: 64,
            max_body: 4 << 20,
            context: 0,
            weights: Weights::Native,
            path: ScorePath::Int8,
            prefix_entries: 64,
            threads: 2,
            admission: Admission::Optimistic,
            prefill: Prefill::Exact,
            prefix_store: None,
        }
    }
}

/// The state every handler shares.
struct App {
    tx: std::sync::Mutex<std::sync::mpsc::Sender<Request>>,
    stats: Arc<Stats>,
    tokenizer: Arc<GgufTokenizer>,
    chat: ChatTemplate,
    model_id: String,
    context: usize,
    created: u64,
    max_requests: usize,
    in_flight: AtomicUsize,
    refused: AtomicU64,
    requests: AtomicU64,
    bits_per_value: f64,
    values_per_token: usize,
    pool_bytes: usize,
    next_id: AtomicU64,
    store: Option<Arc<PrefixStore>>,
    /// The engine's prefix snapshots: the store is asked only for longer prefixes.
    local_keys: prefix::HeldKeys,
}

/// A server ready to be bound: the model loaded, the engine thread running.
pub struct Server {
    app: Arc<App>,
    max_body: usize,
}

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

impl Server {
    /// Loads the model and the cache config, and starts the engine thread.
    ///
    /// # Errors
    /// A message for the operator: the model, the config or the specs refused.
    pub fn start(config: &ServerConfig) -> Result<Self, String> {
        let model = LlamaModel::load_with(&config.model, config.weights).map_err(|e| e.to_string())?;
        let tokenizer = GgufTokenizer::load(&config.model).map_err(|e| e.to_string())?;
        let mc = model.config().clone();
        let mut cache = match (&config.cache_config, &config.specs) {
            (Some(_), Some(_)) => return Err("give a cache config or --specs, not both".into()),
            (Some(path), None) => {
                let c = KvCacheConfig::load(path).map_err(|e| format!("{}: {e}", path.display()))?;
                mc.check_cache(&c).map_err(|e| e.to_string())?;
                c
            }
            (None, specs) => {
                let mut builder = mc.cache_builder();
                if let Some(specs) = specs {
                    let (k, v) = specs.split_once('/').unwrap_or((specs, specs));
                    let k = k.parse().map_err(|e| format!("--specs {specs}: {e}"))?;
                    let v = v.parse().map_err(|e| format!("--specs {specs}: {e}"))?;
                    builder = builder.specs(k, v);
                }
                builder.blocks_per_layer(1).build().map_err(|e| e.to_string())?
            }
        };
        // The pool: as many blocks per layer as the budget holds.
        cache.blocks_per_layer = 1;
        let block_bytes = kvq::cache::QuantizedKvCache::new(cache.clone())
            .map_err(|e| e.to_string())?
            .memory()
            .iter()
            .map(|m| m.block_bytes)
            .sum::<usize>()
            .max(1);
        let blocks = config.pool_bytes / block_bytes;
        if blocks == 0 {
            return Err(format!(
                "a pool of {} bytes holds no block of every layer ({block_bytes} bytes)",
                config.pool_bytes
            ));
        }
        cache.blocks_per_layer = blocks;
        let context = match (config.context, mc.context_length) {
            (0, 0) => 4096,
            (0, c) => c,
            (c, _) => c,
        };
        let eos =
            tokenizer.end_of_generation().first().and_then(|&t| tokenizer.token_text(t)).unwrap_or_default();
        let bos = tokenizer.bos().and_then(|t| tokenizer.token_text(t)).unwrap_or_default();
        let chat = ChatTemplate::new(tokenizer.chat_template(), bos, eos)?;
        let stats = Arc::new(Stats::default());
        let tokenizer = Arc::new(tokenizer);
        let bits_per_value = cache.bits_per_value();
        let values_per_token = 2 * mc.layers * mc.kv_heads * mc.head_dim;
        let model_fingerprint = fingerprint(&config.model)?;
        let store = match &config.prefix_store {
            None => None,
            Some(url) => {
                let backend = crate::store::open(url).map_err(|e| e.to_string())?;
                let geometry = Geometry { sinks: cache.sink_tokens, block: cache.block_size };
                let root = prefix::cache_root(&model_fingerprint, &cache);
                let store = PrefixStore::new(backend, geometry, root)?;
                eprintln!("kvq-serve: prefix store {}", store.describe());
                Some(Arc::new(store))
            }
        };
        let engine = Engine::new(
            Arc::new(model),
            Arc::clone(&tokenizer),
            cache,
            EngineConfig {
                max_running: config.max_running,
                prefill_budget: config.prefill_budget,
                path: config.path,
                context,
                prefix_entries: config.prefix_entries,
                admission: config.admission,
                prefill: config.prefill,
                model_fingerprint,
                store: store.clone(),
            },
            Arc::clone(&stats),
        )?;
        let local_keys = engine.prefix_keys();
        let (tx, rx) = std::sync::mpsc::channel();
        // The engine runs on a worker of its own pool: its parallel calls then go to that
        // worker's queue, where rayon allocates nothing (a thread outside the pool pushes them
        // into the pool's injector, which allocates a block every 63 calls).
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads.max(1))
            .thread_name(|i| format!("kvq-engine-{i}"))
            .build()
            .map_err(|e| format!("the engine's threads: {e}"))?;
        std::thread::Builder::new()
            .name("kvq-engine".into())
            .spawn(move || pool.install(|| engine.run(rx)))
            .map_err(|e| format!("the engine thread: {e}"))?;
        let model_id = config.model_id.clone().unwrap_or_else(|| {
            config.model.file_stem().map_or_else(|| "model".into(), |s| s.to_string_lossy().into_owned())
        });
        let app = App {
            tx: std::sync::Mutex::new(tx),
            stats,
            tokenizer,
            chat,
            model_id,
            context,
            created: now(),
            max_requests: config.max_requests.max(1),
            in_flight: AtomicUsize::new(0),
            refused: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            bits_per_value,
            values_per_token,
            pool_bytes: blocks * block_bytes,
            next_id: AtomicU64::new(1),
            store,
            local_keys,
        };
        Ok(Self { app: Arc::new(app), max_body: config.max_body })
    }

    /// The routes.
    pub fn router(&self) -> Router {
        Router::new()
            .route("/health", get(health))
            .route("/v1/models", get(models))
            .route("/metrics", get(metrics))
            .route("/v1/completions", post(completions))
            .route("/v1/chat/completions", post(chat_completions))
            .fallback(not_found)
            .layer(DefaultBodyLimit::max(self.max_body))
            .with_state(Arc::clone(&self.app))
    }

    /// Serves on `listener` until `shutdown` resolves.
    ///
    /// # Errors
    /// The listener's.
    pub async fn serve(
        self,
        listener: tokio::net::TcpListener,
        shutdown: impl std::future::Future<Output = ()> + Send + 'static,
    ) -> std::io::Result<()> {
        axum::serve(listener, self.router()).with_graceful_shutdown(shutdown).await
    }
}

/// What identifies a model file for prefix keys, in this process and in every process sharing
/// a prefix store: its length, a CRC-32 of all of it (tensor data included: a model whose
/// weights differ keys differently), and its first and last MiB (header, metadata and the
/// ends of the tensor data). Reading the file once costs what loading it does.
fn fingerprint(path: &std::path::Path) -> Result<Vec<u8>, String> {
    use std::io::{Read, Seek, SeekFrom};
    let err = |e: std::io::Error| format!("{}: {e}", path.display());
    let mut f = std::fs::File::open(path).map_err(err)?;
    let len = f.metadata().map_err(err)?.len();
    let mut crc = crc32fast::Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf).map_err(err)?;
        if n == 0 {
            break;
        }
        crc.update(&buf[..n]);
    }
    let mut out = len.to_le_bytes().to_vec();
    out.extend_from_slice(&crc.finalize().to_le_bytes());
    f.seek(SeekFrom::Start(0)).map_err(err)?;
    let mut head = Vec::new();
    (&mut f).take(1 << 20).read_to_end(&mut head).map_err(err)?;
    f.seek(SeekFrom::Start(len.saturating_sub(1 << 20))).map_err(err)?;
    let mut tail = Vec::new();
    f.take(1 << 20).read_to_end(&mut tail).map_err(err)?;
    out.extend(head);
    out.extend(tail);
    Ok(out)
}

/// Binds `addr` and serves until Ctrl-C; prints the address it listens on.
///
/// # Errors
/// A message: the model, the config, or the address refused.
pub fn run(config: &ServerConfig, addr: SocketAddr, threads: usize) -> Result<(), String> {
    let server = Server::start(config)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.clamp(1, 4))
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.map_err(|e| format!("{addr}: {e}"))?;
        let local = listener.local_addr().map_err(|e| e.to_string())?;
        eprintln!("kvq-serve: {} on http://{local}", server.app.model_id);
        let shutdown = async {
            let _ = tokio::signal::ctrl_c().await;
        };
        server.serve(listener, shutdown).await.map_err(|e| e.to_string())
    })
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut r = (status, axum::Json(self.body())).into_response();
        if self.status == 429 {
            r.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

async fn not_found() -> ApiError {
    ApiError { status: 404, kind: "not_found_error", param: None, message: "no such route".into() }
}

async fn health() -> Response {
    axum::Json(json!({ "status": "ok" })).into_response()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    axum::Json(json!({
        "object": "list",
        "data": [{ "id": app.model_id, "object": "model", "created": app.created, "owned_by": "kvq" }],
    }))
    .into_response()
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    let s = &app.stats;
    let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
    let busy = s.busy_seconds();
    let generated = g(&s.generated_tokens);
    let rows: Vec<(&str, &str, &str, String)> = vec![
        ("kvq_requests_total", "counter", "HTTP generation requests received", g(&app.requests).to_string()),
        (
            "kvq_requests_refused_total",
            "counter",
            "Requests refused with 429 (too many in flight)",
            g(&app.refused).to_string(),
        ),
        (
            "kvq_requests_admitted_total",
            "counter",
            "Requests admitted to the engine",
            g(&s.admitted).to_string(),
        ),
        (
            "kvq_requests_finished_total",
            "counter",
            "Requests the engine finished",
            g(&s.finished).to_string(),
        ),
        (
            "kvq_requests_cancelled_total",
            "counter",
            "Requests dropped because their client went away",
            g(&s.cancelled).to_string(),
        ),
        ("kvq_sequences_running", "gauge", "Sequences being decoded or prefilled", g(&s.running).to_string()),
        ("kvq_sequences_waiting", "gauge", "Requests waiting for admission", g(&s.waiting).to_string()),
        (
            "kvq_sequences_preempted",
            "gauge",
            "Requests preempted, their sequences in host memory",
            g(&s.preempted).to_string(),
        ),
        (
            "kvq_preemptions_total",
            "counter",
            "Requests preempted for lack of blocks",
            g(&s.preemptions).to_string(),
        ),
        ("kvq_prompt_tokens_total", "counter", "Prompt tokens prefilled", g(&s.prompt_tokens).to_string()),
        ("kvq_generated_tokens_total", "counter", "Tokens generated", generated.to_string()),
        ("kvq_busy_seconds_total", "counter", "Seconds the engine spent in steps", format!("{busy:.6}")),
        (
            "kvq_pool_blocks_used",
            "gauge",
            "Cache pool blocks in use, all layers",
            g(&s.blocks_used).to_string(),
        ),
        (
            "kvq_pool_blocks_free",
            "gauge",
            "Cache pool blocks free, all layers",
            g(&s.blocks_free).to_string(),
        ),
        ("kvq_pool_bytes", "gauge", "Bytes of the cache pool", app.pool_bytes.to_string()),
        (
            "kvq_cache_bytes",
            "gauge",
            "Bytes the cache holds (codes, parameters, windows, tables)",
            g(&s.cache_bytes).to_string(),
        ),
        ("kvq_cached_tokens", "gauge", "Tokens the running sequences hold", g(&s.cached_tokens).to_string()),
        (
            "kvq_prefix_hits_total",
            "counter",
            "Requests admitted on a cached prefix",
            g(&s.prefix_hits).to_string(),
        ),
        (
            "kvq_prefix_misses_total",
            "counter",
            "Requests admitted without one",
            g(&s.prefix_misses).to_string(),
        ),
        (
            "kvq_prefix_tokens_reused_total",
            "counter",
            "Prompt tokens not prefilled thanks to the prefix cache",
            g(&s.prefix_tokens_reused).to_string(),
        ),
        ("kvq_prefix_entries", "gauge", "Prefix snapshots held", g(&s.prefix_entries).to_string()),
    ];
    let mut rows = rows;
    if let Some(store) = &app.store {
        let t = store.stats();
        rows.extend([
            (
                "kvq_store_hits_total",
                "counter",
                "Requests admitted on a prefix read from the shared store",
                g(&t.hits).to_string(),
            ),
            (
                "kvq_store_misses_total",
                "counter",
                "Prompts of which the shared store held no prefix",
                g(&t.misses).to_string(),
            ),
            (
                "kvq_store_tokens_reused_total",
                "counter",
                "Prompt tokens not prefilled thanks to the shared store",
                g(&t.tokens_reused).to_string(),
            ),
            (
                "kvq_store_bytes_read_total",
                "counter",
                "Bytes of entries read from the shared store",
                g(&t.bytes_read).to_string(),
            ),
            (
                "kvq_store_bytes_written_total",
                "counter",
                "Bytes of entries written to the shared store",
                g(&t.bytes_written).to_string(),
            ),
            (
                "kvq_store_prefixes_written_total",
                "counter",
                "Prefixes written whole to the shared store (head after blocks): readable by others",
                g(&t.prefixes_written).to_string(),
            ),
            (
                "kvq_store_errors_total",
                "counter",
                "Shared store calls that failed (unreachable, I/O) and writes dropped",
                g(&t.errors).to_string(),
            ),
            (
                "kvq_store_refused_total",
                "counter",
                "Shared store entries refused (checksum, header, tokens) and recomputed",
                g(&t.refused).to_string(),
            ),
        ]);
    }
    rows.extend([
        (
            "kvq_cache_bits_per_value",
            "gauge",
            "Bits per cached key or value of the config",
            format!("{:.4}", app.bits_per_value),
        ),
        (
            "kvq_cache_values_per_token",
            "gauge",
            "Keys and values cached per token (layers x KV heads x head dim x 2)",
            app.values_per_token.to_string(),
        ),
    ]);
    let mut text = String::new();
    for (name, kind, help, value) in rows {
        text += &format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {value}\n");
    }
    let tps = if busy > 0.0 { generated as f64 / busy } else { 0.0 };
    text += &format!(
        "# HELP kvq_tokens_per_second Generated tokens per busy second\n# TYPE kvq_tokens_per_second gauge\nkvq_tokens_per_second {tps:.3}\n"
    );
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// Holds one of the in-flight slots; released when the response is done (the stream ends).
struct Slot(Arc<App>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

fn take_slot(app: &Arc<App>) -> Result<Slot, ApiError> {
    app.requests.fetch_add(1, Ordering::Relaxed);
    if app.in_flight.fetch_add(1, Ordering::Relaxed) >= app.max_requests {
        app.in_flight.fetch_sub(1, Ordering::Relaxed);
        app.refused.fetch_add(1, Ordering::Relaxed);
        return Err(ApiError {
            status: 429,
            kind: "rate_limit_error",
            param: None,
            message: format!("{} requests are in flight; try again shortly", app.max_requests),
        });
    }
    Ok(Slot(Arc::clone(app)))
}

fn body_bytes(body: Result<Bytes, BytesRejection>) -> Result<Bytes, ApiError> {
    body.map_err(|e| {
        let status = e.status().as_u16();
        ApiError { status: if status == 413 { 413 } else { 400 }, ..ApiError::bad_body(e.body_text()) }
    })
}

/// A request ready for the engine, and how to answer it.
struct Job {
    prompt: Vec<u32>,
    checked: Checked,
    max_tokens: usize,
}

fn job(app: &App, prompt: Vec<u32>, checked: Checked, default_max: Option<usize>) -> Result<Job, ApiError> {
    if prompt.is_empty() {
        return Err(ApiError::invalid("prompt", "the prompt has no tokens"));
    }
    if prompt.len() >= app.context {
        return Err(ApiError::invalid(
            "prompt",
            format!("the prompt has {} tokens; the context is {}", prompt.len(), app.context),
        ));
    }
    let room = app.context - prompt.len();
    let max_tokens = match checked.max_tokens {
        Some(n) if n > room => {
            return Err(ApiError::invalid(
                "max_tokens",
                format!(
                    "{} prompt tokens and max_tokens {n} exceed the context of {}",
                    prompt.len(),
                    app.context
                ),
            ));
        }
        Some(n) => n,
        None => default_max.unwrap_or(room).min(room),
    };
    Ok(Job { prompt, checked, max_tokens })
}

fn fresh_seed(app: &App) -> u64 {
    let t = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
    t ^ app.next_id.fetch_add(1, Ordering::Relaxed).wrapping_mul(0x9E37_79B9_7F4A_7C15)
}

fn submit(app: &App, job: &Job, stored: Option<Fetched>) -> Result<mpsc::UnboundedReceiver<Event>, ApiError> {
    let (tx, rx) = mpsc::unbounded_channel();
    let req = Request {
        stored,
        prompt: job.prompt.clone(),
        max_tokens: job.max_tokens,
        sampling: job.checked.sampling.clone(),
        stop: job.checked.stop.clone(),
        ignore_eos: job.checked.ignore_eos,
        events: tx,
    };
    let sent = app.tx.lock().map(|tx| tx.send(req).is_ok()).unwrap_or(false);
    if !sent {
        return Err(ApiError {
            status: 503,
            kind: "server_error",
            param: None,
            message: "the engine has stopped".into(),
        });
    }
    Ok(rx)
}

/// The two endpoints' shapes of one answer.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Completion,
    Chat,
}

async fn completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    handle(app, body, Kind::Completion, prepare_completion).await
}

async fn chat_completions(State(app): State<Arc<App>>, body: Result<Bytes, BytesRejection>) -> Response {
    handle(app, body, Kind::Chat, prepare_chat).await
}

/// Takes an in-flight slot, turns the body into a job with `prepare`, and answers.
async fn handle(
    app: Arc<App>,
    body: Result<Bytes, BytesRejection>,
    kind: Kind,
    prepare: fn(&App, &[u8]) -> Result<Job, ApiError>,
) -> Response {
    let slot = match take_slot(&app) {
        Ok(s) => s,
        Err(e) => return e.into_response(),
    };
    let prepared = body_bytes(body).and_then(|b| prepare(&app, &b));
    answer(app, slot, prepared, kind).await
}

fn prepare_completion(app: &App, body: &[u8]) -> Result<Job, ApiError> {
    let req: CompletionRequest = api::parse(body, COMPLETION_FIELDS)?;
    req.check_extra()?;
    let checked = req.common.check(&app.model_id, fresh_seed(app))?;
    let vocab = app.tokenizer.inner().get_vocab_size(true);
    let prompt = match &req.prompt {
        Prompt::Text(t) => encode(app, t, true)?,
        Prompt::Texts(v) if v.len() == 1 => encode(app, &v[0], true)?,
        Prompt::Texts(_) => return Err(ApiError::invalid("prompt", "exactly one prompt is served")),
        Prompt::Tokens(ids) => ids
            .iter()
            .map(|&t| {
                u32::try_from(t).ok().filter(|&t| (t as usize) < vocab).ok_or_else(|| {
                    ApiError::invalid("prompt", format!("token {t} is outside the vocabulary"))
                })
            })
            .collect::<Result<Vec<_>, _>>()?,
    };
    // OpenAI's default for completions.
    job(app, prompt, checked, Some(16))
}

fn prepare_chat(app: &App, body: &[u8]) -> Result<Job, ApiError> {
    let mut req: ChatRequest = api::parse(body, CHAT_FIELDS)?;
    if let Some(n) = req.max_completion_tokens {
        req.common.max_tokens = Some(n);
    }
    let checked = req.common.check(&app.model_id, fresh_seed(app))?;
    let messages = req.messages()?;
    let text = app.chat.render(&messages).map_err(|m| ApiError::invalid("messages", m))?;
    let prompt = encode(app, &text, false)?;
    job(app, prompt, checked, None)
}

/// Tokens of a text; `bos` adds the model's BOS where its tokenizer does.
fn encode(app: &App, text: &str, bos: bool) -> Result<Vec<u32>, ApiError> {
    // A byte of text is at most one token: refuse what cannot fit before tokenizing it.
    if text.len() > app.context.saturating_mul(64) {
        return Err(ApiError::invalid(
            "prompt",
            format!("a prompt of {} bytes is far beyond the context", text.len()),
        ));
    }
    let r = if bos { app.tokenizer.encode(text) } else { app.tokenizer.encode_raw(text) };
    r.map_err(|e| ApiError::invalid("prompt", e.to_string()))
}

async fn answer(app: Arc<App>, slot: Slot, prepared: Result<Job, ApiError>, kind: Kind) -> Response {
    let job = match prepared {
        Ok(j) => j,
        Err(e) => return e.into_response(),
    };
    // The shared store is read here, off the engine's thread, while other requests decode.
    let stored = match app.store.clone() {
        Some(store) => {
            let prompt = job.prompt.clone();
            let keys = Arc::clone(&app.local_keys);
            tokio::task::spawn_blocking(move || {
                // Not for what the process's own snapshots already hold.
                let beyond =
                    store.held_end(&prompt, &keys.read().unwrap_or_else(std::sync::PoisonError::into_inner));
                store.lookup_beyond(&prompt, beyond)
            })
            .await
            .ok()
            .flatten()
        }
        None => None,
    };
    let mut rx = match submit(&app, &job, stored) {
        Ok(rx) => rx,
        Err(e) => return e.into_response(),
    };
    let id = format!(
        "{}-{}",
        if kind == Kind::Chat { "chatcmpl" } else { "cmpl" },
        app.next_id.fetch_add(1, Ordering::Relaxed)
    );
    let created = now();
    if job.checked.stream {
        return stream_answer(app, slot, rx, kind, id, created, job.checked.include_usage).into_response();
    }
    let mut text = String::new();
    loop {
        match rx.recv().await {
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Done { reason, prompt_tokens, completion_tokens }) => {
                let usage = Usage::new(prompt_tokens, completion_tokens);
                let choice = match kind {
                    Kind::Completion => {
                        json!({ "index": 0, "text": text, "finish_reason": reason.as_str(), "logprobs": Value::Null })
                    }
                    Kind::Chat => json!({
                        "index": 0,
                        "message": { "role": "assistant", "content": text },
                        "finish_reason": reason.as_str(),
                        "logprobs": Value::Null,
                    }),
                };
                let object = if kind == Kind::Chat { "chat.completion" } else { "text_completion" };
                drop(slot);
                return axum::Json(json!({
                    "id": id, "object": object, "created": created, "model": app.model_id,
                    "choices": [choice], "usage": usage,
                }))
                .into_response();
            }
            Some(Event::Error(message)) => {
                return ApiError { status: 400, kind: "invalid_request_error", param: None, message }
                    .into_response();
            }
            None => {
                return ApiError {
                    status: 500,
                    kind: "server_error",
                    param: None,
                    message: "the engine stopped".into(),
                }
                .into_response();
            }
        }
    }
}

fn chunk(
    app: &App,
    kind: Kind,
    id: &str,
    created: u64,
    text: Option<&str>,
    first: bool,
    reason: Option<FinishReason>,
) -> Value {
    let reason = reason.map(FinishReason::as_str);
    match kind {
        Kind::Completion => json!({
            "id": id, "object": "text_completion", "created": created, "model": app.model_id,
            "choices": [{ "index": 0, "text": text.unwrap_or(""), "finish_reason": reason, "logprobs": Value::Null }],
        }),
        Kind::Chat => {
            let mut delta = serde_json::Map::new();
            if first {
                delta.insert("role".into(), "assistant".into());
            }
            if let Some(t) = text {
                delta.insert("content".into(), t.into());
            }
            json!({
                "id": id, "object": "chat.completion.chunk", "created": created, "model": app.model_id,
                "choices": [{ "index": 0, "delta": delta, "finish_reason": reason, "logprobs": Value::Null }],
            })
        }
    }
}

struct StreamState {
    app: Arc<App>,
    _slot: Slot,
    rx: mpsc::UnboundedReceiver<Event>,
    kind: Kind,
    id: String,
    created: u64,
    include_usage: bool,
    first: bool,
    pending: std::collections::VecDeque<SseEvent>,
    ended: bool,
}

fn stream_answer(
    app: Arc<App>,
    slot: Slot,
    rx: mpsc::UnboundedReceiver<Event>,
    kind: Kind,
    id: String,
    created: u64,
    include_usage: bool,
) -> Sse<impl Stream<Item = Result<SseEvent, Infallible>>> {
    let state = StreamState {
        app,
        _slot: slot,
        rx,
        kind,
        id,
        created,
        include_usage,
        first: true,
        pending: Default::default(),
        ended: false,
    };
    let data = |v: Value| SseEvent::default().data(v.to_string());
    let s = stream::unfold(state, move |mut st| async move {
        loop {
            if let Some(e) = st.pending.pop_front() {
                return Some((Ok(e), st));
            }
            if st.ended {
                return None;
            }
            match st.rx.recv().await {
                Some(Event::Text(t)) => {
                    let c = chunk(&st.app, st.kind, &st.id, st.created, Some(&t), st.first, None);
                    st.first = false;
                    st.pending.push_back(data(c));
                }
                Some(Event::Done { reason, prompt_tokens, completion_tokens }) => {
                    let c = chunk(&st.app, st.kind, &st.id, st.created, None, st.first, Some(reason));
                    st.pending.push_back(data(c));
                    if st.include_usage {
                        let object =
                            if st.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                        st.pending.push_back(data(json!({
                            "id": st.id, "object": object, "created": st.created, "model": st.app.model_id,
                            "choices": [], "usage": Usage::new(prompt_tokens, completion_tokens),
                        })));
                    }
                    st.pending.push_back(SseEvent::default().data("[DONE]"));
                    st.ended = true;
                }
                Some(Event::Error(message)) => {
                    let e = ApiError { status: 400, kind: "invalid_request_error", param: None, message };
                    st.pending.push_back(data(e.body()));
                    st.ended = true;
                }
                None => st.ended = true,
            }
        }
    });
    Sse::new(s)
}
