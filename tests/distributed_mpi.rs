//! Data-parallel training across 2 processes over MPI (`--features mpi`).
//!
//! `two_ranks_under_mpiexec` re-runs this test binary under `mpiexec -n 2`, selecting only
//! `mpi_rank` with `DDP_MPI_CHILD=1`; each rank checks its side and a failure exits non-zero,
//! which fails the parent. Without `mpiexec` on the `PATH` the parent prints a notice and passes.
//! Checked over MPI: ranks seeded differently agree after construction, 2 ranks on half batches
//! match one process on the full batch within 1e-6, parameters stay bitwise equal, a parameter
//! unused on one rank gets an agreed gradient, buffers follow rank 0, and a model built differently
//! on one rank is an error on both.
//!
//! Run: `cargo test -p candle-module --features mpi --test distributed_mpi`
//! (needs MPICH: `apt-get install -y mpich libmpich-dev libclang-dev`).
#![cfg(feature = "mpi")]

use candle_nn::{Optimizer, SGD};
use module_runtime::distributed::{init_from_env, DdpConfig, DistributedDataParallel, ReduceOp};
use module_runtime::prelude::*;

mod support;
use support::values;

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
        .args(["mpi_rank", "--exact", "--nocapture", "--test-threads=1"])
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
