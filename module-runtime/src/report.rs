//! What a load found: [`LoadReport`], the payload of [`Error::Load`](crate::Error::Load).

use std::fmt;

use candle_core::{DType, Shape};

use crate::lazy_shape::LazyShape;

/// One entry whose value does not fit the model.
#[derive(Clone, Debug, PartialEq)]
pub struct Mismatch {
    /// The model path.
    pub key: String,
    /// The model's shape.
    pub expected_shape: Shape,
    /// The model's dtype.
    pub expected_dtype: DType,
    /// The checkpoint's shape.
    pub shape: Shape,
    /// The checkpoint's dtype.
    pub dtype: DType,
    /// For an unbuilt lazy parameter or buffer: the shapes it takes (`?` for any size);
    /// `expected_shape` is then its empty placeholder's.
    pub unbuilt: Option<LazyShape>,
}

/// Everything a load found: what it loaded, and every key that did not fit, all at once.
///
/// A failed load returns this inside [`Error::Load`](crate::Error::Load); a successful non-strict load returns it so the
/// caller can inspect what was skipped.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoadReport {
    /// Model paths the checkpoint has no value for.
    pub missing: Vec<String>,
    /// Checkpoint keys (after key rules) that name nothing in the model.
    pub unexpected: Vec<String>,
    /// Entries with the wrong shape or dtype.
    pub mismatched: Vec<Mismatch>,
    /// `(missing, unexpected)` pairs that look like the same entry under two spellings.
    pub suggestions: Vec<(String, String)>,
    /// How many model entries received a value.
    pub loaded: usize,
}

impl LoadReport {
    /// Whether every model entry was loaded and nothing was left over.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.unexpected.is_empty() && self.mismatched.is_empty()
    }
}

impl fmt::Display for LoadReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let quoted = |keys: &[String]| {
            keys.iter()
                .map(|k| format!("\"{k}\""))
                .collect::<Vec<_>>()
                .join(", ")
        };
        if !self.missing.is_empty() {
            writeln!(f, "  missing key(s): {}.", quoted(&self.missing))?;
        }
        if !self.unexpected.is_empty() {
            writeln!(f, "  unexpected key(s): {}.", quoted(&self.unexpected))?;
        }
        for m in &self.mismatched {
            let expected = match &m.unbuilt {
                Some(shape) => format!("{shape} (unbuilt)"),
                None => format!("{:?}", m.expected_shape),
            };
            writeln!(
                f,
                "  \"{}\": the checkpoint has {:?} {:?}, the model has {:?} {}.",
                m.key, m.dtype, m.shape, m.expected_dtype, expected
            )?;
        }
        for (missing, unexpected) in &self.suggestions {
            writeln!(
                f,
                "  did you mean: \"{unexpected}\" in the checkpoint for \"{missing}\" in the model?"
            )?;
        }
        Ok(())
    }
}
