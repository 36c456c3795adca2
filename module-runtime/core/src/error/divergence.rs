//! The payload of [`Error::OutputMismatch`](crate::Error::OutputMismatch): where a run's outputs
//! left the expected ones, and the [`Tolerance`] that decided it.

use candle_core::{DType, Shape};

/// How close an output must be to the expected one: `|output - expected| <= atol + rtol *
/// |expected|` for every element, as `torch.allclose` (NaN is never close, as with its
/// `equal_nan=False`).
///
/// There is no default: which tolerance fits depends on the dtype and on where the expected
/// values come from. Outputs of another framework (PyTorch's, captured to a file) differ from
/// ours in float32 by rounding, a few 1e-7, which `torch.allclose`'s defaults
/// ([`allclose`](Self::allclose), `atol = 1e-8`) reject for small values;
/// [`for_dtype`](Self::for_dtype) gives `torch.testing.assert_close`'s per-dtype defaults, made
/// for that comparison. Outputs of this framework on the same machine compare
/// [`exact`](Self::exact)ly.
///
/// ```
/// use module_runtime::Tolerance;
/// use candle_core::DType;
///
/// let f32_tol = Tolerance::for_dtype(DType::F32);
/// assert_eq!((f32_tol.atol, f32_tol.rtol), (1e-5, 1.3e-6));
/// // An honest float32 difference between two frameworks: 5e-7 on a value of 0.01.
/// assert!(f32_tol.is_close(0.0100005, 0.01));
/// assert!(!Tolerance::allclose().is_close(0.0100005, 0.01));
/// ```
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Tolerance {
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
}

impl Tolerance {
    /// A tolerance of `atol` absolute and `rtol` relative.
    pub fn new(atol: f64, rtol: f64) -> Self {
        Self { atol, rtol }
    }

    /// Only exact equality.
    pub fn exact() -> Self {
        Self::new(0.0, 0.0)
    }

    /// `torch.allclose`'s defaults: `atol = 1e-8`, `rtol = 1e-5`.
    pub fn allclose() -> Self {
        Self::new(1e-8, 1e-5)
    }

    /// `torch.testing.assert_close`'s defaults for outputs of `dtype`, as `(atol, rtol)`: float32
    /// `(1e-5, 1.3e-6)`, float64 `(1e-7, 1e-7)`, float16 `(1e-5, 1e-3)`, bfloat16 and the 8-bit
    /// floats `(1e-5, 1.6e-2)`; integers exactly.
    pub fn for_dtype(dtype: DType) -> Self {
        match dtype {
            DType::F32 => Self::new(1e-5, 1.3e-6),
            DType::F64 => Self::new(1e-7, 1e-7),
            DType::F16 => Self::new(1e-5, 1e-3),
            d if d.is_float() => Self::new(1e-5, 1.6e-2),
            _ => Self::exact(),
        }
    }

    /// Whether `value` is close to `expected` (never for NaN).
    pub fn is_close(&self, value: f64, expected: f64) -> bool {
        (value - expected).abs() <= self.atol + self.rtol * expected.abs()
    }
}

/// The payload of [`Error::OutputMismatch`](crate::Error::OutputMismatch): the first call of a submodule, in call order,
/// whose output is not close to the expected one.
#[derive(Clone, Debug, PartialEq)]
pub struct OutputDivergence {
    /// The submodule's path.
    pub path: String,
    /// Which call of the submodule (0 for its first call in the run).
    pub call: usize,
    /// Which of its output tensors.
    pub output: usize,
    /// The largest absolute difference: infinite when the shapes or the number of outputs
    /// differ, NaN when only NaNs differ.
    pub max_diff: f64,
    /// The tolerance used.
    pub tolerance: Tolerance,
    /// The expected tensor's shape.
    pub expected_shape: Shape,
    /// The output's shape.
    pub shape: Shape,
    /// Every diverging call as `path` (first call) or `path#call`, in call order, this one
    /// first.
    pub diverging: Vec<String>,
}

impl std::fmt::Display for OutputDivergence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "output {} of call {} of `{}` differs from the expected: ",
            self.output, self.call, self.path
        )?;
        if self.expected_shape != self.shape {
            write!(
                f,
                "expected shape {:?}, got {:?}",
                self.expected_shape, self.shape
            )?;
        } else if self.max_diff == f64::INFINITY {
            f.write_str("another number of output tensors, or infinite values")?;
        } else {
            let Tolerance { atol, rtol } = self.tolerance;
            write!(
                f,
                "max |difference| {:e} (tolerance: atol {atol:e}, rtol {rtol:e})",
                self.max_diff
            )?;
        }
        if self.diverging.len() > 1 {
            let n = self.diverging.len();
            write!(
                f,
                "; {n} diverging calls in all: {}",
                self.diverging.join(", ")
            )?;
        }
        Ok(())
    }
}
