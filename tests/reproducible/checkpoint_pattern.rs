//! Activation checkpointing by path pattern (issue 44, item 2): `CheckpointWrapper` fields turned
//! on by `apply_activation_checkpointing(&model, "blocks.*")` (PyTorch's
//! `apply_activation_checkpointing`, transformers' `gradient_checkpointing_enable()`). Training
//! is bit-identical to plain training (dropout included), the blocks' insides leave the graph,
//! paths, state dict and `print(model)` are the plain model's, hooks fire as documented, and a
//! pattern that cannot be checkpointed is a typed error that changes nothing.

use std::sync::Arc;

use module_runtime::nn::{Dropout, LayerNorm, GELU};
use module_runtime::prelude::*;
use module_runtime::{
    apply_activation_checkpointing, randn, remove_activation_checkpointing, CheckpointError,
    CheckpointWrapper, HookCtx,
};

use super::serial;

/// A residual block with dropout and a norm, taking its input by value (a checkpointed call
/// keeps it for the recomputation).
#[derive(Module)]
struct Block {
    fc1: Linear,
    act: GELU,
    drop: Dropout,
    fc2: Linear,
    norm: LayerNorm,
}

impl Forward<Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: Tensor) -> Result<Tensor> {
        let h = self.drop.call(&self.act.call(&self.fc1.call(&x)?)?)?;
        self.norm.call(&(self.fc2.call(&h)? + x)?)
    }
}

/// The same model with wrapped blocks (`W` = `CheckpointWrapper<Block>`) or plain ones.
#[derive(Module)]
struct Net<W: Module> {
    embed: Linear,
    blocks: Vec<W>,
    head: Linear,
}

fn block(dev: &Device) -> Result<Block> {
    Ok(Block {
        fc1: Linear::new(8, 32, dev)?,
        act: GELU::default(),
        drop: Dropout::new(0.2),
        fc2: Linear::new(32, 8, dev)?,
        norm: LayerNorm::new(8, dev)?,
    })
}

fn net<W: Module>(wrap: impl Fn(Block) -> W) -> Result<Net<W>> {
    let dev = Device::Cpu;
    manual_seed(7);
    Ok(Net {
        embed: Linear::new(6, 8, &dev)?,
        blocks: (0..3)
            .map(|_| block(&dev).map(&wrap))
            .collect::<Result<_>>()?,
        head: Linear::new(8, 3, &dev)?,
    })
}

impl<W: Module + Forward<Tensor, Output = Tensor>> Net<W> {
    fn run(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.embed.call(x)?;
        for b in &self.blocks {
            h = b.call(h)?;
        }
        self.head.call(&h)
    }
}

fn wrapped() -> Result<Net<CheckpointWrapper<Block>>> {
    net(CheckpointWrapper::new)
}

/// Losses of `steps` AdamW steps, and the state dict after them.
fn train<W: Module + Forward<Tensor, Output = Tensor>>(
    model: &Net<W>,
    steps: u64,
) -> Result<(Vec<f32>, super::Bits)> {
    model.train();
    let mut opt = AdamW::new(model, AdamW::options().lr(1e-2)).unwrap();
    let mut losses = Vec::new();
    for step in 0..steps {
        manual_seed(100 + step);
        let x = randn(0., 1., (5, 6), DType::F32, &Device::Cpu)?;
        let loss = model.run(&x)?.sqr()?.mean_all()?;
        losses.push(loss.to_scalar::<f32>()?);
        opt.step(&loss.backward()?).unwrap();
    }
    Ok((losses, super::bits(&model.state_dict()?)))
}

#[test]
fn pattern_checkpointed_training_is_bit_identical() -> Result<()> {
    let _serial = serial();
    let plain = train(&net(|b| b)?, 4)?;
    let model = wrapped()?;
    let on = apply_activation_checkpointing(&model, "blocks.*")?;
    assert_eq!(on, ["blocks.0", "blocks.1", "blocks.2"]);
    assert!(model.blocks.iter().all(CheckpointWrapper::is_checkpointing));
    let checkpointed = train(&model, 4)?;
    assert_eq!(checkpointed, plain);
    // Dropout drew other masks at each step: the losses moved.
    assert!(plain.0.windows(2).all(|w| w[0] != w[1]));
    Ok(())
}

#[test]
fn the_blocks_insides_leave_the_graph_and_come_back_off() -> Result<()> {
    let _serial = serial();
    let model = wrapped()?;
    model.train();
    let x = randn(0., 1., (5, 6), DType::F32, &Device::Cpu)?;
    // The blocks' hidden activations are [5, 32].
    let hidden = |y: &Tensor| {
        y.sorted_nodes()
            .iter()
            .filter(|n| n.dims() == [5, 32])
            .count()
    };
    assert!(hidden(&model.run(&x)?) > 0);
    apply_activation_checkpointing(&model, "blocks.*")?;
    assert_eq!(hidden(&model.run(&x)?), 0);
    // Only the matched block: the others keep theirs.
    assert_eq!(
        remove_activation_checkpointing(&model, "blocks.1")?,
        ["blocks.1"]
    );
    assert!(hidden(&model.run(&x)?) > 0);
    remove_activation_checkpointing(&model, "blocks.*")?;
    // Without gradients nothing is checkpointed either way: the plain call.
    apply_activation_checkpointing(&model, "**")?;
    let y = module_runtime::without_grad(|| model.run(&x))?;
    assert_eq!(y.dims(), [5, 3]);
    Ok(())
}

#[test]
fn the_wrapper_is_transparent() -> Result<()> {
    let _serial = serial();
    let plain = net(|b| b)?;
    let model = wrapped()?;
    let keys = |sd: StateDict| sd.keys().map(str::to_owned).collect::<Vec<_>>();
    assert_eq!(keys(model.state_dict()?), keys(plain.state_dict()?));
    assert_eq!(format!("{model}"), format!("{plain}"));
    let names = |v: Vec<(String, &dyn Module)>| -> Vec<String> {
        // Below the root, whose class name shows the test's type parameter.
        v.into_iter()
            .skip(1)
            .map(|(p, m)| format!("{p} {}", m.class_name()))
            .collect()
    };
    assert_eq!(names(model.named_modules()), names(plain.named_modules()));
    // A strict load into the wrapped model; its fields through `Deref`.
    model.load_state_dict(&plain.state_dict()?, &LoadOptions::default())?;
    assert_eq!(
        model.blocks[1].fc1.weight.tensor()?.to_vec2::<f32>()?,
        plain.blocks[1].fc1.weight.tensor()?.to_vec2::<f32>()?
    );
    Ok(())
}

#[test]
fn hooks_fire_on_the_block_once_and_inside_it_again_in_the_recomputation() -> Result<()> {
    let _serial = serial();
    let model = wrapped()?;
    model.train();
    apply_activation_checkpointing(&model, "blocks.*")?;
    let hooks = Hooks::new();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    for pattern in ["blocks.1", "blocks.1.fc1"] {
        let seen = seen.clone();
        let hook = move |ctx: &HookCtx<'_>, _: &[Tensor], _: &[Tensor]| {
            seen.lock().unwrap().push(ctx.path().to_owned());
            Ok(None)
        };
        hooks.register_forward_hook(pattern, hook, HookOptions::default())?;
    }
    let x = randn(0., 1., (5, 6), DType::F32, &Device::Cpu)?;
    hooks.run(&model, |m| {
        m.run(&x)?.sum_all()?.backward().map_err(Error::from)
    })?;
    // The forward: `blocks.1.fc1` inside `blocks.1`; the recomputation: `fc1` again only.
    assert_eq!(
        *seen.lock().unwrap(),
        ["blocks.1.fc1", "blocks.1", "blocks.1.fc1"]
    );
    Ok(())
}

#[test]
fn patterns_that_cannot_be_checkpointed_are_typed_errors() -> Result<()> {
    let _serial = serial();
    let model = wrapped()?;
    match apply_activation_checkpointing(&model, "blokcs.*") {
        Err(Error::NoModuleMatch { what, near, .. }) => {
            assert_eq!(what, "activation checkpointing");
            assert!(near.iter().any(|p| p.starts_with("blocks.")), "{near:?}");
        }
        other => panic!("expected NoModuleMatch, got {other:?}"),
    }
    // A module that is not wrapped.
    let err = apply_activation_checkpointing(&model, "head").unwrap_err();
    match &err {
        Error::ActivationCheckpoint(CheckpointError::NotWrapped { path, class, .. }) => {
            assert_eq!((path.as_str(), class.as_str()), ("head", "Linear"));
        }
        other => panic!("expected NotWrapped, got {other:?}"),
    }
    assert!(
        err.to_string().contains("CheckpointWrapper<Linear>"),
        "{err}"
    );
    // The plain model has no wrapper anywhere.
    let plain = net(|b| b)?;
    assert!(apply_activation_checkpointing(&plain, "blocks.*").is_err());
    // Nothing was turned on by the failures.
    assert!(!model.blocks.iter().any(CheckpointWrapper::is_checkpointing));
    Ok(())
}
