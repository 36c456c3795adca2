//! Pipeline-parallel training of a residual MLP: its blocks split over the ranks by path, GPipe or
//! 1F1B over micro-batches, AdamW on each rank's own stage (README, "Pipeline parallelism";
//! BENCHMARKS.md, "Pipeline parallelism").
//!
//! ```text
//! cargo build --release --features mpi --example pipeline_mlp
//! target/release/examples/pipeline_mlp                      # one process: the whole model
//! mpiexec -n 2 target/release/examples/pipeline_mlp         # 2 stages, half the blocks each
//! mpiexec -n 2 target/release/examples/pipeline_mlp --schedule 1f1b
//! ```
//!
//! Every run prints the time per step and a digest of the final weights of each half of the model
//! (the paths of the 2-stage split's stage 0 and stage 1): one process and both schedules on 2
//! ranks print the same digests, since the pipeline's training is bitwise one process's that
//! accumulates the same micro-batches. Each rank builds the model empty and loads only its
//! stage's weights (the same seeded values everywhere).

use std::time::Instant;

use clap::{Parser, ValueEnum};
use module_runtime::distributed::{
    init_from_env, PipelineSplit, PipelineStage, Schedule1F1B, ScheduleGPipe,
};
use module_runtime::optim::{Optimizer, ParamList};
use module_runtime::prelude::*;
use module_runtime::{build_empty, StateDict};

#[derive(Clone, Copy, ValueEnum)]
enum Schedule {
    Gpipe,
    #[value(name = "1f1b")]
    OneFOneB,
}

/// Trains a residual MLP, split over the ranks of the launch.
#[derive(Parser)]
struct Args {
    /// The pipeline schedule
    #[arg(long, value_enum, default_value_t = Schedule::Gpipe)]
    schedule: Schedule,
    /// Residual blocks (an even number: half on each of 2 stages)
    #[arg(long, value_name = "N", default_value_t = 8)]
    blocks: usize,
    /// Width of every block
    #[arg(long, value_name = "N", default_value_t = 512)]
    width: usize,
    /// Rows per batch
    #[arg(long, value_name = "N", default_value_t = 256)]
    batch: usize,
    /// Micro-batches per batch
    #[arg(long, value_name = "N", default_value_t = 8)]
    microbatches: usize,
    /// Optimizer steps (the first, a warm-up, is not timed)
    #[arg(long, value_name = "N", default_value_t = 6)]
    steps: usize,
}

#[derive(Module)]
struct Mlp {
    blocks: Vec<Linear>,
    head: Linear,
}

impl Mlp {
    fn new(args: &Args) -> Result<Mlp> {
        let dev = Device::Cpu;
        Ok(Mlp {
            blocks: (0..args.blocks)
                .map(|_| Linear::new(args.width, args.width, &dev))
                .collect::<Result<_>>()?,
            head: Linear::new(args.width, 1, &dev)?,
        })
    }

    /// Blocks `range`, then the head when `head`.
    fn run(&self, x: &Tensor, range: std::ops::Range<usize>, head: bool) -> Result<Tensor> {
        let mut h = x.clone();
        for block in &self.blocks[range] {
            h = (block.call(&h)?.tanh()? + &h)?;
        }
        if head {
            h = self.head.call(&h)?;
        }
        Ok(h)
    }
}

/// Seeded values in `[-0.5, 0.5) / sqrt(cols)`, the same on every rank.
fn seeded(seed: usize, dims: &[usize]) -> Result<Tensor> {
    let n: usize = dims.iter().product();
    let scale = 1.0 / (*dims.last().unwrap_or(&1) as f32).sqrt();
    let v: Vec<f32> = (0..n)
        .map(|i| ((((i * 7919 + seed * 104_729) % 10_007) as f32) / 10_007.0 - 0.5) * scale)
        .collect();
    Ok(Tensor::from_vec(v, dims, &Device::Cpu)?)
}

/// FNV-1a over the paths and the bits of their values.
fn digest(sd: &StateDict, paths: &[String]) -> Result<u64> {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |bytes: &[u8]| {
        for b in bytes {
            h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    for path in paths {
        eat(path.as_bytes());
        let value = sd.get(path).expect("a path of the model");
        for x in value.flatten_all()?.to_vec1::<f32>()? {
            eat(&x.to_bits().to_le_bytes());
        }
    }
    Ok(h)
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    let args = Args::parse();
    let comm = init_from_env()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    if world > 2 || args.blocks % 2 != 0 {
        return Err("run on 1 or 2 ranks, with an even number of blocks".into());
    }
    let half = args.blocks / 2;
    // The 2-stage split's paths, for the digests (and the split itself on 2 ranks).
    let stage_paths: [Vec<String>; 2] = [
        (0..half).map(|i| format!("blocks.{i}")).collect(),
        (half..args.blocks)
            .map(|i| format!("blocks.{i}"))
            .chain(["head".to_string()])
            .collect(),
    ];
    let (split, range, head) = if world == 2 {
        let range = if rank == 0 {
            0..half
        } else {
            half..args.blocks
        };
        (PipelineSplit::new(stage_paths.clone())?, range, rank == 1)
    } else {
        (PipelineSplit::new([["**"]])?, 0..args.blocks, true)
    };

    let model = build_empty(|| Mlp::new(&args))?;
    let stage = PipelineStage::new(&model, &split, &*comm, |x| {
        model.run(x, range.clone(), head)
    })?;
    let initial: StateDict = model
        .named_parameters()
        .iter()
        .enumerate()
        .filter(|(_, (path, _))| stage.paths().contains(path))
        .map(|(i, (path, p))| {
            // Unbuilt: the shape it will have.
            let dims = p.lazy_shape().and_then(|s| s.known()).unwrap_or_default();
            Ok((path.clone(), seeded(i, &dims)?))
        })
        .collect::<Result<Vec<_>>>()?
        .into_iter()
        .collect();
    stage.load_state_dict(&initial)?;
    let mut opt = AdamW::new(
        &ParamList(stage.named_parameters().to_vec()),
        AdamW::options().lr(1e-3),
    )?;

    let x = seeded(1, &[args.batch, args.width])?;
    let y = x.sum_keepdim(1)?.tanh()?;
    let mse = |out: &Tensor, t: &Tensor| -> Result<Tensor> { Ok((out - t)?.sqr()?.mean_all()?) };
    let (gpipe, one_f_one_b) = (
        ScheduleGPipe::new(&stage, args.microbatches, mse)?,
        Schedule1F1B::new(&stage, args.microbatches, mse)?,
    );
    let mut times = Vec::new();
    let mut last_loss = None;
    for _ in 0..args.steps {
        let start = Instant::now();
        let (input, target) = (
            stage.is_first().then_some(&x),
            stage.is_last().then_some(&y),
        );
        let step = match args.schedule {
            Schedule::Gpipe => gpipe.step(input, target)?,
            Schedule::OneFOneB => one_f_one_b.step(input, target)?,
        };
        opt.step(&step.grads)?;
        comm.barrier()?;
        times.push(start.elapsed().as_secs_f64() * 1e3);
        if let Some(l) = step.losses.first() {
            last_loss = Some(l.to_scalar::<f32>()?);
        }
    }
    let mut timed = times[1..].to_vec();
    timed.sort_by(f64::total_cmp);
    let median = timed.get(timed.len() / 2).copied().unwrap_or(f64::NAN);
    let sd = stage.state_dict()?;
    let name = match args.schedule {
        Schedule::Gpipe => "GPipe",
        Schedule::OneFOneB => "1F1B",
    };
    println!(
        "rank {rank} of {world} ({name}, {} micro-batches): median {median:.1} ms per step \
         over {} steps (min {:.1}, max {:.1})",
        args.microbatches,
        timed.len(),
        timed.first().copied().unwrap_or(f64::NAN),
        timed.last().copied().unwrap_or(f64::NAN),
    );
    for (s, paths) in stage_paths.iter().enumerate() {
        let mine: Vec<String> = model
            .named_parameters()
            .into_iter()
            .map(|(p, _)| p)
            .filter(|p| {
                paths
                    .iter()
                    .any(|prefix| p.starts_with(&format!("{prefix}.")))
            })
            .collect();
        if mine.iter().all(|p| stage.paths().contains(p)) {
            println!(
                "rank {rank}: weights of stage {s}'s paths: digest {:016x}",
                digest(&sd, &mine)?
            );
        }
    }
    if let Some(l) = last_loss {
        println!("rank {rank}: last step's first micro-batch loss {l}");
    }
    Ok(())
}
