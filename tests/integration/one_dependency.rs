//! A user's crate has one dependency, `module-runtime`, and one import, its prelude: with nothing
//! else, a model is defined and trained with `torch.optim`'s AdamW, groups, clipping and a schedule
//! (issue 41). This package is such a crate: its manifest names no other runtime crate.

use module_runtime::prelude::*;

type AnyResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

#[derive(Module)]
struct Regressor {
    hidden: Linear,
    out: Linear,
}

impl Forward<&Tensor> for Regressor {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.out.call(&self.hidden.call(x)?.tanh()?)
    }
}

/// Every name below comes from the prelude: `AdamW`, `ParamGroups`, `StepLr`, `LrScheduler`,
/// `clip_grad_norm`, the `Optimizer` trait (`step`, `params`, `lrs`). The loss of a small
/// regression falls to a tenth of where it started; a prelude without the optimizers would not
/// compile, and an optimizer that did not update the model would not get there.
#[test]
fn a_model_trains_with_adamw_from_the_prelude() -> AnyResult<()> {
    let dev = Device::Cpu;
    let model = Regressor {
        hidden: Linear::new(4, 16, &dev)?,
        out: Linear::new(16, 1, &dev)?,
    };
    let x = Tensor::randn(0f32, 1.0, (64, 4), &dev)?;
    let w = Tensor::new(&[[0.5f32], [-1.0], [2.0], [0.25]], &dev)?;
    let y = x.matmul(&w)?;
    let mse =
        |model: &Regressor| -> Result<Tensor> { Ok(model.call(&x)?.sub(&y)?.sqr()?.mean_all()?) };

    let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
    let mut opt = AdamW::with_groups(&model, AdamW::options().lr(0.02), &groups)?;
    let mut schedule = StepLr::new(&mut opt, 100, 0.5);
    let first = mse(&model)?.to_scalar::<f32>()?;
    for _ in 0..200 {
        let mut grads = mse(&model)?.backward()?;
        clip_grad_norm(&mut grads, opt.params(), 5.0, 2.0, false)?;
        opt.step(&grads)?;
        schedule.step(&mut opt);
    }
    let last = mse(&model)?.to_scalar::<f32>()?;
    assert!(last < first / 10.0, "loss {first} -> {last}");
    assert_eq!(
        opt.lrs(),
        [0.005, 0.005],
        "two halvings of 0.02 in 200 steps, both groups"
    );
    Ok(())
}

/// The root package's manifest depends on `module-runtime` and on no other runtime crate (the
/// optimizers came as `module-optim`, a second dependency, before the façade re-exported them);
/// nor do the model packages'.
#[test]
fn the_packages_depend_on_the_facade_alone() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for manifest in ["Cargo.toml", "minilm/Cargo.toml", "llama/Cargo.toml"] {
        let text = std::fs::read_to_string(root.join(manifest)).unwrap();
        let others: Vec<&str> = text
            .lines()
            .map(str::trim_start)
            .filter(|l| l.starts_with("module-") && !l.starts_with("module-runtime "))
            .collect();
        assert!(
            others.is_empty(),
            "{manifest} depends on runtime crates besides module-runtime: {others:?}"
        );
        assert!(text.contains("\nmodule-runtime = "), "{manifest}");
    }
}
