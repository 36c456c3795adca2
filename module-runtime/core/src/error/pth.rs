//! What is wrong with a PyTorch checkpoint: [`PthErrorKind`], the `kind` of
//! [`Error::Pth`](super::Error::Pth).

fn list_or_none(names: &[String]) -> String {
    if names.is_empty() {
        String::from("none")
    } else {
        names.join(", ")
    }
}

/// What is wrong with a PyTorch checkpoint: the `kind` of [`Error::Pth`](super::Error::Pth).
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PthErrorKind {
    /// The data ends before the structure it declares (a truncated file or member).
    #[error("the data ends early: the file is truncated or corrupt")]
    Truncated,

    /// A pickle opcode the reader does not know or does not accept.
    #[error("unknown or unsupported pickle opcode 0x{opcode:02x}")]
    UnknownOpcode {
        /// The opcode byte.
        opcode: u8,
    },

    /// The pickle names a Python global outside the allow-list (PyTorch's tensor rebuild
    /// functions and storage types, `collections.OrderedDict`, `_codecs.encode`, `torch.Size`).
    #[error(
        "the pickle names the Python global `{module}.{name}`, which is not allowed in a state \
         dict (only PyTorch's tensor and storage types and `collections.OrderedDict` are; \
         nothing in the file is executed)"
    )]
    ForbiddenGlobal {
        /// The global's module (`os`).
        module: String,
        /// The global's name (`system`).
        name: String,
    },

    /// The pickle nests deeper (values or marks on its stack) than the reader's limit.
    #[error("the pickle nests deeper than the limit of {limit}")]
    TooDeep {
        /// The limit that was reached.
        limit: usize,
    },

    /// The pickle uses a memo index beyond the reader's limit.
    #[error("the pickle uses memo index {index}, beyond the limit of {limit}")]
    MemoTooLarge {
        /// The index asked for.
        index: u64,
        /// The largest index accepted.
        limit: u64,
    },

    /// A tensor's shape, strides and storage offset reach past the end of its storage, or
    /// overflow.
    #[error(
        "tensor `{key}` of shape {shape:?} with stride {stride:?} at storage offset {offset} \
         does not fit in its storage of {storage_bytes} bytes"
    )]
    StorageOutOfBounds {
        /// The tensor's key (`""` when it is not in the state dict being read).
        key: String,
        /// The declared shape.
        shape: Vec<i64>,
        /// The declared strides, in elements.
        stride: Vec<i64>,
        /// The declared storage offset, in elements.
        offset: i64,
        /// The storage's length in bytes.
        storage_bytes: u64,
    },

    /// A zip member the reader needs is compressed; PyTorch stores every member uncompressed.
    #[error("zip member `{member}` is compressed ({method}); PyTorch writes members uncompressed")]
    Compressed {
        /// The member's name.
        member: String,
        /// The compression method.
        method: String,
    },

    /// The zip archive names a member twice, so which one is meant is ambiguous.
    #[error("the zip archive holds two members of one name (or two `data.pkl`)")]
    DuplicateMember,

    /// The state dict names a tensor twice. `torch.save` never writes that (a Python dict
    /// pickles each key once), and unpickling would silently keep the last.
    #[error("the state dict names `{key}` twice")]
    DuplicateKey {
        /// The key.
        key: String,
    },

    /// A member the checkpoint refers to is not in the zip archive (or a storage is missing from
    /// a legacy file).
    #[error("the checkpoint has no `{member}`")]
    MissingMember {
        /// The member or storage key.
        member: String,
    },

    /// The storages are not little-endian.
    #[error("the storages are {found}-endian; only little-endian checkpoints can be read")]
    ByteOrder {
        /// What the file declares.
        found: String,
    },

    /// A tensor's storage type has no candle dtype.
    #[error("tensor `{key}` has storage type `{storage_type}`, which candle cannot represent")]
    UnsupportedDType {
        /// The tensor's key.
        key: String,
        /// The storage type (`torch.ComplexFloatStorage`).
        storage_type: String,
    },

    /// No state dict was selected and the top level is not one (or the key selects something
    /// that is not one); `candidates` are the keys there that hold a state dict, and dotted
    /// `key.inner` ones a level further down (pass one as the key).
    #[error(
        "found {found} where a state dict was expected; keys holding a state dict: {}",
        list_or_none(.candidates)
    )]
    NotAStateDict {
        /// The top-level keys whose values are state dicts (`model`).
        candidates: Vec<String>,
        /// What the top level is, in words.
        found: String,
    },

    /// The key asked for names nothing, or something that is not a state dict.
    #[error("no state dict at key `{key}`; the keys there are: {}", list_or_none(.available))]
    NoSuchKey {
        /// The key asked for.
        key: String,
        /// The keys of the dict where the search stopped.
        available: Vec<String>,
    },

    /// A state dict entry is not a tensor (PyTorch's `load_state_dict` would fail on it too).
    #[error("state dict entry `{key}` is {found}, not a tensor")]
    NotATensor {
        /// The entry's key.
        key: String,
        /// What it is, in words.
        found: String,
    },

    /// A value asked of a checkpoint's Python values (`PthValues`) is not there, or not of the
    /// type asked for; `key` is the dotted path from the top level (`extra.tags.1`).
    #[error("`{key}`: {reason}")]
    Value {
        /// The path asked for, or the part of it that was reached.
        key: String,
        /// What is there instead, in words.
        reason: String,
    },

    /// Anything else that makes the file unreadable as a checkpoint.
    #[error("{reason}")]
    Malformed {
        /// What is wrong, in words.
        reason: String,
    },
}
