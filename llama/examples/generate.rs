//! Text generation with a Llama-family Hugging Face checkpoint: loaded strictly, by name, into
//! `llama::LlamaForCausalLM`, prefilled in one pass and decoded with the KV cache.
//!
//! ```text
//! echo '[242, 175, 307, 294, 301, 380, 230]' |
//!     cargo run --release -p llama --example generate -- --model llama/tests/fixtures/tiny-llama --max-new-tokens 40
//! ```
//!
//! Reads prompts from stdin, one JSON array of token ids per line, and prints per prompt one JSON
//! line: the array of generated ids (without the prompt; the end-of-sequence token included when
//! one stopped it). Greedy without `--temperature`, `--top-k` or `--top-p`; seeded sampling with
//! them. With `--text` (the folder needs a `tokenizer.json`) each stdin line is text, encoded with
//! the tokenizer's special tokens, and each output line is the generated text as a JSON string.
//! Nothing else goes to stdout.
//!
//! Quantized weights: `--quantize q8_0` (or `q4_0`, `q4_k`, …) quantizes the model's `Linear`
//! layers after loading; `--model` may also be a llama.cpp `.gguf` file (quantized or not; its
//! embedded tokenizer is not read: `--text` takes the `tokenizer.json` in the file's folder):
//!
//! ```text
//! echo '[242, 175, 307]' | cargo run --release -p llama --example generate -- \
//!     --model llama/tests/fixtures/tiny-llama-q8_0.gguf --max-new-tokens 40
//! ```
//!
//! A PEFT LoRA/DoRA adapter: `--adapter PEFT_DIR` (the folder `save_pretrained` writes:
//! `adapter_config.json`, `adapter_model.safetensors`) is loaded onto the model strictly, after
//! `--quantize` if given (the adapter stays in float over the quantized base), as
//! `PeftModel.from_pretrained(model, PEFT_DIR)` does; greedy output is transformers + peft's:
//!
//! ```text
//! echo '[242, 175, 307, 294, 301, 380, 230]' | cargo run --release -p llama --example generate -- \
//!     --model llama/tests/fixtures/tiny-llama --adapter llama/tests/fixtures/tiny-llama-lora \
//!     --max-new-tokens 40
//! ```

use std::io::{BufRead, Write};
use std::path::PathBuf;

use candle_module::device_or_env;
use clap::Parser;
use llama::json_lines::generate_json_lines;
use llama::{generate, GenerationConfig, LlamaForCausalLM};
use module_runtime::nn::peft::{PeftExt, DEFAULT_ADAPTER};
use module_runtime::nn::{parse_quant_kind, quantize};

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Generate after each prompt on stdin (JSON arrays of token ids, or text with --text).
#[derive(Parser)]
struct Args {
    /// The checkpoint folder (config.json, model.safetensors or its index; tokenizer.json for --text), or a .gguf file
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// A PEFT adapter folder (adapter_config.json, adapter_model.safetensors) to apply
    #[arg(long, value_name = "PEFT_DIR")]
    adapter: Option<PathBuf>,
    /// Quantize the Linear layers' weights after loading: q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, …
    #[arg(long, value_name = "KIND")]
    quantize: Option<String>,
    /// The most tokens to generate per prompt
    #[arg(long, value_name = "N")]
    max_new_tokens: usize,
    /// Sampling temperature (0: greedy)
    #[arg(long, value_name = "T")]
    temperature: Option<f64>,
    /// Sample from the K most likely tokens
    #[arg(long, value_name = "K")]
    top_k: Option<usize>,
    /// Sample from the most likely tokens whose probabilities sum over P
    #[arg(long, value_name = "P")]
    top_p: Option<f64>,
    /// transformers' repetition_penalty (1: none)
    #[arg(long, value_name = "R", default_value = "1.0")]
    repetition_penalty: f64,
    /// The sampling seed
    #[arg(long, value_name = "S", default_value = "0")]
    seed: u64,
    /// Stdin lines are text and outputs are text (needs DIR/tokenizer.json, or one beside the .gguf file)
    #[arg(long)]
    text: bool,
    /// cpu, cuda:0, metal:0 [default: $MODULE_DEVICE, else cpu]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
}

fn main() -> AnyResult<()> {
    // Freed tensors' memory reused by the next ones (see `reuse_freed_memory`).
    module_runtime::reuse_freed_memory();
    let args = Args::parse();
    let device = device_or_env(args.device.as_deref())?;
    let mut model = if args.model.extension().is_some_and(|e| e == "gguf") {
        LlamaForCausalLM::from_gguf(&args.model, &device)?
    } else {
        LlamaForCausalLM::from_pretrained(&args.model, &device)?
    };
    if let Some(kind) = &args.quantize {
        let report = quantize(&model, "**", parse_quant_kind(kind)?)?;
        eprintln!(
            "{kind}: {} Linear layers quantized, {} kept in float (rows not a multiple of the block)",
            report.quantized.len(),
            report.kept_float.len()
        );
    }
    // After quantizing: the adapter's own small layers stay in float.
    if let Some(dir) = &args.adapter {
        let layers = model.load_adapter(dir, DEFAULT_ADAPTER, false)?;
        eprintln!("adapter {}: {} layers", dir.display(), layers.len());
    }
    let config = GenerationConfig {
        max_new_tokens: args.max_new_tokens,
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repetition_penalty,
        stop_tokens: model.config.eos_token_ids.clone(),
        seed: args.seed,
    };
    let stdin = std::io::stdin().lock();
    let stdout = std::io::stdout().lock();
    if !args.text {
        return Ok(generate_json_lines(&model, &config, stdin, stdout)?);
    }
    // A checkpoint folder holds its tokenizer; a `.gguf` file is read with the one beside it.
    let folder = match args.model.is_file() {
        true => args.model.parent().unwrap_or(std::path::Path::new(".")),
        false => &args.model,
    };
    let path = folder.join("tokenizer.json");
    if !path.is_file() {
        return Err(format!("--text needs {}", path.display()).into());
    }
    let tokenizer = tokenizers::Tokenizer::from_file(&path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    generate_text(&model, &config, &tokenizer, stdin, stdout)
}

/// `--text`: each line encoded, generated after, and the new tokens decoded.
fn generate_text(
    model: &LlamaForCausalLM,
    config: &GenerationConfig,
    tokenizer: &tokenizers::Tokenizer,
    input: impl BufRead,
    mut output: impl Write,
) -> AnyResult<()> {
    for line in input.lines() {
        let line = line?;
        if line.is_empty() {
            continue;
        }
        let encoding = tokenizer
            .encode(line.as_str(), true)
            .map_err(|e| format!("cannot encode {line:?}: {e}"))?;
        let generated = generate(model, &[encoding.get_ids().to_vec()], config)?;
        let text = tokenizer
            .decode(&generated[0], true)
            .map_err(|e| format!("cannot decode: {e}"))?;
        writeln!(output, "{}", serde_json::to_string(&text)?)?;
        output.flush()?;
    }
    Ok(())
}
