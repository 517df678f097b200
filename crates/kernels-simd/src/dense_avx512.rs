//! AVX-512 kernels for full-precision rows (f32, or f16 widened in the register with
//! `vcvtph2ps`): the dense baselines' scores and value sums, sixteen lanes where the AVX2
//! kernels (`avx2.rs`, `dense_scores_tile` and `dense_axpy_tile`) take eight. The baseline an
//! AVX-512 machine is compared against should run at that machine's width, or every "faster
//! than f16" leans on a kernel half as wide as the quantized ones.
//!
//! Same shapes as the AVX2 kernels: scores take four rows against up to four query rows at a
//! time (each 16-value chunk of a row loaded and widened once for the whole group), value sums
//! hold 32 output columns of up to four query rows in registers over spans of rows. Rows of a
//! multiple of 16 values; others are left to the AVX2 kernels. The results are the scalar
//! reference's to the rounding of float sums taken in another order.

use std::arch::x86_64::*;

/// Whether these kernels run here for rows of `dim` values: AVX-512F on this CPU and `dim` a
/// positive multiple of 16.
pub fn supported(dim: usize) -> bool {
    dim > 0 && dim.is_multiple_of(16) && cpu_ok()
}

fn cpu_ok() -> bool {
    crate::dispatch::cpu().avx512
}

/// Calls `$tile::<NQ, $half>` with `$args` for the query rows four at a time (`$i0` the first
/// of each four, `NQ` how many of them there are). The caller's comment states why the calls
/// are sound.
macro_rules! four_query_rows_at_a_time {
    ($n_q:expr, $tile:ident::<$half:ident>, |$i0:ident| ($($arg:expr),*)) => {{
        let mut $i0 = 0;
        while $i0 < $n_q {
            // SAFETY: as the caller states.
            unsafe {
                match $n_q - $i0 {
                    1 => $tile::<1, $half>($($arg),*),
                    2 => $tile::<2, $half>($($arg),*),
                    3 => $tile::<3, $half>($($arg),*),
                    _ => $tile::<4, $half>($($arg),*),
                }
            }
            $i0 += 4;
        }
    }};
}

/// Sixteen floats of a full-precision row from element `at` of `x` (f32, or f16 as `HALF` says).
///
/// # Safety
/// The CPU must support AVX-512F; elements `at .. at + 16` of `x` lie within it.
#[inline]
#[target_feature(enable = "avx512f")]
unsafe fn load16<const HALF: bool>(x: *const u8, at: usize) -> __m512 {
    // SAFETY: as this function's.
    unsafe {
        if HALF {
            _mm512_cvtph_ps(_mm256_loadu_si256(x.add(at * 2).cast()))
        } else {
            _mm512_loadu_ps(x.cast::<f32>().add(at))
        }
    }
}

/// `out[i · rows + r] = q_i · x_r` (see `crate::scalar::dense_scores`). Returns `false`,
/// computing nothing, where [`supported`] says no.
///
/// The caller checked the lengths: `x` holds `rows · dim` elements (f32, or f16 as `HALF`
/// says), `q` `n_q · dim` floats, `out` `n_q · rows`.
pub(crate) fn dense_scores<const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    q: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> bool {
    if !supported(dim) {
        return false;
    }
    // SAFETY (of each call): `supported` checked the CPU and dim % 16; the query rows from i0
    // on and their scores lie in `q` and `out`, `x` holds rows · dim elements (the caller's
    // check).
    four_query_rows_at_a_time!(n_q, scores_tile::<HALF>, |i0| (
        x,
        rows,
        dim,
        &q[i0 * dim..],
        &mut out[i0 * rows..]
    ));
    true
}

/// Rows of `x` scored together by [`scores_tile`].
const SCORE_ROWS: usize = 4;

/// The scores of the first `NQ` query rows: [`SCORE_ROWS`] rows of `x` at a time (then one at
/// a time for the last few), each 16-value chunk loaded once for the `NQ` query chunks.
///
/// # Safety
/// The CPU must support AVX-512F; `dim % 16 == 0`; `x` holds `rows · dim` elements, `q` at
/// least `NQ · dim` floats, `out` at least `(NQ - 1) · rows + rows`.
#[target_feature(enable = "avx512f")]
unsafe fn scores_tile<const NQ: usize, const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    q: &[f32],
    out: &mut [f32],
) {
    let qp = q.as_ptr();
    let mut r = 0;
    while r + SCORE_ROWS <= rows {
        let mut acc = [[_mm512_setzero_ps(); NQ]; SCORE_ROWS];
        for c in (0..dim).step_by(16) {
            // SAFETY: c + 16 <= dim; rows r .. r + 4 lie within x, query rows i < NQ within q.
            unsafe {
                let mut xs = [_mm512_setzero_ps(); SCORE_ROWS];
                for (j, v) in xs.iter_mut().enumerate() {
                    *v = load16::<HALF>(x, (r + j) * dim + c);
                }
                for i in 0..NQ {
                    let qv = _mm512_loadu_ps(qp.add(i * dim + c));
                    for (a, &xv) in acc.iter_mut().zip(&xs) {
                        a[i] = _mm512_fmadd_ps(xv, qv, a[i]);
                    }
                }
            }
        }
        for (j, a) in acc.iter().enumerate() {
            for (i, &v) in a.iter().enumerate() {
                out[i * rows + r + j] = _mm512_reduce_add_ps(v);
            }
        }
        r += SCORE_ROWS;
    }
    while r < rows {
        let mut acc = [_mm512_setzero_ps(); NQ];
        for c in (0..dim).step_by(16) {
            // SAFETY: as above, for row r.
            unsafe {
                let x0 = load16::<HALF>(x, r * dim + c);
                for (i, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(x0, _mm512_loadu_ps(qp.add(i * dim + c)), *a);
                }
            }
        }
        for (i, &a) in acc.iter().enumerate() {
            out[i * rows + r] = _mm512_reduce_add_ps(a);
        }
        r += 1;
    }
}

/// `out[i · dim + c] += Σ_r p[i · rows + r] · x[r · dim + c]` (see
/// `crate::scalar::dense_axpy`). Returns `false`, computing nothing, where [`supported`] says
/// no.
///
/// The caller checked the lengths: `x` holds `rows · dim` elements (f32, or f16 as `HALF`
/// says), `p` `n_q · rows` floats, `out` `n_q · dim`.
pub(crate) fn dense_axpy<const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    p: &[f32],
    n_q: usize,
    out: &mut [f32],
) -> bool {
    if !supported(dim) {
        return false;
    }
    // SAFETY (of each call): `supported` checked the CPU and dim % 16; the weights of the
    // query rows from i0 on and their outputs lie in `p` and `out`, `x` holds rows · dim
    // elements (the caller's check).
    four_query_rows_at_a_time!(n_q, axpy_tile::<HALF>, |i0| (
        x,
        rows,
        dim,
        &p[i0 * rows..],
        &mut out[i0 * dim..]
    ));
    true
}

/// Rows per span of [`axpy_tile`]: 32 rows of 128 f32 are 16 KiB, so a span's column passes
/// stay in L1.
const SPAN: usize = 32;

/// The value sums of the first `NQ` query rows: 32 output columns of each (16 where `dim` is
/// an odd multiple of 16) held in registers while a span of rows passes.
///
/// # Safety
/// The CPU must support AVX-512F; `dim % 16 == 0`; `x` holds `rows · dim` elements, `p` at
/// least `(NQ - 1) · rows + rows` floats, `out` at least `NQ · dim`.
#[target_feature(enable = "avx512f")]
unsafe fn axpy_tile<const NQ: usize, const HALF: bool>(
    x: *const u8,
    rows: usize,
    dim: usize,
    p: &[f32],
    out: &mut [f32],
) {
    let (pp, op) = (p.as_ptr(), out.as_mut_ptr());
    let bytes = if HALF { 2 } else { 4 };
    for r0 in (0..rows).step_by(SPAN) {
        let end = rows.min(r0 + SPAN);
        // The next span's rows, a line at a time: its column passes read each row 64 or 128
        // bytes at a time, a stride the hardware prefetcher does not follow from DRAM.
        for off in (end * dim * bytes..rows.min(end + SPAN) * dim * bytes).step_by(64) {
            // SAFETY: `off` lies inside `x` (rows · dim elements); a prefetch reads nothing.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(x.add(off).cast()) };
        }
        let mut c = 0;
        while c + 32 <= dim {
            // SAFETY: c + 32 <= dim; output rows i < NQ lie within out.
            let mut acc: [[__m512; 2]; NQ] = std::array::from_fn(|i| unsafe {
                [_mm512_loadu_ps(op.add(i * dim + c)), _mm512_loadu_ps(op.add(i * dim + c + 16))]
            });
            for r in r0..end {
                // SAFETY: row r lies within x, weight i · rows + r within p.
                unsafe {
                    let (x0, x1) = (load16::<HALF>(x, r * dim + c), load16::<HALF>(x, r * dim + c + 16));
                    for (i, a) in acc.iter_mut().enumerate() {
                        let w = _mm512_set1_ps(*pp.add(i * rows + r));
                        a[0] = _mm512_fmadd_ps(x0, w, a[0]);
                        a[1] = _mm512_fmadd_ps(x1, w, a[1]);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                // SAFETY: as for the loads.
                unsafe {
                    _mm512_storeu_ps(op.add(i * dim + c), a[0]);
                    _mm512_storeu_ps(op.add(i * dim + c + 16), a[1]);
                }
            }
            c += 32;
        }
        if c < dim {
            // The last 16 columns of a row of an odd multiple of 16.
            // SAFETY: c + 16 == dim; output rows i < NQ lie within out.
            let mut acc: [__m512; NQ] =
                std::array::from_fn(|i| unsafe { _mm512_loadu_ps(op.add(i * dim + c)) });
            for r in r0..end {
                // SAFETY: as above.
                unsafe {
                    let x0 = load16::<HALF>(x, r * dim + c);
                    for (i, a) in acc.iter_mut().enumerate() {
                        *a = _mm512_fmadd_ps(x0, _mm512_set1_ps(*pp.add(i * rows + r)), *a);
                    }
                }
            }
            for (i, a) in acc.iter().enumerate() {
                // SAFETY: as above.
                unsafe { _mm512_storeu_ps(op.add(i * dim + c), *a) };
            }
        }
    }
}
