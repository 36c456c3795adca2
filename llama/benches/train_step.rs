//! Training steps of the SmolLM-135M-shaped Llama against PyTorch, step time and peak resident
//! memory, each variant in a process of its own, interleaved round by round (issue 43 item 8,
//! issue 44 item 5):
//!
//! - `lora`: LoRA of rank 8 (`lora_alpha` 16, no dropout) on `q/k/v/o/gate/up/down_proj`
//!   ([`llama::finetune::lora_config`]), AdamW (lr 1e-3, weight decay 0.01) on the adapters only,
//!   batch 4 × 128; PyTorch's peer is `peft`'s `get_peft_model` with the same configuration;
//!   `lora-ckpt` the same after `gradient_checkpointing_enable()` (PyTorch's with
//!   `use_reentrant=False`): QLoRA's like-for-like float32 peer;
//! - `qlora`: the same over a `q4_0` base, quantized on the way in
//!   (`LlamaForCausalLM::from_pretrained_quantized(dir, device, "**", q4_0)`: the float32 model is
//!   never resident; ours only: PyTorch has no CPU `q4_0`), and `qlora-ckpt` with
//!   `gradient_checkpointing_enable()` too (as PEFT's QLoRA recipe trains);
//! - `full` and `full-ckpt`: every parameter trained, AdamW (lr 1e-5, weight decay 0.01), batch
//!   4 × 256, without and with `gradient_checkpointing_enable()` (PyTorch's with
//!   `use_reentrant=False`, as ours is).
//!
//! ```text
//! PYTORCH=/path/to/venv/bin/python cargo bench -p llama --bench train_step            # 2 rounds, 3 timed steps
//! PYTORCH=/path/to/venv/bin/python cargo bench -p llama --bench train_step -- 3 5      # 3 rounds, 5 timed steps
//! TRAIN_STEP_VARIANTS=lora,qlora cargo bench -p llama --bench train_step              # some variants
//! ```
//!
//! The weights are the same on both sides: the decode benchmark's checkpoint (`$LLAMA_BENCH_DIR`,
//! default `smollm-135m-random` in the temp folder), which `pytorch_train_step.py make` saves there
//! when it is missing (the same seeded random model), read by `from_pretrained` on both sides; the adapters' `lora_A` are each side's own random draw
//! (`lora_B` is zero on both, so the first loss is the same). The batch is fixed token ids, the
//! same on both sides (`(7919 i + 13) mod vocab` over the batch's positions `i`), the loss
//! next-token cross-entropy over every position's logits (transformers' `labels=ids`), and the
//! first step's loss of each side is printed as a check. f32, CPU, 2 threads on both sides
//! (`RAYON_NUM_THREADS`, `torch.set_num_threads`).
//!
//! `MODULE_DEVICE=cuda:0` runs both sides on that GPU (each step ends with a device
//! synchronize, on both sides); the resident set is then the host's, and the parent also polls
//! `nvidia-smi` every 50 ms while each process runs: "gpu" is the device memory in use at its
//! highest, less what was in use before the process started (the CUDA context included, as for
//! PyTorch, whose caching allocator's reserve counts too).
//!
//! What each process measures, the same way on both sides: it loads the model, reads its peak
//! resident set so far (`VmHWM`, "load peak"), resets that peak to the current resident set
//! (`/proc/self/clear_refs` 5, Linux), reads the resident set ("before"), runs one warm-up step
//! and then the timed steps (forward, backward, optimizer step), and reads `VmHWM` again: the
//! **peak** reported is the process's whole resident set at its highest from the end of the load
//! to the end of the steps — model, optimizer state, gradients, activations, allocator and
//! library overhead, nothing subtracted. The step time is the median of the timed steps; the
//! processor time (user + system, both threads) per step is printed too. Ours runs with
//! [`reuse_freed_memory`](module_runtime::reuse_freed_memory) (the README's advice for
//! training). PyTorch's side is `pytorch_train_step.py` beside this file.
//!
//! `TRAIN_STEP_PLAIN_MALLOC=1` runs ours without `reuse_freed_memory` (glibc's defaults: large
//! blocks mapped and unmapped), to see what the heap's kept holes add to a peak.
//!
//! `TRAIN_STEP_ACCOUNT=1` adds an accounting (ours only), printed by each child to stderr: after
//! the first forward, the tensors the graph keeps alive (every node of `loss.sorted_nodes()`, each
//! storage counted once, views sharing their base's) grouped by shape, with the parameters apart
//! (what the backward's end holds beside the parameters' gradients); and the peak resident set of
//! each phase of the steps (forward, backward, optimizer: the peak reset as each starts).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use llama::finetune::lora_config;
use llama::LlamaForCausalLM;
use module_runtime::nn::loss::linear_cross_entropy;
use module_runtime::nn::peft::get_peft_model;
use module_runtime::nn::CrossEntropyLoss;
use module_runtime::optim::{AdamW, Optimizer as _};
use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Set in the processes the benchmark starts: the variant to run.
const VARIANT: &str = "TRAIN_STEP_VARIANT";
/// The variants, with the batch each runs and whether PyTorch has a peer.
const VARIANTS: [(&str, usize, usize, bool); 6] = [
    ("lora", 4, 128, true),
    ("lora-ckpt", 4, 128, true),
    ("qlora", 4, 128, false),
    ("qlora-ckpt", 4, 128, false),
    ("full", 4, 256, true),
    ("full-ckpt", 4, 256, true),
];

/// What one process measured.
#[derive(Clone, Copy, Debug)]
struct Figures {
    median: Duration,
    cpu: Duration,
    load_peak_mib: f64,
    peak_mib: f64,
    before_mib: f64,
    first_loss: f64,
    /// On a GPU: the device memory in use at its highest while the process ran (`nvidia-smi`).
    gpu_peak_mib: Option<f64>,
}

fn main() -> AnyResult<()> {
    let numbers: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let rounds = numbers.first().copied().unwrap_or(2);
    let steps = numbers.get(1).copied().unwrap_or(3).max(1);
    let dir = std::env::var_os("LLAMA_BENCH_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("smollm-135m-random"));
    if let Ok(variant) = std::env::var(VARIANT) {
        let &(_, batch, seq, _) = VARIANTS
            .iter()
            .find(|v| v.0 == variant)
            .ok_or_else(|| format!("unknown variant {variant}"))?;
        return child(&dir, &variant, batch, seq, steps);
    }
    let pytorch = std::env::var_os("PYTORCH").map(PathBuf::from);
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/pytorch_train_step.py");
    if !dir.join("model.safetensors").exists() {
        let Some(python) = &pytorch else {
            return Err(format!(
                "no checkpoint in {}: set PYTORCH (it makes it) or run the decode benchmark",
                dir.display()
            )
            .into());
        };
        let status = Command::new(python)
            .arg(&script)
            .arg(&dir)
            .args(["make", "0", "0", "0"])
            .status()?;
        if !status.success() {
            return Err(format!("{} failed to make the checkpoint", script.display()).into());
        }
    }
    let chosen = std::env::var("TRAIN_STEP_VARIANTS").ok();
    let variants: Vec<_> = VARIANTS
        .iter()
        .filter(|v| {
            chosen
                .as_deref()
                .is_none_or(|c| c.split(',').any(|n| n == v.0))
        })
        .copied()
        .collect();
    let threads = std::env::var("RAYON_NUM_THREADS").unwrap_or_else(|_| "2".to_owned());
    println!(
        "{rounds} rounds, {steps} timed steps per process (after 1 warm-up step), {threads} threads; \
         checkpoint {}",
        dir.display()
    );
    // (variant, side) -> the figures of each round.
    let mut all: Vec<((&str, &str), Vec<Figures>)> = Vec::new();
    let mut record = |key: (&'static str, &'static str), f: Figures| {
        match all.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => v.push(f),
            None => all.push((key, vec![f])),
        }
        println!(
            "  {:>9} {:>7}: step {:8.0} ms ({:8.0} ms processor), peak {:6.0} MiB, {:6.0} MiB before \
             the steps, load peak {:6.0} MiB, first loss {:.4}{}",
            key.0,
            key.1,
            ms(f.median),
            ms(f.cpu),
            f.peak_mib,
            f.before_mib,
            f.load_peak_mib,
            f.first_loss,
            f.gpu_peak_mib
                .map(|g| format!(", gpu {g:.0} MiB"))
                .unwrap_or_default()
        );
    };
    for round in 0..rounds {
        println!("round {}", round + 1);
        for &(name, batch, seq, peer) in &variants {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(std::env::args().skip(1))
                .env(VARIANT, name)
                .env("RAYON_NUM_THREADS", &threads);
            record((name, "ours"), run(cmd, name)?);
            if let (true, Some(python)) = (peer, &pytorch) {
                let mut cmd = Command::new(python);
                cmd.arg(&script).arg(&dir).arg(name);
                cmd.args([batch, seq, steps].map(|n| n.to_string()));
                record((name, "pytorch"), run(cmd, name)?);
            }
        }
    }
    println!("summary (range over the rounds):");
    for ((name, side), figures) in &all {
        let range = |f: &dyn Fn(&Figures) -> f64| {
            let v: Vec<f64> = figures.iter().map(f).collect();
            let lo = v.iter().copied().fold(f64::INFINITY, f64::min);
            let hi = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            format!("{lo:.0}-{hi:.0}")
        };
        let gpu = match figures[0].gpu_peak_mib {
            Some(_) => format!(
                ", gpu {:>11} MiB",
                range(&|f| f.gpu_peak_mib.unwrap_or(f64::NAN))
            ),
            None => String::new(),
        };
        println!(
            "  {name:>9} {side:>7}: step {:>13} ms, processor {:>13} ms, peak {:>11} MiB{gpu}",
            range(&|f| ms(f.median)),
            range(&|f| ms(f.cpu)),
            range(&|f| f.peak_mib),
        );
    }
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The device memory in use on GPU 0, in MiB, as `nvidia-smi` reads it.
fn gpu_used_mib() -> Option<f64> {
    let out = Command::new("nvidia-smi")
        .args([
            "--query-gpu=memory.used",
            "--format=csv,noheader,nounits",
            "-i",
            "0",
        ])
        .output()
        .ok()?;
    String::from_utf8_lossy(&out.stdout).trim().parse().ok()
}

/// Runs one process and reads its `figures` line; on a GPU (`MODULE_DEVICE=cuda…`), with the
/// device memory it took at its highest.
fn run(mut cmd: Command, name: &str) -> AnyResult<Figures> {
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    let on_gpu = std::env::var("MODULE_DEVICE").is_ok_and(|d| d.starts_with("cuda"));
    let done = Arc::new(AtomicBool::new(false));
    let poller = on_gpu.then(|| {
        let done = Arc::clone(&done);
        let base = gpu_used_mib().unwrap_or(0.0);
        std::thread::spawn(move || {
            let mut high = base;
            while !done.load(Ordering::Relaxed) {
                high = high.max(gpu_used_mib().unwrap_or(base));
                std::thread::sleep(Duration::from_millis(50));
            }
            high - base
        })
    });
    let out = cmd.output();
    done.store(true, Ordering::Relaxed);
    let gpu_peak_mib = poller.and_then(|p| p.join().ok());
    let out = out?;
    let text = String::from_utf8_lossy(&out.stdout);
    // Ours: the step's parts (mean over the warm-up and timed steps).
    for line in String::from_utf8_lossy(&out.stderr).lines() {
        if line.contains("mean forward") || line.starts_with("account:") {
            println!("    {line}");
        }
    }
    let figures = parse(&text).ok_or_else(|| {
        format!(
            "the {name} process failed: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
        .into()
    });
    figures.map(|f| Figures { gpu_peak_mib, ..f })
}

/// The line a process prints: `figures MEDIAN_NS CPU_NS LOAD_PEAK PEAK BEFORE LOSS`.
fn parse(text: &str) -> Option<Figures> {
    let line = text.lines().find_map(|l| l.strip_prefix("figures "))?;
    let mut parts = line.split_whitespace();
    let mut next = || parts.next()?.parse::<f64>().ok();
    Some(Figures {
        median: Duration::from_nanos(next()? as u64),
        cpu: Duration::from_nanos(next()? as u64),
        load_peak_mib: next()?,
        peak_mib: next()?,
        before_mib: next()?,
        first_loss: next()?,
        gpu_peak_mib: None,
    })
}

/// The benchmark's batch: `[batch, seq]` token ids, and the next-token labels of every
/// position, flattened (`i64`), the last of each row -100 (transformers pads the labels so, rather
/// than copying the logits without their last position).
fn batch_ids(batch: usize, seq: usize, vocab: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..batch * seq)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let labels: Vec<i64> = (0..batch * seq)
        .map(|i| match (i + 1) % seq {
            0 => -100,
            _ => i64::from(ids[i + 1]),
        })
        .collect();
    let n = labels.len();
    Ok((
        Tensor::from_vec(ids, (batch, seq), device)?,
        Tensor::from_vec(labels, n, device)?,
    ))
}

/// One variant's process: load, set up, reset the peak, warm up, time the steps, print the
/// figures.
fn child(dir: &Path, variant: &str, batch: usize, seq: usize, steps: usize) -> AnyResult<()> {
    if std::env::var_os("TRAIN_STEP_PLAIN_MALLOC").is_none() {
        module_runtime::reuse_freed_memory();
    }
    let device = candle_module::device_from_env()?;
    // QLoRA's base is quantized on the way in: the float32 model is never resident.
    let mut model = if variant.starts_with("qlora") {
        LlamaForCausalLM::from_pretrained_quantized(dir, &device, "**", GgmlDType::Q4_0)?.0
    } else {
        LlamaForCausalLM::from_pretrained(dir, &device)?
    };
    let lr = match variant {
        "lora" | "lora-ckpt" | "qlora" | "qlora-ckpt" => {
            if variant.ends_with("-ckpt") {
                model.gradient_checkpointing_enable();
            }
            get_peft_model(&mut model, &lora_config(8))?;
            1e-3
        }
        _ => {
            if variant == "full-ckpt" {
                model.gradient_checkpointing_enable();
            }
            1e-5
        }
    };
    model.train();
    let mut opt = AdamW::new(&model, AdamW::options().lr(lr).weight_decay(0.01))?;
    let (ids, labels) = batch_ids(batch, seq, model.config.vocab_size, &device)?;
    let loss_fn = CrossEntropyLoss::new();
    // `TRAIN_STEP_LOSS=fused`: the head and its loss by blocks of the vocabulary
    // (`linear_cross_entropy`), never the whole logits; the default calls the model for them.
    let fused_loss = std::env::var("TRAIN_STEP_LOSS").is_ok_and(|v| v == "fused");
    let (_, load_peak) = candle_module::process_memory_mib();
    std::fs::write("/proc/self/clear_refs", "5")?;
    let (before, _) = candle_module::process_memory_mib();
    let mut parts = [Duration::ZERO; 3];
    let account = std::env::var_os("TRAIN_STEP_ACCOUNT").is_some();
    // With the accounting: the peak resident set of each phase (forward, backward, optimizer),
    // the most over the steps, each phase's peak reset as it starts.
    let mut phase_peaks = [0f64; 3];
    let mut phase_end = |i: usize| {
        if account {
            let (_, peak) = candle_module::process_memory_mib();
            phase_peaks[i] = phase_peaks[i].max(peak);
            let _ = std::fs::write("/proc/self/clear_refs", "5");
        }
    };
    let mut accounted = false;
    let mut step = || -> AnyResult<(Duration, f32)> {
        let start = Instant::now();
        let loss = if fused_loss {
            linear_cross_entropy(&model.hidden_states(&ids)?, &model.lm_head, &labels, -100)?
        } else {
            let logits = model.call(&ids)?;
            let (b, t, vocab) = logits.dims3()?;
            let logits = logits.reshape((b * t, vocab))?;
            loss_fn.call((&logits, &labels))?
        };
        let value = loss.to_scalar::<f32>()?;
        let forward = start.elapsed();
        if account && !std::mem::replace(&mut accounted, true) {
            account_graph(&loss);
        }
        phase_end(0);
        let grads = loss.backward()?;
        device.synchronize()?;
        phase_end(1);
        // The graph (every activation) hangs from the loss: dropped before the optimizer's step,
        // as PyTorch frees it during the backward.
        drop(loss);
        let backward = start.elapsed();
        opt.step(&grads)?;
        drop(grads);
        device.synchronize()?;
        phase_end(2);
        let whole = start.elapsed();
        for (sum, part) in parts
            .iter_mut()
            .zip([forward, backward - forward, whole - backward])
        {
            *sum += part;
        }
        Ok((whole, value))
    };
    let (_, first) = step()?;
    let cpu_start = candle_module::process_cpu_time()?;
    let mut times = (0..steps)
        .map(|_| step().map(|s| s.0))
        .collect::<AnyResult<Vec<_>>>()?;
    let cpu = (candle_module::process_cpu_time()? - cpu_start) / steps as u32;
    let (_, mut peak) = candle_module::process_memory_mib();
    if account {
        let [f, b, o] = phase_peaks;
        eprintln!("account: peak by phase (most over the steps): forward {f:.0}, backward {b:.0}, optimizer {o:.0} MiB");
        peak = f.max(b).max(o);
    }
    times.sort();
    let [f, b, o] = parts.map(|p| ms(p) / (steps + 1) as f64);
    eprintln!("{variant}: mean forward {f:.0} ms, backward {b:.0} ms, optimizer {o:.0} ms");
    println!(
        "figures {} {} {load_peak:.1} {peak:.1} {before:.1} {first:.6}",
        times[times.len() / 2].as_nanos(),
        cpu.as_nanos()
    );
    Ok(())
}

/// The bytes the graph behind `loss` keeps alive, by shape (each storage once), printed to
/// stderr: the activations a step holds until its backward returns.
fn account_graph(loss: &Tensor) {
    use std::collections::{BTreeMap, HashSet};
    let nodes = loss.sorted_nodes();
    let address = |t: &Tensor| &*t.storage_and_layout().0 as *const _ as usize;
    // The parameters' storages first: their transposed views are no activations.
    let mut seen = HashSet::new();
    let mut params = 0;
    for node in nodes.iter().filter(|n| n.is_variable()) {
        if seen.insert(address(node)) {
            params += node.elem_count() * node.dtype().size_in_bytes();
        }
    }
    // shape -> (storages, bytes) of the rest.
    let mut by_shape: BTreeMap<Vec<usize>, (usize, usize)> = BTreeMap::new();
    for node in &nodes {
        if !seen.insert(address(node)) {
            continue;
        }
        let entry = by_shape.entry(node.dims().to_vec()).or_default();
        entry.0 += 1;
        entry.1 += node.elem_count() * node.dtype().size_in_bytes();
    }
    let mib = |b: usize| b as f64 / (1 << 20) as f64;
    let mut rows: Vec<_> = by_shape.into_iter().collect();
    rows.sort_by_key(|(_, (_, bytes))| std::cmp::Reverse(*bytes));
    let activations: usize = rows.iter().map(|(_, (_, bytes))| bytes).sum();
    for (dims, (count, bytes)) in &rows {
        if mib(*bytes) >= 1.0 {
            eprintln!("account: {dims:?} x {count}: {:.1} MiB", mib(*bytes));
        }
    }
    eprintln!(
        "account: {} nodes; activations {:.1} MiB, parameters {:.1} MiB",
        nodes.len(),
        mib(activations),
        mib(params)
    );
}
