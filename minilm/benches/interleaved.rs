//! all-MiniLM-L6-v2 forward throughput, the variants interleaved: each round runs every variant once,
//! in turn, so a shared machine's slow and fast moments fall on all of them alike, and the medians
//! and ratios of one run are comparable (criterion's groups run one variant after another, ten
//! seconds each, and on the 2-core development machine two such runs differ by 10–25%).
//!
//! ```text
//! cargo bench -p minilm --features peers --bench interleaved            # 30 rounds
//! cargo bench -p minilm --features peers --bench interleaved -- 60      # 60 rounds
//! ```
//!
//! Variants: candle-transformers' `BertModel` (the peer), ours with `eval()` only, ours with
//! `eval()` + `no_grad()`, the same with the fused passes off (`nn::without_fusion`: bias + GELU
//! and residual + LayerNorm as separate passes), ours with `eval()` + `freeze("**")`, and ours
//! under `no_grad()` through `functional_call` with every parameter substituted (copies of the
//! model's own values; issue 15's target: within 5% of the plain call); one batch of 32 sentences
//! of 25 tokens, as in DESIGN.md §6. The checkpoint comes from `MINILM_DIR` or
//! `../shared/models/all-MiniLM-L6-v2`.
//!
//! With `PYTORCH` set (a Python with torch and transformers), every round also runs PyTorch's side,
//! `../shared/perf/pytorch_minilm_bench.py` (or `$PYTORCH_MINILM_BENCH`): transformers' `BertModel`
//! on the same checkpoint, `eval()` under `torch.no_grad()`, 2 threads, the same batch shape,
//! `PYTORCH_REPS` (default 5) timed forwards per round after its own warm-up. Its line is the
//! median of the rounds' medians:
//!
//! ```text
//! PYTORCH=/path/to/venv/bin/python cargo bench -p minilm --features peers --bench interleaved -- 20
//! ```

use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use module_runtime::prelude::*;
use module_runtime::StateDict;

#[path = "support/mod.rs"]
mod support;
use support::{BATCH, SEQ};

type Run<'a> = Box<dyn Fn() -> Result<Tensor> + 'a>;

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // Freed tensors' memory reused from step to step, as the README advises (glibc's allocator
    // would hand it back and fault it in again every step).
    module_runtime::reuse_freed_memory();
    let rounds = support::threads_and_rounds(30);
    let Some(dir) = minilm_dir() else {
        eprintln!("*** SKIPPED: no all-MiniLM-L6-v2 checkpoint (set MINILM_DIR) ***");
        return Ok(());
    };
    let device = Device::Cpu;
    let path = dir.join("model.safetensors");
    let load = || -> Result<BertModel> {
        let model =
            module_runtime::build_empty(|| BertModel::new(&BertConfig::minilm_l6(), &device))?;
        model.load_state_dict(&path, &LoadOptions::default())?;
        model.eval();
        Ok(model)
    };
    let ours = load()?;
    // Every parameter substituted: copies of the model's own values, in fresh storage.
    let substitutes: StateDict = (ours.named_parameters().into_iter())
        .map(|(path, p)| Ok((path, p.tensor()?.copy()?)))
        .collect::<Result<_>>()?;
    let frozen = load()?;
    frozen.freeze("**")?;
    let peer = support::peer(&dir, &device)?;
    let (ids, mask) = support::inputs(&device)?;
    let types = ids.zeros_like()?;

    let variants: Vec<(&str, Run)> = vec![
        (
            "candle_transformers_bert",
            Box::new(|| Ok(peer.forward(&ids, &types, Some(&mask))?)),
        ),
        ("derived_eval_only", Box::new(|| ours.call((&ids, &mask)))),
        (
            "derived_eval_no_grad",
            Box::new(|| module_runtime::without_grad(|| ours.call((&ids, &mask)))),
        ),
        (
            "derived_eval_no_grad_unfused",
            Box::new(|| {
                module_runtime::without_grad(|| {
                    module_runtime::nn::without_fusion(|| ours.call((&ids, &mask)))
                })
            }),
        ),
        (
            "derived_eval_freeze",
            Box::new(|| frozen.call((&ids, &mask))),
        ),
        (
            "derived_functional_all",
            Box::new(|| {
                module_runtime::without_grad(|| ours.functional_call(&substitutes, (&ids, &mask)))
            }),
        ),
    ];
    // Same outputs, then a warm-up round.
    let reference = (variants[0].1)()?;
    for (name, run) in &variants {
        let diff = (run()? - &reference)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-4, "{name} differs from the peer by {diff}");
    }
    let pytorch = std::env::var_os("PYTORCH").map(PathBuf::from);
    let script = std::env::var_os("PYTORCH_MINILM_BENCH")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/perf/pytorch_minilm_bench.py")
        });
    let reps = std::env::var("PYTORCH_REPS").unwrap_or_else(|_| "5".to_owned());
    let mut torch_medians: Vec<f64> = Vec::new();
    let mut times: Vec<Vec<Duration>> = vec![Vec::new(); variants.len()];
    for _ in 0..rounds {
        for ((_, run), times) in variants.iter().zip(&mut times) {
            let start = Instant::now();
            black_box(run()?);
            times.push(start.elapsed());
        }
        if let Some(python) = &pytorch {
            let out = Command::new(python)
                .arg(&script)
                .arg(&dir)
                .args([BATCH.to_string(), SEQ.to_string(), reps.clone()])
                .output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            // `forward 32x25: median 180.1 ms = 178 sentences/s (…)`
            let median = text.lines().find_map(|l| {
                l.split_once(": median ")?
                    .1
                    .split_once(" ms")?
                    .0
                    .parse()
                    .ok()
            });
            match median {
                Some(ms) => torch_medians.push(ms),
                None => eprintln!(
                    "pytorch: no result: {}",
                    String::from_utf8_lossy(&out.stderr)
                ),
            }
        }
    }
    let medians: Vec<f64> = times
        .iter_mut()
        .map(|t| {
            t.sort();
            t[t.len() / 2].as_secs_f64()
        })
        .collect();
    println!("{rounds} interleaved rounds, batch {BATCH} x {SEQ} tokens");
    for (((name, _), t), median) in variants.iter().zip(&times).zip(&medians) {
        println!(
            "{name:<30} median {:7.1} ms = {:5.0} sentences/s (min {:6.1} ms, max {:6.1} ms); {:.2} x the peer's throughput",
            median * 1e3,
            BATCH as f64 / median,
            t[0].as_secs_f64() * 1e3,
            t[t.len() - 1].as_secs_f64() * 1e3,
            medians[0] / median,
        );
    }
    if !torch_medians.is_empty() {
        torch_medians.sort_by(f64::total_cmp);
        let median = torch_medians[torch_medians.len() / 2] / 1e3;
        println!(
            "{:<30} median {:7.1} ms = {:5.0} sentences/s (min of the rounds' medians {:6.1} ms); {:.2} x the peer's throughput",
            "pytorch_eval_no_grad",
            median * 1e3,
            BATCH as f64 / median,
            torch_medians[0],
            medians[0] / median,
        );
        for ((name, _), ours) in variants.iter().zip(&medians).skip(1) {
            println!("{name:<30} {:.2} x PyTorch's throughput", median / ours);
        }
    }
    Ok(())
}
