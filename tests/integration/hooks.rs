//! Forward hooks through the public API: ordering, replacement, removal, failures, threads, and
//! the tools built on them (capture, call order, summary with shapes).

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::{Arc, Barrier, Mutex};

use module_runtime::nn::{Linear, ReLU, Sequential};
use module_runtime::prelude::*;
use module_runtime::{Captures, HookCtx, TensorStruct};

/// The device under test: `MODULE_DEVICE` (`cuda:0`, …), the CPU when unset.
fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

/// A small model with every way of holding and calling a submodule.
#[derive(Module)]
struct Net {
    fc: Linear,
    act: ReLU,
    blocks: Vec<Linear>,
    boxed: Box<Linear>,
    shared_a: Arc<Linear>,
    shared_b: Arc<Linear>,
}

impl Net {
    fn new() -> Result<Self> {
        let shared = Arc::new(Linear::new(4, 4, &dev())?);
        Ok(Self {
            fc: Linear::new(4, 4, &dev())?,
            act: ReLU::new(),
            blocks: vec![Linear::new(4, 4, &dev())?, Linear::new(4, 4, &dev())?],
            boxed: Box::new(Linear::new(4, 4, &dev())?),
            shared_a: shared.clone(),
            shared_b: shared,
        })
    }
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;

    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mut h = self.fc.call(x)?;
        h = self.act.call(&h)?;
        for block in &self.blocks {
            h = block.call(&h)?;
        }
        h = self.boxed.call(&h)?;
        h = self.shared_a.call(&h)?;
        self.shared_b.call(&h)
    }
}

fn input() -> Result<Tensor> {
    Ok(Tensor::arange(0f32, 8., &dev())?.reshape((2, 4))?)
}

type Log = Arc<Mutex<Vec<String>>>;

fn log() -> Log {
    Arc::default()
}

fn take(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

fn assert_close(a: &Tensor, b: &Tensor) -> Result<()> {
    let diff = (a - b)?.abs()?.max_all()?.to_scalar::<f32>()?;
    assert!(diff < 1e-6, "tensors differ by {diff}");
    Ok(())
}

#[test]
fn every_call_reports_the_path_it_was_called_through() -> Result<()> {
    let net = Net::new()?;
    let (_, order) = net.call_order(|m| m.call(&input()?))?;
    assert_eq!(
        order,
        ["", "fc", "act", "blocks.0", "blocks.1", "boxed", "shared_a", "shared_b"]
    );
    Ok(())
}

#[test]
fn forward_hooks_fire_in_prepend_then_registration_order() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    let fired = log();
    for i in 0..5 {
        let fired = fired.clone();
        let hook = move |_: &HookCtx<'_>, _: &[Tensor], _: &[Tensor]| {
            fired.lock().unwrap().push(i.to_string());
            Ok(None)
        };
        if i == 1 || i == 4 {
            hooks.register_forward_hook("fc", hook, HookOptions::default().prepend())?;
        } else {
            hooks.register_forward_hook("fc", hook, HookOptions::default())?;
        }
    }
    for _ in 0..2 {
        hooks.run(&net, |m| m.call(&input()?))?;
        assert_eq!(take(&fired), ["4", "1", "0", "2", "3"]);
    }
    Ok(())
}

#[test]
fn pre_hooks_fire_in_prepend_then_registration_order() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    let fired = log();
    for i in 0..5 {
        let fired = fired.clone();
        let hook = move |_: &HookCtx<'_>, _: &[Tensor]| {
            fired.lock().unwrap().push(i.to_string());
            Ok(None)
        };
        if i == 0 || i == 4 {
            hooks.register_forward_pre_hook(
                "blocks.1",
                hook,
                PreHookOptions::default().prepend(),
            )?;
        } else {
            hooks.register_forward_pre_hook("blocks.1", hook, PreHookOptions::default())?;
        }
    }
    for _ in 0..2 {
        hooks.run(&net, |m| m.call(&input()?))?;
        assert_eq!(take(&fired), ["4", "0", "1", "2", "3"]);
    }
    Ok(())
}

#[test]
fn global_and_targeted_hooks_interleave_around_forward() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    let fired = log();
    let push = |name: &'static str| {
        let fired = fired.clone();
        move |ctx: &HookCtx<'_>| {
            if ctx.path() == "fc" {
                fired.lock().unwrap().push(name.to_owned());
            }
        }
    };
    let (a, b, c, d) = (
        push("local post"),
        push("global post"),
        push("local pre"),
        push("global pre"),
    );
    hooks.register_forward_hook(
        "fc",
        move |ctx, _, _| {
            a(ctx);
            Ok(None)
        },
        HookOptions::default(),
    )?;
    hooks.register_global_forward_hook(
        move |ctx, _, _| {
            b(ctx);
            Ok(None)
        },
        HookOptions::default(),
    );
    hooks.register_forward_pre_hook(
        "fc",
        move |ctx, _| {
            c(ctx);
            Ok(None)
        },
        PreHookOptions::default(),
    )?;
    hooks.register_global_forward_pre_hook(
        move |ctx, _| {
            d(ctx);
            Ok(None)
        },
        PreHookOptions::default(),
    );
    hooks.run(&net, |m| m.call(&input()?))?;
    assert_eq!(
        take(&fired),
        ["global pre", "local pre", "global post", "local post"]
    );
    Ok(())
}

#[test]
fn replacing_input_and_output_and_undoing_each() -> Result<()> {
    let fc = Linear::new(4, 3, &dev())?;
    let x = input()?;
    let hooks = Hooks::new();
    let double = hooks.register_forward_pre_hook(
        "",
        |_, input| Ok(Some(vec![(&input[0] * 2.)?])),
        PreHookOptions::default(),
    )?;
    let negate = hooks.register_forward_hook(
        "",
        |_, _, output| Ok(Some(vec![output[0].neg()?])),
        HookOptions::default(),
    )?;

    let f = |x: &Tensor| fc.call(x);
    let both = hooks.run(&fc, |m| m.call(&x))?;
    assert_close(&both, &f(&(&x * 2.)?)?.neg()?)?;

    assert!(double.remove());
    let negated = hooks.run(&fc, |m| m.call(&x))?;
    assert_close(&negated, &f(&x)?.neg()?)?;

    assert!(negate.remove());
    assert!(!negate.remove(), "removal is idempotent");
    let plain = hooks.run(&fc, |m| m.call(&x))?;
    assert_close(&plain, &f(&x)?)?;
    assert!(hooks.is_empty());
    Ok(())
}

#[test]
fn hooks_that_remove_themselves_fire_once() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    let fired = log();
    for name in ["first", "second"] {
        let fired = fired.clone();
        hooks.register_forward_hook(
            "blocks.0",
            move |ctx, _, _| {
                fired.lock().unwrap().push(name.to_owned());
                ctx.remove_this_hook();
                Ok(None)
            },
            HookOptions::default(),
        )?;
    }
    hooks.run(&net, |m| m.call(&input()?))?;
    assert_eq!(take(&fired), ["first", "second"]);
    hooks.run(&net, |m| m.call(&input()?))?;
    assert!(take(&fired).is_empty());
    assert!(hooks.is_empty());
    Ok(())
}

#[test]
fn a_submodule_called_three_times_fires_three_times() -> Result<()> {
    #[derive(Module)]
    struct Thrice {
        fc: Linear,
    }
    impl Forward<&Tensor> for Thrice {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let x = self.fc.call(x)?;
            let x = self.fc.call(&x)?;
            self.fc.call(&x)
        }
    }
    let m = Thrice {
        fc: Linear::new(4, 4, &dev())?,
    };
    let (_, captured) = m.capture(&["fc"], |m| m.call(&input()?))?;
    assert_eq!(captured.len(), 3);
    assert_eq!(captured.paths().collect::<Vec<_>>(), ["fc", "fc", "fc"]);
    Ok(())
}

#[test]
fn a_hook_error_names_the_path_and_aborts_the_call() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    hooks.register_forward_hook(
        "blocks.*",
        |ctx, _, _| {
            Err(Error::InvalidDevice {
                name: format!("refused by {}", ctx.path()),
            })
        },
        HookOptions::default(),
    )?;
    let after = log();
    let sink = after.clone();
    hooks.register_forward_pre_hook(
        "boxed",
        move |_, _| {
            sink.lock().unwrap().push("boxed ran".into());
            Ok(None)
        },
        PreHookOptions::default(),
    )?;
    let err = hooks.run(&net, |m| m.call(&input()?)).unwrap_err();
    match &err {
        Error::Hook { path, hook, .. } => {
            assert_eq!(path, "blocks.0");
            assert_eq!(*hook, "forward hook");
        }
        other => panic!("expected a hook error, got {other:?}"),
    }
    assert!(err.to_string().contains("`blocks.0`"), "{err}");
    assert!(take(&after).is_empty(), "the call was aborted");
    Ok(())
}

#[test]
fn a_hook_returning_the_wrong_number_of_tensors_is_an_error() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    hooks.register_forward_pre_hook(
        "act",
        |_, input| Ok(Some(vec![input[0].clone(), input[0].clone()])),
        PreHookOptions::default(),
    )?;
    let err = hooks.run(&net, |m| m.call(&input()?)).unwrap_err();
    assert!(
        matches!(&err, Error::HookTensorCount { path, expected: 1, got: 2, .. } if path == "act"),
        "{err:?}"
    );
    Ok(())
}

#[test]
fn a_panicking_hook_leaves_no_stale_state() -> Result<()> {
    let net = Net::new()?;
    let x = input()?;
    let panicking = Hooks::new();
    panicking.register_forward_hook(
        "blocks.1",
        |_, _, _| panic!("hook panics"),
        HookOptions::default(),
    )?;
    let result = catch_unwind(AssertUnwindSafe(|| panicking.run(&net, |m| m.call(&x))));
    assert!(result.is_err());

    // No leftover hooks: a plain call is the forward itself.
    let plain = net.call(&x)?;
    assert_close(&plain, &net.forward(&x)?)?;
    // Correct paths on the next hooked call.
    let (_, order) = net.call_order(|m| m.call(&x))?;
    assert_eq!(order.len(), 8);
    assert_eq!(order[4], "blocks.1");

    // A panic in a forward, too.
    #[derive(Module)]
    struct Boom {
        inner: Linear,
    }
    impl Forward<&Tensor> for Boom {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.inner.call(x)?;
            panic!("forward panics")
        }
    }
    let boom = Boom {
        inner: Linear::new(4, 4, &dev())?,
    };
    let result = catch_unwind(AssertUnwindSafe(|| boom.call_order(|m| m.call(&x))));
    assert!(result.is_err());
    let (_, order) = net.call_order(|m| m.call(&x))?;
    assert_eq!(order[1], "fc");
    Ok(())
}

#[test]
fn sequential_layers_are_hooked_by_position() -> Result<()> {
    let seq = Sequential::new()
        .add(Linear::new(4, 8, &dev())?)
        .add(ReLU::new())
        .add(Linear::new(8, 2, &dev())?);
    let (y, order) = seq.call_order(|m| m.call(&input()?))?;
    assert_eq!(order, ["", "0", "1", "2"]);
    assert_eq!(y.dims(), [2, 2]);
    Ok(())
}

#[test]
fn trees_of_tensors_in_and_out() -> Result<()> {
    struct Pair {
        left: Tensor,
        right: Option<Tensor>,
        label: &'static str,
    }
    impl TensorStruct for Pair {
        fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
            f(&self.left);
            self.right.iter().for_each(&mut *f);
        }
        fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
            Self {
                left: f(self.left),
                right: self.right.map(&mut *f),
                label: self.label,
            }
        }
    }

    #[derive(Module)]
    struct Split {
        scale: Param,
    }
    impl Forward<(&Tensor, Option<&Tensor>, usize)> for Split {
        type Output = Pair;
        fn forward(&self, (a, b, n): (&Tensor, Option<&Tensor>, usize)) -> Result<Pair> {
            let s = self.scale.tensor()?;
            Ok(Pair {
                left: (a.broadcast_mul(&s)? * n as f64)?,
                right: b.map(|b| b.broadcast_mul(&s)).transpose()?,
                label: "pair",
            })
        }
    }

    let m = Split {
        scale: Param::new(Tensor::new(&[3f32], &dev())?)?,
    };
    let a = Tensor::new(&[1f32, 2.], &dev())?;
    let b = Tensor::new(&[5f32], &dev())?;
    let hooks = Hooks::new();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = seen.clone();
    hooks.register_forward_pre_hook(
        "",
        move |_, input| {
            sink.lock().unwrap().push(input.len());
            // Replace the optional tensor only.
            Ok(Some(vec![input[0].clone(), (&input[1] + 1.)?]))
        },
        PreHookOptions::default(),
    )?;
    let sink = seen.clone();
    hooks.register_forward_hook(
        "",
        move |_, input, output| {
            sink.lock().unwrap().push(input.len() * 10 + output.len());
            Ok(Some(vec![output[0].clone(), output[1].neg()?]))
        },
        HookOptions::default(),
    )?;
    let out = hooks.run(&m, |m| m.call((&a, Some(&b), 2)))?;
    assert_eq!(*seen.lock().unwrap(), [2, 22]);
    assert_eq!(out.left.to_vec1::<f32>()?, [6., 12.]);
    assert_eq!(out.right.unwrap().to_vec1::<f32>()?, [-18.]);
    assert_eq!(out.label, "pair");
    Ok(())
}

#[test]
fn threads_see_their_own_calls_and_share_hooks() -> Result<()> {
    #[derive(Module)]
    struct Branchy {
        one: Linear,
        two: Linear,
    }
    impl Forward<&Tensor> for Branchy {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            if x.dim(0)? == 1 {
                self.one.call(x)
            } else {
                self.two.call(x)
            }
        }
    }
    let model = Arc::new(Branchy {
        one: Linear::new(4, 4, &dev())?,
        two: Linear::new(4, 4, &dev())?,
    });
    let hooks = Hooks::new();
    let seen: Arc<Mutex<Vec<(std::thread::ThreadId, String)>>> = Arc::default();
    let sink = seen.clone();
    hooks.register_global_forward_pre_hook(
        move |ctx, _| {
            sink.lock()
                .unwrap()
                .push((std::thread::current().id(), ctx.path().to_owned()));
            Ok(None)
        },
        PreHookOptions::default(),
    );
    let barrier = Arc::new(Barrier::new(2));
    let handles: Vec<_> = [1usize, 3]
        .into_iter()
        .map(|rows| {
            let (model, hooks, barrier) = (model.clone(), hooks.clone(), barrier.clone());
            std::thread::spawn(move || -> Result<std::thread::ThreadId> {
                let x = Tensor::ones((rows, 4), DType::F32, &dev())?;
                barrier.wait();
                for _ in 0..50 {
                    hooks.run(&*model, |m| m.call(&x))?;
                }
                Ok(std::thread::current().id())
            })
        })
        .collect();
    let ids: Vec<_> = handles
        .into_iter()
        .map(|h| h.join().unwrap())
        .collect::<Result<_>>()?;
    let seen = seen.lock().unwrap();
    assert_eq!(seen.len(), 2 * 50 * 2);
    for (thread, path) in seen.iter() {
        let expected = if *thread == ids[0] { "one" } else { "two" };
        assert!(path.is_empty() || path == expected, "{path} on {thread:?}");
    }
    Ok(())
}

#[test]
fn nested_runs_on_one_root_combine_registries() -> Result<()> {
    let net = Net::new()?;
    let outer = Hooks::new();
    let fired = log();
    let sink = fired.clone();
    outer.register_forward_hook(
        "fc",
        move |_, _, _| {
            sink.lock().unwrap().push("outer".into());
            Ok(None)
        },
        HookOptions::default(),
    )?;
    let (_, captured): (Tensor, Captures) = outer.run(&net, |m| {
        m.capture(&["fc", "blocks.*"], |m| m.call(&input()?))
    })?;
    assert_eq!(take(&fired), ["outer"]);
    assert_eq!(
        captured.paths().collect::<Vec<_>>(),
        ["fc", "blocks.0", "blocks.1"]
    );
    Ok(())
}

#[test]
fn hooks_see_the_module_and_can_downcast_it() -> Result<()> {
    let net = Net::new()?;
    let hooks = Hooks::new();
    let widths = log();
    let sink = widths.clone();
    hooks.register_forward_hook(
        "**",
        move |ctx, _, _| {
            if let Some(linear) = ctx.module().downcast_ref::<Linear>() {
                sink.lock()
                    .unwrap()
                    .push(format!("{}:{}", ctx.path(), linear.out_features()));
            }
            Ok(None)
        },
        HookOptions::default(),
    )?;
    hooks.run(&net, |m| m.call(&input()?))?;
    assert_eq!(take(&widths).len(), 6);
    Ok(())
}

#[test]
fn summary_with_shapes_from_a_dry_run() -> Result<()> {
    let seq = Sequential::new()
        .add(Linear::new(4, 8, &dev())?)
        .add(ReLU::new())
        .add(Linear::new(8, 2, &dev())?);
    let summary = seq.summary_with(|m| m.call(&input()?))?;
    let shapes: Vec<_> = summary
        .rows
        .iter()
        .map(|r| (r.input_shape.clone(), r.output_shape.clone()))
        .collect();
    assert_eq!(
        shapes[0],
        (Some("[2, 4]".to_owned()), Some("[2, 2]".to_owned()))
    );
    assert_eq!(
        shapes[1],
        (Some("[2, 4]".to_owned()), Some("[2, 8]".to_owned()))
    );
    let text = summary.to_string();
    assert!(text.contains("Output shape"), "{text}");
    assert!(text.contains("[2, 8]"), "{text}");
    Ok(())
}

#[test]
fn without_hooks_call_is_forward() -> Result<()> {
    let net = Net::new()?;
    let x = input()?;
    assert_close(&net.call(&x)?, &net.forward(&x)?)?;
    // An empty registry changes nothing either.
    let y = Hooks::new().run(&net, |m| m.call(&x))?;
    assert_close(&y, &net.forward(&x)?)?;
    Ok(())
}

/// A `TensorStruct` whose `map_tensors` visits more tensors than `for_each_tensor` lists cannot take
/// a hook's replacement: a typed error naming the path and the type, not a panic.
#[test]
fn a_tensor_struct_that_maps_more_than_it_lists_is_an_error() -> Result<()> {
    struct Lopsided {
        a: Tensor,
        b: Tensor,
    }
    impl TensorStruct for Lopsided {
        fn for_each_tensor(&self, f: &mut dyn FnMut(&Tensor)) {
            f(&self.a);
        }
        fn map_tensors(self, f: &mut dyn FnMut(Tensor) -> Tensor) -> Self {
            Self {
                a: f(self.a),
                b: f(self.b),
            }
        }
    }

    #[derive(Module)]
    struct Make {
        scale: Param,
    }
    impl Forward<&Tensor> for Make {
        type Output = Lopsided;
        fn forward(&self, x: &Tensor) -> Result<Lopsided> {
            let y = x.broadcast_mul(&self.scale.tensor()?)?;
            Ok(Lopsided { a: y.clone(), b: y })
        }
    }

    let m = Make {
        scale: Param::new(Tensor::new(&[2f32], &dev())?)?,
    };
    let hooks = Hooks::new();
    hooks.register_forward_hook(
        "",
        |_, _, output| Ok(Some(vec![output[0].neg()?])),
        HookOptions::default(),
    )?;
    let x = Tensor::new(&[1f32], &dev())?;
    let err = match hooks.run(&m, |m| m.call(&x)) {
        Ok(_) => panic!("the mismatch went unnoticed"),
        Err(e) => e,
    };
    assert!(
        matches!(
            &err,
            Error::TensorTreeMismatch {
                listed: 1,
                visited: 2,
                ..
            }
        ),
        "{err}"
    );
    assert!(err.to_string().contains("Lopsided"), "{err}");
    Ok(())
}
