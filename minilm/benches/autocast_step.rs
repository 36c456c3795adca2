//! The MiniLM fine-tuning step of `train_step` (all-MiniLM-L6-v2, train mode, batch 8 × 25,
//! module-optim's fused `AdamW`) in float32 and with its forward under
//! `autocast("cpu", BF16)`, against PyTorch's same step in float32 and under
//! `torch.autocast("cpu", dtype=torch.bfloat16)`, in one interleaved run; and first a single
//! product `[200, 384] × [384, 1536]` (a MiniLM feed-forward product of a 8 × 25 batch) in
//! float32 and under autocast, on both sides.
//!
//! ```text
//! cargo bench -p minilm --bench autocast_step              # 5 rounds of 4 steps
//! PYTORCH=/path/to/venv/bin/python cargo bench -p minilm --bench autocast_step
//! ```
//!
//! With `PYTORCH` set, every round also runs `benches/support/pytorch_autocast_step.py` twice
//! (float32, autocast), after our two variants' steps. `ONLY=0` (float32) or `ONLY=1` (autocast)
//! times one of ours alone, for a profile of that one (`perf record --call-graph dwarf`).
//!
//! `MODULE_DEVICE=cuda:0` runs both sides on that GPU, under `autocast("cuda", BF16)` and
//! `torch.autocast("cuda", dtype=torch.bfloat16)`, each timed part ending with a device
//! synchronize on both sides.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use module_runtime::amp::autocast;
use module_runtime::nn::Linear;
use module_runtime::optim::{AdamW, Optimizer as _};
use module_runtime::prelude::*;

#[path = "support/mod.rs"]
mod support;

const BATCH: usize = 8;
const SEQ: usize = 25;
const STEPS: usize = 4;

fn median(mut t: Vec<f64>) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[0])
}

/// One product's median time, in µs, in float32 or under autocast (the weight a parameter that
/// records gradients, so its bfloat16 copy is cached in the scope, as PyTorch's).
fn product(amp: bool, device: &Device) -> Result<(f64, DType)> {
    let fc = Linear::new(384, 1536, device)?;
    let x = Tensor::randn(0f32, 1.0, (200, 384), device)?;
    let run = || -> Result<(f64, DType)> {
        let mut times = Vec::new();
        let mut dtype = DType::F32;
        for i in 0..30 {
            let start = Instant::now();
            let y = fc.call(&x)?;
            device.synchronize()?;
            if i >= 5 {
                times.push(start.elapsed().as_secs_f64() * 1e6);
            }
            dtype = y.dtype();
        }
        Ok((median(times).0, dtype))
    };
    if amp {
        autocast(device_type(device), DType::BF16, run)
    } else {
        run()
    }
}

/// The device type `autocast` takes for `device`.
fn device_type(device: &Device) -> &'static str {
    if device.is_cuda() {
        "cuda"
    } else {
        "cpu"
    }
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    module_runtime::reuse_freed_memory();
    let rounds = support::threads_and_rounds(5);
    let device = candle_module::device_from_env()?;
    for amp in [false, true] {
        let (us, dtype) = product(amp, &device)?;
        let label = if amp { "autocast bf16" } else { "float32" };
        println!("ours product {label}: {us:.0} us ({dtype:?})");
    }
    let Some(dir) = minilm_dir() else {
        eprintln!("*** SKIPPED: no all-MiniLM-L6-v2 checkpoint (set MINILM_DIR) ***");
        return Ok(());
    };
    let load = || -> Result<BertModel> {
        let model = BertModel::new(&BertConfig::minilm_l6(), &device)?;
        model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
        model.train();
        Ok(model)
    };
    let (ids, mask) = support::batch(BATCH, SEQ, &device)?;
    let mask_f = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let v = ((Tensor::arange(0u32, 384, &device)?.to_dtype(DType::F32)? / 384.0)? - 0.5)?;

    let models = [load()?, load()?];
    let mut opts = [
        AdamW::new(&models[0], AdamW::options().lr(1e-5))?,
        AdamW::new(&models[1], AdamW::options().lr(1e-5))?,
    ];
    // PyTorch's AMP recipe: the forward and the loss under autocast, backward and step outside.
    let step = |model: &BertModel, opt: &mut AdamW, amp: bool| -> Result<[Duration; 3]> {
        let start = Instant::now();
        let forward = || -> Result<Tensor> {
            let hidden = model.call((&ids, &mask))?;
            let pooled = (hidden.broadcast_mul(&mask_f)?.sum(1)?
                / mask_f.sum(1)?.broadcast_as((BATCH, 384))?)?;
            Ok(pooled.broadcast_mul(&v)?.sum(1)?.sqr()?.mean_all()?)
        };
        let loss = if amp {
            autocast(device_type(&device), DType::BF16, forward)?
        } else {
            forward()?
        };
        device.synchronize()?;
        let f = start.elapsed();
        let grads = loss.backward()?;
        device.synchronize()?;
        let b = start.elapsed() - f;
        opt.step(&grads).map_err(candle_core::Error::wrap)?;
        device.synchronize()?;
        Ok([f, b, start.elapsed() - f - b])
    };

    let pytorch = std::env::var_os("PYTORCH").map(PathBuf::from);
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support/pytorch_autocast_step.py");
    let sentences = std::env::temp_dir().join("minilm_autocast_step_sentences.txt");
    if pytorch.is_some() {
        let line = vec!["word"; SEQ - 2].join(" ");
        std::fs::write(&sentences, vec![line; BATCH].join("\n"))?;
    }
    for (i, model) in models.iter().enumerate() {
        step(model, &mut opts[i], i == 1)?; // warm-up
    }
    let mut times: [Vec<[Duration; 3]>; 2] = [Vec::new(), Vec::new()];
    let mut torch_lines = Vec::new();
    for round in 0..rounds {
        for (i, model) in models.iter().enumerate() {
            if std::env::var("ONLY").is_ok_and(|v| v != i.to_string()) {
                continue;
            }
            for _ in 0..STEPS {
                times[i].push(step(model, &mut opts[i], i == 1)?);
            }
        }
        if let Some(python) = &pytorch {
            for mode in ["plain", "autocast"] {
                let out = Command::new(python)
                    .arg(&script)
                    .arg(&dir)
                    .arg(&sentences)
                    .arg(STEPS.to_string())
                    .arg(mode)
                    .output()?;
                let text = String::from_utf8_lossy(&out.stderr);
                for line in text.lines().filter(|l| l.starts_with("pytorch")) {
                    torch_lines.push(format!("round {round}: {line}"));
                }
            }
        }
    }
    for (i, label) in ["float32", "autocast bf16"].iter().enumerate() {
        if times[i].is_empty() {
            continue;
        }
        let part = |k: usize| median(times[i].iter().map(|p| p[k].as_secs_f64() * 1e3).collect());
        let whole = median(
            times[i]
                .iter()
                .map(|p| p.iter().map(Duration::as_secs_f64).sum::<f64>() * 1e3)
                .collect(),
        );
        println!(
            "ours ({label}) train step: batch {BATCH} x {SEQ}, {} steps in {rounds} rounds: median {:.1} ms (min {:.1}); forward {:.0} ms, backward {:.0} ms, AdamW {:.0} ms",
            times[i].len(),
            whole.0,
            whole.1,
            part(0).0,
            part(1).0,
            part(2).0,
        );
    }
    for line in torch_lines {
        println!("{line}");
    }
    Ok(())
}
