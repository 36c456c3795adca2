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
use std::path::PathBuf;
use std::time::Instant;

use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use minilm::sentences::{encode_batch, load_tokenizer, mean_pool_normalized};
use module_runtime::parse_device;
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

const USAGE: &str = "\
Embed sentences (one per line on stdin) with all-MiniLM-L6-v2; print a JSON array of embeddings.

Usage: sentence_embeddings [OPTIONS]

Options:
  --model DIR       the checkpoint folder (config.json, model.safetensors, tokenizer.json)
                    [default: $MINILM_DIR, else ../shared/models/all-MiniLM-L6-v2]
  --batch-size N    sentences per forward pass [default: 32]
  --device NAME     cpu, cuda:0, metal:0 [default: cpu]
  -h, --help        print this help";

struct Args {
    model: PathBuf,
    batch_size: usize,
    device: String,
}

fn parse_args() -> AnyResult<Args> {
    let mut model = None;
    let mut batch_size = 32;
    let mut device = "cpu".to_owned();
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let mut value = || args.next().ok_or_else(|| format!("{flag} needs a value"));
        match flag.as_str() {
            "--model" => model = Some(PathBuf::from(value()?)),
            "--batch-size" => {
                batch_size = value()?.parse()?;
                if batch_size == 0 {
                    return Err("--batch-size must be at least 1".into());
                }
            }
            "--device" => device = value()?,
            "-h" | "--help" => {
                println!("{USAGE}");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument `{other}`\n\n{USAGE}").into()),
        }
    }
    let model = match model.or_else(minilm_dir) {
        Some(dir) => dir,
        None => return Err(format!("no checkpoint found: pass --model DIR\n\n{USAGE}").into()),
    };
    Ok(Args {
        model,
        batch_size,
        device,
    })
}

fn main() -> AnyResult<()> {
    let args = parse_args()?;
    let device = parse_device(&args.device)?;

    let started = Instant::now();
    let config = BertConfig::from_json_file(&args.model.join("config.json"))?;
    let model = BertModel::new(&config, &device)?;
    model.load_safetensors(args.model.join("model.safetensors"))?;
    // Inference: dropout off, and no parameter tracks a gradient, so the fused kernels run.
    model.eval();
    model.freeze("**")?;
    let tokenizer = load_tokenizer(&args.model)?;
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
    for chunk in order.chunks(args.batch_size) {
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
        args.model.display(),
        loaded.as_secs_f64() * 1e3,
        sentences.len(),
        elapsed.as_secs_f64() * 1e3,
        sentences.len() as f64 / elapsed.as_secs_f64().max(1e-9),
        device
    );
    Ok(())
}
