//! What backward hooks cost: one training step (forward, loss, backward) of an MLP of six
//! `Linear(256, 256)` + `ReLU` on a batch of 256, CPU float32, four ways, interleaved in blocks:
//! a plain `call`; under `Hooks::run` with an empty registry; with a global no-op forward hook;
//! with a global no-op full backward hook and pre-hook (every one of the 13 calls hooked: its
//! input and output go through identities, and the hooks fire in `backward`).
//!
//! The figure is the process's CPU time per step (user + system, from `/proc/self/stat`), which
//! other work on a shared machine disturbs less than wall time (printed too); run it on one thread
//! (`RAYON_NUM_THREADS=1`), or the CPU time counts the kernel pool's threads waiting for work.
//!
//! ```text
//! RAYON_NUM_THREADS=1 cargo run -p module-hooks --example backward_hook_cost --release
//! ```
//!
//! (or the dev profile with this crate optimized: `cargo run -p module-hooks --example
//! backward_hook_cost --config 'profile.dev.package.module-hooks.opt-level=3'`; candle's own
//! crates are optimized in the dev profile already).

use std::time::Instant;

use module_runtime::nn::{Linear, ReLU};
use module_runtime::prelude::*;

#[derive(Module)]
struct Mlp {
    layers: Vec<Linear>,
    act: ReLU,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = x.clone();
        for layer in &self.layers {
            h = self.act.call(&layer.call(&h)?)?;
        }
        Ok(h)
    }
}

/// The process's CPU time so far, in milliseconds (`utime + stime`, in 10 ms ticks).
fn cpu_ms() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").expect("Linux's /proc");
    let fields: Vec<&str> = stat[stat.rfind(')').unwrap() + 2..].split(' ').collect();
    let ticks = |i: usize| fields[i].parse::<f64>().unwrap();
    (ticks(11) + ticks(12)) * 10.0
}

fn main() -> Result<()> {
    module_runtime::reuse_freed_memory();
    let dev = Device::Cpu;
    let layers = (0..6).map(|_| Linear::new(256, 256, &dev));
    let model = Mlp {
        layers: layers.collect::<Result<_>>()?,
        act: ReLU::new(),
    };
    let x = Tensor::randn(0f32, 1., (256, 256), &dev)?;
    let empty = Hooks::new();
    let forward = Hooks::new();
    forward.register_global_forward_hook(|_, _, _| Ok(None), HookOptions::default());
    let backward = Hooks::new();
    let options = BackwardHookOptions::default();
    backward.register_global_full_backward_hook(|_, _, _| Ok(None), options);
    backward.register_global_full_backward_pre_hook(|_, _| Ok(None), options);
    let variants: [(&str, Option<&Hooks>); 4] = [
        ("plain call", None),
        ("run, empty registry", Some(&empty)),
        ("run, global no-op forward hook", Some(&forward)),
        (
            "run, global no-op backward hook + pre-hook",
            Some(&backward),
        ),
    ];
    let step = |hooks: Option<&Hooks>| -> Result<()> {
        let y = match hooks {
            None => model.call(&x)?,
            Some(hooks) => hooks.run(&model, |m| m.call(&x))?,
        };
        y.sqr()?.mean_all()?.backward()?;
        Ok(())
    };
    for (_, hooks) in &variants {
        for _ in 0..3 {
            step(*hooks)?;
        }
    }
    const BLOCK: usize = 25;
    const ROUNDS: usize = 6;
    let (mut cpu, mut wall) = ([0.0; 4], [0.0; 4]);
    for _ in 0..ROUNDS {
        for (i, (_, hooks)) in variants.iter().enumerate() {
            let (c, t) = (cpu_ms(), Instant::now());
            for _ in 0..BLOCK {
                step(*hooks)?;
            }
            wall[i] += t.elapsed().as_secs_f64() * 1e3;
            cpu[i] += cpu_ms() - c;
        }
    }
    let steps = (ROUNDS * BLOCK) as f64;
    for (i, (name, _)) in variants.iter().enumerate() {
        let (c, w) = (cpu[i] / steps, wall[i] / steps);
        println!("{name:44} CPU {c:6.2} ms/step   wall {w:6.2} ms/step");
    }
    Ok(())
}
