//! Sentence embeddings with a real Hugging Face checkpoint: all-MiniLM-L6-v2 loaded strictly, by
//! name, into the BERT encoder of `minilm::bert` (plain structs with `#[derive(Module)]`),
//! tokenized with the `tokenizers` crate, mean-pooled over the attention mask and L2-normalized,
//! as sentence-transformers does.
//!
//! ```text
//! printf 'A man is eating food.\nA man is riding a horse.\n' |
//!     cargo run --release -p minilm --example sentence_embeddings -- --model ../shared/models/all-MiniLM-L6-v2
//! ```
//!
//! Reads sentences from stdin, one per line, and prints to stdout one JSON array holding one array of
//! 384 floats per input line, in order. Nothing else goes to stdout (timings go to stderr).

use std::io::{BufRead, Write};
use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use candle_module::device_or_env;
use clap::Parser;
use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use minilm::sentences::{encode_batch, load_tokenizer, mean_pool_normalized};
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Embed sentences (one per line on stdin) with all-MiniLM-L6-v2; print a JSON array of embeddings.
#[derive(Parser)]
struct Args {
    /// The checkpoint folder (config.json, model.safetensors, tokenizer.json)
    /// [default: $MINILM_DIR, else ../shared/models/all-MiniLM-L6-v2]
    #[arg(long, value_name = "DIR")]
    model: Option<PathBuf>,
    /// Sentences per forward pass
    #[arg(long, value_name = "N", default_value = "32")]
    batch_size: NonZeroUsize,
    /// cpu, cuda:0, metal:0 [default: $MODULE_DEVICE, else cpu]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
}

fn main() -> AnyResult<()> {
    // Freed tensors' memory reused by the next ones (see `reuse_freed_memory`).
    module_runtime::reuse_freed_memory();
    let args = Args::parse();
    let model_dir = args
        .model
        .or_else(minilm_dir)
        .ok_or("no checkpoint found: pass --model DIR")?;
    let device = device_or_env(args.device.as_deref())?;

    let started = Instant::now();
    let config = BertConfig::from_json_file(&model_dir.join("config.json"))?;
    // Build only to load: no random init of weights the checkpoint is about to replace.
    let model = module_runtime::build_empty(|| BertModel::new(&config, &device))?;
    model.load_state_dict(model_dir.join("model.safetensors"), &LoadOptions::default())?;
    // Inference, as in PyTorch: `model.eval()` (dropout off) and `torch.no_grad()` (no parameter
    // records a gradient, so the fused kernels run).
    model.eval();
    let _no_grad = module_runtime::no_grad();
    let tokenizer = load_tokenizer(&model_dir)?;
    let loaded = started.elapsed();

    let lines: Vec<String> = std::io::stdin()
        .lock()
        .lines()
        .collect::<std::io::Result<_>>()?;
    let sentences: Vec<&str> = lines.iter().map(|l| l.trim_end_matches('\r')).collect();

    // Batch sentences of similar length together (less padding), then restore the input order.
    let mut order: Vec<usize> = (0..sentences.len()).collect();
    order.sort_by_key(|&i| sentences[i].len());
    let started = Instant::now();
    let mut embeddings = vec![Vec::new(); sentences.len()];
    for chunk in order.chunks(args.batch_size.get()) {
        let batch: Vec<&str> = chunk.iter().map(|&i| sentences[i]).collect();
        let (ids, mask) = encode_batch(&tokenizer, &batch, &device)?;
        let hidden = model.call((&ids, &mask))?;
        let batch_embeddings = mean_pool_normalized(&hidden, &mask)?.to_vec2::<f32>()?;
        for (&i, embedding) in chunk.iter().zip(batch_embeddings) {
            embeddings[i] = embedding;
        }
    }
    let elapsed = started.elapsed();

    let mut out = std::io::BufWriter::new(std::io::stdout().lock());
    serde_json::to_writer(&mut out, &embeddings)?;
    writeln!(out)?;
    out.flush()?;
    eprintln!(
        "loaded {} in {:.0} ms; embedded {} sentences in {:.0} ms ({:.0} sentences/s) on {:?}",
        model_dir.display(),
        loaded.as_secs_f64() * 1e3,
        sentences.len(),
        elapsed.as_secs_f64() * 1e3,
        sentences.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        device
    );
    Ok(())
}
