//! Inference habits: the `no_grad` scope (PyTorch's `torch.no_grad()`), and models built only to be
//! loaded (PyTorch's `meta` device + `load_state_dict(assign=True)`).
//!
//! PyTorch's behaviour these tests hold us to, from its source and tests:
//! - the grad mode is thread-local and a new thread starts enabled (`torch/csrc/autograd/grad_mode.h`,
//!   `GradMode` over a thread-local `AutogradState`; `test_autograd.py::test_no_grad_thread_local`
//!   style checks);
//! - `no_grad` nests with `enable_grad`, each restoring the previous mode on exit, also on an
//!   exception (`torch/autograd/grad_mode.py`, `_NoParamDecoratorContextManager.__exit__`);
//! - outputs computed under `no_grad` have `requires_grad=False`, and the same computation outside it
//!   records a graph whose backward reaches the parameters.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Barrier};

use candle_module::fixtures::max_abs_diff as max_diff;
use module_runtime::prelude::*;
use module_runtime::{enable_grad, is_grad_enabled, no_grad, without_grad};

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    norm: module_runtime::nn::LayerNorm,
    fc2: Linear,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.fc1.call(x)?.gelu_erf()?;
        let h = self.norm.call(&h)?;
        self.fc2.call(&h)
    }
}

fn mlp(dev: &Device) -> Result<Mlp> {
    Ok(Mlp {
        fc1: Linear::new(6, 16, dev)?,
        norm: module_runtime::nn::LayerNorm::new(16, dev)?,
        fc2: Linear::new(16, 3, dev)?,
    })
}

fn input(dev: &Device) -> Result<Tensor> {
    Ok(Tensor::arange(0f32, 30., dev)?
        .reshape((5, 6))?
        .affine(0.1, -1.0)?)
}

#[test]
fn no_grad_records_nothing_and_gives_the_same_values() -> Result<()> {
    let dev = Device::Cpu;
    let model = mlp(&dev)?;
    model.eval();
    let x = input(&dev)?;
    let with_graph = model.call(&x)?;
    assert!(
        with_graph.track_op(),
        "outside the scope the graph is recorded"
    );
    let y = {
        let _guard = no_grad();
        model.call(&x)?
    };
    assert!(!y.track_op(), "under no_grad nothing is recorded");
    // The fused inference kernels (layer norm) and the composed ones agree to rounding.
    assert!(max_diff(&y, &with_graph) < 1e-5);
    // Nothing was frozen: every parameter is still trained.
    assert!(model.parameters().iter().all(|p| p.requires_grad()));
    Ok(())
}

#[test]
fn backward_outside_the_scope_still_reaches_every_parameter() -> Result<()> {
    let dev = Device::Cpu;
    let model = mlp(&dev)?;
    let x = input(&dev)?;
    {
        let _guard = no_grad();
        model.call(&x)?;
    }
    let loss = model.call(&x)?.sqr()?.sum_all()?;
    let grads = loss.backward()?;
    for (name, p) in model.named_parameters() {
        assert!(
            grads.get(p.var()?.as_tensor()).is_some(),
            "{name} has no gradient"
        );
    }
    // The same loss computed under the scope has no graph to go back through.
    let frozen_loss = without_grad(|| model.call(&x))?.sqr()?.sum_all()?;
    let grads = frozen_loss.backward()?;
    for (name, p) in model.named_parameters() {
        assert!(
            grads.get(p.var()?.as_tensor()).is_none(),
            "{name} got a gradient"
        );
    }
    Ok(())
}

#[test]
fn scopes_nest_with_enable_grad() -> Result<()> {
    let dev = Device::Cpu;
    let model = mlp(&dev)?;
    let x = input(&dev)?;
    let _outer = no_grad();
    assert!(!model.call(&x)?.track_op());
    {
        let _inner = enable_grad();
        assert!(is_grad_enabled());
        assert!(model.call(&x)?.track_op());
        {
            let _again = no_grad();
            assert!(!model.call(&x)?.track_op());
        }
        assert!(model.call(&x)?.track_op());
    }
    assert!(!model.call(&x)?.track_op());
    Ok(())
}

#[test]
fn the_mode_is_per_thread() -> Result<()> {
    let dev = Device::Cpu;
    let model = Arc::new(mlp(&dev)?);
    let x = input(&dev)?;
    // Two threads run at the same time, one inside a scope and one outside; each sees its own mode.
    let barrier = Arc::new(Barrier::new(2));
    let spawn = |scoped: bool| {
        let (model, x, barrier) = (model.clone(), x.clone(), barrier.clone());
        std::thread::spawn(move || -> Result<bool> {
            let _guard = scoped.then(no_grad);
            barrier.wait(); // both are in (or out of) their scope now
            let tracked = model.call(&x)?.track_op();
            barrier.wait();
            Ok(tracked)
        })
    };
    let scoped = spawn(true);
    let plain = spawn(false);
    assert!(!scoped.join().unwrap()?);
    assert!(plain.join().unwrap()?);
    // A new thread starts with gradients enabled even when its parent is in a scope.
    let _guard = no_grad();
    assert!(std::thread::spawn(is_grad_enabled).join().unwrap());
    Ok(())
}

#[test]
fn a_panic_inside_the_scope_restores_the_mode() {
    let result = catch_unwind(AssertUnwindSafe(|| {
        let _guard = no_grad();
        assert!(!is_grad_enabled());
        panic!("inside the scope");
    }));
    assert!(result.is_err());
    assert!(is_grad_enabled(), "the guard's drop ran during unwinding");
    let result = catch_unwind(AssertUnwindSafe(|| {
        without_grad(|| panic!("inside the closure"));
    }));
    assert!(result.is_err());
    assert!(is_grad_enabled());
}

// ---------------------------------------------------------------------------------------------
// Build only to load: `empty_weights` (PyTorch's `torch.device("meta")`, accelerate's
// `init_empty_weights`) and `LoadOptions::assign` (`load_state_dict(assign=True)`).
// ---------------------------------------------------------------------------------------------

use module_runtime::{build_empty, empty_weights, LoadOptions, StateDict};

#[test]
fn an_empty_model_holds_nothing_until_loaded() -> Result<()> {
    let dev = Device::Cpu;
    let trained = mlp(&dev)?;
    let model = build_empty(|| mlp(&dev))?;
    for (name, p) in model.named_parameters() {
        assert!(!p.is_built(), "{name} was built");
        assert_eq!(p.elem_count(), 0, "{name} holds values");
    }
    // The names and shapes are known before loading, so a strict load can check them.
    assert_eq!(
        model.named_parameters().len(),
        trained.named_parameters().len()
    );
    let x = input(&dev)?;
    let err = model.call(&x).unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::NotLoaded {
                awaits_load: true,
                ..
            }
        ),
        "{err:?}"
    );
    let message = err.to_string();
    assert!(message.contains("[16, 6]"), "{message}");
    assert!(message.contains("`fc1` (Linear)"), "{message}");
    assert!(message.contains("load a checkpoint"), "{message}");

    model.load_state_dict(&trained.state_dict()?, &LoadOptions::default())?;
    assert!(model.parameters().iter().all(|p| p.is_built()));
    assert_eq!(max_diff(&model.call(&x)?, &trained.call(&x)?), 0.0);
    Ok(())
}

#[test]
fn a_failed_load_leaves_the_empty_model_empty() -> Result<()> {
    let dev = Device::Cpu;
    let trained = mlp(&dev)?;
    let model = build_empty(|| mlp(&dev))?;
    let mut partial: StateDict = trained.state_dict()?;
    partial = partial
        .into_hash_map()
        .into_iter()
        .filter(|(k, _)| k != "fc2.bias")
        .collect();
    let err = model
        .load_state_dict(&partial, &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("fc2.bias"), "{err}");
    assert!(model.parameters().iter().all(|p| !p.is_built()));
    // A value of the wrong shape is reported as for any model.
    let mut wrong = trained.state_dict()?;
    wrong.insert("fc1.weight", Tensor::zeros((6, 16), DType::F32, &dev)?);
    let err = model
        .load_state_dict(&wrong, &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("fc1.weight"), "{err}");
    assert!(model.parameters().iter().all(|p| !p.is_built()));
    Ok(())
}

#[test]
fn an_empty_model_loads_from_a_file_and_matches_an_eager_one() -> Result<()> {
    let dev = Device::Cpu;
    let trained = mlp(&dev)?;
    let dir = std::env::temp_dir().join(format!("inference-empty-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("mlp.safetensors");
    trained.save_safetensors(&path)?;
    for options in [LoadOptions::default(), LoadOptions::default().assign()] {
        let model = build_empty(|| mlp(&dev))?;
        let report = model.load_state_dict(&path, &options)?;
        assert_eq!(report.loaded, 6);
        let x = input(&dev)?;
        assert_eq!(max_diff(&model.call(&x)?, &trained.call(&x)?), 0.0);
        // The loaded model trains like any other.
        let loss = model.call(&x)?.sum_all()?;
        let grads = loss.backward()?;
        assert!(grads.get(model.fc1.weight.var()?.as_tensor()).is_some());
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn lazy_layers_under_empty_weights_wait_for_the_load() -> Result<()> {
    let dev = Device::Cpu;
    let source = Linear::new(5, 3, &dev)?;
    let lazy = {
        let _guard = empty_weights();
        module_runtime::nn::LazyLinear::new(3, &dev)?
    };
    let x = Tensor::ones((2, 5), DType::F32, &dev)?;
    // Not built from its init recipe on the first call: only a load may fill it.
    let err = lazy.call(&x).unwrap_err();
    assert!(
        matches!(
            err.inner(),
            Error::NotLoaded {
                awaits_load: true,
                ..
            }
        ),
        "{err:?}"
    );
    lazy.load_state_dict(&source.state_dict()?, &LoadOptions::default())?;
    assert_eq!(max_diff(&lazy.call(&x)?, &source.call(&x)?), 0.0);
    Ok(())
}

#[test]
fn explicit_values_are_kept_and_the_guard_is_scoped() -> Result<()> {
    let dev = Device::Cpu;
    let explicit = {
        let _guard = empty_weights();
        let inner = {
            let _nested = empty_weights();
            Linear::new(2, 2, &dev)?
        };
        assert!(!inner.weight.is_built(), "nested guards defer");
        assert!(
            !Linear::new(2, 2, &dev)?.weight.is_built(),
            "the outer one still does"
        );
        Param::new(Tensor::ones(3, DType::F32, &dev)?)?
    };
    assert!(
        explicit.is_built(),
        "a value given explicitly is already computed"
    );
    assert!(
        Linear::new(2, 2, &dev)?.weight.is_built(),
        "the guard is gone"
    );
    let result = catch_unwind(AssertUnwindSafe(|| {
        let _guard = empty_weights();
        panic!("while building");
    }));
    assert!(result.is_err());
    assert!(
        Linear::new(2, 2, &dev)?.weight.is_built(),
        "restored after a panic"
    );
    Ok(())
}

// `assign`: "setting it to True preserves properties of the Tensors in the state dict. The only
// exception is the requires_grad field of Parameter for which the value from the module is
// preserved" (`torch.nn.Module.load_state_dict`'s docstring, `torch/nn/modules/module.py`); shapes
// are still checked (`_load_from_state_dict`: "size mismatch for ..." whatever `assign` is).
#[test]
fn assign_takes_the_checkpoints_dtype_and_keeps_requires_grad() -> Result<()> {
    let dev = Device::Cpu;
    let source = mlp(&dev)?;
    source.to_dtype(DType::F64)?;
    let model = mlp(&dev)?;
    model.freeze("fc1")?;
    let report = model.load_state_dict(&source.state_dict()?, &LoadOptions::default().assign())?;
    assert_eq!(report.loaded, 6);
    for (name, p) in model.named_parameters() {
        assert_eq!(p.dtype(), DType::F64, "{name}");
        assert_eq!(p.requires_grad(), !name.starts_with("fc1"), "{name}");
    }
    let x = input(&dev)?.to_dtype(DType::F64)?;
    let diff = (model.call(&x)? - source.call(&x)?)?
        .abs()?
        .max_all()?
        .to_scalar::<f64>()?;
    assert_eq!(diff, 0.0);
    // Without `assign`, the model keeps its dtype and converts (`Tensor.copy_`).
    let plain = mlp(&dev)?;
    plain.load_state_dict(&source.state_dict()?, &LoadOptions::default())?;
    assert!(plain.parameters().iter().all(|p| p.dtype() == DType::F32));
    Ok(())
}

#[test]
fn assign_still_checks_shapes_and_float_parameters() -> Result<()> {
    let dev = Device::Cpu;
    let model = mlp(&dev)?;
    let before = model.state_dict()?;
    let mut wrong = model.state_dict()?;
    wrong.insert("fc2.weight", Tensor::zeros((3, 15), DType::F32, &dev)?);
    let assign = LoadOptions::default().assign();
    let err = model.load_state_dict(&wrong, &assign).unwrap_err();
    assert!(err.to_string().contains("fc2.weight"), "{err}");
    let mut integer = model.state_dict()?;
    integer.insert("fc2.bias", Tensor::zeros(3, DType::I64, &dev)?);
    let err = model.load_state_dict(&integer, &assign).unwrap_err();
    assert!(err.to_string().contains("fc2.bias"), "{err}");
    // Nothing changed.
    for (key, value) in before.iter() {
        let now = model.state_dict()?;
        assert_eq!(max_diff(value, now.get(key).unwrap()), 0.0, "{key}");
    }
    Ok(())
}

#[derive(Module)]
struct Tied {
    embed: module_runtime::nn::Embedding,
    head: Linear,
}

#[test]
fn assign_keeps_tied_weights_tied() -> Result<()> {
    let dev = Device::Cpu;
    let make = || -> Result<Tied> {
        let embed = module_runtime::nn::Embedding::new(4, 3, &dev)?;
        let mut head = Linear::new(3, 4, &dev)?;
        head.weight = embed.weight.clone();
        Ok(Tied { embed, head })
    };
    let source = make()?;
    let model = build_empty(make)?;
    model.load_state_dict(&source.state_dict()?, &LoadOptions::default().assign())?;
    assert!(model.head.weight.same_as(&model.embed.weight));
    assert_eq!(
        max_diff(&model.head.weight.tensor()?, &source.embed.weight.tensor()?),
        0.0
    );
    Ok(())
}
