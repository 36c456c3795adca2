//! `ZeroRedundancyOptimizer` over ranks that are threads (`LocalGroup`): stages 1 and 2 train
//! bitwise as data parallelism does (AdamW, parameter groups, clipping, a schedule), each rank
//! keeps only its partition's state (and, at stage 2, gradients), the state consolidates into
//! what a single process loads and continues from, a rank's shard saves and loads, and ranks
//! that disagree get an error, not a hang. The 2-process version over MPI is the workspace's
//! `tests/distributed_mpi.rs`.

use module_runtime::distributed::{
    Collective, DdpConfig, DistributedDataParallel, LocalGroup, ReduceOp, SingleProcess,
};
use module_runtime::optim::{
    clip_grad_norm, partition_sizes, AdamW, Error, LambdaLr, LrScheduler, Optimizer, ParamGroups,
    ZeroRedundancyOptimizer, ZeroStage,
};
use module_runtime::prelude::*;
use module_runtime::StateDict;

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
    head: Linear,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc2.call(&self.fc1.call(x)?.tanh()?)?.tanh()?;
        self.head.call(&h)
    }
}

/// The same model on every call; `seed` changes the values (ranks seeded differently).
fn mlp(seed: usize) -> Mlp {
    let dev = Device::Cpu;
    let m = Mlp {
        fc1: Linear::new(6, 9, &dev).unwrap(),
        fc2: Linear::new(9, 7, &dev).unwrap(),
        head: Linear::new(7, 3, &dev).unwrap(),
    };
    for (i, (_, p)) in m.named_parameters().into_iter().enumerate() {
        let v: Vec<f32> = (0..p.elem_count())
            .map(|k| (((k + 13 * i + seed) * 37) % 19) as f32 / 19.0 - 0.5)
            .collect();
        p.set(&Tensor::from_vec(v, p.shape(), &dev).unwrap())
            .unwrap();
    }
    m
}

/// Step `k`'s whole batch: 8 examples.
fn batch(k: usize) -> (Tensor, Tensor) {
    let v = |n: usize, m: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i + 5 * k) * m) % 17) as f32 / 8.0 - 1.0)
            .collect()
    };
    (
        Tensor::from_vec(v(48, 29), (8, 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(v(24, 31), (8, 3), &Device::Cpu).unwrap(),
    )
}

fn adamw(model: &Mlp) -> AdamW {
    let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
    AdamW::with_groups(model, AdamW::options().lr(2e-2).weight_decay(0.1), &groups).unwrap()
}

fn flat(model: &Mlp) -> Vec<f32> {
    let ps: Vec<Tensor> = model
        .parameters()
        .iter()
        .map(|p| p.tensor().unwrap().flatten_all().unwrap())
        .collect();
    Tensor::cat(&ps, 0).unwrap().to_vec1().unwrap()
}

/// The gradients of the loss on this rank's share of step `k`'s batch (all of it in one process).
fn grads(model: &Mlp, comm: &dyn Collective, k: usize) -> candle_core::backprop::GradStore {
    let (x, y) = batch(k);
    let per = 8 / comm.world_size();
    let start = comm.rank() * per;
    let (x, y) = (
        x.narrow(0, start, per).unwrap(),
        y.narrow(0, start, per).unwrap(),
    );
    let out = model.call(&x).unwrap();
    let loss = (out - y).unwrap().sqr().unwrap().mean_all().unwrap();
    loss.backward().unwrap()
}

/// One ZeRO step: reduce, clip to 0.5, step; whether the bound clipped.
fn zero_step(model: &Mlp, zero: &mut ZeroRedundancyOptimizer<'_, AdamW>, k: usize) -> bool {
    let mut g = grads(model, zero.collective(), k);
    zero.reduce_gradients(&mut g).unwrap();
    let clipped = zero.clip_grad_norm(&mut g, 0.5, 2.0, false).unwrap() > 0.5;
    zero.step(&g).unwrap();
    clipped
}

/// Runs `f` on every rank of a `world`-rank `LocalGroup`, each in its own thread.
fn on_ranks<T: Send>(world: usize, f: impl Fn(LocalGroup) -> T + Sync) -> Vec<T> {
    let ranks = LocalGroup::new(world).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// What a rank ends a run with: the parameters, its optimizer state dict (the consolidated one
/// on rank 0 under ZeRO), the state keys it held itself, and the gradient count after a stage-2
/// reduce.
struct Run {
    params: Vec<f32>,
    state: Option<StateDict>,
    own_state_keys: usize,
    clipped: bool,
}

/// 5 steps of data parallelism (`stage` None) or ZeRO at `stage`, with a linear warmup.
fn run(comm: &LocalGroup, stage: Option<ZeroStage>) -> Run {
    let model = mlp(comm.rank() * 7); // different on each rank: DDP copies rank 0's
    let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default()).unwrap();
    let mut clipped = false;
    match stage {
        None => {
            let mut opt = adamw(&model);
            let params = opt.params();
            let mut sched = LambdaLr::linear_with_warmup(&mut opt, 2, 10);
            for k in 0..5 {
                let mut g = grads(&model, comm, k);
                ddp.reduce_gradients(&mut g).unwrap();
                clipped |= clip_grad_norm(&mut g, &params, 0.5, 2.0, false).unwrap() > 0.5;
                opt.step(&g).unwrap();
                sched.step(&mut opt);
            }
            let state = opt.state_dict().unwrap();
            Run {
                params: flat(&model),
                own_state_keys: state.keys().filter(|k| k.starts_with("state.")).count(),
                state: Some(state),
                clipped,
            }
        }
        Some(stage) => {
            let mut zero = ZeroRedundancyOptimizer::new(adamw(&model), comm, stage).unwrap();
            zero.set_bucket_cap_bytes(100); // several buckets
            let mut sched = LambdaLr::linear_with_warmup(&mut zero, 2, 10);
            let owned = zero.partition_parameters()[comm.rank()].len();
            for k in 0..5 {
                let mut g = grads(&model, comm, k);
                zero.reduce_gradients(&mut g).unwrap();
                let held = model
                    .parameters()
                    .iter()
                    .filter(|p| g.get(p.var().unwrap().as_tensor()).is_some())
                    .count();
                match stage {
                    ZeroStage::One => assert_eq!(held, 6),
                    ZeroStage::Two => assert_eq!(held, owned, "stage 2 keeps its partition's"),
                }
                clipped |= zero.clip_grad_norm(&mut g, 0.5, 2.0, false).unwrap() > 0.5;
                zero.step(&g).unwrap();
                sched.step(&mut zero);
            }
            let own_state_keys = zero
                .state_dict()
                .unwrap()
                .keys()
                .filter(|k| k.starts_with("state."))
                .count();
            Run {
                params: flat(&model),
                state: zero.consolidate_state_dict(0).unwrap(),
                own_state_keys,
                clipped,
            }
        }
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

fn same_state(a: &StateDict, b: &StateDict) {
    let keys = |s: &StateDict| {
        let mut k: Vec<String> = s.keys().map(str::to_owned).collect();
        k.sort();
        k
    };
    assert_eq!(keys(a), keys(b));
    for (k, t) in a.iter() {
        let u = b.get(k).unwrap();
        let f = |t: &Tensor| {
            t.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f64>()
                .unwrap()
        };
        assert_eq!(f(t), f(u), "{k}");
    }
}

#[test]
fn stages_train_bitwise_as_data_parallelism() {
    let ddp = on_ranks(2, |c| run(&c, None));
    assert!(
        ddp[0].clipped,
        "the norm bound is reached, so clipping is exercised"
    );
    for stage in [ZeroStage::One, ZeroStage::Two] {
        let zero = on_ranks(2, |c| run(&c, Some(stage)));
        for (r, z) in zero.iter().enumerate() {
            assert_eq!(bits(&z.params), bits(&ddp[0].params), "{stage:?}, rank {r}");
        }
        // Each rank held the state of its own partition only: the two add up to the whole.
        assert_eq!(
            zero[0].own_state_keys + zero[1].own_state_keys,
            ddp[0].own_state_keys
        );
        assert!(zero[0].own_state_keys < ddp[0].own_state_keys);
        assert!(zero[1].state.is_none(), "consolidated on rank 0 only");
        same_state(
            zero[0].state.as_ref().unwrap(),
            ddp[0].state.as_ref().unwrap(),
        );
    }
}

#[test]
fn consolidated_state_resumes_in_one_process() {
    // Two ranks train 5 steps at stage 2, then 3 more; one process loads the model and the
    // consolidated state after the 5 and runs the 3 on the whole batches.
    let out = on_ranks(2, |c| {
        let model = mlp(0);
        let mut zero = ZeroRedundancyOptimizer::new(adamw(&model), &c, ZeroStage::Two).unwrap();
        for k in 0..5 {
            zero_step(&model, &mut zero, k);
        }
        let saved = (flat(&model), zero.consolidate_state_dict(0).unwrap());
        for k in 5..8 {
            zero_step(&model, &mut zero, k);
        }
        (saved, flat(&model))
    });
    let ((params, state), after) = (&out[0].0, &out[0].1);
    let model = mlp(0);
    let mut p = 0;
    for param in model.parameters() {
        let n = param.elem_count();
        param
            .set(&Tensor::from_slice(&params[p..p + n], param.shape(), &Device::Cpu).unwrap())
            .unwrap();
        p += n;
    }
    let mut opt = adamw(&model);
    opt.load_state_dict(state.as_ref().unwrap()).unwrap();
    let params = opt.params();
    for k in 5..8 {
        let mut g = grads(&model, &SingleProcess, k);
        clip_grad_norm(&mut g, &params, 0.5, 2.0, false).unwrap();
        opt.step(&g).unwrap();
    }
    let diff = flat(&model)
        .iter()
        .zip(after)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        diff <= 1e-6,
        "one process resumed from the consolidated state: {diff}"
    );
}

#[test]
fn sharded_state_saves_per_rank() {
    let dir = std::env::temp_dir().join(format!("zero-shards-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dir = &dir;
    on_ranks(2, |c| {
        let model = mlp(0);
        let mut zero = ZeroRedundancyOptimizer::new(adamw(&model), &c, ZeroStage::One).unwrap();
        for k in 0..2 {
            zero_step(&model, &mut zero, k);
        }
        let path = dir.join(format!("rank{}.safetensors", c.rank()));
        zero.save_state(&path).unwrap();
        c.barrier().unwrap();
        // The same rank loads its own shard; the other rank's is refused, nothing changed.
        let mut again = ZeroRedundancyOptimizer::new(adamw(&model), &c, ZeroStage::One).unwrap();
        again.load_state(&path).unwrap();
        same_state(&again.state_dict().unwrap(), &zero.state_dict().unwrap());
        let other = dir.join(format!("rank{}.safetensors", 1 - c.rank()));
        let err = again.load_state(&other).unwrap_err();
        assert!(matches!(err, Error::ZeroMismatch { .. }), "{err}");
        assert!(
            err.to_string().contains("cannot be loaded on rank"),
            "{err}"
        );
        same_state(&again.state_dict().unwrap(), &zero.state_dict().unwrap());
        // A consolidated state dict (gathered on rank 1, saved, read by both) also loads:
        // each rank keeps its own partition's state.
        let full_path = dir.join("full.safetensors");
        if let Some(full) = zero.consolidate_state_dict(1).unwrap() {
            full.save_safetensors(&full_path).unwrap();
        }
        c.barrier().unwrap();
        let mut third = ZeroRedundancyOptimizer::new(adamw(&model), &c, ZeroStage::One).unwrap();
        third.load_state(&full_path).unwrap();
        same_state(&third.state_dict().unwrap(), &zero.state_dict().unwrap());
        c.barrier().unwrap();
    });
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn ranks_that_differ_get_an_error() {
    let errs = on_ranks(2, |c| {
        let model = mlp(0);
        let groups = if c.rank() == 1 {
            ParamGroups::new().group("head", |g| g.lr(1.0))
        } else {
            ParamGroups::new()
        };
        let opt = AdamW::with_groups(&model, AdamW::options(), &groups).unwrap();
        ZeroRedundancyOptimizer::new(opt, &c, ZeroStage::One)
            .unwrap_err()
            .to_string()
    });
    for e in errs {
        assert!(e.contains("rank(s) [1]"), "{e}");
    }
    assert!(ZeroStage::from_number(3)
        .unwrap_err()
        .to_string()
        .contains("stage 3"));
}

#[test]
fn partition_is_balanced_and_deterministic() {
    assert_eq!(partition_sizes(&[4, 4, 4, 4], 2), [0, 1, 0, 1]);
    assert_eq!(partition_sizes(&[1, 8, 3, 5], 3), [2, 0, 2, 1]);
    assert_eq!(partition_sizes(&[7], 4), [0]);
    let model = mlp(0);
    let zero = ZeroRedundancyOptimizer::new(adamw(&model), &SingleProcess, ZeroStage::Two).unwrap();
    assert_eq!(zero.partition_parameters().len(), 1);
    assert_eq!(zero.partition_parameters()[0].len(), 6);
}

#[test]
fn gather_and_scatter_collectives() {
    let out = on_ranks(3, |c| {
        let r = c.rank() as f32;
        let mine = Tensor::new(&[r, r + 10.0], &Device::Cpu).unwrap();
        let all = Tensor::zeros(6, DType::F32, &Device::Cpu).unwrap();
        c.all_gather(&mine, &all).unwrap();
        let input = Tensor::new(&[r, 1.0, 2.0 * r, 1.0, 3.0 * r, 1.0], &Device::Cpu).unwrap();
        let block = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
        c.reduce_scatter(&input, &block, ReduceOp::Sum).unwrap();
        let bad = Tensor::zeros(5, DType::F32, &Device::Cpu).unwrap();
        let err = c.all_gather(&mine, &bad).unwrap_err().to_string();
        (
            all.to_vec1::<f32>().unwrap(),
            block.to_vec1::<f32>().unwrap(),
            err,
        )
    });
    for (r, (all, block, err)) in out.iter().enumerate() {
        assert_eq!(all, &[0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
        assert_eq!(block, &[3.0 * (r as f32 + 1.0), 3.0]);
        assert!(err.contains("a whole of 5"), "{err}");
    }
    // The trait's default implementations (through broadcast and all-reduce), on one rank.
    let one = Tensor::new(&[5f32, 6.0], &Device::Cpu).unwrap();
    let whole = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    SingleProcess.all_gather(&one, &whole).unwrap();
    assert_eq!(whole.to_vec1::<f32>().unwrap(), [5.0, 6.0]);
    let back = Tensor::zeros(2, DType::F32, &Device::Cpu).unwrap();
    SingleProcess
        .reduce_scatter(&whole, &back, ReduceOp::Avg)
        .unwrap();
    assert_eq!(back.to_vec1::<f32>().unwrap(), [5.0, 6.0]);
}

#[test]
fn bfloat16_parameters_shard_as_data_parallelism() {
    // Mixed precision: bfloat16 parameters (AdamW keeps float32 state for them), stage 2 against
    // DDP, 3 steps; the gradients' bfloat16 sums and the all-gather's bits agree.
    let run = |stage: Option<ZeroStage>| {
        on_ranks(2, move |c| {
            let model = mlp(c.rank());
            model.to_dtype(DType::BF16).unwrap();
            let ddp = DistributedDataParallel::new(&model, &c, DdpConfig::default()).unwrap();
            let mut plain = adamw(&model);
            let mut zero = stage.map(|s| {
                let mut z = ZeroRedundancyOptimizer::new(adamw(&model), &c, s).unwrap();
                z.set_bucket_cap_bytes(64);
                z
            });
            for k in 0..3 {
                let (x, y) = batch(k);
                let (x, y) = (
                    x.narrow(0, c.rank() * 4, 4).unwrap(),
                    y.narrow(0, c.rank() * 4, 4).unwrap(),
                );
                let out = model.call(&x.to_dtype(DType::BF16).unwrap()).unwrap();
                let diff = (out.to_dtype(DType::F32).unwrap() - y).unwrap();
                let mut g = diff.sqr().unwrap().mean_all().unwrap().backward().unwrap();
                match zero.as_mut() {
                    Some(z) => {
                        z.reduce_gradients(&mut g).unwrap();
                        z.step(&g).unwrap();
                    }
                    None => {
                        ddp.reduce_gradients(&mut g).unwrap();
                        plain.step(&g).unwrap();
                    }
                }
            }
            let ps: Vec<Tensor> = model
                .parameters()
                .iter()
                .map(|p| p.tensor().unwrap().flatten_all().unwrap())
                .collect();
            assert_eq!(ps[0].dtype(), DType::BF16);
            bits(
                &Tensor::cat(&ps, 0)
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_vec1()
                    .unwrap(),
            )
        })
    };
    let ddp = run(None);
    assert_eq!(run(Some(ZeroStage::Two)), ddp);
    assert_eq!(run(Some(ZeroStage::One)), ddp);
}
