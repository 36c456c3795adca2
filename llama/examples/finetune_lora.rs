//! LoRA fine-tuning of a Llama-family Hugging Face checkpoint (QLoRA with `--quantize`), saving a
//! PEFT adapter folder that `generate --adapter` and Python's `peft` load.
//!
//! ```text
//! cargo run --release -p llama --example finetune_lora -- --model llama/tests/fixtures/tiny-llama \
//!     --data train.jsonl --rank 8 --steps 20 --out my-adapter [--quantize q8_0]
//! ```
//!
//! `--data` is JSON lines of token ids, one training sequence per line (`[1, 306, 4966, 29889]`;
//! blank lines skipped). The model loads strictly by name
//! (`LlamaForCausalLM::from_pretrained`); with `--quantize KIND` (`q8_0`, `q4_0`, `q4_k`, …) its
//! `Linear` layers are quantized as the load reads them
//! (`LlamaForCausalLM::from_pretrained_quantized`: the float32 base is never in memory; QLoRA:
//! the adapters stay in float over the quantized base, which stays quantized). LoRA of rank R
//! (`lora_alpha` = 2R, `--lora-alpha` to change) goes on every
//! projection of attention and MLP (`q_proj`, `k_proj`, `v_proj`, `o_proj`, `gate_proj`,
//! `up_proj`, `down_proj`), and N AdamW steps (lr 1e-3, weight decay 0.01, 4 sequences a batch,
//! right-padded, the padding masked out of the loss) train it on next-token cross-entropy:
//! `llama::finetune` documents each choice. Prints one line per step to stdout,
//!
//! ```text
//! step 1 loss 5.9641
//! step 2 loss 5.8712
//! ```
//!
//! and writes `PEFT_DIR/adapter_config.json` and `PEFT_DIR/adapter_model.safetensors` (PEFT's
//! `save_pretrained`); a summary goes to stderr. Runs repeat: `--seed` (0) seeds `lora_A`'s
//! initialization, the only random draw.

use std::path::PathBuf;

use candle_module::device_or_env;
use clap::Parser;
use llama::finetune::{train_lora, FinetuneConfig};
use llama::json_lines::read_token_ids;
use llama::LlamaForCausalLM;
use module_runtime::nn::parse_quant_kind;
use module_runtime::nn::peft::PeftExt;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Train a LoRA adapter on JSON lines of token ids and save it as a PEFT adapter folder.
#[derive(Parser)]
struct Args {
    /// The checkpoint folder (config.json, model.safetensors or its index)
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Training sequences: one JSON array of token ids per line
    #[arg(long, value_name = "FILE")]
    data: PathBuf,
    /// The adapters' rank r
    #[arg(long, value_name = "R")]
    rank: usize,
    /// Optimizer steps (one batch each)
    #[arg(long, value_name = "N")]
    steps: usize,
    /// Where the PEFT adapter folder is written
    #[arg(long, value_name = "PEFT_DIR")]
    out: PathBuf,
    /// QLoRA: quantize the base's Linear layers as they load (q8_0, q4_0, q4_k, …)
    #[arg(long, value_name = "KIND")]
    quantize: Option<String>,
    /// LoRA's alpha [default: 2 * rank]
    #[arg(long, value_name = "A")]
    lora_alpha: Option<f64>,
    /// Sequences per batch
    #[arg(long, value_name = "B", default_value = "4")]
    batch_size: usize,
    /// AdamW's learning rate
    #[arg(long, value_name = "LR", default_value = "1e-3")]
    lr: f64,
    /// The seed of lora_A's initialization
    #[arg(long, value_name = "S", default_value = "0")]
    seed: u64,
    /// cpu, cuda:0, metal:0 [default: $MODULE_DEVICE, else cpu]
    #[arg(long, value_name = "NAME")]
    device: Option<String>,
}

fn main() -> AnyResult<()> {
    let args = Args::parse();
    let device = device_or_env(args.device.as_deref())?;
    let file = std::fs::File::open(&args.data)
        .map_err(|e| format!("cannot open {}: {e}", args.data.display()))?;
    let data = read_token_ids(std::io::BufReader::new(file))
        .map_err(|e| format!("{}: {e}", args.data.display()))?;
    let mut config = FinetuneConfig {
        batch_size: args.batch_size,
        lr: args.lr,
        seed: args.seed,
        ..FinetuneConfig::new(args.rank, args.steps)
    };
    if let Some(alpha) = args.lora_alpha {
        config.lora.lora_alpha = alpha;
    }
    config.lora.base_model_name_or_path = Some(args.model.display().to_string());
    let mut model = match &args.quantize {
        None => LlamaForCausalLM::from_pretrained(&args.model, &device)?,
        Some(kind) => {
            // Quantized on the way in: the float32 base is never in memory.
            let (model, report) = LlamaForCausalLM::from_pretrained_quantized(
                &args.model,
                &device,
                "**",
                parse_quant_kind(kind)?,
            )?;
            eprintln!(
                "{kind}: {} Linear layers quantized, {} kept in float (rows not a multiple of the block)",
                report.quantized.len(),
                report.kept_float.len()
            );
            model
        }
    };
    eprintln!(
        "{} sequences, batches of {}, rank {}, lora_alpha {}, lr {}",
        data.len(),
        config.batch_size.min(data.len()),
        config.lora.r,
        config.lora.lora_alpha,
        config.lr
    );
    train_lora(&mut model, &data, &config, |step, loss| {
        println!("step {step} loss {loss:.4}");
    })?;
    let (trainable, all) = model.get_nb_trainable_parameters();
    model.save_pretrained(&args.out)?;
    eprintln!(
        "saved {} ({trainable} trainable parameters of {all})",
        args.out.display()
    );
    Ok(())
}
