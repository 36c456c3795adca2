//! What the MiniLM benchmarks share: the batch they run and the peer they compare with. Included
//! by path (`#[path = "support/mod.rs"] mod support;`), so each bench uses what it needs.
#![allow(dead_code)]

#[cfg(feature = "peers")]
use std::path::Path;

use candle_core::{DType, Device, Tensor};
#[cfg(feature = "peers")]
use candle_nn::VarBuilder;
#[cfg(feature = "peers")]
use candle_transformers::models::bert;

/// What every benchmark sets first: two threads, as PyTorch's side (`torch.set_num_threads(2)`),
/// unless `RAYON_NUM_THREADS` says otherwise (set, the variable also spares candle's every matmul a
/// read of /proc/cpuinfo to count physical cores); and the number of rounds, the first numeric
/// argument (`default` without one). Call it before any other thread starts: it writes the
/// environment.
pub fn threads_and_rounds(default: usize) -> usize {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    // The host and the kernels it takes, with every figure (BENCHMARKS.md names both).
    eprintln!(
        "kernels: {}",
        module_runtime::backends::cpu::kernel_choice()
    );
    std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(default)
}

/// Sentences per batch (DESIGN.md §6).
pub const BATCH: usize = 32;
/// Tokens per sentence.
pub const SEQ: usize = 25;

/// The benchmark batch: `[BATCH, SEQ]` token ids spread over the vocabulary, and an all-ones mask.
pub fn inputs(device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    batch(BATCH, SEQ, device)
}

/// A `[batch, seq]` batch of token ids spread over the vocabulary, and an all-ones mask.
pub fn batch(batch: usize, seq: usize, device: &Device) -> candle_core::Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..batch * seq)
        .map(|i| 1000 + (i as u32 * 7919) % 29000)
        .collect();
    let ids = Tensor::from_vec(ids, (batch, seq), device)?;
    let mask = Tensor::ones((batch, seq), DType::U32, device)?;
    Ok((ids, mask))
}

/// candle-transformers' BERT from the checkpoint folder `dir`, as its examples load it: the
/// `config.json`, and a memory-mapped `VarBuilder` (feature `peers`).
#[cfg(feature = "peers")]
pub fn peer(dir: &Path, device: &Device) -> candle_core::Result<bert::BertModel> {
    let config: bert::Config = serde_json::from_str(
        &std::fs::read_to_string(dir.join("config.json")).map_err(candle_core::Error::wrap)?,
    )
    .map_err(candle_core::Error::wrap)?;
    // SAFETY: the checkpoint is not modified while mapped.
    let vb = unsafe {
        VarBuilder::from_mmaped_safetensors(&[dir.join("model.safetensors")], DType::F32, device)?
    };
    bert::BertModel::load(vb, &config)
}

/// The median of `t` (the upper one of an even count).
pub fn median(mut t: Vec<f64>) -> f64 {
    t.sort_by(f64::total_cmp);
    t[t.len() / 2]
}
