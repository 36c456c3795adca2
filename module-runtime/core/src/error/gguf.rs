//! What is wrong with a GGUF file's layout: [`GgufErrorKind`], the `kind` of
//! [`QuantizeError::GgufFile`](super::QuantizeError::GgufFile).

use candle_core::quantized::GgmlDType;

/// What the bounded GGUF reader refuses in a file: the `kind` of
/// [`QuantizeError::GgufFile`](super::QuantizeError::GgufFile). Every check is made on the
/// header, before any tensor's data is read or any model is built.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum GgufErrorKind {
    /// The file ends inside the structure it declares.
    #[error("the file ends inside {what}: it is truncated or corrupt")]
    Truncated {
        /// What was being read (`the metadata value of \`general.name\``).
        what: String,
    },

    /// A count or length larger than the rest of the file can hold (a key or string length, an
    /// array's, the tensor or metadata count), or metadata that would take more memory than the
    /// reader allows for a file of this size.
    #[error("{what} is {declared}, more than the {limit} this file can hold")]
    TooLarge {
        /// What declares it (`the length of key 3`, `array \`tokenizer.ggml.tokens\``).
        what: String,
        /// The declared count, length or size.
        declared: u64,
        /// The most the file allows.
        limit: u64,
    },

    /// `general.alignment` is zero, not a power of two, or not an integer.
    #[error("general.alignment is {found}; it must be a power of two")]
    Alignment {
        /// The value found, in words.
        found: String,
    },

    /// Two metadata entries have one key: which one is meant is ambiguous.
    #[error("metadata key `{key}` appears twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },

    /// Two tensors have one name: which one is meant is ambiguous.
    #[error("tensor `{name}` appears twice")]
    DuplicateTensor {
        /// The name.
        name: String,
    },

    /// A tensor's shape has no size in its type: no dimensions, more than GGML's four, an
    /// element count that overflows, or rows that are not a whole number of the type's blocks.
    #[error("tensor `{name}`: {kind:?} of shape {shape:?} (GGUF order) {reason}")]
    TensorShape {
        /// The tensor.
        name: String,
        /// Its declared type.
        kind: GgmlDType,
        /// Its declared dimensions, innermost first (as the file lists them).
        shape: Vec<u64>,
        /// What is wrong, in words.
        reason: String,
    },

    /// A tensor's data does not start on the file's alignment.
    #[error("tensor `{name}` starts at data offset {offset}, not a multiple of the alignment {alignment}")]
    Misaligned {
        /// The tensor.
        name: String,
        /// Its offset in the data section.
        offset: u64,
        /// The file's alignment.
        alignment: u64,
    },

    /// A tensor's data starts inside the previous tensor's.
    #[error("tensor `{name}` at data offset {offset} overlaps `{previous}`, which ends at {previous_end}")]
    Overlap {
        /// The tensor.
        name: String,
        /// Its offset in the data section.
        offset: u64,
        /// The tensor before it in the file.
        previous: String,
        /// Where that one's data ends.
        previous_end: u64,
    },

    /// Bytes between two tensors, or after the last one, that no tensor accounts for: the tensor
    /// before them is larger on disk than its type and shape say (a quantized tensor relabelled
    /// as another type, a wrong shape), or the offsets are wrong.
    #[error(
        "{unaccounted} bytes after tensor `{previous}` (which ends at data offset {previous_end}) \
         belong to no tensor: its type or shape does not match its data"
    )]
    Unaccounted {
        /// The tensor before the gap.
        previous: String,
        /// Where its data ends, by its type and shape.
        previous_end: u64,
        /// The bytes nobody accounts for (beyond the alignment's padding).
        unaccounted: u64,
    },

    /// A tensor's data reaches past the end of the file: it is truncated, or the tensor is
    /// smaller on disk than its type and shape say.
    #[error("tensor `{name}` needs {bytes} bytes at data offset {offset}, past the end of the file ({available} bytes of data)")]
    PastEnd {
        /// The tensor.
        name: String,
        /// Its offset in the data section.
        offset: u64,
        /// Its size by type and shape.
        bytes: u64,
        /// The bytes of data the file holds.
        available: u64,
    },

    /// Anything else that makes the file unreadable as GGUF (magic, version, a value or tensor
    /// type the reader does not know, a boolean that is neither 0 nor 1).
    #[error("{reason}")]
    Malformed {
        /// What is wrong, in words.
        reason: String,
    },
}
