//! What the memory benchmarks share: the SmolLM-135M-shaped model the decode benchmark makes, and
//! running each case in a process of its own. Included by path (`#[path = "support/mod.rs"] mod
//! support;`), so each bench uses what it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;

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

/// Runs this benchmark again once per case, each in a fresh process with `var` set to the case
/// (so that each case's peak resident memory is its own), and fails on the first that fails.
pub fn run_cases<S: AsRef<str>>(var: &str, cases: &[S]) -> Result<(), Box<dyn std::error::Error>> {
    for case in cases {
        let case = case.as_ref();
        let status = Command::new(std::env::current_exe()?)
            .env(var, case)
            .status()?;
        if !status.success() {
            return Err(format!("the {case} case failed: {status}").into());
        }
    }
    Ok(())
}
