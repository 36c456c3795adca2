//! Per-rank peak memory of a full fine-tuning step of a model with SmolLM-135M's parameters, under
//! data parallelism (`--zero 0`), ZeRO stages 1 and 2 (`ZeroRedundancyOptimizer`) and stage 3
//! (`FullyShardedDataParallel`, each of the 30 layers a unit: `auto_wrap_policy(["layers.*"])`)
//! (BENCHMARKS.md, "ZeRO").
//!
//! ```text
//! cargo build --release --features mpi --example zero_memory
//! for z in 0 1 2 3; do mpiexec -n 2 target/release/examples/zero_memory --zero $z; done
//! ```
//!
//! The model has SmolLM-135M's parameters, shape for shape (134.5 M, float32: a tied 49152 × 576
//! embedding, 30 layers of `q_proj`/`k_proj`/`v_proj`/`o_proj` and `gate_proj`/`up_proj`/
//! `down_proj` without biases; the 61 norm vectors are left out), randomly initialized. Its
//! forward uses every matrix (residual blocks, a SwiGLU MLP, the tied output projection and a
//! cross-entropy over the vocabulary), but not Llama's attention or positions: what the
//! measurement is about is the memory of the parameters, gradients and AdamW state, which is
//! the same. Each rank prints its resident set after building the model, and its peak (`VmHWM`)
//! over `--steps` steps of AdamW on `--tokens` tokens.

use std::rc::Rc;
use std::time::Instant;

use clap::Parser;
use module_runtime::distributed::{
    init_from_env, Collective, DdpConfig, DistributedDataParallel, ReduceOp,
};
use module_runtime::nn::Embedding;
use module_runtime::optim::{
    FsdpConfig, FullyShardedDataParallel, ZeroRedundancyOptimizer, ZeroStage,
};
use module_runtime::prelude::*;

/// A SmolLM-135M-sized fine-tuning step on every rank.
#[derive(Parser)]
struct Args {
    /// ZeRO stage: 0 data parallelism, 1 optimizer state sharded, 2 and gradients, 3 and
    /// parameters (FullyShardedDataParallel)
    #[arg(long, value_name = "STAGE", default_value_t = 0)]
    zero: u8,
    /// Optimizer steps
    #[arg(long, value_name = "N", default_value_t = 3)]
    steps: usize,
    /// Tokens per rank per step
    #[arg(long, value_name = "N", default_value_t = 32)]
    tokens: usize,
    /// Print rank 0's resident memory and peak after each forward, backward and optimizer step
    #[arg(long)]
    phases: bool,
}

/// With `--phases`, rank 0's resident memory and peak so far, after `what` of step `step`.
fn phase(args: &Args, rank: usize, step: usize, what: &str) {
    if args.phases && rank == 0 {
        println!(
            "step {step} after the {what}: resident {:.0} MiB, peak {:.0} MiB",
            status_mib("VmRSS:"),
            status_mib("VmHWM:")
        );
    }
}

#[derive(Module)]
struct Layer {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
}

#[derive(Module)]
struct SmolShaped {
    embed_tokens: Embedding,
    layers: Vec<Layer>,
}

const HIDDEN: usize = 576;
const KV: usize = 192;
const INTERMEDIATE: usize = 1536;
const VOCAB: usize = 49152;

impl SmolShaped {
    fn new(device: &Device) -> Result<Self> {
        let layers = (0..30)
            .map(|_| {
                Ok(Layer {
                    q_proj: Linear::no_bias(HIDDEN, HIDDEN, device)?,
                    k_proj: Linear::no_bias(HIDDEN, KV, device)?,
                    v_proj: Linear::no_bias(HIDDEN, KV, device)?,
                    o_proj: Linear::no_bias(HIDDEN, HIDDEN, device)?,
                    gate_proj: Linear::no_bias(HIDDEN, INTERMEDIATE, device)?,
                    up_proj: Linear::no_bias(HIDDEN, INTERMEDIATE, device)?,
                    down_proj: Linear::no_bias(INTERMEDIATE, HIDDEN, device)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(SmolShaped {
            embed_tokens: Embedding::new(VOCAB, HIDDEN, device)?,
            layers,
        })
    }
}

impl Forward<&Tensor> for Layer {
    type Output = Tensor;

    /// A residual block over every matrix, then a SwiGLU MLP.
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let kv = (self.k_proj.call(x)? * self.v_proj.call(x)?)?;
        let mixed = (self.q_proj.call(x)? + Tensor::cat(&[&kv, &kv, &kv], D::Minus1)?)?;
        let x = (x + self.o_proj.call(&mixed.tanh()?)?)?;
        let gate = candle_nn::ops::silu(&self.gate_proj.call(&x)?)?;
        Ok((&x + self.down_proj.call(&(gate * self.up_proj.call(&x)?)?)?)?)
    }
}

impl Forward<&Tensor> for SmolShaped {
    type Output = Tensor;

    /// `[tokens]` ids → `[tokens, vocab]` logits.
    fn forward(&self, ids: &Tensor) -> Result<Tensor> {
        let mut x = self.embed_tokens.call(ids)?;
        for l in &self.layers {
            x = l.call(&x)?;
        }
        let w = self.embed_tokens.weight.tensor()?;
        Ok(x.matmul(&w.t()?)?)
    }
}

/// `VmRSS` or `VmHWM` of this process, in MiB.
fn status_mib(field: &str) -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse::<f64>().ok()
        })
        .map_or(0.0, |kib| kib / 1024.0)
}

/// Every rank's `mine`, on every rank.
fn gather(comm: &dyn Collective, mine: f64) -> Result<Vec<f64>> {
    let mut slots = vec![0.0; comm.world_size()];
    slots[comm.rank()] = mine;
    let t = Tensor::new(slots.as_slice(), &comm.device())?;
    comm.all_reduce(&t, ReduceOp::Sum)?;
    Ok(t.to_vec1()?)
}

/// Step `step`'s `[tokens]` input ids and next-token targets on `rank`.
fn tokens(args: &Args, step: usize, rank: usize, device: &Device) -> Result<(Tensor, Tensor)> {
    let ids: Vec<u32> = (0..=args.tokens)
        .map(|i| ((i * 7919 + step * 104_729 + rank * 31) % VOCAB) as u32)
        .collect();
    let ids = Tensor::new(ids.as_slice(), device)?;
    Ok((
        ids.narrow(0, 0, args.tokens)?,
        ids.narrow(0, 1, args.tokens)?,
    ))
}

/// `--steps` steps of data parallelism or ZeRO stage 1 or 2: the resident memory after
/// building, and the seconds a step.
fn replicated(
    args: &Args,
    model: &SmolShaped,
    comm: &dyn Collective,
) -> std::result::Result<(f64, f64), Box<dyn std::error::Error>> {
    let stage = match args.zero {
        0 => None,
        n => Some(ZeroStage::from_number(n)?),
    };
    let device = comm.device();
    let ddp = DistributedDataParallel::new(model, comm, DdpConfig::default())?;
    let adamw = AdamW::new(model, AdamW::options().lr(1e-5))?;
    let (mut plain, mut zero) = match stage {
        None => (Some(adamw), None),
        Some(s) => (None, Some(ZeroRedundancyOptimizer::new(adamw, comm, s)?)),
    };
    let built = status_mib("VmRSS:");
    let start = Instant::now();
    for step in 0..args.steps {
        let (input, target) = tokens(args, step, comm.rank(), &device)?;
        let loss = candle_nn::loss::cross_entropy(&ddp.call(&input)?, &target)?;
        phase(args, comm.rank(), step, "forward");
        let mut grads = loss.backward()?;
        phase(args, comm.rank(), step, "backward");
        match (&mut plain, &mut zero) {
            (Some(opt), _) => {
                ddp.reduce_gradients(&mut grads)?;
                opt.step(&grads)?;
            }
            (_, Some(z)) => {
                z.reduce_gradients(&mut grads)?;
                z.step(&grads)?;
            }
            (None, None) => unreachable!("one optimizer is made above"),
        }
        phase(args, comm.rank(), step, "step");
    }
    Ok((
        built,
        start.elapsed().as_secs_f64() / args.steps.max(1) as f64,
    ))
}

/// `--steps` steps of ZeRO stage 3: the model sharded with each layer a unit.
fn fully_sharded(
    args: &Args,
    model: SmolShaped,
    comm: Rc<dyn Collective>,
) -> std::result::Result<(f64, f64), Box<dyn std::error::Error>> {
    let (rank, device) = (comm.rank(), comm.device());
    let config = FsdpConfig::default().auto_wrap_policy(["layers.*"]);
    let fsdp = FullyShardedDataParallel::new(model, comm, config)?;
    let mut adamw = AdamW::new(fsdp.module(), AdamW::options().lr(1e-5))?; // over the shards
    let built = status_mib("VmRSS:");
    let start = Instant::now();
    for step in 0..args.steps {
        let (input, target) = tokens(args, step, rank, &device)?;
        let loss = candle_nn::loss::cross_entropy(&fsdp.call(&input)?, &target)?;
        phase(args, rank, step, "forward");
        let grads = loss.backward()?; // shard gradients, already averaged over the ranks
        phase(args, rank, step, "backward");
        adamw.step(&grads)?;
        phase(args, rank, step, "step");
    }
    Ok((
        built,
        start.elapsed().as_secs_f64() / args.steps.max(1) as f64,
    ))
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // Freed tensors go back to the system at once, so VmHWM is the live peak, not the heap's
    // high-water mark after fragmentation (glibc otherwise raises its mmap threshold as large
    // blocks are freed, up to 32 MiB, and serves smaller tensors from the heap after that).
    module_runtime::return_freed_memory();
    let args = Args::parse();
    if args.zero > 3 {
        ZeroStage::from_number(args.zero)?; // the error naming the stages
    }
    let comm: Rc<dyn Collective> = init_from_env()?.into();
    let (rank, world) = (comm.rank(), comm.world_size());
    let model = SmolShaped::new(&comm.device())?;
    let count: usize = model.parameters().iter().map(|p| p.elem_count()).sum();
    let (built, per_step) = if args.zero == 3 {
        fully_sharded(&args, model, comm.clone())?
    } else {
        replicated(&args, &model, &*comm)?
    };
    let built = gather(&*comm, built)?;
    let peak = gather(&*comm, status_mib("VmHWM:"))?;
    let times = gather(&*comm, per_step)?;
    if rank == 0 {
        println!(
            "--zero {} on {world} rank(s), {:.1} M float32 parameters, {} tokens per rank, {} steps",
            args.zero,
            count as f64 / 1e6,
            args.tokens,
            args.steps
        );
        for r in 0..world {
            println!(
                "rank {r}: resident after building {:.0} MiB, peak (VmHWM) {:.0} MiB, {:.2} s a step",
                built[r], peak[r], times[r]
            );
        }
    }
    comm.barrier()?;
    Ok(())
}
