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
            Backend::Avx2 => cpu().avx2,
            Backend::Avx512 => cpu().avx512,
            Backend::Dotprod => cpu().dotprod,
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

/// The extensions of this CPU the kernels use, detected once per process ([`cpu`]); the
/// kernels' own guards read these, never the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct Cpu {
    /// AVX2, FMA and F16C.
    pub(crate) avx2: bool,
    /// AVX-512 F, BW and VL, with AVX2.
    pub(crate) avx512: bool,
    /// AVX-512 VNNI, with AVX-512.
    pub(crate) vnni: bool,
    /// AVX-512 VBMI, with AVX-512.
    pub(crate) vbmi: bool,
    /// aarch64 NEON with the dot-product extension.
    pub(crate) dotprod: bool,
}

impl Cpu {
    const NONE: Cpu = Cpu { avx2: false, avx512: false, vnni: false, vbmi: false, dotprod: false };

    fn detect() -> Self {
        let (avx2, avx512, dotprod) = (avx2_available(), avx512_available(), dotprod_available());
        #[cfg(target_arch = "x86_64")]
        let (vnni, vbmi) = (
            avx512 && std::arch::is_x86_feature_detected!("avx512vnni"),
            avx512 && std::arch::is_x86_feature_detected!("avx512vbmi"),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (vnni, vbmi) = (false, false);
        Cpu { avx2, avx512, vnni, vbmi, dotprod }
    }

    /// What `backend` may use of this CPU: nothing beyond the backend's instruction set.
    fn for_backend(self, backend: Backend) -> Self {
        match backend {
            Backend::Scalar | Backend::Wide => Cpu::NONE,
            Backend::Avx2 => Cpu { avx2: self.avx2, ..Cpu::NONE },
            Backend::Avx512 => Cpu { dotprod: false, ..self },
            Backend::Dotprod => Cpu { dotprod: self.dotprod, ..Cpu::NONE },
        }
    }
}

/// This CPU's extensions, detected on the first call.
pub(crate) fn cpu() -> Cpu {
    static CPU: OnceLock<Cpu> = OnceLock::new();
    *CPU.get_or_init(Cpu::detect)
}

/// A backend this CPU runs, resolved once: what every kernel entry takes. Only detection makes
/// one ([`Kernels::new`], [`detect`], [`selected`], [`available`]), so an entry never asks the
/// CPU again and [`crate::implementation`] and its kin name the code that really runs.
/// [`Kernels::SCALAR`] and [`Kernels::WIDE`] run everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kernels {
    backend: Backend,
    cpu: Cpu,
}

impl Kernels {
    /// The scalar reference.
    pub const SCALAR: Kernels = Kernels { backend: Backend::Scalar, cpu: Cpu::NONE };
    /// The `wide` kernels (SSE2 on x86-64, NEON on aarch64).
    pub const WIDE: Kernels = Kernels { backend: Backend::Wide, cpu: Cpu::NONE };

    /// The kernels of `backend` if this CPU runs it.
    ///
    /// # Errors
    /// [`DispatchError::Unavailable`] when it does not.
    pub fn new(backend: Backend) -> Result<Self, DispatchError> {
        if backend.is_available() {
            Ok(Kernels { backend, cpu: cpu().for_backend(backend) })
        } else {
            let names: Vec<&str> =
                Backend::ALL.iter().filter(|b| b.is_available()).map(|b| b.name()).collect();
            Err(DispatchError::Unavailable(backend, names.join(", ")))
        }
    }

    /// The backend.
    pub fn backend(self) -> Backend {
        self.backend
    }

    /// The backend's name, as `KVQ_FORCE_BACKEND` takes it.
    pub fn name(self) -> &'static str {
        self.backend.name()
    }

    /// The extensions the kernels of this backend may use.
    pub(crate) fn cpu(self) -> Cpu {
        self.cpu
    }
}

impl PartialEq<Backend> for Kernels {
    fn eq(&self, other: &Backend) -> bool {
        self.backend == *other
    }
}

impl fmt::Display for Kernels {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
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

/// The backends this CPU can run, worst to best.
pub fn available() -> Vec<Kernels> {
    Backend::ALL.into_iter().filter_map(|b| Kernels::new(b).ok()).collect()
}

/// The best backend this CPU can run.
pub fn detect() -> Kernels {
    available().into_iter().max_by_key(|k| k.backend).unwrap_or(Kernels::SCALAR)
}

/// Parses a `KVQ_FORCE_BACKEND` value.
///
/// # Errors
/// [`DispatchError::Unknown`] or [`DispatchError::Unavailable`].
pub fn parse_forced(value: &str) -> Result<Kernels, DispatchError> {
    let b = Backend::ALL
        .into_iter()
        .find(|b| b.name().eq_ignore_ascii_case(value.trim()))
        .ok_or_else(|| DispatchError::Unknown(value.to_string()))?;
    Kernels::new(b)
}

/// The backend of this process: `KVQ_FORCE_BACKEND` if set, else [`detect`]. Decided on the
/// first call and cached.
///
/// # Errors
/// The [`DispatchError`] of a bad `KVQ_FORCE_BACKEND`, on every call.
pub fn selected() -> Result<Kernels, DispatchError> {
    static CHOICE: OnceLock<Result<Kernels, DispatchError>> = OnceLock::new();
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
        assert!(a.contains(&Kernels::SCALAR) && a.contains(&Kernels::WIDE));
        assert!(a.contains(&detect()));
        assert_eq!(parse_forced("SCALAR"), Ok(Kernels::SCALAR));
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

    /// A backend's kernels use nothing beyond its instruction set: the AVX2 kernels of an
    /// AVX-512 CPU take no AVX-512 path, and no kernels claim what the CPU lacks.
    #[test]
    fn kernels_use_only_their_backends_extensions() {
        for k in available() {
            let c = k.cpu();
            assert!(c.avx2 <= cpu().avx2 && c.avx512 <= cpu().avx512 && c.vnni <= cpu().vnni);
            assert!(c.vbmi <= cpu().vbmi && c.dotprod <= cpu().dotprod);
            match k.backend() {
                Backend::Scalar | Backend::Wide => assert_eq!(c, Cpu::NONE),
                Backend::Avx2 => assert!(c.avx2 && !c.avx512 && !c.vnni && !c.vbmi && !c.dotprod),
                Backend::Avx512 => assert!(c.avx2 && c.avx512 && !c.dotprod),
                Backend::Dotprod => assert!(c.dotprod && !c.avx2),
            }
        }
        for b in Backend::ALL {
            assert_eq!(Kernels::new(b).is_ok(), b.is_available(), "{b}");
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
        if let Ok(k) = selected() {
            assert!(k.backend().is_available());
        }
    }
}
