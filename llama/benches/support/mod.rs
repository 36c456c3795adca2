//! What the memory benchmarks share: the SmolLM-135M-shaped model the decode benchmark makes.

use std::path::{Path, PathBuf};

/// `$LLAMA_BENCH_DIR`, else `smollm-135m-random` in the system's temp folder: where the decode
/// benchmark saves its model.
pub fn model_dir() -> PathBuf {
    std::env::var_os("LLAMA_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("smollm-135m-random"))
}

/// An error naming `dir` unless it holds the decode benchmark's checkpoint.
pub fn require_model(dir: &Path) -> Result<(), Box<dyn std::error::Error>> {
    if dir.join("model.safetensors").exists() {
        Ok(())
    } else {
        Err(format!(
            "no checkpoint in {}: run the decode benchmark first",
            dir.display()
        )
        .into())
    }
}
