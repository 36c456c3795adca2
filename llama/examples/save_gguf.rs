//! A Hugging Face Llama folder written as llama.cpp's GGUF file, vocabulary included
//! (`llama::save_gguf`), as llama.cpp's `convert_hf_to_gguf.py --outtype …` writes one:
//!
//! ```text
//! cargo run --release -p llama --example save_gguf -- --model DIR --out model-q8_0.gguf --kind q8_0
//! ```
//!
//! `--kind` is `f32`, `f16` or a quantized kind (`q8_0`, `q4_0`, `q4_k`, …): matrices whose rows
//! the kind's blocks do not divide, and the norms, stay float32. The vocabulary comes from the
//! folder's `tokenizer.json` (without one, llama.cpp's `none` placeholder).

use std::path::PathBuf;

use clap::Parser;
use module_runtime::candle_core::quantized::GgmlDType;
use module_runtime::nn::parse_quant_kind;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Write a Hugging Face Llama folder as llama.cpp's GGUF.
#[derive(Parser)]
struct Args {
    /// The checkpoint folder (config.json, model.safetensors, tokenizer.json)
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// The GGUF file to write
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// The matrices' type: f32, f16, q8_0, q4_0, q4_k, …
    #[arg(long, value_name = "KIND", default_value = "q8_0")]
    kind: String,
}

fn main() -> AnyResult<()> {
    let args = Args::parse();
    let kind = match args.kind.to_ascii_lowercase().as_str() {
        "f32" => GgmlDType::F32,
        "f16" => GgmlDType::F16,
        other => parse_quant_kind(other)?,
    };
    llama::save_gguf(&args.model, &args.out, kind)?;
    println!("wrote {} ({kind:?})", args.out.display());
    Ok(())
}
