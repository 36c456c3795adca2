//! Data-parallel training (issue #20) without MPI or a GPU: the single-process engine in the
//! default build, and several ranks as threads through `LocalGroup`, which runs the same
//! `DistributedDataParallel` code as the MPI engine does across processes.

use std::time::Duration;

use candle_nn::{Optimizer, SGD};
use module_runtime::distributed::{
    plan_buckets, Collective, DdpConfig, DistEnv, DistributedDataParallel, DistributedError,
    DistributedSampler, Launcher, LocalGroup, ReduceOp, SingleProcess,
};
use module_runtime::prelude::*;

use crate::support;
use module_runtime::Buffer;
use support::{param_values, values};

fn linear(seed: u64, i: usize, o: usize) -> Linear {
    Linear::from_tensors(
        values(seed, &[o, i], &Device::Cpu),
        Some(values(seed + 100, &[o], &Device::Cpu)),
    )
    .unwrap()
}

#[derive(Module)]
struct Net {
    fc1: Linear,
    fc2: Linear,
    /// Used only when a test says so: an unused parameter on some ranks.
    extra: Linear,
    stats: Buffer,
}

impl Net {
    fn new(seed: u64) -> Net {
        Net {
            fc1: linear(seed, 6, 8),
            fc2: linear(seed + 1, 8, 3),
            extra: linear(seed + 2, 6, 3),
            stats: Buffer::new(values(seed + 3, &[3], &Device::Cpu)),
        }
    }
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.call(x)?.tanh()?;
        Ok(self.fc2.call(&h)?.broadcast_add(&self.stats.tensor()?)?)
    }
}

fn batch() -> (Tensor, Tensor) {
    (
        values(7, &[8, 6], &Device::Cpu),
        values(8, &[8, 3], &Device::Cpu),
    )
}

fn mse(out: &Tensor, y: &Tensor) -> Result<Tensor> {
    Ok((out - y)?.sqr()?.mean_all()?)
}

/// Runs `f(rank, comm)` on `world` threads and returns the results in rank order.
fn on_ranks<T: Send>(
    world: usize,
    f: impl Fn(usize, &LocalGroup) -> Result<T> + Sync,
) -> Vec<Result<T>> {
    let ranks = LocalGroup::with_timeout(world, Duration::from_secs(20)).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .iter()
            .enumerate()
            .map(|(rank, comm)| {
                let f = &f;
                s.spawn(move || f(rank, comm))
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn world_of_one_step_equals_a_plain_step_bit_for_bit() -> Result<()> {
    let (x, y) = batch();
    let plain = Net::new(1);
    let wrapped = Net::new(1);
    let comm = SingleProcess;
    let ddp =
        DistributedDataParallel::new(&wrapped, &comm, DdpConfig::default().bucket_cap_mb(0.0001))?;
    assert!(ddp.is_main());
    assert_eq!((ddp.rank(), ddp.world_size()), (0, 1));
    assert!(
        ddp.bucket_paths().len() > 1,
        "a small cap makes several buckets"
    );
    let mut opt_plain = SGD::new(plain.trainable_vars()?, 0.1)?;
    let mut opt_ddp = SGD::new(wrapped.trainable_vars()?, 0.1)?;
    for _ in 0..3 {
        let g = mse(&plain.call(&x)?, &y)?.backward()?;
        opt_plain.step(&g)?;
        let mut g = mse(&ddp.call(&x)?, &y)?.backward()?;
        ddp.reduce_gradients(&mut g)?;
        // `extra` takes no part: it must stay without a gradient.
        assert!(g.get(wrapped.extra.weight.var()?.as_tensor()).is_none());
        opt_ddp.step(&g)?;
    }
    assert_eq!(param_values(&plain), param_values(&wrapped));
    Ok(())
}

#[test]
fn buckets_hold_one_dtype_under_the_cap_in_model_order() -> Result<()> {
    use candle_core::DType::{BF16, F32};
    assert_eq!(plan_buckets(&[], 16), Vec::<Vec<usize>>::new());
    // A tensor over the cap is alone; empty tensors are left out.
    assert_eq!(
        plan_buckets(&[(F32, 10), (F32, 1), (F32, 0), (F32, 3), (F32, 1)], 16),
        [vec![0], vec![1, 3], vec![4]]
    );
    assert_eq!(
        plan_buckets(&[(BF16, 4), (F32, 2), (BF16, 4), (F32, 2)], 16),
        [vec![0, 2], vec![1, 3]]
    );
    assert_eq!(plan_buckets(&[(F32, 4); 3], usize::MAX), [vec![0, 1, 2]]);

    let model = Net::new(0);
    let comm = SingleProcess;
    // fc1.weight 48 floats = 192 bytes; a 200-byte cap.
    let ddp = DistributedDataParallel::new(
        &model,
        &comm,
        DdpConfig {
            bucket_cap_bytes: 200,
            ..Default::default()
        },
    )?;
    assert_eq!(
        ddp.bucket_paths(),
        [
            vec!["fc1.weight"],
            vec!["fc1.bias", "fc2.weight", "fc2.bias"],
            vec!["extra.weight", "extra.bias"],
        ]
    );
    // Frozen parameters are not reduced.
    model.freeze("extra")?;
    let ddp = DistributedDataParallel::new(&model, &comm, DdpConfig::default())?;
    assert_eq!(
        ddp.bucket_paths(),
        [vec!["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]]
    );
    Ok(())
}

#[test]
fn unbuilt_and_frozen_models_are_refused() {
    let lazy = module_runtime::nn::LazyLinear::new(3, &Device::Cpu).unwrap();
    let err =
        DistributedDataParallel::new(&lazy, &SingleProcess, DdpConfig::default()).unwrap_err();
    assert!(matches!(err, Error::Unbuilt { .. }), "{err}");

    let model = Net::new(0);
    model.freeze("**").unwrap();
    let err =
        DistributedDataParallel::new(&model, &SingleProcess, DdpConfig::default()).unwrap_err();
    assert!(
        matches!(err, Error::Distributed(DistributedError::NoTrainableParams)),
        "{err}"
    );
}

#[test]
fn ranks_seeded_differently_agree_after_construction() {
    let out = on_ranks(3, |rank, comm| {
        let model = Net::new(10 + rank as u64);
        let _ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default())?;
        Ok((
            param_values(&model),
            model.stats.tensor().unwrap().to_vec1::<f32>()?,
        ))
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out[0].0, param_values(&Net::new(10)), "rank 0's values win");
    assert!(out.iter().all(|o| *o == out[0]));
}

#[test]
fn two_ranks_on_half_batches_match_one_process_on_the_full_batch() {
    let (x, y) = batch();
    let steps = 5;
    let single = Net::new(3);
    let mut opt = SGD::new(single.trainable_vars().unwrap(), 0.2).unwrap();
    for _ in 0..steps {
        let g = mse(&single.call(&x).unwrap(), &y)
            .unwrap()
            .backward()
            .unwrap();
        opt.step(&g).unwrap();
    }
    let out = on_ranks(2, |rank, comm| {
        let model = Net::new(3 + rank as u64 * 17);
        // A small cap: several buckets.
        let ddp =
            DistributedDataParallel::new(&model, comm, DdpConfig::default().bucket_cap_mb(0.0002))?;
        let mut opt = SGD::new(model.trainable_vars()?, 0.2)?;
        let (xs, ys) = (x.narrow(0, rank * 4, 4)?, y.narrow(0, rank * 4, 4)?);
        for _ in 0..steps {
            let mut g = mse(&ddp.call(&xs)?, &ys)?.backward()?;
            ddp.reduce_gradients(&mut g)?;
            opt.step(&g)?;
        }
        Ok(param_values(&model))
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out[0], out[1], "replicas stay bitwise equal");
    for ((name, a), (_, b)) in param_values(&single).iter().zip(&out[0]) {
        let diff = a
            .iter()
            .zip(b)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(diff <= 1e-6, "{name}: {diff}");
    }
}

#[test]
fn a_parameter_unused_on_one_rank_counts_as_zeros_there() {
    let (x, y) = batch();
    let out = on_ranks(2, |rank, comm| {
        let model = Net::new(5);
        let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default())?;
        let mut out = ddp.call(&x)?;
        if rank == 0 {
            out = (out + model.extra.call(&x)?)?;
        }
        let mut g = mse(&out, &y)?.backward()?;
        let local = g
            .get(model.extra.weight.var().unwrap().as_tensor())
            .map(|t| t.to_vec2::<f32>().unwrap());
        ddp.reduce_gradients(&mut g)?;
        let reduced = g
            .get(model.extra.weight.var().unwrap().as_tensor())
            .unwrap()
            .to_vec2::<f32>()?;
        Ok((local, reduced))
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    let local = out[0].0.clone().unwrap();
    assert!(out[1].0.is_none());
    let half: Vec<Vec<f32>> = local
        .iter()
        .map(|r| r.iter().map(|v| v / 2.0).collect())
        .collect();
    assert_eq!(out[0].1, half);
    assert_eq!(out[1].1, half);
}

#[test]
fn a_parameter_unused_on_every_rank_keeps_no_gradient() {
    let (x, y) = batch();
    let out = on_ranks(2, |_, comm| {
        let model = Net::new(5);
        let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default())?;
        let mut g = mse(&ddp.call(&x)?, &y)?.backward()?;
        ddp.reduce_gradients(&mut g)?;
        Ok((
            g.get(model.extra.weight.var().unwrap().as_tensor())
                .is_none(),
            g.get(model.fc1.weight.var().unwrap().as_tensor()).is_some(),
        ))
    });
    for r in out {
        assert_eq!(r.unwrap(), (true, true));
    }
}

#[test]
fn bf16_models_reduce_in_their_own_buckets() {
    let (x, y) = batch();
    let out = on_ranks(2, |rank, comm| {
        let model = Net::new(9 + rank as u64);
        model.to_dtype(DType::BF16)?;
        let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default())?;
        let xs = x.narrow(0, rank * 4, 4)?.to_dtype(DType::BF16)?;
        let ys = y.narrow(0, rank * 4, 4)?.to_dtype(DType::BF16)?;
        let mut g = mse(&ddp.call(&xs)?, &ys)?.backward()?;
        ddp.reduce_gradients(&mut g)?;
        let w = g.get(model.fc1.weight.var().unwrap().as_tensor()).unwrap();
        assert_eq!(w.dtype(), DType::BF16);
        Ok(w.to_dtype(DType::F32)?.to_vec2::<f32>()?)
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out[0], out[1]);
}

#[test]
fn mismatched_models_fail_on_every_rank() {
    let out = on_ranks(3, |rank, comm| {
        let model = Net::new(0);
        if rank == 2 {
            model.freeze("fc2")?; // another requires_grad: another digest
        }
        DistributedDataParallel::new(&model, comm, DdpConfig::default()).map(|_| ())
    });
    for (rank, r) in out.into_iter().enumerate() {
        match r {
            Err(Error::Distributed(DistributedError::ModelMismatch {
                mismatched,
                rank: r,
                ..
            })) => {
                assert_eq!((mismatched, r), (vec![2], rank));
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn buffers_follow_rank_0_before_each_forward() {
    let out = on_ranks(2, |rank, comm| {
        let model = Net::new(0);
        let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default())?;
        model
            .stats
            .set(&Tensor::new(&[rank as f32; 3], &Device::Cpu)?)?;
        ddp.call(&values(1, &[2, 6], &Device::Cpu))?;
        let synced = model.stats.tensor().unwrap().to_vec1::<f32>()?;
        // Opted out: the local value stays.
        let ddp = DistributedDataParallel::new(
            &model,
            comm,
            DdpConfig::default().broadcast_buffers(false),
        )?;
        model
            .stats
            .set(&Tensor::new(&[rank as f32; 3], &Device::Cpu)?)?;
        ddp.call(&values(1, &[2, 6], &Device::Cpu))?;
        Ok((synced, model.stats.tensor().unwrap().to_vec1::<f32>()?))
    });
    let out: Vec<_> = out.into_iter().map(Result::unwrap).collect();
    assert_eq!(out[1].0, [0.0; 3]);
    assert_eq!(out[1].1, [1.0; 3]);
}

#[test]
fn local_group_collectives_and_their_failures() {
    let out = on_ranks(2, |rank, comm| {
        let t = Tensor::new(&[rank as f32 + 1.0, 4.0], &Device::Cpu)?;
        comm.all_reduce(&t, ReduceOp::Avg)?;
        let b = Tensor::new(&[rank as i64 * 10 + 3], &Device::Cpu)?;
        comm.broadcast(&b, 1)?;
        comm.barrier()?;
        Ok((t.to_vec1::<f32>()?, b.to_vec1::<i64>()?))
    });
    for r in out {
        assert_eq!(r.unwrap(), (vec![1.5, 4.0], vec![13]));
    }
    // Different sizes: an error on both ranks, not corrupt data.
    let out = on_ranks(2, |rank, comm| {
        let t = Tensor::zeros(rank + 1, DType::F32, &Device::Cpu)?;
        comm.all_reduce(&t, ReduceOp::Sum)
    });
    for r in out {
        assert!(
            matches!(
                r,
                Err(Error::Distributed(DistributedError::OpMismatch { .. }))
            ),
            "{r:?}"
        );
    }
    // A rank that never joins: a timeout, not a hang.
    let ranks = LocalGroup::with_timeout(2, Duration::from_millis(50)).unwrap();
    let err = ranks[0].barrier().unwrap_err();
    assert!(
        matches!(err, Error::Distributed(DistributedError::Timeout { .. })),
        "{err}"
    );
    let err = ranks[1].barrier().unwrap_err();
    assert!(
        matches!(err, Error::Distributed(DistributedError::Poisoned { .. })),
        "{err}"
    );
    // Bad roots.
    let t = Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap();
    assert!(SingleProcess.broadcast(&t, 1).is_err());
}

// --- DistributedSampler: PyTorch's index lists ------------------------------------------------

fn sampler(len: usize, world: usize, rank: usize) -> DistributedSampler {
    DistributedSampler::new(len, world, rank).unwrap()
}

#[test]
fn sampler_without_shuffle_matches_pytorch() {
    // torch: DistributedSampler(range(10), num_replicas=3, rank=r, shuffle=False)
    // total_size 12, indices 0..10 + [0, 1].
    let lists: Vec<_> = (0..3)
        .map(|r| sampler(10, 3, r).shuffle(false).indices())
        .collect();
    assert_eq!(
        lists,
        [vec![0, 3, 6, 9], vec![1, 4, 7, 0], vec![2, 5, 8, 1]]
    );
    // drop_last: num_samples = ceil((10 - 3) / 3) = 3, total 9.
    let lists: Vec<_> = (0..3)
        .map(|r| sampler(10, 3, r).shuffle(false).drop_last(true).indices())
        .collect();
    assert_eq!(lists, [vec![0, 3, 6], vec![1, 4, 7], vec![2, 5, 8]]);
    // Padding longer than the data repeats it: 2 samples over 5 ranks.
    let lists: Vec<_> = (0..5)
        .map(|r| sampler(2, 5, r).shuffle(false).indices())
        .collect();
    assert_eq!(lists, [vec![0], vec![1], vec![0], vec![1], vec![0]]);
    assert_eq!(sampler(2, 5, 4).drop_last(true).num_samples(), 0);
    assert_eq!(sampler(0, 2, 1).indices(), Vec::<usize>::new());
}

#[test]
fn sampler_shuffle_matches_pytorch_randperm() {
    // torch.randperm(4, generator=torch.Generator().manual_seed(0)) is Fisher–Yates on MT19937
    // (seed 0 draws 2357136044, 2546248239, 3071714933): [0, 1, 3, 2].
    assert_eq!(sampler(4, 1, 0).indices(), [0, 1, 3, 2]);
    assert_eq!(sampler(4, 2, 0).indices(), [0, 3]);
    assert_eq!(sampler(4, 2, 1).indices(), [1, 2]);
}

#[test]
fn sampler_covers_disjointly_and_reshuffles_per_epoch() {
    for (len, world) in [(100, 4), (101, 4), (7, 3), (3, 8)] {
        for drop_last in [false, true] {
            let mut samplers: Vec<_> = (0..world)
                .map(|r| sampler(len, world, r).seed(7).drop_last(drop_last))
                .collect();
            let mut previous = None;
            for epoch in 0..3 {
                let lists: Vec<Vec<usize>> = samplers
                    .iter_mut()
                    .map(|s| {
                        s.set_epoch(epoch);
                        s.indices()
                    })
                    .collect();
                let n = samplers[0].num_samples();
                assert!(lists.iter().all(|l| l.len() == n));
                let mut all: Vec<usize> = lists.concat();
                all.sort_unstable();
                if drop_last {
                    all.dedup();
                    assert_eq!(all.len(), n * world, "disjoint");
                    assert_eq!(n, len / world);
                } else {
                    let mut distinct = all.clone();
                    distinct.dedup();
                    assert_eq!(distinct, (0..len).collect::<Vec<_>>(), "covers");
                    assert_eq!(all.len(), len.div_ceil(world) * world);
                }
                if len > 10 {
                    assert_ne!(previous.as_ref(), Some(&lists), "epoch {epoch} reshuffles");
                }
                previous = Some(lists);
            }
        }
    }
    assert!(DistributedSampler::new(10, 2, 2).is_err());
    assert!(DistributedSampler::new(10, 0, 0).is_err());
}

// --- Launcher environment ---------------------------------------------------------------------

fn env(vars: &[(&str, &str)]) -> module_runtime::Result<DistEnv> {
    DistEnv::from_vars(|n| vars.iter().find(|v| v.0 == n).map(|v| v.1.to_string()))
}

#[test]
fn launcher_environments_are_read_and_half_set_ones_refused() {
    let e = env(&[]).unwrap();
    assert_eq!((e.launcher, e.rank, e.world_size), (Launcher::None, 0, 1));
    let e = env(&[
        ("RANK", "3"),
        ("WORLD_SIZE", "4"),
        ("LOCAL_RANK", "1"),
        ("MASTER_ADDR", "10.0.0.1"),
        ("MASTER_PORT", "29500"),
    ])
    .unwrap();
    assert_eq!(e.launcher, Launcher::Torchrun);
    assert_eq!((e.rank, e.world_size, e.local_rank), (3, 4, Some(1)));
    assert_eq!(e.master, Some(("10.0.0.1".to_string(), 29500)));
    let e = env(&[
        ("OMPI_COMM_WORLD_RANK", "1"),
        ("OMPI_COMM_WORLD_SIZE", "2"),
        ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
    ])
    .unwrap();
    assert_eq!(
        (e.launcher, e.rank, e.world_size, e.local_rank),
        (Launcher::OpenMpi, 1, 2, Some(1))
    );
    // A one-rank torchrun needs no rendezvous.
    assert!(env(&[("RANK", "0"), ("WORLD_SIZE", "1")]).is_ok());
    // Agreeing launchers are fine.
    assert!(env(&[
        ("PMI_RANK", "1"),
        ("PMI_SIZE", "2"),
        ("RANK", "1"),
        ("WORLD_SIZE", "2"),
        ("MASTER_ADDR", "h"),
        ("MASTER_PORT", "1")
    ])
    .is_ok());

    for bad in [
        &[("RANK", "0")][..],
        &[("WORLD_SIZE", "2")],
        &[("LOCAL_RANK", "0")],
        &[("MASTER_ADDR", "localhost")],
        &[("RANK", "0"), ("WORLD_SIZE", "2")],
        &[("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h")],
        &[
            ("RANK", "2"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
        &[
            ("RANK", "x"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
        &[
            ("RANK", "0"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "99999"),
        ],
        &[("PMI_RANK", "0")],
        &[("OMPI_COMM_WORLD_SIZE", "2")],
        &[("PMI_RANK", "0"), ("PMI_SIZE", "0")],
        &[
            ("PMI_RANK", "0"),
            ("PMI_SIZE", "2"),
            ("RANK", "1"),
            ("WORLD_SIZE", "2"),
            ("MASTER_ADDR", "h"),
            ("MASTER_PORT", "1"),
        ],
    ] {
        match env(bad) {
            Err(Error::Distributed(DistributedError::Env { .. })) => {}
            other => panic!("{bad:?}: {other:?}"),
        }
    }
}
