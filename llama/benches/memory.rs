//! Resident memory of the SmolLM-135M-shaped decoder (135M parameters; float32 513 MiB, `q8_0`
//! 136 MiB, `q4_0` 72 MiB): loaded in float32, after `quantize(&model, "**", kind)` (the float
//! values freed), after a first decode step (the kernel's tiles made, replacing the weights'
//! bytes), and loaded from a GGUF of the kind (never holding float values), for `q8_0` and
//! `q4_0`. Each case runs in a fresh process (this one, again), read from `/proc/self/status`
//! (Linux).
//!
//! The checkpoint is the decode benchmark's (`$LLAMA_BENCH_DIR`, default `smollm-135m-random` in
//! the system's temp folder), and the GGUF files the ones it writes with `QUANTIZE=q8_0,q4_0`:
//! run it first.
//!
//! ```text
//! QUANTIZE=q8_0,q4_0 cargo bench -p llama --bench decode -- 1   # the checkpoint and GGUF files
//! cargo bench -p llama --bench memory
//! ```

use std::path::Path;

use candle_module::process_memory_mib;
use llama::LlamaForCausalLM;
use module_runtime::nn::quantize;
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[path = "support/mod.rs"]
mod support;

/// The case a child process measures.
const CASE: &str = "MEMORY_BENCH_CASE";

fn report(what: &str) {
    let (resident, _) = process_memory_mib();
    if resident.is_nan() {
        println!("{what:44} (resident memory is read on Linux only)");
    } else {
        println!("{what:44} {resident:6.0} MiB resident");
    }
}

/// A 16-token prefill and one decode step.
fn first_step(model: &LlamaForCausalLM) -> AnyResult<()> {
    let device = Device::Cpu;
    let prompt = Tensor::from_vec((1..17u32).collect::<Vec<_>>(), (1, 16), &device)?;
    let (logits, cache) = model.prefill(&prompt, model.initial_state(1)?)?;
    let token = logits.flatten_all()?.argmax(0)?.to_scalar::<u32>()?;
    let _ = model.step(&Tensor::new(&[token], &device)?, cache)?;
    Ok(())
}

/// The kinds measured, with their names.
const KINDS: [(&str, GgmlDType); 2] = [("q8_0", GgmlDType::Q8_0), ("q4_0", GgmlDType::Q4_0)];

/// One case: `KIND` (the checkpoint quantized) or `KIND.gguf` (the GGUF file).
fn measure(case: &str, dir: &Path) -> AnyResult<()> {
    if let Some(name) = case.strip_suffix(".gguf") {
        let model =
            LlamaForCausalLM::from_gguf(&dir.join(format!("model-{name}.gguf")), &Device::Cpu)?;
        report(&format!("{name} GGUF loaded"));
        first_step(&model)?;
        report(&format!("{name} GGUF, after the first step (tiles)"));
        return Ok(());
    }
    let kind = KINDS
        .iter()
        .find(|(name, _)| *name == case)
        .ok_or_else(|| format!("unknown case {case}"))?
        .1;
    let model = LlamaForCausalLM::from_pretrained(dir, &Device::Cpu)?;
    report("float32 loaded");
    let _ = quantize(&model, "**", kind)?;
    report(&format!("quantized to {case}"));
    first_step(&model)?;
    report(&format!("{case}, after the first step (tiles)"));
    Ok(())
}

fn main() -> AnyResult<()> {
    let dir = support::model_dir();
    if let Ok(case) = std::env::var(CASE) {
        return measure(&case, &dir);
    }
    support::require_model(&dir)?;
    let mut cases = Vec::new();
    for (name, _) in KINDS {
        cases.push(name.to_owned());
        if dir.join(format!("model-{name}.gguf")).exists() {
            cases.push(format!("{name}.gguf"));
        } else {
            println!(
                "(no model-{name}.gguf in {}: `QUANTIZE={name}` on the decode benchmark writes it)",
                dir.display()
            );
        }
    }
    support::run_cases(CASE, &cases)?;
    Ok(())
}
