//! The payload of [`Error::OutputMismatch`](crate::Error::OutputMismatch): where a run's outputs
//! left the expected ones, and the [`Tolerance`] that decided it.

use candle_core::Shape;

/// How close an output must be to the expected one: `|output - expected| <= atol + rtol *
/// |expected|` for every element, as `torch.allclose` (NaN is never close, as with its
/// `equal_nan=False`).
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
}

impl Default for Tolerance {
    /// `torch.allclose`'s defaults: `atol = 1e-8`, `rtol = 1e-5`.
    fn default() -> Self {
        Self::new(1e-8, 1e-5)
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
