//! Automatic prefix caching: prompts that begin like an earlier one reuse its cached blocks.
//!
//! While a request's prompt is prefilled, the engine keeps a copy-on-write fork of its
//! sequence at the last block boundary before the prompt's last token (the boundary `B`;
//! blocks follow the sink tokens): prefill chunks stop at `B`, and the fork is taken there. A
//! later prompt whose first `B` tokens are the same forks that snapshot and prefills only the
//! rest.
//!
//! Reuse is exact: the snapshot is what a prefill of those `B` tokens holds, taken when the
//! sequence had exactly `B` tokens (a prompt chunk's tokens attend as decode steps would, so
//! where chunks stop changes nothing). Cutting a longer sequence back to `B` would not do:
//! once a prompt runs a whole block past `B`, the cache has quantized a block that a sequence
//! of `B` tokens still holds in full precision. So a hit changes no output, only the time to
//! the first token. The same snapshots go to the shared store ([`crate::store`]).
//!
//! Snapshots are keyed by a hash chain over the token ids of each block, the key of the block
//! before, and a fingerprint of the model and the cache config; a hit is confirmed by
//! comparing the tokens themselves, so a hash collision can never serve another prompt's
//! blocks. Unreferenced snapshots are evicted least recently used: when the pool needs their
//! blocks, or past a count limit.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, RwLock};

use kvq::cache::SeqId;

/// FNV-1a over 64 bits: stable across processes and releases, cheap, and never trusted alone
/// (hits are confirmed by the tokens).
fn fnv(h: u64, bytes: &[u8]) -> u64 {
    fnv_bytes(h, bytes.iter().copied())
}

/// [`fnv`] over token ids, each as its 4 little-endian bytes.
fn fnv_tokens(h: u64, tokens: &[u32]) -> u64 {
    fnv_bytes(h, tokens.iter().flat_map(|t| t.to_le_bytes()))
}

fn fnv_bytes(mut h: u64, bytes: impl Iterator<Item = u8>) -> u64 {
    for b in bytes {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The chain's root for a model and a cache config.
pub fn root(model_fingerprint: &[u8], config_digest: &[u8]) -> u64 {
    fnv(fnv(0xcbf2_9ce4_8422_2325, model_fingerprint), config_digest)
}

/// The chain's root for a model's fingerprint and a cache config (its pool size left out: it
/// is no part of what a block holds).
pub fn cache_root(model_fingerprint: &[u8], cache: &kvq::cache::KvCacheConfig) -> u64 {
    let json = kvq::cache::KvCacheConfig { blocks_per_layer: 0, ..cache.clone() }.to_json();
    root(model_fingerprint, json.as_bytes())
}

/// Where blocks begin and end: after `sinks` tokens, every `block` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    /// Sink tokens before the first block.
    pub sinks: usize,
    /// Tokens per block.
    pub block: usize,
}

impl Geometry {
    /// The largest block boundary that leaves at least one token of `len` to prefill, if one
    /// closes at least one block.
    pub fn boundary_before(&self, len: usize) -> Option<usize> {
        let body = len.checked_sub(1)?.checked_sub(self.sinks)?;
        let blocks = body / self.block.max(1);
        (blocks > 0).then_some(self.sinks + blocks * self.block)
    }

    /// `(boundary, key)` of every block boundary of `tokens` that leaves a token to prefill,
    /// shortest first.
    pub fn keys(&self, root: u64, tokens: &[u32]) -> Vec<(usize, u64)> {
        let Some(last) = self.boundary_before(tokens.len()) else { return Vec::new() };
        let mut key = fnv_tokens(root, &tokens[..self.sinks]);
        (self.sinks + self.block..=last)
            .step_by(self.block.max(1))
            .map(|end| {
                key = fnv_tokens(key, &tokens[end - self.block..end]);
                (end, key)
            })
            .collect()
    }
}

impl Geometry {
    /// The longest boundary of `prompt` whose key is in `held` (0: none).
    pub fn longest_held(&self, root: u64, prompt: &[u32], held: &HashSet<u64>) -> usize {
        self.keys(root, prompt).into_iter().rev().find(|(_, k)| held.contains(k)).map_or(0, |(end, _)| end)
    }
}

/// One kept snapshot.
#[derive(Debug)]
struct Entry {
    seq: SeqId,
    tokens: Vec<u32>,
    last_used: u64,
}

/// The snapshots; the engine owns the cache they live in.
#[derive(Debug)]
pub struct PrefixCache {
    geometry: Geometry,
    root: u64,
    max_entries: usize,
    entries: HashMap<u64, Entry>,
    clock: u64,
    /// The keys of `entries`, for other threads (the HTTP handlers, which skip the shared
    /// store when this cache holds a prefix at least as long).
    held: Arc<RwLock<HashSet<u64>>>,
}

/// The keys a [`PrefixCache`] holds, readable from other threads.
pub type HeldKeys = Arc<RwLock<HashSet<u64>>>;

impl PrefixCache {
    /// An empty prefix cache keeping at most `max_entries` snapshots (0: none).
    pub fn new(geometry: Geometry, root: u64, max_entries: usize) -> Self {
        Self { geometry, root, max_entries, entries: HashMap::new(), clock: 0, held: Arc::default() }
    }

    /// Whether snapshots are kept at all.
    pub fn enabled(&self) -> bool {
        self.max_entries > 0
    }

    /// The keys held, kept up to date as snapshots come and go.
    pub fn held_keys(&self) -> HeldKeys {
        Arc::clone(&self.held)
    }

    fn held(&self) -> std::sync::RwLockWriteGuard<'_, HashSet<u64>> {
        self.held.write().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Snapshots held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no snapshot is held.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The longest snapshot whose tokens begin `prompt`: its sequence and length.
    pub fn lookup(&mut self, prompt: &[u32]) -> Option<(SeqId, usize)> {
        if !self.enabled() {
            return None;
        }
        self.clock += 1;
        for (end, key) in self.geometry.keys(self.root, prompt).into_iter().rev() {
            if let Some(e) = self.entries.get_mut(&key)
                && e.tokens[..] == prompt[..end]
            {
                e.last_used = self.clock;
                return Some((e.seq, end));
            }
        }
        None
    }

    /// Where a snapshot of a prefilled `prompt` would be cut, and whether one is wanted (none
    /// held for that prefix yet).
    pub fn wants(&self, prompt: &[u32]) -> Option<usize> {
        if !self.enabled() {
            return None;
        }
        let (end, key) = *self.geometry.keys(self.root, prompt).last()?;
        (!self.entries.contains_key(&key)).then_some(end)
    }

    /// Keeps `seq`, holding the first `end` tokens of `prompt`. Returns the sequences evicted
    /// to stay within the count limit, for the caller to free.
    pub fn insert(&mut self, prompt: &[u32], end: usize, seq: SeqId) -> Vec<SeqId> {
        let Some(&(_, key)) = self.geometry.keys(self.root, &prompt[..end + 1]).last() else {
            return vec![seq];
        };
        self.clock += 1;
        let mut evicted = Vec::new();
        if let Some(old) =
            self.entries.insert(key, Entry { seq, tokens: prompt[..end].to_vec(), last_used: self.clock })
        {
            evicted.push(old.seq);
        }
        self.held().insert(key);
        while self.entries.len() > self.max_entries {
            match self.evict_lru() {
                Some(s) => evicted.push(s),
                None => break,
            }
        }
        evicted
    }

    /// Removes the least recently used snapshot; its sequence is the caller's to free.
    pub fn evict_lru(&mut self) -> Option<SeqId> {
        let key = *self.entries.iter().min_by_key(|(_, e)| e.last_used)?.0;
        self.held().remove(&key);
        self.entries.remove(&key).map(|e| e.seq)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const G: Geometry = Geometry { sinks: 4, block: 8 };

    #[test]
    fn boundaries_follow_the_sinks_and_leave_a_token() {
        assert_eq!(G.boundary_before(12), None, "4 sinks + 8 tokens: nothing left to prefill");
        assert_eq!(G.boundary_before(13), Some(12));
        assert_eq!(G.boundary_before(20), Some(12));
        assert_eq!(G.boundary_before(21), Some(20));
        let tokens: Vec<u32> = (0..30).collect();
        let keys = G.keys(1, &tokens);
        assert_eq!(keys.iter().map(|k| k.0).collect::<Vec<_>>(), [12, 20, 28]);
        // The chain: a change in an early block changes every later key.
        let mut other = tokens.clone();
        other[5] = 99;
        let k2 = G.keys(1, &other);
        assert!(keys.iter().zip(&k2).all(|(a, b)| a.1 != b.1));
        assert_ne!(G.keys(2, &tokens)[0].1, keys[0].1, "the root (model, config) is in every key");
    }

    #[test]
    fn the_longest_confirmed_snapshot_is_found_and_the_oldest_evicted() {
        let mut pc = PrefixCache::new(G, 7, 2);
        let a: Vec<u32> = (0..25).collect();
        assert_eq!(pc.wants(&a), Some(20));
        assert!(pc.insert(&a, 20, SeqId(1)).is_empty());
        assert_eq!(pc.wants(&a), None);
        let mut b = a.clone();
        b.extend(100..110);
        assert_eq!(pc.lookup(&b), Some((SeqId(1), 20)));
        assert_eq!(pc.lookup(&a[..20]), None, "a prompt must keep a token to prefill");
        let mut c = a.clone();
        c[15] = 7;
        assert_eq!(pc.lookup(&c), None);
        assert!(pc.insert(&c, 20, SeqId(2)).is_empty());
        pc.lookup(&b);
        let d: Vec<u32> = (50..80).collect();
        let end = pc.wants(&d).unwrap();
        assert_eq!(pc.insert(&d, end, SeqId(3)), [SeqId(2)], "c was used least recently");
        assert_eq!(pc.len(), 2);
    }
}
