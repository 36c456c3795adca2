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
//! and saves the checkpoint. The optimizer is module-optim's AdamW (PyTorch's defaults).
//!
//! `--zero 1|2` shards the optimizer over the ranks with `ZeroRedundancyOptimizer` (ZeRO stage 1:
//! each rank keeps the AdamW state of its partition of the parameters; stage 2: and only its
//! partition's averaged gradients); `--zero 3` shards the parameters themselves with
//! `FullyShardedDataParallel` (PyTorch's FSDP `FULL_SHARD`, each of `fc1`, `fc2`, `head` a unit:
//! gathered for its forward and its backward, its gradient reduce-scattered, AdamW stepping the
//! shards); `--zero 0` (the default) is plain data parallelism. Every run prints each rank's peak
//! resident memory (`VmHWM`, measured right after training). A `--zero 1|2|3` run then trains
//! the `--zero 0` reference in the same process, from the same initial parameters over the same
//! batches, and compares the parameters: ZeRO's gradient sums, optimizer arithmetic and
//! all-gather are those of data parallelism, so they are bitwise equal (the check would accept a
//! difference within 1e-6 and say so; anything more is an error). At stage 3, rank 0 saves the
//! full state dict (gathered from the shards), the model file a single process loads.
//!
//! ```text
//! mpiexec -n 2 target/release/examples/ddp_digits --zero 2      # ZeRO stage 2 on two ranks
//! mpiexec -n 2 target/release/examples/ddp_digits --zero 3      # stage 3 (FSDP) on two ranks
//! ```

use std::num::NonZeroUsize;
use std::path::PathBuf;
use std::rc::Rc;
use std::time::{Duration, Instant};

use candle_module::{digits_path, DigitNet, Digits};
use clap::Parser;
use module_runtime::distributed::{
    init_from_env, Collective, DdpConfig, DistributedDataParallel, DistributedSampler, ReduceOp,
};
use module_runtime::optim::{
    FsdpConfig, FullyShardedDataParallel, ZeroRedundancyOptimizer, ZeroStage,
};
use module_runtime::prelude::*;
use module_runtime::{LoadOptions, StateDict};

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
    /// ZeRO stage: 0 plain data parallelism, 1 optimizer state sharded, 2 and gradients, 3 and
    /// parameters (FullyShardedDataParallel)
    #[arg(long, value_name = "STAGE", default_value_t = 0)]
    zero: u8,
    /// Also time an all-reduce (average) of this many float32 values, 10 times, after training
    /// (22713216: the size of all-MiniLM-L6-v2's gradients)
    #[arg(long, value_name = "N")]
    allreduce_floats: Option<usize>,
    /// Where rank 0 saves the trained checkpoint
    #[arg(long, value_name = "PATH", default_value = "digits_ddp.safetensors")]
    out: PathBuf,
}

/// This process's peak resident memory in KiB (`VmHWM` of `/proc/self/status`; 0 where there is
/// no such file).
fn peak_rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
            line.split_whitespace().nth(1)?.parse().ok()
        })
        .unwrap_or(0)
}

/// What a training run reports.
struct Trained {
    time: Duration,
    reducing: Duration,
    reductions: u32,
}

/// Trains `model` (already wrapped in `ddp`) with AdamW, sharded at `stage` (None: plain data
/// parallelism), printing rank 0's mean loss every 10 epochs when `verbose`.
fn train(
    args: &Args,
    ddp: &DistributedDataParallel<'_, DigitNet>,
    train: &Digits,
    stage: Option<ZeroStage>,
    verbose: bool,
) -> Result<Trained, Box<dyn std::error::Error>> {
    let comm = ddp.collective();
    let model = ddp.module();
    let adamw = AdamW::new(model, AdamW::options().lr(args.lr))?;
    let (mut plain, mut zero) = match stage {
        None => (Some(adamw), None),
        Some(stage) => (
            None,
            Some(ZeroRedundancyOptimizer::new(adamw, comm, stage)?),
        ),
    };
    let (mut reducing, mut reductions) = (Duration::ZERO, 0u32);
    let time = epochs(args, comm, train, verbose, |x, y| {
        let loss = candle_nn::loss::cross_entropy(&ddp.call(x)?, y)?;
        let mut grads = loss.backward()?;
        let reduce_start = Instant::now();
        match (&mut plain, &mut zero) {
            (Some(opt), _) => {
                ddp.reduce_gradients(&mut grads)?; // the mean over ranks, bucket by bucket
                reducing += reduce_start.elapsed();
                opt.step(&grads)?;
            }
            (_, Some(zero)) => {
                zero.reduce_gradients(&mut grads)?; // stage 2: this rank's partition only
                reducing += reduce_start.elapsed();
                zero.step(&grads)?; // its partition stepped, the parameters all-gathered
            }
            (None, None) => unreachable!("one optimizer is made above"),
        }
        reductions += 1;
        Ok(loss.to_scalar::<f32>()?)
    })?;
    Ok(Trained {
        time,
        reducing,
        reductions,
    })
}

/// Runs `args.epochs` epochs over this rank's share of `train` (a new shuffle each epoch, the same
/// on every rank): `step(x, y)` trains on one batch of `--batch-size / world size` examples and
/// returns its loss. With `verbose`, rank 0 prints its mean loss every 10 epochs. Returns the
/// time taken.
fn epochs(
    args: &Args,
    comm: &dyn Collective,
    train: &Digits,
    verbose: bool,
    mut step: impl FnMut(&Tensor, &Tensor) -> Result<f32, Box<dyn std::error::Error>>,
) -> Result<Duration, Box<dyn std::error::Error>> {
    let device = comm.device();
    let local_batch = args.batch_size.get() / comm.world_size();
    let mut sampler = DistributedSampler::for_collective(train.len(), comm)?
        .shuffle(true)
        .seed(args.seed);
    let start = Instant::now();
    for epoch in 0..args.epochs {
        sampler.set_epoch(epoch);
        let mut total = 0.0;
        let indices = sampler.indices();
        let batches = indices.chunks(local_batch);
        let count = batches.len();
        for batch in batches {
            let (x, y) = train.gather(batch, &device)?;
            total += step(&x, &y)?;
        }
        if verbose && comm.rank() == 0 && ((epoch + 1) % 10 == 0 || epoch + 1 == args.epochs) {
            println!(
                "epoch {:3}: rank 0's mean loss {:.4}",
                epoch + 1,
                total / count as f32
            );
        }
    }
    Ok(start.elapsed())
}

/// Prints every rank's peak resident memory (`peaks`, KiB by rank) at ZeRO stage `stage`.
fn print_peaks(stage: u8, peaks: &[u64]) {
    let peaks: Vec<String> = peaks
        .iter()
        .enumerate()
        .map(|(r, kib)| format!("rank {r} {:.1} MiB", *kib as f64 / 1024.0))
        .collect();
    println!(
        "peak resident memory (VmHWM) at --zero {stage}: {}",
        peaks.join(", ")
    );
}

/// The model's parameters as one flat `f32` vector.
fn flat_params(model: &DigitNet) -> Result<Vec<f32>> {
    let parts = model
        .parameters()
        .iter()
        .map(|p| Ok(p.tensor()?.flatten_all()?.to_dtype(DType::F32)?))
        .collect::<Result<Vec<_>>>()?;
    Ok(Tensor::cat(&parts, 0)?.to_vec1()?)
}

/// Every rank's value of `mine`, on every rank.
fn gather_u64(comm: &dyn Collective, mine: u64) -> Result<Vec<u64>> {
    let mut slots = vec![0f64; comm.world_size()];
    slots[comm.rank()] = mine as f64;
    let t = Tensor::new(slots.as_slice(), &comm.device())?;
    comm.all_reduce(&t, ReduceOp::Sum)?;
    Ok(t.to_vec1::<f64>()?.into_iter().map(|v| v as u64).collect())
}

/// Trains the `--zero 0` reference from `initial` (the same start, batches and AdamW, without
/// sharding) and compares its parameters with `ours`: bitwise, or within 1e-6 (said), or an error.
fn compare_with_reference(
    args: &Args,
    comm: &dyn Collective,
    train_set: &Digits,
    initial: &StateDict,
    ours: &[f32],
) -> Result<(), Box<dyn std::error::Error>> {
    let reference = DigitNet::new(&comm.device())?;
    reference.load_state_dict(initial, &LoadOptions::default())?;
    let ref_ddp = DistributedDataParallel::new(&reference, comm, DdpConfig::default())?;
    train(args, &ref_ddp, train_set, None, false)?;
    let theirs = flat_params(&reference)?;
    let bitwise = ours
        .iter()
        .zip(&theirs)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    let diff = ours
        .iter()
        .zip(&theirs)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    if comm.rank() == 0 {
        if bitwise {
            println!(
                "parameters bitwise equal to a --zero 0 run's (trained again in this process)"
            );
        } else {
            println!(
                "parameters within {diff:e} of a --zero 0 run's (not bitwise; the bound is 1e-6)"
            );
        }
    }
    if !bitwise && diff > 1e-6 {
        return Err(format!(
            "rank {}: {diff} away from the --zero 0 parameters",
            comm.rank()
        )
        .into());
    }
    Ok(())
}

/// `--zero 3`: the model sharded with `FullyShardedDataParallel` (each layer a unit), trained with
/// AdamW over the shards; then the same report as the other stages, rank 0 saving the full state
/// dict, and the comparison with the `--zero 0` reference.
fn fully_sharded(
    args: &Args,
    model: DigitNet,
    comm: Rc<dyn Collective>,
    train_set: &Digits,
    test: &Digits,
) -> Result<(), Box<dyn std::error::Error>> {
    let (rank, world) = (comm.rank(), comm.world_size());
    let device = comm.device();
    let local_batch = args.batch_size.get() / world;
    // Every layer a unit (`*`: the root's children); rank 0's initial values, sharded.
    let fsdp = FullyShardedDataParallel::new(
        model,
        comm.clone(),
        FsdpConfig::default().auto_wrap_policy(["*"]),
    )?;
    let initial = fsdp.state_dict()?; // gathered: the starting point of the reference run
    if rank == 0 {
        println!(
            "{} training examples on {world} rank(s) ({}): batches of {local_batch} per rank ({} in \
             all)",
            train_set.len(),
            comm.backend(),
            args.batch_size
        );
        println!(
            "ZeRO stage 3 (FullyShardedDataParallel, units {:?}): the parameters, gradients and \
             AdamW's state sharded over the ranks",
            fsdp.units()
        );
    }
    let mut opt = AdamW::new(fsdp.module(), AdamW::options().lr(args.lr))?; // over the shards
    let (mut backward, mut steps) = (Duration::ZERO, 0u32);
    let time = epochs(args, &*comm, train_set, true, |x, y| {
        let loss = candle_nn::loss::cross_entropy(&fsdp.call(x)?, y)?;
        let backward_start = Instant::now();
        // Each unit gathered again, its gradient reduce-scattered: shards, averaged.
        let grads = loss.backward()?;
        backward += backward_start.elapsed();
        opt.step(&grads)?;
        steps += 1;
        Ok(loss.to_scalar::<f32>()?)
    })?;
    let peaks = gather_u64(&*comm, peak_rss_kib())?;
    let accuracy = |data: &Digits| fsdp.summon_full_params(|m| Ok(m.accuracy(data, &device)?));
    let (train_accuracy, test_accuracy) = (accuracy(train_set)?, accuracy(test)?);
    let full = fsdp.state_dict()?; // FULL_STATE_DICT, on every rank
    if rank == 0 {
        println!(
            "trained {} epochs in {:.1}s on {world} rank(s): train accuracy {:.2}%, test accuracy \
             {:.2}%; parameters sharded over the ranks; backward (gathers and reduce-scatters \
             included) {:.1} µs a step",
            args.epochs,
            time.as_secs_f64(),
            100.0 * train_accuracy,
            100.0 * test_accuracy,
            backward.as_secs_f64() * 1e6 / f64::from(steps.max(1)),
        );
        print_peaks(3, &peaks);
        full.save_safetensors(&args.out)?; // the model file one process loads
        println!("rank 0 saved {} (the full state dict)", args.out.display());
    }
    let reference = DigitNet::new(&device)?;
    let ours: Vec<f32> = {
        let parts = reference
            .named_parameters()
            .iter()
            .map(|(path, _)| Ok(full.get(path).ok_or("a parameter missing")?.flatten_all()?))
            .collect::<Result<Vec<_>, Box<dyn std::error::Error>>>()?;
        Tensor::cat(&parts, 0)?.to_vec1()?
    };
    compare_with_reference(args, &*comm, train_set, &initial, &ours)?;
    comm.barrier()?;
    Ok(())
}

fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
    // Freed tensors' memory reused by the next ones (see `reuse_freed_memory`).
    module_runtime::reuse_freed_memory();
    let args = Args::parse();
    // Stages other than 0 to 3 are an error before anything starts.
    let stage = match args.zero {
        0 | 3 => None,
        n => Some(ZeroStage::from_number(n)?),
    };
    let comm: Rc<dyn Collective> = init_from_env()?.into();
    let (rank, world) = (comm.rank(), comm.world_size());
    let batch_size = args.batch_size.get();
    if batch_size % world != 0 {
        return Err(format!("--batch-size {batch_size} is not a multiple of {world} ranks").into());
    }
    let local_batch = batch_size / world;
    let device = comm.device(); // cuda:LOCAL_RANK under NCCL, else the CPU
    let (train_set, test) = Digits::load(&digits_path())?.split(0.2, 42);

    let model = DigitNet::new(&device)?; // each rank draws its own values...
    if args.zero == 3 {
        return fully_sharded(&args, model, comm, &train_set, &test);
    }
    // ...rank 0's values win.
    let ddp = DistributedDataParallel::new(&model, &*comm, DdpConfig::default())?;
    // The starting point, kept (copied) for the `--zero 0` reference run.
    let initial: StateDict = model
        .state_dict()?
        .iter()
        .map(|(k, t)| Ok((k.to_owned(), t.copy()?)))
        .collect::<Result<_>>()?;
    if ddp.is_main() {
        let sampler = DistributedSampler::for_collective(train_set.len(), &*comm)?;
        println!(
            "{} training examples on {world} rank(s) ({}): {} per rank per epoch, batches of \
             {local_batch} per rank ({batch_size} in all)",
            train_set.len(),
            comm.backend(),
            sampler.num_samples()
        );
        if let Some(stage) = stage {
            println!(
                "ZeRO stage {}: AdamW's state{} sharded over the ranks",
                stage.number(),
                if stage == ZeroStage::Two {
                    " and the gradients"
                } else {
                    ""
                }
            );
        }
    }

    let trained = train(&args, &ddp, &train_set, stage, true)?;
    let peaks = gather_u64(&*comm, peak_rss_kib())?;

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
            trained.time.as_secs_f64(),
            100.0 * model.accuracy(&train_set, &device)?,
            100.0 * model.accuracy(&test, &device)?,
            trained.reducing.as_secs_f64() * 1e6 / f64::from(trained.reductions.max(1)),
        );
        print_peaks(args.zero, &peaks);
        model.save_safetensors(&args.out)?; // names as the model's: no `module.` prefix
        println!("rank 0 saved {}", args.out.display());
    }

    if stage.is_some() {
        compare_with_reference(&args, &*comm, &train_set, &initial, &flat_params(&model)?)?;
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
