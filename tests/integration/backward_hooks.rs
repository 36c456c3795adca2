//! Backward hooks against PyTorch (`fixtures/make_backward_hook_fixtures.py`): full backward hooks
//! and pre-hooks (their gradients and call order on a nested model, replacing gradients), tensor
//! gradient hooks, removal, and that a forward without backward hooks records no extra op (more
//! in `backward_hook_api.rs`).

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use module_runtime::nn::{Linear, ReLU, Tanh};
use module_runtime::prelude::*;
use module_runtime::BackwardHookOptions;

pub(super) fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

#[derive(Module)]
struct Block {
    fc: Linear,
    act: Tanh,
}

impl Forward<&Tensor> for Block {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.act.call(&self.fc.call(x)?)
    }
}

/// The fixture's `Net`: `fc2(block(act(fc1(x))))`, `block` = `tanh(fc(x))`.
#[derive(Module)]
pub(super) struct Net {
    fc1: Linear,
    act: ReLU,
    block: Block,
    fc2: Linear,
}

impl Forward<&Tensor> for Net {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let h = self.act.call(&self.fc1.call(x)?)?;
        self.fc2.call(&self.block.call(&h)?)
    }
}

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/pytorch/backward_hooks")
}

/// The model with PyTorch's weights, and the fixture's tensors.
pub(super) fn setup() -> (Net, HashMap<String, Tensor>) {
    let d = dev();
    let net = Net {
        fc1: Linear::new(4, 5, &d).unwrap(),
        act: ReLU::new(),
        block: Block {
            fc: Linear::new(5, 5, &d).unwrap(),
            act: Tanh::new(),
        },
        fc2: Linear::new(5, 3, &d).unwrap(),
    };
    net.load_state_dict(dir().join("model.safetensors"), &LoadOptions::default())
        .unwrap();
    let values = candle_core::safetensors::load(dir().join("values.safetensors"), &d).unwrap();
    (net, values)
}

/// The metadata entry `key` of the values file (a safetensors header's `__metadata__`).
fn metadata(key: &str) -> serde_json::Value {
    let bytes = std::fs::read(dir().join("values.safetensors")).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    serde_json::from_str(header["__metadata__"][key].as_str().unwrap()).unwrap()
}

/// `(model(x) * w).sum()`, the fixture's loss, under `hooks`.
pub(super) fn loss(net: &Net, hooks: &Hooks, x: &Tensor, w: &Tensor) -> Result<Tensor> {
    hooks.run(net, |net| Ok(net.call(x)?.mul(w)?.sum_all()?))
}

fn close(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.dims(), b.dims(), "{what}");
    let diff = (a - b).unwrap().abs().unwrap().max_all().unwrap();
    let diff = diff.to_scalar::<f32>().unwrap();
    assert!(diff < 1e-5, "{what}: differs from PyTorch by {diff}");
}

type Event = (String, String, Vec<Option<Tensor>>, Vec<Option<Tensor>>);

/// Global hooks that log every call with its gradients.
fn logging_hooks() -> (Hooks, Arc<Mutex<Vec<Event>>>) {
    let hooks = Hooks::new();
    let log = Arc::new(Mutex::new(Vec::new()));
    let l = log.clone();
    hooks.register_global_full_backward_pre_hook(
        move |ctx, grad_output| {
            let event = (
                "pre".into(),
                ctx.path().into(),
                vec![],
                grad_output.to_vec(),
            );
            l.lock().unwrap().push(event);
            Ok(None)
        },
        BackwardHookOptions::default(),
    );
    let l = log.clone();
    hooks.register_global_full_backward_hook(
        move |ctx, grad_input, grad_output| {
            let event = (
                "full".into(),
                ctx.path().into(),
                grad_input.to_vec(),
                grad_output.to_vec(),
            );
            l.lock().unwrap().push(event);
            Ok(None)
        },
        BackwardHookOptions::default(),
    );
    (hooks, log)
}

/// Compares a logged side (`in` or `out`) of call `n` with PyTorch's, `None`s included.
fn same_side(values: &HashMap<String, Tensor>, key: &str, got: &[Option<Tensor>]) {
    for (j, g) in got.iter().enumerate() {
        let key = format!("{key}.{j}");
        match (values.get(&key), g) {
            (Some(want), Some(g)) => close(g, want, &key),
            (None, None) => {}
            (want, g) => panic!(
                "{key}: PyTorch {:?}, here {:?}",
                want.is_some(),
                g.is_some()
            ),
        }
    }
}

/// The order and gradients of every full backward hook and pre-hook call, with the input
/// without `requires_grad` (the root's and fc1's full hooks then run at their outputs' time, with
/// `None` input gradients) and with it.
#[test]
fn calls_and_gradients_are_pytorchs() {
    let (net, values) = setup();
    for (case, xgrad) in [("observe", false), ("observe_xgrad", true)] {
        let (hooks, log) = logging_hooks();
        let x0 = &values["x"];
        let var = candle_core::Var::from_tensor(x0).unwrap();
        let x = if xgrad {
            var.as_tensor().clone()
        } else {
            x0.clone()
        };
        loss(&net, &hooks, &x, &values["w"])
            .unwrap()
            .backward()
            .unwrap();
        let log = log.lock().unwrap();
        let order = metadata(&format!("{case}.order"));
        let order = order.as_array().unwrap();
        let got: Vec<_> = log.iter().map(|e| (e.0.as_str(), e.1.as_str())).collect();
        let want: Vec<_> = order
            .iter()
            .map(|e| (e[0].as_str().unwrap(), e[1].as_str().unwrap()))
            .collect();
        assert_eq!(got, want, "{case}: call order");
        for (n, ((kind, _, gin, gout), e)) in log.iter().zip(order).enumerate() {
            assert_eq!(
                gin.len() as u64,
                e[2].as_u64().unwrap(),
                "{case}.{n} grad_input"
            );
            assert_eq!(
                gout.len() as u64,
                e[3].as_u64().unwrap(),
                "{case}.{n} grad_output"
            );
            same_side(&values, &format!("{case}.{n}.{kind}.in"), gin);
            same_side(&values, &format!("{case}.{n}.{kind}.out"), gout);
        }
    }
}

/// The gradients of every parameter (and of `x`) after a backward, against PyTorch's `case`.
fn grads_are(
    net: &Net,
    grads: &candle_core::backprop::GradStore,
    x: &candle_core::Var,
    values: &HashMap<String, Tensor>,
    case: &str,
) {
    for (name, p) in net.named_parameters() {
        let g = grads.get(&p.var().unwrap()).unwrap();
        close(
            g,
            &values[&format!("{case}.grad.{name}")],
            &format!("{case}: {name}"),
        );
    }
    let gx = grads.get(x.as_tensor()).unwrap();
    close(
        gx,
        &values[&format!("{case}.grad.x")],
        &format!("{case}: x"),
    );
}

/// A pre-hook that doubles `block`'s output gradient and a full hook that adds 1 to `block.fc`'s
/// input gradient change every upstream gradient (parameters of `block.fc`, `fc1` and the input)
/// exactly as in PyTorch.
#[test]
fn replaced_gradients_change_every_upstream_gradient() {
    let (net, values) = setup();
    let hooks = Hooks::new();
    let opts = BackwardHookOptions::default();
    hooks
        .register_full_backward_pre_hook(
            "block",
            |_, go| Ok(Some(vec![Some((go[0].as_ref().unwrap() * 2.0)?)])),
            opts,
        )
        .unwrap();
    hooks
        .register_full_backward_hook(
            "block.fc",
            |_, gi, _| Ok(Some(vec![Some((gi[0].as_ref().unwrap() + 1.0)?)])),
            opts,
        )
        .unwrap();
    let x = candle_core::Var::from_tensor(&values["x"]).unwrap();
    let grads = loss(&net, &hooks, x.as_tensor(), &values["w"])
        .unwrap()
        .backward()
        .unwrap();
    grads_are(&net, &grads, &x, &values, "replace");

    // Without the hooks, PyTorch's plain gradients.
    let grads = loss(&net, &Hooks::new(), x.as_tensor(), &values["w"])
        .unwrap()
        .backward()
        .unwrap();
    grads_are(&net, &grads, &x, &values, "plain");
}

/// A tensor hook that negates the gradient at `block.fc`'s output, registered by a forward hook
/// that returns the hooked tensor as the new output (PyTorch: `output.register_hook(lambda g: -g)`).
#[test]
fn a_tensor_hook_negates_a_gradient() {
    let (net, values) = setup();
    let hooks = Hooks::new();
    hooks
        .register_forward_hook(
            "block.fc",
            |_, _, output| {
                let hooked = register_hook(&output[0], |g| Ok(Some(g.neg()?)))?;
                Ok(Some(vec![hooked]))
            },
            HookOptions::default(),
        )
        .unwrap();
    let x = candle_core::Var::from_tensor(&values["x"]).unwrap();
    let grads = loss(&net, &hooks, x.as_tensor(), &values["w"])
        .unwrap()
        .backward()
        .unwrap();
    grads_are(&net, &grads, &x, &values, "tensor_hook");
}

/// A removed hook (by its handle, or by itself) no longer fires, and the gradients are the plain
/// ones; a hook removed after the forward still fires for that forward, as PyTorch's.
#[test]
fn removed_hooks_no_longer_fire() {
    let (net, values) = setup();
    let hooks = Hooks::new();
    let fired = Arc::new(Mutex::new(Vec::<String>::new()));
    let f = fired.clone();
    let handle = hooks
        .register_full_backward_hook(
            "fc2",
            move |ctx, gi, _| {
                f.lock().unwrap().push(ctx.path().to_owned());
                Ok(Some(vec![Some(gi[0].as_ref().unwrap().zeros_like()?)]))
            },
            BackwardHookOptions::default(),
        )
        .unwrap();
    let f = fired.clone();
    hooks
        .register_full_backward_pre_hook(
            "fc1",
            move |ctx, _| {
                f.lock().unwrap().push(format!("once {}", ctx.path()));
                ctx.remove_this_hook();
                Ok(None)
            },
            BackwardHookOptions::default(),
        )
        .unwrap();
    let x = candle_core::Var::from_tensor(&values["x"]).unwrap();
    let l = loss(&net, &hooks, x.as_tensor(), &values["w"]).unwrap();
    assert!(handle.remove());
    assert!(!handle.remove());
    l.backward().unwrap();
    // Set up by the forward, both fire (fc1's with a zero gradient: fc2 zeroed its input's).
    assert_eq!(*fired.lock().unwrap(), ["fc2", "once fc1"]);
    fired.lock().unwrap().clear();
    let grads = loss(&net, &hooks, x.as_tensor(), &values["w"])
        .unwrap()
        .backward()
        .unwrap();
    assert!(fired.lock().unwrap().is_empty());
    assert!(hooks.is_empty());
    grads_are(&net, &grads, &x, &values, "plain");
}

/// The ids of the nodes of `t`'s graph.
fn graph(t: &Tensor) -> usize {
    t.sorted_nodes().len()
}

/// Without backward hooks, the forward records no op more than a plain call, whatever other hooks
/// are registered; with one on `fc2`, only `fc2`'s call gets its identities.
#[test]
fn no_backward_hook_no_extra_op() {
    let (net, values) = setup();
    let x = candle_core::Var::from_tensor(&values["x"]).unwrap();
    let plain = graph(&net.call(x.as_tensor()).unwrap());
    let hooks = Hooks::new();
    hooks
        .register_forward_hook("**", |_, _, _| Ok(None), HookOptions::default())
        .unwrap();
    let handle = hooks
        .register_full_backward_hook("fc2", |_, _, _| Ok(None), BackwardHookOptions::default())
        .unwrap();
    let with_one = graph(&hooks.run(&net, |n| n.call(x.as_tensor())).unwrap());
    // One tag and one gate on fc2's input, and on its output.
    assert_eq!(with_one, plain + 4);
    handle.remove();
    let forward_only = graph(&hooks.run(&net, |n| n.call(x.as_tensor())).unwrap());
    assert_eq!(forward_only, plain);
    // Grad mode off: nothing is recorded, hooks or not.
    hooks.register_global_full_backward_hook(|_, _, _| Ok(None), BackwardHookOptions::default());
    let _guard = no_grad();
    let y = hooks.run(&net, |n| n.call(&values["x"])).unwrap();
    assert!(!y.track_op());
}

/// Parallel branches: the calls are reached in PyTorch's order (`torch` prints the same list for
/// this model: `a(c(x)) * b(c(x)) + a(x)` with global hooks).
#[test]
fn parallel_branches_fire_in_pytorchs_order() {
    #[derive(Module)]
    struct Par {
        a: Linear,
        b: Linear,
        c: Linear,
    }
    impl Forward<&Tensor> for Par {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let h = self.c.call(x)?;
            Ok(((self.a.call(&h)? * self.b.call(&h)?)? + self.a.call(x)?)?)
        }
    }
    let d = dev();
    let par = Par {
        a: Linear::new(2, 2, &d).unwrap(),
        b: Linear::new(2, 2, &d).unwrap(),
        c: Linear::new(2, 2, &d).unwrap(),
    };
    let hooks = Hooks::new();
    let order = Arc::new(Mutex::new(Vec::<String>::new()));
    let (o1, o2) = (order.clone(), order.clone());
    let opts = BackwardHookOptions::default();
    hooks.register_global_full_backward_pre_hook(
        move |ctx, _| {
            o1.lock().unwrap().push(format!("pre {}", ctx.path()));
            Ok(None)
        },
        opts,
    );
    hooks.register_global_full_backward_hook(
        move |ctx, _, _| {
            o2.lock().unwrap().push(format!("full {}", ctx.path()));
            Ok(None)
        },
        opts,
    );
    let x = candle_core::Var::ones((1, 2), DType::F32, &d).unwrap();
    let y = hooks.run(&par, |m| m.call(x.as_tensor())).unwrap();
    y.sum_all().unwrap().backward().unwrap();
    let want = [
        "pre ", "pre a", "full a", "pre b", "full b", "pre a", "full a", "pre c", "full c", "full ",
    ];
    assert_eq!(*order.lock().unwrap(), want);
}
