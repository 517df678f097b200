//! Calibration from the model itself: the keys and queries each layer writes and reads, as
//! a cache sees them (after RoPE), and the bits per key channel (`-qa` specs) fitted to them.
//!
//! [`Recorder`] is a [`KvStore`] that serves attention from an f32 cache and keeps every key
//! appended and every query asked; [`channel_bits`] runs calibration tokens through the model
//! with it and fits one [`ChannelBits`] map per layer and KV head
//! ([`kvq::cache::fit_heads`]: the spec's own per-channel error at each width, weighted by the
//! mean squared query of each channel over the query heads that read the KV head).

use std::cell::RefCell;

use kvq::cache::{ChannelBits, QuantSpec, Shape};
use kvq::prelude::Tensor;

use crate::error::{Error, Result};
use crate::model::LlamaModel;
use crate::store::{F32Cache, KvStore};

/// An f32 cache that records the keys appended and the queries that attend, per layer.
#[derive(Debug, Clone)]
pub struct Recorder {
    inner: F32Cache,
    keys: Vec<Vec<f32>>,
    /// Attention takes `&self`: the queries go into a cell.
    queries: RefCell<Vec<Vec<f32>>>,
}

impl Recorder {
    /// A recorder for `model`'s shape.
    ///
    /// # Errors
    /// As [`LlamaModel::f32_cache`].
    pub fn new(model: &LlamaModel) -> Result<Self> {
        let layers = model.config().layers;
        Ok(Self {
            inner: model.f32_cache()?,
            keys: vec![Vec::new(); layers],
            queries: RefCell::new(vec![Vec::new(); layers]),
        })
    }

    /// Per layer, the keys appended (token after token, `kv_heads × head_dim` each) and the
    /// queries that attended (`query_heads × head_dim` each).
    pub fn into_parts(self) -> (Vec<Vec<f32>>, Vec<Vec<f32>>) {
        (self.keys, self.queries.into_inner())
    }
}

impl KvStore for Recorder {
    fn append(&mut self, layer: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.inner.append(layer, k, v)?;
        self.keys[layer].extend_from_slice(k);
        Ok(())
    }

    fn attention(&self, layer: usize, q: &[f32], out: &mut [f32]) -> Result<()> {
        self.inner.attention(layer, q, out)?;
        self.queries.borrow_mut()[layer].extend_from_slice(q);
        Ok(())
    }

    fn len(&self, layer: usize) -> usize {
        self.inner.len(layer)
    }

    fn truncate(&mut self, len: usize) -> Result<()> {
        self.inner.truncate(len)
    }

    fn reset(&mut self) -> Result<()> {
        self.keys.iter_mut().chain(self.queries.get_mut()).for_each(Vec::clear);
        self.inner.reset()
    }

    fn used_bytes(&self) -> usize {
        self.inner.used_bytes()
    }
}

/// Runs `tokens` through `model` from an empty cache and returns what it recorded.
///
/// # Errors
/// The model's ([`LlamaModel::forward`]).
pub fn record(model: &LlamaModel, tokens: &[u32]) -> Result<Recorder> {
    let mut rec = Recorder::new(model)?;
    model.forward(&mut rec, tokens)?;
    Ok(rec)
}

/// One [`ChannelBits`] map per layer and KV head for the `-qa` key spec `spec`, fitted on the
/// keys and queries of `tokens` run through `model` (see the module's description): pass the
/// result to [`kvq::cache::KvCacheConfigBuilder::channel_bits`], layer by layer. Both
/// channels of each RoPE pair get the same width, in the model's pairing.
///
/// # Errors
/// [`Error::Eval`] for a spec without `-qa` or calibration tokens that hold no whole token
/// group of the spec (or that [`ChannelBits::fit`] refuses otherwise); the model's.
pub fn channel_bits(model: &LlamaModel, tokens: &[u32], spec: &QuantSpec) -> Result<Vec<Vec<ChannelBits>>> {
    if !spec.channel_bits() {
        return Err(Error::Eval(format!("{spec} has no bits per channel (-qa) to fit")));
    }
    let (keys, queries) = record(model, tokens)?.into_parts();
    let c = model.config();
    let n = tokens.len();
    // Recorded token after token (`[token][head][channel]`) into `[head, token, channel]`.
    let by_head = |rows: &[f32], heads: usize| {
        let d = c.head_dim;
        let data =
            (0..heads).flat_map(|h| (0..n).flat_map(move |t| &rows[(t * heads + h) * d..][..d])).copied();
        Tensor::new(Shape::new(heads, n, d), data.collect())
    };
    (0..c.layers)
        .map(|l| {
            let fit_err =
                |e: kvq::cache::QuantError| Error::Eval(format!("layer {l}: bits per channel: {e}"));
            let (k, q) = (
                by_head(&keys[l], c.kv_heads).map_err(fit_err)?,
                by_head(&queries[l], c.heads).map_err(fit_err)?,
            );
            kvq::cache::fit_heads(&k, &q, spec, Some(c.rope_pairing)).map_err(fit_err)
        })
        .collect()
}
