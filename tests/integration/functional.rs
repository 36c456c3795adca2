//! Functional calls and state as a value through the public API (issue #15): `functional_call`
//! with `torch.func.functional_call`'s semantics plus per-thread isolation, `call_and_update`,
//! `flatten`/`unflatten`, `deep_clone`, and `expect_outputs`.
//!
//! PyTorch references: `torch/nn/utils/stateless.py` (`_untie_named_tensors_map`,
//! `_reparametrize_module`, `functional_call`), which `torch/_functorch/functional_call.py`
//! forwards to, and its tests in `test/test_stateless.py`.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Barrier};

use module_runtime::nn::{BatchNorm1d, Sequential};
use module_runtime::prelude::*;
use module_runtime::{no_grad, Captures, FunctionalOptions, Tolerance};

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

fn full(value: f32, shape: &[usize]) -> Tensor {
    Tensor::full(value, shape, &dev()).unwrap()
}

fn vec2(t: &Tensor) -> Vec<Vec<f32>> {
    t.to_dtype(DType::F32).unwrap().to_vec2().unwrap()
}

/// Two layers whose weights are one tied parameter (`fc2.weight` is `fc1.weight`).
#[derive(Module, Clone)]
struct Tied {
    fc1: Linear,
    fc2: Linear,
}

impl Tied {
    fn new() -> Self {
        let fc1 = Linear::new(2, 2, &dev()).unwrap();
        let mut fc2 = Linear::new(2, 2, &dev()).unwrap();
        fc2.weight = fc1.weight.clone();
        Self { fc1, fc2 }
    }
}

impl Forward<&Tensor> for Tied {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?)
    }
}

/// A layer, a BatchNorm and a non-persistent buffer.
#[derive(Module, Clone)]
struct Net {
    fc: Linear,
    bn: BatchNorm1d,
    scale: Buffer,
}

impl Net {
    fn new() -> Self {
        Self {
            fc: Linear::new(3, 2, &dev()).unwrap(),
            bn: BatchNorm1d::new(2, &dev()).unwrap(),
            scale: Buffer::non_persistent(full(1.0, &[2])),
        }
    }
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.bn.call(&self.fc.call(x)?)?;
        Ok(h.broadcast_mul(&self.scale.tensor()?)?)
    }
}

fn linear_tensors(w: f32, b: f32) -> StateDict {
    let mut sd = StateDict::new();
    sd.insert("weight", full(w, &[2, 3]));
    sd.insert("bias", full(b, &[2]));
    sd
}

// ---------------------------------------------------------------------------------------------
// functional_call

#[test]
fn functional_call_uses_the_given_tensors_and_leaves_the_model_unchanged() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let before = model.state_dict()?;
    let x = full(1.0, &[1, 3]);
    let y = model.functional_call(&linear_tensors(1.0, 0.5), &x)?;
    assert_eq!(vec2(&y), [[3.5, 3.5]]);
    // The model's values are as they were, and a plain call uses them.
    for (k, t) in before.iter() {
        let now = model.state_dict()?;
        let diff = (now.get(k).unwrap() - t)?.abs()?.sum_all()?;
        assert_eq!(diff.to_scalar::<f32>()?, 0.0, "{k} changed");
    }
    let plain = model.call(&x)?;
    let expected = x
        .matmul(&model.weight.tensor()?.t()?)?
        .broadcast_add(&model.bias.as_ref().unwrap().tensor()?)?;
    assert_eq!(vec2(&plain), vec2(&expected));
    Ok(())
}

/// `functional_call(strict=False)` (the default): the map may be any subset; the rest keep the
/// module's values (`_reparametrize_module` swaps with `allow_missing=True`).
#[test]
fn a_subset_of_tensors_is_enough_by_default() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let mut sd = StateDict::new();
    sd.insert("bias", full(10.0, &[2]));
    let x = full(0.0, &[1, 3]);
    assert_eq!(vec2(&model.functional_call(&sd, &x)?), [[10.0, 10.0]]);
    Ok(())
}

/// `strict=True`: "Error(s) in reparametrizing for ...: Unexpected key(s) ... Missing key(s)"
/// (`_reparametrize_module`); here the error of a strict load, with its suggestions.
#[test]
fn strict_reports_missing_and_unexpected_keys_like_a_load() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let mut sd = StateDict::new();
    sd.insert("weigth", full(1.0, &[2, 3]));
    let strict = FunctionalOptions::default().strict();
    let err = model
        .functional_call_with(&sd, &strict, |m| m.call(&full(1.0, &[1, 3])))
        .unwrap_err();
    let Error::Load(report) = &err else {
        panic!("expected a load error, got {err}")
    };
    assert_eq!(report.missing, ["weight", "bias"]);
    assert_eq!(report.unexpected, ["weigth"]);
    assert_eq!(
        report.suggestions,
        [("weight".to_owned(), "weigth".to_owned())]
    );
    Ok(())
}

/// Deviation: an unknown key is an error by default (PyTorch either raises `AttributeError` or
/// sets a stray attribute the forward never reads); `allow_unexpected` ignores it.
#[test]
fn unknown_keys_fail_unless_allowed() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let mut sd = linear_tensors(1.0, 0.0);
    sd.insert("fc.weight", full(1.0, &[2, 3]));
    let x = full(1.0, &[1, 3]);
    let err = model.functional_call(&sd, &x).unwrap_err();
    assert!(
        matches!(&err, Error::Load(r) if r.unexpected == ["fc.weight"] && r.missing.is_empty())
    );
    let allow = FunctionalOptions::default().allow_unexpected();
    let y = model.functional_call_with(&sd, &allow, |m| m.call(&x))?;
    assert_eq!(vec2(&y), [[3.0, 3.0]]);
    Ok(())
}

#[test]
fn shapes_and_dtypes_are_checked_like_a_load() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let mut sd = StateDict::new();
    sd.insert("weight", full(1.0, &[3, 2]));
    sd.insert("bias", full(1.0, &[2]).to_dtype(DType::F64)?);
    let err = model.functional_call(&sd, &full(1.0, &[1, 3])).unwrap_err();
    let Error::Load(report) = &err else {
        panic!("expected a load error, got {err}")
    };
    let keys: Vec<_> = report.mismatched.iter().map(|m| m.key.as_str()).collect();
    assert_eq!(keys, ["weight", "bias"]);
    assert_eq!(report.mismatched[1].dtype, DType::F64);
    assert_eq!(report.mismatched[1].expected_dtype, DType::F32);
    Ok(())
}

/// `tie_weights=True` (the default): "if the module has two tied weights self.foo and
/// self.tied_foo and the user passes {'foo': foo_value, ...}, this will return {'foo': foo_value,
/// 'tied_foo': foo_value, ...}" (`_untie_named_tensors_map`).
#[test]
fn a_value_for_one_alias_of_a_tied_weight_is_used_for_all() -> Result<()> {
    let model = Tied::new();
    let mut sd = StateDict::new();
    sd.insert("fc1.weight", Tensor::eye(2, DType::F32, &dev())?);
    sd.insert("fc1.bias", full(0.0, &[2]));
    sd.insert("fc2.bias", full(0.0, &[2]));
    let x = Tensor::new(&[[1f32, 2.]], &dev())?;
    // Identity weights in both layers: the output is the input.
    assert_eq!(vec2(&model.functional_call(&sd, &x)?), [[1.0, 2.0]]);
    // Strict counts the alias as given (PyTorch unties the map before checking keys).
    let strict = FunctionalOptions::default().strict();
    model.functional_call_with(&sd, &strict, |m| m.call(&x))?;
    Ok(())
}

/// "If the user passes {'foo': foo_value, 'tied_foo': tied_foo_value, ...}, it will raise an
/// error. If the user passes {'foo': foo_value, 'tied_foo': foo_value, ...}, it will not"
/// (`_untie_named_tensors_map`: values compared by identity).
#[test]
fn two_values_for_one_tied_weight_are_an_error() -> Result<()> {
    let model = Tied::new();
    let x = full(1.0, &[1, 2]);
    let eye = Tensor::eye(2, DType::F32, &dev())?;
    let mut sd = StateDict::new();
    sd.insert("fc1.weight", eye.clone());
    sd.insert("fc2.weight", eye.clone());
    model.functional_call(&sd, &x)?; // the same tensor twice is fine
    sd.insert("fc2.weight", eye.copy()?);
    let err = model.functional_call(&sd, &x).unwrap_err();
    assert!(
        matches!(&err, Error::TiedValues { keys } if keys == &["fc1.weight", "fc2.weight"]),
        "{err}"
    );
    Ok(())
}

#[test]
fn hooks_fire_inside_a_functional_call() -> Result<()> {
    let model = Tied::new();
    let mut sd = StateDict::new();
    sd.insert("fc1.weight", full(0.0, &[2, 2]));
    sd.insert("fc1.bias", full(3.0, &[2]));
    let x = full(1.0, &[1, 2]);
    let (_, captured) = model.capture(&["fc1"], |m| m.functional_call(&sd, &x))?;
    assert_eq!(vec2(captured.get("fc1").unwrap()), [[3.0, 3.0]]);
    Ok(())
}

/// Beyond PyTorch, which swaps tensors into the shared module: 8 threads make functional calls
/// on one `Arc<Model>` at once, each seeing only its own tensors, while plain calls on another
/// thread see the model's.
#[test]
fn threads_see_only_their_own_substitutions() -> Result<()> {
    let model = Arc::new(Linear::new(3, 2, &dev())?);
    let x = full(1.0, &[1, 3]);
    let plain = vec2(&model.call(&x)?);
    let barrier = Arc::new(Barrier::new(9));
    let mut handles = Vec::new();
    for i in 0..8 {
        let (model, x, barrier) = (model.clone(), x.clone(), barrier.clone());
        handles.push(std::thread::spawn(move || -> Result<()> {
            let sd = linear_tensors(i as f32, 0.0);
            barrier.wait();
            for _ in 0..50 {
                let y = model.functional_call(&sd, &x)?;
                let want = 3.0 * i as f32;
                assert_eq!(vec2(&y), [[want, want]], "thread {i}");
            }
            Ok(())
        }));
    }
    let (observer_model, observer_x) = (model.clone(), x.clone());
    let observer = std::thread::spawn(move || -> Result<()> {
        for _ in 0..50 {
            assert_eq!(vec2(&observer_model.call(&observer_x)?), plain);
        }
        Ok(())
    });
    barrier.wait();
    for h in handles {
        h.join().expect("worker panicked")?;
    }
    observer.join().expect("observer panicked")?;
    Ok(())
}

/// Gradients flow into substituted tensors that are variables (what `torch.func.grad` over
/// `functional_call` gives in PyTorch); the model's own replaced parameters get none.
#[test]
fn gradients_flow_into_substituted_variables() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let w = candle_core::Var::from_tensor(&full(2.0, &[2, 3]))?;
    let mut sd = StateDict::new();
    sd.insert("weight", w.as_tensor().clone());
    let x = Tensor::new(&[[1f32, 2., 3.]], &dev())?;
    let y = model.functional_call(&sd, &x)?;
    let grads = y.sum_all()?.backward()?;
    let gw = grads
        .get(&w)
        .expect("a gradient for the substituted weight");
    assert_eq!(vec2(gw), [[1.0, 2.0, 3.0], [1.0, 2.0, 3.0]]);
    assert!(grads.get(model.weight.var()?.as_tensor()).is_none());
    assert!(grads
        .get(model.bias.as_ref().unwrap().var()?.as_tensor())
        .is_some()); // not replaced: still trained
    Ok(())
}

/// Under `no_grad` a substituted tensor is read detached, as parameters are.
#[test]
fn no_grad_detaches_substituted_tensors() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let w = candle_core::Var::from_tensor(&full(2.0, &[2, 3]))?;
    let mut sd = StateDict::new();
    sd.insert("weight", w.as_tensor().clone());
    let x = full(1.0, &[1, 3]);
    let y = {
        let _guard = no_grad();
        model.functional_call(&sd, &x)?
    };
    assert!(!y.track_op());
    assert!(model.functional_call(&sd, &x)?.track_op());
    Ok(())
}

#[test]
fn scopes_nest_and_close_on_panic() -> Result<()> {
    let model = Linear::new(3, 2, &dev())?;
    let x = full(1.0, &[1, 3]);
    let plain = vec2(&model.call(&x)?);
    let outer = linear_tensors(1.0, 0.0);
    let mut inner = StateDict::new();
    inner.insert("bias", full(100.0, &[2]));
    let opts = FunctionalOptions::default();
    model.functional_call_with(&outer, &opts, |m| {
        assert_eq!(vec2(&m.call(&x)?), [[3.0, 3.0]]);
        // The inner scope's bias wins; the outer weight still applies.
        assert_eq!(vec2(&m.functional_call(&inner, &x)?), [[103.0, 103.0]]);
        assert_eq!(vec2(&m.call(&x)?), [[3.0, 3.0]]);
        Ok(())
    })?;
    let panicked = catch_unwind(AssertUnwindSafe(|| {
        let _ = model.functional_call_with(&outer, &opts, |_| -> Result<()> {
            panic!("inside the scope")
        });
    }));
    assert!(panicked.is_err());
    assert_eq!(
        vec2(&model.call(&x)?),
        plain,
        "the scope outlived the panic"
    );
    Ok(())
}

#[test]
fn buffers_can_be_substituted_and_writes_stay_in_the_call() -> Result<()> {
    let model = Net::new();
    let x = Tensor::new(&[[1f32, 2., 3.], [0., -1., 4.]], &dev())?;
    let mut sd = StateDict::new();
    // A non-persistent buffer can be substituted too (`named_buffers(remove_duplicate=False)`).
    sd.insert("scale", full(0.0, &[2]));
    let y = model.functional_call(&sd, &x)?;
    assert_eq!(vec2(&y), [[0.0, 0.0], [0.0, 0.0]]);
    // The model is in training mode: BatchNorm writes its running statistics, into the call's
    // copies, substituted or not. Deviation: PyTorch writes them in place into the module's
    // buffers, or into the tensors passed (the "in-place operations" note of `functional_call`).
    let given = full(5.0, &[2]);
    sd.insert("bn.running_mean", given.clone());
    model.functional_call(&sd, &x)?;
    let bn = &model.bn;
    assert_eq!(
        bn.running_mean
            .as_ref()
            .unwrap()
            .tensor()?
            .to_vec1::<f32>()?,
        [0.0, 0.0]
    );
    assert_eq!(
        bn.running_var
            .as_ref()
            .unwrap()
            .tensor()?
            .to_vec1::<f32>()?,
        [1.0, 1.0]
    );
    let nbt = bn.num_batches_tracked.as_ref().unwrap().tensor()?;
    assert_eq!(nbt.to_scalar::<i64>()?, 0);
    assert_eq!(given.to_vec1::<f32>()?, [5.0, 5.0]);
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// call_and_update

#[test]
fn call_and_update_returns_the_updated_buffers_and_leaves_the_model_unchanged() -> Result<()> {
    let model = Net::new();
    model.eval();
    let x = Tensor::new(&[[1f32, 2., 3.], [0., -1., 4.], [2., 2., 2.]], &dev())?;
    let before = model.state_dict()?;
    let (y, state) = model.call_and_update(&StateDict::new(), &x)?;
    assert_eq!(
        state.keys().collect::<Vec<_>>(),
        [
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked"
        ]
    );
    // The same as a training step on an independent copy.
    let copy = model.deep_clone()?;
    copy.train();
    let y_ref = copy.call(&x)?;
    assert_eq!(vec2(&y), vec2(&y_ref));
    let after_ref = copy.state_dict()?;
    for (k, t) in state.iter() {
        let diff = (t.to_dtype(DType::F64)? - after_ref.get(k).unwrap().to_dtype(DType::F64)?)?;
        assert_eq!(diff.abs()?.sum_all()?.to_scalar::<f64>()?, 0.0, "{k}");
    }
    // The model: still in eval mode, buffers as before.
    assert!(!model.is_training());
    assert!(!model.bn.mode.is_training());
    for (k, t) in before.iter() {
        let diff = (t.to_dtype(DType::F64)?
            - model.state_dict()?.get(k).unwrap().to_dtype(DType::F64)?)?;
        assert_eq!(
            diff.abs()?.sum_all()?.to_scalar::<f64>()?,
            0.0,
            "{k} changed"
        );
    }
    // Threading the state: a second step counts two batches.
    let (_, state2) = model.call_and_update(&state, &x)?;
    assert_eq!(
        state2
            .get("bn.num_batches_tracked")
            .unwrap()
            .to_scalar::<i64>()?,
        2
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// flatten

#[test]
fn flatten_round_trips_exactly_in_state_dict_order() -> Result<()> {
    let model = Net::new();
    let sd = model.state_dict()?;
    let (tensors, spec) = model.flatten()?;
    assert_eq!(
        spec.paths().collect::<Vec<_>>(),
        sd.keys().collect::<Vec<_>>()
    );
    assert_eq!(spec.entries()[0].shape.dims(), [2, 3]);
    let back = spec.unflatten(tensors.clone())?;
    for ((k1, a), (k2, b)) in back.iter().zip(sd.iter()) {
        assert_eq!(k1, k2);
        assert_eq!(a.dtype(), b.dtype());
        let diff = (a.to_dtype(DType::F64)? - b.to_dtype(DType::F64)?)?;
        assert_eq!(diff.abs()?.sum_all()?.to_scalar::<f64>()?, 0.0);
    }
    let err = spec.unflatten(tensors[1..].to_vec()).unwrap_err();
    assert!(matches!(err, Error::FlatLength { expected, got } if expected == got + 1));
    let mut wrong = tensors;
    wrong[0] = full(0.0, &[3, 2]);
    assert!(
        matches!(spec.unflatten(wrong), Err(Error::Load(r)) if r.mismatched[0].key == "fc.weight")
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// deep_clone

#[test]
fn deep_clone_is_independent_and_keeps_ties() -> Result<()> {
    let model = Tied::new();
    model.fc1.bias.as_ref().unwrap().set_requires_grad(false);
    model.eval();
    let copy = model.deep_clone()?;
    // Fresh identities, ties kept inside the copy.
    assert!(!copy.fc1.weight.same_as(&model.fc1.weight));
    assert!(copy.fc1.weight.same_as(&copy.fc2.weight));
    assert_eq!(copy.named_parameters().len(), 3);
    assert!(!copy.fc1.bias.as_ref().unwrap().requires_grad());
    assert!(!copy.is_training());
    // Same values, independent storage.
    assert_eq!(
        vec2(&copy.fc1.weight.tensor()?),
        vec2(&model.fc1.weight.tensor()?)
    );
    copy.fc2.weight.set(&full(7.0, &[2, 2]))?;
    assert_eq!(vec2(&copy.fc1.weight.tensor()?), [[7.0, 7.0], [7.0, 7.0]]);
    assert_ne!(vec2(&model.fc1.weight.tensor()?), [[7.0, 7.0], [7.0, 7.0]]);
    Ok(())
}

#[test]
fn deep_clone_copies_buffers() -> Result<()> {
    let model = Net::new();
    let copy = model.deep_clone()?;
    copy.train();
    copy.call(&full(1.0, &[4, 3]))?;
    let nbt = |m: &Net| -> Result<i64> {
        Ok(m.bn
            .num_batches_tracked
            .as_ref()
            .unwrap()
            .tensor()?
            .to_scalar::<i64>()?)
    };
    assert_eq!(nbt(&copy)?, 1);
    assert_eq!(nbt(&model)?, 0);
    assert!(!copy.scale.is_persistent());
    Ok(())
}

#[derive(Module, Clone)]
struct WithArc {
    shared: Arc<Linear>,
}

#[test]
fn deep_clone_refuses_modules_shared_through_arc() -> Result<()> {
    let model = WithArc {
        shared: Arc::new(Linear::new(2, 2, &dev())?),
    };
    let Err(err) = model.deep_clone() else {
        panic!("expected an error")
    };
    assert!(
        matches!(&err, Error::SharedModule { path } if path == "shared"),
        "{err}"
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// expect_outputs

#[derive(Module)]
struct Outer {
    block: Sequential,
    head: Linear,
}

impl Forward<&Tensor> for Outer {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.head.call(&self.block.call(x)?)
    }
}

fn outer() -> Outer {
    let dev = dev();
    Outer {
        block: Sequential::new()
            .add(Linear::new(3, 3, &dev).unwrap())
            .add(Linear::new(3, 3, &dev).unwrap()),
        head: Linear::new(3, 2, &dev).unwrap(),
    }
}

#[test]
fn expect_outputs_accepts_a_matching_run() -> Result<()> {
    let model = outer();
    let x = full(1.0, &[2, 3]);
    let (_, reference) = model.capture(&["block", "block.*", "head"], |m| m.call(&x))?;
    let y = model.expect_outputs(&reference, Tolerance::exact(), |m| m.call(&x))?;
    assert_eq!(y.dims(), [2, 2]);
    Ok(())
}

/// The first diverging call in call order: `block` starts before `block.1` (which diverges
/// first in completion order), and `head` follows.
#[test]
fn expect_outputs_names_the_first_diverging_call() -> Result<()> {
    let model = outer();
    let x = full(1.0, &[2, 3]);
    let (_, reference) = model.capture(&["block", "block.*", "head"], |m| m.call(&x))?;
    let mut sd = StateDict::new();
    sd.insert(
        "block.1.bias",
        (model.get_parameter("block.1.bias")?.tensor()? + 0.25)?,
    );
    let err = model
        .expect_outputs(&reference, Tolerance::for_dtype(DType::F32), |m| {
            m.functional_call(&sd, &x)
        })
        .unwrap_err();
    match &err {
        Error::OutputMismatch(d) => {
            assert_eq!(d.path, "block");
            assert_eq!(d.call, 0);
            assert!((d.max_diff - 0.25).abs() < 1e-6, "{}", d.max_diff);
            assert_eq!(d.diverging, ["block", "block.1", "head"]);
            assert!(
                err.to_string()
                    .starts_with("output 0 of call 0 of `block` differs"),
                "{err}"
            );
        }
        other => panic!("expected an output mismatch, got {other}"),
    }
    // Only the inner layers checked: `block.0` matches, `block.1` is named.
    let inner: Captures = model.capture(&["block.*"], |m| m.call(&x))?.1;
    let err = model
        .expect_outputs(&inner, Tolerance::for_dtype(DType::F32), |m| {
            m.functional_call(&sd, &x)
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::OutputMismatch(d) if d.path == "block.1"),
        "{err}"
    );
    Ok(())
}

#[test]
fn expect_outputs_reports_shapes_and_calls_that_did_not_happen() -> Result<()> {
    let model = outer();
    let x = full(1.0, &[2, 3]);
    let (_, reference) = model.capture(&["head"], |m| m.call(&x))?;
    let err = model
        .expect_outputs(&reference, Tolerance::for_dtype(DType::F32), |m| {
            m.call(&full(1.0, &[1, 3]))
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::OutputMismatch(d) if d.max_diff.is_infinite()),
        "{err}"
    );
    let err = model
        .expect_outputs(&reference, Tolerance::for_dtype(DType::F32), |m| {
            m.block.call(&x)
        })
        .unwrap_err();
    assert!(
        matches!(&err, Error::NotRun { pattern, .. } if pattern == "head"),
        "{err}"
    );
    Ok(())
}

#[test]
fn expected_outputs_can_be_given_by_path() -> Result<()> {
    let model = outer();
    let x = full(1.0, &[2, 3]);
    let head = model
        .capture(&["head"], |m| m.call(&x))?
        .1
        .get("head")
        .unwrap()
        .clone();
    let expected: Captures = [("head", (head + 1e-3)?)].into_iter().collect();
    model.expect_outputs(&expected, Tolerance::new(1e-2, 0.0), |m| m.call(&x))?;
    let err = model
        .expect_outputs(&expected, Tolerance::new(1e-4, 0.0), |m| m.call(&x))
        .unwrap_err();
    assert!(
        matches!(&err, Error::OutputMismatch(d) if (d.max_diff - 1e-3).abs() < 1e-5),
        "{err}"
    );
    Ok(())
}

/// An honest float32 difference between two frameworks (5e-7 on an output of 0.01, what PyTorch
/// and candle differ by after rounding) passes the float32 tolerance and fails `torch.allclose`'s.
#[test]
fn the_float32_tolerance_accepts_rounding_differences_that_allclose_rejects() -> Result<()> {
    let dev = Device::Cpu;
    let layer = Linear::new(1, 1, &dev)?;
    layer
        .weight
        .set(&Tensor::zeros((1, 1), DType::F32, &dev)?)?;
    layer
        .bias
        .as_ref()
        .unwrap()
        .set(&Tensor::new(&[0.01f32], &dev)?)?;
    let model = Sequential::new().add(layer);
    let x = Tensor::ones((1, 1), DType::F32, &dev)?;
    let expected: Captures = [("0", Tensor::new(&[[0.0100005f32]], &dev)?)]
        .into_iter()
        .collect();
    model.expect_outputs(&expected, Tolerance::for_dtype(DType::F32), |m| m.call(&x))?;
    let err = model
        .expect_outputs(&expected, Tolerance::allclose(), |m| m.call(&x))
        .unwrap_err();
    assert!(matches!(err, Error::OutputMismatch(_)), "{err}");
    Ok(())
}

/// The training mode of `call_and_update` is the calling thread's only: threads updating state
/// from one model in eval mode do not change what a plain call on another thread computes.
#[test]
fn call_and_update_on_threads_leaves_plain_calls_in_eval_mode() -> Result<()> {
    let model = Arc::new(Net::new());
    model.eval();
    let x = Tensor::new(&[[1f32, 2., 3.], [0., -1., 4.], [2., 2., 2.]], &dev())?;
    let eval_out = vec2(&model.call(&x)?);
    let states: Vec<_> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..8)
            .map(|_| {
                let (model, x) = (model.clone(), x.clone());
                s.spawn(move || -> Result<StateDict> {
                    let mut state = StateDict::new();
                    for _ in 0..5 {
                        state = model.call_and_update(&state, &x)?.1;
                    }
                    Ok(state)
                })
            })
            .collect();
        for _ in 0..20 {
            assert_eq!(vec2(&model.call(&x).unwrap()), eval_out);
        }
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for state in states {
        let n = state?
            .get("bn.num_batches_tracked")
            .unwrap()
            .to_scalar::<i64>()?;
        assert_eq!(n, 5);
    }
    assert_eq!(vec2(&model.call(&x)?), eval_out);
    Ok(())
}

/// PyTorch builds models on the `meta` device and runs them with `functional_call`; here a model
/// made under `empty_weights` (or with unbuilt lazy parameters) runs on given tensors and stays
/// unbuilt.
#[test]
fn unbuilt_models_run_on_given_tensors_and_stay_unbuilt() -> Result<()> {
    let empty = module_runtime::build_empty(|| Linear::new(3, 2, &dev()))?;
    let x = full(1.0, &[1, 3]);
    assert_eq!(
        vec2(&empty.functional_call(&linear_tensors(1.0, 0.0), &x)?),
        [[3.0, 3.0]]
    );
    assert!(!empty.weight.is_built());
    let mut only_weight = StateDict::new();
    only_weight.insert("weight", full(1.0, &[2, 3]));
    let err = empty.functional_call(&only_weight, &x).unwrap_err();
    assert!(
        matches!(&err, Error::Unbuilt { paths, .. } if paths == &["bias"]),
        "{err}"
    );

    // A lazy layer takes any shape its lazy shape accepts, and is not built by the call.
    let lazy = module_runtime::nn::LazyLinear::new(2, &dev())?;
    let y = lazy.functional_call(&linear_tensors(1.0, 0.0), &x)?;
    assert_eq!(vec2(&y), [[3.0, 3.0]]);
    assert!(!lazy.get_parameter("weight")?.is_built());
    let mut wrong = linear_tensors(1.0, 0.0);
    wrong.insert("weight", full(1.0, &[5, 3]));
    let err = lazy.functional_call(&wrong, &x).unwrap_err();
    assert!(
        matches!(&err, Error::Load(r) if r.mismatched[0].unbuilt.is_some()),
        "{err}"
    );
    Ok(())
}
