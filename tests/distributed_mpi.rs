//! Data-parallel training (and ZeRO, and tensor parallelism) across 2 processes over MPI
//! (`--features mpi`).
//!
//! `two_ranks_under_mpiexec` re-runs this test binary under `mpiexec -n 2`, selecting only
//! `mpi_rank` with `DDP_MPI_CHILD=1`; each rank checks its side and a failure exits non-zero,
//! which fails the parent. Without `mpiexec` on the `PATH` the parent prints a notice and passes.
//! Checked over MPI: ranks seeded differently agree after construction, 2 ranks on half batches
//! match one process on the full batch within 1e-6, parameters stay bitwise equal, a parameter
//! unused on one rank gets an agreed gradient, buffers follow rank 0, and a model built differently
//! on one rank is an error on both.
//!
//!
//! `zero_under_mpiexec` does the same for `zero_rank`: `ZeroRedundancyOptimizer` at stages 1 and
//! 2 (AdamW with groups, clipping, a schedule) ends bitwise where DDP does, and its consolidated
//! state, loaded with the model in one process, continues within 1e-6 of the 2-rank run.
//!
//! `pipeline_under_mpiexec` runs `pipeline_rank`: `send`/`recv` between the ranks, then a model
//! split over them by path (each rank building only its stage's weights) trained with GPipe and
//! 1F1B, bitwise equal to one process accumulating the same micro-batches.
//!
//! Run: `cargo test -p candle-module --features mpi --test distributed_mpi`
//! (needs MPICH: `apt-get install -y mpich libmpich-dev libclang-dev`).
#![cfg(feature = "mpi")]

use candle_core::backprop::GradStore;
use candle_nn::{Optimizer as _, SGD};
use module_runtime::distributed::Collective;
use module_runtime::distributed::{init_from_env, DdpConfig, DistributedDataParallel, ReduceOp};
use module_runtime::optim::{
    clip_grad_norm, AdamW, LambdaLr, LrScheduler, ParamGroups, ZeroRedundancyOptimizer, ZeroStage,
};
use module_runtime::prelude::*;
use module_runtime::StateDict;

mod support;
use support::values;

#[path = "distributed_mpi/pipeline.rs"]
mod pipeline;

#[derive(Module)]
struct Net {
    fc1: Linear,
    fc2: Linear,
    extra: Linear,
}

impl Net {
    fn new(seed: u64) -> Net {
        let lin = |s: u64, i: usize, o: usize| {
            Linear::from_tensors(
                values(s, &[o, i], &Device::Cpu),
                Some(values(s + 100, &[o], &Device::Cpu)),
            )
            .unwrap()
        };
        Net {
            fc1: lin(seed, 6, 8),
            fc2: lin(seed + 1, 8, 3),
            extra: lin(seed + 2, 6, 3),
        }
    }
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.tanh()?)
    }
}

/// A layer with a buffer, for buffer synchronization.
#[derive(Module)]
struct Counted {
    fc: Linear,
    seen: Buffer,
}

impl Forward<&Tensor> for Counted {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc.call(x)
    }
}

fn mse(out: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok((out - y)?.sqr()?.mean_all()?)
}

fn flat(model: &Net) -> Tensor {
    let ps: Vec<Tensor> = model
        .parameters()
        .iter()
        .map(|p| p.tensor().unwrap().flatten_all().unwrap())
        .collect();
    Tensor::cat(&ps, 0).unwrap()
}

#[test]
fn two_ranks_under_mpiexec() {
    under_mpiexec("mpi_rank");
}

#[test]
fn zero_under_mpiexec() {
    under_mpiexec("zero_rank");
}

#[test]
fn tensor_parallel_under_mpiexec() {
    under_mpiexec("tensor_parallel_rank");
}

#[test]
fn pipeline_under_mpiexec() {
    under_mpiexec("pipeline::pipeline_rank");
}

/// Tensor parallelism over MPI: `Net`'s `fc1` split by rows and `fc2` by columns
/// (`parallelize_module`, the engine's all-reduce summing `fc2`'s partial outputs) gives the
/// whole model's output within 1e-5 on both ranks.
#[test]
fn tensor_parallel_rank() -> AnyResult<()> {
    use module_runtime::distributed::Mpi;
    use module_runtime::nn::{parallelize_module, OutputReduce, ParallelStyle, TensorParallel};
    use std::sync::Arc;
    if std::env::var_os("DDP_MPI_CHILD").is_none() {
        return Ok(());
    }
    let comm: Arc<dyn Collective + Send + Sync> = Arc::new(Mpi::init()?);
    let whole = Net::new(5);
    let x = values(9, &[4, 6], &Device::Cpu);
    let want = module_runtime::without_grad(|| whole.call(&x))?;
    let mut split = Net::new(5);
    let c = comm.clone();
    let mesh = TensorParallel::new(
        comm.rank(),
        comm.world_size(),
        OutputReduce::new(move |t| c.all_reduce(t, ReduceOp::Sum)),
    );
    let plan = [
        ("fc1", ParallelStyle::Colwise),
        ("fc2", ParallelStyle::Rowwise),
    ];
    let sharded = parallelize_module(&mut split, &mesh, &plan)?;
    let got = module_runtime::without_grad(|| split.call(&x))?;
    let diff = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
    let ok = sharded == ["fc1", "fc2"] && split.fc1.out_features() == 4 && diff < 1e-5;
    agree(
        &*comm,
        ok,
        &format!("tensor-parallel output differs by {diff}"),
    )?;
    println!("rank ok");
    Ok(())
}

/// Runs the test `child` of this binary on 2 MPI ranks; each must print `rank ok`.
fn under_mpiexec(child: &str) {
    if std::env::var_os("DDP_MPI_CHILD").is_some() {
        return;
    }
    let Ok(mpiexec) = which("mpiexec") else {
        eprintln!("mpiexec not found: skipping the 2-rank MPI test");
        return;
    };
    let out = std::process::Command::new(mpiexec)
        .args(["-n", "2"])
        .arg(std::env::current_exe().unwrap())
        .args([child, "--exact", "--nocapture", "--test-threads=1"])
        // A rank that fails leaves the other waiting in a collective: MPICH's Hydra ends the
        // job after this many seconds.
        .env("MPIEXEC_TIMEOUT", "900")
        .env("DDP_MPI_CHILD", "1")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "mpiexec failed:\n{text}");
    assert_eq!(text.matches("rank ok").count(), 2, "{text}");
}

fn which(name: &str) -> std::result::Result<std::path::PathBuf, ()> {
    let path = std::env::var_os("PATH").ok_or(())?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}

#[test]
fn mpi_rank() -> Result<()> {
    if std::env::var_os("DDP_MPI_CHILD").is_none() {
        return Ok(());
    }
    let comm = init_from_env()?;
    assert_eq!((comm.world_size(), comm.backend()), (2, "mpi"));
    let rank = comm.rank();
    let (x, y) = (
        values(7, &[8, 6], &Device::Cpu),
        values(8, &[8, 3], &Device::Cpu),
    );
    let steps = 5;

    // The reference: one process on the full batch (each rank computes it alone).
    let single = Net::new(3);
    let mut opt = SGD::new(single.trainable_vars()?, 0.2)?;
    for _ in 0..steps {
        opt.step(&mse(&single.call(&x)?, &y)?.backward()?)?;
    }

    // Seeded differently: equal after construction.
    let model = Net::new(3 + rank as u64 * 17);
    let ddp =
        DistributedDataParallel::new(&model, &*comm, DdpConfig::default().bucket_cap_mb(0.0002))?;
    assert_eq!(
        flat(&model).to_vec1::<f32>()?,
        flat(&Net::new(3)).to_vec1::<f32>()?
    );
    assert!(ddp.bucket_paths().len() > 1);

    let mut opt = SGD::new(model.trainable_vars()?, 0.2)?;
    let (xs, ys) = (x.narrow(0, rank * 4, 4)?, y.narrow(0, rank * 4, 4)?);
    for _ in 0..steps {
        let mut out = ddp.call(&xs)?;
        if rank == 0 {
            // Unused on rank 1; adds exactly 0 (`e - e`) so the reference run is unchanged,
            // but gives `extra` a (zero) gradient on rank 0.
            let e = model.extra.call(&xs)?;
            out = (out + (&e - &e)?)?;
        }
        let mut g = mse(&out, &ys)?.backward()?;
        ddp.reduce_gradients(&mut g)?;
        assert!(
            g.get(model.extra.weight.var()?.as_tensor()).is_some(),
            "agreed across ranks"
        );
        opt.step(&g)?;
    }

    // Within 1e-6 of the single process.
    let diff = (flat(&model) - flat(&single))?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    assert!(diff <= 1e-6, "rank {rank}: {diff}");
    // Bitwise equal across ranks: rank 0's bits against ours.
    let mine = flat(&model);
    let root = mine.copy()?;
    comm.broadcast(&root, 0)?;
    let same = mine
        .to_vec1::<f32>()?
        .iter()
        .zip(root.to_vec1::<f32>()?)
        .all(|(a, b)| a.to_bits() == b.to_bits());
    let agree = Tensor::new(&[f32::from(u8::from(same))], &Device::Cpu)?;
    comm.all_reduce(&agree, ReduceOp::Sum)?;
    assert_eq!(
        agree.to_vec1::<f32>()?,
        [2.0],
        "parameters bitwise equal on both ranks"
    );

    // Buffers follow rank 0: at construction, and again before each `ddp.call` (PyTorch's
    // `broadcast_buffers=True`) after a rank changed its own.
    let counted = Counted {
        fc: Linear::from_tensors(values(1, &[3, 6], &Device::Cpu), None)?,
        seen: Buffer::new(Tensor::new(&[rank as f32 * 10.0 + 1.0], &Device::Cpu)?),
    };
    let ddp_b = DistributedDataParallel::new(&counted, &*comm, DdpConfig::default())?;
    assert_eq!(
        counted.seen.tensor()?.to_vec1::<f32>()?,
        [1.0],
        "rank {rank}"
    );
    counted
        .seen
        .set(&Tensor::new(&[rank as f32 + 5.0], &Device::Cpu)?)?;
    ddp_b.call(&xs)?;
    assert_eq!(
        counted.seen.tensor()?.to_vec1::<f32>()?,
        [5.0],
        "rank {rank}"
    );

    // A model built differently on rank 1: an error on both ranks, not a hang.
    let other = Net::new(0);
    if rank == 1 {
        other.freeze("fc2")?;
    }
    let err = DistributedDataParallel::new(&other, &*comm, DdpConfig::default()).unwrap_err();
    assert!(err.to_string().contains("differ from rank 0"), "{err}");
    comm.barrier()?;
    println!("rank ok");
    Ok(())
}

/// The whole batch of step `k`: 8 examples.
fn zero_batch(k: u64) -> (Tensor, Tensor) {
    (
        values(40 + k, &[8, 6], &Device::Cpu),
        values(60 + k, &[8, 3], &Device::Cpu),
    )
}

fn zero_adamw(model: &Net) -> AdamW {
    let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
    AdamW::with_groups(model, AdamW::options().lr(1e-2).weight_decay(0.1), &groups).unwrap()
}

/// The gradients of step `k` on `rank`'s half of the batch, or on all of it with `rank` None.
fn zero_grads(model: &Net, rank: Option<usize>, k: u64) -> AnyResult<GradStore> {
    let (x, y) = zero_batch(k);
    let (x, y) = match rank {
        Some(r) => (x.narrow(0, r * 4, 4)?, y.narrow(0, r * 4, 4)?),
        None => (x, y),
    };
    Ok(mse(&model.call(&x)?, &y)?.backward()?)
}

/// Steps `from..to` of DDP: AdamW (biases without weight decay), a warmup, clipping to 0.3.
fn ddp_steps(
    ddp: &DistributedDataParallel<'_, Net>,
    opt: &mut AdamW,
    sched: &mut LambdaLr,
    steps: std::ops::Range<u64>,
) -> AnyResult<bool> {
    let params = opt.params();
    let mut clipped = false;
    for k in steps {
        let mut g = zero_grads(ddp.module(), Some(ddp.rank()), k)?;
        ddp.reduce_gradients(&mut g)?;
        clipped |= clip_grad_norm(&mut g, &params, 0.3, 2.0, false)? > 0.3;
        opt.step(&g)?;
        sched.step(opt);
    }
    Ok(clipped)
}

/// Either crate's error (the runtime's, the optimizers').
type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[test]
fn zero_rank() -> AnyResult<()> {
    if std::env::var_os("DDP_MPI_CHILD").is_none() {
        return Ok(());
    }
    let comm = init_from_env()?;
    let rank = comm.rank();
    // The reference: DDP, 4 steps (clipping reached), on models seeded differently per rank.
    let model = Net::new(3 + rank as u64 * 17);
    let ddp = DistributedDataParallel::new(&model, &*comm, DdpConfig::default())?;
    let mut opt = zero_adamw(&model);
    let mut sched = LambdaLr::linear_with_warmup(&mut opt, 2, 10);
    assert!(
        ddp_steps(&ddp, &mut opt, &mut sched, 0..4)?,
        "clipping is exercised"
    );
    let reference = flat(&model).to_vec1::<f32>()?;
    let reference_state = opt.state_dict()?;

    for stage in [ZeroStage::One, ZeroStage::Two] {
        let model = Net::new(3 + rank as u64 * 17);
        // Copies rank 0's parameters to rank 1.
        let _ddp = DistributedDataParallel::new(&model, &*comm, DdpConfig::default())?;
        let mut zero = ZeroRedundancyOptimizer::new(zero_adamw(&model), &*comm, stage)?;
        zero.set_bucket_cap_bytes(64); // several buckets
        let mut sched = LambdaLr::linear_with_warmup(&mut zero, 2, 10);
        let mut step = |zero: &mut ZeroRedundancyOptimizer<'_, AdamW>, k: u64| -> AnyResult<()> {
            let mut g = zero_grads(&model, Some(rank), k)?;
            zero.reduce_gradients(&mut g)?;
            zero.clip_grad_norm(&mut g, 0.3, 2.0, false)?;
            zero.step(&g)?;
            sched.step(zero);
            Ok(())
        };
        for k in 0..4 {
            step(&mut zero, k)?;
        }
        // Bitwise where DDP ends, on both ranks.
        let mine = flat(&model).to_vec1::<f32>()?;
        let same = mine
            .iter()
            .zip(&reference)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        agree(
            &*comm,
            same,
            &format!("{stage:?}: parameters bitwise DDP's"),
        )?;
        // The consolidated state is DDP's optimizer's, on rank 0 only.
        let full = zero.consolidate_state_dict(0)?;
        assert_eq!(full.is_some(), rank == 0);
        // Two more steps on 2 ranks; one process loads the model and the consolidated state and
        // takes them on the whole batches: within 1e-6.
        let mut lrs = Vec::new();
        for k in 4..6 {
            lrs.push(zero.lrs());
            step(&mut zero, k)?;
        }
        let after = flat(&model).to_vec1::<f32>()?;
        let resumed = match full {
            Some(full) => resume_in_one_process(&full, &reference_state, &mine, &after, &lrs)?,
            None => String::new(), // rank 0 checks
        };
        agree(&*comm, resumed.is_empty(), &format!("{stage:?}: {resumed}"))?;
    }

    // The native MPI all-gather keeps half-precision bits; reduce-scatter sums blocks.
    let mine = Tensor::new(&[rank as f32 + 0.1, -1.7], &Device::Cpu)?.to_dtype(DType::BF16)?;
    let all = Tensor::zeros(4, DType::BF16, &Device::Cpu)?;
    comm.all_gather(&mine, &all)?;
    let expected = Tensor::new(&[0.1f32, -1.7, 1.1, -1.7], &Device::Cpu)?.to_dtype(DType::BF16)?;
    let wide = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
    assert_eq!(wide(&all), wide(&expected));
    let input = Tensor::new(&[1f32, 2.0, 3.0 + rank as f32, 4.0], &Device::Cpu)?;
    let block = Tensor::zeros(2, DType::F32, &Device::Cpu)?;
    comm.reduce_scatter(&input, &block, ReduceOp::Avg)?;
    let want: [[f32; 2]; 2] = [[1.0, 2.0], [3.5, 4.0]];
    assert_eq!(block.to_vec1::<f32>()?, want[rank]);
    comm.barrier()?;
    println!("rank ok");
    Ok(())
}

/// Every rank's verdict, agreed: a check failed on any rank fails on every rank (a rank that
/// panicked alone would leave the other waiting in the next collective).
fn agree(comm: &dyn Collective, ok: bool, what: &str) -> AnyResult<()> {
    let failed = Tensor::new(&[f32::from(u8::from(!ok))], &Device::Cpu)?;
    comm.all_reduce(&failed, ReduceOp::Sum)?;
    let failed = failed.to_vec1::<f32>()?[0];
    assert!(
        failed == 0.0,
        "rank {}: failed on {failed} rank(s): {what}",
        comm.rank()
    );
    Ok(())
}

/// On rank 0: the consolidated state is DDP's optimizer's, and one process that loads it and the
/// parameters `params` and takes steps 4 and 5 on the whole batches (at the learning rates `lrs`
/// the schedule set) ends within 1e-6 of the 2-rank run's `after`. Returns what failed, or
/// nothing.
fn resume_in_one_process(
    full: &StateDict,
    reference: &StateDict,
    params: &[f32],
    after: &[f32],
    lrs: &[Vec<f64>],
) -> AnyResult<String> {
    let mut keys: Vec<&str> = full.keys().collect();
    let mut expected: Vec<&str> = reference.keys().collect();
    keys.sort_unstable();
    expected.sort_unstable();
    if keys != expected {
        return Ok(format!("consolidated keys {keys:?}, DDP's {expected:?}"));
    }
    let wide = |t: &Tensor| -> AnyResult<Vec<f64>> {
        Ok(t.to_dtype(DType::F64)?.flatten_all()?.to_vec1::<f64>()?)
    };
    for (k, t) in full.iter() {
        if wide(t)? != wide(reference.get(k).expect("same keys"))? {
            return Ok(format!("consolidated `{k}` differs from DDP's"));
        }
    }
    let single = Net::new(0);
    let mut offset = 0;
    for p in single.parameters() {
        let n = p.elem_count();
        p.set(&Tensor::from_slice(
            &params[offset..offset + n],
            p.shape(),
            &Device::Cpu,
        )?)?;
        offset += n;
    }
    let mut opt = zero_adamw(&single);
    opt.load_state_dict(full)?;
    let trained = opt.params();
    for (k, lrs) in (4..6).zip(lrs) {
        for (g, lr) in lrs.iter().enumerate() {
            opt.set_lr(g, *lr);
        }
        let mut g = zero_grads(&single, None, k)?;
        clip_grad_norm(&mut g, &trained, 0.3, 2.0, false)?;
        opt.step(&g)?;
    }
    let diff = (flat(&single) - Tensor::new(after, &Device::Cpu)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f32>()?;
    Ok(if diff <= 1e-6 {
        String::new()
    } else {
        format!("one process resumed {diff} away")
    })
}
