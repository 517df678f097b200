//! Where a model keeps one sequence's keys and values: kvq's quantized cache, or a plain f32
//! cache that is the reference every quantized run is measured against.

use std::borrow::{Borrow, BorrowMut};

use kvq::attention::{AttentionOptions, ScorePath};
use kvq::cache::SeqId;
use kvq::cache::{KvCacheConfig, QuantizedKvCache};

use crate::error::{Error, Result};

/// One sequence's KV cache as a model sees it: per layer, append a token's keys and values,
/// and attend a token's queries over everything appended so far.
///
/// Rows are head-major within a token: keys and values `kv_heads × head_dim`, queries and
/// outputs `query_heads × head_dim`; the query heads of a GQA group are consecutive.
pub trait KvStore {
    /// Appends one token's keys and values to `layer`.
    ///
    /// # Errors
    /// The store's own (a full pool, non-finite values for a quantized cache).
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()>;

    /// Causal decode attention of one token's queries over the tokens of `layer`, scaled by
    /// `1/sqrt(head_dim)`, into `out`.
    ///
    /// # Errors
    /// The store's own.
    fn attention(&self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()>;

    /// Checks that `tokens` more tokens fit in every layer, changing nothing; a model calls
    /// it before a forward pass so that a full cache refuses the pass instead of failing half
    /// way through the layers. The default accepts everything (a store that grows).
    ///
    /// # Errors
    /// The store's own (a pool too small).
    fn check_capacity(&self, tokens: usize) -> Result<()> {
        let _ = tokens;
        Ok(())
    }

    /// Tokens stored in `layer`.
    fn len(&self, layer: usize) -> usize;

    /// Whether `layer` holds no token.
    fn is_empty(&self, layer: usize) -> bool {
        self.len(layer) == 0
    }

    /// Shortens every layer to `len` tokens (an error if some layer cannot be cut there).
    ///
    /// # Errors
    /// The store's own; nothing changes on error.
    fn truncate(&mut self, len: usize) -> Result<()>;

    /// Empties the store, for a new sequence.
    ///
    /// # Errors
    /// The store's own.
    fn reset(&mut self) -> Result<()>;

    /// Bytes the store holds for this sequence (a quantized cache: codes, parameters, tails
    /// and sinks, as its memory report counts them).
    fn used_bytes(&self) -> usize;
}

/// A plain f32 cache: every key and value as it came, attention in f32 with a GQA-aware loop
/// (each K/V row read once for its whole group of query heads). The reference.
#[derive(Debug, Clone)]
pub struct F32Cache {
    kv_heads: usize,
    query_heads: usize,
    head_dim: usize,
    k: Vec<Vec<f32>>,
    v: Vec<Vec<f32>>,
}

impl F32Cache {
    /// An empty cache of `layers` layers.
    ///
    /// # Errors
    /// [`Error::Shape`] when the query heads are not a positive multiple of the KV heads.
    pub fn new(layers: usize, kv_heads: usize, query_heads: usize, head_dim: usize) -> Result<Self> {
        if kv_heads == 0 || head_dim == 0 || query_heads == 0 || !query_heads.is_multiple_of(kv_heads) {
            return Err(Error::Shape(format!(
                "{query_heads} query heads over {kv_heads} KV heads of {head_dim} channels"
            )));
        }
        Ok(Self { kv_heads, query_heads, head_dim, k: vec![Vec::new(); layers], v: vec![Vec::new(); layers] })
    }

    fn check_layer(&self, layer: usize) -> Result<()> {
        if layer >= self.k.len() {
            return Err(Error::Shape(format!("layer {layer} of {}", self.k.len())));
        }
        Ok(())
    }
}

impl KvStore for F32Cache {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_layer(layer)?;
        let row = self.kv_heads * self.head_dim;
        if k.len() != row || v.len() != row {
            return Err(Error::Shape(format!("k has {} values, v {}, a token {row}", k.len(), v.len())));
        }
        self.k[layer].extend_from_slice(k);
        self.v[layer].extend_from_slice(v);
        Ok(())
    }

    fn attention(&self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
        self.check_layer(layer)?;
        let (h, g, d) = (self.kv_heads, self.query_heads / self.kv_heads, self.head_dim);
        if q.len() != self.query_heads * d || out.len() != q.len() {
            return Err(Error::Shape(format!(
                "q has {} values, out {}, expected {}",
                q.len(),
                out.len(),
                self.query_heads * d
            )));
        }
        let n = self.len(layer);
        out.fill(0.0);
        if n == 0 {
            return Ok(());
        }
        let (keys, values) = (&self.k[layer], &self.v[layer]);
        let scale = 1.0 / (d as f32).sqrt();
        let mut scores = vec![0f32; g * n];
        for kv in 0..h {
            let qs = &q[kv * g * d..(kv + 1) * g * d];
            for t in 0..n {
                let krow = &keys[(t * h + kv) * d..][..d];
                for (j, qrow) in qs.chunks_exact(d).enumerate() {
                    scores[j * n + t] = dot(qrow, krow) * scale;
                }
            }
            for s in scores.chunks_exact_mut(n) {
                let m = s.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f32;
                for x in s.iter_mut() {
                    *x = (*x - m).exp();
                    sum += *x;
                }
                let inv = 1.0 / sum;
                s.iter_mut().for_each(|x| *x *= inv);
            }
            let o = &mut out[kv * g * d..(kv + 1) * g * d];
            for t in 0..n {
                let vrow = &values[(t * h + kv) * d..][..d];
                for (j, orow) in o.chunks_exact_mut(d).enumerate() {
                    let p = scores[j * n + t];
                    orow.iter_mut().zip(vrow).for_each(|(a, &b)| *a += p * b);
                }
            }
        }
        Ok(())
    }

    fn len(&self, layer: usize) -> usize {
        self.k.get(layer).map_or(0, |k| k.len() / (self.kv_heads * self.head_dim))
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        let row = self.kv_heads * self.head_dim;
        for (k, v) in self.k.iter_mut().zip(&mut self.v) {
            k.truncate(len * row);
            v.truncate(len * row);
        }
        Ok(())
    }

    fn reset(&mut self) -> Result<()> {
        self.truncate(0)
    }

    fn used_bytes(&self) -> usize {
        self.k.iter().chain(&self.v).map(|x| x.len() * 4).sum()
    }
}

/// An f32 dot product in 8 independent lanes, which the compiler vectorizes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ca.remainder().iter().zip(cb.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// One sequence in kvq's [`QuantizedKvCache`]: its residual window, sinks and per-layer specs
/// as the config says, attention through kvq's fused kernels. The cache is the store's own
/// ([`KvqStore`]) or borrowed from a caller that keeps many sequences in one pool
/// ([`KvqSeq::borrowed`], what a server does).
#[derive(Debug, Clone)]
pub struct KvqSeq<C> {
    cache: C,
    seq: SeqId,
    path: ScorePath,
}

/// A store that owns its cache, with one sequence in it.
pub type KvqStore = KvqSeq<QuantizedKvCache>;

impl KvqSeq<QuantizedKvCache> {
    /// A cache made from `config`, with one sequence in it.
    ///
    /// # Errors
    /// [`Error::Kvq`] for an invalid config.
    pub fn new(config: KvCacheConfig, path: ScorePath) -> Result<Self> {
        let mut cache = QuantizedKvCache::new(config)?;
        let seq = cache.create();
        Ok(Self { cache, seq, path })
    }
}

impl<'a> KvqSeq<&'a mut QuantizedKvCache> {
    /// Sequence `seq` of a cache that holds others too; nothing is checked until the first
    /// call (an unknown sequence is then [`Error::Kvq`]).
    pub fn borrowed(cache: &'a mut QuantizedKvCache, seq: SeqId, path: ScorePath) -> Self {
        Self { cache, seq, path }
    }
}

impl<C: Borrow<QuantizedKvCache>> KvqSeq<C> {
    /// The cache.
    pub fn cache(&self) -> &QuantizedKvCache {
        self.cache.borrow()
    }

    /// The sequence this store reads and writes.
    pub fn seq(&self) -> SeqId {
        self.seq
    }
}

impl<C: BorrowMut<QuantizedKvCache>> KvStore for KvqSeq<C> {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        Ok(self.cache.borrow_mut().append(self.seq, layer, k, v)?)
    }

    fn attention(&self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
        Ok(self.cache().attention(&AttentionOptions::with_path(self.path), self.seq, layer, q, out)?)
    }

    fn check_capacity(&self, tokens: usize) -> Result<()> {
        Ok(self.cache().check_capacity(self.seq, tokens)?)
    }

    fn len(&self, layer: usize) -> usize {
        self.cache().len(self.seq, layer).unwrap_or(0)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        Ok(self.cache.borrow_mut().truncate(self.seq, len)?)
    }

    /// Empties the sequence; its reservation, if any, stays.
    fn reset(&mut self) -> Result<()> {
        self.truncate(0)
    }

    /// Bytes in use in the whole cache (every sequence of a borrowed one).
    fn used_bytes(&self) -> usize {
        self.cache().used_bytes()
    }
}
