//! # kvq-kernels-simd
//!
//! Kernels that read a quantized KV cache block without materializing it in f32: dequantize,
//! scores (`s[t] = q · k̂[t]`, for several query rows at once, as a GQA group needs) and axpy
//! (`o += Σ_t p[t] · v̂[t]`). Every kernel has a scalar reference in [`scalar`]; the `wide`
//! backend (`wide_backend`) is tested against it on random blocks of many shapes.
//!
//! This crate is the only one of the workspace allowed `unsafe` (the `std::arch` paths);
//! every `unsafe` block carries a `// SAFETY:` comment. **Status:** the scalar and `wide`
//! backends cover affine, symmetric and table (FP8, codebook) levels with per-row,
//! per-channel or per-group (`gN`) parameters; the AVX2+FMA backend covers affine, symmetric
//! and table 2-, 3-, 4- and 8-bit blocks for scores and axpy (per-group ones in groups of a multiple of 16),
//! and [`implementation_for`] names the code that runs for a given block. The integer score path ([`scores_int8_with`]) has AVX2, AVX-512 VNNI and
//! aarch64 dotprod kernels, all equal to [`scalar::scores_int8`] bit for bit. The `avx512`
//! backend's float kernels are the AVX2 ones but for FP8 blocks with one scale per row, which
//! have AVX-512 kernels of their own and a fused block kernel (`fp8_avx512`,
//! [`attend_float_with`]): [`implementation`] and [`implementation_for`] say which code
//! actually runs, so no log claims a path that did not run.
//!
//! Every entry takes a [`Kernels`]: a backend this CPU was found to run, which only detection
//! makes ([`dispatch`]). The CPU is asked once per process; the kernels' guards read what it
//! answered, and no entry can be handed a backend the CPU lacks.
//!
//! ```
//! use kvq_kernels_simd::{Kernels, Levels, Params, QuantBlock, dispatch, scores_with};
//! // Two rows of 8 INT8 codes, per-row scale and offset.
//! let codes: Vec<u8> = (0..16).collect();
//! let block = QuantBlock::new(&codes, 2, 8, 8, Levels::Affine,
//!     Params::PerRow { scale: &[0.5, 1.0], offset: Some(&[0.0, -1.0]) })?;
//! let q = [1.0f32; 8];
//! let mut s = [0.0f32; 2];
//! scores_with(Kernels::WIDE, &block, &q, 1, &mut s)?;
//! assert_eq!(s, [0.5 * 28.0, 92.0 - 8.0]);
//! // The best kernels this CPU runs (detected once; `KVQ_FORCE_BACKEND` may ask for others).
//! let best = dispatch::detect();
//! scores_with(best, &block, &q, 1, &mut s)?;
//! assert!((s[1] - 84.0).abs() < 1e-4);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

// The one crate of the workspace allowed `unsafe` (the SIMD intrinsics); every block carries a
// `// SAFETY:` comment, which clippy's `undocumented_unsafe_blocks` checks.
#![allow(unsafe_code)]
/// Dispatches `$f::<NQ>` on a runtime query group size (1 to 3, else 4): the fused block
/// kernels' monomorphizations.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! by_group {
    ($f:ident, $nq:expr, ($($arg:expr),*)) => {
        match $nq {
            1 => $f::<1>($($arg),*),
            2 => $f::<2>($($arg),*),
            3 => $f::<3>($($arg),*),
            _ => $f::<4>($($arg),*),
        }
    };
}

/// Dispatches `$f::<BITS, NQ>` on a runtime bit width (4, else 8) and query group size (1 to
/// 3, else 4): the integer kernels' monomorphizations.
#[cfg(target_arch = "x86_64")]
macro_rules! by_4_or_8_and_group {
    ($f:ident, $bits:expr, $nq:expr, ($($arg:expr),*)) => {
        match ($bits, $nq) {
            (4, 1) => $f::<4, 1>($($arg),*),
            (4, 2) => $f::<4, 2>($($arg),*),
            (4, 3) => $f::<4, 3>($($arg),*),
            (4, _) => $f::<4, 4>($($arg),*),
            (_, 1) => $f::<8, 1>($($arg),*),
            (_, 2) => $f::<8, 2>($($arg),*),
            (_, 3) => $f::<8, 3>($($arg),*),
            (_, _) => $f::<8, 4>($($arg),*),
        }
    };
}

/// The entries every fused module (`fused_avx2`, `fused_dotprod`) wraps around its own `run`,
/// `attend_int_supported` and `attend_int_regions_supported`: which blocks in parts it takes,
/// and the checked calls into `run` for keys in parts and in channel regions. Written once for
/// every instruction set.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! fused_entries {
    () => {
        /// Whether [`crate::attend_int_parts_with`] runs this kernel for keys in `parts` with
        /// the values `v`: one part as [`attend_int_supported`] takes it; several (per-channel
        /// keys whose parameters change every few rows) only of INT4 keys, the first with the
        /// values of its rows as [`attend_int_supported`] takes it, the others in its layout,
        /// covering the values' rows.
        pub fn attend_int_parts_supported(parts: &[QuantBlock<'_>], v: &QuantBlock<'_>, n_q: usize) -> bool {
            crate::parts_supported_int4(parts, v, |k, v| attend_int_supported(k, v, n_q))
        }

        /// One block of keys and the block of values of the same tokens attended by `n_q`
        /// query rows (`q`, `n_q × dim`, already scaled), the online softmax `state` of the rows
        /// updated; see the module. Returns `false`, changing nothing, when
        /// [`attend_int_parts_supported`] is false or a value scale is negative or NaN (byte
        /// weights need `p · scale ≥ 0`).
        pub(crate) fn attend_int_in(
            parts: &[QuantBlock<'_>],
            v: &QuantBlock<'_>,
            q: &[f32],
            n_q: usize,
            state: Online<'_>,
            w: &mut FusedScratch,
        ) -> bool {
            if !attend_int_parts_supported(parts, v, n_q) {
                return false;
            }
            if parts[0].bits != 4 {
                // One block of keys per channel of another width: a region of the whole row,
                // which `attend_int_supported` checked as such.
                return attend_int_regions_in(&[KeyRegion { first: 0, keys: parts[0] }], v, q, n_q, state, w);
            }
            // SAFETY: `attend_int_parts_supported` checked the CPU, the widths, the layouts and
            // the sizes of every part.
            unsafe { run(Keys::Parts(parts), v, q, n_q, state, w) }
        }

        /// [`attend_int_in`] for keys in channel regions (`-qa`): their scores by this
        /// instruction set's region scores, then the same softmax step and value sums. Returns
        /// `false`, changing nothing, when [`attend_int_regions_supported`] is false or a value
        /// scale is negative or NaN.
        pub(crate) fn attend_int_regions_in(
            regions: &[KeyRegion<'_>],
            v: &QuantBlock<'_>,
            q: &[f32],
            n_q: usize,
            state: Online<'_>,
            w: &mut FusedScratch,
        ) -> bool {
            if !attend_int_regions_supported(regions, v, n_q) {
                return false;
            }
            // SAFETY: checked above.
            unsafe { run(Keys::Regions(regions), v, q, n_q, state, w) }
        }
    };
}

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
pub mod block;
#[cfg(target_arch = "x86_64")]
mod dense_avx512;
pub mod dispatch;
#[cfg(target_arch = "aarch64")]
mod dotprod;
#[cfg(target_arch = "x86_64")]
mod fp8_avx512;
#[cfg(target_arch = "x86_64")]
mod fused_avx2;
#[cfg(target_arch = "aarch64")]
mod fused_dotprod;
pub mod ggml;
pub mod ggml_packed;
mod int8;
mod int_values;
mod k_quants;
pub mod memory;
#[cfg(target_arch = "aarch64")]
mod neon;
mod prefetch;
#[cfg(all(test, target_os = "linux", any(target_arch = "x86_64", target_arch = "aarch64")))]
mod region_tests;
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
mod regions;
#[cfg(target_arch = "x86_64")]
mod regions_avx2;
#[cfg(target_arch = "aarch64")]
mod regions_neon;
pub mod rowquant;
pub mod scalar;
pub mod softmax;
pub mod unit;
mod wide_backend;

pub use block::{KernelError, Levels, Params, QuantBlock};
pub use dispatch::{Backend, DispatchError, Kernels};
pub use memory::{advise_huge_pages, advise_huge_pages_of};
pub use rowquant::{row_kernels, row_kernels_for};

/// The buffers the kernels reuse from call to call (unpacked levels, folded and rounded
/// queries, partial sums). The `*_with` functions keep one per thread; a caller that needs
/// every call free of allocation whatever thread runs it (a decode workspace) owns one per
/// task and passes it to the `*_in` functions. Its buffers grow to the largest block and
/// query group seen, and stay.
#[derive(Default)]
pub struct Scratch {
    pub(crate) wide: wide_backend::Scratch,
    #[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
    pub(crate) int8: int8::Scratch,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) intv: int_values::Scratch,
    #[cfg(target_arch = "x86_64")]
    pub(crate) fused: avx512::FusedScratch,
    #[cfg(target_arch = "x86_64")]
    pub(crate) fused_avx2: fused_avx2::FusedScratch,
    #[cfg(target_arch = "aarch64")]
    pub(crate) fused_dotprod: fused_dotprod::FusedScratch,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) sums: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) w: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(crate) weights: Vec<f32>,
    /// What the next fused call brings into cache while it computes ([`Scratch::prefetch_next`]).
    pub(crate) ahead: prefetch::Ahead,
}

impl Scratch {
    /// Queues `data` (memory the caller reads after the next call, a decode's next blocks) to
    /// be brought into cache during the next fused attention call on this scratch
    /// (a unit a [`unit::Attender`] attends with it), a few cache
    /// lines at a time from the kernel's row loops, so that the loads overlap its arithmetic
    /// instead of stalling it as one burst of [`prefetch`] before the call does (the AVX-512
    /// and AVX2 fused kernels; the NEON one, and a block no fused kernel takes, prefetch the
    /// queue whole before they compute, as [`prefetch`] would). Every other call leaves it for
    /// [`Scratch::prefetch_queued`]. Up to four ranges are queued, a further one is prefetched
    /// at once. A hint only: no effect on any result; the memory need not outlive the queue
    /// (only addresses are kept, and a prefetch never faults).
    pub fn prefetch_next(&mut self, data: &[u8]) {
        self.ahead.push(data);
    }

    /// Prefetches whatever [`Scratch::prefetch_next`] queued and no fused call has asked for
    /// yet, now (as [`prefetch`]), and empties the queue.
    pub fn prefetch_queued(&mut self) {
        self.ahead.finish();
    }
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch").finish_non_exhaustive()
    }
}

thread_local! {
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::default();
}

/// Runs `f` with this thread's [`Scratch`]. The `*_in` kernels never call back into it, so
/// no borrow nests.
pub(crate) fn with_scratch<R>(f: impl FnOnce(&mut Scratch) -> R) -> R {
    SCRATCH.with_borrow_mut(f)
}

/// The code that runs for the float kernels of `backend`: AVX-512 runs the AVX2 kernels (but
/// for FP8 rows, see [`implementation_for`], and full-precision rows, see
/// [`dense_implementation`]) and
/// dotprod the `wide` (NEON) ones; both have integer score kernels of their own (see
/// [`scores_int8_with`]). The AVX2 kernels fall back to `wide` for layouts they do
/// not cover.
pub fn implementation(backend: Kernels) -> Backend {
    match backend.backend() {
        Backend::Scalar => Backend::Scalar,
        _ if backend.cpu().avx2 => Backend::Avx2,
        _ => Backend::Wide,
    }
}

/// The code that runs the float kernels of `backend` for the block `b`: [`implementation`],
/// except that FP8 blocks with one scale per row and rows of a multiple of 32 codes run
/// AVX-512 kernels of their own on `avx512` (`fp8_avx512`), and that where the AVX2 kernels do not cover a block's layout (code widths other than
/// 2, 3, 4 and 8, rows not a multiple of the chunk (64 codes for 2 and 3 bits), per-group parameters in groups not a multiple
/// of 16) the `wide` ones run, and this says so.
pub fn implementation_for(backend: Kernels, b: &QuantBlock<'_>) -> Backend {
    match implementation(backend) {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 if backend.cpu().avx512 && fp8_avx512::supported(b) => Backend::Avx512,
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 if !avx2::float_supported(b) => Backend::Wide,
        other => {
            let _ = b;
            other
        }
    }
}

fn check(ok: bool, what: impl FnOnce() -> String) -> Result<(), KernelError> {
    if ok { Ok(()) } else { Err(KernelError::Shape(what())) }
}

fn check_scores(b: &QuantBlock<'_>, q: &[f32], n_q: usize, out: &[f32]) -> Result<(), KernelError> {
    check(q.len() == n_q * b.dim && out.len() == n_q * b.rows, || {
        format!(
            "{n_q} queries: {} query values and {} outputs for a block of {} × {}",
            q.len(),
            out.len(),
            b.rows,
            b.dim
        )
    })
}

fn check_axpy(b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &[f32]) -> Result<(), KernelError> {
    check(p.len() == n_q * b.rows && out.len() == n_q * b.dim, || {
        format!(
            "{n_q} weight rows: {} weights and {} outputs for a block of {} × {}",
            p.len(),
            out.len(),
            b.rows,
            b.dim
        )
    })
}

/// `out[r · dim + d] = x̂[r][d]` with `backend`.
///
/// # Errors
/// [`KernelError::Shape`] when `out` is not `rows × dim` long.
pub fn dequantize_with(backend: Kernels, b: &QuantBlock<'_>, out: &mut [f32]) -> Result<(), KernelError> {
    check(out.len() == b.rows * b.dim, || format!("{} outputs for {} × {}", out.len(), b.rows, b.dim))?;
    match implementation(backend) {
        Backend::Scalar => scalar::dequantize(b, out),
        _ => wide_backend::dequantize(b, out),
    }
    Ok(())
}

/// `out[i · rows + t] = q_i · x̂[t]` for `n_q` query rows of `dim` values, with `backend`.
///
/// # Errors
/// [`KernelError::Shape`] when `q` is not `n_q × dim` or `out` not `n_q × rows` long.
pub fn scores_with(
    backend: Kernels,
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    with_scratch(|w| scores_in(backend, w, b, q, n_q, out))
}

/// [`scores_with`] with the caller's [`Scratch`]: no allocation once it has grown to the
/// block and the query group (the scalar reference allocates; no fast path selects it).
///
/// # Errors
/// As [`scores_with`].
pub fn scores_in(
    backend: Kernels,
    scratch: &mut Scratch,
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_scores(b, q, n_q, out)?;
    match implementation(backend) {
        Backend::Scalar => scalar::scores(b, q, n_q, out),
        _ => scores_fast(backend, scratch, b, q, n_q, out),
    }
    Ok(())
}

fn scores_fast(
    backend: Kernels,
    w: &mut Scratch,
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) {
    match implementation(backend) {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 if backend == Backend::Avx512 && fp8_avx512::supported(b) => {
            fp8_avx512::scores_in(b, q, n_q, out)
        }
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => avx2::scores_in(b, q, n_q, out, w),
        _ => wide_backend::scores_in(b, q, n_q, out, &mut w.wide),
    }
}

fn axpy_fast(backend: Kernels, w: &mut Scratch, b: &QuantBlock<'_>, p: &[f32], n_q: usize, out: &mut [f32]) {
    match implementation(backend) {
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 if backend == Backend::Avx512 && fp8_avx512::supported(b) => {
            fp8_avx512::axpy_in(b, p, n_q, out, &mut w.weights)
        }
        #[cfg(target_arch = "x86_64")]
        Backend::Avx2 => avx2::axpy_in(b, p, n_q, out, w),
        _ => wide_backend::axpy_in(b, p, n_q, out, &mut w.wide),
    }
}

/// `out[i · dim + d] += Σ_t p[i · rows + t] · x̂[t][d]` for `n_q` weight rows, with `backend`.
///
/// # Errors
/// [`KernelError::Shape`] when `p` is not `n_q × rows` or `out` not `n_q × dim` long.
pub fn axpy_with(
    backend: Kernels,
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    with_scratch(|w| axpy_in(backend, w, b, p, n_q, out))
}

/// [`axpy_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`axpy_with`].
pub fn axpy_in(
    backend: Kernels,
    scratch: &mut Scratch,
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_axpy(b, p, n_q, out)?;
    match implementation(backend) {
        Backend::Scalar => scalar::axpy(b, p, n_q, out),
        _ => axpy_fast(backend, scratch, b, p, n_q, out),
    }
    Ok(())
}

fn check_dense(
    x_len: usize,
    rows: usize,
    dim: usize,
    w: &[f32],
    n_q: usize,
    out: usize,
    scores: bool,
) -> Result<(), KernelError> {
    let want = |a: usize, b: usize| a.checked_mul(b);
    let (w_len, out_len) =
        if scores { (want(n_q, dim), want(n_q, rows)) } else { (want(n_q, rows), want(n_q, dim)) };
    check(want(rows, dim) == Some(x_len) && w_len == Some(w.len()) && out_len == Some(out), || {
        format!(
            "{rows} full-precision rows of {dim}: {x_len} values, {n_q} query rows of {} values, {out} outputs",
            w.len()
        )
    })
}

/// The element types of full-precision rows that the dense kernels read: `f32` in place, and
/// `half::f16` widened where it is used (in registers with F16C on AVX2 backends for rows of a
/// multiple of 8 (scores) or 16 (values); a 256-value piece at a time through `half`, NEON's
/// conversion on aarch64, otherwise). Sealed: the kernels exist for these two.
pub trait DenseRow: Copy + sealed::Sealed {
    #[doc(hidden)]
    fn scores(backend: Kernels, x: &[Self], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]);
    #[doc(hidden)]
    fn axpy(backend: Kernels, x: &[Self], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]);
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
}

/// Picks a dense kernel of `$kind` (`dense_scores`, `dense_axpy`, or their `_f16` forms) for the
/// backend that really runs.
macro_rules! dense_kernel {
    ($backend:expr, $kind:ident, ($($arg:expr),*)) => {
        match implementation($backend) {
            Backend::Scalar => scalar::$kind($($arg),*),
            #[cfg(target_arch = "x86_64")]
            Backend::Avx2 => avx2::$kind($($arg),*),
            _ => wide_backend::$kind($($arg),*),
        }
    };
}

/// Runs the AVX-512 dense kernel `$kind` (`dense_scores` or `dense_axpy`) for rows of
/// `$half` (f16 or not) and returns from the caller when the backend is AVX-512 and the kernel
/// takes the rows ([`dense_implementation`] says when).
macro_rules! dense_avx512 {
    ($backend:expr, $kind:ident, $half:literal, ($x:expr, $($arg:expr),*)) => {
        #[cfg(target_arch = "x86_64")]
        if $backend == Backend::Avx512 && dense_avx512::$kind::<$half>($x.as_ptr().cast(), $($arg),*) {
            return;
        }
    };
}

impl DenseRow for f32 {
    fn scores(backend: Kernels, x: &[f32], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
        dense_avx512!(backend, dense_scores, false, (x, rows, dim, q, n_q, out));
        dense_kernel!(backend, dense_scores, (x, rows, dim, q, n_q, out))
    }
    fn axpy(backend: Kernels, x: &[f32], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
        dense_avx512!(backend, dense_axpy, false, (x, rows, dim, p, n_q, out));
        dense_kernel!(backend, dense_axpy, (x, rows, dim, p, n_q, out))
    }
}

impl DenseRow for half::f16 {
    fn scores(backend: Kernels, x: &[Self], rows: usize, dim: usize, q: &[f32], n_q: usize, out: &mut [f32]) {
        dense_avx512!(backend, dense_scores, true, (x, rows, dim, q, n_q, out));
        dense_kernel!(backend, dense_scores_f16, (x, rows, dim, q, n_q, out))
    }
    fn axpy(backend: Kernels, x: &[Self], rows: usize, dim: usize, p: &[f32], n_q: usize, out: &mut [f32]) {
        dense_avx512!(backend, dense_axpy, true, (x, rows, dim, p, n_q, out));
        dense_kernel!(backend, dense_axpy_f16, (x, rows, dim, p, n_q, out))
    }
}

/// The code that runs [`dense_scores_with`] and [`dense_axpy_with`] for rows of `dim` values
/// on `backend`: AVX-512 kernels of their own where the backend is AVX-512 and `dim` a multiple
/// of 16 (`dense_avx512`), else [`implementation`]'s.
pub fn dense_implementation(backend: Kernels, dim: usize) -> Backend {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 && dense_avx512::supported(dim) {
        return Backend::Avx512;
    }
    let _ = dim;
    implementation(backend)
}

/// Scores of `n_q` query rows against `rows` full-precision rows `x` (`rows × dim`, f32 or
/// f16: an unquantized cache, the cache's tails and sinks): `out[i · rows + r] = q_i · x_r`,
/// with the FMA kernels on AVX2 backends (two rows against four query rows at a time), AVX-512
/// ones on [`Backend::Avx512`] for rows of a multiple of 16 ([`dense_implementation`]), 16
/// `wide` lanes (SSE2/NEON) otherwise, the f64 reference on [`Backend::Scalar`].
///
/// # Errors
/// [`KernelError::Shape`] when `x` is not `rows × dim`, `q` not `n_q × dim` or `out` not
/// `n_q × rows` long.
pub fn dense_scores_with<T: DenseRow>(
    backend: Kernels,
    x: &[T],
    rows: usize,
    dim: usize,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_dense(x.len(), rows, dim, q, n_q, out.len(), true)?;
    T::scores(backend, x, rows, dim, q, n_q, out);
    Ok(())
}

/// `out[i · dim + d] += Σ_r p[i · rows + r] · x[r · dim + d]` over full-precision rows (f32 or
/// f16), with the kernels of [`dense_scores_with`] (AVX2: 16 output columns of four query rows
/// in registers over spans of 32 rows).
///
/// # Errors
/// [`KernelError::Shape`] when `x` is not `rows × dim`, `p` not `n_q × rows` or `out` not
/// `n_q × dim` long.
pub fn dense_axpy_with<T: DenseRow>(
    backend: Kernels,
    x: &[T],
    rows: usize,
    dim: usize,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_dense(x.len(), rows, dim, p, n_q, out.len(), false)?;
    T::axpy(backend, x, rows, dim, p, n_q, out);
    Ok(())
}

/// Scores through the integer path where the backend has one (AVX2: affine 4-bit rows of a
/// multiple of 64 codes, 8-bit rows of a multiple of 16; AVX-512 with VNNI: 4-bit rows of a
/// multiple of 128, 8-bit of 64, else its AVX2 kernel; dotprod: 4-bit rows of a multiple of
/// 32, 8-bit of 16; on AVX2 and dotprod also 4-bit rows per group of a multiple of 32 and
/// 4-bit rows of 16-level tables or symmetric levels), else [`scores_with`]. Returns whether
/// the integer path ran. Every integer kernel gives the scores of [`scalar::scores_int8`], bit
/// for bit.
///
/// The integer path quantizes each query row to int8, as llama.cpp does: each score is off by
/// at most `max|q| / 254 · Σ_d |level_d · scale_d|` (the algebra: [`scalar::scores_int8`],
/// the reference every integer kernel equals).
///
/// # Errors
/// As [`scores_with`].
pub fn scores_int8_with(
    backend: Kernels,
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<bool, KernelError> {
    with_scratch(|w| scores_int8_in(backend, w, b, q, n_q, out))
}

/// [`scores_int8_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`scores_with`].
pub fn scores_int8_in(
    backend: Kernels,
    scratch: &mut Scratch,
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<bool, KernelError> {
    check_scores(b, q, n_q, out)?;
    if implementation(backend) == Backend::Scalar {
        scalar::scores(b, q, n_q, out);
        return Ok(false);
    }
    Ok(scores_int8_fast(backend, scratch, b, q, n_q, out))
}

/// The integer kernel that [`scores_int8_with`] runs for the block `b` on `backend`:
/// `Some(Backend::Avx512)` for the VNNI kernels, `Some(Backend::Avx2)`, `Some(Backend::Dotprod)`,
/// or `None` where the block takes the float kernels instead ([`implementation_for`]).
pub fn int8_implementation(backend: Kernels, b: &QuantBlock<'_>) -> Option<Backend> {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 && avx512::int8_supported(b) {
        return Some(Backend::Avx512);
    }
    #[cfg(target_arch = "x86_64")]
    if implementation(backend) == Backend::Avx2 && avx2::int8_supported(b) {
        return Some(Backend::Avx2);
    }
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod && dotprod::int8_supported(b) {
        return Some(Backend::Dotprod);
    }
    let _ = (backend, b);
    None
}

fn scores_int8_fast(
    backend: Kernels,
    w: &mut Scratch,
    b: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 && avx512::scores_int8_in(b, q, n_q, out, &mut w.int8) {
        return true;
    }
    #[cfg(target_arch = "x86_64")]
    if implementation(backend) == Backend::Avx2 && avx2::scores_int8_in(b, q, n_q, out, &mut w.int8) {
        return true;
    }
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod && dotprod::scores_int8_in(b, q, n_q, out, &mut w.int8) {
        return true;
    }
    scores_fast(backend, w, b, q, n_q, out);
    false
}

/// Value accumulation through the integer path where the backend has one (AVX-512 with VNNI:
/// affine 4-bit rows of a multiple of 128 codes, 8-bit rows of a multiple of 64), else
/// [`axpy_with`]. Returns whether the
/// integer path ran.
///
/// The integer path rounds each weight row of the block (`p · scale` per row, `p` per
/// channel) with one scale to integers of at most `W_max` (255 for codes of up to 4 bits,
/// 32767 for wider ones) and sums `weight · (code − 2^(bits − 1))` exactly in i32, the centre's
/// share added back from the exact float sum of the weights: each output is off by at most
/// `max|w| / (2 · W_max) · Σ_r |level_r − 2^(bits − 1)|` (per channel, times `|scale|`). The
/// results equal [`scalar::axpy_int`] bit for bit.
///
/// # Errors
/// As [`axpy_with`].
pub fn axpy_int_with(
    backend: Kernels,
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<bool, KernelError> {
    with_scratch(|w| axpy_int_in(backend, w, b, p, n_q, out))
}

/// [`axpy_int_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`axpy_with`].
pub fn axpy_int_in(
    backend: Kernels,
    scratch: &mut Scratch,
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<bool, KernelError> {
    check_axpy(b, p, n_q, out)?;
    if implementation(backend) == Backend::Scalar {
        scalar::axpy(b, p, n_q, out);
        return Ok(false);
    }
    Ok(axpy_int_fast(backend, scratch, b, p, n_q, out))
}

fn axpy_int_fast(
    backend: Kernels,
    w: &mut Scratch,
    b: &QuantBlock<'_>,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 && avx512::axpy_int_in(b, p, n_q, out, &mut w.intv) {
        return true;
    }
    axpy_fast(backend, w, b, p, n_q, out);
    false
}

/// The running state of an online softmax over `n_q` query rows: per row the largest score
/// seen `m` (−∞ before the first), the sum `l` of `exp(score − m)`, and `o` (`n_q × dim`) the
/// values weighted by those exponentials, not yet divided by `l`.
#[derive(Debug)]
pub struct Online<'a> {
    /// The running maxima, one per query row.
    pub m: &'a mut [f32],
    /// The running sums of the exponentials, one per query row.
    pub l: &'a mut [f32],
    /// The running weighted sums of the values, `n_q` rows of `dim`.
    pub o: &'a mut [f32],
}

impl Online<'_> {
    /// A shorter-lived state over the same rows (to try one kernel, then another).
    pub fn reborrow(&mut self) -> Online<'_> {
        Online { m: &mut *self.m, l: &mut *self.l, o: &mut *self.o }
    }
}

/// A block of keys `k` and the block of values `v` of the same tokens attended by `n_q` query
/// rows `q` (`n_q × dim`, already scaled) in one fused call on the integer paths, `state`
/// updated as an online softmax over the block would update it: for each row, the scores
/// of [`scores_int8_with`], their maximum `m'` with the running `m` (NaN scores skipped),
/// `l ← l · e^(m − m') + Σ e^(s − m')`, `o ← o · e^(m − m') + Σ_r e^(s_r − m') · v̂_r` through
/// [`axpy_int_with`]'s rounding; a row whose maximum stays −∞ is left as it is.
///
/// Where it runs (INT4 affine keys per channel, INT4 affine values per row with non-negative
/// scales, blocks of up to 256 tokens, head_dim 64, 128 or 256, query rows four at a time;
/// on `avx512` and `avx2` also values per group of 32, 64, 128 or 256, each group's weights
/// rounded with their own scale, as [`scalar::attend_int`] does, and INT4 keys per row or per
/// group of 32 to 256 values; on
/// the `avx512` backend with VNNI, see `avx512::attend_int_supported`, on the `avx2`
/// backend, see `fused_avx2::attend_int_supported`, which the `avx512` backend runs where
/// its own kernel has no code (no VNNI or VBMI), and on the `dotprod` backend of aarch64,
/// see `fused_dotprod::attend_int_supported`; on `avx512` with VBMI, `avx2` and `dotprod`
/// also keys per channel of 1 to 8 bits and values of 1 to 3 bits per row) nothing of a block goes
/// through memory but its
/// codes and parameters and a few small buffers; elsewhere it returns `Ok(false)`, changing
/// nothing, and the caller runs the separate kernels (the kernels: `avx512::attend_int_in`,
/// `fused_avx2::attend_int_in`, `fused_dotprod::attend_int_in`). Its results equal [`scalar::attend_int`] to the rounding
/// of float sums taken in another order and of `exp` (the softmax module's polynomial), not bit
/// for bit.
///
/// # Errors
/// [`KernelError::Shape`] when the blocks differ in rows or head_dim, or `q` and `state` do not
/// hold `n_q` rows.
pub fn attend_int_with(
    backend: Kernels,
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    with_scratch(|w| attend_int_in(backend, w, k, v, q, n_q, state))
}

/// Most rows of a block that the fused kernels take.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) const FUSED_ROWS: usize = 256;

/// The blocks every fused kernel of [`attend_int_with`] takes, whatever the CPU: INT4 affine
/// keys with per-channel parameters and INT4 affine values with per-row parameters
/// (KIVI-style), the same tokens (1 to [`FUSED_ROWS`]) and head_dim (64, 128 or 256), at
/// least one query row.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) fn fused_layout(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    fused_shapes(k, v, n_q)
        && matches!(k.params, Params::PerChannel { .. })
        && matches!(v.params, Params::PerRow { .. })
}

/// What [`fused_layout`], [`fused_layout_grouped`] and [`fused_layout_row_keys`] ask of
/// both blocks, but the layout of their parameters.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
fn fused_shapes(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    k.bits == 4
        && v.bits == 4
        && k.dim == v.dim
        && k.rows == v.rows
        && (1..=FUSED_ROWS).contains(&k.rows)
        && matches!(k.dim, 64 | 128 | 256)
        && n_q >= 1
        && matches!(k.levels, Levels::Affine)
        && matches!(v.levels, Levels::Affine)
}

/// The key and value layouts the x86 fused integer kernels take, given the narrow values
/// (`narrow`) and the key regions with such values (`regions`) a kernel has code for: keys
/// per channel of another width than 4 bits as one region of the row; INT4 keys in the
/// layouts of [`fused_layout`], [`fused_layout_grouped`] and [`fused_layout_row_keys`]; with
/// narrow values, INT4 keys as those layouts take them with INT4 values of the same rows (per
/// row values only).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn fused_int_layout(
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    n_q: usize,
    narrow: fn(&QuantBlock<'_>) -> bool,
    regions: fn(&[KeyRegion<'_>], &QuantBlock<'_>, usize) -> bool,
) -> bool {
    if k.bits != 4 {
        let one = [KeyRegion { first: 0, keys: *k }];
        return matches!(k.params, Params::PerChannel { .. }) && regions(&one, v, n_q);
    }
    if v.bits == 4 {
        fused_layout(k, v, n_q) || fused_layout_grouped(k, v, n_q) || fused_layout_row_keys(k, v, n_q)
    } else {
        let v4 = QuantBlock { bits: 4, row_bytes: v.dim / 2, ..*v };
        narrow(v) && (fused_layout(k, &v4, n_q) || fused_layout_row_keys(k, &v4, n_q))
    }
}

/// Most value groups of a row the fused kernels of AVX2 and dotprod take: groups of 32 along
/// the largest head_dim of [`fused_shapes`], 256.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) const MAX_GROUPS: usize = 256 / 32;

/// Whether `b` is per group with groups of 32, 64, 128 or 256 values (a power of two
/// multiple of 32: whole 16-byte lanes of 4-bit codes).
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) fn lane_groups(b: &QuantBlock<'_>) -> bool {
    matches!(b.params, Params::PerGroup { group, .. } if group.is_multiple_of(32) && group.is_power_of_two())
}

/// [`fused_layout`] with INT4 values per group instead of per row, groups of 32, 64, 128 or
/// 256 values (the values `kvq recommend` picks for most layers: `int4-g32`), which the
/// AVX-512, AVX2 and dotprod kernels take.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) fn fused_layout_grouped(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    fused_shapes(k, v, n_q) && matches!(k.params, Params::PerChannel { .. }) && lane_groups(v)
}

/// INT4 keys per token, their parameters per row or per group (groups as
/// [`fused_layout_grouped`]'s values), with values per row or per group (`int4-g32`,
/// `int4-token`, `int4-g32/int4-token`), which the AVX-512, AVX2 and dotprod kernels take.
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) fn fused_layout_row_keys(k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    fused_shapes(k, v, n_q)
        && (matches!(k.params, Params::PerRow { .. }) || lane_groups(k))
        && (matches!(v.params, Params::PerRow { .. }) || lane_groups(v))
}

/// The driver of a fused kernel: `f(nq, q, m, l, o)` on the `n_q` query rows of `q` (`dim`
/// values each) and their softmax `state` [`int8::GROUP`] rows at a time (a GQA group of
/// more, or a chunk's tokens), each group's state its own. Returns `false`, running nothing,
/// when a value scale of `v` is negative or NaN (byte weights need `p · scale ≥ 0`).
///
/// # Panics
/// When `q` and `state` do not hold `n_q` rows (the callers check the shapes first).
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) fn fused_groups(
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
    mut f: impl FnMut(usize, &[f32], &mut [f32], &mut [f32], &mut [f32]),
) -> bool {
    let (Params::PerRow { scale: vs, .. } | Params::PerGroup { scale: vs, .. }) = v.params else {
        return false;
    };
    // Without an early exit, so that the check compiles to vector compares (a scalar
    // `all` took 1.5-2% of a fused decode step).
    if !vs.iter().fold(true, |ok, &s| ok & (s >= 0.0)) {
        return false;
    }
    let (d, Online { m, l, o }) = (v.dim, state);
    assert!(q.len() == n_q * d && m.len() == n_q && l.len() == n_q && o.len() == n_q * d, "shapes");
    let mut i0 = 0;
    while i0 < n_q {
        let nq = (n_q - i0).min(int8::GROUP);
        let (q, m, l) = (&q[i0 * d..(i0 + nq) * d], &mut m[i0..i0 + nq], &mut l[i0..i0 + nq]);
        f(nq, q, m, l, &mut o[i0 * d..(i0 + nq) * d]);
        i0 += nq;
    }
    true
}

/// Whether [`attend_int_parts_with`] (and [`attend_int_with`], keys in one part) runs its fused
/// kernel for keys in `parts` like these, values like `v` and `n_q` query rows on `backend` (it
/// still declines a block whose value scales are negative).
pub fn attend_int_fused_parts(
    backend: Kernels,
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    n_q: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    match backend.backend() {
        // The AVX2 kernels where the AVX-512 ones have no code (no VNNI or VBMI, say).
        Backend::Avx512 => {
            return avx512::attend_int_parts_supported(parts, v, n_q)
                || fused_avx2::attend_int_parts_supported(parts, v, n_q);
        }
        Backend::Avx2 => return fused_avx2::attend_int_parts_supported(parts, v, n_q),
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod {
        return parts_supported(parts, v, |k, v| fused_dotprod::attend_int_supported(k, v, n_q));
    }
    let _ = (backend, parts, v, n_q);
    false
}

/// [`parts_supported`] where several parts must be INT4 keys (the fused kernels take keys of
/// other widths as one region of the row, one part only).
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
pub(crate) fn parts_supported_int4(
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    supported: impl Fn(&QuantBlock<'_>, &QuantBlock<'_>) -> bool,
) -> bool {
    (parts.len() == 1 || parts.first().is_some_and(|k| k.bits == 4)) && parts_supported(parts, v, supported)
}

/// Whether a fused kernel whose blocks `supported` accepts takes keys in `parts` with the
/// values `v`: one part as `supported(part, v)`; several (per-channel keys whose parameters
/// change every few rows of the values' block) when the first is `supported` with the values
/// of its rows, every part is per channel in the first's layout, and they cover the values'
/// rows, at most [`FUSED_ROWS`].
#[cfg_attr(not(any(target_arch = "x86_64", target_arch = "aarch64")), allow(dead_code))]
pub(crate) fn parts_supported(
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    supported: impl Fn(&QuantBlock<'_>, &QuantBlock<'_>) -> bool,
) -> bool {
    let [first, rest @ ..] = parts else { return false };
    if rest.is_empty() {
        return supported(first, v);
    }
    // The first part in full; the others as its layout (a kernel's support depends on the
    // layout and the rows, and the rows are checked here), which is cheaper per part.
    let layout = |k: &QuantBlock<'_>| match k.params {
        Params::PerChannel { offset, .. } => {
            Some((k.bits, k.dim, k.row_bytes, matches!(k.levels, Levels::Affine), offset.is_some()))
        }
        _ => None,
    };
    let mut at = 0;
    for k in parts {
        if k.rows == 0 || at + k.rows > v.rows || layout(k).is_none() || layout(k) != layout(first) {
            return false;
        }
        at += k.rows;
    }
    at == v.rows && v.rows <= FUSED_ROWS && supported(first, &v.sub_rows(0..first.rows))
}

/// [`attend_int_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`attend_int_with`].
pub(crate) fn attend_int_in(
    backend: Kernels,
    scratch: &mut Scratch,
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    attend_int_parts_in(backend, scratch, std::slice::from_ref(k), v, q, n_q, state)
}

/// [`attend_int_with`] with the keys in parts: consecutive blocks of keys with parameters of
/// their own (a cache block of per-channel keys whose parameters change every few tokens,
/// `int4-channel32` in blocks of 128) against one block of values of all their rows, in one
/// call: each part's rows scored with its own parameters ([`scores_int8_with`]), then one
/// online softmax step and one sum of the values over all the rows, as for one block
/// ([`scalar::attend_int_parts`] is the reference). The fused kernels take parts of INT4 keys
/// per channel (each part and the values of its rows as [`attend_int_with`] takes a block);
/// elsewhere it returns `Ok(false)`, changing nothing.
///
/// # Errors
/// [`KernelError::Shape`] when there are no parts, their rows do not add up to the values',
/// a part's head_dim differs from the values', or `q` and `state` do not hold `n_q` rows.
pub fn attend_int_parts_with(
    backend: Kernels,
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    with_scratch(|w| attend_int_parts_in(backend, w, parts, v, q, n_q, state))
}

/// [`attend_int_parts_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`attend_int_parts_with`].
pub(crate) fn attend_int_parts_in(
    backend: Kernels,
    scratch: &mut Scratch,
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    check_attend(parts, v, q, n_q, &state)?;
    #[cfg(target_arch = "x86_64")]
    match backend.backend() {
        // The AVX2 kernel where the AVX-512 one has no code (no VNNI or VBMI, say), or declines.
        Backend::Avx512 | Backend::Avx2 => {
            let mut state = state;
            if backend == Backend::Avx512
                && streaming(
                    scratch,
                    |s| &mut s.fused.ahead,
                    |s| avx512::attend_int_in(parts, v, q, n_q, state.reborrow(), &mut s.fused),
                )
            {
                return Ok(true);
            }
            return Ok(streaming(
                scratch,
                |s| &mut s.fused_avx2.ahead,
                |s| fused_avx2::attend_int_in(parts, v, q, n_q, state, &mut s.fused_avx2),
            ));
        }
        _ => {}
    }
    scratch.ahead.finish();
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod {
        return Ok(fused_dotprod::attend_int_in(parts, v, q, n_q, state, &mut scratch.fused_dotprod));
    }
    let _ = backend;
    Ok(false)
}

/// Runs `kernel` (an x86 fused kernel, which steps the queue of [`Scratch::prefetch_next`]
/// on from its row loops) with that queue moved to its scratch (`slot`), then prefetches
/// whatever it left (all of it when it declined the block).
#[cfg(target_arch = "x86_64")]
fn streaming(
    scratch: &mut Scratch,
    slot: impl Fn(&mut Scratch) -> &mut prefetch::Ahead,
    kernel: impl FnOnce(&mut Scratch) -> bool,
) -> bool {
    *slot(scratch) = std::mem::take(&mut scratch.ahead);
    let ran = kernel(scratch);
    slot(scratch).finish();
    ran
}

/// The shapes of a fused kernel's call: keys in parts whose rows add up to the values', of
/// the values' head_dim, `n_q` query rows and state rows.
fn check_attend(
    parts: &[QuantBlock<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: &Online<'_>,
) -> Result<(), KernelError> {
    let rows = parts.iter().try_fold(0usize, |a, k| a.checked_add(k.rows));
    let d = v.dim;
    check(
        !parts.is_empty()
            && rows == Some(v.rows)
            && parts.iter().all(|k| k.dim == d)
            && q.len() == n_q.saturating_mul(d)
            && state.m.len() == n_q
            && state.l.len() == n_q
            && state.o.len() == n_q.saturating_mul(d),
        || {
            let keys: Vec<String> = parts.iter().map(|k| format!("{} × {}", k.rows, k.dim)).collect();
            format!(
                "keys [{}], values {} × {}, {n_q} query rows: {} query values, state {} / {} / {}",
                keys.join(", "),
                v.rows,
                v.dim,
                q.len(),
                state.m.len(),
                state.l.len(),
                state.o.len()
            )
        },
    )
}

/// One width's channels of a row of keys stored with bits per channel (`-qa` specs): the
/// per-channel block of those channels' codes, channels `first .. first + keys.dim` of the
/// row (in the order the cache stores them).
#[derive(Debug, Clone, Copy)]
pub struct KeyRegion<'a> {
    /// The region's first channel in the row.
    pub first: usize,
    /// Its codes and per-channel parameters, `keys.dim` channels of every row.
    pub keys: QuantBlock<'a>,
}

/// Whether `regions` tile a row of `dim` channels in order (each starting where the last
/// ended, the first at 0, none empty), each of `rows` rows.
pub(crate) fn regions_tile(regions: &[KeyRegion<'_>], rows: usize, dim: usize) -> bool {
    let mut at = 0;
    for r in regions {
        if r.first != at || r.keys.dim == 0 || r.keys.rows != rows {
            return false;
        }
        at += r.keys.dim;
    }
    !regions.is_empty() && at == dim
}

/// The integer-path scores of keys in channel regions (`-qa`): each region's rows scored
/// with its columns of the `n_q` query rows (`q`, `n_q × dim`, `dim` the regions' channels
/// together), the query rounded to int8 with a scale of its own per region, the regions'
/// scores added into `out[i · rows + r]` ([`scalar::scores_int8_regions`] is the reference;
/// the sums are taken in another order). The AVX-512 kernel with VBMI of
/// [`attend_int_regions_with`] takes regions as it does (a head_dim of 64, 128 or 256, up to
/// 256 rows); the AVX2 kernel (on `avx2`, and on `avx512` where that one has no code) and the
/// `dotprod` kernel of aarch64 affine per-channel regions of 1 to 8 bits and a multiple of 8
/// channels, any rows, their scores the reference's bit for bit; elsewhere it returns `Ok(false)`, computing nothing, and the
/// caller scores the regions one by one ([`scores_int8_with`]).
///
/// # Errors
/// [`KernelError::Shape`] when the regions do not tile a row in order with the same rows, or
/// `q` and `out` do not hold `n_q` rows.
pub fn scores_int8_regions_with(
    backend: Kernels,
    regions: &[KeyRegion<'_>],
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<bool, KernelError> {
    with_scratch(|w| scores_int8_regions_in(backend, w, regions, q, n_q, out))
}

/// [`scores_int8_regions_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`scores_int8_regions_with`].
pub(crate) fn scores_int8_regions_in(
    backend: Kernels,
    scratch: &mut Scratch,
    regions: &[KeyRegion<'_>],
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<bool, KernelError> {
    let dim: usize = regions.iter().map(|r| r.keys.dim).sum();
    let rows = regions.first().map_or(0, |r| r.keys.rows);
    check(
        regions_tile(regions, rows, dim)
            && n_q.checked_mul(dim) == Some(q.len())
            && n_q.checked_mul(rows).is_some_and(|n| n <= out.len()),
        || {
            let keys: Vec<String> = regions
                .iter()
                .map(|r| format!("{} × {} from {}", r.keys.rows, r.keys.dim, r.first))
                .collect();
            format!(
                "key regions [{}], {n_q} query rows: {} query values, {} outputs",
                keys.join(", "),
                q.len(),
                out.len()
            )
        },
    )?;
    #[cfg(target_arch = "x86_64")]
    match backend.backend() {
        // The AVX2 kernel where the AVX-512 one has no code (no VBMI, say).
        Backend::Avx512 if avx512::scores_int8_regions_in(regions, q, n_q, out, &mut scratch.fused) => {
            return Ok(true);
        }
        Backend::Avx512 | Backend::Avx2 => {
            return Ok(regions::scores_in::<regions_avx2::Kernel>(
                regions,
                q,
                n_q,
                out,
                &mut scratch.fused_avx2.regions,
            ));
        }
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod {
        return Ok(regions::scores_in::<regions_neon::Kernel>(
            regions,
            q,
            n_q,
            out,
            &mut scratch.fused_dotprod.regions,
        ));
    }
    let _ = (backend, scratch);
    Ok(false)
}

/// [`attend_int_with`] for keys stored in channel regions of their own widths (`-qa` specs:
/// each [`KeyRegion`] a per-channel block of some of the row's channels), against one block
/// of values of the same rows: each region scored with its columns of the query rows
/// ([`scores_int8_with`], the query rounded to int8 per region), the regions' scores added,
/// then one online softmax step and one sum of the values, as for one block
/// ([`scalar::attend_int_regions`] is the reference). The AVX-512 kernel with VBMI takes
/// affine per-channel regions of 1 to 8 bits and a multiple of 8 channels with values as
/// [`attend_int_with`] takes them (see `avx512::attend_int_regions_supported`); so does the
/// AVX2 kernel (on `avx2`, and on `avx512` where that one has no code; see
/// `fused_avx2::attend_int_regions_supported`) and the `dotprod` kernel of aarch64 (see
/// `fused_dotprod::attend_int_regions_supported`); elsewhere it returns `Ok(false)`, changing
/// nothing, and the caller runs the separate kernels.
///
/// # Errors
/// [`KernelError::Shape`] when the regions do not tile the values' head_dim in order with the
/// values' rows, or `q` and `state` do not hold `n_q` rows.
pub fn attend_int_regions_with(
    backend: Kernels,
    regions: &[KeyRegion<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    with_scratch(|w| attend_int_regions_in(backend, w, regions, v, q, n_q, state))
}

/// [`attend_int_regions_with`] with the caller's [`Scratch`], as [`scores_in`].
///
/// # Errors
/// As [`attend_int_regions_with`].
pub(crate) fn attend_int_regions_in(
    backend: Kernels,
    scratch: &mut Scratch,
    regions: &[KeyRegion<'_>],
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    let d = v.dim;
    check(
        regions_tile(regions, v.rows, v.dim)
            && q.len() == n_q * d
            && state.m.len() == n_q
            && state.l.len() == n_q
            && state.o.len() == n_q * d,
        || {
            let keys: Vec<String> = regions
                .iter()
                .map(|r| format!("{} × {} from {}", r.keys.rows, r.keys.dim, r.first))
                .collect();
            format!(
                "key regions [{}], values {} × {}, {n_q} query rows: {} query values, state {} / {} / {}",
                keys.join(", "),
                v.rows,
                v.dim,
                q.len(),
                state.m.len(),
                state.l.len(),
                state.o.len()
            )
        },
    )?;
    #[cfg(target_arch = "x86_64")]
    match backend.backend() {
        // The AVX2 kernel where the AVX-512 one has no code (no VBMI, say), or declines.
        Backend::Avx512 | Backend::Avx2 => {
            let mut state = state;
            if backend == Backend::Avx512
                && streaming(
                    scratch,
                    |s| &mut s.fused.ahead,
                    |s| avx512::attend_int_regions_in(regions, v, q, n_q, state.reborrow(), &mut s.fused),
                )
            {
                return Ok(true);
            }
            return Ok(streaming(
                scratch,
                |s| &mut s.fused_avx2.ahead,
                |s| fused_avx2::attend_int_regions_in(regions, v, q, n_q, state, &mut s.fused_avx2),
            ));
        }
        _ => {}
    }
    scratch.ahead.finish();
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod {
        return Ok(fused_dotprod::attend_int_regions_in(
            regions,
            v,
            q,
            n_q,
            state,
            &mut scratch.fused_dotprod,
        ));
    }
    let _ = (backend, scratch);
    Ok(false)
}

/// Whether [`attend_int_regions_with`] runs a fused kernel for such regions and values and
/// `n_q` query rows on `backend` (it still declines a block whose value scales are negative).
pub fn attend_int_fused_regions(
    backend: Kernels,
    regions: &[KeyRegion<'_>],
    v: &QuantBlock<'_>,
    n_q: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    match backend.backend() {
        // The AVX2 kernel where the AVX-512 one has no code (no VBMI, say).
        Backend::Avx512 => {
            return avx512::attend_int_regions_supported(regions, v, n_q)
                || fused_avx2::attend_int_regions_supported(regions, v, n_q);
        }
        Backend::Avx2 => return fused_avx2::attend_int_regions_supported(regions, v, n_q),
        _ => {}
    }
    #[cfg(target_arch = "aarch64")]
    if backend == Backend::Dotprod {
        return fused_dotprod::attend_int_regions_supported(regions, v, n_q);
    }
    let _ = (backend, regions, v, n_q);
    false
}

/// A block of keys `k` and the block of values `v` of the same tokens attended by `n_q` query
/// rows `q` (`n_q × dim`, already scaled) in one fused call on the float kernels: `state`
/// updated as decode's float path updates it with [`scores_with`], the online softmax step
/// and [`axpy_with`] (for each row the scores, their maximum `m'` with the running `m`, NaN
/// scores skipped, `l ← l · e^(m − m') + Σ e^(s − m')`, `o ← o · e^(m − m') + Σ_r e^(s_r −
/// m') · v̂_r`; a row whose maximum stays −∞ gets no weight). [`scalar::attend_float`] is the
/// reference; the results equal it to the rounding of float sums taken in another order and
/// of `exp` (the softmax module's polynomial).
///
/// Where it runs (FP8 keys and values with one scale per row, `fp8e4m3-token` and
/// `fp8e5m2-token`, the same 1 to 256 rows and a head_dim that is a multiple of 32, on the
/// `avx512` backend: see `fp8_avx512::attend_supported`) the block's scores and weights stay
/// in a small buffer on the stack; elsewhere it returns `Ok(false)`, changing nothing, and the
/// caller runs the separate kernels.
///
/// # Errors
/// [`KernelError::Shape`] when the blocks differ in rows or head_dim, or `q` and `state` do not
/// hold `n_q` rows.
pub fn attend_float_with(
    backend: Kernels,
    k: &QuantBlock<'_>,
    v: &QuantBlock<'_>,
    q: &[f32],
    n_q: usize,
    state: Online<'_>,
) -> Result<bool, KernelError> {
    check_attend(std::slice::from_ref(k), v, q, n_q, &state)?;
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 {
        return Ok(fp8_avx512::attend_in(k, v, q, n_q, state));
    }
    let _ = backend;
    Ok(false)
}

/// Whether [`attend_float_with`] runs its fused kernel for blocks like `k` and `v` and `n_q`
/// query rows on `backend`.
pub fn attend_float_fused(backend: Kernels, k: &QuantBlock<'_>, v: &QuantBlock<'_>, n_q: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    if backend == Backend::Avx512 {
        return fp8_avx512::attend_supported(k, v, n_q);
    }
    let _ = (backend, k, v, n_q);
    false
}

/// Widens little-endian f16 values (`bytes`, any alignment) into `out`: the first
/// `min(out.len(), bytes.len() / 2)` values, whose count it returns. Exact (every f16 is an
/// f32), NaN and infinities included. 8 at a time with F16C (`vcvtph2ps`) where the CPU has it,
/// through `half` elsewhere and for the tail: decode widens every block's parameters with it.
pub fn widen_f16(bytes: &[u8], out: &mut [f32]) -> usize {
    let n = out.len().min(bytes.len() / 2);
    let (bytes, out) = (&bytes[..2 * n], &mut out[..n]);
    #[cfg(target_arch = "x86_64")]
    let done = avx2::widen_f16(bytes, out);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    scalar::widen_f16(&bytes[2 * done..], &mut out[done..]);
    n
}

/// [`ParamGrid::widen`](kvq_quant_core::ParamGrid::widen) (one-byte parameters: each
/// group's grid indices `(mins[i], maxs[i])` to its scale and offset) with the CPU's vector
/// instructions: the same bits, 8 pairs at a time with AVX2 where the CPU has it, through
/// `ParamGrid::widen` elsewhere and for the tail. Decode widens every block's one-byte
/// parameters with it (a baseline x86-64 build compiles `ParamGrid::widen` to SSE2, four pairs
/// at a time).
///
/// # Panics
/// When the four slices differ in length, as `ParamGrid::widen`.
pub fn widen_grid(
    grid: &kvq_quant_core::ParamGrid,
    mins: &[u8],
    maxs: &[u8],
    levels: f32,
    scales: &mut [f32],
    offsets: &mut [f32],
) {
    let n = mins.len();
    assert!(
        maxs.len() == n && scales.len() == n && offsets.len() == n,
        "one scale and offset per pair of indices"
    );
    #[cfg(target_arch = "x86_64")]
    let done = avx2::widen_grid(grid, mins, maxs, levels, scales, offsets);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    if done < n {
        grid.widen(&mins[done..], &maxs[done..], levels, &mut scales[done..], &mut offsets[done..]);
    }
}

/// Rows of per-channel affine codes to decode and turn by RoPE ([`decode_turn_with`]): the
/// keys of a block stored in their frame before RoPE (`-prerope` specs), brought to their
/// positions for scoring. For row `r` of `dim` codes, `x_c = code_c · scale_c + offset_c`,
/// then `out_c = x_c · table[r][c] + x_p · table[r][dim + c]`, `p` being the channel that `c`
/// turns with under `pairing`: `table[r]` holds the `dim` cosines of the channels' pairs, then
/// their sines, negative on the first channel of each pair (`(x_a, x_b)` becomes
/// `(x_a cos − x_b sin, x_b cos + x_a sin)`).
#[derive(Debug, Clone, Copy)]
pub struct TurnRows<'a> {
    /// Packed rows as a block stores them: `packed_len(dim, bits)` bytes each, the bit planes
    /// of `kvq_quant_core::pack`.
    pub codes: &'a [u8],
    /// Bits per code, 1 to 8.
    pub bits: u8,
    /// Per channel.
    pub scale: &'a [f32],
    /// Per channel.
    pub offset: &'a [f32],
    /// `2 · dim` values per row: cosines, then signed sines.
    pub table: &'a [f32],
    /// Which channels turn together.
    pub pairing: kvq_quant_core::RopePairing,
    /// Channels per row.
    pub dim: usize,
}

impl TurnRows<'_> {
    /// Bytes per packed row (0 for a width out of range).
    pub fn row_bytes(&self) -> usize {
        kvq_quant_core::pack::packed_len(self.dim, self.bits).unwrap_or(0)
    }

    /// Rows held.
    pub fn rows(&self) -> usize {
        self.codes.len() / self.row_bytes().max(1)
    }

    /// Row `r`'s codes, one byte each, in `out` (`dim` long).
    pub(crate) fn unpack(&self, r: usize, out: &mut [u8]) {
        let rb = self.row_bytes();
        kvq_quant_core::pack::unpack_row(&self.codes[r * rb..(r + 1) * rb], self.bits, out)
            .expect("checked by check_turn");
    }
}

/// The shape checks of [`decode_turn_with`] for `out` outputs.
fn check_turn(t: &TurnRows<'_>, out: usize) -> Result<(), KernelError> {
    let d = t.dim;
    check(d > 0 && d.is_multiple_of(2), || format!("rows of {d} channels do not hold whole RoPE pairs"))?;
    check((1..=8).contains(&t.bits), || format!("{}-bit codes", t.bits))?;
    let rb = t.row_bytes();
    check(t.codes.len().is_multiple_of(rb) && t.rows().checked_mul(d) == Some(out), || {
        format!("{} code bytes (rows of {rb}) and {out} outputs for rows of {d}", t.codes.len())
    })?;
    check(t.scale.len() == d && t.offset.len() == d, || {
        format!("{} scales and {} offsets for {d} channels", t.scale.len(), t.offset.len())
    })?;
    check(t.table.len() >= t.rows() * 2 * d, || {
        format!("a table of {} values for {} rows of {d}", t.table.len(), t.rows())
    })
}

/// Decodes and turns `t`'s rows into `out` ([`TurnRows`]). The AVX2 and AVX-512 backends run
/// an AVX2 and FMA kernel for 4- and 8-bit rows of a multiple of 32 channels, read where they
/// are packed; the others (and other shapes) unpack each row and run an f32 loop that the
/// compiler vectorizes for the target (SSE2, NEON); [`Backend::Scalar`] is the f64 reference.
///
/// # Errors
/// [`KernelError::Shape`] for an odd or zero `dim`, codes that are not whole rows or not as
/// many as `out`, a scale or offset not `dim` long, or a table shorter than `2 · dim` per row.
pub fn decode_turn_with(backend: Kernels, t: &TurnRows<'_>, out: &mut [f32]) -> Result<(), KernelError> {
    check_turn(t, out.len())?;
    #[cfg(target_arch = "x86_64")]
    if backend.cpu().avx2 && avx2::decode_turn(t, out) {
        return Ok(());
    }
    match backend.backend() {
        Backend::Scalar => scalar::decode_turn(t, out),
        _ => wide_backend::decode_turn(t, out),
    }
    Ok(())
}

/// Scores of `n_q` query rows of `q` against `t`'s rows decoded and turned by RoPE:
/// `out[i · rows + r] = q_i · turned_r`, with `turned_r` what [`decode_turn_with`] gives. AVX2
/// and AVX-512 backends fuse the decode, the turn and the dots, never writing the rows out (two
/// rows against four query rows at a time; 4- and 8-bit rows of a multiple of 32 channels, read
/// where they are packed); the others decode the rows into this thread's [`Scratch`] and score
/// them with [`dense_scores_with`]; [`Backend::Scalar`] is the f64 reference.
///
/// # Errors
/// As [`decode_turn_with`], and [`KernelError::Shape`] when `q` is not `n_q × dim` or `out`
/// not `n_q × rows` long.
pub fn scores_turn_with(
    backend: Kernels,
    t: &TurnRows<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    with_scratch(|w| scores_turn_in(backend, w, t, q, n_q, out))
}

/// [`scores_turn_with`] with the caller's [`Scratch`]: no allocation once it has held a block
/// of this size.
///
/// # Errors
/// As [`scores_turn_with`].
pub fn scores_turn_in(
    backend: Kernels,
    scratch: &mut Scratch,
    t: &TurnRows<'_>,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> Result<(), KernelError> {
    check_turn(t, t.rows() * t.dim)?;
    let n = t.rows();
    check(n_q.checked_mul(t.dim) == Some(q.len()) && n_q.checked_mul(n) == Some(out.len()), || {
        format!("{n_q} query rows of {} values and {} outputs for {n} rows of {}", q.len(), out.len(), t.dim)
    })?;
    #[cfg(target_arch = "x86_64")]
    if backend.cpu().avx2 && avx2::scores_turn(t, q, n_q, out) {
        return Ok(());
    }
    if backend == Backend::Scalar {
        scalar::scores_turn(t, q, n_q, out);
        return Ok(());
    }
    let rows = &mut scratch.w;
    rows.resize(n * t.dim, 0.0);
    wide_backend::decode_turn_in(t, rows, &mut scratch.wide.codes);
    dense_scores_with(backend, &rows[..], n, t.dim, q, n_q, out)
}

/// Asks the CPU to start loading `data` into cache (one prefetch per 64-byte line), so that a
/// block read a little later does not wait on memory. A hint only: no effect on results, and
/// a no-op where there is no prefetch instruction to use. On x86-64 the lines go to L2
/// (`prefetcht1`): a decode unit's two blocks are ~75 lines, more than L1 has miss buffers
/// for, and the T1 hint measured no slower than T0 in decode.
#[inline]
pub fn prefetch(data: &[u8]) {
    for line in cache_lines(data) {
        prefetch_line(line);
    }
}

/// [`prefetch`] of the line at `line`, an address that need not be valid (only handed to the
/// hint).
#[inline(always)]
pub(crate) fn prefetch_line(line: *const u8) {
    // SAFETY: `prefetcht1` (SSE, part of every x86-64 CPU) never faults, even on an address
    // outside the process, and changes no architectural state.
    #[cfg(target_arch = "x86_64")]
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T1 }>(line.cast())
    };
    // SAFETY: `prfm` is a hint that never faults and changes no architectural state.
    #[cfg(target_arch = "aarch64")]
    unsafe {
        std::arch::asm!("prfm pldl1keep, [{0}]", in(reg) line, options(nostack, readonly, preserves_flags))
    };
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = line;
}

/// The start of every 64-byte cache line that `data` touches, its last included, by address:
/// `chunks(64)` from an unaligned start missed the last line, and its bounds arithmetic cost
/// more instructions than the prefetches themselves. `wrapping_*` keeps the arithmetic plain:
/// the addresses are only handed to prefetch hints, never dereferenced.
#[inline]
fn cache_lines(data: &[u8]) -> impl Iterator<Item = *const u8> {
    let start = data.as_ptr() as usize;
    let back = start % 64;
    let count = if data.is_empty() { 0 } else { (back + data.len() - 1) / 64 + 1 };
    let first = data.as_ptr().wrapping_sub(back);
    (0..count).map(move |i| first.wrapping_add(64 * i))
}

/// How far ahead (bytes) a kernel streaming a block of `bytes` code bytes asks for its rows,
/// or `None` to leave it to the hardware: on Intel cores, for blocks of 1 MiB and more (rows
/// that come from L3 or DRAM; a decode block of a cache is a few KiB, and decode prefetches the
/// next one itself). The AVX2 per-group dots (`run_dots`) ask this far ahead into L1
/// ([`prefetch_l1`]); the VNNI dots ask [`STREAM_AHEAD_FAR`] ahead with [`prefetch_far`]. On a
/// 2-vCPU Intel Xeon with AVX-512 the VNNI INT4 scores read 8M rows from DRAM at 48-52% of the
/// one-thread stream rate without a prefetch and 76-77% with 2 KiB into L1 (1 KiB 72%, 3 KiB
/// 70%, 4 KiB 66%, 8 KiB 54% in an earlier build); the AVX2 integer kernel of rows per row or
/// per channel gained nothing there and does not ask. The integer path's driver asks for each
/// chunk of rows' parameters (per row or per group) before the chunk's dots, on the same
/// condition. On AMD Zen 4 the same prefetch (512 B to 4 KiB) cost 10-30%
/// (docs/performance.md), so other vendors are left alone.
#[cfg(target_arch = "x86_64")]
pub(crate) fn stream_prefetch(bytes: usize) -> Option<usize> {
    const STREAM_AHEAD: usize = 2048;
    (bytes >= 1 << 20 && intel()).then_some(STREAM_AHEAD)
}

/// How far ahead (bytes) the VNNI dots ask for a streamed block's rows with [`prefetch_far`]
/// (where [`stream_prefetch`] says to). On the 2-vCPU Intel Xeon of docs/performance.md
/// (2026-12-05), one pass over 8M INT4 rows per channel after a stream read, the variants
/// alternating in one process over three rounds: 86-89% of the stream rate with `prefetcht2`
/// 2.5 KiB ahead, 79-85% with `prefetcht1` at the same distance, 80-83% with `prefetcht0` 2 KiB
/// ahead (the previous choice); per token 84-87%, 83-84%, 80-81%. `prefetcht2` 2 KiB, 3 KiB and
/// 3.5 KiB ahead were no better than 2.5 KiB. In criterion's groups, the two builds alternating
/// three times: INT4 per channel 12.6-13.1 -> 13.2-13.4 GiB/s, per token 11.2-12.0 ->
/// 12.4-12.6, INT8 per token 12.4-13.2 -> 13.7-14.0, INT8 per channel unchanged.
#[cfg(target_arch = "x86_64")]
pub(crate) const STREAM_AHEAD_FAR: usize = 2560;

/// Whether this is an Intel CPU (its CPUID vendor string), read once.
#[cfg(target_arch = "x86_64")]
fn intel() -> bool {
    static INTEL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *INTEL.get_or_init(|| {
        let r = std::arch::x86_64::__cpuid(0);
        [r.ebx, r.edx, r.ecx] == [0x756e_6547, 0x4965_6e69, 0x6c65_746e] // "GenuineIntel"
    })
}

/// [`prefetch`] into L1 (`prefetcht0`): one hint per 64-byte line of `len` bytes from `at`,
/// an address that need not be valid (a hint never faults).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_l1(at: *const u8, len: usize) {
    prefetch_hinted::<{ std::arch::x86_64::_MM_HINT_T0 }>(at, len);
}

/// [`prefetch`] with the `prefetcht2` hint ("to a far cache level"): one hint per 64-byte line
/// of `len` bytes from `at`, an address that need not be valid (a hint never faults). For rows
/// read once from DRAM a few KiB later, where it measured faster than [`prefetch_l1`] (see
/// [`STREAM_AHEAD_FAR`]; `perf` put most of the VNNI dots' time on the `prefetcht0` itself,
/// waiting for one of L1's few miss buffers, and the far hint keeps the lines out of L1 until
/// the kernel's own load).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn prefetch_far(at: *const u8, len: usize) {
    prefetch_hinted::<{ std::arch::x86_64::_MM_HINT_T2 }>(at, len);
}

/// One `_mm_prefetch` with hint `HINT` per 64-byte line of `len` bytes from `at`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch_hinted<const HINT: i32>(at: *const u8, len: usize) {
    for k in 0..len.div_ceil(64) {
        // SAFETY: the prefetch instructions (SSE, part of every x86-64 CPU) never fault, even
        // on an invalid address; the address is only handed to the hint.
        unsafe { std::arch::x86_64::_mm_prefetch::<HINT>(at.wrapping_add(64 * k).cast()) };
    }
}

#[cfg(test)]
mod prefetch_tests {
    use super::{cache_lines, prefetch};

    #[test]
    fn every_line_touched_is_prefetched_once() {
        let buf = vec![7u8; 640];
        for start in 0..130 {
            for len in [0, 1, 2, 63, 64, 65, 127, 128, 129, 300, 640 - start] {
                let Some(data) = buf.get(start..start + len) else { continue };
                let lines: Vec<usize> = cache_lines(data).map(|p| p as usize).collect();
                let base = data.as_ptr() as usize;
                let want: Vec<usize> = (0..len).map(|i| (base + i) & !63).fold(Vec::new(), |mut v, a| {
                    if v.last() != Some(&a) {
                        v.push(a);
                    }
                    v
                });
                assert_eq!(lines, want, "start {start}, len {len}");
                prefetch(data);
            }
        }
    }

    /// Streaming prefetch only for blocks that cannot be cache-resident, and only on the
    /// vendor it was measured to pay on; hints past a buffer's end are harmless.
    #[cfg(target_arch = "x86_64")]
    #[test]
    #[cfg_attr(miri, ignore = "CPUID")]
    fn stream_prefetch_is_for_long_blocks_on_intel() {
        use super::{intel, prefetch_l1, stream_prefetch};
        for bytes in [0, 64, 4096, 64 << 10, (1 << 20) - 1] {
            assert_eq!(stream_prefetch(bytes), None, "{bytes} bytes");
        }
        assert_eq!(stream_prefetch(1 << 20).is_some(), intel());
        assert_eq!(stream_prefetch(usize::MAX).is_some(), intel());
        let buf = [1u8; 100];
        prefetch_l1(buf.as_ptr().wrapping_add(1 << 40), 4096);
        prefetch_l1(std::ptr::null(), 64);
        super::prefetch_far(buf.as_ptr().wrapping_add(1 << 40), 4096);
        super::prefetch_far(std::ptr::null(), 64);
    }
}
