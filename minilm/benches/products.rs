//! Single float32 products `x Wᵀ` of the shapes the MiniLM and SmolLM benchmarks run: the
//! runtime's `Linear` (without a bias, under `no_grad`: its products run on candle's barrier pool,
//! `module-runtime/kernels/src/matmul.rs`) against candle's `matmul` on the same tensors, interleaved
//! call by call, and, with `PYTORCH` set, `torch.nn.functional.linear` in the same run
//! (`support/pytorch_products.py`, 2 threads). Medians of the calls, in GFLOP/s. Ours runs with
//! the products' automatic instruction set and, interleaved with it, forced to each level the CPU
//! has (`with_cpu_capability`): AVX2 and AVX-512 side by side on the same host.
//!
//! ```text
//! cargo bench -p minilm --bench products                  # 200 calls per shape
//! PYTORCH=/path/to/venv/bin/python cargo bench -p minilm --bench products -- 400
//! ```

use std::path::Path;
use std::process::Command;
use std::time::Instant;

use candle_core::{Device, Tensor};
use module_runtime::backends::cpu::{get_cpu_capability, with_cpu_capability, CpuCapability};
use module_runtime::nn::Linear;
use module_runtime::prelude::*;

#[path = "support/mod.rs"]
mod support;

/// (name, rows, in, out).
const SHAPES: [(&str, usize, usize, usize); 8] = [
    ("minilm-forward-qkvo", 800, 384, 384),
    ("minilm-forward-up", 800, 384, 1536),
    ("minilm-forward-down", 800, 1536, 384),
    ("minilm-train-qkvo", 200, 384, 384),
    ("minilm-train-up", 200, 384, 1536),
    ("smollm-prefill-up", 128, 576, 1536),
    ("smollm-prefill-down", 128, 1536, 576),
    ("smollm-decode-up", 1, 576, 1536),
];

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let calls = support::threads_and_rounds(200);
    let dev = Device::Cpu;
    let _inference = module_runtime::no_grad();
    let levels: Vec<CpuCapability> = [CpuCapability::Avx2, CpuCapability::Avx512]
        .into_iter()
        .filter(|&level| level <= get_cpu_capability())
        .collect();
    let mut ours_ms = Vec::new();
    for (name, m, k, n) in SHAPES {
        let x = Tensor::randn(0f32, 1., (m, k), &dev)?;
        let w = Tensor::randn(0f32, 1., (n, k), &dev)?;
        let linear = Linear::from_tensors(w.clone(), None)?;
        let (a, b) = (linear.call(&x)?, x.matmul(&w.t()?)?);
        let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(diff <= 1e-3, "{name}: the two products differ by {diff}");
        for _ in 0..20 {
            linear.call(&x)?;
            x.matmul(&w.t()?)?;
        }
        let (mut ours, mut candle) = (Vec::new(), Vec::new());
        let mut forced = vec![Vec::new(); levels.len()];
        for _ in 0..calls {
            let start = Instant::now();
            linear.call(&x)?;
            ours.push(start.elapsed().as_secs_f64() * 1e3);
            for (level, times) in levels.iter().zip(&mut forced) {
                let start = Instant::now();
                with_cpu_capability(*level, || linear.call(&x))?;
                times.push(start.elapsed().as_secs_f64() * 1e3);
            }
            let start = Instant::now();
            x.matmul(&w.t()?)?;
            candle.push(start.elapsed().as_secs_f64() * 1e3);
        }
        let flop = 2.0 * (m * k * n) as f64;
        let gflops = |ms: f64| flop / ms / 1e6;
        let (ours, candle) = (support::median(ours), support::median(candle));
        ours_ms.push(ours);
        let forced: Vec<String> = levels
            .iter()
            .zip(forced)
            .map(|(level, times)| format!("{level} {:.0}", gflops(support::median(times))))
            .collect();
        println!(
            "{name:<22} {m:>4}x{k:<4}x{n:<5} ours {ours:.3} ms ({:.0} GFLOP/s; forced: {}), candle's matmul {candle:.3} ms ({:.0} GFLOP/s)",
            gflops(ours),
            forced.join(", "),
            gflops(candle)
        );
    }
    if let Some(python) = std::env::var_os("PYTORCH") {
        let script =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/support/pytorch_products.py");
        let out = Command::new(python)
            .arg(script)
            .arg(calls.to_string())
            .args(
                SHAPES
                    .iter()
                    .map(|(name, m, k, n)| format!("{name}:{m}:{k}:{n}")),
            )
            .output()?;
        let text = String::from_utf8_lossy(&out.stdout);
        for (line, ours) in text.lines().zip(&ours_ms) {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let [name, m, k, n, ms] = fields[..] else {
                continue;
            };
            let flop = 2.0 * m.parse::<f64>()? * k.parse::<f64>()? * n.parse::<f64>()?;
            let ms: f64 = ms.parse()?;
            println!(
                "{name:<22} PyTorch {ms:.3} ms ({:.0} GFLOP/s); ours {:.2}x its speed",
                flop / ms / 1e6,
                ms / ours
            );
        }
        if !out.status.success() {
            eprintln!("pytorch: {}", String::from_utf8_lossy(&out.stderr));
        }
    }
    Ok(())
}
