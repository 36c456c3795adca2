//! Activation checkpointing (issue 44, item 2): `checkpoint(function, inputs)`, PyTorch's
//! `torch.utils.checkpoint.checkpoint(function, *inputs, use_reentrant=False)`. Checkpointed and
//! plain training agree bit for bit (dropout included), nothing of the function's inside stays
//! in the graph, and what cannot be checkpointed is a typed error.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use candle_core::Var;
use module_runtime::nn::{Dropout, LayerNorm, GELU};
use module_runtime::prelude::*;
use module_runtime::{checkpoint, randn, CheckpointError, HookCtx};

use super::serial;

/// A residual block with dropout and a norm: every kind of op a transformer layer has.
#[derive(Module)]
struct Block {
    fc1: Linear,
    act: GELU,
    drop: Dropout,
    fc2: Linear,
    norm: LayerNorm,
}

impl Block {
    fn new(dim: usize, dev: &Device) -> Result<Self> {
        Ok(Self {
            fc1: Linear::new(dim, 4 * dim, dev)?,
            act: GELU::default(),
            drop: Dropout::new(0.2),
            fc2: Linear::new(4 * dim, dim, dev)?,
            norm: LayerNorm::new(dim, dev)?,
        })
    }
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.drop.call(&self.act.call(&self.fc1.call(x)?)?)?;
        self.norm.call(&(self.fc2.call(&h)? + x)?)
    }
}

/// Blocks shared through `Arc`, so a checkpointed call can run one again during the backward.
#[derive(Module)]
struct Net {
    embed: Linear,
    blocks: Vec<Arc<Block>>,
    head: Linear,
}

impl Net {
    fn new(dev: &Device) -> Result<Self> {
        manual_seed(7);
        Ok(Self {
            embed: Linear::new(6, 8, dev)?,
            blocks: (0..3)
                .map(|_| Block::new(8, dev).map(Arc::new))
                .collect::<Result<_>>()?,
            head: Linear::new(8, 3, dev)?,
        })
    }

    /// The forward, with each block checkpointed or not; `order` lists the blocks run (a block
    /// may appear twice).
    fn run(&self, x: &Tensor, order: &[usize], checkpointed: bool) -> Result<Tensor> {
        let mut h = self.embed.call(x)?;
        for &i in order {
            h = if checkpointed {
                let block = self.blocks[i].clone();
                // Called on the block inside the `Arc` (not on this clone of the `Arc`, which is
                // not part of the model): hooks see it at its path.
                checkpoint(move |xs| Ok(vec![(*block).call(&xs[0])?]), &[h])?.remove(0)
            } else {
                self.blocks[i].call(&h)?
            };
        }
        self.head.call(&h)
    }
}

/// Each parameter's values, by path.
type Values = Vec<(String, Vec<f32>)>;

fn values(model: &Net) -> Values {
    model
        .named_parameters()
        .into_iter()
        .map(|(path, p)| {
            let v = p
                .tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap();
            (path, v)
        })
        .collect()
}

/// Losses of `steps` AdamW steps, and the parameters after them.
fn train(order: &[usize], checkpointed: bool, steps: u64) -> Result<(Vec<f32>, Values)> {
    let dev = Device::Cpu;
    let model = Net::new(&dev)?;
    model.train();
    let mut opt = AdamW::new(&model, AdamW::options().lr(1e-2)).unwrap();
    let mut losses = Vec::new();
    for step in 0..steps {
        manual_seed(100 + step);
        let x = randn(0., 1., (5, 6), DType::F32, &dev)?;
        let loss = model.run(&x, order, checkpointed)?.sqr()?.mean_all()?;
        losses.push(loss.to_scalar::<f32>()?);
        let grads = loss.backward()?;
        opt.step(&grads).unwrap();
    }
    Ok((losses, values(&model)))
}

#[test]
fn checkpointed_training_is_bit_identical_with_dropout() -> Result<()> {
    let _serial = serial();
    let order = [0, 1, 2];
    let (plain_losses, plain) = train(&order, false, 4)?;
    let (losses, checkpointed) = train(&order, true, 4)?;
    assert_eq!(losses, plain_losses);
    assert_eq!(checkpointed, plain);
    // Dropout drew different masks at each step: the losses moved (the test is not vacuous).
    assert!(plain_losses.windows(2).all(|w| w[0] != w[1]));
    Ok(())
}

#[test]
fn a_block_used_twice_is_bit_identical() -> Result<()> {
    let _serial = serial();
    let order = [1, 0, 1];
    let (plain_losses, plain) = train(&order, false, 3)?;
    let (losses, checkpointed) = train(&order, true, 3)?;
    assert_eq!(losses, plain_losses);
    assert_eq!(checkpointed, plain);
    Ok(())
}

#[test]
fn nothing_of_the_inside_stays_in_the_graph() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    let model = Net::new(&dev)?;
    model.train();
    let x = randn(0., 1., (5, 6), DType::F32, &dev)?;
    // The blocks' hidden activations are [5, 32]: plain, the graph holds them; checkpointed, none.
    let hidden = |y: &Tensor| {
        y.sorted_nodes()
            .iter()
            .filter(|n| n.dims() == [5, 32])
            .count()
    };
    assert!(hidden(&model.run(&x, &[0, 1, 2], false)?) > 0);
    assert_eq!(hidden(&model.run(&x, &[0, 1, 2], true)?), 0);
    Ok(())
}

#[test]
fn a_parameter_used_inside_and_outside_gets_both_parts() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    let model = Net::new(&dev)?;
    let x = Var::randn(0f32, 1., (5, 8), &dev)?;
    let block = model.blocks[0].clone();
    let weight = block.fc2.weight.tensor()?;
    // fc2's weight is read by the block and again outside it.
    let outside = |y: &Tensor| -> Result<Tensor> { Ok((y.sum_all()? + weight.sqr()?.sum_all()?)?) };
    manual_seed(1);
    let plain = outside(&block.call(x.as_tensor())?)?.backward()?;
    manual_seed(1);
    let b = block.clone();
    let y = checkpoint(
        move |xs| Ok(vec![b.call(&xs[0])?]),
        &[x.as_tensor().clone()],
    )?;
    let checkpointed = outside(&y[0])?.backward()?;
    for t in [&weight, x.as_tensor(), &block.fc1.weight.tensor()?] {
        let a = plain.get(t).unwrap().flatten_all()?.to_vec1::<f32>()?;
        let b = checkpointed
            .get(t)
            .unwrap()
            .flatten_all()?
            .to_vec1::<f32>()?;
        assert_eq!(a, b);
    }
    Ok(())
}

#[test]
fn a_function_without_parameters_and_several_outputs() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    let x = Var::randn(0f32, 1., (4, 5), &dev)?;
    let f = |xs: &[Tensor]| -> Result<Vec<Tensor>> {
        let drop = Dropout::new(0.5);
        let h = drop.call(&xs[0].gelu_erf()?)?;
        Ok(vec![h.sqr()?, h.exp()?, xs[1].clone()])
    };
    let ids = Tensor::new(&[1u32, 2, 3], &dev)?;
    let loss = |outs: &[Tensor]| -> Result<Tensor> {
        // The second output is not used: its gradient is none, as PyTorch's.
        Ok((outs[0].sum_all()? * 3.0)?)
    };
    manual_seed(3);
    let plain = loss(&f(&[x.as_tensor().clone(), ids.clone()])?)?.backward()?;
    manual_seed(3);
    let outs = checkpoint(f, &[x.as_tensor().clone(), ids.clone()])?;
    assert_eq!(outs[2].to_vec1::<u32>()?, [1, 2, 3]);
    let checkpointed = loss(&outs)?.backward()?;
    let a = plain.get(x.as_tensor()).unwrap().to_vec2::<f32>()?;
    let b = checkpointed.get(x.as_tensor()).unwrap().to_vec2::<f32>()?;
    assert_eq!(a, b);
    assert!(a.iter().flatten().any(|v| *v == 0.0) && a.iter().flatten().any(|v| *v != 0.0));
    Ok(())
}

#[test]
fn without_gradients_it_is_the_function() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    let model = Net::new(&dev)?;
    let block = model.blocks[0].clone();
    model.eval();
    let x = Tensor::ones((2, 8), DType::F32, &dev)?;
    let _off = no_grad();
    let b = block.clone();
    let y = checkpoint(
        move |xs| Ok(vec![b.call(&xs[0])?]),
        std::slice::from_ref(&x),
    )?;
    assert!(!y[0].track_op());
    assert_eq!(y[0].to_vec2::<f32>()?, block.call(&x)?.to_vec2::<f32>()?);
    Ok(())
}

/// The checkpoint error a failed backward carries (candle wraps it; converting gives it back).
fn checkpoint_error(e: candle_core::Error) -> Option<CheckpointError> {
    match Error::from(e) {
        Error::ActivationCheckpoint(c) => Some(c),
        _ => None,
    }
}

#[test]
fn errors_are_typed() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    let x = Var::randn(0f32, 1., (3, 4), &dev)?;
    let xs = [x.as_tensor().clone()];
    let e = checkpoint(|_| Ok(vec![]), &xs).unwrap_err();
    assert!(
        matches!(e, Error::ActivationCheckpoint(CheckpointError::NoOutput)),
        "{e}"
    );

    // A recomputation whose output has another shape fails the backward, naming both.
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let y = checkpoint(
        move |xs| {
            let n = c.fetch_add(1, Ordering::SeqCst);
            Ok(vec![if n == 0 {
                xs[0].exp()?
            } else {
                xs[0].exp()?.sum(0)?
            }])
        },
        &xs,
    )?;
    let e = y[0].sum_all()?.backward().unwrap_err();
    match checkpoint_error(e) {
        Some(CheckpointError::Recomputed {
            forward,
            recomputed,
        }) => {
            assert_eq!(
                (forward.as_str(), recomputed.as_str()),
                ("([3, 4] F32)", "([4] F32)")
            );
        }
        other => panic!("{other:?}"),
    }

    // A recomputation that reads a parameter the forward did not.
    let (a, b) = (
        Var::ones((3, 4), DType::F32, &dev)?,
        Var::ones((3, 4), DType::F32, &dev)?,
    );
    let calls = Arc::new(AtomicUsize::new(0));
    let c = calls.clone();
    let y = checkpoint(
        move |xs| {
            let w = if c.fetch_add(1, Ordering::SeqCst) == 0 {
                &a
            } else {
                &b
            };
            Ok(vec![xs[0].mul(w.as_tensor())?])
        },
        &xs,
    )?;
    let e = y[0].sum_all()?.backward().unwrap_err();
    let e = checkpoint_error(e);
    assert!(
        matches!(e, Some(CheckpointError::NewParameter { .. })),
        "{e:?}"
    );
    Ok(())
}

#[test]
fn forward_hooks_fire_again_in_the_recomputation() -> Result<()> {
    let _serial = serial();
    let dev = Device::Cpu;
    let model = Net::new(&dev)?;
    let x = Tensor::ones((2, 6), DType::F32, &dev)?;
    let hooks = Hooks::new();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for pattern in ["blocks.*", "blocks.*.fc1"] {
        let seen = seen.clone();
        let hook = move |ctx: &HookCtx<'_>, _: &[Tensor], _: &[Tensor]| {
            seen.lock().unwrap().push(ctx.path().to_owned());
            Ok(None)
        };
        hooks.register_forward_hook(pattern, hook, HookOptions::default())?;
    }
    // A run around the forward and the backward: every module inside a checkpoint fires its
    // forward hooks twice, as with PyTorch's non-reentrant checkpoint (the recomputation runs
    // the backward's blocks last to first).
    hooks.run(&model, |m| {
        m.run(&x, &[0, 1], true)?
            .sum_all()?
            .backward()
            .map_err(Error::from)
    })?;
    let calls = std::mem::take(&mut *seen.lock().unwrap());
    let once = ["blocks.0.fc1", "blocks.0", "blocks.1.fc1", "blocks.1"];
    let again = ["blocks.1.fc1", "blocks.1", "blocks.0.fc1", "blocks.0"];
    assert_eq!(calls, [once, again].concat());
    // Around the forward only: once.
    let y = hooks.run(&model, |m| m.run(&x, &[0, 1], true))?;
    y.sum_all()?.backward()?;
    assert_eq!(*seen.lock().unwrap(), once);
    Ok(())
}
