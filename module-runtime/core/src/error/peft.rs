//! What can go wrong with PEFT adapters (LoRA, DoRA): [`PeftError`], carried by
//! [`Error::Peft`](crate::Error::Peft).

/// An adapter configuration, adapter file or adapter operation that cannot be used.
///
/// Each variant names what is wrong: the configuration field, the module path, the file key, or
/// the shapes involved. A failed `get_peft_model` or adapter load leaves the model as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum PeftError {
    /// `adapter_config.json` holds a field this runtime does not know: it is refused rather than
    /// ignored, as an adapter trained with it may not compute what it computed in `peft`.
    #[error("adapter config field `{field}` is unknown to this runtime{}", in_file(.file))]
    UnknownField {
        /// The field's name.
        field: String,
        /// The file it came from, if any.
        file: Option<std::path::PathBuf>,
    },

    /// A configuration field this runtime knows, with a value it does not implement (a LoRA
    /// variant, an initialization, `fan_in_fan_out`, …).
    #[error("adapter config `{field}` = {value} is not supported{}", because(.reason))]
    Unsupported {
        /// The field's name.
        field: String,
        /// Its value, as JSON.
        value: String,
        /// Why, or what is supported instead.
        reason: String,
    },

    /// A configuration value that is malformed (a rank of 0, a regex that does not compile, a
    /// field of the wrong JSON type).
    #[error("adapter config `{field}`: {message}")]
    InvalidConfig {
        /// The field's name.
        field: String,
        /// What is wrong with it.
        message: String,
    },

    /// The targets match no module of the model (almost always a typo or another model's names).
    #[error("target_modules {targets} match no module of this model{}", near(.available))]
    NoTarget {
        /// The targets as configured.
        targets: String,
        /// Some of the model's `Linear` paths.
        available: Vec<String>,
    },

    /// A targeted module is of a type that takes no adapter here.
    #[error("`{path}` is a `{found}`: LoRA adapters wrap `Linear`, `Embedding` and `Conv1d/2d/3d` layers")]
    UnsupportedLayer {
        /// The module's path.
        path: String,
        /// Its class.
        found: String,
    },

    /// A `modules_to_save` entry names a module of a type that cannot hold a trainable copy.
    #[error(
        "`{path}` is a `{found}`: modules_to_save copies `Linear`, `Embedding`, \
         `Conv1d/2d/3d` and `LayerNorm` layers"
    )]
    UnsupportedModuleToSave {
        /// The module's path.
        path: String,
        /// Its class.
        found: String,
    },

    /// An adapter of this name is already on the layer.
    #[error("`{path}` already has an adapter named `{adapter}`")]
    AdapterExists {
        /// The layer's path.
        path: String,
        /// The adapter's name.
        adapter: String,
    },

    /// No adapter of this name on the model (`set_adapter`, `delete_adapter`).
    #[error("the model has no adapter named `{adapter}`{}", near(.available))]
    NoAdapter {
        /// The name asked for.
        adapter: String,
        /// The adapters the model has.
        available: Vec<String>,
    },

    /// An adapter file's tensor does not fit the layer it belongs to: the adapter was made for
    /// another model (or another rank).
    #[error("adapter tensor `{key}` has shape {found:?}, but `{path}` needs {expected:?}")]
    Shape {
        /// The key in the adapter file.
        key: String,
        /// The layer's path.
        path: String,
        /// The shape the layer needs.
        expected: Vec<usize>,
        /// The shape in the file.
        found: Vec<usize>,
    },

    /// Keys of the adapter file that no wrapped layer takes, or that a wrapped layer needs and the
    /// file lacks.
    #[error("adapter file does not fit the model: {}", key_lists(.missing, .unexpected))]
    Keys {
        /// Keys the configuration's layers need that the file lacks.
        missing: Vec<String>,
        /// Keys in the file that belong to no wrapped layer.
        unexpected: Vec<String>,
    },

    /// An operation the adapter's state does not allow (merging into a quantized weight,
    /// unloading while merged, …).
    #[error("`{path}`: {message}")]
    State {
        /// The layer's path.
        path: String,
        /// What is not possible, and why.
        message: String,
    },
}

fn in_file(file: &Option<std::path::PathBuf>) -> String {
    match file {
        Some(f) => format!(" (in `{}`)", f.display()),
        None => String::new(),
    }
}

fn because(reason: &str) -> String {
    if reason.is_empty() {
        String::new()
    } else {
        format!(": {reason}")
    }
}

fn near(names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!("; the model has: {}", names.join(", "))
    }
}

/// `missing a, b; unexpected c and 3 more`: up to six keys of each list.
fn key_lists(missing: &[String], unexpected: &[String]) -> String {
    let list = |what: &str, keys: &[String]| {
        let shown: Vec<&str> = keys.iter().take(6).map(String::as_str).collect();
        let more = match keys.len().saturating_sub(shown.len()) {
            0 => String::new(),
            n => format!(" and {n} more"),
        };
        format!("{what} {}{more}", shown.join(", "))
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(list("missing", missing));
    }
    if !unexpected.is_empty() {
        parts.push(list("unexpected", unexpected));
    }
    parts.join("; ")
}
