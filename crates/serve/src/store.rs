//! Quantized prefix blocks shared across processes: a [`BlockStore`] on a directory, on Redis
//! or in memory, and the [`PrefixStore`] that keys, writes, reads and checks them.
//!
//! What is stored, per block of tokens of a prompt (the blocks of [`crate::prefix`]): the
//! quantized rows of every layer and KV head exactly as the cache holds them
//! ([`QuantizedKvCache::export_split`](kvq::cache::QuantizedKvCache::export_split)), and per
//! prefix that a prefill reached, a head with the rest of that length's state (lengths, sink
//! tokens, the full-precision window). A block is keyed by the prefix's hash chain at its end
//! (model fingerprint and cache config in the root, then the token ids of every block), so it
//! is found only by a process running the same model and config after the same tokens, and
//! prefixes that share blocks share their entries.
//!
//! Every entry carries a header (format version, kind, the chain's root, its own key, its
//! index, and the token ids it stands for) and a CRC-32. An entry that is truncated,
//! corrupt, of another version, model or config, or stored under another key, is refused and
//! the prompt recomputed: nothing read from a store becomes a token unchecked.
//!
//! The store is a cache, never a dependency: when it is unreachable the server recomputes,
//! says so once in its log, and reconnects by itself. Writes leave the request's path: a
//! writer thread takes them from a short queue (dropped, and counted, when it is full).

use std::collections::{HashMap, HashSet, VecDeque};
use std::fmt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use crate::prefix::Geometry;

/// Why a store call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StoreError {
    /// The store cannot be reached now (connection refused, dropped, timed out).
    #[error("the prefix store is unreachable: {0}")]
    Unavailable(String),
    /// The store answered with an error, or a file could not be read or written.
    #[error("prefix store: {0}")]
    Io(String),
    /// A store URL that names no store.
    #[error("prefix store URL {url:?}: {reason}")]
    Url {
        /// The URL given.
        url: String,
        /// What is wrong with it.
        reason: String,
    },
}

/// Where entries live: a map from keys to bytes that other processes may share.
pub trait BlockStore: Send + Sync {
    /// The entries of `keys`, `None` where one is absent, in order.
    ///
    /// # Errors
    /// [`StoreError`]: the store could not answer.
    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError>;

    /// Stores `value` under `key`. An entry already there stays (entries are content-addressed:
    /// a key stands for one content).
    ///
    /// # Errors
    /// [`StoreError`]: nothing was stored.
    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError>;

    /// Whether each of `keys` is held, in order.
    ///
    /// # Errors
    /// [`StoreError`]: the store could not answer.
    fn contains(&self, keys: &[String]) -> Result<Vec<bool>, StoreError>;

    /// The store for logs (its URL, without credentials).
    fn describe(&self) -> String;
}

/// Opens the store a URL names:
/// - `dir://PATH[?max_bytes=N]`: one file per entry under `PATH` (created if missing), written
///   atomically, the least recently used evicted past `N` bytes (default 8 GiB); it survives
///   restarts, and several processes may share it. An empty URL is the default directory
///   ([`default_dir`]).
/// - `redis://HOST:PORT/DB[?ttl=SECONDS]`: a Redis server (entries expire after the TTL,
///   default a day); run it with `maxmemory-policy allkeys-lru` so that it evicts old entries
///   rather than refusing writes.
/// - `memory://`: in this process only (tests).
///
/// # Errors
/// [`StoreError::Url`] for a URL of no known kind or with a bad parameter, [`StoreError::Io`]
/// for a directory that cannot be made. A Redis server need not be up yet.
pub fn open(url: &str) -> Result<Box<dyn BlockStore>, StoreError> {
    let bad = |reason: String| StoreError::Url { url: url.to_string(), reason };
    if url.is_empty() {
        return Ok(Box::new(DirStore::new(default_dir(), DEFAULT_DIR_BYTES)?));
    }
    let (base, query) = url.split_once('?').unwrap_or((url, ""));
    let mut params: HashMap<&str, &str> = HashMap::new();
    for kv in query.split('&').filter(|s| !s.is_empty()) {
        let (k, v) = kv.split_once('=').ok_or_else(|| bad(format!("parameter {kv:?} has no value")))?;
        params.insert(k, v);
    }
    let number = |params: &HashMap<&str, &str>, name: &str, default: u64| -> Result<u64, StoreError> {
        params.get(name).map_or(Ok(default), |v| {
            v.parse::<u64>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(format!("{name}={v} is not a positive number")))
        })
    };
    let only = |params: &HashMap<&str, &str>, allowed: &[&str]| -> Result<(), StoreError> {
        match params.keys().find(|k| !allowed.contains(k)) {
            Some(k) => Err(bad(format!("unknown parameter {k:?}"))),
            None => Ok(()),
        }
    };
    if let Some(path) = base.strip_prefix("dir://") {
        only(&params, &["max_bytes"])?;
        if path.is_empty() {
            return Err(bad("no directory".into()));
        }
        return Ok(Box::new(DirStore::new(
            PathBuf::from(path),
            number(&params, "max_bytes", DEFAULT_DIR_BYTES)?,
        )?));
    }
    if base.starts_with("redis://") {
        only(&params, &["ttl"])?;
        let ttl = number(&params, "ttl", 24 * 3600)?;
        return Ok(Box::new(RedisStore::new(base, ttl).map_err(|e| bad(e.to_string()))?));
    }
    if base == "memory://" {
        only(&params, &[])?;
        return Ok(Box::new(MemoryStore::default()));
    }
    Err(bad("expected dir://PATH, redis://HOST:PORT/DB or memory://".into()))
}

/// The directory store's default size cap.
pub const DEFAULT_DIR_BYTES: u64 = 8 << 30;

/// The default directory store: `$XDG_CACHE_HOME/kvq/prefix-store`, else
/// `$HOME/.cache/kvq/prefix-store`, else `kvq-prefix-store` here.
pub fn default_dir() -> PathBuf {
    let base =
        std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(PathBuf::from).or_else(|| {
            std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache"))
        });
    match base {
        Some(b) => b.join("kvq").join("prefix-store"),
        None => PathBuf::from("kvq-prefix-store"),
    }
}

/// Entries in this process's memory.
#[derive(Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
}

impl MemoryStore {
    fn map(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        self.map.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

impl BlockStore for MemoryStore {
    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        let map = self.map();
        Ok(keys.iter().map(|k| map.get(k).cloned()).collect())
    }
    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.map().entry(key.to_string()).or_insert_with(|| value.to_vec());
        Ok(())
    }
    fn contains(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        let map = self.map();
        Ok(keys.iter().map(|k| map.contains_key(k)).collect())
    }
    fn describe(&self) -> String {
        "memory://".into()
    }
}

/// The largest entry a directory store reads.
const MAX_ENTRY_BYTES: u64 = 1 << 30;

/// One file per entry in a directory, shared by every process that opens it.
pub struct DirStore {
    dir: PathBuf,
    max_bytes: u64,
    /// Bytes of entries, as last counted (other processes add theirs unseen until the next
    /// eviction counts again).
    used: AtomicU64,
    evicting: Mutex<()>,
}

impl DirStore {
    /// A store in `dir` (created when missing) holding about `max_bytes` at most.
    ///
    /// # Errors
    /// [`StoreError::Io`] when the directory cannot be made or read.
    pub fn new(dir: PathBuf, max_bytes: u64) -> Result<Self, StoreError> {
        std::fs::create_dir_all(&dir).map_err(|e| StoreError::Io(format!("{}: {e}", dir.display())))?;
        let s = Self { dir, max_bytes, used: AtomicU64::new(0), evicting: Mutex::new(()) };
        let used = s.entries()?.iter().map(|e| e.1).sum();
        s.used.store(used, Ordering::Relaxed);
        Ok(s)
    }

    fn path(&self, key: &str) -> PathBuf {
        // Keys are made here of letters, digits and ':' (kept out of file names).
        self.dir.join(key.replace(':', "-"))
    }

    /// Every entry file: path, bytes, last use.
    fn entries(&self) -> Result<Vec<(PathBuf, u64, SystemTime)>, StoreError> {
        let io = |e: std::io::Error| StoreError::Io(format!("{}: {e}", self.dir.display()));
        let mut out = Vec::new();
        for entry in std::fs::read_dir(&self.dir).map_err(io)? {
            let entry = entry.map_err(io)?;
            if !entry.file_name().to_string_lossy().starts_with("kvq-") {
                continue;
            }
            // Another process may evict it meanwhile.
            if let Ok(m) = entry.metadata()
                && m.is_file()
            {
                out.push((entry.path(), m.len(), m.modified().unwrap_or(SystemTime::UNIX_EPOCH)));
            }
        }
        Ok(out)
    }

    /// Deletes the least recently used entries until a tenth of the cap is free.
    fn evict(&self) -> Result<(), StoreError> {
        let _one = self.evicting.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let mut entries = self.entries()?;
        let mut used: u64 = entries.iter().map(|e| e.1).sum();
        if used > self.max_bytes {
            entries.sort_by_key(|e| e.2);
            let target = self.max_bytes - self.max_bytes / 10;
            for (path, len, _) in entries {
                if used <= target {
                    break;
                }
                if std::fs::remove_file(&path).is_ok() {
                    used -= len;
                }
            }
        }
        self.used.store(used, Ordering::Relaxed);
        Ok(())
    }
}

impl BlockStore for DirStore {
    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        keys.iter()
            .map(|k| {
                let path = self.path(k);
                match kvq::io::read_regular_file(&path, MAX_ENTRY_BYTES) {
                    Ok(bytes) => {
                        // Its last use, for eviction (best effort: another process may have
                        // evicted it since).
                        if let Ok(f) = std::fs::File::options().write(true).open(&path) {
                            let _ = f.set_modified(SystemTime::now());
                        }
                        Ok(Some(bytes))
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
                    Err(e) => Err(StoreError::Io(format!("{}: {e}", path.display()))),
                }
            })
            .collect()
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        let path = self.path(key);
        if path.exists() {
            return Ok(());
        }
        // A temporary file renamed into place (the project's atomic write): readers, and other
        // writers of the same key, see no entry or a whole one, never a torn one.
        kvq::io::write_atomic(&path, value)
            .map_err(|e| StoreError::Io(format!("{}: {e}", path.display())))?;
        let used = self.used.fetch_add(value.len() as u64, Ordering::Relaxed) + value.len() as u64;
        if used > self.max_bytes {
            self.evict()?;
        }
        Ok(())
    }

    fn contains(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        Ok(keys.iter().map(|k| self.path(k).is_file()).collect())
    }

    fn describe(&self) -> String {
        format!("dir://{}", self.dir.display())
    }
}

/// Entries in a Redis server, through one connection made again whenever it fails.
pub struct RedisStore {
    client: redis::Client,
    shown: String,
    ttl: u64,
    con: Mutex<Option<redis::Connection>>,
    /// No new connection is tried before this instant after a failed one.
    retry_at: Mutex<Option<Instant>>,
    down: AtomicBool,
}

/// How long a connection, a read or a write may take.
const REDIS_TIMEOUT: Duration = Duration::from_secs(2);
/// How long after a failed connection the next is tried.
const REDIS_RETRY: Duration = Duration::from_millis(500);

impl RedisStore {
    /// A store on the server of `url` (`redis://HOST:PORT/DB`), entries living `ttl` seconds.
    /// Nothing is connected before the first call.
    ///
    /// # Errors
    /// The URL's.
    pub fn new(url: &str, ttl: u64) -> Result<Self, StoreError> {
        let client = redis::Client::open(url)
            .map_err(|e| StoreError::Url { url: url.into(), reason: e.to_string() })?;
        let info = client.get_connection_info();
        let shown = format!("redis://{}/{}", info.addr(), info.redis_settings().db());
        Ok(Self {
            client,
            shown,
            ttl,
            con: Mutex::new(None),
            retry_at: Mutex::new(None),
            down: AtomicBool::new(false),
        })
    }

    fn with_con<T>(
        &self,
        f: impl FnOnce(&mut redis::Connection) -> redis::RedisResult<T>,
    ) -> Result<T, StoreError> {
        let mut con = self.con.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if con.is_none() {
            let mut retry = self.retry_at.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            if retry.is_some_and(|t| Instant::now() < t) {
                return Err(StoreError::Unavailable(format!("{}: waiting to reconnect", self.shown)));
            }
            let made = self.client.get_connection_with_timeout(REDIS_TIMEOUT).and_then(|c| {
                c.set_read_timeout(Some(REDIS_TIMEOUT))?;
                c.set_write_timeout(Some(REDIS_TIMEOUT))?;
                Ok(c)
            });
            match made {
                Ok(c) => *con = Some(c),
                Err(e) => {
                    *retry = Some(Instant::now() + REDIS_RETRY);
                    return Err(self.failed(&e));
                }
            }
        }
        match f(con.as_mut().expect("connected above")) {
            Ok(v) => {
                if self.down.swap(false, Ordering::Relaxed) {
                    eprintln!("kvq-serve: prefix store {} is reachable again", self.shown);
                }
                Ok(v)
            }
            Err(e) => {
                // The connection's state is unknown after any failure: the next call makes a new one.
                *con = None;
                Err(self.failed(&e))
            }
        }
    }

    /// Logs the first failure of an outage.
    fn failed(&self, e: &redis::RedisError) -> StoreError {
        let unreachable =
            e.is_io_error() || e.is_connection_refusal() || e.is_timeout() || e.is_connection_dropped();
        if unreachable && !self.down.swap(true, Ordering::Relaxed) {
            eprintln!(
                "kvq-serve: prefix store {} is unreachable ({e}); prompts are computed until it is back",
                self.shown
            );
        }
        if unreachable {
            StoreError::Unavailable(format!("{}: {e}", self.shown))
        } else {
            StoreError::Io(format!("{}: {e}", self.shown))
        }
    }
}

impl BlockStore for RedisStore {
    fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Vec<u8>>>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.with_con(|c| redis::cmd("MGET").arg(keys).query(c))
    }

    fn put(&self, key: &str, value: &[u8]) -> Result<(), StoreError> {
        self.with_con(|c| {
            redis::cmd("SET").arg(key).arg(value).arg("EX").arg(self.ttl).arg("NX").query::<Option<String>>(c)
        })
        .map(|_| ())
    }

    fn contains(&self, keys: &[String]) -> Result<Vec<bool>, StoreError> {
        if keys.is_empty() {
            return Ok(Vec::new());
        }
        self.with_con(|c| {
            let mut p = redis::pipe();
            for k in keys {
                p.cmd("EXISTS").arg(k);
            }
            p.query(c)
        })
    }

    fn describe(&self) -> String {
        self.shown.clone()
    }
}

// ---- Entries ----

const MAGIC: &[u8; 8] = b"KVQPFXST";
/// The entry format this build writes and reads.
pub const ENTRY_VERSION: u32 = 1;
const KIND_BLOCK: u8 = 1;
const KIND_HEAD: u8 = 2;
/// magic, version, kind, root, key, index, token count.
const HEADER: usize = 8 + 4 + 1 + 8 + 8 + 8 + 4;

/// An entry: header, the token ids it stands for, the payload, a CRC-32 of all of it.
fn seal(kind: u8, root: u64, key: u64, index: u64, tokens: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER + 4 * tokens.len() + payload.len() + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&ENTRY_VERSION.to_le_bytes());
    out.push(kind);
    out.extend_from_slice(&root.to_le_bytes());
    out.extend_from_slice(&key.to_le_bytes());
    out.extend_from_slice(&index.to_le_bytes());
    out.extend_from_slice(&(tokens.len() as u32).to_le_bytes());
    for t in tokens {
        out.extend_from_slice(&t.to_le_bytes());
    }
    out.extend_from_slice(payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    out
}

/// What an entry must be to be used.
struct Expect<'a> {
    kind: u8,
    root: u64,
    key: u64,
    /// The block's index (`None` for a head, whose index is its block count).
    index: Option<u64>,
    tokens: &'a [u32],
}

/// The index and payload of `bytes`, if it is the entry `want` describes.
fn unseal<'a>(bytes: &'a [u8], want: &Expect<'_>) -> Result<(u64, &'a [u8]), String> {
    if bytes.len() < HEADER + 4 || &bytes[..8] != MAGIC {
        return Err("not a kvq prefix entry (bad magic or truncated)".into());
    }
    let (content, crc) = bytes.split_at(bytes.len() - 4);
    if crc32fast::hash(content) != u32::from_le_bytes(crc.try_into().expect("4 bytes")) {
        return Err("checksum mismatch: the entry is corrupt or truncated".into());
    }
    let u64_at = |at: usize| u64::from_le_bytes(content[at..at + 8].try_into().expect("8 bytes"));
    let version = u32::from_le_bytes(content[8..12].try_into().expect("4 bytes"));
    if version != ENTRY_VERSION {
        return Err(format!("entry format version {version} (this build reads {ENTRY_VERSION})"));
    }
    let kind = content[12];
    if kind != want.kind {
        return Err(format!("an entry of kind {kind} where {} was asked for", want.kind));
    }
    if u64_at(13) != want.root {
        return Err("an entry of another model or cache config".into());
    }
    if u64_at(21) != want.key {
        return Err("an entry stored under another key".into());
    }
    let index = u64_at(29);
    if want.index.is_some_and(|i| i != index) {
        return Err(format!("block {index} where block {} was asked for", want.index.unwrap_or(0)));
    }
    let n = u32::from_le_bytes(content[37..41].try_into().expect("4 bytes")) as usize;
    let tokens =
        content.get(HEADER..).and_then(|rest| rest.get(..n.checked_mul(4)?)).ok_or("truncated tokens")?;
    if n != want.tokens.len() || tokens.chunks_exact(4).zip(want.tokens).any(|(b, &t)| b != t.to_le_bytes()) {
        return Err("an entry for other tokens (a key collision)".into());
    }
    Ok((index, &content[HEADER + 4 * n..]))
}

fn block_name(key: u64) -> String {
    format!("kvq:b:{key:016x}")
}

fn head_name(key: u64) -> String {
    format!("kvq:h:{key:016x}")
}

// ---- The store as the server uses it ----

/// A prefix found in the store, checked: import it with
/// [`QuantizedKvCache::import_split`](kvq::cache::QuantizedKvCache::import_split).
pub struct Fetched {
    /// Prompt tokens it holds.
    pub end: usize,
    /// The head of that length.
    pub head: Vec<u8>,
    /// Its stored blocks of tokens, in order.
    pub blocks: Vec<Vec<u8>>,
}

impl fmt::Debug for Fetched {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fetched {{ end: {}, blocks: {} }}", self.end, self.blocks.len())
    }
}

/// Counters for `/metrics`.
#[derive(Debug, Default)]
pub struct StoreStats {
    /// Prompts admitted on a prefix read from the store.
    pub hits: AtomicU64,
    /// Prompts the store held no prefix of.
    pub misses: AtomicU64,
    /// Prompt tokens not prefilled thanks to the store.
    pub tokens_reused: AtomicU64,
    /// Entry bytes read.
    pub bytes_read: AtomicU64,
    /// Entry bytes written.
    pub bytes_written: AtomicU64,
    /// Prefixes written whole (their head put after their blocks): readable by every server.
    pub prefixes_written: AtomicU64,
    /// Calls that failed (store unreachable, I/O), and writes dropped on a full queue.
    pub errors: AtomicU64,
    /// Entries refused by their checksum or header, or that did not import.
    pub refused: AtomicU64,
}

/// The writer's work: a prefix to write (its tokens, the head and the blocks of tokens).
struct Job {
    tokens: Vec<u32>,
    head: Vec<u8>,
    blocks: Vec<Vec<u8>>,
}

/// Writes queued at most; more are dropped (the store is a cache).
const QUEUE: usize = 4;
/// Head keys remembered as written or read, so that a prefix is offered once.
const REMEMBERED: usize = 4096;

/// The server's view of a [`BlockStore`]: keys prompts, reads and checks prefixes, and writes
/// new ones from a thread of its own.
pub struct PrefixStore {
    backend: Arc<dyn BlockStore>,
    geometry: Geometry,
    root: u64,
    stats: Arc<StoreStats>,
    known: Arc<Known>,
    jobs: SyncSender<Job>,
}

/// Head keys this process wrote or read (the latest [`REMEMBERED`]), so that a prefix is
/// offered once; a failed write forgets its key again.
#[derive(Default)]
struct Known(Mutex<(HashSet<u64>, VecDeque<u64>)>);

impl Known {
    fn lock(&self) -> std::sync::MutexGuard<'_, (HashSet<u64>, VecDeque<u64>)> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `key`; `false` when it was there.
    fn insert(&self, key: u64) -> bool {
        let mut k = self.lock();
        if !k.0.insert(key) {
            return false;
        }
        k.1.push_back(key);
        if k.1.len() > REMEMBERED
            && let Some(old) = k.1.pop_front()
        {
            k.0.remove(&old);
        }
        true
    }

    fn contains(&self, key: u64) -> bool {
        self.lock().0.contains(&key)
    }

    fn forget(&self, key: u64) {
        self.lock().0.remove(&key);
    }
}

impl fmt::Debug for PrefixStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "PrefixStore({})", self.backend.describe())
    }
}

impl PrefixStore {
    /// A prefix store on `backend` for blocks of `geometry` under `root` (the model and cache
    /// config, [`crate::prefix::root`]); starts its writer thread, which ends with the store.
    ///
    /// # Errors
    /// The thread's.
    pub fn new(backend: Box<dyn BlockStore>, geometry: Geometry, root: u64) -> Result<Self, String> {
        let backend: Arc<dyn BlockStore> = Arc::from(backend);
        let stats = Arc::new(StoreStats::default());
        let (jobs, rx) = std::sync::mpsc::sync_channel(QUEUE);
        let known = Arc::new(Known::default());
        let writer = Writer {
            backend: Arc::clone(&backend),
            geometry,
            root,
            stats: Arc::clone(&stats),
            known: Arc::clone(&known),
        };
        std::thread::Builder::new()
            .name("kvq-store-writer".into())
            .spawn(move || writer.run(&rx))
            .map_err(|e| format!("the prefix store's writer thread: {e}"))?;
        Ok(Self { backend, geometry, root, stats, known, jobs })
    }

    /// The counters.
    pub fn stats(&self) -> &StoreStats {
        &self.stats
    }

    /// The store for logs.
    pub fn describe(&self) -> String {
        self.backend.describe()
    }

    /// The longest prefix of `prompt` held in the store, every entry checked against its
    /// header, its checksum and the prompt's tokens; `None` on a miss or when the store
    /// cannot be read (counted).
    pub fn lookup(&self, prompt: &[u32]) -> Option<Fetched> {
        self.lookup_beyond(prompt, 0)
    }

    /// [`PrefixStore::lookup`] of prefixes longer than `beyond` tokens only (what the
    /// process's own prefix cache holds); nothing is read, or counted, when none can be.
    pub fn lookup_beyond(&self, prompt: &[u32], beyond: usize) -> Option<Fetched> {
        let all = self.geometry.keys(self.root, prompt);
        let skipped = all.iter().take_while(|&&(end, _)| end <= beyond).count();
        let keys = &all[skipped..];
        if keys.is_empty() && beyond > 0 {
            return None;
        }
        let heads: Vec<String> = keys.iter().map(|&(_, k)| head_name(k)).collect();
        let held = match self.backend.contains(&heads) {
            Ok(h) => h,
            Err(_) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                return None;
            }
        };
        for i in (0..keys.len()).rev().filter(|&i| held.get(i) == Some(&true)) {
            match self.fetch(prompt, &all, i + skipped) {
                Ok(Some(f)) => {
                    self.known.insert(keys[i].1);
                    return Some(f);
                }
                Ok(None) => {}
                Err(Some(_)) => {
                    self.stats.refused.fetch_add(1, Ordering::Relaxed);
                }
                Err(None) => {
                    self.stats.errors.fetch_add(1, Ordering::Relaxed);
                    return None;
                }
            }
        }
        self.stats.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// The prefix ending at boundary `i` of `keys`: `Ok(None)` when an entry is missing,
    /// `Err(Some(why))` when one is refused, `Err(None)` when the store failed.
    fn fetch(
        &self,
        prompt: &[u32],
        keys: &[(usize, u64)],
        i: usize,
    ) -> Result<Option<Fetched>, Option<String>> {
        let (end, key) = keys[i];
        let got = self.backend.get_many(&[head_name(key)]).map_err(|_| None)?;
        let Some(Some(bytes)) = got.into_iter().next() else { return Ok(None) };
        let mut read = bytes.len() as u64;
        let want = Expect { kind: KIND_HEAD, root: self.root, key, index: None, tokens: &prompt[..end] };
        let (n, head) = unseal(&bytes, &want).map_err(Some)?;
        let n = usize::try_from(n)
            .ok()
            .filter(|&n| n <= i + 1)
            .ok_or_else(|| Some(format!("a head of {n} blocks")))?;
        let names: Vec<String> = keys[..n].iter().map(|&(_, k)| block_name(k)).collect();
        let got = self.backend.get_many(&names).map_err(|_| None)?;
        let mut blocks = Vec::with_capacity(n);
        for (j, entry) in got.into_iter().enumerate() {
            let Some(bytes) = entry else { return Ok(None) };
            read += bytes.len() as u64;
            let (at, key) = keys[j];
            let b = self.geometry.block;
            let want = Expect {
                kind: KIND_BLOCK,
                root: self.root,
                key,
                index: Some(j as u64),
                tokens: &prompt[at - b..at],
            };
            let (_, payload) = unseal(&bytes, &want).map_err(Some)?;
            blocks.push(payload.to_vec());
        }
        if blocks.len() != n {
            return Ok(None);
        }
        self.stats.bytes_read.fetch_add(read, Ordering::Relaxed);
        Ok(Some(Fetched { end, head: head.to_vec(), blocks }))
    }

    /// The longest prefix of `prompt` whose key is in `held` (a process's own prefix cache,
    /// [`crate::prefix::PrefixCache::held_keys`]), in tokens; 0 for none.
    pub fn held_end(&self, prompt: &[u32], held: &std::collections::HashSet<u64>) -> usize {
        self.geometry.longest_held(self.root, prompt, held)
    }

    /// Where a prefilled `prompt` would be cut for the store, when its prefix has not been
    /// written or read by this process yet.
    pub fn wants(&self, prompt: &[u32]) -> Option<usize> {
        let &(end, key) = self.geometry.keys(self.root, prompt).last()?;
        (!self.known.contains(key)).then_some(end)
    }

    /// Queues the first `end` tokens of `prompt`, split as `head` and `blocks`
    /// ([`QuantizedKvCache::export_split`](kvq::cache::QuantizedKvCache::export_split)), for
    /// the writer; dropped (and counted) when the queue is full.
    pub fn offer(&self, prompt: &[u32], end: usize, head: Vec<u8>, blocks: Vec<Vec<u8>>) {
        let Some(&(_, key)) = self.geometry.keys(self.root, &prompt[..(end + 1).min(prompt.len())]).last()
        else {
            return;
        };
        if !self.known.insert(key) {
            return;
        }
        match self.jobs.try_send(Job { tokens: prompt[..end].to_vec(), head, blocks }) {
            Ok(()) => {}
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                // Not written: another request may offer it again.
                self.known.forget(key);
            }
        }
    }
}

/// The writer thread's side.
struct Writer {
    backend: Arc<dyn BlockStore>,
    geometry: Geometry,
    root: u64,
    stats: Arc<StoreStats>,
    known: Arc<Known>,
}

impl Writer {
    fn run(&self, rx: &Receiver<Job>) {
        while let Ok(Job { tokens, head, blocks }) = rx.recv() {
            if let Err(key) = self.write(&tokens, &head, &blocks) {
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                // Not written: offered again by the next prompt that reaches it.
                self.known.forget(key);
            }
        }
    }

    /// The blocks the store lacks, then the head (so that a head is never found before its
    /// blocks).
    /// `Err(head key)` when the store failed.
    fn write(&self, tokens: &[u32], head: &[u8], blocks: &[Vec<u8>]) -> Result<(), u64> {
        let end = tokens.len();
        // The keys of every boundary up to `end` (a token past it keeps `end` itself in).
        let mut past = tokens.to_vec();
        past.push(0);
        let keys = self.geometry.keys(self.root, &past);
        let Some(&(last, head_key)) = keys.last() else { return Ok(()) };
        if last != end || blocks.len() > keys.len() {
            return Ok(());
        }
        let names: Vec<String> = keys[..blocks.len()].iter().map(|&(_, k)| block_name(k)).collect();
        let held = self.backend.contains(&names).map_err(|_| head_key)?;
        let b = self.geometry.block;
        for (j, ((&(at, key), block), held)) in keys.iter().zip(blocks).zip(held).enumerate() {
            if held {
                continue;
            }
            let entry = seal(KIND_BLOCK, self.root, key, j as u64, &tokens[at - b..at], block);
            self.backend.put(&names[j], &entry).map_err(|_| head_key)?;
            self.stats.bytes_written.fetch_add(entry.len() as u64, Ordering::Relaxed);
        }
        let entry = seal(KIND_HEAD, self.root, head_key, blocks.len() as u64, tokens, head);
        self.backend.put(&head_name(head_key), &entry).map_err(|_| head_key)?;
        self.stats.bytes_written.fetch_add(entry.len() as u64, Ordering::Relaxed);
        self.stats.prefixes_written.fetch_add(1, Ordering::Release);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry() -> Vec<u8> {
        seal(KIND_BLOCK, 7, 9, 2, &[5, 6, 7], b"payload")
    }

    fn want(tokens: &[u32]) -> Expect<'_> {
        Expect { kind: KIND_BLOCK, root: 7, key: 9, index: Some(2), tokens }
    }

    #[test]
    fn entries_open_only_as_what_was_asked_for() {
        let e = entry();
        assert_eq!(unseal(&e, &want(&[5, 6, 7])).unwrap(), (2, &b"payload"[..]));
        let refused = |bytes: &[u8], w: &Expect<'_>| unseal(bytes, w).unwrap_err();
        assert!(refused(&e, &want(&[5, 6, 8])).contains("other tokens"));
        assert!(refused(&e, &want(&[5, 6])).contains("other tokens"));
        assert!(refused(&e, &Expect { root: 8, ..want(&[5, 6, 7]) }).contains("another model"));
        assert!(refused(&e, &Expect { key: 1, ..want(&[5, 6, 7]) }).contains("another key"));
        assert!(refused(&e, &Expect { index: Some(3), ..want(&[5, 6, 7]) }).contains("block 2"));
        assert!(refused(&e, &Expect { kind: KIND_HEAD, index: None, ..want(&[5, 6, 7]) }).contains("kind"));
        for n in 0..e.len() {
            assert!(unseal(&e[..n], &want(&[5, 6, 7])).is_err(), "truncated to {n}");
        }
        for at in 0..e.len() {
            let mut bad = e.clone();
            bad[at] ^= 1;
            assert!(unseal(&bad, &want(&[5, 6, 7])).is_err(), "byte {at} flipped");
        }
        // A token count beyond the entry, with a valid checksum: refused, no panic.
        let mut lying = e[..e.len() - 4].to_vec();
        lying[37..41].copy_from_slice(&u32::MAX.to_le_bytes());
        let crc = crc32fast::hash(&lying);
        lying.extend_from_slice(&crc.to_le_bytes());
        assert!(unseal(&lying, &want(&[5, 6, 7])).is_err());
    }

    #[test]
    fn urls_name_stores_or_say_what_is_wrong() {
        assert_eq!(open("memory://").unwrap().describe(), "memory://");
        for bad in [
            "memory://?x=1",
            "ftp://x",
            "dir://",
            "dir://x?max_bytes=0",
            "dir://x?max_bytes",
            "redis://h:1/0?ttl=-1",
            "redis://h:1/0?db=2",
        ] {
            assert!(matches!(open(bad), Err(StoreError::Url { .. })), "{bad}");
        }
        let r = open("redis://127.0.0.1:1/3?ttl=60").unwrap();
        assert_eq!(r.describe(), "redis://127.0.0.1:1/3");
        // Nothing listens on port 1: an error, not a hang or a panic.
        assert!(matches!(r.contains(&["k".into()]), Err(StoreError::Unavailable(_))));
        assert!(r.put("k", b"v").is_err());
    }

    fn temp(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("kvq-store-unit-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    #[test]
    fn a_directory_store_keeps_the_recently_used_under_its_cap() {
        let dir = temp("cap");
        let s = DirStore::new(dir.clone(), 10_000).unwrap();
        let value = vec![1u8; 1000];
        for i in 0..9 {
            s.put(&format!("kvq:b:{i}"), &value).unwrap();
        }
        // Entry 0 used last: it outlives the others when the cap is passed.
        std::thread::sleep(Duration::from_millis(20));
        assert!(s.get_many(&["kvq:b:0".into()]).unwrap()[0].is_some());
        for i in 9..12 {
            std::thread::sleep(Duration::from_millis(2));
            s.put(&format!("kvq:b:{i}"), &value).unwrap();
        }
        let held: Vec<bool> = s.contains(&(0..12).map(|i| format!("kvq:b:{i}")).collect::<Vec<_>>()).unwrap();
        assert!(held.iter().filter(|&&h| h).count() <= 10, "{held:?}");
        assert!(held[0] && held[11], "{held:?}");
        assert!(!held[1], "{held:?}");
        // A second store on the same directory sees the same entries.
        let again = DirStore::new(dir.clone(), 10_000).unwrap();
        assert_eq!(again.contains(&["kvq:b:11".into()]).unwrap(), [true]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn writers_of_one_key_at_once_leave_one_whole_entry() {
        let dir = temp("race");
        let stores: Vec<DirStore> = (0..4).map(|_| DirStore::new(dir.clone(), 1 << 30).unwrap()).collect();
        std::thread::scope(|scope| {
            for (i, s) in stores.iter().enumerate() {
                scope.spawn(move || {
                    for round in 0..50 {
                        s.put(&format!("kvq:b:{round}"), &vec![i as u8; 100_000]).unwrap();
                    }
                });
            }
        });
        for round in 0..50 {
            let got = stores[0].get_many(&[format!("kvq:b:{round}")]).unwrap().remove(0).unwrap();
            assert_eq!(got.len(), 100_000);
            assert!(got.iter().all(|&b| b == got[0]), "a torn entry");
        }
        let leftovers = std::fs::read_dir(&dir)
            .unwrap()
            .filter(|e| !e.as_ref().unwrap().file_name().to_string_lossy().starts_with("kvq-"))
            .count();
        assert_eq!(leftovers, 0, "temporary files left behind");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_store_that_cannot_write_says_so() {
        let dir = temp("gone");
        let s = DirStore::new(dir.clone(), 1 << 20).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(matches!(s.put("kvq:b:1", b"x"), Err(StoreError::Io(_))));
        assert_eq!(s.get_many(&["kvq:b:1".into()]).unwrap(), [None]);
    }
}
