//! The digits classifier of `train_digits`, trained data-parallel: PyTorch's
//! `DistributedDataParallel` + `DistributedSampler` workflow on `module_runtime::distributed`.
//!
//! ```text
//! cargo run --release --example ddp_digits                       # one process
//! cargo build --release --features mpi --example ddp_digits      # needs MPICH (see the README)
//! mpiexec -n 2 target/release/examples/ddp_digits                # two ranks over MPI
//! cargo build --release --features nccl --example ddp_digits     # CUDA toolkit + libnccl.so
//! torchrun --nproc-per-node 2 --no-python target/release/examples/ddp_digits  # two GPUs, NCCL
//! ```
//!
//! The model and batches live on `comm.device()`: the CPU for one process and MPI, `cuda:LOCAL_RANK`
//! under NCCL. The NCCL run is untested: no GPU was available to this project.
//!
//! Every rank builds the model with its own random initialization; `DistributedDataParallel`
//! checks that the ranks built the same parameters and copies rank 0's values to all. Each epoch,
//! the sampler gives every rank a disjoint share of the shuffled training set; a rank's batch is
//! `--batch-size / world size` examples, and the gradients are averaged over the ranks after each
//! backward pass, so one optimizer step sees the same global batch at any world size. At the end,
//! the ranks check that their parameters are bitwise equal, and rank 0 reports the test accuracy
//! and saves the checkpoint.

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::time::Instant;

use candle_module::{digits_path, DigitNet, Digits};
use candle_nn::Optimizer;
use clap::Parser;
use module_runtime::distributed::{
    init_from_env, DdpConfig, DistributedDataParallel, DistributedSampler, ReduceOp,
};
use module_runtime::prelude::*;

/// Train the digit classifier on every rank of an MPI job (or in one process).
#[derive(Parser)]
struct Args {
    /// Passes over the training set
    #[arg(long, value_name = "N", default_value_t = 30)]
    epochs: u64,
    /// AdamW learning rate
    #[arg(long, value_name = "LR", default_value_t = 3e-3)]
    lr: f64,
    /// Examples per optimizer step, over all ranks (a multiple of the world size)
    #[arg(long, value_name = "N", default_value = "32")]
    batch_size: NonZeroUsize,
    /// Seed of the sampler's shuffle, the same on every rank
    #[arg(long, default_value_t = 42)]
    seed: u64,
    /// Also time an all-reduce (average) of this many float32 values, 10 times, after training
    /// (22713216: the size of all-MiniLM-L6-v2's gradients)
    #[arg(long, value_name = "N")]
    allreduce_floats: Option<usize>,
    /// Where rank 0 saves the trained checkpoint
    #[arg(long, value_name = "PATH", default_value = "digits_ddp.safetensors")]
    out: PathBuf,
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // Freed tensors' memory reused by the next ones (see `reuse_freed_memory`).
    module_runtime::reuse_freed_memory();
    let args = Args::parse();
    let comm = init_from_env()?;
    let (rank, world) = (comm.rank(), comm.world_size());
    let batch_size = args.batch_size.get();
    if batch_size % world != 0 {
        return Err(format!("--batch-size {batch_size} is not a multiple of {world} ranks").into());
    }
    let local_batch = batch_size / world;
    let device = comm.device(); // cuda:LOCAL_RANK under NCCL, else the CPU
    let (train, test) = Digits::load(&digits_path())?.split(0.2, 42);

    let model = DigitNet::new(&device)?; // each rank draws its own values...
    let ddp = DistributedDataParallel::new(&model, &*comm, DdpConfig::default())?; // ...rank 0's win
    let mut opt = candle_nn::AdamW::new(
        model.trainable_vars()?,
        candle_nn::ParamsAdamW {
            lr: args.lr,
            ..Default::default()
        },
    )?;
    let mut sampler = DistributedSampler::for_collective(train.len(), &*comm)?
        .shuffle(true)
        .seed(args.seed);
    if ddp.is_main() {
        println!(
            "{} training examples on {world} rank(s) ({}): {} per rank per epoch, batches of \
             {local_batch} per rank ({batch_size} in all)",
            train.len(),
            comm.backend(),
            sampler.num_samples()
        );
    }

    let start = Instant::now();
    let (mut reducing, mut reductions) = (std::time::Duration::ZERO, 0u32);
    for epoch in 0..args.epochs {
        sampler.set_epoch(epoch); // a new shuffle each epoch, the same on every rank
        let mut total = 0.0;
        let indices = sampler.indices();
        let batches = indices.chunks(local_batch);
        let steps = batches.len();
        for batch in batches {
            let (x, y) = train.gather(batch, &device)?;
            let loss = candle_nn::loss::cross_entropy(&ddp.call(&x)?, &y)?;
            let mut grads = loss.backward()?;
            let reduce_start = Instant::now();
            ddp.reduce_gradients(&mut grads)?; // the mean over ranks, bucket by bucket
            reducing += reduce_start.elapsed();
            reductions += 1;
            opt.step(&grads)?;
            total += loss.to_scalar::<f32>()?;
        }
        if ddp.is_main() && ((epoch + 1) % 10 == 0 || epoch + 1 == args.epochs) {
            println!(
                "epoch {:3}: rank 0's mean loss {:.4}",
                epoch + 1,
                total / steps as f32
            );
        }
    }
    let train_time = start.elapsed();

    // The ranks must hold the same parameters: compare each rank's sum with the mean of all.
    for (path, p) in model.named_parameters() {
        let mine = p.tensor()?.to_dtype(DType::F64)?.sum_all()?.reshape(1)?;
        let mean = mine.copy()?;
        comm.all_reduce(&mean, ReduceOp::Avg)?;
        let (mine, mean) = (mine.to_vec1::<f64>()?[0], mean.to_vec1::<f64>()?[0]);
        if (mine - mean).abs() > 1e-9 * mine.abs().max(1.0) {
            return Err(format!("rank {rank}: `{path}` differs from the other ranks'").into());
        }
    }

    if ddp.is_main() {
        println!(
            "trained {} epochs in {:.1}s on {world} rank(s): train accuracy {:.2}%, test accuracy \
             {:.2}%; parameters equal on every rank; gradient all-reduce {:.1} µs a step",
            args.epochs,
            train_time.as_secs_f64(),
            100.0 * model.accuracy(&train, &device)?,
            100.0 * model.accuracy(&test, &device)?,
            reducing.as_secs_f64() * 1e6 / f64::from(reductions.max(1)),
        );
        model.save_safetensors(&args.out)?; // names as the model's: no `module.` prefix
        println!("rank 0 saved {}", args.out.display());
    }
    if let Some(n) = args.allreduce_floats {
        let values = Tensor::ones(n, DType::F32, &device)?;
        let mut times = Vec::new();
        for _ in 0..10 {
            ddp.barrier()?; // time the transfer, not a rank arriving late
            let start = Instant::now();
            comm.all_reduce(&values, ReduceOp::Avg)?;
            device.synchronize()?; // a GPU engine may only have enqueued it
            times.push(start.elapsed().as_secs_f64());
        }
        times.sort_by(f64::total_cmp);
        if ddp.is_main() {
            println!(
                "all-reduce (average) of {n} float32 values ({:.1} MiB) over {world} rank(s): \
                 median {:.3} ms, min {:.3} ms (10 runs)",
                n as f64 * 4.0 / (1 << 20) as f64,
                times[5] * 1e3,
                times[0] * 1e3
            );
        }
    }
    ddp.barrier()?;
    Ok(())
}
