//! all-MiniLM-L6-v2 on `module-runtime`: a model written with `#[derive(Module)]` that loads a
//! real Hugging Face checkpoint, for this workspace's examples, tests and benchmarks (not part of
//! the library).
//!
//! - [`bert`]: Hugging Face's `BertModel` as derived structs, with checkpoint names;
//! - [`sentences`]: the tokenizer and pooling that turn it into a sentence-embedding model, as
//!   sentence-transformers runs it;
//! - [`minilm_dir`]: where the checkpoint is.

use std::path::{Path, PathBuf};

pub mod bert;
pub mod sentences;

/// Where the all-MiniLM-L6-v2 checkpoint is: `$MINILM_DIR`, else `../shared/models/all-MiniLM-L6-v2`
/// beside the workspace, if it holds a `model.safetensors`.
pub fn minilm_dir() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("MINILM_DIR").map(PathBuf::from),
        // This package is one level below the workspace root.
        Some(Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/models/all-MiniLM-L6-v2")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|dir| dir.join("model.safetensors").is_file())
}
