//! `ShardedGradScaler` over sharded gradients (`FullyShardedDataParallel` on a 2-rank
//! `LocalGroup`): an inf in one rank's shard makes every rank skip the step and back off its
//! scale, where a plain `GradScaler` skips on that rank alone and the ranks part.

use std::rc::Rc;

use module_runtime::distributed::{Collective, LocalGroup};
use module_runtime::optim::{
    FsdpConfig, FullyShardedDataParallel, GradScaler, GradScalerOptions, SgdOptions,
    ShardedGradScaler, SGD,
};
use module_runtime::prelude::*;

#[derive(Module)]
struct Net {
    layers: Vec<Linear>,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.layers[0].call(x)?.tanh()?;
        self.layers[1].call(&h)
    }
}

fn net() -> Net {
    let dev = Device::Cpu;
    let m = Net {
        layers: vec![
            Linear::new(4, 5, &dev).unwrap(),
            Linear::new(5, 2, &dev).unwrap(),
        ],
    };
    for (i, (_, p)) in m.named_parameters().into_iter().enumerate() {
        let v: Vec<f32> = (0..p.elem_count())
            .map(|k| (((k + 7 * i) * 13) % 11) as f32 / 11.0 - 0.5)
            .collect();
        p.set(&Tensor::from_vec(v, p.shape(), &dev).unwrap())
            .unwrap();
    }
    m
}

/// What one rank saw: whether each of two steps ran, the scale after each update, and the
/// first layer's full weight at the end.
type Seen = (Vec<bool>, Vec<f64>, Vec<f32>);

/// Two scaled steps on a 2-rank group; in the first, rank 0 finds an inf in its shard of
/// `layers.0.weight`'s gradient. `sharded` picks the scaler.
fn run(comm: LocalGroup, sharded: bool) -> Seen {
    let rank = comm.rank();
    let comm: Rc<dyn Collective> = Rc::new(comm);
    let config = FsdpConfig::default().auto_wrap_policy(["layers.*"]);
    let fsdp = FullyShardedDataParallel::new(net(), comm.clone(), config).unwrap();
    let mut opt = SGD::new(fsdp.module(), SgdOptions::new(0.1)).unwrap();
    let options = GradScalerOptions::default();
    let (mut plain, mut shared) = if sharded {
        (None, Some(ShardedGradScaler::new(options, comm).unwrap()))
    } else {
        (Some(GradScaler::new(options).unwrap()), None)
    };
    let (mut stepped, mut scales) = (Vec::new(), Vec::new());
    for k in 0..2 {
        let x = Tensor::full(0.1 * (k + rank + 1) as f32, (3, 4), &Device::Cpu).unwrap();
        let loss = fsdp.call(&x).unwrap().sqr().unwrap().mean_all().unwrap();
        let scaled = match (&mut plain, &mut shared) {
            (Some(s), _) => s.scale(&loss).unwrap(),
            (_, Some(s)) => s.scale(&loss).unwrap(),
            _ => unreachable!(),
        };
        let mut grads = scaled.backward().unwrap();
        if k == 0 && rank == 0 {
            let var = fsdp.module().layers[0].weight.var().unwrap();
            let g = grads.get(var.as_tensor()).unwrap();
            let mut v = g.to_vec1::<f32>().unwrap();
            v[1] = f32::INFINITY;
            grads.insert(
                var.as_tensor(),
                Tensor::new(v.as_slice(), &Device::Cpu).unwrap(),
            );
        }
        let (ran, scale) = match (&mut plain, &mut shared) {
            (Some(s), _) => {
                let ran = s.step(&mut opt, &mut grads).unwrap();
                s.update(None).unwrap();
                (ran, s.get_scale())
            }
            (_, Some(s)) => {
                let ran = s.step(&mut opt, &mut grads).unwrap();
                s.update(None).unwrap();
                (ran, s.get_scale())
            }
            _ => unreachable!(),
        };
        stepped.push(ran);
        scales.push(scale);
    }
    let full = fsdp.state_dict().unwrap();
    let w = full.get("layers.0.weight").unwrap();
    (stepped, scales, w.flatten_all().unwrap().to_vec1().unwrap())
}

fn on_ranks(f: impl Fn(LocalGroup) -> Seen + Sync) -> Vec<Seen> {
    let ranks = LocalGroup::with_timeout(2, std::time::Duration::from_secs(30)).unwrap();
    std::thread::scope(|s| {
        let f = &f;
        let handles: Vec<_> = ranks.into_iter().map(|c| s.spawn(move || f(c))).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

#[test]
fn an_inf_in_one_ranks_shard_skips_the_step_on_every_rank() {
    let seen = on_ranks(|c| run(c, true));
    for (stepped, scales, _) in &seen {
        assert_eq!(stepped, &[false, true]);
        assert_eq!(scales, &[32768.0, 32768.0]);
    }
    assert_eq!(seen[0].2, seen[1].2, "the ranks hold the same model");
    assert_ne!(seen[0].2, {
        let w = net().layers[0].weight.tensor().unwrap();
        w.flatten_all().unwrap().to_vec1::<f32>().unwrap()
    });
}

#[test]
fn a_plain_grad_scaler_would_let_the_ranks_part() {
    let seen = on_ranks(|c| run(c, false));
    assert_eq!(seen[0].0, [false, true], "rank 0 saw the inf");
    assert_eq!(seen[1].0, [true, true], "rank 1 did not");
    assert_ne!(seen[0].1, seen[1].1, "their scales differ");
}
