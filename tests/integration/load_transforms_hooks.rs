//! State-dict hooks against the PyTorch fixtures of `load_transforms`: load pre-hooks by type and
//! by path that rewrite the incoming state dict (a split done by hand, a prefix, the older
//! `weight_norm` keys), and state-dict post-hooks that rewrite what `state_dict` produces.

use module_runtime::nn::{Linear, MultiheadAttention, MultiheadAttentionConfig};
use module_runtime::prelude::*;
use module_runtime::{HookTarget, StateDict, StateDictHooks};

use super::{fixture, io, linear, max_diff, mha_split, SplitAttention};

/// A pre-hook registered on a module type does the split itself, reading the values; another,
/// by path, renames keys.
#[test]
fn load_pre_hooks_by_type_and_by_path_rewrite_the_incoming_state_dict() {
    #[derive(Module)]
    struct Wrapper {
        attn: SplitAttention,
    }
    let model = Wrapper {
        attn: SplitAttention::new(),
    };
    let hooks = StateDictHooks::new();
    // By path: the checkpoint is a bare `nn.MultiheadAttention`'s; put it under `attn.`.
    hooks
        .register_load_state_dict_pre_hook("", |_, sd| {
            for key in sd.keys() {
                sd.rename(&key, &format!("attn.{key}"))?;
            }
            Ok(())
        })
        .unwrap();
    // By type: split the stacked projection (children's pre-hooks run after their parents').
    hooks
        .register_load_state_dict_pre_hook(HookTarget::of_type::<SplitAttention>(), |_, sd| {
            let p = sd.prefix().to_owned();
            for what in ["weight", "bias"] {
                let stacked = sd.get(&format!("{p}in_proj_{what}"))?;
                for (i, name) in ["q", "k", "v"].iter().enumerate() {
                    sd.insert(format!("{p}{name}.{what}"), stacked.narrow(0, 8 * i, 8)?);
                }
                sd.remove(&format!("{p}in_proj_{what}"));
            }
            Ok(())
        })
        .unwrap();
    let options = LoadOptions::default().state_dict_hooks(&hooks);
    let report = model.load_state_dict(fixture("mha.pth"), &options).unwrap();
    assert_eq!(report.loaded, 8);
    assert_eq!(
        report.transforms[0].rule,
        r#"load_state_dict pre-hook on """#
    );
    assert_eq!(report.transforms[0].produced[0], "attn.in_proj_weight");
    assert_eq!(
        report.transforms[1].rule,
        r#"load_state_dict pre-hook on "attn""#
    );
    let io = io("mha");
    let y = model.attn.forward(io.get("input").unwrap()).unwrap();
    assert!(max_diff(&y, io.get("output").unwrap()) <= 1e-6);

    // A hook's error fails the load, naming the module, with the model unchanged.
    let before = model
        .attn
        .q
        .weight
        .tensor()
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    let failing = StateDictHooks::new();
    failing
        .register_load_state_dict_pre_hook("attn", |_, sd| sd.get("attn.nothing").map(|_| ()))
        .unwrap();
    let err = model
        .load_state_dict(fixture("mha.pth"), &mha_split().state_dict_hooks(&failing))
        .unwrap_err();
    assert!(
        matches!(&err, Error::Hook { path, .. } if path == "attn"),
        "{err}"
    );
    assert!(err.to_string().contains("no key `attn.nothing`"), "{err}");
    assert_eq!(
        model
            .attn
            .q
            .weight
            .tensor()
            .unwrap()
            .to_vec2::<f32>()
            .unwrap(),
        before
    );

    // A path that names no module is refused, as a forward hook's is.
    let typo = StateDictHooks::new();
    typo.register_load_state_dict_pre_hook("atn", |_, _| Ok(()))
        .unwrap();
    let err = model
        .load_state_dict(
            fixture("mha.pth"),
            &LoadOptions::default().state_dict_hooks(&typo),
        )
        .unwrap_err();
    assert!(matches!(err, Error::NoModuleMatch { .. }), "{err}");
}

/// A state-dict post-hook on the split attention writes PyTorch's layout back: the runtime's own
/// `MultiheadAttention` loads it and gives PyTorch's output. Removing the hook restores the
/// plain state dict.
#[test]
fn state_dict_post_hook_rewrites_what_state_dict_produces() {
    let model = SplitAttention::new();
    model
        .load_state_dict(fixture("mha.pth"), &mha_split())
        .unwrap();
    let hooks = StateDictHooks::new();
    let handle = hooks
        .register_state_dict_post_hook(HookTarget::of_type::<SplitAttention>(), |_, p, sd| {
            for what in ["weight", "bias"] {
                let keys = ["q", "k", "v"].map(|n| format!("{p}{n}.{what}"));
                let parts: Vec<Tensor> = keys.iter().map(|k| sd.get(k).unwrap().clone()).collect();
                for k in &keys {
                    sd.remove(k);
                }
                sd.insert(format!("{p}in_proj_{what}"), Tensor::cat(&parts, 0)?);
            }
            Ok(())
        })
        .unwrap();
    let sd = hooks.state_dict(&model).unwrap();
    let keys: Vec<&str> = sd.keys().collect();
    assert_eq!(
        keys,
        [
            "out_proj.weight",
            "out_proj.bias",
            "in_proj_weight",
            "in_proj_bias"
        ]
    );
    let config = MultiheadAttentionConfig {
        batch_first: true,
        ..Default::default()
    };
    let mha = MultiheadAttention::with_config(8, 2, config, &Device::Cpu).unwrap();
    mha.load_state_dict(&sd, &LoadOptions::default()).unwrap();
    mha.eval();
    let io = io("mha");
    let y = mha.call(io.get("input").unwrap()).unwrap();
    assert!(max_diff(&y, io.get("output").unwrap()) <= 1e-6);

    assert!(handle.remove());
    assert!(!handle.remove());
    assert!(hooks.state_dict(&model).unwrap().contains_key("q.weight"));
}

/// Post-hooks by path run submodules first (PyTorch's `state_dict` recursion), each seeing what
/// the ones before it wrote; a pattern that matches no module is refused.
#[test]
fn state_dict_post_hooks_by_path_run_children_first() {
    use std::sync::{Arc, Mutex};
    let model = SplitAttention::new();
    let order = Arc::new(Mutex::new(Vec::new()));
    let hooks = StateDictHooks::new();
    let seen = order.clone();
    hooks
        .register_state_dict_post_hook("", move |_, prefix, sd| {
            seen.lock().unwrap().push(format!("root {prefix:?}"));
            // The child's hook ran first: its key is already renamed.
            assert!(sd.contains_key("q.w") && !sd.contains_key("q.weight"));
            Ok(())
        })
        .unwrap();
    let seen = order.clone();
    hooks
        .register_state_dict_post_hook("*", move |_, prefix, sd| {
            seen.lock().unwrap().push(prefix.to_owned());
            if prefix == "q." {
                let w = sd.remove("q.weight").unwrap();
                sd.insert("q.w", w);
            }
            Ok(())
        })
        .unwrap();
    let sd = hooks.state_dict(&model).unwrap();
    assert!(sd.contains_key("q.w"));
    assert_eq!(
        *order.lock().unwrap(),
        ["q.", "k.", "v.", "out_proj.", "root \"\""]
    );
    let typo = StateDictHooks::new();
    typo.register_state_dict_post_hook("encoder.*", |_, _, _| Ok(()))
        .unwrap();
    assert!(matches!(
        typo.state_dict(&model).unwrap_err(),
        Error::NoModuleMatch { .. }
    ));
}

/// The older `torch.nn.utils.weight_norm` keys (`weight_g`, `weight_v`) onto a parametrized
/// layer, as PyTorch itself does it (its `_weight_norm_compat_hook` is a load pre-hook): one
/// pre-hook by type serves every `Linear` of a model.
#[test]
fn a_pre_hook_by_type_loads_legacy_weight_norm_keys() {
    use module_runtime::nn::parametrize::weight_norm;
    let mut fc = linear(3, 2);
    weight_norm(&mut fc, "weight", Some(0)).unwrap();
    let hooks = StateDictHooks::new();
    hooks
        .register_load_state_dict_pre_hook(HookTarget::of_type::<Linear>(), |_, sd| {
            let p = sd.prefix().to_owned();
            for (old, new) in [("weight_g", "original0"), ("weight_v", "original1")] {
                if sd.contains(&format!("{p}{old}")) {
                    let new = format!("{p}parametrizations.weight.{new}");
                    sd.rename(&format!("{p}{old}"), &new)?;
                }
            }
            Ok(())
        })
        .unwrap();
    let mut legacy = StateDict::new();
    let dev = Device::Cpu;
    legacy.insert("weight_g", Tensor::new(&[[2f32], [3.]], &dev).unwrap());
    legacy.insert(
        "weight_v",
        Tensor::new(&[[3f32, 0., 4.], [0., 1., 0.]], &dev).unwrap(),
    );
    legacy.insert("bias", Tensor::zeros(2, DType::F32, &dev).unwrap());
    fc.load_state_dict(&legacy, &LoadOptions::default().state_dict_hooks(&hooks))
        .unwrap();
    // weight = g * v / |v| per row.
    let y = fc
        .call(&Tensor::new(&[[1f32, 1., 1.]], &dev).unwrap())
        .unwrap();
    let expected = [2. * 7. / 5., 3.];
    for (a, b) in y.to_vec2::<f32>().unwrap()[0].iter().zip(expected) {
        assert!((a - b).abs() < 1e-6, "{a} vs {b}");
    }
}
