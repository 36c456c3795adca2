//! A training step of PyTorch's `nn.TransformerEncoder` as users build it, ours against PyTorch's,
//! interleaved round by round: 2 layers, `d_model` 256, 8 heads, `dim_feedforward` 1024, dropout
//! 0.1, batch first, post-norm; a `[16, 64, 256]` batch; loss = mean of the output's squares;
//! AdamW (lr 1e-4), fused on both sides (module-optim's; PyTorch's `fused=True`). The attention
//! runs without its weights, as the layers call it: `scaled_dot_product_attention` on both sides.
//!
//! ```text
//! cargo bench --bench transformer_step                                      # ours, 5 rounds
//! PYTORCH=/path/to/venv/bin/python cargo bench --bench transformer_step -- 5  # with PyTorch
//! ```
//!
//! Each round: 5 steps of ours (median kept), then `benches/support/pytorch_transformer_step.py`
//! in a fresh process (2 warm-up steps, 5 timed, its median). 2 threads on both sides
//! (`RAYON_NUM_THREADS`, `torch.set_num_threads`). Random weights on each side: the time is the
//! shapes'.

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use module_runtime::nn::{
    EncoderInput, TransformerEncoder, TransformerEncoderLayer, TransformerLayerConfig,
};
use module_runtime::optim::{AdamW, Optimizer as _};
use module_runtime::prelude::*;

const STEPS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        std::env::set_var("RAYON_NUM_THREADS", "2");
    }
    module_runtime::reuse_freed_memory();
    eprintln!(
        "kernels: {}",
        module_runtime::backends::cpu::kernel_choice()
    );
    let rounds = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(5);
    let dev = Device::Cpu;
    let config = TransformerLayerConfig {
        dim_feedforward: 1024,
        batch_first: true,
        ..Default::default()
    };
    let layer = TransformerEncoderLayer::with_config(256, 8, config, &dev)?;
    let encoder = TransformerEncoder::new(&layer, 2, None)?;
    encoder.train();
    let mut opt = AdamW::new(&encoder, AdamW::options().lr(1e-4))?;
    let x = module_runtime::randn(0.0, 1.0, (16, 64, 256), DType::F32, &dev)?;
    let mut step = || -> Result<f64> {
        let start = Instant::now();
        let y = encoder.call(EncoderInput::new(&x))?;
        let loss = y.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        opt.step(&grads).map_err(candle_core::Error::wrap)?;
        Ok(start.elapsed().as_secs_f64() * 1e3)
    };
    step()?;
    step()?;
    let python = std::env::var_os("PYTORCH");
    let script =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support/pytorch_transformer_step.py");
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "2".into());
    for round in 0..rounds {
        let ours = median((0..STEPS).map(|_| step()).collect::<Result<Vec<_>>>()?);
        let theirs = match &python {
            Some(python) => {
                let out = Command::new(python)
                    .arg(&script)
                    .arg(STEPS.to_string())
                    .env("RAYON_NUM_THREADS", &threads)
                    .output()?;
                let text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
                match text.parse::<f64>() {
                    Ok(ms) => format!("{ms:.1} ms"),
                    Err(_) => format!("failed: {}", String::from_utf8_lossy(&out.stderr)),
                }
            }
            None => "not run (set PYTORCH)".into(),
        };
        println!(
            "round {round}: ours {ours:.1} ms, PyTorch {theirs} (median of {STEPS} steps each)"
        );
    }
    Ok(())
}
