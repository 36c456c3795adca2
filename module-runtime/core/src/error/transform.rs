//! What can go wrong in a load's transforms (a checkpoint tensor split, concatenated or
//! transposed on its way into a model): [`TransformError`], carried by
//! [`Error::Transform`](crate::Error::Transform).

use candle_core::{DType, Shape};

/// A load transform (`LoadOptions::split`, `split_with_sizes`, `cat`, `transpose`) that cannot be
/// applied to the checkpoint. Each variant names the rule as it was written, the checkpoint keys
/// and their shapes; the load fails before anything is copied, so the model is unchanged.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum TransformError {
    /// A split whose pieces do not add up to the tensor's size along the dimension (an equal split
    /// of a size that the number of pieces does not divide, or sizes whose sum is another number).
    #[error(
        "{rule}: `{key}` has shape {shape:?}, whose size {} along dim {dim} does not {}",
        shape.dims().get(*dim).copied().unwrap_or(0),
        split_what(.sizes, *.pieces)
    )]
    SplitSizes {
        /// The rule, as code.
        rule: String,
        /// The checkpoint key it matched.
        key: String,
        /// The key's shape.
        shape: Shape,
        /// The dimension split along.
        dim: usize,
        /// The sizes asked for (empty for an equal split).
        sizes: Vec<usize>,
        /// How many pieces.
        pieces: usize,
    },

    /// A concatenation whose parts disagree outside the concatenated dimension, in rank or in
    /// dtype.
    #[error(
        "{rule}: the parts cannot be concatenated along dim {dim}: {}",
        parts(.keys, .shapes, .dtypes)
    )]
    CatShapes {
        /// The rule, as code.
        rule: String,
        /// The checkpoint keys, in order.
        keys: Vec<String>,
        /// Their shapes.
        shapes: Vec<Shape>,
        /// Their dtypes.
        dtypes: Vec<DType>,
        /// The dimension concatenated along.
        dim: usize,
    },

    /// A concatenation found its first part but not another one.
    #[error("{rule}: `{found}` is in the checkpoint but `{missing}` is not")]
    MissingPart {
        /// The rule, as code.
        rule: String,
        /// The part that is there.
        found: String,
        /// The part that is not.
        missing: String,
    },

    /// A split's dimension is beyond the tensor's rank.
    #[error("{rule}: `{key}` has shape {shape:?}, which has no dim {dim}")]
    Rank {
        /// The rule, as code.
        rule: String,
        /// The checkpoint key.
        key: String,
        /// Its shape.
        shape: Shape,
        /// The dimension asked for.
        dim: usize,
    },

    /// A transpose of a tensor with more than two dimensions: it swaps the dims of a matrix, as
    /// `Tensor.t()` does (a vector is left as it is).
    #[error("{rule}: `{key}` has shape {shape:?}; transpose takes a matrix, as Tensor.t() does")]
    NotMatrix {
        /// The rule, as code.
        rule: String,
        /// The checkpoint key.
        key: String,
        /// Its shape.
        shape: Shape,
    },

    /// In a strict load, a rule that matched no checkpoint key (a typo, or another model's names).
    #[error("{rule} matches no key of the checkpoint{}", like(.near))]
    NoMatch {
        /// The rule, as code.
        rule: String,
        /// Checkpoint keys that look alike.
        near: Vec<String>,
    },

    /// A rule produced a key the model does not have.
    #[error("{rule} produced `{key}`, which the model does not have{}", like(.near))]
    UnknownTarget {
        /// The rule, as code.
        rule: String,
        /// The produced key.
        key: String,
        /// Model paths that look alike.
        near: Vec<String>,
    },

    /// A rule that is malformed whatever the checkpoint: as many target patterns as sizes, the
    /// same `*` segments on both sides.
    #[error("{rule}: {message}")]
    InvalidRule {
        /// The rule, as code.
        rule: String,
        /// What is wrong with it.
        message: String,
    },

    /// A load pre-hook asked for a key the state dict being loaded does not have.
    #[error("load_state_dict pre-hook on `{path}`: the state dict has no key `{key}`")]
    NoKey {
        /// The path of the module the hook is registered on.
        path: String,
        /// The key it asked for.
        key: String,
    },
}

impl From<TransformError> for super::Error {
    /// Boxed: the variants carry keys and shapes, and [`Error`](super::Error) stays small.
    fn from(e: TransformError) -> Self {
        super::Error::Transform(Box::new(e))
    }
}

fn split_what(sizes: &[usize], pieces: usize) -> String {
    if sizes.is_empty() {
        format!("divide into {pieces} equal pieces")
    } else {
        format!(
            "equal the sizes {sizes:?} (sum {})",
            sizes.iter().sum::<usize>()
        )
    }
}

fn parts(keys: &[String], shapes: &[Shape], dtypes: &[DType]) -> String {
    let parts: Vec<String> = (keys.iter().zip(shapes).zip(dtypes))
        .map(|((k, s), d)| format!("`{k}` {d:?} {s:?}"))
        .collect();
    parts.join(", ")
}

fn like(near: &[String]) -> String {
    match near {
        [] => String::new(),
        near => format!("; there is: {}", near.join(", ")),
    }
}
