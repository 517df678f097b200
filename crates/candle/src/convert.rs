//! Between candle [`Tensor`]s and kvq's cache: appending a model's keys and values and running
//! decode attention on candle tensors, copying only where the layout forces it.
//!
//! kvq's cache takes one token's keys (or values) as `kv_heads × head_dim` contiguous f32, and a
//! query as `query_heads × head_dim`. A contiguous f32 tensor on the CPU in that order is read
//! in place; any other dtype (f16, bf16), a strided view or a head-major layout is converted or
//! transposed once.

use std::borrow::Cow;

use candle_core::{DType, Device, Storage, Tensor};
use kvq::attention::{AttentionOptions, ScorePath};
use kvq::cache::QuantizedKvCache;
use kvq::cache::SeqId;

use crate::error::{Error, Result};

/// Calls `f` with the tensor's elements in row-major order as f32: in place when the tensor is
/// a contiguous f32 CPU tensor, else after one conversion (f16, bf16, other float dtypes,
/// strided layouts). Non-CPU tensors are refused.
///
/// # Errors
/// [`Error::Shape`] for a tensor not on the CPU or of an integer dtype; candle errors.
pub fn with_f32<R>(t: &Tensor, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
    if !matches!(t.device(), Device::Cpu) {
        return Err(Error::Shape(format!(
            "tensor on {:?}: kvq-candle works on the CPU",
            t.device().location()
        )));
    }
    if !matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
        return Err(Error::Shape(format!("tensor of {:?}: keys, values and queries are float", t.dtype())));
    }
    if t.dtype() == DType::F32 {
        let (storage, layout) = t.storage_and_layout();
        if let (Storage::Cpu(cpu), Some((start, end))) = (&*storage, layout.contiguous_offsets()) {
            let all = cpu.as_slice::<f32>()?;
            return Ok(f(&all[start..end]));
        }
    }
    let owned = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    Ok(f(&owned))
}

/// The tensor's elements as f32, in a new vector (read in place and copied once for a
/// contiguous f32 tensor, converted otherwise).
///
/// # Errors
/// As [`with_f32`].
pub fn to_f32_vec(t: &Tensor) -> Result<Vec<f32>> {
    with_f32(t, <[f32]>::to_vec)
}

/// How the dimensions of a K/V tensor are laid out.
fn token_major(t: &Tensor, kv_heads: usize, head_dim: usize) -> Result<Cow<'_, Tensor>> {
    let dims = t.dims();
    match *dims {
        // [tokens, kv_heads, head_dim]: what a projection reshapes to.
        [_, h, d] if h == kv_heads && d == head_dim => Ok(Cow::Borrowed(t)),
        // [kv_heads, head_dim]: one token.
        [h, d] if h == kv_heads && d == head_dim => Ok(Cow::Owned(t.unsqueeze(0)?)),
        // [1, kv_heads, tokens, head_dim]: candle's attention layout (batch, heads, seq, dim).
        [1, h, _, d] if h == kv_heads && d == head_dim => Ok(Cow::Owned(t.squeeze(0)?.transpose(0, 1)?)),
        _ => Err(Error::Shape(format!(
            "keys/values shaped {dims:?}: expected [tokens, {kv_heads}, {head_dim}], [{kv_heads}, {head_dim}] or \
             [1, {kv_heads}, tokens, {head_dim}]"
        ))),
    }
}

/// Appends the keys and values of one or more tokens to `layer` of `seq`.
///
/// `k` and `v` are shaped `[tokens, kv_heads, head_dim]`, `[kv_heads, head_dim]` (one token) or
/// `[1, kv_heads, tokens, head_dim]` (candle's attention layout), in f32, f16 or bf16. Token
/// after token goes through [`QuantizedKvCache::append`]; a failure leaves the tokens before
/// it appended (a cache error names the cause; [`QuantizedKvCache::truncate`] undoes them).
///
/// # Errors
/// [`Error::Shape`] for mismatched tensors; [`Error::Kvq`] from the cache.
pub fn append(cache: &mut QuantizedKvCache, seq: SeqId, layer: usize, k: &Tensor, v: &Tensor) -> Result<()> {
    let (h, d) = (cache.config().kv_heads, cache.config().head_dim);
    let (k, v) = (token_major(k, h, d)?, token_major(v, h, d)?);
    if k.dims() != v.dims() {
        return Err(Error::Shape(format!("keys {:?} and values {:?} differ", k.dims(), v.dims())));
    }
    let row = h * d;
    with_f32(&k, |ks| {
        with_f32(&v, |vs| {
            for (kr, vr) in ks.chunks_exact(row).zip(vs.chunks_exact(row)) {
                cache.append(seq, layer, kr, vr)?;
            }
            Ok(())
        })
    })??
}

/// Decode attention of one token's queries over `layer` of `seq`.
///
/// `q` is `[query_heads, head_dim]` or `[1, query_heads, 1, head_dim]` (f32, f16 or bf16); the
/// result has `q`'s shape, in f32.
///
/// # Errors
/// [`Error::Shape`]; [`Error::Kvq`] from the cache.
pub fn attention(
    cache: &QuantizedKvCache,
    path: ScorePath,
    seq: SeqId,
    layer: usize,
    q: &Tensor,
) -> Result<Tensor> {
    let (heads, d) = (cache.config().query_heads, cache.config().head_dim);
    match *q.dims() {
        [h, dd] | [1, h, 1, dd] if h == heads && dd == d => {}
        ref dims => {
            return Err(Error::Shape(format!(
                "query shaped {dims:?}: expected [{heads}, {d}] or [1, {heads}, 1, {d}]"
            )));
        }
    }
    let mut out = vec![0f32; heads * d];
    with_f32(q, |qs| cache.attention(&AttentionOptions::with_path(path), seq, layer, qs, &mut out))??;
    Ok(Tensor::from_vec(out, q.shape(), &Device::Cpu)?)
}
