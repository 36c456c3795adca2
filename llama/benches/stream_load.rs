//! Streaming loads of a model larger than memory allows twice (issue 47, item 5): a random
//! bfloat16 Llama of 3.2 B parameters shaped like Llama-3.2-3B (hidden 3072, 28 layers, MLP 8192,
//! 24 heads over 8 key/value heads, 128,256-token vocabulary, tied head), saved as Hugging Face
//! shards (`model-0000i-of-0000n.safetensors` of about 2 GB and `model.safetensors.index.json`,
//! written by `StateDict::save_sharded`),
//! loaded into a model built empty (`build_empty`), in bfloat16 and quantized on the way
//! (`quantize` on the empty model marks its `Linear` weights; the load quantizes each as it
//! arrives). Each case runs in a fresh process (this one, again) and prints the load's time, the
//! model's bytes (parameters as stored: quantized blocks, bfloat16 values) and the process's peak
//! resident memory (`VmHWM`, Linux) against them; the target is peak ≤ 1.1 × the model.
//!
//! The checkpoint is written once to `$STREAM_BENCH_DIR` (default `llama-3b-random-bf16` in the
//! system's temp folder: 6.4 GB of disk); cases to run are the arguments (default all:
//! `bf16 q8_0 q4_0 q4_k`).
//!
//! ```text
//! cargo bench -p llama --bench stream_load [-- q4_0 ...]
//! ```

use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_module::process_memory_mib;
use llama::{LlamaConfig, LlamaForCausalLM};
use module_runtime::nn::{parse_quant_kind, quantize};
use module_runtime::prelude::*;
use module_runtime::{build_empty, ModuleExt};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[path = "support/mod.rs"]
mod support;

/// The case a child process measures.
const CASE: &str = "STREAM_BENCH_CASE";

/// Bytes per shard, at most (transformers' `max_shard_size` is 5 GB; smaller shards here so that
/// the 6.4 GB model comes in several).
const SHARD_BYTES: usize = 2_000_000_000;

fn config_json() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 28,
        "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
        "vocab_size": 128256, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "tie_word_embeddings": true, "bos_token_id": 128000,
        "eos_token_id": 128001, "torch_dtype": "bfloat16",
    })
}

/// Writes the random checkpoint: every parameter of the empty model, in its order, drawn from
/// N(0, 0.02²) (norms: ones) and rounded to bfloat16, saved as shards of at most
/// [`SHARD_BYTES`] (`StateDict::save_sharded`).
fn make_checkpoint(dir: &Path) -> AnyResult<()> {
    let json = config_json();
    let config = LlamaConfig::from_json(&json)?;
    let empty = build_empty(|| LlamaForCausalLM::new(&config, &Device::Cpu))?;
    eprintln!(
        "writing a random 3.2B-parameter bfloat16 Llama to {}",
        dir.display()
    );
    let mut sd = StateDict::new();
    for (key, p) in empty.named_parameters() {
        let shape = p.lazy_shape().ok_or("an empty model's parameter")?;
        let dims = shape.known().ok_or("a known shape")?;
        let value = match dims.len() {
            1 => Tensor::ones(dims, DType::BF16, &Device::Cpu)?,
            _ => Tensor::randn(0f32, 0.02, dims, &Device::Cpu)?.to_dtype(DType::BF16)?,
        };
        sd.insert(key, value);
    }
    for file in sd.save_sharded(dir, SHARD_BYTES)? {
        eprintln!("  {}", file.display());
    }
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(&json)?,
    )?;
    Ok(())
}

/// The bytes the model's parameters take as stored.
fn model_bytes(model: &LlamaForCausalLM) -> AnyResult<usize> {
    let mut bytes = 0;
    for p in model.parameters() {
        bytes += match p.quantized()? {
            Some(q) => q.storage_size_in_bytes(),
            None => p.elem_count() * p.dtype().size_in_bytes(),
        };
    }
    Ok(bytes)
}

/// One case in this process: `bf16`, or a quantization's name.
fn measure(case: &str, dir: &Path) -> AnyResult<()> {
    let config = LlamaConfig::from_json_file(&dir.join("config.json"))?;
    let (_, before) = process_memory_mib();
    let start = Instant::now();
    let model = build_empty(|| LlamaForCausalLM::new(&config, &Device::Cpu))?;
    model.to_dtype(DType::BF16)?;
    if case != "bf16" {
        let _ = quantize(&model, "**", parse_quant_kind(case)?)?;
    }
    model.load_state_dict(dir, &LlamaForCausalLM::load_options(&config))?;
    let seconds = start.elapsed().as_secs_f64();
    let (_, peak) = process_memory_mib();
    let model_mib = model_bytes(&model)? as f64 / (1 << 20) as f64;
    // A prompt through the model: it computes with what was loaded (transformers, loading the
    // same folder in bfloat16, gives [1.3047, -0.6992, 2.2500] for this prompt).
    let prompt = Tensor::new(&[[128000u32, 791, 4062]], &Device::Cpu)?;
    let (logits, _) = model.prefill(&prompt, model.initial_state(1)?)?;
    let logits = logits.to_dtype(DType::F32)?.flatten_all()?;
    let finite = logits.sum_all()?.to_scalar::<f32>()?.is_finite();
    let first: Vec<f32> = logits.narrow(0, 0, 3)?.to_vec1()?;
    println!(
        "| {case:5} | {seconds:6.1} s | {model_mib:7.0} MiB | {peak:7.0} MiB ({before:.0} before) | \
         **{:.3}×** | {} |",
        peak / model_mib,
        if finite { "finite logits" } else { "NON-FINITE logits" }
    );
    println!("  (the last position's first logits: {first:?})");
    Ok(())
}

fn main() -> AnyResult<()> {
    let dir = std::env::var_os("STREAM_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("llama-3b-random-bf16"));
    if let Ok(case) = std::env::var(CASE) {
        return measure(&case, &dir);
    }
    if !dir.join("model.safetensors.index.json").exists() {
        make_checkpoint(&dir)?;
    }
    let mut cases: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    if cases.is_empty() {
        cases = ["bf16", "q8_0", "q4_0", "q4_k"].map(String::from).to_vec();
    }
    println!("| case | load | model | peak resident (process) | peak / model | check |");
    println!("|---|---|---|---|---|---|");
    support::run_cases(CASE, &cases)?;
    Ok(())
}
