//! What a decode step costs besides its arithmetic: `step` of a 30-layer Llama so narrow (hidden
//! 64, one head, intermediate 128, vocabulary 256) that its weights (1.4 MB in float32) stay in
//! the caches and its products take a few microseconds, in float32 and with `q8_0` weights. The
//! time left is the layers' fixed costs: tensors made and freed, the thread pool's dispatches,
//! hooks checked, norms, rotary embedding, the cache writes and attention over 16 to 216 keys.
//! Subtracted from a full-size model's step, it tells what a faster kernel cannot remove.
//!
//! ```text
//! cargo bench -p llama --bench step_overhead          # 2 threads, as the decode benchmark
//! ```

use std::time::Instant;

use llama::{LlamaConfig, LlamaForCausalLM};
use module_runtime::nn::{parse_quant_kind, quantize};
use module_runtime::prelude::*;

const STEPS: usize = 200;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    module_runtime::reuse_freed_memory();
    let config = LlamaConfig::from_json(&serde_json::json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 30,
        "num_attention_heads": 1, "num_key_value_heads": 1, "head_dim": 64,
        "vocab_size": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
        "rope_theta": 100000.0, "tie_word_embeddings": true,
    }))?;
    let device = Device::Cpu;
    let prompt = Tensor::from_vec((0..16u32).collect::<Vec<_>>(), (1, 16), &device)?;
    for kind in ["f32", "q8_0"] {
        let model = LlamaForCausalLM::new(&config, &device)?;
        if kind != "f32" {
            let _ = quantize(&model, "**", parse_quant_kind(kind)?)?;
        }
        let (_, mut cache) = model.prefill(&prompt, model.initial_state(1)?)?;
        let mut rounds = Vec::new();
        for _ in 0..7 {
            cache.truncate(16)?;
            let mut token = 1u32;
            let start = Instant::now();
            for _ in 0..STEPS {
                let (logits, next) = model.step(&Tensor::new(&[token], &device)?, cache)?;
                cache = next;
                token = logits.argmax(D::Minus1)?.flatten_all()?.to_vec1::<u32>()?[0];
            }
            rounds.push(start.elapsed().as_secs_f64() * 1e6 / STEPS as f64);
        }
        rounds.sort_by(f64::total_cmp);
        let layers = config.num_hidden_layers as f64;
        println!(
            "{kind:5} step {:6.1} µs (median of 7 rounds of {STEPS}; {:.1}–{:.1}), {:.2} µs a layer",
            rounds[3],
            rounds[0],
            rounds[6],
            rounds[3] / layers
        );
    }
    Ok(())
}
