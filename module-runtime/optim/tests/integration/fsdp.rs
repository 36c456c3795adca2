//! `FullyShardedDataParallel` (ZeRO stage 3) over ranks that are threads (`LocalGroup`): it
//! trains bitwise as data parallelism does (AdamW with parameter groups and a schedule, world
//! sizes that pad the shards), clipping agrees within float32 rounding, only shard gradients
//! reach the `GradStore`, the full state dict and the consolidated optimizer state load into a
//! single process that continues identically, a rank's sharded state saves and loads, and bad
//! setups are typed errors. The 2-process version over MPI is the workspace's
//! `tests/distributed_mpi.rs`.

use std::rc::Rc;

use module_runtime::amp::autocast;
use module_runtime::distributed::{Collective, DdpConfig, DistributedDataParallel, LocalGroup};
use module_runtime::optim::{
    clip_grad_norm, AdamW, Error, FsdpConfig, FullyShardedDataParallel, LambdaLr, LrScheduler,
    Optimizer, ParamGroups,
};
use module_runtime::prelude::*;
use module_runtime::{LoadOptions, StateDict};

#[derive(Module)]
struct Block {
    fc: Linear,
    gate: Linear,
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let gate = (self.gate.call(x)?.neg()?.exp()? + 1.0)?.recip()?;
        let h = (self.fc.call(x)?.tanh()? * gate)?;
        Ok((x + h)?)
    }
}

/// A root projection and head around two blocks (the units under `blocks.*`).
#[derive(Module)]
struct Net {
    proj: Linear,
    blocks: Vec<Block>,
    head: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.proj.call(x)?;
        for b in &self.blocks {
            h = b.call(&h)?;
        }
        self.head.call(&h)
    }
}

/// The same model on every call; `seed` changes the values (ranks seeded differently).
fn net(seed: usize) -> Net {
    let dev = Device::Cpu;
    let block = || Block {
        fc: Linear::new(7, 7, &dev).unwrap(),
        gate: Linear::new(7, 7, &dev).unwrap(),
    };
    let m = Net {
        proj: Linear::new(6, 7, &dev).unwrap(),
        blocks: vec![block(), block()],
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

/// Step `k`'s whole batch: 12 examples (a share for 1, 2, 3 or 4 ranks).
fn batch(k: usize) -> (Tensor, Tensor) {
    let v = |n: usize, m: usize| -> Vec<f32> {
        (0..n)
            .map(|i| (((i + 5 * k) * m) % 17) as f32 / 8.0 - 1.0)
            .collect()
    };
    (
        Tensor::from_vec(v(72, 29), (12, 6), &Device::Cpu).unwrap(),
        Tensor::from_vec(v(36, 31), (12, 3), &Device::Cpu).unwrap(),
    )
}

/// This rank's share of step `k`'s batch.
fn share(comm: &dyn Collective, k: usize) -> (Tensor, Tensor) {
    let (x, y) = batch(k);
    let per = 12 / comm.world_size();
    let start = comm.rank() * per;
    (
        x.narrow(0, start, per).unwrap(),
        y.narrow(0, start, per).unwrap(),
    )
}

fn loss(out: Tensor, y: &Tensor) -> Tensor {
    (out - y).unwrap().sqr().unwrap().mean_all().unwrap()
}

fn adamw(model: &Net) -> AdamW {
    let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
    AdamW::with_groups(model, AdamW::options().lr(2e-2).weight_decay(0.1), &groups).unwrap()
}

fn wrap(model: Net, comm: &Rc<dyn Collective>) -> FullyShardedDataParallel<Net> {
    let comm = comm.clone();
    let config = FsdpConfig::default().auto_wrap_policy(["blocks.*"]);
    FullyShardedDataParallel::new(model, comm, config).unwrap()
}

/// Every value of a state dict, by key, as f64.
fn values(sd: &StateDict) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    let mut v: Vec<_> = sd
        .iter()
        .map(|(k, t)| {
            let flat = t.to_dtype(DType::F64).unwrap().flatten_all().unwrap();
            (
                k.to_owned(),
                t.dims().to_vec(),
                flat.to_vec1::<f64>().unwrap(),
            )
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn max_diff(a: &StateDict, b: &StateDict) -> f64 {
    let (a, b) = (values(a), values(b));
    assert_eq!(
        a.iter().map(|x| (&x.0, &x.1)).collect::<Vec<_>>(),
        b.iter().map(|x| (&x.0, &x.1)).collect::<Vec<_>>()
    );
    a.iter()
        .zip(&b)
        .flat_map(|(x, y)| x.2.iter().zip(&y.2).map(|(p, q)| (p - q).abs()))
        .fold(0.0, f64::max)
}

fn copied(sd: &StateDict) -> StateDict {
    sd.iter()
        .map(|(k, t)| (k.to_owned(), t.copy().unwrap()))
        .collect()
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

/// 5 steps of data parallelism: the model's and the optimizer's state dicts.
fn ddp_run(comm: &LocalGroup, clip: Option<f64>) -> (StateDict, StateDict) {
    let model = net(comm.rank() * 7);
    let ddp = DistributedDataParallel::new(&model, comm, DdpConfig::default()).unwrap();
    let mut opt = adamw(&model);
    let params = opt.params();
    let mut sched = LambdaLr::linear_with_warmup(&mut opt, 2, 10);
    for k in 0..5 {
        let (x, y) = share(comm, k);
        let mut g = loss(ddp.call(&x).unwrap(), &y).backward().unwrap();
        ddp.reduce_gradients(&mut g).unwrap();
        if let Some(max) = clip {
            clip_grad_norm(&mut g, &params, max, 2.0, false).unwrap();
        }
        opt.step(&g).unwrap();
        sched.step(&mut opt);
    }
    (model.state_dict().unwrap(), opt.state_dict().unwrap())
}

/// The same 5 steps sharded: the full state dicts (model, optimizer), and whether every
/// gradient in the store was shard-sized.
fn fsdp_run(comm: LocalGroup, clip: Option<f64>) -> (StateDict, StateDict, bool) {
    let rank = comm.rank();
    let comm: Rc<dyn Collective> = Rc::new(comm);
    let fsdp = wrap(net(rank * 7), &comm);
    let mut opt = adamw(fsdp.module());
    let mut sched = LambdaLr::linear_with_warmup(&mut opt, 2, 10);
    let mut shard_sized = true;
    for k in 0..5 {
        let (x, y) = share(fsdp.collective(), k);
        let mut g = loss(fsdp.call(&x).unwrap(), &y).backward().unwrap();
        for (path, p) in fsdp.module().named_parameters() {
            let grad = g.get(p.var().unwrap().as_tensor()).unwrap();
            shard_sized &= grad.dims() == [fsdp.shard_len(&path).unwrap()];
        }
        if let Some(max) = clip {
            fsdp.clip_grad_norm(&mut g, max, 2.0).unwrap();
        }
        opt.step(&g).unwrap();
        sched.step(&mut opt);
    }
    let model = fsdp.state_dict().unwrap();
    let optim = fsdp.optim_state_dict(&opt).unwrap();
    (model, optim, shard_sized)
}

#[test]
fn trains_bitwise_as_data_parallelism() {
    for world in [2, 3, 4] {
        let ddp = on_ranks(world, |c| ddp_run(&c, None));
        let fsdp = on_ranks(world, |c| fsdp_run(c, None));
        for (r, (model, optim, shard_sized)) in fsdp.iter().enumerate() {
            assert!(shard_sized, "world {world}, rank {r}: only shard gradients");
            assert_eq!(
                max_diff(model, &ddp[0].0),
                0.0,
                "world {world}, rank {r}: model"
            );
            assert_eq!(
                max_diff(optim, &ddp[0].1),
                0.0,
                "world {world}, rank {r}: AdamW state"
            );
        }
    }
}

#[test]
fn clipping_over_shards_agrees_with_one_process() {
    let ddp = on_ranks(2, |c| ddp_run(&c, Some(0.05)));
    let fsdp = on_ranks(2, |c| fsdp_run(c, Some(0.05)));
    let unclipped = on_ranks(2, |c| ddp_run(&c, None));
    assert!(
        max_diff(&ddp[0].0, &unclipped[0].0) > 1e-3,
        "the bound clips"
    );
    for (model, _, _) in &fsdp {
        assert!(max_diff(model, &ddp[0].0) < 1e-6);
    }
}

#[test]
fn full_state_loads_into_one_process_and_resumes() {
    // Two ranks train 5 steps, then 2 more; one process loads the full model and the
    // consolidated AdamW state after the 5 and runs the 2 on the whole batches.
    let out = on_ranks(2, |c| {
        let c: Rc<dyn Collective> = Rc::new(c);
        let fsdp = wrap(net(0), &c);
        let mut opt = adamw(fsdp.module());
        let step = |opt: &mut AdamW, k| {
            let (x, y) = share(fsdp.collective(), k);
            let g = loss(fsdp.call(&x).unwrap(), &y).backward().unwrap();
            opt.step(&g).unwrap();
        };
        (0..5).for_each(|k| step(&mut opt, k));
        let saved = (
            fsdp.state_dict().unwrap(),
            fsdp.optim_state_dict(&opt).unwrap(),
        );
        (5..7).for_each(|k| step(&mut opt, k));
        (saved, fsdp.state_dict().unwrap())
    });
    let ((model_sd, optim_sd), after) = &out[0];
    let single = net(99);
    single
        .load_state_dict(model_sd, &LoadOptions::default())
        .unwrap(); // strict
    let mut opt = adamw(&single);
    opt.load_state_dict(optim_sd).unwrap();
    for k in 5..7 {
        let (x, y) = batch(k);
        let g = loss(single.call(&x).unwrap(), &y).backward().unwrap();
        opt.step(&g).unwrap();
    }
    assert!(max_diff(&single.state_dict().unwrap(), after) < 1e-6);
}

#[test]
fn sharded_state_saves_per_rank_and_full_state_loads_back() {
    let out = on_ranks(2, |c| {
        let rank = c.rank();
        let c: Rc<dyn Collective> = Rc::new(c);
        let fsdp = wrap(net(0), &c);
        let mut opt = adamw(fsdp.module());
        let step = |opt: &mut AdamW, k| {
            let (x, y) = share(fsdp.collective(), k);
            let g = loss(fsdp.call(&x).unwrap(), &y).backward().unwrap();
            opt.step(&g).unwrap();
        };
        (0..3).for_each(|k| step(&mut opt, k));
        // Copies: a state dict's tensors are the live values, as PyTorch's are.
        let shard = copied(&fsdp.sharded_state_dict().unwrap());
        let optim_shard = copied(&opt.state_dict().unwrap());
        let full = fsdp.state_dict().unwrap();
        let full_optim = fsdp.optim_state_dict(&opt).unwrap();
        (3..5).for_each(|k| step(&mut opt, k));
        let expected = fsdp.state_dict().unwrap();
        // Shards are 1-D, half the parameter (rounded up).
        assert_eq!(shard.get("proj.weight").unwrap().dims(), [21]);
        // Another rank's shard is refused, nothing changed.
        let mut other = shard.clone();
        other.insert(
            "fsdp.rank",
            Tensor::new(1.0 - rank as f64, &Device::Cpu).unwrap(),
        );
        let err = fsdp.load_sharded_state_dict(&other).unwrap_err();
        assert!(matches!(err, Error::ShardedModel { .. }), "{err}");
        assert!(
            err.to_string().contains("cannot be loaded on rank"),
            "{err}"
        );
        // Both ways back to step 3 give the same 2 further steps.
        let mut results = Vec::new();
        for sharded in [true, false] {
            let again = wrap(net(5), &c);
            let mut opt = adamw(again.module());
            if sharded {
                again.load_sharded_state_dict(&shard).unwrap();
                opt.load_state_dict(&optim_shard).unwrap();
            } else {
                again
                    .load_state_dict(&full, &LoadOptions::default())
                    .unwrap();
                opt.load_state_dict(&again.optim_state_dict_to_load(&full_optim).unwrap())
                    .unwrap();
            }
            for k in 3..5 {
                let (x, y) = share(again.collective(), k);
                let g = loss(again.call(&x).unwrap(), &y).backward().unwrap();
                opt.step(&g).unwrap();
            }
            results.push(max_diff(&again.state_dict().unwrap(), &expected));
        }
        results
    });
    for r in out {
        assert_eq!(r, [0.0, 0.0]);
    }
}

#[test]
fn forward_matches_the_unwrapped_model_and_frees_nothing_it_needs() {
    let reference = net(0);
    let (x, _) = batch(0);
    let expected = reference.call(&x).unwrap().to_vec2::<f32>().unwrap();
    let out = on_ranks(2, |c| {
        let c: Rc<dyn Collective> = Rc::new(c);
        let fsdp = wrap(net(0), &c);
        assert_eq!(fsdp.units(), ["", "blocks.0", "blocks.1"]);
        // A failed call (a shape error) leaves no scope open: the next call is as good.
        let wrong = Tensor::ones((2, 5), DType::F32, &Device::Cpu).unwrap();
        assert!(fsdp.call(&wrong).is_err());
        let y = fsdp.call(&x).unwrap().to_vec2::<f32>().unwrap();
        let eval = {
            let _off = no_grad();
            fsdp.call(&x).unwrap().to_vec2::<f32>().unwrap()
        };
        // Twice in one graph: both backward passes gather again.
        let two = (fsdp.call(&x).unwrap() + fsdp.call(&x).unwrap()).unwrap();
        let g = two.sum_all().unwrap().backward().unwrap();
        let n = fsdp.module().parameters().len();
        let held = fsdp
            .module()
            .parameters()
            .iter()
            .filter(|p| g.get(p.var().unwrap().as_tensor()).is_some())
            .count();
        // A second backward over the same graph gathers every weight again (the first freed
        // them): the same gradients.
        let l = fsdp.call(&x).unwrap().sqr().unwrap().sum_all().unwrap();
        let (g1, g2) = (l.backward().unwrap(), l.backward().unwrap());
        let same = fsdp.module().parameters().iter().all(|p| {
            let v = p.var().unwrap();
            let f = |g: &candle_core::backprop::GradStore| {
                g.get(v.as_tensor()).unwrap().to_vec1::<f32>().unwrap()
            };
            f(&g1) == f(&g2)
        });
        (y, eval, held == n && same)
    });
    for (y, eval, all) in out {
        assert_eq!(y, expected);
        assert_eq!(eval, expected);
        assert!(all);
    }
}

#[test]
fn bad_setups_are_typed_errors() {
    // A pattern that wraps nothing.
    let err = on_ranks(2, |c| {
        let c: Rc<dyn Collective> = Rc::new(c);
        let config = FsdpConfig::default().auto_wrap_policy(["layers.*"]);
        FullyShardedDataParallel::new(net(0), c, config).unwrap_err()
    });
    assert!(matches!(&err[0], Error::ShardedModel { .. }), "{}", err[0]);
    assert!(
        err[0].to_string().contains("matches no module"),
        "{}",
        err[0]
    );
    // A weight tied across two units.
    let err = on_ranks(2, |c| {
        let c: Rc<dyn Collective> = Rc::new(c);
        let mut model = net(0);
        model.blocks[1].fc.weight = model.blocks[0].fc.weight.clone();
        let config = FsdpConfig::default().auto_wrap_policy(["blocks.*"]);
        FullyShardedDataParallel::new(model, c, config).unwrap_err()
    });
    let msg = err[0].to_string();
    assert!(
        msg.contains("blocks.1.fc.weight") && msg.contains("blocks.0.fc.weight"),
        "{msg}"
    );
}

#[test]
fn bfloat16_parameters_shard_as_data_parallelism() {
    // Mixed precision: bfloat16 parameters (AdamW keeps float32 state for them), 3 steps of stage
    // 3 against DDP: the shards, the gathered weights and the reduce-scattered gradients are
    // bfloat16 as DDP's are, and the parameters agree bit for bit.
    let step_on = |model_call: &dyn Fn(&Tensor) -> Tensor, rank: usize, k: usize| {
        let (x, y) = batch(k);
        let (x, y) = (
            x.narrow(0, rank * 6, 6).unwrap(),
            y.narrow(0, rank * 6, 6).unwrap(),
        );
        let out = model_call(&x.to_dtype(DType::BF16).unwrap());
        let diff = (out.to_dtype(DType::F32).unwrap() - y).unwrap();
        diff.sqr().unwrap().mean_all().unwrap().backward().unwrap()
    };
    let ddp = on_ranks(2, |c| {
        let model = net(c.rank());
        model.to_dtype(DType::BF16).unwrap();
        let ddp = DistributedDataParallel::new(&model, &c, DdpConfig::default()).unwrap();
        let mut opt = adamw(&model);
        for k in 0..3 {
            let mut g = step_on(&|x| ddp.call(x).unwrap(), c.rank(), k);
            ddp.reduce_gradients(&mut g).unwrap();
            opt.step(&g).unwrap();
        }
        model.state_dict().unwrap()
    });
    let fsdp = on_ranks(2, |c| {
        let rank = c.rank();
        let model = net(rank);
        model.to_dtype(DType::BF16).unwrap();
        let c: Rc<dyn Collective> = Rc::new(c);
        let fsdp = wrap(model, &c);
        let mut opt = adamw(fsdp.module());
        for k in 0..3 {
            let g = step_on(&|x| fsdp.call(x).unwrap(), rank, k);
            opt.step(&g).unwrap();
        }
        let full = fsdp.state_dict().unwrap();
        assert_eq!(full.get("proj.weight").unwrap().dtype(), DType::BF16);
        full
    });
    for sd in &fsdp {
        assert_eq!(max_diff(sd, &ddp[0]), 0.0);
    }
}

/// Three steps with the forward under bfloat16 `autocast` (float32 master weights and
/// gradients): the model's state dict, under data parallelism or sharded.
fn autocast_run(comm: LocalGroup, sharded: bool) -> StateDict {
    let rank = comm.rank();
    let comm: Rc<dyn Collective> = Rc::new(comm);
    let (fsdp, plain) = if sharded {
        (Some(wrap(net(rank * 7), &comm)), None)
    } else {
        (None, Some(net(rank * 7)))
    };
    let ddp = plain
        .as_ref()
        .map(|m| DistributedDataParallel::new(m, &*comm, DdpConfig::default()).unwrap());
    let mut opt = match (&fsdp, &plain) {
        (Some(f), _) => adamw(f.module()),
        (_, Some(m)) => adamw(m),
        _ => unreachable!(),
    };
    for k in 0..3 {
        let (x, y) = share(&*comm, k);
        let out = autocast("cpu", DType::BF16, || match (&fsdp, &ddp) {
            (Some(f), _) => f
                .call(&x)
                .map_err(|e| candle_core::Error::Msg(e.to_string())),
            (_, Some(d)) => d
                .call(&x)
                .map_err(|e| candle_core::Error::Msg(e.to_string())),
            _ => unreachable!(),
        })
        .unwrap();
        assert_eq!(out.dtype(), DType::BF16);
        let mut g = loss(out.to_dtype(DType::F32).unwrap(), &y)
            .backward()
            .unwrap();
        if let Some(d) = &ddp {
            d.reduce_gradients(&mut g).unwrap();
        }
        opt.step(&g).unwrap();
    }
    match (&fsdp, &plain) {
        (Some(f), _) => f.state_dict().unwrap(),
        (_, Some(m)) => m.state_dict().unwrap(),
        _ => unreachable!(),
    }
}

#[test]
fn bfloat16_autocast_trains_as_data_parallelism() {
    let ddp = on_ranks(2, |c| autocast_run(c, false));
    for (r, model) in on_ranks(2, |c| autocast_run(c, true)).iter().enumerate() {
        assert_eq!(max_diff(model, &ddp[0]), 0.0, "rank {r}");
    }
    assert!(
        max_diff(&ddp[0], &net(0).state_dict().unwrap()) > 1e-3,
        "the steps train"
    );
}

#[test]
fn a_rank_updating_its_weights_while_another_waits_in_a_forward_does_not_deadlock() {
    // Rank 1's forward waits in the first unit's all-gather for rank 0, which first writes one
    // of its parameters. The write is an update that waits for the calls running in the process,
    // and rank 1's forward is one: rank 1 lets go of its call's share of the lock while its
    // collective waits (else: a timeout error after 20 s).
    let ranks = LocalGroup::with_timeout(2, std::time::Duration::from_secs(20)).unwrap();
    let outs: Vec<Tensor> = std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|c| {
                s.spawn(move || {
                    let rank = c.rank();
                    let comm: Rc<dyn Collective> = Rc::new(c);
                    // Every parameter in a unit: the root gathers nothing, so rank 1's first
                    // collective is inside its call.
                    let units = ["proj", "blocks.*", "head"];
                    let config = FsdpConfig::default().auto_wrap_policy(units);
                    let fsdp = FullyShardedDataParallel::new(net(0), comm.clone(), config).unwrap();
                    if rank == 0 {
                        std::thread::sleep(std::time::Duration::from_millis(300));
                        let p = &fsdp.module().proj.weight;
                        p.set(&p.tensor().unwrap().copy().unwrap()).unwrap();
                    }
                    let (x, _) = share(&*comm, 0);
                    fsdp.call(&x).unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(outs.len(), 2);
}
