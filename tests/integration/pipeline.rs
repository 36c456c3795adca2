//! Pipeline parallelism on ranks as threads (`LocalGroup`): point-to-point `send`/`recv`, a
//! model split over 2 and 3 stages by path, GPipe and 1F1B, training bitwise equal to one
//! process accumulating the same micro-batches, and the typed errors.

use std::collections::HashMap;
use std::time::Duration;

use module_runtime::candle_core::backprop::GradStore;
use module_runtime::distributed::{
    Collective, LocalGroup, PipelineSplit, PipelineStage, PipelineStep, Schedule1F1B, ScheduleGPipe,
};
use module_runtime::optim::{AdamW, Optimizer, ParamList};
use module_runtime::prelude::*;
use module_runtime::{build_empty, StateDict};

use crate::support::values;

#[derive(Module)]
struct Block {
    fc: Linear,
}

#[derive(Module)]
struct Net {
    embed: Linear,
    layers: Vec<Block>,
    head: Linear,
}

const LAYERS: usize = 4;

impl Net {
    /// The model with Linear's own initialization (nothing drawn under `build_empty`).
    fn layout() -> Result<Net> {
        let lin = |i, o| Linear::new(i, o, &Device::Cpu);
        Ok(Net {
            embed: lin(5, 8)?,
            layers: (0..LAYERS)
                .map(|_| Ok(Block { fc: lin(8, 8)? }))
                .collect::<Result<_>>()?,
            head: lin(8, 3)?,
        })
    }

    /// The model with seeded weights.
    fn new() -> Result<Net> {
        let net = Net::layout()?;
        for (i, p) in net.parameters().iter().enumerate() {
            p.set(&values(i as u64, p.shape().dims(), &Device::Cpu))?;
        }
        Ok(net)
    }

    /// The embedding (when `first`), the blocks `layers`, the head (when `last`).
    fn part(
        &self,
        x: &Tensor,
        first: bool,
        layers: std::ops::Range<usize>,
        last: bool,
    ) -> Result<Tensor> {
        let mut h = if first {
            self.embed.call(x)?.tanh()?
        } else {
            x.clone()
        };
        for block in &self.layers[layers] {
            h = (block.fc.call(&h)?.tanh()? + &h)?;
        }
        if last {
            h = self.head.call(&h)?;
        }
        Ok(h)
    }
}

fn mse(y: &Tensor, t: &Tensor) -> Result<Tensor> {
    Ok((y - t)?.sqr()?.mean_all()?)
}

fn batch() -> (Tensor, Tensor) {
    (
        values(7, &[8, 5], &Device::Cpu),
        values(8, &[8, 3], &Device::Cpu),
    )
}

const STEPS: usize = 3;

fn adamw(params: Vec<(String, Param)>) -> AdamW {
    AdamW::new(
        &ParamList(params),
        AdamW::options().lr(0.05).weight_decay(0.01),
    )
    .unwrap()
}

/// One process: each step the micro-batches' gradients summed in order and divided by their
/// count, then AdamW. The losses of every step and the final state dict.
fn single_process(n_mb: usize) -> (Vec<Vec<f32>>, StateDict) {
    let model = Net::new().unwrap();
    let mut opt = adamw(model.named_parameters());
    let (x, y) = batch();
    let rows = 8 / n_mb;
    let mut losses = Vec::new();
    for _ in 0..STEPS {
        let mut sums: HashMap<usize, Tensor> = HashMap::new();
        let mut step_losses = Vec::new();
        for k in 0..n_mb {
            let out = model
                .part(&x.narrow(0, k * rows, rows).unwrap(), true, 0..LAYERS, true)
                .unwrap();
            let loss = mse(&out, &y.narrow(0, k * rows, rows).unwrap()).unwrap();
            step_losses.push(loss.to_scalar::<f32>().unwrap());
            let g = loss.backward().unwrap();
            for p in model.parameters() {
                let gp = g.get(p.var().unwrap().as_tensor()).unwrap().clone();
                let s = match sums.remove(&p.id()) {
                    Some(s) => (s + gp).unwrap(),
                    None => gp,
                };
                sums.insert(p.id(), s);
            }
        }
        let mut grads = GradStore::default();
        let n = Tensor::new(n_mb as f32, &Device::Cpu).unwrap();
        for p in model.parameters() {
            let g = sums[&p.id()].broadcast_div(&n).unwrap();
            grads.insert(p.var().unwrap().as_tensor(), g);
        }
        opt.step(&grads).unwrap();
        losses.push(step_losses);
    }
    (losses, model.state_dict().unwrap())
}

/// The blocks of each stage: `[0..2, 2..4]` for 2 stages, `[0..1, 1..3, 3..4]` for 3.
fn blocks(num_stages: usize) -> Vec<std::ops::Range<usize>> {
    match num_stages {
        2 => vec![0..2, 2..4],
        _ => vec![0..1, 1..3, 3..4],
    }
}

fn split_for(num_stages: usize) -> PipelineSplit {
    let ranges = blocks(num_stages);
    let stages: Vec<Vec<String>> = ranges
        .iter()
        .enumerate()
        .map(|(s, r)| {
            let mut paths: Vec<String> = r.clone().map(|i| format!("layers.{i}")).collect();
            if s == 0 {
                paths.insert(0, "embed".into());
            }
            if s + 1 == num_stages {
                paths.push("head".into());
            }
            paths
        })
        .collect();
    PipelineSplit::new(stages).unwrap()
}

/// Each rank of a `num_stages` pipeline: the model built empty, its stage loaded from the
/// initial weights, `STEPS` AdamW steps. Per rank: the last stage's losses and the stage's
/// state dict.
fn pipeline(num_stages: usize, n_mb: usize, one_f_one_b: bool) -> Vec<(Vec<Vec<f32>>, StateDict)> {
    let initial = Net::new().unwrap().state_dict().unwrap();
    let split = split_for(num_stages);
    let ranks = LocalGroup::with_timeout(num_stages, Duration::from_secs(60)).unwrap();
    std::thread::scope(|s| {
        let handles: Vec<_> = ranks
            .into_iter()
            .map(|comm| {
                let (initial, split) = (&initial, &split);
                s.spawn(move || -> Result<(Vec<Vec<f32>>, StateDict)> {
                    let model = build_empty(Net::layout)?;
                    let rank = comm.rank();
                    let range = blocks(num_stages)[rank].clone();
                    let (first, last) = (rank == 0, rank + 1 == num_stages);
                    let stage = PipelineStage::new(&model, split, &comm, |x| {
                        model.part(x, first, range.clone(), last)
                    })?;
                    stage.load_state_dict(initial)?;
                    // Only the stage's weights exist on this rank.
                    for (path, p) in model.named_parameters() {
                        let mine = stage.paths().contains(&path);
                        assert_eq!(p.is_built(), mine, "rank {rank}: {path}");
                    }
                    let mut opt = adamw(stage.named_parameters().to_vec());
                    let (x, y) = batch();
                    let (x, y) = (first.then_some(&x), last.then_some(&y));
                    let mut losses = Vec::new();
                    for _ in 0..STEPS {
                        let step: PipelineStep = if one_f_one_b {
                            Schedule1F1B::new(&stage, n_mb, mse)?.step(x, y)?
                        } else {
                            ScheduleGPipe::new(&stage, n_mb, mse)?.step(x, y)?
                        };
                        opt.step(&step.grads).unwrap();
                        if last {
                            assert_eq!(step.output.as_ref().unwrap().dims(), [8, 3]);
                        }
                        losses.push(
                            step.losses
                                .iter()
                                .map(|l| l.to_scalar::<f32>())
                                .collect::<candle_core::Result<_>>()?,
                        );
                    }
                    Ok((losses, stage.state_dict()?))
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap().unwrap())
            .collect()
    })
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
        .into_iter()
        .map(f32::to_bits)
        .collect()
}

fn check_equal_to_one_process(num_stages: usize, n_mb: usize, one_f_one_b: bool) {
    let (want_losses, want) = single_process(n_mb);
    let ranks = pipeline(num_stages, n_mb, one_f_one_b);
    let (losses, _) = ranks.last().unwrap();
    assert_eq!(
        losses, &want_losses,
        "{num_stages} stages, {n_mb} micro-batches"
    );
    // The union of the stages' state dicts is the single process's, bit for bit.
    let mut keys = Vec::new();
    for (_, sd) in &ranks {
        for (key, value) in sd.iter() {
            let expected = want.get(key).unwrap_or_else(|| panic!("unexpected {key}"));
            assert_eq!(bits(value), bits(expected), "{key}");
            keys.push(key.to_owned());
        }
    }
    let all: Vec<String> = want.keys().map(str::to_owned).collect();
    assert_eq!(keys, all);
}

#[test]
fn gpipe_two_stages_equals_one_process() {
    check_equal_to_one_process(2, 4, false);
}

#[test]
fn one_f_one_b_two_stages_equals_one_process() {
    check_equal_to_one_process(2, 4, true);
}

#[test]
fn gpipe_three_stages_equals_one_process() {
    check_equal_to_one_process(3, 4, false);
}

#[test]
fn one_f_one_b_three_stages_equals_one_process() {
    check_equal_to_one_process(3, 4, true);
    // Fewer micro-batches than stages: warm-up only, no steady state on stage 0.
    check_equal_to_one_process(3, 2, true);
}
