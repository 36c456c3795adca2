//! One fine-tuning step of all-MiniLM-L6-v2, timed in its three parts (forward, backward,
//! optimizer step), as issue 28 and DESIGN.md §6 define it: train mode (dropout on), a batch of
//! 8 sentences of 25 tokens, loss = mean((mean-pooled embedding · v)²) with
//! v = arange(384) / 384 − 0.5, AdamW with lr 1e-5.
//!
//! ```text
//! cargo bench -p minilm --bench train_step              # 5 rounds of 4 steps
//! cargo bench -p minilm --bench train_step -- 8         # 8 rounds
//! PYTORCH=/path/to/venv/bin/python cargo bench -p minilm --bench train_step
//! ```
//!
//! With `PYTORCH` set (a Python with torch and transformers), every round also runs PyTorch's side,
//! `../shared/perf/pytorch_train_step.py` (or `$PYTORCH_TRAIN_STEP`), once with its default AdamW and
//! once with `fused=True`, on sentences that tokenize to the same 8 × 25 batch, so the figures of one
//! run are comparable: the machine's slow and fast moments fall on both sides alike.
//!
//! Three of our variants, each training its own copy of the model: candle-nn's `AdamW` (what users
//! had before module-optim), module-optim's `AdamW` (its fused CPU pass), and module-optim's
//! `AdamW` with the runtime's fused training passes off (`nn::without_fusion`: every layer
//! composed of candle ops, as before they existed), so what those passes gain is measured in the
//! same run. A round is `STEPS` steps of each in turn, after one warm-up step each; the medians
//! (and minimums, the figure least disturbed by other work on the machine) are over every step.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use candle_core::backprop::GradStore;
use candle_nn::{Optimizer as _, ParamsAdamW};
use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use module_runtime::nn::without_fusion;
use module_runtime::optim::{AdamW, Optimizer as _};
use module_runtime::prelude::*;

#[path = "support/mod.rs"]
mod support;

/// Sentences per batch, and tokens per sentence (issue 28).
const BATCH: usize = 8;
const SEQ: usize = 25;
/// Steps per round.
const STEPS: usize = 4;

/// One step's parts.
#[derive(Clone, Copy)]
struct Parts {
    forward: Duration,
    backward: Duration,
    optimizer: Duration,
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // Freed tensors' memory reused from step to step, as the README advises (glibc's allocator
    // would hand it back and fault it in again every step).
    module_runtime::reuse_freed_memory();
    let rounds = support::threads_and_rounds(5);
    let Some(dir) = minilm_dir() else {
        eprintln!("*** SKIPPED: no all-MiniLM-L6-v2 checkpoint (set MINILM_DIR) ***");
        return Ok(());
    };
    let device = Device::Cpu;
    let load = || -> Result<BertModel> {
        let model = BertModel::new(&BertConfig::minilm_l6(), &device)?;
        model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
        model.train();
        Ok(model)
    };

    let (ids, mask) = support::batch(BATCH, SEQ, &device)?;
    let mask_f = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let v = ((Tensor::arange(0u32, 384, &device)?.to_dtype(DType::F32)? / 384.0)? - 0.5)?;

    // Each variant trains its own copy of the model with its own optimizer.
    let candle_nn_model = load()?;
    let mut candle_nn_adamw = candle_nn::AdamW::new(
        candle_nn_model.trainable_vars()?,
        ParamsAdamW {
            lr: 1e-5,
            ..ParamsAdamW::default()
        },
    )?;
    let optim_model = load()?;
    let mut optim_adamw =
        module_runtime::optim::AdamW::new(&optim_model, AdamW::options().lr(1e-5))?;
    let composed_model = load()?;
    let mut composed_adamw =
        module_runtime::optim::AdamW::new(&composed_model, AdamW::options().lr(1e-5))?;
    let step =
        |model: &BertModel, opt: &mut dyn FnMut(&GradStore) -> Result<()>| -> Result<Parts> {
            let start = Instant::now();
            let hidden = model.call((&ids, &mask))?;
            let pooled = (hidden.broadcast_mul(&mask_f)?.sum(1)?
                / mask_f.sum(1)?.broadcast_as((BATCH, 384))?)?;
            let loss = pooled.broadcast_mul(&v)?.sum(1)?.sqr()?.mean_all()?;
            let forward = start.elapsed();
            let grads = loss.backward()?;
            let backward = start.elapsed() - forward;
            opt(&grads)?;
            let optimizer = start.elapsed() - forward - backward;
            Ok(Parts {
                forward,
                backward,
                optimizer,
            })
        };
    let mut candle_nn_step = |g: &GradStore| Ok(candle_nn_adamw.step(g)?);
    let mut optim_step =
        |g: &GradStore| Ok(optim_adamw.step(g).map_err(candle_core::Error::wrap)?);
    let mut composed_step =
        |g: &GradStore| Ok(composed_adamw.step(g).map_err(candle_core::Error::wrap)?);

    let pytorch = std::env::var_os("PYTORCH").map(PathBuf::from);
    let script = std::env::var_os("PYTORCH_TRAIN_STEP")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/perf/pytorch_train_step.py")
        });
    let sentences = std::env::temp_dir().join("minilm_train_step_sentences.txt");
    if pytorch.is_some() {
        // 23 words each: with [CLS] and [SEP], 25 tokens, so padding=True gives the same batch.
        let line = vec!["word"; SEQ - 2].join(" ");
        std::fs::write(&sentences, vec![line; BATCH].join("\n"))?;
    }

    step(&candle_nn_model, &mut candle_nn_step)?; // warm-up
    step(&optim_model, &mut optim_step)?;
    without_fusion(|| step(&composed_model, &mut composed_step))?;
    let (mut with_candle_nn, mut with_optim, mut composed) = (Vec::new(), Vec::new(), Vec::new());
    let mut torch_lines = Vec::new();
    for round in 0..rounds {
        for _ in 0..STEPS {
            with_candle_nn.push(step(&candle_nn_model, &mut candle_nn_step)?);
        }
        for _ in 0..STEPS {
            with_optim.push(step(&optim_model, &mut optim_step)?);
        }
        for _ in 0..STEPS {
            composed.push(without_fusion(|| {
                step(&composed_model, &mut composed_step)
            })?);
        }
        if let Some(python) = &pytorch {
            for fused in [false, true] {
                let mut cmd = Command::new(python);
                cmd.arg(&script)
                    .arg(&dir)
                    .arg(&sentences)
                    .arg(STEPS.to_string());
                if fused {
                    cmd.arg("fused");
                }
                let out = cmd.output()?;
                let text = String::from_utf8_lossy(&out.stderr);
                let line = text
                    .lines()
                    .rfind(|l| l.contains("train step"))
                    .unwrap_or("pytorch: no result (see its stderr)")
                    .to_owned();
                torch_lines.push(format!("round {round}: {line}"));
            }
        }
    }
    for (name, steps) in [
        ("candle-nn AdamW", &with_candle_nn),
        ("module-optim AdamW (fused)", &with_optim),
        ("module-optim AdamW (fused), layers composed", &composed),
    ] {
        let sorted = |f: fn(&Parts) -> Duration| {
            let mut t: Vec<f64> = steps.iter().map(|p| f(p).as_secs_f64() * 1e3).collect();
            t.sort_by(f64::total_cmp);
            t
        };
        let median = |f| sorted(f)[steps.len() / 2];
        let min = |f| sorted(f)[0];
        let whole = |p: &Parts| p.forward + p.backward + p.optimizer;
        println!(
            "ours ({name}) train step: batch {BATCH} x {SEQ}, {} steps in {rounds} rounds: median {:.1} ms (min {:.1}); forward {:.0} ms (min {:.0}), backward {:.0} ms (min {:.0}), optimizer {:.0} ms",
            steps.len(),
            median(whole),
            min(whole),
            median(|p| p.forward),
            min(|p| p.forward),
            median(|p| p.backward),
            min(|p| p.backward),
            median(|p| p.optimizer),
        );
    }
    for line in torch_lines {
        println!("{line}");
    }
    Ok(())
}
