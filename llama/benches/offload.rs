//! Disk offload (`nn::big_modeling`, Accelerate's `offload_folder`) of the SmolLM-135M-shaped
//! decoder (135M parameters, float32 513 MiB): the peak resident memory and time of a forward
//! (one row of 32 tokens, all logits, under `no_grad`) of the model in memory against the same
//! model built empty and dispatched with every weight on disk, each read as its layer runs and
//! freed after. Each case runs in a fresh process (this one, again); memory from
//! `/proc/self/status` (Linux), the peak reset (`/proc/self/clear_refs`) after the model is
//! ready, so it is the forward's own. The logits of both are compared.
//!
//! The checkpoint is the decode benchmark's (`$LLAMA_BENCH_DIR`, default `smollm-135m-random` in
//! the system's temp folder): run it first. The offload folder (`$OFFLOAD_DIR`, default
//! `smollm-135m-offload` in the temp folder) is written once, by a dispatch of the loaded model.
//!
//! ```text
//! cargo bench -p llama --bench decode -- 1   # the checkpoint, once
//! cargo bench -p llama --bench offload
//! ```

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use candle_module::process_memory_mib;
use llama::{LlamaConfig, LlamaForCausalLM};
use module_runtime::nn::big_modeling::{dispatch_model, DeviceMap};
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[path = "support/mod.rs"]
mod support;

/// The case a child process measures: `unmapped` or `disk`.
const CASE: &str = "OFFLOAD_BENCH_CASE";
const RUNS: usize = 5;

fn map(folder: &Path) -> AnyResult<DeviceMap> {
    Ok(DeviceMap::from_pairs([("", "disk")])?.offload_folder(folder))
}

/// The forward measured: logits of 32 tokens, the median of `RUNS` after one warm-up.
fn forwards(call: impl Fn(&Tensor) -> Result<Tensor>) -> AnyResult<(Tensor, Duration)> {
    let ids = Tensor::from_vec((1..33u32).collect::<Vec<_>>(), (1, 32), &Device::Cpu)?;
    let _guard = no_grad();
    let logits = call(&ids)?;
    let mut times = Vec::new();
    for _ in 0..RUNS {
        let start = Instant::now();
        let _ = call(&ids)?;
        times.push(start.elapsed());
    }
    times.sort();
    Ok((logits, times[RUNS / 2]))
}

fn offload_dir() -> PathBuf {
    std::env::var_os("OFFLOAD_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("smollm-135m-offload"))
}

fn measure(case: &str, dir: &Path) -> AnyResult<()> {
    let folder = offload_dir();
    let (logits, time) = match case {
        "unmapped" => {
            let model = LlamaForCausalLM::from_pretrained(dir, &Device::Cpu)?;
            let (resident, _) = process_memory_mib();
            println!("{case:10} model ready: {resident:6.0} MiB resident");
            std::fs::write("/proc/self/clear_refs", "5")?;
            forwards(|x| model.call(x))?
        }
        "disk" => {
            let config = LlamaConfig::from_json_file(&dir.join("config.json"))?;
            let model = build_empty(|| LlamaForCausalLM::new(&config, &Device::Cpu))?;
            let dispatched = dispatch_model(&model, &map(&folder)?)?;
            let (resident, _) = process_memory_mib();
            println!("{case:10} model ready: {resident:6.0} MiB resident");
            std::fs::write("/proc/self/clear_refs", "5")?;
            let out = forwards(|x| dispatched.call(x))?;
            let per_forward = dispatched.trace().bytes_loaded() / (RUNS + 1);
            println!(
                "{case:10} read {:.0} MiB from disk per forward ({} weights)",
                per_forward as f64 / 1048576.0,
                dispatched.trace().loads() / (RUNS + 1)
            );
            out
        }
        _ => return Err(format!("unknown case {case}").into()),
    };
    let (_, peak) = process_memory_mib();
    println!(
        "{case:10} forward: {:7.1} ms (median of {RUNS}), peak {peak:6.0} MiB resident",
        time.as_secs_f64() * 1e3
    );
    let mut out = StateDict::new();
    out.insert("logits", logits);
    out.save_safetensors(std::env::temp_dir().join(format!("offload-bench-{case}.safetensors")))?;
    Ok(())
}

fn main() -> AnyResult<()> {
    let dir = support::model_dir();
    if let Ok(case) = std::env::var(CASE) {
        return measure(&case, &dir);
    }
    support::require_model(&dir)?;
    let folder = offload_dir();
    if !folder.join("model.norm.weight.safetensors").exists() {
        println!("writing the offload folder {}", folder.display());
        let model = LlamaForCausalLM::from_pretrained(&dir, &Device::Cpu)?;
        dispatch_model(&model, &map(&folder)?)?;
    }
    println!("{}", module_runtime::backends::cpu::kernel_choice());
    support::run_cases(CASE, &["unmapped", "disk"])?;
    let read = |case: &str| -> AnyResult<Tensor> {
        let path = std::env::temp_dir().join(format!("offload-bench-{case}.safetensors"));
        let sd = StateDict::read(path, &LoadOptions::default())?;
        Ok(sd.get("logits").ok_or("no logits")?.clone())
    };
    let diff = (read("unmapped")? - read("disk")?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    println!("largest logit difference, disk against unmapped: {diff:e}");
    Ok(())
}
