//! The element types a model hands the cache: `f32`, `half::f16` and `half::bf16`.
//!
//! Keys and values are stored in the cache's own formats whatever they arrive in, and
//! attention computes in f32; [`Element`] only says how a model's tensors are read and how
//! the outputs are written back. An engine running in f16 or bf16 passes its buffers as they
//! are, with no copy of its own:
//!
//! ```
//! use half::f16;
//! use kvq::prelude::*;
//!
//! let config = KvCacheConfig::builder(1, 1, 2, 64).build()?;
//! let mut cache = QuantizedKvCache::new(config)?;
//! let seq = cache.create();
//! let kv: Vec<f16> = (0..64).map(|i| f16::from_f32((i as f32 * 0.1).sin())).collect();
//! cache.append(seq, 0, &kv, &kv)?;
//! let q = vec![f16::from_f32(0.5); 2 * 64];
//! let mut out = vec![f16::ZERO; 2 * 64];
//! cache.attention(&AttentionOptions::default(), seq, 0, &q, &mut out)?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::borrow::Cow;

use half::{bf16, f16};

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// An element type of queries, keys, values and attention outputs: `f32`, `f16` or `bf16`.
/// Sealed: the cache's arithmetic is f32, and these are the types it widens from exactly.
pub trait Element: Copy + Send + Sync + sealed::Sealed + 'static {
    /// The type's name, for messages.
    const NAME: &'static str;
    /// Zero.
    const ZERO: Self;
    /// The largest finite magnitude of the type.
    const MAX: f32;

    /// The value as f32 (exact: every f16 and bf16 is an f32).
    fn to_f32(self) -> f32;

    /// The nearest value of the type (ties to even); beyond [`Element::MAX`] it is infinite.
    fn from_f32(x: f32) -> Self;

    /// The slice as f32: borrowed for f32, widened into a new buffer otherwise.
    fn widen(x: &[Self]) -> Cow<'_, [f32]>;
}

impl Element for f32 {
    const NAME: &'static str = "f32";
    const ZERO: Self = 0.0;
    const MAX: f32 = f32::MAX;

    #[inline]
    fn to_f32(self) -> f32 {
        self
    }

    #[inline]
    fn from_f32(x: f32) -> Self {
        x
    }

    fn widen(x: &[Self]) -> Cow<'_, [f32]> {
        Cow::Borrowed(x)
    }
}

/// The half-precision types: exact widening, rounding to nearest, whole slices through half
/// (F16C for f16 where the CPU has it).
macro_rules! half_element {
    ($t:ty, $name:literal, $max:expr) => {
        impl Element for $t {
            const NAME: &'static str = $name;
            const ZERO: Self = <$t>::ZERO;
            const MAX: f32 = $max;

            #[inline]
            fn to_f32(self) -> f32 {
                <$t>::to_f32(self)
            }

            #[inline]
            fn from_f32(x: f32) -> Self {
                <$t>::from_f32(x)
            }

            fn widen(x: &[Self]) -> Cow<'_, [f32]> {
                use half::slice::HalfFloatSliceExt;
                Cow::Owned(x.to_f32_vec())
            }
        }
    };
}

half_element!(f16, "f16", 65504.0);
half_element!(bf16, "bf16", 3.389_531_4e38);

/// Whether `x` stays finite when it is written as a `T` (rounded to nearest).
pub(crate) fn fits<T: Element>(x: f32) -> bool {
    T::from_f32(x).to_f32().is_finite()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn widening_is_exact_and_narrowing_rounds_to_nearest() {
        let x = [1.0f32, -2.5, 0.1, 65504.0, 1e-8];
        let h: Vec<f16> = x.iter().map(|&v| f16::from_f32(v)).collect();
        let w = f16::widen(&h);
        for (a, b) in w.iter().zip(&h) {
            assert_eq!(*a, b.to_f32());
        }
        assert!(matches!(f32::widen(&x), Cow::Borrowed(_)));
        assert_eq!(<bf16 as Element>::from_f32(1.0).to_f32(), 1.0);
        assert!(fits::<f16>(65504.0));
        assert!(!fits::<f16>(65520.0), "rounds up to infinity in f16");
        assert!(fits::<bf16>(1e38) && fits::<f32>(f32::MAX));
        assert!(!fits::<f32>(f32::NAN));
        assert_eq!(bf16::MAX.to_f32(), <bf16 as Element>::MAX);
        assert_eq!(f16::MAX.to_f32(), <f16 as Element>::MAX);
    }
}
