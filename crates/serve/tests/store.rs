//! Two `kvq-serve` processes' worth of servers sharing prefix blocks through a store on disk
//! and on a real `redis-server`, with the faults a deployment meets: the texts always those of
//! a server that computes everything itself.

use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kvq_serve::server::ServerConfig;

mod common;
use common::*;

/// Token ids of a prompt of `n` tokens; `salt` makes prompts that differ from the start.
fn ids(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32).map(|i| 3 + (i * 7919 + salt * 131) % 300).collect()
}

fn run(addr: SocketAddr, prompt: &[u32]) -> String {
    greedy_ids(addr, prompt, 6)
}

fn with_store(url: &str) -> ServerConfig {
    // No prefix cache of its own: every reuse here comes from the store.
    ServerConfig { prefix_store: Some(url.to_string()), prefix_entries: 0, ..config() }
}

fn plain() -> SocketAddr {
    start(ServerConfig { prefix_entries: 0, ..config() })
}

/// Waits (20 s at most) until `name` on `addr` is above `than`.
fn rises(addr: SocketAddr, name: &str, than: f64) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while metric(addr, name) <= than {
        assert!(Instant::now() < deadline, "{name} stays at {than}");
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A (writes) then B (reads) on `prompt`: B's text is the plain server's, from the store.
fn shared_once(a: SocketAddr, b: SocketAddr, reference: SocketAddr, prompt: &[u32]) {
    let want = run(reference, prompt);
    let written = metric(a, "kvq_store_prefixes_written_total");
    assert_eq!(run(a, prompt), want, "A, {} tokens", prompt.len());
    // Bytes rise with the first block; the prefix is readable once its head is written.
    rises(a, "kvq_store_prefixes_written_total", written);
    let (hits, prefilled) = (metric(b, "kvq_store_hits_total"), metric(b, "kvq_prompt_tokens_total"));
    assert_eq!(run(b, prompt), want, "B from the store, {} tokens", prompt.len());
    assert_eq!(metric(b, "kvq_store_hits_total"), hits + 1.0, "{} tokens", prompt.len());
    // Only what follows the last stored boundary was prefilled (blocks of 32 after 4 sinks).
    let computed = metric(b, "kvq_prompt_tokens_total") - prefilled;
    assert!((1.0..=32.0).contains(&computed), "{computed} of {} tokens prefilled", prompt.len());
}

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kvq-store-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Entry files of a directory store: (kind, index, path).
fn entries(dir: &Path) -> Vec<(u8, u64, PathBuf)> {
    let mut out: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("kvq-"))
        .map(|p| {
            let b = std::fs::read(&p).unwrap();
            (b[12], u64::from_le_bytes(b[29..37].try_into().unwrap()), p)
        })
        .collect();
    out.sort();
    out
}

#[test]
fn two_servers_share_a_directory_store_with_the_texts_they_compute() {
    let dir = temp_dir("share");
    let url = format!("dir://{}", dir.display());
    let (a, b, reference) = (start(with_store(&url)), start(with_store(&url)), plain());
    // Every distance from a block boundary, and prefixes that share their first blocks.
    for (n, salt) in [(37, 1), (38, 2), (50, 3), (67, 4), (68, 5), (69, 6), (100, 7), (133, 8), (260, 9)] {
        shared_once(a, b, reference, &ids(n, salt));
    }
    let mut longer = ids(260, 9);
    longer.extend(ids(40, 10));
    shared_once(a, b, reference, &longer);
    assert_eq!(metric(b, "kvq_store_refused_total"), 0.0);
    assert_eq!(metric(a, "kvq_store_errors_total") + metric(b, "kvq_store_errors_total"), 0.0);
    // The store survives the servers: a third one, started later, reads it.
    // With a prefix cache of its own, it reads the store once and keeps what it read.
    let c = start(ServerConfig { prefix_entries: 8, ..with_store(&url) });
    assert_eq!(run(c, &longer), run(reference, &longer));
    assert_eq!(metric(c, "kvq_store_hits_total"), 1.0);
    let read = metric(c, "kvq_store_bytes_read_total");
    assert_eq!(run(c, &longer), run(reference, &longer));
    assert_eq!(metric(c, "kvq_store_hits_total"), 1.0);
    assert_eq!(metric(c, "kvq_prefix_hits_total"), 1.0, "the second time from its own cache");
    assert_eq!(
        metric(c, "kvq_store_bytes_read_total"),
        read,
        "the store is not read for what the cache holds"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Truncated, corrupted, or foreign entries (another cache config's, put under this one's
/// keys: a forced collision) are refused and the prompt computed; nothing wrong is served.
#[test]
fn damaged_and_foreign_entries_are_refused_and_recomputed() {
    let dir = temp_dir("damage");
    let url = format!("dir://{}", dir.display());
    let (a, reference) = (start(with_store(&url)), plain());
    let prompt = ids(140, 21);
    let want = run(reference, &prompt);
    assert_eq!(run(a, &prompt), want);
    rises(a, "kvq_store_prefixes_written_total", 0.0);
    let b = start(with_store(&url));
    // Give the writer time to put the head after the blocks.
    let deadline = Instant::now() + Duration::from_secs(20);
    while !entries(&dir).iter().any(|e| e.0 == 2) {
        assert!(Instant::now() < deadline, "no head written");
        std::thread::sleep(Duration::from_millis(10));
    }
    let files = entries(&dir);
    let originals: Vec<Vec<u8>> = files.iter().map(|f| std::fs::read(&f.2).unwrap()).collect();
    let restore = || {
        for (f, bytes) in files.iter().zip(&originals) {
            std::fs::write(&f.2, bytes).unwrap();
        }
    };
    let mut refused = 0.0;
    let mut damage = |what: &str, f: &dyn Fn(&mut Vec<u8>), which: usize| {
        let mut bytes = originals[which].clone();
        f(&mut bytes);
        std::fs::write(&files[which].2, &bytes).unwrap();
        assert_eq!(run(b, &prompt), want, "{what}");
        let now = metric(b, "kvq_store_refused_total");
        assert!(now > refused, "{what}: not refused");
        refused = now;
        restore();
    };
    let head = files.iter().position(|f| f.0 == 2).unwrap();
    let block = files.iter().position(|f| f.0 == 1).unwrap();
    for which in [head, block] {
        damage("truncated", &|b| b.truncate(b.len() / 2), which);
        damage(
            "a flipped byte",
            &|b| {
                let at = b.len() / 2;
                b[at] ^= 0x10
            },
            which,
        );
        damage(
            "another format version",
            &|b| {
                b[8] = 9;
                let n = b.len() - 4;
                let crc = crc32fast::hash(&b[..n]);
                b[n..].copy_from_slice(&crc.to_le_bytes());
            },
            which,
        );
    }
    // Another config's entries for the same prompt under this config's keys.
    let other_dir = temp_dir("foreign");
    let other = start(ServerConfig {
        specs: Some("int8-token/int8-token".into()),
        ..with_store(&format!("dir://{}", other_dir.display()))
    });
    run(other, &prompt);
    let deadline = Instant::now() + Duration::from_secs(20);
    while !entries(&other_dir).iter().any(|e| e.0 == 2) {
        assert!(Instant::now() < deadline, "no foreign head written");
        std::thread::sleep(Duration::from_millis(10));
    }
    for (kind, index, path) in entries(&other_dir) {
        if let Some(mine) = files.iter().find(|f| f.0 == kind && f.1 == index) {
            std::fs::copy(&path, &mine.2).unwrap();
        }
    }
    assert_eq!(run(b, &prompt), want, "foreign entries");
    assert!(metric(b, "kvq_store_refused_total") > refused, "foreign entries not refused");
    restore();
    let hits = metric(b, "kvq_store_hits_total");
    assert_eq!(run(b, &prompt), want);
    assert_eq!(metric(b, "kvq_store_hits_total"), hits + 1.0, "the mended store is read again");
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&other_dir);
}

/// A `redis-server` of this test's own on a free loopback port, stopped when dropped.
struct Redis {
    child: Child,
    port: u16,
}

impl Redis {
    /// `None` (with the reason printed) where no `redis-server` can be run, outside CI.
    fn start(port: Option<u16>) -> Option<Self> {
        let port =
            port.unwrap_or_else(|| TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port());
        let child = Command::new("redis-server")
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
            .args(["--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn();
        let child = match child {
            Ok(c) => c,
            Err(e) => {
                assert!(
                    std::env::var_os("CI").is_none(),
                    "CI must have redis-server (.ci/run installs it): {e}"
                );
                eprintln!(
                    "SKIPPED: no redis-server here ({e}); `apt-get install redis-server` runs this test"
                );
                return None;
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(Instant::now() < deadline, "redis-server did not start on port {port}");
            std::thread::sleep(Duration::from_millis(20));
        }
        Some(Self { child, port })
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/0", self.port)
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Two servers share a Redis store; Redis killed in the middle of the run, then restarted
/// empty: both go on serving the texts they compute, count the errors, and reconnect by
/// themselves. A server started while Redis is down serves too.
#[test]
fn two_servers_share_redis_and_outlive_its_outages() {
    let Some(mut redis) = Redis::start(None) else { return };
    let url = redis.url();
    let (a, b, reference) = (start(with_store(&url)), start(with_store(&url)), plain());
    for (n, salt) in [(37, 31), (69, 32), (133, 33)] {
        shared_once(a, b, reference, &ids(n, salt));
    }
    assert_eq!(metric(a, "kvq_store_errors_total") + metric(b, "kvq_store_errors_total"), 0.0);
    let port = redis.port;
    redis.stop();
    let prompt = ids(120, 34);
    let want = run(reference, &prompt);
    assert_eq!(run(a, &prompt), want, "A with Redis down");
    assert_eq!(run(b, &prompt), want, "B with Redis down");
    assert!(metric(b, "kvq_store_errors_total") > 0.0);
    // Down at start: it starts and serves all the same.
    let late = start(with_store(&url));
    assert_eq!(run(late, &prompt), want, "started with Redis down");
    // Restarted empty on the same port: writes and reads resume.
    let _redis = Redis::start(Some(port)).expect("redis-server ran a moment ago");
    let again = ids(150, 35);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let written = metric(a, "kvq_store_prefixes_written_total");
        let p: Vec<u32> = again.iter().map(|&t| t + (written as u32 % 7)).collect();
        assert_eq!(run(a, &p), run(reference, &p));
        std::thread::sleep(Duration::from_millis(200));
        if metric(a, "kvq_store_prefixes_written_total") > written {
            let hits = metric(late, "kvq_store_hits_total");
            assert_eq!(run(late, &p), run(reference, &p));
            assert_eq!(metric(late, "kvq_store_hits_total"), hits + 1.0, "the late server reads it");
            break;
        }
        assert!(Instant::now() < deadline, "no write after Redis came back");
    }
}

/// A small tmpfs, unmounted when dropped; `None` (said) where mounting is not allowed.
struct SmallDisk(PathBuf);

impl SmallDisk {
    fn mount(bytes: usize) -> Option<Self> {
        let dir = temp_dir("full-disk");
        std::fs::create_dir_all(&dir).unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
            .arg(&dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            eprintln!("SKIPPED the full-disk case: mounting a tmpfs needs root here");
            let _ = std::fs::remove_dir(&dir);
            return None;
        }
        Some(Self(dir))
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A directory store on a disk that fills up: writes fail and are counted, no entry is left
/// torn, and every text is the one a plain server computes, from A and from B.
#[test]
fn a_full_disk_costs_writes_never_texts() {
    let Some(disk) = SmallDisk::mount(192 << 10) else { return };
    let url = format!("dir://{}", disk.0.display());
    let (a, b, reference) = (start(with_store(&url)), start(with_store(&url)), plain());
    for salt in 0..6 {
        let prompt = ids(300 + 37 * salt as usize, 40 + salt);
        let want = run(reference, &prompt);
        assert_eq!(run(a, &prompt), want, "A, prompt {salt}");
        std::thread::sleep(Duration::from_millis(300));
        assert_eq!(run(b, &prompt), want, "B, prompt {salt}");
    }
    assert!(metric(a, "kvq_store_errors_total") > 0.0, "the disk never filled");
    assert_eq!(metric(b, "kvq_store_refused_total"), 0.0, "a torn entry was read");
    // Nothing but whole entries on the disk.
    for (kind, _, path) in entries(&disk.0) {
        assert!(kind == 1 || kind == 2, "{}", path.display());
    }
    let temps = std::fs::read_dir(&disk.0)
        .unwrap()
        .filter(|e| e.as_ref().unwrap().file_name().to_string_lossy().starts_with('.'))
        .count();
    assert_eq!(temps, 0, "temporary files left on the full disk");
}
