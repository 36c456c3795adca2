//! A state dict as a flat vector of tensors and a description to rebuild it (JAX's
//! `tree_flatten`/`tree_unflatten`).

use candle_core::{DType, Shape, Tensor};

use crate::error::{Error, Result};
use crate::report::{LoadReport, Mismatch};
use crate::state::StateDict;

/// One entry of a [`FlatSpec`]: a state-dict path, with the shape and dtype of its tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// The state-dict path.
    pub path: String,
    /// The tensor's shape.
    pub shape: Shape,
    /// The tensor's dtype.
    pub dtype: DType,
}

/// What [`flatten`](crate::FunctionalExt::flatten) returns beside the tensors: their paths,
/// shapes and dtypes in order, to build the state dict back with [`unflatten`](Self::unflatten).
///
/// ```
/// use module_runtime::prelude::*;
///
/// let model = Linear::new(3, 2, &Device::Cpu)?;
/// let (tensors, spec) = model.flatten()?;
/// let rebuilt = spec.unflatten(tensors)?; // the round trip is exact
/// let sd = model.state_dict()?;
/// assert_eq!(rebuilt.keys().collect::<Vec<_>>(), sd.keys().collect::<Vec<_>>());
/// # Ok::<(), module_runtime::Error>(())
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FlatSpec {
    entries: Vec<TensorSpec>,
}

impl FlatSpec {
    /// Splits any state dict into its tensors, in order, and their spec.
    pub fn split(state: &StateDict) -> (Vec<Tensor>, FlatSpec) {
        let (tensors, entries) = state
            .iter()
            .map(|(path, t)| {
                let spec = TensorSpec {
                    path: path.to_owned(),
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                };
                (t.clone(), spec)
            })
            .unzip();
        (tensors, FlatSpec { entries })
    }

    /// The entries, in order.
    pub fn entries(&self) -> &[TensorSpec] {
        &self.entries
    }

    /// The paths, in order.
    pub fn paths(&self) -> impl Iterator<Item = &str> {
        self.entries.iter().map(|e| e.path.as_str())
    }

    /// How many tensors the spec describes.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the spec describes no tensor.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Builds the state dict back from `tensors`, one per entry, in order: each must have its
    /// entry's shape and dtype. Fails with [`Error::FlatLength`] for another number of tensors,
    /// and with [`Error::Load`] listing every tensor of another shape or dtype.
    pub fn unflatten(&self, tensors: Vec<Tensor>) -> Result<StateDict> {
        if tensors.len() != self.entries.len() {
            return Err(Error::FlatLength {
                expected: self.entries.len(),
                got: tensors.len(),
            });
        }
        let mut report = LoadReport::default();
        for (spec, t) in self.entries.iter().zip(&tensors) {
            if *t.shape() != spec.shape || t.dtype() != spec.dtype {
                report.mismatched.push(Mismatch {
                    key: spec.path.clone(),
                    expected_shape: spec.shape.clone(),
                    expected_dtype: spec.dtype,
                    shape: t.shape().clone(),
                    dtype: t.dtype(),
                    unbuilt: None,
                });
            }
        }
        if !report.mismatched.is_empty() {
            return Err(Error::Load(Box::new(report)));
        }
        Ok(self
            .entries
            .iter()
            .map(|e| e.path.clone())
            .zip(tensors)
            .collect())
    }
}
