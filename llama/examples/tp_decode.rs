//! Tensor-parallel decoding over MPI ranks against one process (issue 47, item 6): the same
//! checkpoint, prompt and greedy decode, run whole in one process or split over the ranks of
//! `mpiexec` by `LlamaForCausalLM::tensor_parallel` (each rank keeps its attention heads and its
//! part of the feed-forward block; two all-reduces per layer).
//!
//! ```text
//! cargo build --release -p llama --features mpi --example tp_decode
//! # once, without mpiexec: makes a random model there when the folder has none
//! target/release/examples/tp_decode --model /tmp/llama-8h
//! # then alternately, the same folder:
//! RAYON_NUM_THREADS=2 target/release/examples/tp_decode --model /tmp/llama-8h
//! mpiexec -n 2 -genv RAYON_NUM_THREADS 1 target/release/examples/tp_decode --model /tmp/llama-8h
//! ```
//!
//! Without the launcher's variables it runs as one process; under `mpiexec` every rank loads the
//! whole checkpoint, keeps its part, and rank 0 prints. Per round: the prefill's time (`prefill`,
//! the last position's logits) and the decode's tokens per second (`step` after `step`, argmax),
//! then the greedy tokens' first ids and a checksum of all of them, which must be the same in both
//! modes, and the sum of the prefill's logits (equal to rounding: the ranks' partial sums).
//!
//! A folder without `config.json` gets a random Llama shaped like SmolLM-135M (hidden 576, 30
//! layers, intermediate 1536, vocabulary 49152, tied embeddings) but with 8 query heads of 72 and 2
//! key/value heads, which split over 2 ranks (SmolLM's 9 do not).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::Parser;
use llama::LlamaForCausalLM;
use module_runtime::distributed::{Collective, DistEnv, Mpi, ReduceOp};
use module_runtime::nn::{OutputReduce, TensorParallel};
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Greedy decode of one prompt, whole or split over the MPI ranks.
#[derive(Parser)]
struct Args {
    /// The checkpoint folder (a random model is made there when it has no config.json)
    #[arg(long, value_name = "DIR")]
    model: PathBuf,
    /// Prompt length in tokens
    #[arg(long, value_name = "N", default_value_t = 128)]
    prompt: usize,
    /// Tokens to decode after the prompt
    #[arg(long, value_name = "N", default_value_t = 64)]
    new_tokens: usize,
    /// Rounds (each a prefill and a decode; the first warms the caches)
    #[arg(long, value_name = "N", default_value_t = 5)]
    rounds: usize,
}

fn main() -> AnyResult<()> {
    let args = Args::parse();
    let env = DistEnv::from_env()?;
    let group: Option<Arc<dyn Collective + Send + Sync>> = if env.is_distributed() {
        Some(Arc::new(Mpi::init()?))
    } else {
        None
    };
    let (rank, world) = group
        .as_ref()
        .map_or((0, 1), |g| (g.rank(), g.world_size()));
    if !args.model.join("config.json").exists() {
        if group.is_some() {
            return Err(format!(
                "{} has no model: run once without mpiexec to make a random one",
                args.model.display()
            )
            .into());
        }
        make_random_model(&args.model)?;
    }
    let mut model = LlamaForCausalLM::from_pretrained(&args.model, &Device::Cpu)?;
    if let Some(group) = &group {
        let g = group.clone();
        let mesh = TensorParallel::new(
            rank,
            world,
            OutputReduce::new(move |t| g.all_reduce(t, ReduceOp::Sum)),
        );
        model.tensor_parallel(&mesh)?;
        group.barrier()?;
    }
    let vocab = model.config.vocab_size as u32;
    // The same prompt on every rank and in every mode: a fixed walk over the vocabulary.
    let ids: Vec<u32> = (0..args.prompt as u32)
        .map(|i| (i * 7919 + 13) % vocab)
        .collect();
    let prompt = Tensor::new(ids.as_slice(), &Device::Cpu)?.unsqueeze(0)?;
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "unset".into());
    if rank == 0 {
        println!(
            "{}: {} process(es), RAYON_NUM_THREADS={threads}, prompt {} tokens, {} new",
            if world > 1 {
                "tensor parallel"
            } else {
                "one process"
            },
            world,
            args.prompt,
            args.new_tokens
        );
    }
    for round in 0..args.rounds {
        let (prefill, decode, tokens, logit_sum) =
            without_grad(|| decode_once(&model, &prompt, &args))?;
        if rank == 0 {
            let sum = tokens.iter().fold(0u64, |h, &t| {
                h.wrapping_mul(1_000_003).wrapping_add(u64::from(t))
            });
            println!(
                "round {round}: prefill {:.1} ms ({:.0} tokens/s), decode {:.1} tokens/s, tokens {:?}… checksum {sum:016x}, logits sum {logit_sum:.4}",
                prefill * 1e3,
                args.prompt as f64 / prefill,
                args.new_tokens as f64 / decode,
                &tokens[..tokens.len().min(8)]
            );
        }
    }
    Ok(())
}

/// Seconds of the prefill and of the decode after it, the greedy tokens, and the sum of the
/// prefill's logits.
fn decode_once(
    model: &LlamaForCausalLM,
    prompt: &Tensor,
    args: &Args,
) -> Result<(f64, f64, Vec<u32>, f64)> {
    let argmax = |logits: &Tensor| -> Result<u32> {
        Ok(logits.flatten_all()?.argmax(0)?.to_scalar::<u32>()?)
    };
    let start = Instant::now();
    let (logits, mut state) = model.prefill(prompt, model.initial_state(1)?)?;
    let mut token = argmax(&logits)?;
    let prefill = start.elapsed().as_secs_f64();
    let logit_sum = logits.to_dtype(DType::F64)?.sum_all()?.to_scalar::<f64>()?;
    let mut tokens = vec![token];
    let start = Instant::now();
    for _ in 0..args.new_tokens {
        let (logits, next) = model.step(&Tensor::new(&[token], prompt.device())?, state)?;
        state = next;
        token = argmax(&logits)?;
        tokens.push(token);
    }
    Ok((prefill, start.elapsed().as_secs_f64(), tokens, logit_sum))
}

fn make_random_model(dir: &Path) -> AnyResult<()> {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 72,
        "vocab_size": 49152, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": true, "bos_token_id": 0,
        "eos_token_id": 0,
    });
    eprintln!("making a random 8-head Llama in {}", dir.display());
    LlamaForCausalLM::save_random_pretrained(dir, &json)?;
    Ok(())
}
