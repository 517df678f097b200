//! One entry that attends a *unit* of a quantized cache: a block of keys and the block of
//! values of the same tokens, against a group of query rows, as one step of an online softmax.
//!
//! [`Attender::attend`] owns the order in which kernels are tried: the integer fused kernels
//! (on the integer arithmetic), then the float fused one (FP8 rows), then the separate
//! kernels (scores, the softmax step, the values' sum), and it remembers, across the units of
//! one call, a layout no fused kernel has code for, so later blocks go straight to the
//! separate kernels instead of asking again. It returns a [`UnitKernel`] naming what ran; a
//! caller that only wants to know what would run asks [`Attender::plan`].
//!
//! Units whose keys are not a quantized block (full-precision sinks and tails, keys turned by
//! RoPE block by block) are scored by the caller with the dense or turn kernels; the same
//! softmax step ([`absorb`]) and value sum ([`Attender::add_values`]) finish them.

use crate::block::{KernelError, QuantBlock};
use crate::dispatch::Kernels;
use crate::{KeyRegion, Online, Scratch};

/// The arithmetic of scores against quantized keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum Arithmetic {
    /// Float kernels: scores and sums equal, within f32 rounding, those over the dequantized
    /// block.
    #[default]
    Float,
    /// Queries rounded to 8 bits per row and integer dot products where a kernel has them
    /// ([`crate::scores_int8_with`], [`crate::axpy_int_with`]), float kernels elsewhere.
    Int8,
}

/// The keys of a unit, as the kernels read them.
#[derive(Debug, Clone, Copy)]
#[non_exhaustive]
pub enum Keys<'a> {
    /// One block of keys, or its token groups with parameters of their own, in row order
    /// (per-channel keys whose parameters change inside a cache block).
    Parts(&'a [QuantBlock<'a>]),
    /// Keys with bits per channel (`-qa`): one per-channel region per width, tiling the row;
    /// the query rows hold their channels in the regions' order.
    Regions(&'a [KeyRegion<'a>]),
}

impl Keys<'_> {
    /// Rows (tokens) of the unit's keys.
    fn rows(&self) -> usize {
        match self {
            Keys::Parts(parts) => parts.iter().map(|k| k.rows).sum(),
            Keys::Regions(regions) => regions.first().map_or(0, |r| r.keys.rows),
        }
    }
}

/// What changes a unit's scores before the softmax step.
#[derive(Debug, Clone, Copy, Default)]
pub struct UnitOptions<'a> {
    /// Soft-capping `cap · tanh(s / cap)` of every score (Gemma 2).
    pub softcap: Option<f32>,
    /// `(first token, spans)` when some query row does not see the whole unit: row `i` sees
    /// tokens `spans[i].0 .. spans[i].1` (its sliding window and its causal end) only, the
    /// others get no weight. `None` when every row sees every token of the unit.
    pub mask: Option<(usize, &'a [(usize, usize)])>,
}

/// The kernels that attended a unit.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum UnitKernel {
    /// One integer kernel took keys and values with the softmax step
    /// ([`crate::attend_int_parts_with`]).
    FusedInt,
    /// One integer kernel took keys with bits per channel and the values
    /// ([`crate::attend_int_regions_with`]).
    FusedIntRegions,
    /// One float kernel took keys and values (FP8 rows, [`crate::attend_float_with`]).
    FusedFloat,
    /// The scores kernel, the softmax step ([`absorb`]), then the values kernel.
    Separate,
}

impl UnitKernel {
    /// Whether one kernel took the whole unit.
    pub fn is_fused(self) -> bool {
        self != UnitKernel::Separate
    }

    /// `"fused integer"`, `"fused integer regions"`, `"fused float"` or `"separate kernels"`.
    pub fn name(self) -> &'static str {
        match self {
            UnitKernel::FusedInt => "fused integer",
            UnitKernel::FusedIntRegions => "fused integer regions",
            UnitKernel::FusedFloat => "fused float",
            UnitKernel::Separate => "separate kernels",
        }
    }
}

impl std::fmt::Display for UnitKernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What a fused call did with a unit.
enum Fused {
    Ran(UnitKernel),
    /// The kernel has code for the layout but declined this block (a negative value scale).
    Declined,
    /// No fused kernel has code for the layout.
    NoCode,
}

/// Scores one unit's query group may hold (256 MiB of f32): far past any model's query group
/// times any block, short of what a crafted config could ask for.
pub const MAX_UNIT_SCORES: usize = 1 << 26;

/// Sizes `s` to `n_q × n` scores, growing it fallibly: a config may pair a large query group
/// with large blocks (65,505 query heads on one KV head and blocks of 65,505 tokens asked for
/// 17 GB, an abort a fuzzer found).
///
/// # Errors
/// [`KernelError::Shape`] over [`MAX_UNIT_SCORES`] or when the memory cannot be had.
pub fn size_scores(s: &mut Vec<f32>, n_q: usize, n: usize) -> Result<(), KernelError> {
    let want = n_q.checked_mul(n).filter(|&w| w <= MAX_UNIT_SCORES).ok_or_else(|| {
        KernelError::Shape(format!(
            "{n_q} query rows × {n} tokens of scores: over the limit of {MAX_UNIT_SCORES} per unit"
        ))
    })?;
    if want > s.len() {
        s.try_reserve_exact(want - s.len()).map_err(|_| {
            KernelError::Shape(format!(
                "{n_q} query rows × {n} tokens of scores ({} MiB) cannot be allocated",
                (want * 4) >> 20
            ))
        })?;
    }
    s.resize(want, 0.0);
    Ok(())
}

/// The online-softmax step over a unit's scores `s` (`n_q` rows of `n`, `n_q` the rows of
/// `state`): soft-capping and the mask of `options` applied, then per row the running maximum
/// taken, what `state` accumulated rescaled when it grows, and `s` turned into the weights
/// `exp(s − m)` whose sum joins `l`. A row that has seen no token yet keeps weights of 0 (no
/// `0 · ∞` in the rescaling). The values' sum ([`Attender::add_values`]) follows.
pub fn absorb(backend: Kernels, s: &mut [f32], n: usize, options: &UnitOptions<'_>, state: &mut Online<'_>) {
    if let Some(cap) = options.softcap {
        let inv = 1.0 / cap;
        s.iter_mut().for_each(|x| *x = cap * (*x * inv).tanh());
    }
    if let Some((a, spans)) = options.mask {
        for (row, &(lo, hi)) in s.chunks_exact_mut(n).zip(spans) {
            row[..lo.saturating_sub(a).min(n)].fill(f32::NEG_INFINITY);
            row[hi.saturating_sub(a).min(n)..].fill(f32::NEG_INFINITY);
        }
    }
    let d = state.o.len() / state.m.len().max(1);
    for (i, scores) in s.chunks_exact_mut(n.max(1)).enumerate().take(state.m.len()) {
        let m = max_lanes(scores, state.m[i]);
        if m == f32::NEG_INFINITY {
            scores.fill(0.0);
            continue;
        }
        let factor = (state.m[i] - m).exp();
        let sum = crate::softmax::exp_sum_with(backend, scores, m);
        state.l[i] = state.l[i] * factor + sum;
        state.m[i] = m;
        if factor != 1.0 {
            state.o[i * d..(i + 1) * d].iter_mut().for_each(|x| *x *= factor);
        }
    }
}

/// The largest of `init` and `x`, NaNs in `x` ignored (as `f32::max` does), in 8 lanes that
/// the compiler vectorizes (a fold over `f32::max` stays scalar: its NaN rule blocks it).
fn max_lanes(x: &[f32], init: f32) -> f32 {
    let mut lanes = [init; 8];
    let mut chunks = x.chunks_exact(8);
    for c in &mut chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    chunks.remainder().iter().chain(&lanes).fold(init, |m, &v| if v > m { v } else { m })
}

/// Attends the units of one call (one KV head's blocks against one query group) in order:
/// see the [module](self). Keep one per decode task and [`begin`](Attender::begin) it per
/// call: its buffers (scores, a width's query columns and scores) grow to the largest unit
/// and stay.
#[derive(Debug)]
pub struct Attender {
    path: Path,
    /// Whether fused kernels are still tried: off once a unit's layout has no fused code (a
    /// head's blocks share one layout).
    fused: bool,
    /// Whether the integer fused kernels are still tried (off as `fused`, for them alone:
    /// FP8 rows then go straight to the float one).
    int_fused: bool,
    /// Whether `columns` holds this call's query columns region by region (`-qa` keys).
    columns_ready: bool,
    s: Vec<f32>,
    columns: Vec<f32>,
    part_scores: Vec<f32>,
}

impl Default for Attender {
    fn default() -> Self {
        Self::new(Kernels::SCALAR, Arithmetic::Float)
    }
}

impl Attender {
    /// An attender for one call on `backend` with `arithmetic`.
    pub fn new(backend: Kernels, arithmetic: Arithmetic) -> Self {
        let mut a = Self {
            path: Path { backend, arithmetic },
            fused: true,
            int_fused: true,
            columns_ready: false,
            s: Vec::new(),
            columns: Vec::new(),
            part_scores: Vec::new(),
        };
        a.begin(backend, arithmetic);
        a
    }

    /// Starts a new call (new query rows, maybe another head's layout), keeping the buffers.
    pub fn begin(&mut self, backend: Kernels, arithmetic: Arithmetic) {
        self.path = Path { backend, arithmetic };
        self.fused = true;
        self.int_fused = arithmetic == Arithmetic::Int8;
        self.columns_ready = false;
    }

    /// Attends `n_q` query rows `q` (already scaled; for [`Keys::Regions`] with their
    /// channels in the regions' order) over one unit, `state` updated as one online-softmax
    /// step over its tokens: a fused kernel where one has code for the layout and every row
    /// sees the whole unit without soft-capping, else the separate kernels. `values` is one
    /// block of the values of the keys' rows, or its token groups in order.
    ///
    /// # Errors
    /// [`KernelError::Shape`] when keys, values, queries and state disagree in rows or
    /// head_dim, or the unit's scores cannot be held ([`size_scores`]); a corrupt block's
    /// error from its kernel.
    #[allow(clippy::too_many_arguments)]
    #[inline]
    pub fn attend(
        &mut self,
        scratch: &mut Scratch,
        keys: Keys<'_>,
        values: &[QuantBlock<'_>],
        q: &[f32],
        n_q: usize,
        mut state: Online<'_>,
        options: &UnitOptions<'_>,
    ) -> Result<UnitKernel, KernelError> {
        if self.fused && options.softcap.is_none() && options.mask.is_none() {
            match self.try_fused(scratch, keys, values, q, n_q, state.reborrow())? {
                Fused::Ran(kernel) => return Ok(kernel),
                Fused::Declined => {}
                Fused::NoCode => self.fused = false,
            }
        }
        scratch.prefetch_queued();
        let n = keys.rows();
        let mut s = std::mem::take(&mut self.s);
        let result = (|| {
            size_scores(&mut s, n_q, n)?;
            self.scores(scratch, keys, q, n_q, &mut s)?;
            absorb(self.path.backend, &mut s, n, options, &mut state);
            self.add_values(scratch, values, &s, n_q, state.o)
        })();
        self.s = s;
        result.map(|()| UnitKernel::Separate)
    }

    /// What [`attend`](Attender::attend) would run on a unit like this one (every row seeing
    /// it whole, no soft-capping), asking nothing of the CPU but what the kernels ask.
    pub fn plan(&self, keys: Keys<'_>, values: &[QuantBlock<'_>], n_q: usize) -> UnitKernel {
        let b = self.path.backend;
        let [v] = values else { return UnitKernel::Separate };
        let int = self.path.arithmetic == Arithmetic::Int8;
        match keys {
            Keys::Regions(rs) if int && crate::attend_int_fused_regions(b, rs, v, n_q) => {
                UnitKernel::FusedIntRegions
            }
            Keys::Regions(_) => UnitKernel::Separate,
            Keys::Parts(ks) if int && crate::attend_int_fused_parts(b, ks, v, n_q) => UnitKernel::FusedInt,
            Keys::Parts([k]) if crate::attend_float_fused(b, k, v, n_q) => UnitKernel::FusedFloat,
            Keys::Parts(_) => UnitKernel::Separate,
        }
    }

    /// The fused kernels in their order: integer (regions, or parts), then float.
    #[inline]
    fn try_fused(
        &mut self,
        scratch: &mut Scratch,
        keys: Keys<'_>,
        values: &[QuantBlock<'_>],
        q: &[f32],
        n_q: usize,
        mut state: Online<'_>,
    ) -> Result<Fused, KernelError> {
        let b = self.path.backend;
        // Values in token groups (per channel) have no fused kernel.
        let [v] = values else { return Ok(Fused::NoCode) };
        match keys {
            Keys::Regions(rs) => {
                if self.path.arithmetic != Arithmetic::Int8 {
                    // The float arithmetic has no fused kernel for keys with bits per channel.
                    return Ok(Fused::NoCode);
                }
                let ran = crate::attend_int_regions_in(b, scratch, rs, v, q, n_q, state)?;
                Ok(outcome(ran, UnitKernel::FusedIntRegions, || {
                    crate::attend_int_fused_regions(b, rs, v, n_q)
                }))
            }
            Keys::Parts(ks) => {
                if self.int_fused {
                    let ran = crate::attend_int_parts_in(b, scratch, ks, v, q, n_q, state.reborrow())?;
                    match outcome(ran, UnitKernel::FusedInt, || crate::attend_int_fused_parts(b, ks, v, n_q))
                    {
                        Fused::NoCode => self.int_fused = false,
                        done => return Ok(done),
                    }
                }
                // FP8 keys and values: the float kernel (on the integer arithmetic too, which
                // has no integer form of their levels).
                let [k] = ks else { return Ok(Fused::NoCode) };
                scratch.prefetch_queued();
                let ran = crate::attend_float_with(b, k, v, q, n_q, state)?;
                Ok(outcome(ran, UnitKernel::FusedFloat, || crate::attend_float_fused(b, k, v, n_q)))
            }
        }
    }

    /// The scores of `n_q` query rows `q` over a unit's keys into `s` (`n_q` rows of the
    /// keys' rows), as the separate path of [`attend`](Attender::attend) computes them.
    ///
    /// # Errors
    /// As [`attend`](Attender::attend).
    pub fn scores(
        &mut self,
        scratch: &mut Scratch,
        keys: Keys<'_>,
        q: &[f32],
        n_q: usize,
        s: &mut [f32],
    ) -> Result<(), KernelError> {
        let n = keys.rows();
        match keys {
            Keys::Parts([k]) => self.path.block(scratch, true, k, q, n_q, s),
            Keys::Parts(parts) => {
                // Token groups inside the block: each group's scores, put in place.
                let ws = &mut self.part_scores;
                let mut at = 0;
                for k in parts {
                    let nk = k.rows;
                    ws.resize(n_q * nk, 0.0);
                    self.path.block(scratch, true, k, q, n_q, ws)?;
                    for (row, part) in s.chunks_exact_mut(n).zip(ws.chunks_exact(nk)) {
                        row[at..at + nk].copy_from_slice(part);
                    }
                    at += nk;
                }
                Ok(())
            }
            Keys::Regions(rs) => self.score_regions(scratch, rs, q, n_q, s),
        }
    }

    /// Keys with bits per channel: one kernel over every region on the integer arithmetic
    /// where the backend has it, otherwise each region scored with its columns of the query
    /// and the scores summed.
    fn score_regions(
        &mut self,
        scratch: &mut Scratch,
        rs: &[KeyRegion<'_>],
        q: &[f32],
        n_q: usize,
        s: &mut [f32],
    ) -> Result<(), KernelError> {
        if self.path.arithmetic == Arithmetic::Int8
            && crate::scores_int8_regions_in(self.path.backend, scratch, rs, q, n_q, s)?
        {
            return Ok(());
        }
        let n = rs.first().map_or(0, |r| r.keys.rows);
        let d = rs.iter().map(|r| r.keys.dim).sum::<usize>();
        if q.len() != n_q * d || s.len() != n_q * n {
            return Err(KernelError::Shape(format!(
                "{n_q} query rows: {} query values and {} scores for width regions of {n} × {d}",
                q.len(),
                s.len()
            )));
        }
        if !self.columns_ready {
            // Every block of the head has the same regions: their query columns, region after
            // region, once per call.
            self.columns.clear();
            for r in rs {
                for row in q.chunks_exact(d) {
                    self.columns.extend_from_slice(&row[r.first..r.first + r.keys.dim]);
                }
            }
            self.columns_ready = true;
        }
        s.fill(0.0);
        let (columns, ws) = (&self.columns, &mut self.part_scores);
        for r in rs {
            let c = r.keys.dim;
            let wq = columns.get(n_q * r.first..n_q * (r.first + c)).ok_or_else(|| {
                KernelError::Shape(format!(
                    "a width region at channel {} of {c} past the query's {d}",
                    r.first
                ))
            })?;
            ws.resize(n_q * n, 0.0);
            self.path.block(scratch, true, &r.keys, wq, n_q, ws)?;
            s.iter_mut().zip(ws.iter()).for_each(|(x, y)| *x += y);
        }
        Ok(())
    }

    /// Adds the values of a unit weighted by `p` (`n_q` rows of the values' rows, as
    /// [`absorb`] leaves them) to `o` (`n_q` rows of head_dim).
    ///
    /// # Errors
    /// [`KernelError::Shape`] when `p` or `o` do not match the values; a corrupt block's error
    /// from its kernel.
    pub fn add_values(
        &mut self,
        scratch: &mut Scratch,
        values: &[QuantBlock<'_>],
        p: &[f32],
        n_q: usize,
        o: &mut [f32],
    ) -> Result<(), KernelError> {
        if let [v] = values {
            return self.path.block(scratch, false, v, p, n_q, o);
        }
        // Values per channel in token groups: each group's weights, gathered.
        let n = values.iter().map(|v| v.rows).sum::<usize>();
        if p.len() != n_q * n {
            return Err(KernelError::Shape(format!("{} weights for {n_q} rows of {n} values", p.len())));
        }
        let ws = &mut self.part_scores;
        let mut at = 0;
        for v in values {
            let nk = v.rows;
            ws.clear();
            for row in p.chunks_exact(n) {
                ws.extend_from_slice(&row[at..at + nk]);
            }
            self.path.block(scratch, false, v, ws, n_q, o)?;
            at += nk;
        }
        Ok(())
    }
}

/// The backend and arithmetic of one call: which kernel scores or sums a block.
#[derive(Debug, Clone, Copy)]
struct Path {
    backend: Kernels,
    arithmetic: Arithmetic,
}

impl Path {
    /// One block's scores (`scores`) or value sums through this arithmetic's kernel.
    fn block(
        self,
        scratch: &mut Scratch,
        scores: bool,
        b: &QuantBlock<'_>,
        w: &[f32],
        n_q: usize,
        out: &mut [f32],
    ) -> Result<(), KernelError> {
        let backend = self.backend;
        match (scores, self.arithmetic) {
            (true, Arithmetic::Float) => crate::scores_in(backend, scratch, b, w, n_q, out),
            (true, Arithmetic::Int8) => crate::scores_int8_in(backend, scratch, b, w, n_q, out).map(|_| ()),
            (false, Arithmetic::Float) => crate::axpy_in(backend, scratch, b, w, n_q, out),
            (false, Arithmetic::Int8) => crate::axpy_int_in(backend, scratch, b, w, n_q, out).map(|_| ()),
        }
    }
}

/// What a fused call did: ran, declined this block (`has_code`), or has no code for its
/// layout. The kernel checks the layout itself; only a refusal asks which it was.
fn outcome(ran: bool, kernel: UnitKernel, has_code: impl FnOnce() -> bool) -> Fused {
    if ran {
        Fused::Ran(kernel)
    } else if has_code() {
        Fused::Declined
    } else {
        Fused::NoCode
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Levels, Params};

    #[test]
    fn max_lanes_is_the_f32_max_fold() {
        for n in 0..40usize {
            for init in [f32::NEG_INFINITY, -1.0, 0.5] {
                let mut x: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7).collect();
                if n > 2 {
                    x[n / 2] = f32::NAN;
                    x[n - 1] = f32::NEG_INFINITY;
                }
                let want = x.iter().copied().fold(init, f32::max);
                assert_eq!(max_lanes(&x, init).to_bits(), want.to_bits(), "{n} {init}");
            }
        }
        assert_eq!(max_lanes(&[f32::NAN; 9], f32::NEG_INFINITY), f32::NEG_INFINITY);
        assert_eq!(max_lanes(&[1.0, f32::INFINITY, 2.0], 0.0), f32::INFINITY);
    }

    /// An INT4 affine block of `rows × dim` with per-row or per-channel parameters.
    fn codes(rows: usize, dim: usize, seed: usize) -> Vec<u8> {
        (0..rows * dim / 2).map(|i| ((i * 7 + seed * 13) % 256) as u8).collect()
    }

    /// The separate path (scores, absorb, values) over a unit equals the dequantized reference
    /// on every backend this CPU has, on both arithmetics, in one block and in token groups,
    /// with and without a mask and soft-capping; and whatever ran is what `plan` said.
    #[test]
    fn attend_matches_the_dequantized_unit() {
        let (rows, dim, n_q) = (32, 64, 3);
        let kc = codes(rows, dim, 1);
        let vc = codes(rows, dim, 2);
        let ks: Vec<f32> = (0..dim).map(|c| 0.01 + 0.002 * c as f32).collect();
        let ko: Vec<f32> = (0..dim).map(|c| -0.1 + 0.003 * c as f32).collect();
        let vs: Vec<f32> = (0..rows).map(|r| 0.02 + 0.001 * r as f32).collect();
        let vo: Vec<f32> = (0..rows).map(|r| -0.15 + 0.002 * r as f32).collect();
        let k = QuantBlock::new(
            &kc,
            rows,
            dim,
            4,
            Levels::Affine,
            Params::PerChannel { scale: &ks, offset: Some(&ko) },
        )
        .unwrap();
        let v = QuantBlock::new(
            &vc,
            rows,
            dim,
            4,
            Levels::Affine,
            Params::PerRow { scale: &vs, offset: Some(&vo) },
        )
        .unwrap();
        let q: Vec<f32> = (0..n_q * dim).map(|i| ((i * 29 % 17) as f32 - 8.0) * 0.05).collect();
        let mut kd = vec![0.0; rows * dim];
        let mut vd = vec![0.0; rows * dim];
        crate::scalar::dequantize(&k, &mut kd);
        crate::scalar::dequantize(&v, &mut vd);
        let spans: Vec<(usize, usize)> = (0..n_q).map(|i| (3 * i, rows - 5 * i)).collect();
        let mut seen = Vec::new();
        for backend in crate::dispatch::available() {
            for arithmetic in [Arithmetic::Float, Arithmetic::Int8] {
                for (masked, softcap) in [(false, None), (true, None), (false, Some(2.0))] {
                    let options = UnitOptions { softcap, mask: masked.then_some((0, &spans[..])) };
                    // Reference: dense softmax attention over the dequantized rows.
                    let mut want = vec![0.0f32; n_q * dim];
                    for i in 0..n_q {
                        let (lo, hi) = if masked { spans[i] } else { (0, rows) };
                        let mut s: Vec<f64> = (0..rows)
                            .map(|t| {
                                let x: f64 =
                                    (0..dim).map(|c| (q[i * dim + c] * kd[t * dim + c]) as f64).sum();
                                softcap.map_or(x, |cap: f32| cap as f64 * (x / cap as f64).tanh())
                            })
                            .collect();
                        let m = s[lo..hi].iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                        let mut l = 0.0;
                        for (t, x) in s.iter_mut().enumerate() {
                            *x = if (lo..hi).contains(&t) { (*x - m).exp() } else { 0.0 };
                            l += *x;
                        }
                        for c in 0..dim {
                            want[i * dim + c] =
                                ((0..rows).map(|t| s[t] * vd[t * dim + c] as f64).sum::<f64>() / l) as f32;
                        }
                    }
                    let halves = [k.sub_rows(0..16), k.sub_rows(16..32)];
                    for keys in [Keys::Parts(std::slice::from_ref(&k)), Keys::Parts(&halves)] {
                        let mut at = Attender::new(backend, arithmetic);
                        let mut scratch = Scratch::default();
                        let (mut m, mut l, mut o) =
                            (vec![f32::NEG_INFINITY; n_q], vec![0.0; n_q], vec![0.0; n_q * dim]);
                        let state = Online { m: &mut m, l: &mut l, o: &mut o };
                        let ran = at
                            .attend(&mut scratch, keys, std::slice::from_ref(&v), &q, n_q, state, &options)
                            .unwrap();
                        seen.push(ran);
                        if options.softcap.is_none() && options.mask.is_none() {
                            assert_eq!(ran, at.plan(keys, std::slice::from_ref(&v), n_q), "{backend:?}");
                        } else {
                            assert_eq!(ran, UnitKernel::Separate);
                        }
                        // The integer arithmetic rounds queries and weights to 8 bits.
                        let tol = if arithmetic == Arithmetic::Int8 { 3e-2 } else { 1e-4 };
                        for (i, (got, want)) in o.chunks_exact(dim).zip(want.chunks_exact(dim)).enumerate() {
                            for (g, w) in got.iter().zip(want) {
                                let g = g / l[i];
                                assert!(
                                    (g - w).abs() <= tol * (1.0 + w.abs()),
                                    "{backend:?} {arithmetic:?} {ran} row {i}: {g} vs {w}"
                                );
                            }
                        }
                    }
                }
            }
        }
        // Where the CPU has an integer fused kernel, this unit (INT4 keys per channel, INT4
        // values per row) went through it.
        let fused =
            crate::dispatch::available().iter().any(|b| matches!(b.name(), "avx2" | "avx512" | "dotprod"));
        assert_eq!(seen.contains(&UnitKernel::FusedInt), fused);
    }

    #[test]
    fn oversized_units_are_refused_before_allocating() {
        let mut s = Vec::new();
        assert!(matches!(size_scores(&mut s, 65_505, 65_505), Err(KernelError::Shape(_))));
        assert!(matches!(size_scores(&mut s, usize::MAX, 2), Err(KernelError::Shape(_))));
        assert!(s.is_empty());
        size_scores(&mut s, 4, 32).unwrap();
        assert_eq!(s.len(), 128);
    }
}
