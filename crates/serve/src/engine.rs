//! The scheduler: one thread that owns the model and the quantized cache, and runs steps of
//! continuous batching over every admitted request.
//!
//! - Requests wait in arrival order. One is admitted when a running slot is free and the pool
//!   can reserve its blocks ([`QuantizedKvCache::reserve`]): its whole length (prompt plus
//!   `max_tokens`), or under [`Admission::Optimistic`] at least its prompt and a block more. A
//!   request never fails for lack of blocks, whatever the others do; one that the empty pool
//!   could not hold is refused at once.
//! - Each step decodes one token of every running request past its prompt, then spends a
//!   token budget on the prompts still being prefilled, in chunks, oldest first.
//! - A request whose client has gone (its event channel closed) is dropped at the next step
//!   and its blocks return to the pool at once.
//!
//! - A prompt that begins like an earlier one forks that prompt's cached blocks and prefills
//!   only the rest ([`crate::prefix`]); snapshots give their blocks back, least recently used
//!   first, when a request needs them.
//!
//! - A step is one batched forward ([`LlamaModel::step`]): the weights are read once for all
//!   of its tokens, and every token attends as it would alone, so batching changes no output.
//!
//! - With [`Admission::Optimistic`] (the default) a request that does not fit whole is
//!   admitted on its prompt and a block more; when a step finds no block for a request's
//!   tokens, the youngest running request is preempted: its sequence is exported to host
//!   memory (the cache's own bytes) and imported again, before any new admission, once
//!   blocks are free. Its output does not change.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use kvq::attention::ScorePath;
use kvq::cache::SeqId;
use kvq::cache::{KvCacheConfig, QuantizedKvCache};
pub use kvq_candle::model::Prefill;
use kvq_candle::model::{StepOptions, StepSeq, StepWorkspace};
use kvq_candle::{GgufTokenizer, LlamaModel};
use tokio::sync::mpsc::UnboundedSender;

use crate::prefix::{self, Geometry, PrefixCache};
use crate::sampling::{Sampler, SamplingParams};
use crate::store::{Fetched, PrefixStore};
use crate::text::{Detokenizer, StopMatcher};

/// Why a generation ended (OpenAI's `finish_reason`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// `max_tokens`, or the end of the context.
    Length,
}

impl FinishReason {
    /// The API's word for it.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Stop => "stop",
            Self::Length => "length",
        }
    }
}

/// What the engine tells a request's handler.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum Event {
    /// Text to send (never part of a character or of a stop string).
    Text(String),
    /// The end, with the token counts.
    Done {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Generated tokens (an end-of-generation token included).
        completion_tokens: usize,
    },
    /// The request failed (the model or the cache refused it); nothing more follows.
    Error(String),
}

/// One generation request.
#[derive(Debug)]
pub struct Request {
    /// Prompt token ids (not empty).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (at least 1).
    pub max_tokens: usize,
    /// Sampling.
    pub sampling: SamplingParams,
    /// Stop strings.
    pub stop: Vec<String>,
    /// Keep going past end-of-generation tokens (benchmarks).
    pub ignore_eos: bool,
    /// Where events go; a closed channel cancels the request.
    pub events: UnboundedSender<Event>,
    /// A prefix of the prompt read from the shared store, checked, to import instead of
    /// prefilling it (when the process's own prefix cache holds no longer one).
    pub stored: Option<Fetched>,
}

/// The engine's limits.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// Requests decoded together at most.
    pub max_running: usize,
    /// Prompt tokens prefilled per step, over all requests.
    pub prefill_budget: usize,
    /// The attention path of the cache.
    pub path: ScorePath,
    /// Longest sequence (prompt plus output) served.
    pub context: usize,
    /// Prefix snapshots kept at most (0: no prefix caching).
    pub prefix_entries: usize,
    /// The model's fingerprint, part of every prefix key.
    pub model_fingerprint: Vec<u8>,
    /// How much of a request's length admission reserves.
    pub admission: Admission,
    /// How prompt chunks attend ([`Prefill::Exact`]: as decode steps would, which the
    /// prefix cache's exactness relies on).
    pub prefill: Prefill,
    /// The store shared with other processes, written with every prefix the process's own
    /// prefix cache would keep ([`crate::store`]).
    pub store: Option<Arc<PrefixStore>>,
}

/// How much of a request's length its admission reserves in the pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Admission {
    /// The prompt and a block of tokens more when the whole length does not fit, so that
    /// more requests run at once; a request whose next tokens find no block preempts the
    /// youngest running one (its sequence exported to host memory, bytes as the cache
    /// holds them, and imported again when blocks are free): outputs do not change.
    #[default]
    Optimistic,
    /// The whole length (prompt plus `max_tokens`): nothing is ever preempted, and requests
    /// wait for blocks that the running ones may never use.
    Full,
}

/// Counters and gauges for `/metrics`, updated by the engine thread.
#[derive(Debug, Default)]
pub struct Stats {
    /// Requests admitted since the start.
    pub admitted: AtomicU64,
    /// Requests finished (every reason).
    pub finished: AtomicU64,
    /// Requests dropped because their client went away.
    pub cancelled: AtomicU64,
    /// Requests running now.
    pub running: AtomicU64,
    /// Requests waiting now.
    pub waiting: AtomicU64,
    /// Requests preempted now (their sequence in host memory).
    pub preempted: AtomicU64,
    /// Preemptions since the start.
    pub preemptions: AtomicU64,
    /// Prompt tokens prefilled.
    pub prompt_tokens: AtomicU64,
    /// Tokens generated.
    pub generated_tokens: AtomicU64,
    /// Pool blocks in use (all layers).
    pub blocks_used: AtomicU64,
    /// Pool blocks free (all layers).
    pub blocks_free: AtomicU64,
    /// Bytes the cache holds.
    pub cache_bytes: AtomicU64,
    /// Tokens the cache holds (all sequences).
    pub cached_tokens: AtomicU64,
    /// Seconds spent in steps, as f64 bits.
    pub busy_seconds: AtomicU64,
    /// Requests admitted on a prefix snapshot.
    pub prefix_hits: AtomicU64,
    /// Requests admitted without one.
    pub prefix_misses: AtomicU64,
    /// Prompt tokens not prefilled thanks to a snapshot.
    pub prefix_tokens_reused: AtomicU64,
    /// Snapshots held.
    pub prefix_entries: AtomicU64,
}

impl Stats {
    /// Seconds spent in steps.
    pub fn busy_seconds(&self) -> f64 {
        f64::from_bits(self.busy_seconds.load(Ordering::Relaxed))
    }
}

enum Phase {
    /// Prompt tokens prefilled so far.
    Prefill(usize),
    /// The sampled token not yet in the cache.
    Decode(u32),
}

struct Running {
    req: Request,
    /// Admission order: the youngest running request is preempted first.
    admitted_at: u64,
    seq: SeqId,
    phase: Phase,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopMatcher,
    generated: usize,
    /// The prompt length at which a prefix snapshot is taken (prefill chunks stop there).
    cut: Option<usize>,
}

impl Running {
    fn send_text(&self, text: String) {
        if !text.is_empty() {
            let _ = self.req.events.send(Event::Text(text));
        }
    }

    /// Sends the end; `true`, for the step's bookkeeping.
    fn done(&self, reason: FinishReason) -> bool {
        let _ = self.req.events.send(Event::Done {
            reason,
            prompt_tokens: self.req.prompt.len(),
            completion_tokens: self.generated,
        });
        true
    }

    /// Ends the generation for `reason`, first sending what the detokenizer and the stop
    /// matcher still hold (a stop string found in it ends it as a stop).
    fn end(&mut self, tokenizer: &GgufTokenizer, reason: FinishReason) -> Result<bool, String> {
        let owed = self.detok.finish(tokenizer).map_err(|e| e.to_string())?;
        let released = self.stops.push(&owed);
        if released.stopped {
            self.send_text(released.text);
            return Ok(self.done(FinishReason::Stop));
        }
        let held = self.stops.finish();
        self.send_text(released.text + &held);
        Ok(self.done(reason))
    }
}

/// The scheduler and what it owns; [`Engine::run`] is its thread's body.
pub struct Engine {
    model: Arc<LlamaModel>,
    tokenizer: Arc<GgufTokenizer>,
    cache: QuantizedKvCache,
    config: EngineConfig,
    stats: Arc<Stats>,
    waiting: VecDeque<Request>,
    /// Oldest admitted first.
    running: Vec<Running>,
    /// Preempted requests and their sequences' bytes, oldest admitted first.
    preempted: VecDeque<(Running, Vec<u8>)>,
    admissions: u64,
    eog: Vec<u32>,
    prefix: PrefixCache,
    options: StepOptions,
    ws: StepWorkspace,
}

impl Engine {
    /// An engine for `model` with a cache made from `cache`.
    ///
    /// # Errors
    /// The cache config's, or a config made for another model.
    pub fn new(
        model: Arc<LlamaModel>,
        tokenizer: Arc<GgufTokenizer>,
        cache: KvCacheConfig,
        config: EngineConfig,
        stats: Arc<Stats>,
    ) -> Result<Self, String> {
        model.config().check_cache(&cache).map_err(|e| e.to_string())?;
        let geometry = Geometry { sinks: cache.sink_tokens, block: cache.block_size };
        let prefix = PrefixCache::new(
            geometry,
            prefix::cache_root(&config.model_fingerprint, &cache),
            config.prefix_entries,
        );
        let cache = QuantizedKvCache::new(cache).map_err(|e| e.to_string())?;
        let eog = tokenizer.end_of_generation().to_vec();
        let options = StepOptions { prefill: config.prefill, ..StepOptions::with_path(config.path) };
        Ok(Self {
            model,
            tokenizer,
            cache,
            config,
            stats,
            waiting: VecDeque::new(),
            running: Vec::new(),
            preempted: VecDeque::new(),
            admissions: 0,
            eog,
            prefix,
            options,
            ws: StepWorkspace::new(),
        })
    }

    /// The keys of the prefix snapshots this engine holds, kept up to date from its thread.
    pub fn prefix_keys(&self) -> prefix::HeldKeys {
        self.prefix.held_keys()
    }

    /// Serves requests from `rx` until every sender is gone and the work is done.
    pub fn run(mut self, rx: std::sync::mpsc::Receiver<Request>) {
        loop {
            if self.running.is_empty() && self.waiting.is_empty() && self.preempted.is_empty() {
                match rx.recv() {
                    Ok(r) => self.waiting.push_back(r),
                    Err(_) => return,
                }
            }
            while let Ok(r) = rx.try_recv() {
                self.waiting.push_back(r);
            }
            let start = Instant::now();
            self.step();
            let busy = self.stats.busy_seconds() + start.elapsed().as_secs_f64();
            self.stats.busy_seconds.store(busy.to_bits(), Ordering::Relaxed);
            self.publish();
        }
    }

    /// One step: drop cancelled requests, admit, then one batched forward of every running
    /// request's next token and of prompt chunks within the prefill budget.
    pub fn step(&mut self) {
        self.drop_cancelled();
        self.resume();
        if self.preempted.is_empty() {
            self.admit();
        }
        self.secure();
        // (request, tokens, its prompt done after this step) of the step, in running order.
        let mut plan: Vec<(usize, std::ops::Range<usize>)> = Vec::with_capacity(self.running.len());
        let mut budget = self.config.prefill_budget.max(1);
        for (i, r) in self.running.iter().enumerate() {
            match r.phase {
                Phase::Decode(_) => plan.push((i, 0..1)),
                Phase::Prefill(_) if budget == 0 => {}
                Phase::Prefill(done) => {
                    let mut n = (r.req.prompt.len() - done).min(budget);
                    // A chunk stops where the snapshot is taken.
                    if let Some(cut) = r.cut.filter(|&c| c > done) {
                        n = n.min(cut - done);
                    }
                    budget -= n;
                    plan.push((i, done..done + n));
                }
            }
        }
        if plan.is_empty() {
            return;
        }
        let outcome = self.run_step(&plan);
        let outcome = match outcome {
            Ok(logits) => plan.iter().zip(logits).map(|(p, l)| (p.0, Ok(l))).collect(),
            // One request's failure (a value the cache refuses) must not fail the others: the
            // step left the cache as it was, so each request runs again alone.
            Err(_) if plan.len() > 1 => plan
                .iter()
                .map(|p| (p.0, self.run_step(std::slice::from_ref(p)).map(|mut l| l.remove(0))))
                .collect(),
            Err(e) => vec![(plan[0].0, Err(e))],
        };
        let mut finished = Vec::new();
        for (i, result) in outcome {
            let done = result.and_then(|logits| self.advance(i, logits));
            match done {
                Ok(false) => {}
                Ok(true) => finished.push(i),
                Err(e) => {
                    let _ = self.running[i].req.events.send(Event::Error(e));
                    finished.push(i);
                }
            }
        }
        for i in finished.into_iter().rev() {
            self.retire(i);
        }
    }

    /// Runs one batched forward over `plan` (request, the prompt range to prefill, or `0..1`
    /// for a decode token): the logits of each entry that ends its prompt or decodes, `None`
    /// for a prompt chunk that more chunks follow.
    fn run_step(
        &mut self,
        plan: &[(usize, std::ops::Range<usize>)],
    ) -> Result<Vec<Option<Vec<f32>>>, String> {
        let running = &self.running;
        let batch: Vec<StepSeq<'_>> = plan
            .iter()
            .map(|(i, range)| {
                let r = &running[*i];
                match &r.phase {
                    Phase::Decode(tok) => StepSeq::new(r.seq, std::slice::from_ref(tok)),
                    Phase::Prefill(_) => StepSeq {
                        seq: r.seq,
                        tokens: &r.req.prompt[range.clone()],
                        logits: range.end == r.req.prompt.len(),
                    },
                }
            })
            .collect();
        let logits = self
            .model
            .step(&mut self.cache, &batch, &self.options, &mut self.ws)
            .map_err(|e| e.to_string())?;
        let vocab = self.model.config().vocab;
        let mut rows = logits.chunks_exact(vocab);
        Ok(batch.iter().map(|e| if e.logits { rows.next().map(<[f32]>::to_vec) } else { None }).collect())
    }

    /// Moves request `i` past its part of the step: a prompt chunk counted, or a prompt
    /// finished (snapshot kept) or a decode token, sampled from `logits` and sent; `Ok(true)`
    /// when the request is finished.
    fn advance(&mut self, i: usize, logits: Option<Vec<f32>>) -> Result<bool, String> {
        if let Phase::Prefill(done) = self.running[i].phase {
            let len = self.cache.len(self.running[i].seq, 0).map_err(|e| e.to_string())?;
            self.stats.prompt_tokens.fetch_add((len - done) as u64, Ordering::Relaxed);
            if self.running[i].cut == Some(len) {
                self.snapshot(i);
            }
            if logits.is_none() {
                self.running[i].phase = Phase::Prefill(len);
                return Ok(false);
            }
        }
        let Some(last) = logits else { return Err("no logits for a finished prompt".into()) };
        self.sample(i, &last)
    }

    fn drop_cancelled(&mut self) {
        let before = self.waiting.len() + self.preempted.len();
        self.waiting.retain(|r| !r.events.is_closed());
        self.preempted.retain(|(r, _)| !r.req.events.is_closed());
        let mut gone = before - self.waiting.len() - self.preempted.len();
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].req.events.is_closed() {
                self.retire(i);
                gone += 1;
            } else {
                i += 1;
            }
        }
        self.stats.cancelled.fetch_add(gone as u64, Ordering::Relaxed);
    }

    fn admit(&mut self) {
        while self.running.len() < self.config.max_running.max(1) {
            let Some(req) = self.waiting.pop_front() else { break };
            let need = req.prompt.len() + req.max_tokens;
            if let Err(e) = self.fits_alone(need) {
                let _ = req.events.send(Event::Error(format!(
                    "{need} tokens (prompt and max_tokens) do not fit in the cache's pool: {e}"
                )));
                continue;
            }
            let mut wants = vec![need];
            if self.config.admission == Admission::Optimistic {
                wants.push(need.min(req.prompt.len() + self.cache.config().block_size));
            }
            let mut admitted = Err(String::new());
            let mut stored = req.stored.as_ref();
            for want in wants {
                admitted = self.with_eviction(|e| e.place(&req.prompt, want, &mut stored));
                if admitted.is_ok() {
                    break;
                }
            }
            let (seq, reused, from_store) = match admitted {
                Ok(placed) => placed,
                Err(_) => {
                    // Blocks come back as running requests finish (the pool holds a request
                    // of this length when nothing else is in it).
                    self.waiting.push_front(req);
                    break;
                }
            };
            self.stats.admitted.fetch_add(1, Ordering::Relaxed);
            if from_store {
                // Counted by the store's own metrics.
            } else if reused > 0 {
                self.stats.prefix_hits.fetch_add(1, Ordering::Relaxed);
                self.stats.prefix_tokens_reused.fetch_add(reused as u64, Ordering::Relaxed);
            } else {
                self.stats.prefix_misses.fetch_add(1, Ordering::Relaxed);
            }
            let sampler = Sampler::new(req.sampling.clone(), &req.prompt);
            let stops = StopMatcher::new(req.stop.clone());
            self.admissions += 1;
            let local = self.prefix.wants(&req.prompt);
            let shared = self.config.store.as_ref().and_then(|s| s.wants(&req.prompt));
            let cut = local.or(shared);
            // Admitted on a prefix that ends at the cut (read from the store, say): the
            // snapshot is the sequence as it is now.
            let now = reused > 0 && cut == Some(reused);
            self.running.push(Running {
                cut: cut.filter(|&end| end > reused),
                req,
                admitted_at: self.admissions,
                seq,
                phase: Phase::Prefill(reused),
                sampler,
                detok: Detokenizer::new(),
                stops,
                generated: 0,
            });
            if now {
                self.snapshot(self.running.len() - 1);
            }
        }
    }

    /// Whether a sequence of `tokens` fits in the empty pool.
    fn fits_alone(&self, tokens: usize) -> Result<(), String> {
        let config = self.cache.config();
        let blocks = config.blocks_for_tokens(tokens).map_err(|e| e.to_string())?;
        match blocks.iter().enumerate().find(|&(_, &b)| b > config.blocks_per_layer) {
            Some((layer, &b)) => {
                Err(format!("layer {layer} needs {b} blocks of its {}", config.blocks_per_layer))
            }
            None => Ok(()),
        }
    }

    /// Runs `f` until it succeeds, evicting a prefix snapshot (least recently used first)
    /// after each failure; its last error when none is left.
    fn with_eviction<T>(&mut self, mut f: impl FnMut(&mut Self) -> Result<T, String>) -> Result<T, String> {
        loop {
            match f(self) {
                Ok(t) => return Ok(t),
                Err(e) => match self.prefix.evict_lru() {
                    Some(seq) => {
                        let _ = self.cache.free(seq);
                    }
                    None => return Err(e),
                },
            }
        }
    }

    /// Makes sure every running request can append what this step gives it (its decode token,
    /// or its share of the prefill budget), oldest first: a reservation that falls short is
    /// extended by a block of tokens, snapshots are evicted, and when the pool still has no
    /// room the youngest running request is preempted.
    fn secure(&mut self) {
        let bs = self.cache.config().block_size;
        let mut budget = self.config.prefill_budget.max(1);
        let mut i = 0;
        while i < self.running.len() {
            let r = &self.running[i];
            let n = match r.phase {
                Phase::Decode(_) => 1,
                Phase::Prefill(done) => (r.req.prompt.len() - done).min(budget),
            };
            let (seq, rest) = (r.seq, r.req.prompt.len() + r.req.max_tokens);
            let len = self.cache.len(seq, 0).unwrap_or(0);
            let covered = self.cache.reserved_tokens(seq).unwrap_or(0) >= n;
            let want = rest.saturating_sub(len).min(n + bs).max(n);
            if n == 0
                || covered
                || self.with_eviction(|e| e.cache.reserve(seq, want).map_err(|e| e.to_string())).is_ok()
            {
                if let Phase::Prefill(_) = self.running[i].phase {
                    budget -= n;
                }
                i += 1;
                continue;
            }
            // The youngest gives its blocks back: maybe this very request.
            self.preempt(self.running.len() - 1);
        }
    }

    /// Moves running request `i` to host memory: its sequence exported, its blocks freed.
    fn preempt(&mut self, i: usize) {
        let r = self.running.remove(i);
        match self.cache.export_sequence(r.seq) {
            Ok(bytes) => {
                let _ = self.cache.free(r.seq);
                self.stats.preemptions.fetch_add(1, Ordering::Relaxed);
                let at = self.preempted.partition_point(|(p, _)| p.admitted_at < r.admitted_at);
                self.preempted.insert(at, (r, bytes));
            }
            Err(e) => {
                let _ = self.cache.free(r.seq);
                let _ = r.req.events.send(Event::Error(format!(
                    "the pool is full and the request could not be preempted: {e}"
                )));
                self.stats.finished.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Brings preempted requests back, oldest first, while their sequences fit in the pool.
    fn resume(&mut self) {
        while self.running.len() < self.config.max_running.max(1) {
            let Some((_, bytes)) = self.preempted.front() else { break };
            let bytes = bytes.clone();
            let Ok(seq) = self.with_eviction(|e| e.cache.import_sequence(&bytes).map_err(|e| e.to_string()))
            else {
                break;
            };
            let (mut r, _) = self.preempted.pop_front().expect("a front");
            r.seq = seq;
            let at = self.running.partition_point(|p| p.admitted_at < r.admitted_at);
            self.running.insert(at, r);
        }
    }

    /// A sequence for `prompt` holding the blocks of `need` tokens: a fork of the longest
    /// prefix snapshot, or the prefix read from the shared store when it is longer (set to
    /// `None` once it is refused), each with the tokens it already holds; else a new one.
    /// Returns the sequence, the tokens it holds, and whether they came from the store.
    /// Nothing is left behind on error.
    fn place(
        &mut self,
        prompt: &[u32],
        need: usize,
        stored: &mut Option<&Fetched>,
    ) -> Result<(SeqId, usize, bool), String> {
        let local = self.prefix.lookup(prompt);
        if let Some(f) = *stored
            && local.is_none_or(|(_, len)| len < f.end)
        {
            let blocks: Vec<&[u8]> = f.blocks.iter().map(Vec::as_slice).collect();
            match self.cache.import_split(&f.head, &blocks) {
                Ok(seq) => {
                    if self.cache.reserve(seq, need - f.end).is_ok() {
                        if let Some(store) = &self.config.store {
                            store.stats().hits.fetch_add(1, Ordering::Relaxed);
                            store.stats().tokens_reused.fetch_add(f.end as u64, Ordering::Relaxed);
                        }
                        return Ok((seq, f.end, true));
                    }
                    let _ = self.cache.free(seq);
                }
                // Blocks may come back: the caller evicts and calls again.
                Err(kvq::cache::KvqError::Cache(kvq::cache::CacheError::PoolExhausted { .. })) => {}
                Err(_) => {
                    // Checked entries that do not import (another build's layout): computed.
                    if let Some(store) = &self.config.store {
                        store.stats().refused.fetch_add(1, Ordering::Relaxed);
                    }
                    *stored = None;
                }
            }
        }
        if let Some((snapshot, len)) = local
            && let Ok(seq) = self.cache.fork(snapshot)
        {
            if self.cache.reserve(seq, need - len).is_ok() {
                return Ok((seq, len, false));
            }
            let _ = self.cache.free(seq);
        }
        let seq = self.cache.create();
        match self.cache.reserve(seq, need) {
            Ok(()) => Ok((seq, 0, false)),
            Err(e) => {
                let _ = self.cache.free(seq);
                Err(e.to_string())
            }
        }
    }

    /// Keeps a snapshot of request `i`'s sequence, whose prompt has just been prefilled up to
    /// its cut (see [`crate::prefix`]), in the process's prefix cache and in the shared
    /// store, where each wants it. Best effort: a fork the cache refuses keeps nothing.
    fn snapshot(&mut self, i: usize) {
        let r = &self.running[i];
        let local = self.prefix.wants(&r.req.prompt);
        let shared = self.config.store.as_ref().and_then(|s| s.wants(&r.req.prompt));
        let Ok(end) = self.cache.len(r.seq, 0) else { return };
        // The store copies the sequence's bytes out; only the process's own cache needs a fork.
        if let Some(store) = self.config.store.as_ref().filter(|_| shared == Some(end))
            && let Ok(n) = self.cache.final_blocks(r.seq)
            && let Ok((head, blocks)) = self.cache.export_split(r.seq, n)
        {
            store.offer(&r.req.prompt, end, head, blocks);
        }
        if local != Some(end) {
            return;
        }
        let Ok(copy) = self.cache.fork(r.seq) else { return };
        for seq in self.prefix.insert(&r.req.prompt, end, copy) {
            let _ = self.cache.free(seq);
        }
    }

    /// Samples request `i`'s next token from `last` (the logits after its last token) and
    /// sends its text; `Ok(true)` when the request is finished.
    fn sample(&mut self, i: usize, last: &[f32]) -> Result<bool, String> {
        let r = &mut self.running[i];
        let Some(tok) = r.sampler.sample(last) else {
            return Err("the model produced no finite logit".into());
        };
        r.sampler.accept(tok);
        r.generated += 1;
        self.stats.generated_tokens.fetch_add(1, Ordering::Relaxed);
        let total = r.req.prompt.len() + r.generated;
        if !r.req.ignore_eos && self.eog.contains(&tok) {
            return r.end(&self.tokenizer, FinishReason::Stop);
        }
        let delta = r.detok.push(&self.tokenizer, tok).map_err(|e| e.to_string())?;
        let released = r.stops.push(&delta);
        r.send_text(released.text);
        if released.stopped {
            return Ok(r.done(FinishReason::Stop));
        }
        if r.generated >= r.req.max_tokens || total >= self.config.context {
            return r.end(&self.tokenizer, FinishReason::Length);
        }
        r.phase = Phase::Decode(tok);
        Ok(false)
    }

    fn retire(&mut self, i: usize) {
        let r = self.running.remove(i);
        let _ = self.cache.free(r.seq);
        self.stats.finished.fetch_add(1, Ordering::Relaxed);
    }

    fn publish(&self) {
        let s = &self.stats;
        s.running.store(self.running.len() as u64, Ordering::Relaxed);
        s.waiting.store(self.waiting.len() as u64, Ordering::Relaxed);
        s.preempted.store(self.preempted.len() as u64, Ordering::Relaxed);
        // One walk of every layer's tables per step (`used_bytes` would walk them again).
        let mem = self.cache.memory();
        let free: usize = mem.iter().map(|m| m.free_blocks).sum();
        let used: usize = mem.iter().flat_map(|m| &m.layers).map(|l| l.blocks).sum();
        let bytes: usize = mem.iter().map(|m| m.used_bytes()).sum();
        s.blocks_used.store(used as u64, Ordering::Relaxed);
        s.blocks_free.store(free as u64, Ordering::Relaxed);
        s.cache_bytes.store(bytes as u64, Ordering::Relaxed);
        let tokens: usize = self.running.iter().map(|r| self.cache.len(r.seq, 0).unwrap_or(0)).sum();
        s.cached_tokens.store(tokens as u64, Ordering::Relaxed);
        s.prefix_entries.store(self.prefix.len() as u64, Ordering::Relaxed);
    }
}
