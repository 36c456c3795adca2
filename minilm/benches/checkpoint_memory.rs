//! The MiniLM fine-tuning step of `train_step` (train mode, dropout on, mean-pooled loss, AdamW
//! with lr 1e-5) with and without every encoder layer checkpointed
//! (`gradient_checkpointing_enable()`): the peak resident memory of the step and its time, each
//! measured in a process of its own so that the peaks (`VmHWM`) do not mix (issue 44, item 5).
//!
//! ```text
//! cargo bench -p minilm --bench checkpoint_memory                 # batch 8 x 25, 8 steps
//! cargo bench -p minilm --bench checkpoint_memory -- 8 32 128     # 8 steps of batch 32 x 128
//! ```
//!
//! The numeric arguments are the steps per process, the batch and the sequence length. Each
//! process loads the model, runs two warm-up steps, resets its peak (`/proc/self/clear_refs`),
//! runs the steps and reports the median step time, the peak resident set over the steps
//! (`VmHWM`) and the resident set before them. Two kinds of process, per variant:
//!
//! - memory: glibc returns every freed block of 64 KiB or more to the system
//!   (`GLIBC_TUNABLES=glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=65536`), so
//!   the resident set before the steps is the model and the optimizer's state at rest, and the
//!   peak less it is what the step itself holds at its fullest (gradients, activations,
//!   temporaries);
//! - time: freed memory reused (`reuse_freed_memory`, as the other benchmarks and the README's
//!   advice), run twice per variant, alternating; the better median of the two is reported.

use std::process::Command;
use std::time::{Duration, Instant};

use minilm::bert::{BertConfig, BertModel};
use minilm::minilm_dir;
use module_runtime::optim::{AdamW, Optimizer as _};
use module_runtime::prelude::*;

#[path = "support/mod.rs"]
mod support;

/// Set in the processes the benchmark starts: which variant to run.
const VARIANT: &str = "CHECKPOINT_MEMORY_VARIANT";
/// Set in the processes that measure memory (freed memory not reused).
const MEMORY: &str = "CHECKPOINT_MEMORY_PEAK";

/// What one process measured.
#[derive(Clone, Copy, Debug)]
struct Figures {
    median: Duration,
    /// Processor time (user and system, all threads) per step: less disturbed than the wall
    /// time by other work on a busy machine.
    cpu: Duration,
    peak_mib: f64,
    before_mib: f64,
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let numbers: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let steps = numbers.first().copied().unwrap_or(8);
    let batch = numbers.get(1).copied().unwrap_or(8);
    let seq = numbers.get(2).copied().unwrap_or(25);
    if let Ok(variant) = std::env::var(VARIANT) {
        return child(&variant, steps, batch, seq);
    }
    if minilm_dir().is_none() {
        eprintln!("*** SKIPPED: no all-MiniLM-L6-v2 checkpoint (set MINILM_DIR) ***");
        return Ok(());
    }
    let run =
        |variant: &str, memory: bool| -> std::result::Result<Figures, Box<dyn std::error::Error>> {
            let mut cmd = Command::new(std::env::current_exe()?);
            cmd.args(std::env::args().skip(1)).env(VARIANT, variant);
            if memory {
                cmd.env(MEMORY, "1").env(
                    "GLIBC_TUNABLES",
                    "glibc.malloc.mmap_threshold=65536:glibc.malloc.trim_threshold=65536",
                );
            }
            let out = cmd.output()?;
            let text = String::from_utf8_lossy(&out.stdout);
            let figures = parse(&text).ok_or_else(|| {
                format!(
                    "the {variant} process failed: {text}{}",
                    String::from_utf8_lossy(&out.stderr)
                )
            })?;
            eprintln!(
            "{variant:>12} ({}): step median {:7.1} ms ({:6.1} ms processor), peak {:6.1} MiB, \
             {:6.1} MiB before the steps",
            if memory { "memory" } else { "time" },
            ms(figures.median),
            ms(figures.cpu),
            figures.peak_mib,
            figures.before_mib
        );
            Ok(figures)
        };
    let plain = run("plain", true)?;
    let checkpointed = run("checkpointed", true)?;
    let (mut times, mut cpu) = ([Duration::MAX; 2], [Duration::MAX; 2]);
    for _ in 0..2 {
        for (i, variant) in ["plain", "checkpointed"].into_iter().enumerate() {
            let figures = run(variant, false)?;
            times[i] = times[i].min(figures.median);
            cpu[i] = cpu[i].min(figures.cpu);
        }
    }
    let own = |f: Figures| f.peak_mib - f.before_mib;
    println!(
        "MiniLM step, batch {batch} x {seq}, {steps} steps per process:\n\
         \x20 step's peak over the model and optimizer at rest: plain {:6.1} MiB, checkpointed {:6.1} MiB: {:.2}x\n\
         \x20 process's peak resident set:                      plain {:6.1} MiB, checkpointed {:6.1} MiB: {:.2}x\n\
         \x20 step time (median, better of two processes):      plain {:6.1} ms,  checkpointed {:6.1} ms:  {:.2}x\n\
         \x20 processor time per step (better of two):         plain {:6.1} ms,  checkpointed {:6.1} ms:  {:.2}x",
        own(plain),
        own(checkpointed),
        own(checkpointed) / own(plain),
        plain.peak_mib,
        checkpointed.peak_mib,
        checkpointed.peak_mib / plain.peak_mib,
        ms(times[0]),
        ms(times[1]),
        times[1].as_secs_f64() / times[0].as_secs_f64(),
        ms(cpu[0]),
        ms(cpu[1]),
        cpu[1].as_secs_f64() / cpu[0].as_secs_f64(),
    );
    Ok(())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// The line a process prints: `median_ns cpu_ns peak_mib before_mib`.
fn parse(text: &str) -> Option<Figures> {
    let line = text.lines().find_map(|l| l.strip_prefix("figures "))?;
    let mut parts = line.split_whitespace();
    Some(Figures {
        median: Duration::from_nanos(parts.next()?.parse().ok()?),
        cpu: Duration::from_nanos(parts.next()?.parse().ok()?),
        peak_mib: parts.next()?.parse().ok()?,
        before_mib: parts.next()?.parse().ok()?,
    })
}

/// One variant's process: load, warm up, reset the peak, run the steps, print the figures.
fn child(
    variant: &str,
    steps: usize,
    batch: usize,
    seq: usize,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    if std::env::var_os(MEMORY).is_none() {
        module_runtime::reuse_freed_memory();
    }
    support::threads_and_rounds(0);
    let dir = minilm_dir().ok_or("no all-MiniLM-L6-v2 checkpoint")?;
    let device = Device::Cpu;
    let model = BertModel::new(&BertConfig::minilm_l6(), &device)?;
    model.load_state_dict(dir.join("model.safetensors"), &LoadOptions::default())?;
    model.train();
    if variant == "checkpointed" {
        model.gradient_checkpointing_enable();
    }
    let mut opt = AdamW::new(&model, AdamW::options().lr(1e-5))?;
    let (ids, mask) = support::batch(batch, seq, &device)?;
    let mask_f = mask.to_dtype(DType::F32)?.unsqueeze(2)?;
    let v = ((Tensor::arange(0u32, 384, &device)?.to_dtype(DType::F32)? / 384.0)? - 0.5)?;
    let mut step = || -> std::result::Result<Duration, Box<dyn std::error::Error>> {
        let start = Instant::now();
        let hidden = model.call((&ids, &mask))?;
        let pooled = (hidden.broadcast_mul(&mask_f)?.sum(1)?
            / mask_f.sum(1)?.broadcast_as((batch, 384))?)?;
        let loss = pooled.broadcast_mul(&v)?.sum(1)?.sqr()?.mean_all()?;
        let grads = loss.backward()?;
        opt.step(&grads)?;
        Ok(start.elapsed())
    };
    step()?;
    step()?;
    // From here the kernel's peak (`VmHWM`) is the steps' (Linux 4.0 and later).
    std::fs::write("/proc/self/clear_refs", "5")?;
    let (before, _) = candle_module::process_memory_mib();
    let cpu_start = candle_module::process_cpu_time()?;
    let mut times = (0..steps.max(1))
        .map(|_| step())
        .collect::<std::result::Result<Vec<_>, _>>()?;
    let cpu = (candle_module::process_cpu_time()? - cpu_start) / times.len() as u32;
    let (_, peak) = candle_module::process_memory_mib();
    times.sort();
    println!(
        "figures {} {} {peak} {before}",
        times[times.len() / 2].as_nanos(),
        cpu.as_nanos()
    );
    Ok(())
}
