//! Lazy build through the public API: lazy layers, lazy parameters, `Lazy` cells with `Build`,
//! `build(&sample)` dry runs, and traversal and IO on unbuilt models.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use candle_module::fixtures::max_abs_diff as max_diff;
use module_runtime::nn::{
    BatchNorm1d, BatchNorm2d, Conv1d, Conv2d, ConvConfig, LayerNorm, LazyBatchNorm1d,
    LazyBatchNorm2d, LazyConv1d, LazyConv2d, LazyLayerNorm, LazyLinear,
};
use module_runtime::prelude::*;
use module_runtime::{Init, LazyShape};

fn dev() -> Device {
    Device::Cpu
}

fn dims(p: &Param) -> Vec<usize> {
    p.shape().dims().to_vec()
}

fn randn(shape: &[usize]) -> Tensor {
    Tensor::randn(0f32, 1., shape, &dev()).unwrap()
}

#[derive(Module)]
struct Chain {
    fc1: LazyLinear,
    fc2: LazyLinear,
}

impl Chain {
    fn new() -> Result<Self> {
        Ok(Self {
            fc1: LazyLinear::new(15, &dev())?,
            fc2: LazyLinear::new(10, &dev())?,
        })
    }
}

impl Forward<&Tensor> for Chain {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.relu()?)
    }
}

#[test]
fn lazy_linear_takes_in_features_from_the_first_input() -> Result<()> {
    let fc = LazyLinear::new(10, &dev())?;
    let y = fc.call(&randn(&[5, 5]))?;
    assert_eq!(y.dims(), [5, 10]);
    assert_eq!(dims(&fc.weight), [10, 5]);
    assert_eq!(dims(fc.bias.as_ref().unwrap()), [10]);
    assert_eq!(fc.in_features(), Some(5));
    Ok(())
}

#[test]
fn a_chain_of_lazy_linears_builds_layer_by_layer() -> Result<()> {
    let chain = Chain::new()?;
    assert_eq!(chain.call(&randn(&[5, 10]))?.dims(), [5, 10]);
    let shapes: Vec<(String, Vec<usize>)> = chain
        .named_parameters()
        .into_iter()
        .map(|(n, p)| (n, dims(&p)))
        .collect();
    assert_eq!(
        shapes,
        [
            ("fc1.weight".to_owned(), vec![15, 10]),
            ("fc1.bias".to_owned(), vec![15]),
            ("fc2.weight".to_owned(), vec![10, 15]),
            ("fc2.bias".to_owned(), vec![10]),
        ]
    );
    Ok(())
}

#[test]
fn eight_threads_making_the_first_call_materialize_each_parameter_once() -> Result<()> {
    let inits = Arc::new(AtomicUsize::new(0));
    let counting = {
        let inits = inits.clone();
        Init::Custom(Arc::new(move |shape, _, dtype, device| {
            inits.fetch_add(1, Ordering::SeqCst);
            Ok(Tensor::randn(0f32, 1., shape, device)?.to_dtype(dtype)?)
        }))
    };
    let counted = Param::lazy(
        LazyShape::new([Some(3), None]),
        counting,
        DType::F32,
        &dev(),
    )?;
    let fc = LazyLinear::new(4, &dev())?;
    let x = randn(&[2, 6]);
    let barrier = Barrier::new(8);
    // Per thread: the weight's `Var` id, the output, and the custom-initialized parameter.
    type Seen = (candle_core::TensorId, Vec<Vec<f32>>, Vec<Vec<f32>>);
    let seen: Vec<Seen> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                s.spawn(|| {
                    barrier.wait();
                    let y = fc.call(&x).unwrap();
                    let c = counted.materialize(&[3, 6], 6).unwrap();
                    (
                        fc.weight.var().unwrap().as_tensor().id(),
                        y.to_vec2::<f32>().unwrap(),
                        c.to_vec2::<f32>().unwrap(),
                    )
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert_eq!(inits.load(Ordering::SeqCst), 1);
    for (id, y, c) in &seen[1..] {
        assert_eq!(*id, seen[0].0, "one Var for every thread");
        assert_eq!(*y, seen[0].1, "the same values for every thread");
        assert_eq!(*c, seen[0].2);
    }
    assert_eq!(fc.weight.var()?.as_tensor().id(), seen[0].0);
    Ok(())
}

#[test]
fn loading_a_linear_checkpoint_materializes_a_lazy_linear() -> Result<()> {
    let eager = Linear::new(5, 10, &dev())?;
    let lazy = LazyLinear::new(10, &dev())?;
    let report = lazy.load_state_dict(&eager.state_dict()?, &LoadOptions::default())?;
    assert_eq!(report.loaded, 2);
    assert!(lazy.is_built());
    assert_eq!(dims(&lazy.weight), [10, 5]);
    let x = randn(&[2, 5]);
    assert_eq!(max_diff(&lazy.call(&x)?, &eager.call(&x)?), 0.0);

    let err = lazy.call(&randn(&[2, 7])).unwrap_err();
    assert!(matches!(err.inner(), Error::LazyInput { .. }), "{err:?}");
    let msg = err.to_string();
    for needle in ["LazyLinear", "[2, 7]", "[10, 5]", "[10, 7]", "weight"] {
        assert!(msg.contains(needle), "{needle} missing from: {msg}");
    }
    Ok(())
}

#[test]
fn to_dtype_before_the_first_call_is_applied_when_built() -> Result<()> {
    let chain = Chain::new()?;
    chain.to_dtype(DType::F16)?;
    assert!(chain.parameters().iter().all(|p| p.dtype() == DType::F16));
    chain.call(&randn(&[3, 4]).to_dtype(DType::F16)?)?;
    for (name, p) in chain.named_parameters() {
        assert!(p.is_built(), "{name}");
        assert_eq!(p.dtype(), DType::F16, "{name}");
    }
    assert_eq!(dims(&chain.fc1.weight), [15, 4]);
    Ok(())
}

#[test]
fn traversal_lists_unbuilt_parameters_and_says_so() -> Result<()> {
    let chain = Chain::new()?;
    let params = chain.named_parameters();
    assert_eq!(params.len(), 4);
    assert!(params.iter().all(|(_, p)| !p.is_built()));
    assert_eq!(
        params[0].1.lazy_shape().unwrap().to_string(),
        "[15, ?]",
        "the shape it will have"
    );
    assert!(format!("{:?}", params[0].1).contains("unbuilt: [15, ?]"));
    assert_eq!(chain.num_parameters(), 0);
    assert_eq!(
        chain.unbuilt_paths(),
        ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    );
    Ok(())
}

#[test]
fn trainable_vars_on_an_unbuilt_model_names_every_unbuilt_path() -> Result<()> {
    let chain = Chain::new()?;
    let err = chain.trainable_vars().unwrap_err();
    match &err {
        Error::Unbuilt { paths, .. } => {
            assert_eq!(paths, &["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"])
        }
        other => panic!("expected Error::Unbuilt, got {other:?}"),
    }
    let msg = err.to_string();
    assert!(
        msg.contains("fc1.weight, fc1.bias, fc2.weight, fc2.bias"),
        "{msg}"
    );
    assert!(msg.contains("build(&sample)"), "{msg}");

    // Half built: only what is still unbuilt is named.
    chain.fc1.call(&randn(&[1, 3]))?;
    match chain.trainable_vars().unwrap_err() {
        Error::Unbuilt { paths, .. } => assert_eq!(paths, ["fc2.weight", "fc2.bias"]),
        other => panic!("{other:?}"),
    }
    Ok(())
}

#[test]
fn state_dict_and_save_on_an_unbuilt_model_are_errors() -> Result<()> {
    let chain = Chain::new()?;
    assert!(matches!(chain.state_dict(), Err(Error::Unbuilt { .. })));
    let dir = std::env::temp_dir().join(format!("lazy-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("chain.safetensors");
    let err = chain.save_safetensors(&path).unwrap_err();
    assert!(err.to_string().starts_with("cannot save"), "{err}");
    assert!(!path.exists());

    chain.call(&randn(&[2, 3]))?;
    chain.save_safetensors(&path)?;
    let fresh = Chain::new()?;
    fresh.load_state_dict(&path, &LoadOptions::default())?;
    let x = randn(&[4, 3]);
    assert_eq!(max_diff(&chain.call(&x)?, &fresh.call(&x)?), 0.0);
    std::fs::remove_dir_all(&dir).unwrap();
    Ok(())
}

#[test]
fn a_failed_load_into_an_unbuilt_model_leaves_it_unbuilt() -> Result<()> {
    let built = Chain::new()?;
    built.call(&randn(&[1, 6]))?;
    let mut state = built.state_dict()?;
    // fc2 has 10 outputs: a checkpoint with 11 does not fit its known dimension.
    state.insert("fc2.weight", randn(&[11, 15]));
    let fresh = Chain::new()?;
    let err = fresh
        .load_state_dict(&state, &LoadOptions::default())
        .unwrap_err();
    let Error::Load(report) = &err else {
        panic!("{err:?}")
    };
    assert_eq!(report.mismatched.len(), 1);
    assert_eq!(report.mismatched[0].key, "fc2.weight");
    assert_eq!(
        report.mismatched[0].unbuilt.as_ref().unwrap().to_string(),
        "[10, ?]"
    );
    assert!(err.to_string().contains("[10, ?] (unbuilt)"), "{err}");
    assert_eq!(fresh.unbuilt_paths().len(), 4, "nothing was built");

    // A missing key fails a strict load the same way.
    let partial: StateDict = built
        .state_dict()?
        .iter()
        .filter(|(k, _)| *k != "fc1.bias")
        .map(|(k, t)| (k, t.clone()))
        .collect();
    assert!(fresh
        .load_state_dict(&partial, &LoadOptions::default())
        .is_err());
    assert_eq!(fresh.unbuilt_paths().len(), 4);
    Ok(())
}

#[derive(Module)]
struct Net {
    fc: LazyLinear,
    bn: LazyBatchNorm1d,
    head: LazyLinear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.bn.call(&self.fc.call(x)?)?.relu()?;
        self.head.call(&h)
    }
}

#[test]
fn build_on_a_sample_records_no_gradient_and_changes_no_state() -> Result<()> {
    let net = Net {
        fc: LazyLinear::new(6, &dev())?,
        bn: LazyBatchNorm1d::new(&dev())?,
        head: LazyLinear::new(2, &dev())?,
    };
    net.head.freeze("**")?;
    let x = randn(&[4, 3]);
    let (_, captured) = net.capture(&["*"], |m| m.build(&x))?;
    assert!(net.is_built());
    assert_eq!(captured.paths().count(), 3);
    for path in ["fc", "bn", "head"] {
        assert!(
            !captured.get(path).unwrap().track_op(),
            "{path}: the dry run recorded a graph"
        );
    }
    // Flags restored: trainable stays trainable, frozen stays frozen, training mode again.
    assert!(net.fc.weight.requires_grad());
    assert!(!net.head.weight.requires_grad());
    assert!(net.is_training());
    // Evaluation mode during the run: BatchNorm's statistics did not move.
    let nbt = net.bn.num_batches_tracked.as_ref().unwrap().tensor()?;
    assert_eq!(nbt.to_scalar::<i64>()?, 0);
    let mean = net.bn.running_mean.as_ref().unwrap().tensor()?;
    assert_eq!(mean.to_vec1::<f32>()?, [0f32; 6]);
    // And a real call after it does train.
    assert!(net.call(&x)?.track_op());
    assert_eq!(net.trainable_vars()?.len(), 4);
    Ok(())
}

/// A user module that builds its own state from its first input: `x * scale + shift` per feature,
/// with a hidden projection as wide as the input.
#[derive(Module)]
struct Adaptive {
    #[module(skip)]
    calls_to_build: Arc<AtomicUsize>,
    state: Lazy<AdaptiveState>,
}

#[derive(Module)]
struct AdaptiveState {
    scale: Param,
    shift: Param,
    proj: Linear,
}

impl Build<&Tensor> for Adaptive {
    type State = AdaptiveState;
    fn state(&self) -> &Lazy<AdaptiveState> {
        &self.state
    }
    fn build_state(&self, x: &Tensor) -> Result<AdaptiveState> {
        self.calls_to_build.fetch_add(1, Ordering::SeqCst);
        let width = x.dim(D::Minus1)?;
        Ok(AdaptiveState {
            scale: Param::new(Tensor::ones(width, x.dtype(), x.device())?)?,
            shift: Param::new(Tensor::zeros(width, x.dtype(), x.device())?)?,
            proj: Linear::new(width, width, x.device())?,
        })
    }
}

impl Forward<&Tensor> for Adaptive {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let s = self.built(x)?;
        let y = x
            .broadcast_mul(&s.scale.tensor()?)?
            .broadcast_add(&s.shift.tensor()?)?;
        s.proj.call(&y)
    }
}

#[test]
fn a_user_module_builds_its_own_state_on_the_first_call() -> Result<()> {
    let m = Adaptive {
        calls_to_build: Arc::default(),
        state: Lazy::new(),
    };
    assert_eq!(m.unbuilt_paths(), ["state"]);
    assert!(matches!(m.trainable_vars(), Err(Error::Unbuilt { .. })));
    let err = m
        .load_state_dict(&StateDict::new(), &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("state"), "{err}");

    m.call(&randn(&[2, 4]))?;
    m.call(&randn(&[3, 4]))?;
    assert_eq!(m.calls_to_build.load(Ordering::SeqCst), 1);
    let names: Vec<String> = m.named_parameters().into_iter().map(|(n, _)| n).collect();
    assert_eq!(
        names,
        [
            "state.scale",
            "state.shift",
            "state.proj.weight",
            "state.proj.bias"
        ]
    );
    let proj: &Linear = m.get_submodule("state.proj")?;
    assert_eq!(proj.in_features(), 4);

    // Build modes: explicitly with a dry run, and at construction.
    let explicit = Adaptive {
        calls_to_build: Arc::default(),
        state: Lazy::new(),
    };
    explicit.build(&randn(&[1, 3]))?;
    assert!(explicit.is_built());
    assert_eq!(explicit.num_parameters(), 3 + 3 + 9 + 3);
    let at_construction = Adaptive {
        calls_to_build: Arc::default(),
        state: Lazy::from(explicit.build_state(&randn(&[1, 2]))?),
    };
    assert!(at_construction.is_built());
    at_construction.call(&randn(&[5, 2]))?;
    assert_eq!(at_construction.calls_to_build.load(Ordering::SeqCst), 0);
    Ok(())
}

#[test]
fn lazy_layers_match_their_eager_twins_given_the_same_weights() -> Result<()> {
    let cfg = ConvConfig {
        stride: 2.into(),
        padding: 1.into(),
        groups: 2,
        ..Default::default()
    };
    // Each lazy layer loads its eager twin's state dict (same names), then both run one input.
    let conv1 = Conv1d::with_config(4, 6, 3, cfg, &dev())?;
    let lazy_conv1 = LazyConv1d::with_config(6, 3, cfg, &dev())?;
    lazy_conv1.load_state_dict(&conv1.state_dict()?, &LoadOptions::default())?;
    let x = randn(&[2, 4, 9]);
    assert!(max_diff(&conv1.call(&x)?, &lazy_conv1.call(&x)?) < 1e-6);
    assert_eq!(lazy_conv1.in_channels(), Some(4));

    let conv2 = Conv2d::with_config(4, 6, 3, cfg, &dev())?;
    let lazy_conv2 = LazyConv2d::with_config(6, 3, cfg, &dev())?;
    lazy_conv2.load_state_dict(&conv2.state_dict()?, &LoadOptions::default())?;
    let x = randn(&[2, 4, 7, 7]);
    assert!(max_diff(&conv2.call(&x)?, &lazy_conv2.call(&x)?) < 1e-6);

    let ln = LayerNorm::new(5, &dev())?;
    ln.weight.as_ref().unwrap().set(&randn(&[5]))?;
    let lazy_ln = LazyLayerNorm::new(1, &dev())?;
    lazy_ln.load_state_dict(&ln.state_dict()?, &LoadOptions::default())?;
    let x = randn(&[3, 5]);
    assert!(max_diff(&ln.call(&x)?, &lazy_ln.call(&x)?) < 1e-6);

    let bn1 = BatchNorm1d::new(3, &dev())?;
    let lazy_bn1 = LazyBatchNorm1d::new(&dev())?;
    let x = randn(&[8, 3]);
    bn1.call(&x)?; // moves its running statistics away from the defaults
    lazy_bn1.load_state_dict(&bn1.state_dict()?, &LoadOptions::default())?;
    let y = randn(&[8, 3]);
    assert!(max_diff(&bn1.call(&y)?, &lazy_bn1.call(&y)?) < 1e-6);
    bn1.eval();
    lazy_bn1.eval();
    assert!(max_diff(&bn1.call(&y)?, &lazy_bn1.call(&y)?) < 1e-6);

    // The other way round: a lazy layer built by a call saves a checkpoint its twin loads.
    let lazy_bn2 = LazyBatchNorm2d::new(&dev())?;
    let x = randn(&[2, 3, 4, 4]);
    let lazy_y = lazy_bn2.call(&x)?;
    let bn2 = BatchNorm2d::new(3, &dev())?;
    bn2.load_state_dict(&lazy_bn2.state_dict()?, &LoadOptions::default())?;
    assert_eq!(
        bn2.state_dict()?.keys().collect::<Vec<_>>(),
        lazy_bn2.state_dict()?.keys().collect::<Vec<_>>()
    );
    lazy_bn2.eval();
    bn2.eval();
    assert!(max_diff(&bn2.call(&x)?, &lazy_bn2.call(&x)?) < 1e-6);
    assert_eq!(lazy_y.dims(), x.dims());

    let fc = Linear::new(7, 3, &dev())?;
    let lazy_fc = LazyLinear::new(3, &dev())?;
    lazy_fc.call(&randn(&[1, 7]))?;
    fc.load_state_dict(&lazy_fc.state_dict()?, &LoadOptions::default())?;
    let x = randn(&[4, 2, 7]);
    assert_eq!(max_diff(&fc.call(&x)?, &lazy_fc.call(&x)?), 0.0);
    Ok(())
}

#[test]
fn lazy_layers_follow_pytorch_init_bounds() -> Result<()> {
    let fc = LazyLinear::new(50, &dev())?;
    fc.call(&randn(&[1, 16]))?;
    let bound = 1.0 / 4.0;
    for p in fc.parameters() {
        let max = p
            .tensor()?
            .abs()?
            .flatten_all()?
            .max(0)?
            .to_scalar::<f32>()?;
        assert!(max <= bound && max > bound / 2.0, "{max}");
    }
    let bn = LazyBatchNorm2d::new(&dev())?;
    bn.call(&randn(&[2, 3, 2, 2]))?;
    let w = bn.weight.as_ref().unwrap().tensor()?.to_vec1::<f32>()?;
    assert_eq!(w, [1., 1., 1.]);
    assert_eq!(bn.num_features(), Some(3));
    Ok(())
}

#[test]
fn lazy_conv_and_norm_errors_name_the_layer_and_shapes() -> Result<()> {
    let conv = LazyConv2d::new(4, 3, &dev())?;
    conv.call(&randn(&[1, 2, 5, 5]))?;
    let msg = conv.call(&randn(&[1, 3, 5, 5])).unwrap_err().to_string();
    for needle in ["LazyConv2d", "[1, 3, 5, 5]", "[4, 2, 3, 3]", "[4, 3, 3, 3]"] {
        assert!(msg.contains(needle), "{needle} missing from: {msg}");
    }
    let bn = LazyBatchNorm1d::new(&dev())?;
    bn.call(&randn(&[4, 3]))?;
    let msg = bn.call(&randn(&[4, 5])).unwrap_err().to_string();
    assert!(
        msg.contains("LazyBatchNorm1d") && msg.contains("[3]"),
        "{msg}"
    );
    Ok(())
}

#[test]
fn to_device_on_unbuilt_parameters_records_the_target() -> Result<()> {
    let net = Net {
        fc: LazyLinear::new(6, &dev())?,
        bn: LazyBatchNorm1d::new(&dev())?,
        head: LazyLinear::new(2, &dev())?,
    };
    net.to_device(&Device::Cpu)?;
    net.to_dtype(DType::F64)?;
    assert!(!net.is_built());
    net.call(&randn(&[4, 3]).to_dtype(DType::F64)?)?;
    for (name, p) in net.named_parameters() {
        assert_eq!(p.dtype(), DType::F64, "{name}");
    }
    for (name, b) in net.named_buffers() {
        let expected = if name.ends_with("num_batches_tracked") {
            DType::I64
        } else {
            DType::F64
        };
        assert_eq!(b.dtype(), expected, "{name}");
    }
    Ok(())
}
