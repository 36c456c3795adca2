//! The `torch.nn` fixtures of issue 29 (`fixtures/pytorch/nn/NAME.safetensors`, made by
//! `fixtures/make_nn_fixtures.py` and `fixtures/make_transformer_fixtures.py`, which say what each
//! file holds) and the check every `nn_*` parity test runs against one: load the state by
//! PyTorch's names, run the forward pass on the fixture's inputs, compare the output, backpropagate
//! `(output * upstream).sum()` and compare the gradients of the inputs and parameters PyTorch
//! stored, and the parameters' values after the call where the file has them (`after.<key>`).
//! Every key of the file must be used.
//!
//! Tolerance: `|actual - expected| <= 1e-5 + 1e-5 * |expected|` elementwise (the fixtures are
//! within 1e-6 of a float64 rerun).
//!
//! The device under test is `MODULE_DEVICE` (`cuda:0`, `metal:0`; the CPU when unset), as for
//! the root package's parity tests: the fixture is loaded there and the module moved there.

use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::path::PathBuf;

use candle_core::{DType, Device, Tensor, Var};
use module_runtime::{parse_device, Forward, Module, ModuleExt, Result};

/// Absolute and relative tolerance.
pub const TOL: f64 = 1e-5;

/// `fixtures/pytorch/nn` of the repository: the first ancestor of this crate's folder that has it
/// (the crate may sit at any depth of the workspace).
fn fixtures_dir() -> PathBuf {
    let start = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    start
        .ancestors()
        .map(|dir| dir.join("fixtures/pytorch/nn"))
        .find(|dir| dir.is_dir())
        .expect("fixtures/pytorch/nn in an ancestor of the crate's folder")
}

/// The device under test: `MODULE_DEVICE`, else the CPU.
pub fn device() -> Device {
    match std::env::var("MODULE_DEVICE") {
        Ok(name) if !name.is_empty() => parse_device(&name).expect("MODULE_DEVICE names a device"),
        _ => Device::Cpu,
    }
}

/// Loads `NAME.safetensors` onto the device under test.
fn load(name: &str) -> HashMap<String, Tensor> {
    let path = fixtures_dir().join(format!("{name}.safetensors"));
    candle_core::safetensors::load(&path, &device())
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()))
}

/// Asserts that `actual` has `expected`'s shape and values within [`TOL`].
pub fn assert_close(what: &str, actual: &Tensor, expected: &Tensor) {
    assert_eq!(actual.dims(), expected.dims(), "{what}: shape");
    let flat = |t: &Tensor| -> Vec<f64> {
        t.to_dtype(DType::F64)
            .and_then(|t| t.flatten_all())
            .and_then(|t| t.to_vec1::<f64>())
            .expect("a float tensor")
    };
    let (a, e) = (flat(actual), flat(expected));
    for (i, (a, e)) in a.iter().zip(&e).enumerate() {
        let ok = (a - e).abs() <= TOL + TOL * e.abs();
        assert!(ok, "{what}: element {i} is {a} but PyTorch has {e}");
    }
}

/// Checks `module` against fixture `case`: `forward` gets the fixture's tensors `inputs` (in that
/// order; floating-point ones as fresh variables, so their gradients can be compared).
pub fn check(
    case: &str,
    module: &dyn Module,
    inputs: &[&str],
    forward: impl Fn(&[Tensor]) -> Result<Tensor>,
) {
    let tensors = load(case);
    module.to_device(&device()).unwrap();
    let used = RefCell::new(BTreeSet::new());
    let get = |key: &str| -> Tensor {
        used.borrow_mut().insert(key.to_owned());
        tensors
            .get(key)
            .unwrap_or_else(|| panic!("{case}: no key `{key}`"))
            .clone()
    };
    for (name, p) in module.named_parameters() {
        p.set(&get(&format!("param.{name}"))).unwrap();
    }
    for (name, b) in module.named_buffers() {
        b.set(&get(&format!("param.{name}"))).unwrap();
    }
    let mut vars = Vec::new();
    let values: Vec<Tensor> = inputs
        .iter()
        .map(|name| {
            let t = get(name);
            if t.dtype().is_float() {
                let var = Var::from_tensor(&t).unwrap();
                vars.push((*name, var.as_tensor().clone()));
                var.as_tensor().clone()
            } else {
                t
            }
        })
        .collect();
    let output = forward(&values).unwrap_or_else(|e| panic!("{case}: forward failed: {e}"));
    assert_close(&format!("{case}: output"), &output, &get("output"));
    let upstream = get("upstream");
    let grads = (output * upstream)
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    for (name, var) in &vars {
        let key = format!("grad.{name}");
        if let Some(expected) = tensors.get(&key) {
            used.borrow_mut().insert(key.clone());
            let got = grads.get(var).unwrap_or_else(|| panic!("{case}: no {key}"));
            assert_close(&format!("{case}: {key}"), got, expected);
        }
    }
    for (name, p) in module.named_parameters() {
        let key = format!("grad.param.{name}");
        let got = grads.get(&p.tensor().unwrap()).cloned();
        let got = got.unwrap_or_else(|| panic!("{case}: no {key}"));
        assert_close(&format!("{case}: {key}"), &got, &get(&key));
    }
    // State the forward changes in place (an embedding's `max_norm` renormalisation).
    for (name, p) in module.named_parameters() {
        let key = format!("after.{name}");
        if let Some(expected) = tensors.get(&key) {
            used.borrow_mut().insert(key.clone());
            assert_close(&format!("{case}: {key}"), &p.tensor().unwrap(), expected);
        }
    }
    let used = used.borrow();
    let unused: Vec<&String> = tensors.keys().filter(|k| !used.contains(*k)).collect();
    assert!(unused.is_empty(), "{case}: keys never compared: {unused:?}");
}

/// [`check`] for a layer of one tensor, called through `call` (hooks included).
pub fn check_unary<M>(case: &str, layer: &M)
where
    M: Module + for<'a> Forward<&'a Tensor, Output = Tensor>,
{
    check(case, layer, &["input"], |x| layer.call(&x[0]));
}
