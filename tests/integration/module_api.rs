//! The everyday `nn.Module` API a PyTorch user reaches for (issue 14, item 2), each behaviour
//! checked against PyTorch's source. Unless said otherwise, the functions cited are in
//! `torch/nn/modules/module.py` of the PyTorch repository.

use std::sync::Arc;

use module_runtime::prelude::*;
use module_runtime::{Names, StateDict};

fn names<T>(list: Vec<(String, T)>) -> Vec<String> {
    list.into_iter().map(|(n, _)| n).collect()
}

fn ones(n: usize) -> Param {
    Param::new(Tensor::ones(n, DType::F32, &Device::Cpu).unwrap()).unwrap()
}

/// A block with a parameter and a buffer of its own, and a submodule.
#[derive(Module)]
struct Block {
    gain: Param,
    steps: Buffer,
    fc: Linear,
}

fn block() -> Block {
    Block {
        gain: ones(2),
        steps: Buffer::new(Tensor::new(0i64, &Device::Cpu).unwrap()),
        fc: Linear::new(2, 2, &Device::Cpu).unwrap(),
    }
}

/// A model sharing one block under two paths (`Arc`) and tying one parameter twice.
#[derive(Module)]
struct Shared {
    scale: Param,
    tied: Param,
    a: Arc<Block>,
    b: Arc<Block>,
}

fn shared() -> Shared {
    let scale = ones(1);
    let block = Arc::new(block());
    Shared {
        tied: scale.clone(),
        scale,
        a: block.clone(),
        b: block,
    }
}

// ---------------------------------------------------------------------------------------------
// 1. prefix / recurse / remove_duplicate
// ---------------------------------------------------------------------------------------------

/// `Module._named_members`: `name = module_prefix + ("." if module_prefix else "") + k`, over
/// `self.named_modules(prefix=prefix, ...)`, so every name starts with `prefix.`.
#[test]
fn named_members_prefix_joins_with_a_dot() {
    let m = block();
    assert_eq!(
        names(m.named_parameters_with(&Names::new().prefix("model"))),
        ["model.gain", "model.fc.weight", "model.fc.bias"]
    );
    assert_eq!(
        names(m.named_buffers_with(&Names::new().prefix("model"))),
        ["model.steps"]
    );
    // An empty prefix gives the bare names, as `named_parameters()` does.
    assert_eq!(
        names(m.named_parameters_with(&Names::new().prefix(""))),
        names(m.named_parameters())
    );
}

/// `Module.named_modules`: `yield prefix, self` first, then children under
/// `prefix + ("." if prefix else "") + name`: with a prefix, the root is named by the prefix.
#[test]
fn named_modules_with_prefix_names_the_root_by_the_prefix() {
    let m = block();
    assert_eq!(
        names(m.named_modules_with(&Names::new().prefix("model"))),
        ["model", "model.fc"]
    );
    assert_eq!(names(m.named_modules_with(&Names::new())), ["", "fc"]);
}

/// `Module._named_members` with `recurse=False` lists `[(prefix, self)]` only: the module's own,
/// direct parameters and buffers.
#[test]
fn recurse_false_lists_only_own_parameters_and_buffers() {
    let m = block();
    let own = Names::new().recurse(false);
    assert_eq!(names(m.named_parameters_with(&own)), ["gain"]);
    assert_eq!(names(m.named_buffers_with(&own)), ["steps"]);
    assert_eq!(
        names(m.named_parameters_with(&own.clone().prefix("blk"))),
        ["blk.gain"]
    );
    // A module with no parameters of its own lists none, however many its children have.
    let s = shared();
    assert_eq!(names(s.a.named_buffers_with(&own)), ["steps"]);
    #[derive(Module)]
    struct Wrapper {
        inner: Block,
    }
    let w = Wrapper { inner: block() };
    assert!(w.named_parameters_with(&own).is_empty());
    assert!(w.named_buffers_with(&own).is_empty());
}

/// `Module.named_modules(remove_duplicate=False)` does not add modules to `memo`, and
/// `_named_members(remove_duplicate=False)` does not add members: every alias is listed.
#[test]
fn keep_duplicates_lists_every_alias() {
    let s = shared();
    assert_eq!(
        names(s.named_parameters()),
        ["scale", "a.gain", "a.fc.weight", "a.fc.bias"]
    );
    assert_eq!(
        names(s.named_parameters_with(&Names::new().keep_duplicates())),
        [
            "scale",
            "tied",
            "a.gain",
            "a.fc.weight",
            "a.fc.bias",
            "b.gain",
            "b.fc.weight",
            "b.fc.bias"
        ]
    );
    // The older spelling stays.
    assert_eq!(
        names(s.named_parameters_with(&module_runtime::Names::new().keep_duplicates())),
        names(s.named_parameters_with(&Names::new().keep_duplicates()))
    );
    assert_eq!(names(s.named_buffers()), ["a.steps"]);
    assert_eq!(
        names(s.named_buffers_with(&Names::new().keep_duplicates())),
        ["a.steps", "b.steps"]
    );
    assert_eq!(names(s.named_modules()), ["", "a", "a.fc"]);
    assert_eq!(
        names(s.named_modules_with(&Names::new().keep_duplicates().prefix("m"))),
        ["m", "m.a", "m.a.fc", "m.b", "m.b.fc"]
    );
    // Own members only, each alias: the tied parameter twice.
    assert_eq!(
        names(s.named_parameters_with(&Names::new().recurse(false).keep_duplicates())),
        ["scale", "tied"]
    );
    assert_eq!(
        names(s.named_parameters_with(&Names::new().recurse(false))),
        ["scale"]
    );
}

/// The defaults are PyTorch's: `prefix=""`, `recurse=True`, `remove_duplicate=True`
/// (`Module.named_parameters`, `Module.named_buffers`, `Module.named_modules`).
#[test]
fn default_names_are_the_plain_views() {
    let s = shared();
    let d = Names::default();
    assert_eq!(d, Names::new());
    assert!(d.is_recursive() && d.removes_duplicates() && d.get_prefix().is_empty());
    assert_eq!(
        names(s.named_parameters_with(&d)),
        names(s.named_parameters())
    );
    assert_eq!(names(s.named_buffers_with(&d)), names(s.named_buffers()));
    assert_eq!(names(s.named_modules_with(&d)), names(s.named_modules()));
}

// ---------------------------------------------------------------------------------------------
// 4. always_call forward hooks
// ---------------------------------------------------------------------------------------------

/// A module whose `forward` fails on an input with a negative first element.
#[derive(Module)]
struct Picky {
    fc: Linear,
}

impl Forward<&Tensor> for Picky {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if x.flatten_all()?.get(0)?.to_scalar::<f32>()? < 0.0 {
            return Err(Error::Candle(candle_core::Error::Msg(
                "negative input".into(),
            )));
        }
        self.fc.call(x)
    }
}

#[derive(Module)]
struct Outer {
    picky: Picky,
}

impl Forward<&Tensor> for Outer {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.picky.call(x)
    }
}

fn outer() -> Outer {
    Outer {
        picky: Picky {
            fc: Linear::new(2, 2, &Device::Cpu).unwrap(),
        },
    }
}

type Log = Arc<std::sync::Mutex<Vec<String>>>;

/// Registers on `hooks` a forward hook named `name` that logs
/// `name:<failed>:<inputs>:<outputs>` and then returns `result`.
fn logging_hook(
    log: &Log,
    name: &'static str,
    fail: bool,
) -> impl Fn(&module_runtime::HookCtx<'_>, &[Tensor], &[Tensor]) -> Result<Option<Vec<Tensor>>>
       + Send
       + Sync
       + 'static {
    let log = log.clone();
    move |ctx, input, output| {
        log.lock().unwrap().push(format!(
            "{name}:{}:{}:{}",
            ctx.failed(),
            input.len(),
            output.len()
        ));
        if fail {
            return Err(Error::Candle(candle_core::Error::Msg(format!(
                "{name} failed"
            ))));
        }
        Ok(None)
    }
}

fn entries(log: &Log) -> Vec<String> {
    std::mem::take(&mut *log.lock().unwrap())
}

fn x(first: f32) -> Tensor {
    Tensor::new(&[[first, 1.0]], &Device::Cpu).unwrap()
}

/// `Module._call_impl`: when `forward` raises, the `except` branch runs the hooks registered with
/// `always_call=True` (globals first, then the module's) with `result` still `None`, then re-raises;
/// other forward hooks do not run.
#[test]
fn always_call_hooks_run_when_forward_fails() {
    let m = outer();
    let hooks = Hooks::new();
    let log: Log = Default::default();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "plain", false),
            HookOptions::default(),
        )
        .unwrap();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "always", false),
            HookOptions::default().always_call(),
        )
        .unwrap();
    hooks.register_global_forward_hook(
        logging_hook(&log, "global", false),
        HookOptions::default().always_call(),
    );

    let err = hooks.run(&m, |m| m.call(&x(-1.0))).unwrap_err();
    // The error is forward's own, not wrapped as a hook error.
    assert!(err.to_string().contains("negative input"), "{err}");
    assert!(!matches!(err, Error::Hook { .. }));
    // `picky` failed, so did `""` (its caller): each runs its always-call hooks, the inner first.
    // The output is absent (PyTorch's `result` is `None`); the input is there.
    assert_eq!(
        entries(&log),
        ["global:true:1:0", "always:true:1:0", "global:true:1:0"]
    );

    // In a call that succeeds they are ordinary forward hooks (`picky.fc` runs this time).
    hooks.run(&m, |m| m.call(&x(1.0))).unwrap();
    assert_eq!(
        entries(&log),
        [
            "global:false:1:1",
            "global:false:1:1",
            "plain:false:1:1",
            "always:false:1:1",
            "global:false:1:1"
        ]
    );
}

/// `Module._call_impl` marks an always-call hook as called (`called_always_called_hooks`) before
/// running it, and the `except` branch skips those: when a forward hook fails, the always-call
/// hooks that already ran do not run again, the later ones run with the output so far, and the
/// error of an always-call hook in the `except` branch is ignored (PyTorch warns), so the first
/// error is the one raised.
#[test]
fn always_call_hooks_after_a_failing_forward_hook_run_once_with_the_output() {
    let m = outer();
    let hooks = Hooks::new();
    let log: Log = Default::default();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "first", false),
            HookOptions::default().always_call(),
        )
        .unwrap();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "bad", true),
            HookOptions::default(),
        )
        .unwrap();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "skipped", false),
            HookOptions::default(),
        )
        .unwrap();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "last", true),
            HookOptions::default().always_call(),
        )
        .unwrap();

    let err = hooks.run(&m, |m| m.call(&x(1.0))).unwrap_err();
    match &err {
        Error::Hook { path, hook, source } => {
            assert_eq!(path, "picky");
            assert_eq!(*hook, "forward hook");
            assert!(source.to_string().contains("bad failed"));
        }
        other => panic!("expected the failing hook's error, got {other}"),
    }
    assert_eq!(
        entries(&log),
        ["first:false:1:1", "bad:false:1:1", "last:true:1:1"]
    );
}

/// The `try` in `Module._call_impl` covers the forward pre-hooks too: a failing pre-hook runs the
/// always-call forward hooks, with the input as the pre-hooks left it.
#[test]
fn always_call_hooks_run_when_a_pre_hook_fails() {
    let m = outer();
    let hooks = Hooks::new();
    let log: Log = Default::default();
    hooks
        .register_forward_pre_hook(
            "picky",
            |_, _| Err(Error::Candle(candle_core::Error::Msg("pre failed".into()))),
            PreHookOptions::default(),
        )
        .unwrap();
    hooks
        .register_forward_hook(
            "picky",
            logging_hook(&log, "always", false),
            HookOptions::default().prepend().always_call(),
        )
        .unwrap();
    let err = hooks.run(&m, |m| m.call(&x(1.0))).unwrap_err();
    assert!(matches!(
        &err,
        Error::Hook {
            hook: "forward pre-hook",
            ..
        }
    ));
    assert_eq!(entries(&log), ["always:true:1:0"]);
}

// ---------------------------------------------------------------------------------------------
// 2. load_state_dict post-hooks
// ---------------------------------------------------------------------------------------------

fn weight_of(m: &Block) -> Vec<Vec<f32>> {
    m.fc.weight.tensor().unwrap().to_vec2::<f32>().unwrap()
}

/// A state dict for `Block` with `fc.bias` left out and an extra `old.scale`.
fn partial_state(from: &Block) -> StateDict {
    let mut sd = from.state_dict().unwrap();
    let kept: Vec<(String, Tensor)> = sd
        .iter()
        .filter(|(k, _)| *k != "fc.bias")
        .map(|(k, t)| (k.to_owned(), t.clone()))
        .collect();
    sd = kept.into_iter().collect();
    sd.insert(
        "old.scale",
        Tensor::ones(1, DType::F32, &Device::Cpu).unwrap(),
    );
    sd
}

/// `Module.register_load_state_dict_post_hook`: "clearing out both missing and unexpected keys
/// will avoid an error" — `Module.load_state_dict` runs the hooks inside `load(...)` and checks
/// `strict` only after `load(self, state_dict)` returns.
#[test]
fn post_hook_that_clears_the_keys_makes_a_strict_load_succeed() {
    let source = block();
    let model = block();
    let sd = partial_state(&source);
    let err = model
        .load_state_dict(&sd, &LoadOptions::default())
        .unwrap_err();
    assert!(err.to_string().contains("fc.bias"), "{err}");

    let seen: Log = Default::default();
    let log = seen.clone();
    let opts = LoadOptions::default().post_hook(move |_, keys| {
        log.lock().unwrap().push(format!(
            "missing={:?} unexpected={:?}",
            keys.missing_keys, keys.unexpected_keys
        ));
        keys.missing_keys.clear();
        keys.unexpected_keys.clear();
        assert!(keys.is_empty());
        Ok(())
    });
    let report = model.load_state_dict(&sd, &opts).unwrap();
    // The hook saw full paths, after the key rules.
    assert_eq!(
        entries(&seen),
        [r#"missing=["fc.bias"] unexpected=["old.scale"]"#]
    );
    assert!(report.is_complete());
    assert!(report.suggestions.is_empty());
    assert_eq!(report.loaded, 3);
    assert_eq!(weight_of(&model), weight_of(&source));
}

/// The same docstring: "Additions to either set of keys will result in an error being thrown when
/// `strict=True`". A strict load that fails changes nothing.
#[test]
fn post_hook_that_adds_a_key_makes_a_strict_load_fail_and_change_nothing() {
    let source = block();
    let model = block();
    let before = weight_of(&model);
    let opts = LoadOptions::default().post_hook(|_, keys| {
        keys.unexpected_keys.push("made.up".into());
        Ok(())
    });
    let err = model
        .load_state_dict(&source.state_dict().unwrap(), &opts)
        .unwrap_err();
    match &err {
        Error::Load(report) => assert_eq!(report.unexpected, ["made.up"]),
        other => panic!("expected a load report, got {other}"),
    }
    assert_eq!(weight_of(&model), before);
}

/// `Module.load_state_dict` runs the hooks whatever `strict` is, and returns the (edited)
/// `_IncompatibleKeys`.
#[test]
fn post_hooks_run_on_non_strict_loads_and_the_report_shows_their_edits() {
    let source = block();
    let model = block();
    let opts = LoadOptions::default().non_strict().post_hook(|_, keys| {
        keys.unexpected_keys.retain(|k| !k.starts_with("old."));
        Ok(())
    });
    let report = model
        .load_state_dict(&partial_state(&source), &opts)
        .unwrap();
    assert_eq!(report.missing, ["fc.bias"]);
    assert!(report.unexpected.is_empty());
}

/// In `Module.load_state_dict`, `load(module, ...)` recurses into `module._modules` before running
/// `module._load_state_dict_post_hooks`: a submodule's hooks run before its parent's, and each
/// hook is called with the module it is registered on.
#[test]
fn post_hooks_run_children_first_with_their_module() {
    let m = outer();
    let log: Log = Default::default();
    let hook = |name: &'static str| {
        let log = log.clone();
        move |module: &dyn Module, _: &mut module_runtime::IncompatibleKeys<'_>| {
            log.lock()
                .unwrap()
                .push(format!("{name}:{}", module.is::<Linear>()));
            Ok(())
        }
    };
    let opts = LoadOptions::default()
        .post_hook(hook("root"))
        .post_hook_at("picky", hook("picky"))
        .post_hook_at("picky.fc", hook("fc"))
        .post_hook(hook("root2"));
    m.load_state_dict(&m.state_dict().unwrap(), &opts).unwrap();
    assert_eq!(
        entries(&log),
        ["fc:true", "picky:false", "root:false", "root2:false"]
    );
}

/// A hook's error fails the load (in PyTorch the exception propagates out of `load_state_dict`);
/// here it comes before anything is copied, so the model is unchanged. A hook cannot accept a
/// value of the wrong shape: PyTorch reports those in `error_msgs`, which hooks do not see.
#[test]
fn post_hook_errors_and_mismatches_fail_the_load() {
    let source = block();
    let model = block();
    let before = weight_of(&model);
    let opts = LoadOptions::default().post_hook_at("fc", |_, _| {
        Err(Error::Candle(candle_core::Error::Msg("refused".into())))
    });
    let err = model
        .load_state_dict(&source.state_dict().unwrap(), &opts)
        .unwrap_err();
    match &err {
        Error::Hook { path, hook, .. } => {
            assert_eq!(path, "fc");
            assert_eq!(*hook, "load_state_dict post-hook");
        }
        other => panic!("expected a hook error, got {other}"),
    }
    assert_eq!(weight_of(&model), before);

    let mut sd = source.state_dict().unwrap();
    sd.insert("gain", Tensor::ones(3, DType::F32, &Device::Cpu).unwrap());
    let clear = LoadOptions::default().post_hook(|_, keys| {
        assert_eq!(keys.mismatched().len(), 1);
        keys.missing_keys.clear();
        Ok(())
    });
    assert!(matches!(
        model.load_state_dict(&sd, &clear),
        Err(Error::Load(_))
    ));

    let nowhere = LoadOptions::default().post_hook_at("fcc", |_, _| Ok(()));
    assert!(matches!(
        model.load_state_dict(&source.state_dict().unwrap(), &nowhere),
        Err(Error::NoSubmodule { .. })
    ));
}

// ---------------------------------------------------------------------------------------------
// 3. Extra state
// ---------------------------------------------------------------------------------------------

/// A module with non-tensor state: a word list, saved as bytes.
#[derive(Module)]
#[module(extra_state)]
struct Vocab {
    scale: Param,
    fc: Linear,
    #[module(skip)]
    words: std::sync::Mutex<Vec<String>>,
}

impl module_runtime::ExtraState for Vocab {
    fn get_extra_state(&self) -> Result<Tensor> {
        module_runtime::extra_state_from_bytes(self.words.lock().unwrap().join("\n").as_bytes())
    }

    fn set_extra_state(&self, state: &Tensor) -> Result<()> {
        let bytes = module_runtime::extra_state_to_bytes(state)?;
        let text = String::from_utf8(bytes)
            .map_err(|e| Error::Candle(candle_core::Error::Msg(e.to_string())))?;
        if text.contains("refused") {
            return Err(Error::Candle(candle_core::Error::Msg("refused".into())));
        }
        *self.words.lock().unwrap() = text.split('\n').map(str::to_owned).collect();
        Ok(())
    }
}

fn vocab(words: &[&str]) -> Vocab {
    Vocab {
        scale: ones(1),
        fc: Linear::new(2, 2, &Device::Cpu).unwrap(),
        words: std::sync::Mutex::new(words.iter().map(|w| w.to_string()).collect()),
    }
}

fn words(v: &Vocab) -> Vec<String> {
    v.words.lock().unwrap().clone()
}

#[derive(Module)]
struct Tagger {
    gain: Param,
    first: Vocab,
    second: Vocab,
}

fn tagger(a: &[&str], b: &[&str]) -> Tagger {
    Tagger {
        gain: ones(2),
        first: vocab(a),
        second: vocab(b),
    }
}

/// `Module._save_to_state_dict` writes the module's parameters, its persistent buffers, then
/// `destination[prefix + _EXTRA_STATE_KEY_SUFFIX] = self.get_extra_state()` (the suffix being
/// `"_extra_state"`), and `Module.state_dict` recurses into the submodules after it.
#[test]
fn extra_state_is_saved_after_own_members_before_submodules() {
    let t = tagger(&["a"], &["b"]);
    let keys: Vec<String> = t.state_dict().unwrap().keys().map(str::to_owned).collect();
    assert_eq!(
        keys,
        [
            "gain",
            "first.scale",
            "first._extra_state",
            "first.fc.weight",
            "first.fc.bias",
            "second.scale",
            "second._extra_state",
            "second.fc.weight",
            "second.fc.bias",
        ]
    );
    // The root's extra state is `_extra_state` (an empty prefix).
    let v = vocab(&["x"]);
    assert_eq!(
        v.state_dict().unwrap().keys().collect::<Vec<_>>(),
        ["scale", "_extra_state", "fc.weight", "fc.bias"]
    );
    // It is state, not a buffer or a parameter.
    assert!(names(v.named_buffers()).is_empty());
    assert_eq!(
        names(v.named_parameters()),
        ["scale", "fc.weight", "fc.bias"]
    );
}

/// `Module._load_from_state_dict` calls `self.set_extra_state(state_dict[extra_state_key])`.
/// Here the value goes through a safetensors file, as bytes.
#[test]
fn extra_state_round_trips_through_safetensors() {
    let dir = std::env::temp_dir().join(format!("module_api_extra_{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("tagger.safetensors");
    let saved = tagger(&["the", "cat"], &["sat", "on", "mats"]);
    saved.save_safetensors(&file).unwrap();

    let loaded = tagger(&[], &[]);
    let report = loaded
        .load_state_dict(&file, &LoadOptions::default())
        .unwrap();
    assert!(report.is_complete());
    assert_eq!(report.loaded, 9);
    assert_eq!(words(&loaded.first), ["the", "cat"]);
    assert_eq!(words(&loaded.second), ["sat", "on", "mats"]);
    assert_eq!(
        weight_of_fc(&loaded.second.fc),
        weight_of_fc(&saved.second.fc)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

fn weight_of_fc(fc: &Linear) -> Vec<Vec<f32>> {
    fc.weight.tensor().unwrap().to_vec2::<f32>().unwrap()
}

/// `Module._load_from_state_dict`: a module that implements `set_extra_state` and finds no
/// `extra_state_key` appends it to `missing_keys` (a strict load fails); a module without extra
/// state that finds one appends it to `unexpected_keys`.
#[test]
fn a_missing_extra_state_key_is_missing_and_a_stray_one_unexpected() {
    let saved = tagger(&["a"], &["b"]);
    let sd: StateDict = saved
        .state_dict()
        .unwrap()
        .iter()
        .filter(|(k, _)| *k != "second._extra_state")
        .map(|(k, t)| (k.to_owned(), t.clone()))
        .collect();
    let model = tagger(&["old"], &["old"]);
    match model
        .load_state_dict(&sd, &LoadOptions::default())
        .unwrap_err()
    {
        Error::Load(report) => {
            assert_eq!(report.missing, ["second._extra_state"]);
            assert!(report.unexpected.is_empty());
        }
        other => panic!("expected a load report, got {other}"),
    }
    // The failed load changed nothing.
    assert_eq!(words(&model.first), ["old"]);
    // Non-strict: loaded where present, reported where not.
    let report = model
        .load_state_dict(&sd, &LoadOptions::default().non_strict())
        .unwrap();
    assert_eq!(report.missing, ["second._extra_state"]);
    assert_eq!(words(&model.first), ["a"]);
    assert_eq!(words(&model.second), ["old"]);

    let mut stray = block().state_dict().unwrap();
    stray.insert(
        "fc._extra_state",
        module_runtime::extra_state_from_bytes(b"x").unwrap(),
    );
    match block()
        .load_state_dict(&stray, &LoadOptions::default())
        .unwrap_err()
    {
        Error::Load(report) => assert_eq!(report.unexpected, ["fc._extra_state"]),
        other => panic!("expected a load report, got {other}"),
    }
}

/// PyTorch has no all-or-nothing load (an exception in `set_extra_state` leaves what was copied
/// before it); here a refused extra state fails the load with nothing changed: the extra states
/// already set get their old value back, and no parameter is copied.
#[test]
fn a_refused_extra_state_changes_nothing() {
    let saved = tagger(&["new"], &["refused"]);
    let model = tagger(&["old1"], &["old2"]);
    let before = weight_of_fc(&model.first.fc);
    let err = model
        .load_state_dict(&saved.state_dict().unwrap(), &LoadOptions::default())
        .unwrap_err();
    match &err {
        Error::ExtraState { path, .. } => assert_eq!(path, "second._extra_state"),
        other => panic!("expected an extra-state error, got {other}"),
    }
    assert_eq!(words(&model.first), ["old1"]);
    assert_eq!(words(&model.second), ["old2"]);
    assert_eq!(weight_of_fc(&model.first.fc), before);
}

// ---------------------------------------------------------------------------------------------
// 5. Gradients by name (backward hooks: tests/integration/backward_hooks.rs)
// ---------------------------------------------------------------------------------------------

/// Every parameter's gradient is in the `GradStore` that `backward` returns, found by name through
/// `named_parameters` (PyTorch's `p.grad` for each `(name, p)`).
#[test]
fn gradients_by_name_come_from_the_grad_store() {
    let m = outer();
    let x = x(1.0);
    let loss = m.call(&x).unwrap().sum_all().unwrap();
    let grads = loss.backward().unwrap();
    for (name, p) in m.named_parameters() {
        let g = grads
            .get(&p.var().unwrap())
            .unwrap_or_else(|| panic!("no gradient for {name}"));
        assert_eq!(g.dims(), p.shape().dims(), "{name}");
    }
    // d(sum(x W^T + b))/db = 1 for each output.
    let bias = m.picky.fc.bias.as_ref().unwrap().var().unwrap();
    assert_eq!(
        grads.get(&bias).unwrap().to_vec1::<f32>().unwrap(),
        [1.0, 1.0]
    );
}
