//! The shape of an unbuilt (lazy) parameter or buffer.

use std::fmt;

/// The shape of an unbuilt parameter or buffer: a rank, with each dimension known (`Some`) or
/// decided when it is built (`None`, shown as `?`).
///
/// ```
/// use module_runtime::LazyShape;
/// let shape = LazyShape::new([Some(10), None]);
/// assert_eq!(shape.to_string(), "[10, ?]");
/// assert!(shape.accepts(&[10, 7]));
/// assert!(!shape.accepts(&[7, 10]));
/// ```
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LazyShape(Vec<Option<usize>>);

impl LazyShape {
    /// A shape from its dimensions, `None` for those the input decides.
    pub fn new(dims: impl IntoIterator<Item = Option<usize>>) -> Self {
        Self(dims.into_iter().collect())
    }

    /// The dimensions, `None` where unknown.
    pub fn dims(&self) -> &[Option<usize>] {
        &self.0
    }

    /// The dimensions when every one is known (an empty model's parameter), else `None`.
    pub fn known(&self) -> Option<Vec<usize>> {
        self.0.iter().copied().collect()
    }

    /// Whether `dims` has this rank and agrees on every known dimension.
    pub fn accepts(&self, dims: &[usize]) -> bool {
        dims.len() == self.0.len()
            && self
                .0
                .iter()
                .zip(dims)
                .all(|(k, d)| k.is_none_or(|k| k == *d))
    }
}

impl fmt::Display for LazyShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, d) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            match d {
                Some(d) => write!(f, "{d}")?,
                None => f.write_str("?")?,
            }
        }
        f.write_str("]")
    }
}
