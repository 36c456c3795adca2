//! PyTorch's `nn.Module` semantics where they are not obvious, each test citing where PyTorch
//! defines the behaviour (paths are in the PyTorch repository, `torch/nn/modules/module.py` unless
//! said otherwise).

use std::sync::Arc;

use candle_module::device_from_env;
use module_runtime::nn::{BatchNorm1d, Linear, ReLU, Sequential};
use module_runtime::prelude::*;
use module_runtime::{Buffer, LoadOptions, StateDict};

/// Fields of every kind, declared in an order PyTorch would never list them in.
#[derive(Module)]
struct Mixed {
    head: Linear,
    steps: Buffer,
    scale: Param,
    inner: Inner,
    shift: Param,
}

#[derive(Module)]
struct Inner {
    norm: BatchNorm1d,
    gain: Param,
}

fn mixed(dev: &Device) -> Mixed {
    Mixed {
        head: Linear::new(2, 2, dev).unwrap(),
        steps: Buffer::new(Tensor::new(0i64, dev).unwrap()),
        scale: Param::new(Tensor::ones(2, DType::F32, dev).unwrap()).unwrap(),
        inner: Inner {
            norm: BatchNorm1d::new(2, dev).unwrap(),
            gain: Param::new(Tensor::ones(2, DType::F32, dev).unwrap()).unwrap(),
        },
        shift: Param::new(Tensor::zeros(2, DType::F32, dev).unwrap()).unwrap(),
    }
}

/// `Module._save_to_state_dict` writes `self._parameters`, then `self._buffers`, and
/// `Module.state_dict` then recurses into `self._modules`; `named_parameters` goes through
/// `_named_members`, which lists each module's own parameters in `named_modules` (pre-)order.
#[test]
fn state_dict_lists_own_parameters_then_own_buffers_then_children() {
    let m = mixed(&device_from_env().unwrap());
    let keys: Vec<String> = m.state_dict().unwrap().keys().map(str::to_owned).collect();
    assert_eq!(
        keys,
        [
            "scale",
            "shift",
            "steps",
            "head.weight",
            "head.bias",
            "inner.gain",
            "inner.norm.weight",
            "inner.norm.bias",
            "inner.norm.running_mean",
            "inner.norm.running_var",
            "inner.norm.num_batches_tracked",
        ]
    );
    let params: Vec<String> = m.named_parameters().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        params,
        [
            "scale",
            "shift",
            "head.weight",
            "head.bias",
            "inner.gain",
            "inner.norm.weight",
            "inner.norm.bias"
        ]
    );
    let buffers: Vec<String> = m.named_buffers().into_iter().map(|(k, _)| k).collect();
    assert_eq!(
        buffers,
        [
            "steps",
            "inner.norm.running_mean",
            "inner.norm.running_var",
            "inner.norm.num_batches_tracked"
        ]
    );
}

/// `Module._load_from_state_dict` copies with `param.copy_(input_param)`, which converts dtypes:
/// a float64 checkpoint loads into a float32 model, an integer value into a float parameter.
#[test]
fn load_converts_dtypes_like_copy_unless_exact_dtype_is_asked() {
    let dev = device_from_env().unwrap();
    let m = Linear::new(2, 2, &dev).unwrap();
    let mut sd = StateDict::new();
    sd.insert(
        "weight",
        Tensor::new(&[[1f64, 2.], [3., 4.]], &dev).unwrap(),
    );
    sd.insert("bias", Tensor::new(&[5i64, -6], &dev).unwrap());

    let before = m.weight.tensor().unwrap().to_vec2::<f32>().unwrap();
    let err = m
        .load_state_dict(&sd, &LoadOptions::default().exact_dtype())
        .unwrap_err();
    assert!(err.to_string().contains("F64"), "{err}");
    assert_eq!(m.weight.tensor().unwrap().to_vec2::<f32>().unwrap(), before);

    m.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    assert_eq!(m.weight.dtype(), DType::F32);
    assert_eq!(
        m.weight.tensor().unwrap().to_vec2::<f32>().unwrap(),
        [[1., 2.], [3., 4.]]
    );
    assert_eq!(
        m.bias
            .as_ref()
            .unwrap()
            .tensor()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap(),
        [5., -6.]
    );

    // Shapes stay strict.
    let mut sd = m.state_dict().unwrap();
    sd.insert("bias", Tensor::zeros(3, DType::F64, &dev).unwrap());
    assert!(m.load_state_dict(&sd, &LoadOptions::default()).is_err());
}

/// `_NormBase._load_from_state_dict` (`torch/nn/modules/batchnorm.py`): a checkpoint without
/// `num_batches_tracked` keeps the module's own value.
#[test]
fn batch_norm_loads_a_checkpoint_without_num_batches_tracked() {
    let dev = device_from_env().unwrap();
    let bn = BatchNorm1d::new(3, &dev).unwrap();
    bn.call(&Tensor::randn(0f32, 1., (4, 3), &dev).unwrap())
        .unwrap();
    bn.call(&Tensor::randn(0f32, 1., (4, 3), &dev).unwrap())
        .unwrap();
    let source = BatchNorm1d::new(3, &dev).unwrap();
    let mut old: StateDict = source
        .state_dict()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "num_batches_tracked")
        .map(|(k, t)| (k, t.clone()))
        .collect();
    let report = bn.load_state_dict(&old, &LoadOptions::default()).unwrap();
    assert!(report.missing.is_empty());
    let count = bn.num_batches_tracked.as_ref().unwrap().tensor().unwrap();
    assert_eq!(count.to_scalar::<i64>().unwrap(), 2);
    // The rule is for that buffer only.
    old = old
        .iter()
        .filter(|(k, _)| *k != "running_var")
        .map(|(k, t)| (k, t.clone()))
        .collect();
    let err = bn
        .load_state_dict(&old, &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("running_var"), "{err}");
}

/// PyTorch's `state_dict` holds detached views of the live buffers (`buf.detach()` in
/// `_save_to_state_dict`), and BatchNorm updates its running statistics in place
/// (`torch.batch_norm` writes `running_mean`), so a state dict taken before a training step or a
/// load sees the new values.
#[test]
fn buffers_update_in_place_so_earlier_state_dicts_see_new_values() {
    let dev = device_from_env().unwrap();
    let bn = BatchNorm1d::new(2, &dev).unwrap();
    let taken_before = bn.state_dict().unwrap();
    let x = Tensor::new(&[[1f32, 10.], [3., 30.]], &dev).unwrap();
    bn.call(&x).unwrap();
    let mean = taken_before.get("running_mean").unwrap();
    assert_eq!(mean.to_vec1::<f32>().unwrap(), [0.2, 2.0]);
    let count = taken_before.get("num_batches_tracked").unwrap();
    assert_eq!(count.to_scalar::<i64>().unwrap(), 1);

    // A load writes into the same storage too.
    let other = BatchNorm1d::new(2, &dev).unwrap();
    let mut sd = other.state_dict().unwrap();
    sd.insert("running_var", Tensor::new(&[7f32, 8.], &dev).unwrap());
    let before_load = bn.named_buffers()[1].1.tensor().unwrap();
    bn.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    assert_eq!(before_load.to_vec1::<f32>().unwrap(), [7., 8.]);
}

/// `Module.train(mode)` sets `self.training` on the module and every child; `eval()` is
/// `train(False)`; `child.eval()` leaves the parent's flag alone.
#[test]
fn is_training_is_the_modules_own_flag() {
    let dev = device_from_env().unwrap();
    #[derive(Module)]
    struct Mlp {
        fc1: Linear,
        act: ReLU,
        fc2: Linear,
    }
    let m = Mlp {
        fc1: Linear::new(2, 3, &dev).unwrap(),
        act: ReLU::new(),
        fc2: Linear::new(3, 1, &dev).unwrap(),
    };
    assert!(m.is_training() && m.fc1.is_training());
    m.eval();
    assert!(!m.is_training());
    assert!(!m.fc1.is_training() && !m.fc2.is_training());
    m.fc2.train();
    assert!(m.fc2.is_training());
    assert!(!m.is_training() && !m.fc1.is_training());
    m.train();
    m.fc1.eval();
    assert!(m.is_training() && !m.fc1.is_training() && m.fc2.is_training());

    // A module and its first child share their first parameter, yet keep their own flags.
    let seq = Sequential::new().add(Linear::new(2, 2, &dev).unwrap());
    seq.get_submodule_dyn("0").unwrap().eval();
    assert!(seq.is_training());
    assert!(!seq.get_submodule_dyn("0").unwrap().is_training());

    // Mode-dependent layers follow `eval` on an ancestor.
    let bn = Arc::new(BatchNorm1d::new(2, &dev).unwrap());
    #[derive(Module)]
    struct WithNorm {
        norm: Arc<BatchNorm1d>,
    }
    let w = WithNorm { norm: bn.clone() };
    w.eval();
    assert!(!bn.mode.is_training() && !w.is_training());
}

/// `Module.apply` recurses through `self.children()`, which drops duplicates among one module's
/// children only: a module shared at two depths is visited at each.
#[test]
fn apply_recurses_through_children_like_pytorch() {
    let dev = device_from_env().unwrap();
    let shared = Arc::new(Linear::new(2, 2, &dev).unwrap());
    #[derive(Module)]
    struct Block {
        lin: Arc<Linear>,
    }
    #[derive(Module)]
    struct Net {
        a: Arc<Linear>,
        again: Arc<Linear>,
        block: Block,
    }
    let net = Net {
        a: shared.clone(),
        again: shared.clone(),
        block: Block { lin: shared },
    };
    let mut names = Vec::new();
    net.apply(&mut |m| names.push(format!("{m:?}")));
    // `a`/`again` are one child of `net` (visited once); `block.lin` is the same module one level
    // down, visited again. Children before parents.
    assert_eq!(names, ["Linear", "Linear", "Block", "Net"]);
}

/// A module shared as `a` and `b`, with a forward that calls it through `b` only.
#[derive(Module)]
struct TwoPaths {
    a: Arc<Linear>,
    b: Arc<Linear>,
    spare: Linear,
}

impl Forward<&Tensor> for TwoPaths {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> module_runtime::Result<Tensor> {
        self.b.call(x)
    }
}

fn two_paths(dev: &Device) -> TwoPaths {
    let shared = Arc::new(Linear::new(2, 2, dev).unwrap());
    TwoPaths {
        a: shared.clone(),
        b: shared,
        spare: Linear::new(2, 2, dev).unwrap(),
    }
}

/// PyTorch stores hooks on the module object (`Module._forward_hooks`), so a hook registered on
/// `model.a` fires however that module is reached.
#[test]
fn hooks_attach_to_the_module_not_to_the_path_string() {
    let dev = device_from_env().unwrap();
    let m = two_paths(&dev);
    let hooks = Hooks::new();
    let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
    let sink = seen.clone();
    hooks
        .register_forward_hook(
            "a",
            move |ctx, _, _| {
                sink.lock().unwrap().push(ctx.path().to_owned());
                Ok(None)
            },
            HookOptions::default(),
        )
        .unwrap();
    let x = Tensor::ones((1, 2), DType::F32, &dev).unwrap();
    hooks.run(&m, |m| m.call(&x)).unwrap();
    assert_eq!(*seen.lock().unwrap(), ["b"]);
}

/// PyTorch has no patterns, so a misspelled name is an `AttributeError` there; here a pattern
/// that matches nothing would silently never fire, so it is an error listing near matches.
#[test]
fn hook_and_capture_patterns_that_match_nothing_are_errors() {
    let dev = device_from_env().unwrap();
    let m = two_paths(&dev);
    let x = Tensor::ones((1, 2), DType::F32, &dev).unwrap();
    let hooks = Hooks::new();
    hooks
        .register_forward_hook("spar", |_, _, _| Ok(None), HookOptions::default())
        .unwrap();
    let err = hooks.run(&m, |m| m.call(&x)).unwrap_err();
    assert!(
        matches!(&err, module_runtime::Error::NoModuleMatch { near, .. } if near[0] == "spare"),
        "{err}"
    );
    assert!(err.to_string().contains("did you mean: spare"), "{err}");

    let err = m.capture(&["*.weight"], |m| m.call(&x)).unwrap_err();
    assert!(
        matches!(err, module_runtime::Error::NoModuleMatch { .. }),
        "{err}"
    );
    // `spare` exists but the forward never calls it.
    let err = m.capture(&["spare"], |m| m.call(&x)).unwrap_err();
    assert!(
        err.to_string()
            .contains("`spare` matches spare, but none ran"),
        "{err}"
    );
    let (_, captured) = m.capture(&["a"], |m| m.call(&x)).unwrap();
    assert_eq!(captured.paths().collect::<Vec<_>>(), ["b"]);
}

/// `Module.add_module` (which `ModuleDict.__setitem__` calls) raises `KeyError` for an empty name
/// or one containing `.`.
#[test]
fn module_dict_rejects_empty_and_dotted_keys() {
    let dev = device_from_env().unwrap();
    let mut d = module_runtime::nn::ModuleDict::new();
    for bad in ["", "a.b", "."] {
        let err = d.insert(bad, Linear::new(2, 2, &dev).unwrap()).unwrap_err();
        assert!(
            matches!(err, module_runtime::Error::InvalidKey { .. }),
            "{err}"
        );
    }
    assert!(d.is_empty());
    d.insert("ok", Linear::new(2, 2, &dev).unwrap()).unwrap();
    assert!(module_runtime::nn::ModuleDict::from_entries([(
        "x.y",
        Linear::new(2, 2, &dev).unwrap()
    )])
    .is_err());
}
