//! Model-based test: random operations applied to the cache and to a plain `Vec<f32>` model.
//!
//! After every step each live sequence must dequantize to what quantizing the model's tokens
//! with the same grouping gives (bit for bit), no block may leak, reference counts must match
//! the block tables, and a failed operation must leave the cache exactly as it was. Specs
//! include f32 parameters and calibrated (static) ones; caches are reloaded from their bytes
//! mid-run; values too large for an f16 tail or an f16 parameter are appended too.

use std::collections::BTreeMap;

use half::f16;
use kvq_cache_layout::{CacheConfig, CacheError, PagedCache, Segment, SeqId, TailDtype};
use kvq_quant_core::calibration::Part;
use kvq_quant_core::{
    Calibration, ChannelBits, QuantSpec, Shape, Tensor, quantize, quantize_channel_bits, quantize_with_ranges,
};
use proptest::prelude::*;

#[derive(Debug, Clone)]
enum Op {
    Create,
    Append {
        seq: usize,
        layer: usize,
        seed: u64,
    },
    AppendAll {
        seq: usize,
        seed: u64,
    },
    Extend {
        seq: usize,
        layer: usize,
        tokens: usize,
        seed: u64,
    },
    Fork {
        seq: usize,
    },
    Truncate {
        seq: usize,
        len: usize,
    },
    Free {
        seq: usize,
    },
    Reload,
    ExportImport {
        seq: usize,
    },
    BadAppend {
        seq: usize,
    },
    /// Hold blocks for the next `tokens` tokens of one layer (0 releases).
    Reserve {
        seq: usize,
        layer: usize,
        tokens: usize,
    },
    /// An append with one value of 70000: over f16's range (an f16 tail cannot hold it) and
    /// over what f16 parameters allow, but fine for f32 parameters away from f16 tails.
    BigAppend {
        seq: usize,
        layer: usize,
        part: usize,
        seed: u64,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        1 => Just(Op::Create),
        6 => (0..8usize, 0..2usize, any::<u64>()).prop_map(|(seq, layer, seed)| Op::Append { seq, layer, seed }),
        3 => (0..8usize, any::<u64>()).prop_map(|(seq, seed)| Op::AppendAll { seq, seed }),
        3 => (0..8usize, 0..2usize, 0..11usize, any::<u64>()).prop_map(|(seq, layer, tokens, seed)| Op::Extend { seq, layer, tokens, seed }),
        2 => (0..8usize).prop_map(|seq| Op::Fork { seq }),
        2 => (0..8usize, 0..20usize).prop_map(|(seq, len)| Op::Truncate { seq, len }),
        1 => (0..8usize).prop_map(|seq| Op::Free { seq }),
        1 => Just(Op::Reload),
        1 => (0..8usize).prop_map(|seq| Op::ExportImport { seq }),
        1 => (0..8usize).prop_map(|seq| Op::BadAppend { seq }),
        1 => (0..8usize, 0..2usize, 0..2usize, any::<u64>()).prop_map(|(seq, layer, part, seed)| Op::BigAppend { seq, layer, part, seed }),
        3 => (0..8usize, 0..2usize, 0..14usize).prop_map(|(seq, layer, tokens)| Op::Reserve { seq, layer, tokens }),
    ]
}

const TAILS: [TailDtype; 3] = [TailDtype::F16, TailDtype::F32, TailDtype::Int8];

/// A row as a tail of `dtype` stores it (the documented rounding of each type, written out
/// again here).
fn stored(dtype: TailDtype, x: &[f32], d: usize) -> Vec<f32> {
    match dtype {
        TailDtype::F32 => x.to_vec(),
        TailDtype::F16 => x.iter().map(|&v| f16::from_f32(v).to_f32()).collect(),
        TailDtype::Int8 => x
            .chunks(d)
            .flat_map(|row| {
                let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                // An integer level, so that −0.0 comes back as 0.
                let level = move |v: f32| (v / scale).round_ties_even().clamp(-127.0, 127.0) as i32;
                row.iter().map(move |&v| if scale > 0.0 { level(v) as f32 * scale } else { 0.0 })
            })
            .collect(),
        other => panic!("this model does not know tails of {other:?}: write its rounding here"),
    }
}

#[derive(Debug, Clone)]
struct Setup {
    heads: usize,
    d: usize,
    bs: usize,
    residual: usize,
    sinks: usize,
    /// Storage of the window and sinks, `[keys, values]`.
    tail: [TailDtype; 2],
    k: &'static str,
    v: &'static str,
    capacity: usize,
    /// Static ranges for every layer and head (needed by `head` and `tensor` specs; a
    /// `channel` spec with them quantizes at once instead of through the residual window).
    calibrated: bool,
    /// Row specs (per-token, `gN`) keep the residual window too.
    row_window: bool,
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        1..3usize,
        prop::sample::select(vec![8usize, 16]),
        prop::sample::select(vec![2usize, 4]),
        0..3usize,
        0..3usize,
        (0..3usize, 0..4usize),
        prop::sample::select(vec![
            "int4-channel",
            "int3-channel",
            "int2-channel-mse",
            "int8-g4",
            "sym4-token",
            "int4-channel-f32",
            "int3-channel-p8",
            "int2-channel-mse-p8",
            "int4-head",
            "int8-tensor",
            "int3-channel-qa",
        ]),
        prop::sample::select(vec![
            "int4-token",
            "int3-token-mse",
            "int2-g4-mse",
            "fp8e4m3-token",
            "nf4-channel",
            "int4-token-f32",
            "int4-token-p8",
            "int2-g4-mse-p8",
            "int4-head-f32",
            "sym8-g4-f32",
        ]),
        6..30usize,
        any::<bool>(),
        any::<bool>(),
    )
        .prop_map(|(heads, d, bs, residual, sinks, (kt, vt), k, v, capacity, calibrate, row_window)| {
            // Bits per key channel take their ranges from the data: no calibration, so no
            // per-head or per-tensor values beside them.
            // One-byte parameters are a block's own: no calibration either.
            let own = k.contains("-qa") || k.contains("-p8") || v.contains("-p8");
            let fixed = |s: &str| s.contains("-head") || s.contains("-tensor");
            let k = if own && fixed(k) { "int4-channel" } else { k };
            let v = if own && fixed(v) { "int4-token" } else { v };
            Setup {
                heads,
                d,
                bs,
                residual,
                sinks,
                // Values the keys' storage (3) or one of their own.
                tail: [TAILS[kt], TAILS.get(vt).copied().unwrap_or(TAILS[kt])],
                k,
                v,
                capacity,
                // Bits per channel take their ranges from the data: never calibrated.
                calibrated: !own
                    && (calibrate || [k, v].iter().any(|s| s.contains("-head") || s.contains("-tensor"))),
                row_window,
            }
        })
}

/// Ranges from data of the test's own scale (so that some appended values fall outside and
/// are clamped).
fn calibration(s: &Setup) -> Calibration {
    let shape = Shape::new(s.heads, 16, s.d);
    let t = |seed: u64| Tensor::new(shape, values(seed, shape.len())).unwrap();
    Calibration::from_tensors(&[t(1), t(2)], &[t(3), t(4)], None).unwrap()
}

const LAYERS: usize = 2;

/// The model: per sequence, per layer, per part, per head, the appended rows; and per part
/// the number of post-sink tokens quantized into blocks, following the documented rule.
#[derive(Debug, Clone, Default)]
struct ModelSeq {
    rows: Vec<[Vec<Vec<f32>>; 2]>,
    done: Vec<[usize; 2]>,
    /// Per layer, tokens still reserved: appends of up to that many cannot lack blocks.
    reserved: Vec<usize>,
}

/// The map of map index `i` for `int3` keys: uniform at 8 channels; at 16, 2 and 4 bits on the
/// odd and even channels (or the reverse, by `i`), so the stored order is a real permutation.
fn channel_bits(d: usize, i: usize) -> ChannelBits {
    if d < 16 {
        return ChannelBits::uniform(d, 3).unwrap();
    }
    ChannelBits::new((0..d).map(|c| if (c + i).is_multiple_of(2) { 2 } else { 4 }).collect()).unwrap()
}

fn values(seed: u64, n: usize) -> Vec<f32> {
    let mut rng = kvq_quant_core::synth::Rng::new(seed);
    // Mixed scales and an occasional constant run, so zero-range groups occur.
    let scale = [0.01f64, 1.0, 30.0][rng.below(3) as usize];
    let constant = rng.below(8) == 0;
    (0..n).map(|_| if constant { 0.5 } else { (rng.normal() * scale) as f32 }).collect()
}

struct World {
    s: Setup,
    calibration: Option<Calibration>,
    cache: PagedCache,
    model: BTreeMap<SeqId, ModelSeq>,
}

impl World {
    fn spec(&self, part: usize) -> QuantSpec {
        let text = if part == 0 { self.s.k } else { self.s.v };
        text.parse().unwrap()
    }

    /// Whether the part's tokens wait in a tail for their block: per-channel specs without
    /// calibration, row specs with one-byte parameters (a grid per block), and every row spec
    /// when the cache keeps them in the residual window.
    fn channel(&self, part: usize) -> bool {
        let text = if part == 0 { self.s.k } else { self.s.v };
        let row = text.contains("-token") || text.contains("-g");
        (text.contains("channel") && self.calibration.is_none())
            || text.ends_with("-p8")
            || (row && self.s.row_window)
    }

    /// The calibrated ranges of the part's groups for `(layer, head)`, when it is static.
    fn static_ranges(&self, part: usize, layer: usize, head: usize) -> Option<(Vec<f32>, Vec<f32>)> {
        let spec = self.spec(part);
        let text = if part == 0 { self.s.k } else { self.s.v };
        if text.contains("-token") || text.contains("-g") {
            return None;
        }
        let p = if part == 0 { Part::K } else { Part::V };
        let ranges = self.calibration.as_ref()?.group_ranges(p, layer, head, spec.granularity()).unwrap();
        Some(ranges.into_iter().unzip())
    }

    /// A `-qa` K spec's map of `(layer, head)` (see [`channel_bits`]).
    fn map(&self, layer: usize, head: usize) -> Option<ChannelBits> {
        self.spec(0).channel_bits().then(|| channel_bits(self.s.d, layer * self.s.heads + head))
    }

    fn nth(&self, i: usize) -> Option<SeqId> {
        let ids: Vec<SeqId> = self.model.keys().copied().collect();
        (!ids.is_empty()).then(|| ids[i % ids.len()])
    }

    /// Applies a successful append of `n` tokens to the model's layer.
    fn model_append(&mut self, seq: SeqId, layer: usize, k: &[Vec<f32>], v: &[Vec<f32>]) {
        let (bs, r, sinks, d) = (self.s.bs, self.s.residual, self.s.sinks, self.s.d);
        let channel = [self.channel(0), self.channel(1)];
        let m = self.model.get_mut(&seq).unwrap();
        m.reserved[layer] = m.reserved[layer].saturating_sub(k[0].len() / d);
        for (part, data) in [k, v].into_iter().enumerate() {
            for (h, rows) in data.iter().enumerate() {
                m.rows[layer][part][h].extend_from_slice(rows);
            }
        }
        let len = m.rows[layer][0][0].len() / d;
        let p = len.saturating_sub(sinks);
        for (done, channel) in m.done[layer].iter_mut().zip(channel) {
            if channel {
                while p - *done >= (r + 1) * bs {
                    *done += bs;
                }
            } else {
                *done = p;
            }
        }
    }

    fn expected(&self, seq: SeqId, layer: usize, head: usize, part: usize) -> Vec<f32> {
        let (bs, sinks, d) = (self.s.bs, self.s.sinks, self.s.d);
        let m = &self.model[&seq];
        let rows = &m.rows[layer][part][head];
        let len = rows.len() / d;
        let done = m.done[layer][part];
        let full = |x: &[f32]| stored(self.s.tail[part], x, d);
        let n_sinks = len.min(sinks);
        let mut out = full(&rows[..n_sinks * d]);
        let spec = self.spec(part);
        let ranges = self.static_ranges(part, layer, head);
        let q = |tokens: usize, from: usize| {
            let t =
                Tensor::new(Shape::new(1, tokens, d), rows[from * d..(from + tokens) * d].to_vec()).unwrap();
            match &ranges {
                Some((lo, hi)) => quantize_with_ranges(&t, &spec, lo, hi).unwrap().dequantize().into_data(),
                None => quantize(&t, &spec).unwrap().dequantize().into_data(),
            }
        };
        if self.channel(part) {
            // Tokens wait in the tail in its storage type: with an f16 tail the block is
            // quantized from the f16-rounded values, which is all the cache ever saw.
            let stored = full(rows);
            for b in 0..done / bs {
                let from = (sinks + b * bs) * d;
                let t = Tensor::new(Shape::new(1, bs, d), stored[from..from + bs * d].to_vec()).unwrap();
                let back = match (part, self.map(layer, head)) {
                    (0, Some(map)) => quantize_channel_bits(&t, &spec, &[map]).unwrap().dequantize(),
                    _ => quantize(&t, &spec).unwrap().dequantize(),
                };
                out.extend(back.into_data());
            }
            out.extend(full(&rows[(n_sinks + done) * d..]));
        } else {
            for t in sinks..len {
                out.extend(q(1, t));
            }
        }
        out
    }

    fn check(&self) {
        // Every live sequence decodes to the model.
        for &seq in self.model.keys() {
            for layer in 0..LAYERS {
                for head in 0..self.s.heads {
                    for (part, p) in [Part::K, Part::V].into_iter().enumerate() {
                        let got = self.cache.dequantize(seq, layer, head, p).unwrap();
                        let want = self.expected(seq, layer, head, part);
                        assert_eq!(got.len(), want.len(), "seq {seq:?} layer {layer} head {head} {p:?}");
                        for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                            assert!(
                                a.to_bits() == b.to_bits(),
                                "seq {seq:?} L{layer} h{head} {p:?} value {i}: {a} vs {b}"
                            );
                        }
                        let segs = self.cache.segments(seq, layer, head, p).unwrap();
                        let covered: usize = segs
                            .iter()
                            .map(|s| match s {
                                Segment::Full { tokens, .. } => *tokens,
                                Segment::Quantized(b) => b.tokens(),
                            })
                            .sum();
                        assert_eq!(covered, want.len() / self.s.d);
                    }
                }
            }
        }
        // A block table holds the blocks that quantized rows use and no more: the tokens still
        // in every part's full-precision window take none from the pool.
        for &seq in self.model.keys() {
            for layer in 0..LAYERS {
                let quantized = [Part::K, Part::V].map(|p| {
                    let segs = self.cache.segments(seq, layer, 0, p).unwrap();
                    segs.iter().filter(|s| matches!(s, Segment::Quantized(_))).count()
                });
                let table = self.cache.block_table(seq, layer).unwrap().len();
                assert_eq!(table, quantized[0].max(quantized[1]) * self.s.heads, "{seq:?} layer {layer}");
            }
        }
        // Reference counts equal the references in block tables; free = capacity - used.
        let pool = self.cache.pool();
        let mut refs = vec![0u32; pool.capacity()];
        for &seq in self.model.keys() {
            for layer in 0..LAYERS {
                for &id in self.cache.block_table(seq, layer).unwrap() {
                    refs[id as usize] += 1;
                }
            }
        }
        let dump = self.cache.dump_tables();
        let used = refs.iter().filter(|&&r| r > 0).count();
        for (id, &r) in refs.iter().enumerate() {
            assert_eq!(pool.refcount(id as u32), r, "block {id}\n{dump}");
        }
        assert_eq!(pool.free_blocks(), pool.capacity() - used, "leak\n{dump}");
        // Reservations: held blocks add up, fit in the free pool, and cover their tokens.
        let mut held = 0;
        for (&seq, m) in &self.model {
            for layer in 0..LAYERS {
                let r = self.cache.reservation(seq, layer).unwrap();
                assert_eq!(r.tokens, m.reserved[layer], "{seq:?} layer {layer}");
                assert!(r.blocks >= self.cache.blocks_needed(seq, layer, r.tokens).unwrap() || r.tokens == 0);
                held += r.blocks;
            }
        }
        assert_eq!(self.cache.reserved_blocks(), held);
        assert!(held <= pool.free_blocks());
    }

    fn apply(&mut self, op: &Op) {
        let before = self.cache.clone();
        let (heads, d) = (self.s.heads, self.s.d);
        let result: Result<(), CacheError> = match *op {
            Op::Create => {
                let id = self.cache.create();
                let empty = || std::array::from_fn(|_| vec![Vec::new(); heads]);
                self.model.insert(
                    id,
                    ModelSeq {
                        rows: (0..LAYERS).map(|_| empty()).collect(),
                        done: vec![[0, 0]; LAYERS],
                        reserved: vec![0; LAYERS],
                    },
                );
                Ok(())
            }
            Op::Append { seq, layer, seed } => {
                let Some(id) = self.nth(seq) else { return };
                let (k, v) = (values(seed, heads * d), values(seed ^ 1, heads * d));
                let r = self.cache.append(id, layer, &k, &v);
                if r.is_ok() {
                    let split = |x: &[f32]| x.chunks(d).map(<[f32]>::to_vec).collect::<Vec<_>>();
                    self.model_append(id, layer, &split(&k), &split(&v));
                }
                r
            }
            Op::AppendAll { seq, seed } => {
                let Some(id) = self.nth(seq) else { return };
                let (k, v) = (values(seed, LAYERS * heads * d), values(seed ^ 1, LAYERS * heads * d));
                let r = self.cache.append_all_layers(id, &k, &v);
                if r.is_ok() {
                    for layer in 0..LAYERS {
                        let split = |x: &[f32]| {
                            x[layer * heads * d..(layer + 1) * heads * d]
                                .chunks(d)
                                .map(<[f32]>::to_vec)
                                .collect::<Vec<_>>()
                        };
                        self.model_append(id, layer, &split(&k), &split(&v));
                    }
                }
                r
            }
            Op::Extend { seq, layer, tokens, seed } => {
                let Some(id) = self.nth(seq) else { return };
                let shape = Shape::new(heads, tokens, d);
                let k = Tensor::new(shape, values(seed, shape.len())).unwrap();
                let v = Tensor::new(shape, values(seed ^ 1, shape.len())).unwrap();
                let r = self.cache.extend(id, layer, &k, &v);
                if r.is_ok() {
                    let split = |x: &Tensor| {
                        (0..heads)
                            .map(|h| x.data()[h * tokens * d..(h + 1) * tokens * d].to_vec())
                            .collect::<Vec<_>>()
                    };
                    self.model_append(id, layer, &split(&k), &split(&v));
                }
                r
            }
            Op::Fork { seq } => {
                let Some(id) = self.nth(seq) else { return };
                let r = self.cache.fork(id);
                if let Ok(new) = r {
                    let mut copy = self.model[&id].clone();
                    copy.reserved = vec![0; LAYERS];
                    self.model.insert(new, copy);
                } else {
                    // Only the copies a reservation must cover can make a fork fail here.
                    assert!(matches!(r, Err(CacheError::PoolExhausted { .. })), "{r:?}");
                    assert!(self.model[&id].reserved.iter().any(|&t| t > 0));
                }
                r.map(|_| ())
            }
            Op::Truncate { seq, len } => {
                let Some(id) = self.nth(seq) else { return };
                let r = self.cache.truncate(id, len);
                let channel = [self.channel(0), self.channel(1)];
                if r.is_ok() {
                    let (bs, sinks) = (self.s.bs, self.s.sinks);
                    let m = self.model.get_mut(&id).unwrap();
                    for layer in 0..LAYERS {
                        for part in 0..2 {
                            for rows in &mut m.rows[layer][part] {
                                rows.truncate(len * d);
                            }
                        }
                        let p = (m.rows[layer][0][0].len() / d).saturating_sub(sinks);
                        for (part, channel) in channel.into_iter().enumerate() {
                            let done = &mut m.done[layer][part];
                            if p < *done {
                                // Quantized per-channel blocks can only be dropped whole.
                                assert!(!channel || p.is_multiple_of(bs), "truncate into a block succeeded");
                                *done = p;
                            }
                        }
                    }
                }
                r
            }
            Op::Free { seq } => {
                let Some(id) = self.nth(seq) else { return };
                self.model.remove(&id);
                self.cache.free(id)
            }
            Op::Reload => {
                let bytes = self.cache.to_bytes().unwrap();
                let back = PagedCache::from_bytes(&bytes).unwrap();
                // Reservations are scheduling state, not saved.
                let mut unreserved = self.cache.clone();
                for (&id, m) in &mut self.model {
                    for layer in 0..LAYERS {
                        unreserved.reserve(id, layer, 0).unwrap();
                        m.reserved[layer] = 0;
                    }
                }
                assert!(back == unreserved, "reloaded cache differs");
                // A corrupted copy is refused.
                let mut bad = bytes.clone();
                let i = bad.len() / 2;
                bad[i] ^= 0x40;
                assert!(PagedCache::from_bytes(&bad).is_err());
                assert!(PagedCache::from_bytes(&bytes[..bytes.len() - 3]).is_err());
                self.cache = back;
                Ok(())
            }
            Op::ExportImport { seq } => {
                let Some(id) = self.nth(seq) else { return };
                let bytes = self.cache.export_sequence(id).unwrap();
                let r = self.cache.import_sequence(&bytes);
                if let Ok(new) = r {
                    let mut copy = self.model[&id].clone();
                    copy.reserved = vec![0; LAYERS];
                    self.model.insert(new, copy);
                }
                let mut bad = bytes.clone();
                bad[20] ^= 1;
                let snapshot = self.cache.clone();
                assert!(self.cache.import_sequence(&bad).is_err());
                assert!(snapshot == self.cache);
                r.map(|_| ())
            }
            Op::BigAppend { seq, layer, part, seed } => {
                let Some(id) = self.nth(seq) else { return };
                let (mut k, mut v) = (values(seed, heads * d), values(seed ^ 1, heads * d));
                let x = if part == 0 { &mut k } else { &mut v };
                x[(seed as usize) % (heads * d)] = 70_000.0;
                let r = self.cache.append(id, layer, &k, &v);
                if r.is_ok() {
                    let split = |x: &[f32]| x.chunks(d).map(<[f32]>::to_vec).collect::<Vec<_>>();
                    self.model_append(id, layer, &split(&k), &split(&v));
                }
                r
            }
            Op::Reserve { seq, layer, tokens } => {
                let Some(id) = self.nth(seq) else { return };
                let r = self.cache.reserve(id, layer, tokens);
                if r.is_ok() {
                    self.model.get_mut(&id).unwrap().reserved[layer] = tokens;
                }
                r
            }
            Op::BadAppend { seq } => {
                let Some(id) = self.nth(seq) else { return };
                let mut k = values(7, heads * d);
                k[heads * d - 1] = f32::NAN;
                let r = self.cache.append(id, 0, &k, &values(8, heads * d));
                assert!(matches!(r, Err(CacheError::NonFinite { .. })));
                assert!(self.cache.append(id, 0, &k[1..], &k[1..]).is_err());
                r
            }
        };
        if let Err(e) = &result {
            assert!(before == self.cache, "{op:?} failed with {e} but changed the cache");
        }
        if let (Err(CacheError::PoolExhausted { .. }), Some(seq)) = (&result, op.appends()) {
            let id = self.nth(seq).unwrap();
            let m = &self.model[&id];
            let covered = op.tokens_per_layer().iter().all(|&(layer, n)| n <= m.reserved[layer]);
            assert!(!covered, "{op:?} within the reservations {:?} lacked blocks", m.reserved);
        }
        self.check();
    }
}

impl Op {
    /// The sequence an appending op writes to.
    fn appends(&self) -> Option<usize> {
        match *self {
            Op::Append { seq, .. }
            | Op::AppendAll { seq, .. }
            | Op::Extend { seq, .. }
            | Op::BigAppend { seq, .. } => Some(seq),
            _ => None,
        }
    }

    /// The tokens an appending op brings to each layer it writes.
    fn tokens_per_layer(&self) -> Vec<(usize, usize)> {
        match *self {
            Op::Append { layer, .. } | Op::BigAppend { layer, .. } => vec![(layer, 1)],
            Op::AppendAll { .. } => (0..LAYERS).map(|l| (l, 1)).collect(),
            Op::Extend { layer, tokens, .. } => vec![(layer, tokens)],
            _ => Vec::new(),
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(96))]

    #[test]
    fn cache_matches_model(s in setup(), ops in prop::collection::vec(op(), 1..40)) {
        let k: QuantSpec = s.k.parse().unwrap();
        let v: QuantSpec = s.v.parse().unwrap();
        let mut config = CacheConfig::new(LAYERS, s.heads, s.d, s.capacity)
            .with_specs(k, v)
            .with_block_size(s.bs)
            .with_residual_blocks(s.residual)
            .with_sink_tokens(s.sinks)
            .with_tail_dtype(s.tail[0])
            .with_value_tail_dtype(s.tail[1])
            .with_row_window(s.row_window);
        if s.k.contains("-qa") {
            config = config.with_channel_bits((0..LAYERS * s.heads).map(|i| channel_bits(s.d, i)).collect());
        }
        let calibration = s.calibrated.then(|| calibration(&s));
        if let Some(c) = &calibration {
            config = config.with_calibration(c.clone());
        }
        let mut w = World { cache: PagedCache::new(config).unwrap(), model: BTreeMap::new(), calibration, s };
        w.apply(&Op::Create);
        for op in &ops {
            w.apply(op);
        }
    }
}
