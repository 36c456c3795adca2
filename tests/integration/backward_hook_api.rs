//! Backward hooks through the public API, beyond PyTorch's fixtures (those are
//! `backward_hooks.rs`): several inputs and outputs, typed errors, registration order, layouts and
//! dtypes of hooked tensors, typed paths.

use std::sync::{Arc, Mutex};

use module_runtime::nn::{Linear, ReLU};
use module_runtime::prelude::*;
use module_runtime::{BackwardHookError, BackwardHookOptions};

use super::backward_hooks::{dev, loss, setup};

/// A module of several inputs and outputs: one call of each hook with every gradient, zeros for
/// an input that requires a gradient but received none and `None` for an output that received
/// none (PyTorch's `(a*2, b*3)` with only the first output in the loss).
#[test]
fn several_inputs_and_outputs() {
    #[derive(Module)]
    struct Two {
        act: ReLU,
    }
    impl Forward<(&Tensor, &Tensor)> for Two {
        type Output = (Tensor, Tensor);
        fn forward(&self, (a, b): (&Tensor, &Tensor)) -> Result<(Tensor, Tensor)> {
            Ok(((a * 2.0)?, (b * 3.0)?))
        }
    }
    let two = Two { act: ReLU::new() };
    let hooks = Hooks::new();
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    hooks.register_global_full_backward_pre_hook(
        move |_, go| {
            l.lock().unwrap().push(("pre", vec![], go.to_vec()));
            Ok(None)
        },
        BackwardHookOptions::default(),
    );
    let l = log.clone();
    hooks.register_global_full_backward_hook(
        move |_, gi, go| {
            l.lock().unwrap().push(("full", gi.to_vec(), go.to_vec()));
            Ok(None)
        },
        BackwardHookOptions::default(),
    );
    let a = candle_core::Var::ones(2, DType::F32, &dev()).unwrap();
    let b = candle_core::Var::ones(2, DType::F32, &dev()).unwrap();
    let (y, _unused) = hooks
        .run(&two, |m| m.call((a.as_tensor(), b.as_tensor())))
        .unwrap();
    let grads = y.sum_all().unwrap().backward().unwrap();
    let v = |t: &Option<Tensor>| t.as_ref().map(|t| t.to_vec1::<f32>().unwrap());
    let log = log.lock().unwrap();
    assert_eq!(log.len(), 2);
    assert_eq!(log[0].0, "pre");
    assert_eq!(
        log[0].2.iter().map(v).collect::<Vec<_>>(),
        [Some(vec![1.0, 1.0]), None]
    );
    assert_eq!(log[1].0, "full");
    let gi: Vec<_> = log[1].1.iter().map(v).collect();
    assert_eq!(gi, [Some(vec![2.0, 2.0]), Some(vec![0.0, 0.0])]);
    assert_eq!(grads.get(&a).unwrap().to_vec1::<f32>().unwrap(), [2.0, 2.0]);
    assert_eq!(grads.get(&b).unwrap().to_vec1::<f32>().unwrap(), [0.0, 0.0]);
}

/// Bad replacements fail the backward with a typed error naming the path and both shapes; a
/// full hook of a module without input gradients may return only `None`s; a tensor hook on a
/// tensor that records nothing is refused.
#[test]
fn bad_replacements_are_typed_errors() {
    let (net, values) = setup();
    let x = candle_core::Var::from_tensor(&values["x"]).unwrap();
    let hooks = Hooks::new();
    hooks
        .register_full_backward_hook(
            "block.fc",
            |_, _, _| Ok(Some(vec![Some(Tensor::zeros((2, 2), DType::F32, &dev())?)])),
            BackwardHookOptions::default(),
        )
        .unwrap();
    let l = loss(&net, &hooks, x.as_tensor(), &values["w"]).unwrap();
    let err: Error = l.backward().unwrap_err().into();
    let Error::BackwardHook(e) = &err else {
        panic!("expected a backward hook error, got {err}");
    };
    let BackwardHookError::GradMismatch {
        path,
        side,
        expected_shape,
        got_shape,
        ..
    } = &**e
    else {
        panic!("expected GradMismatch, got {e}");
    };
    assert_eq!((path.as_str(), *side), ("block.fc", "input"));
    assert_eq!(
        (expected_shape.as_slice(), got_shape.as_slice()),
        (&[3, 5][..], &[2, 2][..])
    );
    assert!(err.to_string().contains("block.fc"), "{err}");

    let hooks = Hooks::new();
    hooks
        .register_full_backward_pre_hook(
            "fc2",
            |_, _| Ok(Some(vec![None, None])),
            BackwardHookOptions::default(),
        )
        .unwrap();
    let l = loss(&net, &hooks, x.as_tensor(), &values["w"]).unwrap();
    let err: Error = l.backward().unwrap_err().into();
    assert!(
        matches!(
            err,
            Error::HookTensorCount {
                expected: 1,
                got: 2,
                ..
            }
        ),
        "{err}"
    );

    let hooks = Hooks::new();
    hooks
        .register_full_backward_hook(
            "fc1",
            |_, gi, _| {
                assert!(gi[0].is_none());
                Ok(Some(vec![Some(Tensor::zeros((3, 4), DType::F32, &dev())?)]))
            },
            BackwardHookOptions::default(),
        )
        .unwrap();
    let l = loss(&net, &hooks, &values["x"], &values["w"]).unwrap();
    let err: Error = l.backward().unwrap_err().into();
    assert!(
        matches!(&err, Error::BackwardHook(e) if matches!(&**e, BackwardHookError::NoInputGrad { path } if path == "fc1")),
        "{err}"
    );

    let hooks = Hooks::new();
    hooks
        .register_full_backward_hook(
            "fc2",
            |_, _, _| {
                Err(Error::InvalidInput {
                    layer: "test",
                    message: "no".into(),
                })
            },
            BackwardHookOptions::default(),
        )
        .unwrap();
    let l = loss(&net, &hooks, x.as_tensor(), &values["w"]).unwrap();
    let err: Error = l.backward().unwrap_err().into();
    assert!(
        matches!(&err, Error::Hook { path, hook: "full backward hook", .. } if path == "fc2"),
        "{err}"
    );

    let err = register_hook(&values["x"], |_| Ok(None)).unwrap_err();
    assert!(
        matches!(&err, Error::BackwardHook(e) if matches!(**e, BackwardHookError::NoGrad { .. })),
        "{err}"
    );
}

/// A module called twice fires its hooks once per call, each with that call's gradients; hooks of
/// one call fire global first, then in registration order with `prepend` first; a backward hook's
/// pattern that matches no module is refused before the run, as a forward hook's.
#[test]
fn each_call_fires_in_registration_order() {
    #[derive(Module)]
    struct Twice {
        fc: Linear,
    }
    impl Forward<&Tensor> for Twice {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = self.fc.call(x)?;
            self.fc.call(&(h * 3.0)?)
        }
    }
    let twice = Twice {
        fc: Linear::new(2, 2, &dev()).unwrap(),
    };
    let hooks = Hooks::new();
    let log = Arc::new(Mutex::new(Vec::<String>::new()));
    let opts = BackwardHookOptions::default();
    for (name, options) in [("a", opts), ("b", opts), ("first", opts.prepend())] {
        let l = log.clone();
        hooks
            .register_full_backward_pre_hook(
                "fc",
                move |_, go| {
                    let g = go[0].as_ref().unwrap().sum_all()?.to_scalar::<f32>()?;
                    l.lock().unwrap().push(format!("{name} {g}"));
                    Ok(None)
                },
                options,
            )
            .unwrap();
    }
    let l = log.clone();
    hooks.register_global_full_backward_pre_hook(
        move |ctx, _| {
            l.lock().unwrap().push(format!("global {}", ctx.path()));
            Ok(None)
        },
        opts,
    );
    let x = Tensor::ones((1, 2), DType::F32, &dev()).unwrap();
    let y = hooks.run(&twice, |m| m.call(&x)).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    // The second call's output gradient is 1 per element (2 in all); the first's is 3 × W^T 1.
    let log = log.lock().unwrap();
    assert_eq!(log[..5], ["global ", "global fc", "first 2", "a 2", "b 2"]);
    assert_eq!(log.len(), 9);
    assert_eq!(log[5], "global fc");
    let w = twice.fc.weight.tensor().unwrap();
    let first = (w.sum(0).unwrap() * 3.0).unwrap().sum_all().unwrap();
    let first = first.to_scalar::<f32>().unwrap();
    assert_eq!(log[6], format!("first {first}"));

    let typo = Hooks::new();
    typo.register_full_backward_hook("fcc", |_, _, _| Ok(None), opts)
        .unwrap();
    let err = typo.run(&twice, |m| m.call(&x)).unwrap_err();
    assert!(matches!(err, Error::NoModuleMatch { .. }), "{err}");
}

/// The identities that carry hooks keep their tensor's values whatever its layout (transposed,
/// a narrowed view at an offset) and dtype, and their gradients reach the right elements.
#[test]
fn hooked_tensors_keep_their_values_whatever_their_layout() {
    for dtype in [DType::F32, DType::BF16, DType::F64] {
        let base = Tensor::arange(0f32, 6., &dev())
            .unwrap()
            .reshape((2, 3))
            .unwrap();
        let w = candle_core::Var::from_tensor(&base.to_dtype(dtype).unwrap()).unwrap();
        let views = [
            w.as_tensor().t().unwrap(),
            w.as_tensor().narrow(1, 1, 2).unwrap(),
            w.as_tensor().narrow(0, 1, 1).unwrap(),
        ];
        let masks = [
            [[1., 1., 1.], [1., 1., 1.]],
            [[0., 1., 1.], [0., 1., 1.]],
            [[0., 0., 0.], [1., 1., 1.]],
        ];
        for (x, mask) in views.iter().zip(masks) {
            let y = register_hook(x, |g| Ok(Some((g * 2.0)?))).unwrap();
            let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec2::<f32>().unwrap();
            assert_eq!(f32s(&y), f32s(x), "{dtype:?}");
            let grads = y.sum_all().unwrap().backward().unwrap();
            let want: Vec<Vec<f32>> = mask
                .iter()
                .map(|r| r.iter().map(|m| m * 2.0).collect())
                .collect();
            assert_eq!(f32s(grads.get(&w).unwrap()), want, "{dtype:?}");
        }
    }
}

/// The typed-path forms register on the path the compiler checked.
#[test]
fn typed_paths_register_backward_hooks() {
    #[derive(Module)]
    #[module(paths)]
    struct Outer {
        inner: Inner,
    }
    #[derive(Module)]
    #[module(paths)]
    struct Inner {
        fc: Linear,
    }
    impl Forward<&Tensor> for Outer {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.inner.fc.call(x)
        }
    }
    let d = dev();
    let outer = Outer {
        inner: Inner {
            fc: Linear::new(2, 2, &d).unwrap(),
        },
    };
    let hooks = Hooks::new();
    let opts = BackwardHookOptions::default();
    let path = Outer::path().inner().fc();
    hooks
        .register_typed_full_backward_pre_hook(
            &path,
            |ctx, go| {
                assert_eq!(ctx.path(), "inner.fc");
                Ok(Some(vec![Some(go[0].as_ref().unwrap().zeros_like()?)]))
            },
            opts,
        )
        .unwrap();
    let x = candle_core::Var::ones((1, 2), DType::F32, &d).unwrap();
    let grads = hooks
        .run(&outer, |m| m.call(x.as_tensor()))
        .unwrap()
        .sum_all()
        .unwrap()
        .backward()
        .unwrap();
    let w = outer.inner.fc.weight.var().unwrap();
    let g = grads.get(&w).unwrap().abs().unwrap().sum_all().unwrap();
    assert_eq!(g.to_scalar::<f32>().unwrap(), 0.0);
}
