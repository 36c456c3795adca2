//! What `#[module(flatten)]` must not lose: names that collide through a flattened field are a
//! typed error of the state dict and loads (never a silently dropped parameter), and a flattened
//! field's extra state is saved at its parent's `_extra_state` key.

use std::sync::atomic::{AtomicI64, Ordering};

use module_runtime::prelude::*;
use module_runtime::{Error, ExtraState};

fn dev() -> Device {
    Device::Cpu
}

fn param(n: usize) -> Param {
    Param::new(Tensor::ones(n, DType::F32, &dev()).unwrap()).unwrap()
}

fn linear() -> Linear {
    Linear::new(2, 2, &dev()).unwrap()
}

#[derive(Module)]
struct Clash {
    weight: Param,
    #[module(flatten)]
    inner: Linear,
}

#[derive(Module)]
struct Outer {
    enc: Clash,
}

/// `inner`'s `weight` lands at the parent's level, where the field `weight` already is: before,
/// `named_parameters` listed `weight` twice and the state dict kept one of them (the field's
/// parameter was lost, and loading the model's own state dict failed).
#[test]
fn a_name_clash_through_flatten_is_a_typed_error() {
    let c = Clash {
        weight: param(3),
        inner: linear(),
    };
    let err = c.state_dict().unwrap_err();
    match &err {
        Error::DuplicateName {
            path,
            first,
            second,
            fields,
            ..
        } => {
            assert_eq!(path, "weight");
            assert_eq!((*first, *second), ("parameter", "parameter"));
            assert_eq!(fields, &["inner"]);
        }
        other => panic!("expected DuplicateName, got {other:?}"),
    }
    let message = err.to_string();
    assert_eq!(
        message,
        "two children of `Clash` are at `weight` (a parameter, then a parameter): the \
         `#[module(flatten)]`ed field `inner` lifts its children and extra state to `Clash`'s \
         level; `rename` the clashing field, or do not flatten"
    );
    assert!(message.contains("`Clash`"), "{message}");
    assert!(message.contains("`weight`"), "{message}");
    assert!(message.contains("`inner`"), "{message}");

    // Loads refuse it too, before anything changes.
    let mut sd = StateDict::new();
    sd.insert("weight", Tensor::zeros(3, DType::F32, &dev()).unwrap());
    assert!(matches!(
        c.load_state_dict(&sd, &LoadOptions::default()),
        Err(Error::DuplicateName { .. })
    ));
    assert_eq!(
        c.weight.tensor().unwrap().to_vec1::<f32>().unwrap(),
        [1.0; 3]
    );

    // Deeper in a model, the error names the full path.
    let o = Outer { enc: c };
    match o.state_dict() {
        Err(Error::DuplicateName { path, .. }) => assert_eq!(path, "enc.weight"),
        other => panic!("expected DuplicateName, got {:?}", other.map(|sd| sd.len())),
    }
}

#[derive(Module)]
struct TwoFlat {
    #[module(flatten)]
    a: Linear,
    #[module(flatten)]
    b: Linear,
}

#[test]
fn two_flattened_fields_with_one_child_name_clash() {
    let m = TwoFlat {
        a: linear(),
        b: linear(),
    };
    match m.state_dict() {
        Err(Error::DuplicateName { path, fields, .. }) => {
            assert_eq!(path, "weight");
            assert_eq!(fields, ["a", "b"]);
        }
        other => panic!("expected DuplicateName, got {:?}", other.map(|sd| sd.len())),
    }
}

#[derive(Module)]
struct NoClash {
    /// Configuration named like a child of the flattened layer holds nothing to lose.
    bias: bool,
    extra: Option<Param>,
    #[module(flatten)]
    inner: Linear,
}

#[test]
fn configuration_and_absent_fields_do_not_clash() {
    let m = NoClash {
        bias: true,
        extra: None,
        inner: linear(),
    };
    let sd = m.state_dict().unwrap();
    assert_eq!(sd.keys().collect::<Vec<_>>(), ["weight", "bias"]);
    m.load_state_dict(&sd, &LoadOptions::default()).unwrap();
}

/// A module whose extra state is a step counter.
#[derive(Module)]
#[module(extra_state)]
struct Counter {
    scale: Param,
    #[module(skip)]
    steps: AtomicI64,
}

impl ExtraState for Counter {
    fn get_extra_state(&self) -> Result<Tensor> {
        Ok(Tensor::new(
            self.steps.load(Ordering::Relaxed),
            &Device::Cpu,
        )?)
    }
    fn set_extra_state(&self, state: &Tensor) -> Result<()> {
        self.steps
            .store(state.to_scalar::<i64>()?, Ordering::Relaxed);
        Ok(())
    }
}

fn counter(steps: i64) -> Counter {
    Counter {
        scale: param(1),
        steps: AtomicI64::new(steps),
    }
}

#[derive(Module)]
struct Wrap {
    #[module(flatten)]
    counter: Counter,
    head: Linear,
}

#[derive(Module)]
struct Top {
    wrap: Wrap,
}

/// A flattened field's extra state is lifted with its children, to its parent's `_extra_state`
/// (as a single-field enum variant passes it through): before, it was not saved at all.
#[test]
fn a_flattened_fields_extra_state_is_saved_and_loaded() {
    let a = Top {
        wrap: Wrap {
            counter: counter(7),
            head: linear(),
        },
    };
    let sd = a.state_dict().unwrap();
    assert_eq!(
        sd.keys().collect::<Vec<_>>(),
        [
            "wrap.scale",
            "wrap._extra_state",
            "wrap.head.weight",
            "wrap.head.bias"
        ]
    );
    let b = Top {
        wrap: Wrap {
            counter: counter(0),
            head: linear(),
        },
    };
    b.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    assert_eq!(b.wrap.counter.steps.load(Ordering::Relaxed), 7);

    // Through a file too.
    let path =
        std::env::temp_dir().join(format!("derive_holes_{}.safetensors", std::process::id()));
    a.wrap.counter.steps.store(11, Ordering::Relaxed);
    a.save_safetensors(&path).unwrap();
    b.load_state_dict(&path, &LoadOptions::default()).unwrap();
    let _ = std::fs::remove_file(&path);
    assert_eq!(b.wrap.counter.steps.load(Ordering::Relaxed), 11);
}

#[derive(Module)]
enum Either {
    Counted {
        #[module(flatten)]
        counter: Counter,
    },
    Plain {
        head: Linear,
    },
    Pair(#[module(flatten)] Counter, Linear),
}

#[test]
fn an_enum_variants_flattened_field_keeps_its_extra_state() {
    let e = Either::Counted {
        counter: counter(3),
    };
    let sd = e.state_dict().unwrap();
    assert_eq!(sd.keys().collect::<Vec<_>>(), ["scale", "_extra_state"]);
    let other = Either::Plain { head: linear() };
    assert_eq!(
        other.state_dict().unwrap().keys().collect::<Vec<_>>(),
        ["head.weight", "head.bias"]
    );
    let pair = Either::Pair(counter(5), linear());
    assert_eq!(
        pair.state_dict().unwrap().keys().collect::<Vec<_>>(),
        ["scale", "_extra_state", "1.weight", "1.bias"]
    );
}

/// Two extra states at one key: the module's own and a flattened field's.
#[derive(Module)]
#[module(extra_state)]
struct OwnAndLifted {
    #[module(flatten)]
    counter: Counter,
    #[module(skip)]
    steps: AtomicI64,
}

impl ExtraState for OwnAndLifted {
    fn get_extra_state(&self) -> Result<Tensor> {
        Ok(Tensor::new(
            self.steps.load(Ordering::Relaxed),
            &Device::Cpu,
        )?)
    }
    fn set_extra_state(&self, state: &Tensor) -> Result<()> {
        self.steps
            .store(state.to_scalar::<i64>()?, Ordering::Relaxed);
        Ok(())
    }
}

#[derive(Module)]
struct TwoCounters {
    #[module(flatten)]
    first: Option<Counter>,
    #[module(flatten)]
    second: Vec<Counter>,
}

#[test]
fn two_extra_states_at_one_key_are_a_typed_error() {
    let m = OwnAndLifted {
        counter: counter(1),
        steps: AtomicI64::new(2),
    };
    match m.state_dict() {
        Err(Error::DuplicateName {
            path,
            first,
            fields,
            ..
        }) => {
            assert_eq!(path, "_extra_state");
            assert_eq!(first, "extra state");
            assert_eq!(fields, ["counter"]);
        }
        other => panic!("expected DuplicateName, got {:?}", other.map(|sd| sd.len())),
    }
    // A `Vec` names its elements (`0`, `1`): its elements' extra states are theirs, at `0._extra_state`.
    let m = TwoCounters {
        first: Some(counter(1)),
        second: vec![counter(2)],
    };
    let sd = m.state_dict().unwrap();
    assert_eq!(
        sd.keys().collect::<Vec<_>>(),
        ["scale", "_extra_state", "0.scale", "0._extra_state"]
    );
}
