//! What can go wrong when weights are quantized or read from a GGUF file: [`QuantizeError`],
//! carried by [`Error::Quantize`](crate::Error::Quantize).

use candle_core::quantized::GgmlDType;
use candle_core::Shape;

use super::GgufErrorKind;

/// A quantization that cannot be done, or a GGUF file that cannot be read into a model.
///
/// Missing, unexpected or misshapen tensors of a GGUF load are reported like any other load's,
/// in [`Error::Load`](crate::Error::Load); this covers the rest.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum QuantizeError {
    /// `quantize(&model, pattern, kind)`: the pattern matched no `Linear` layer (almost always a
    /// typo, as with `freeze`).
    #[error("pattern `{pattern}` matches no Linear layer{}", list(.available))]
    NoLinear {
        /// The pattern as given.
        pattern: String,
        /// Up to a few of the model's `Linear` paths.
        available: Vec<String>,
    },

    /// A weight whose rows cannot be cut into the kind's blocks: quantized blocks run along the
    /// input dimension, so `in_features` must be a multiple of the block size (32 for `q8_0` and
    /// `q4_0`, 256 for the k-quants). `path` is the `Linear`'s path, or `"parameter"` when a
    /// [`Param`](crate::Param) is quantized on its own.
    #[error(
        "`{path}` of shape {shape:?} cannot be quantized to {kind:?}: it needs a matrix whose \
         rows ({}) are a multiple of the block size {block_size}",
        shape.dims().last().copied().unwrap_or(0)
    )]
    BlockSize {
        /// The layer (or `"parameter"`).
        path: String,
        /// The weight's shape.
        shape: Shape,
        /// The kind asked for.
        kind: GgmlDType,
        /// Its block size.
        block_size: usize,
    },

    /// `F32`, `F16` and `BF16` are float types, not quantizations: change a model's float type
    /// with `to_dtype`.
    #[error("{kind:?} is not a quantized type: use `to_dtype` for float types")]
    FloatKind {
        /// The kind asked for.
        kind: GgmlDType,
    },

    /// A row outside a quantized weight's rows (an id beyond an embedding's quantized table).
    #[error("row {row} is outside the quantized weight's {rows} rows")]
    Row {
        /// The row asked for.
        row: usize,
        /// The weight's rows.
        rows: usize,
    },

    /// A GGUF file lacks a metadata entry the model needs, or holds one it cannot use.
    #[error("GGUF `{}`: {reason}", file.display())]
    Gguf {
        /// The file.
        file: std::path::PathBuf,
        /// What is wrong (names the metadata key).
        reason: String,
    },

    /// A GGUF file the bounded reader refuses: truncated, malformed, sized beyond what the file
    /// holds, or laid out wrongly (duplicated names, misaligned, overlapping or unaccounted
    /// tensor data). Checked before any tensor is read.
    #[error("cannot read GGUF file `{}`{}: {kind}", file.display(), at_offset(*.offset))]
    GgufFile {
        /// The file.
        file: std::path::PathBuf,
        /// Where in the file the problem was found, in bytes from its start, when it is known.
        offset: Option<u64>,
        /// What is wrong (boxed, to keep [`Error`](crate::Error) small).
        kind: Box<GgufErrorKind>,
    },
}

fn at_offset(offset: Option<u64>) -> String {
    offset.map_or_else(String::new, |offset| format!(" (at byte {offset})"))
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        String::from(" (the model has none)")
    } else {
        format!("; Linear layers: {}", names.join(", "))
    }
}
