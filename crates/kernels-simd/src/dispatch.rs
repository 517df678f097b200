//! Which instruction-set backend the kernels use, chosen once per process.
//!
//! Detection order: the best backend the CPU supports at run time (AVX-512 and AVX2+FMA on
//! x86-64, NEON with dotprod on aarch64), then `wide` (SSE2 on a default x86-64 build, NEON on
//! aarch64), then the scalar reference. `KVQ_FORCE_BACKEND=scalar|wide|avx2|avx512|dotprod`
//! forces one for tests and benches; forcing one the CPU lacks is an error, not a crash.

use std::fmt;
use std::sync::OnceLock;

/// An implementation of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Backend {
    /// Plain Rust, one element at a time: the reference every other backend is tested against.
    Scalar,
    /// `wide` vectors, with the instruction set fixed at compile time (SSE2 by default on
    /// x86-64, NEON on aarch64; on aarch64 the levels of codebook rows of up to 16 levels and
    /// of FP8 rows come from NEON lookups in registers, elsewhere from one table read per code).
    Wide,
    /// x86-64 AVX2 and FMA, detected at run time.
    Avx2,
    /// x86-64 AVX-512 (F, BW, VL), detected at run time.
    Avx512,
    /// aarch64 NEON with the dot-product extension (`sdot`), detected at run time.
    Dotprod,
}

impl Backend {
    /// Every backend, in order of preference from worst to best.
    pub const ALL: [Backend; 5] =
        [Backend::Scalar, Backend::Wide, Backend::Avx2, Backend::Avx512, Backend::Dotprod];

    /// The name `KVQ_FORCE_BACKEND` accepts.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Scalar => "scalar",
            Backend::Wide => "wide",
            Backend::Avx2 => "avx2",
            Backend::Avx512 => "avx512",
            Backend::Dotprod => "dotprod",
        }
    }

    /// Whether this CPU can run the backend.
    pub fn is_available(self) -> bool {
        match self {
            Backend::Scalar | Backend::Wide => true,
            Backend::Avx2 => avx2_available(),
            Backend::Avx512 => avx512_available(),
            Backend::Dotprod => dotprod_available(),
        }
    }
}

impl fmt::Display for Backend {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(target_arch = "x86_64")]
fn avx2_available() -> bool {
    // F16C comes with every AVX2 CPU; the kernels widen f16 rows and FP8 codes with it.
    std::arch::is_x86_feature_detected!("avx2")
        && std::arch::is_x86_feature_detected!("fma")
        && std::arch::is_x86_feature_detected!("f16c")
}
#[cfg(not(target_arch = "x86_64"))]
fn avx2_available() -> bool {
    false
}

#[cfg(target_arch = "x86_64")]
fn avx512_available() -> bool {
    avx2_available()
        && std::arch::is_x86_feature_detected!("avx512f")
        && std::arch::is_x86_feature_detected!("avx512bw")
        && std::arch::is_x86_feature_detected!("avx512vl")
}
#[cfg(not(target_arch = "x86_64"))]
fn avx512_available() -> bool {
    false
}

#[cfg(target_arch = "aarch64")]
fn dotprod_available() -> bool {
    std::arch::is_aarch64_feature_detected!("dotprod")
}
#[cfg(not(target_arch = "aarch64"))]
fn dotprod_available() -> bool {
    false
}

/// Why a backend could not be selected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DispatchError {
    /// `KVQ_FORCE_BACKEND` names no backend.
    #[error("KVQ_FORCE_BACKEND={0:?} is not one of scalar, wide, avx2, avx512, dotprod")]
    Unknown(String),
    /// `KVQ_FORCE_BACKEND` names a backend this CPU cannot run.
    #[error("KVQ_FORCE_BACKEND={0} but this CPU does not support it (available: {1})")]
    Unavailable(Backend, String),
}

/// Backends this CPU can run, worst to best.
pub fn available() -> Vec<Backend> {
    Backend::ALL.into_iter().filter(|b| b.is_available()).collect()
}

/// The best backend this CPU can run.
pub fn detect() -> Backend {
    available().into_iter().max().unwrap_or(Backend::Scalar)
}

/// Parses a `KVQ_FORCE_BACKEND` value.
///
/// # Errors
/// [`DispatchError::Unknown`] or [`DispatchError::Unavailable`].
pub fn parse_forced(value: &str) -> Result<Backend, DispatchError> {
    let b = Backend::ALL
        .into_iter()
        .find(|b| b.name().eq_ignore_ascii_case(value.trim()))
        .ok_or_else(|| DispatchError::Unknown(value.to_string()))?;
    if b.is_available() {
        Ok(b)
    } else {
        let names: Vec<&str> = available().iter().map(|b| b.name()).collect();
        Err(DispatchError::Unavailable(b, names.join(", ")))
    }
}

/// The backend of this process: `KVQ_FORCE_BACKEND` if set, else [`detect`]. Decided on the
/// first call and cached.
///
/// # Errors
/// The [`DispatchError`] of a bad `KVQ_FORCE_BACKEND`, on every call.
pub fn selected() -> Result<Backend, DispatchError> {
    static CHOICE: OnceLock<Result<Backend, DispatchError>> = OnceLock::new();
    CHOICE
        .get_or_init(|| match std::env::var("KVQ_FORCE_BACKEND") {
            Ok(v) if !v.is_empty() => parse_forced(&v),
            _ => Ok(detect()),
        })
        .clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalar_and_wide_are_always_there() {
        let a = available();
        assert!(a.contains(&Backend::Scalar) && a.contains(&Backend::Wide));
        assert!(a.contains(&detect()));
        assert_eq!(parse_forced("SCALAR"), Ok(Backend::Scalar));
        assert!(matches!(parse_forced("sse9"), Err(DispatchError::Unknown(_))));
    }

    #[test]
    fn unavailable_backends_are_errors() {
        for b in Backend::ALL {
            match parse_forced(b.name()) {
                Ok(got) => assert!(b.is_available() && got == b),
                Err(e) => assert!(!b.is_available() && matches!(e, DispatchError::Unavailable(..)), "{e}"),
            }
        }
        #[cfg(target_arch = "x86_64")]
        assert!(parse_forced("dotprod").is_err());
        #[cfg(target_arch = "aarch64")]
        assert!(parse_forced("avx2").is_err());
    }

    /// Under `cargo xtask cross`, proves the tests really ran on aarch64 with the CPU features
    /// the emulator was asked for (EXPECT_ARCH, EXPECT_DOTPROD).
    #[test]
    fn runs_where_the_harness_expects() {
        if let Ok(arch) = std::env::var("EXPECT_ARCH") {
            assert_eq!(std::env::consts::ARCH, arch, "tests ran on the wrong architecture");
        }
        if let Ok(dot) = std::env::var("EXPECT_DOTPROD") {
            assert_eq!(
                Backend::Dotprod.is_available(),
                dot == "1",
                "dotprod detection disagrees with the emulated CPU"
            );
        }
    }

    /// `selected()` is what the environment asks for: the forced backend when it is valid,
    /// an error when it is not, the detected best when nothing is forced.
    #[test]
    fn the_selected_backend_is_what_the_environment_asks_for() {
        match std::env::var("KVQ_FORCE_BACKEND") {
            Ok(forced) if !forced.is_empty() => match parse_forced(&forced) {
                Ok(want) => assert_eq!(selected(), Ok(want)),
                Err(e) => assert_eq!(selected(), Err(e)),
            },
            _ => assert_eq!(selected(), Ok(detect())),
        }
        if let Ok(b) = selected() {
            assert!(b.is_available());
        }
    }
}
