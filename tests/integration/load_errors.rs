//! Errors that say what to do (issue #14, item 4): a stray or missing key prefix named in one line
//! with its fix, long reports grouped, "did you mean" pairs that respect shapes and numbering, and
//! forward errors that name the submodule that failed.
//!
//! PyTorch's `Module.load_state_dict` (`torch/nn/modules/module.py`) lists every missing and every
//! unexpected key, so a `DataParallel` checkpoint (`module.` on every key) fails with the whole
//! model twice; the fix, `torch.nn.modules.utils.consume_prefix_in_state_dict_if_present(sd,
//! "module.")`, is left to the user to know. Here the report says it.

use module_runtime::nn::LayerNorm;
use module_runtime::prelude::*;
use module_runtime::{Error, KeyRule, LoadOptions, StateDict};

fn dev() -> Device {
    candle_module::device_from_env().expect("MODULE_DEVICE names a usable device")
}

#[derive(Module)]
struct Layer {
    query: Linear,
    fc: Linear,
}

#[derive(Module)]
struct Encoder {
    layer: Vec<Layer>,
}

#[derive(Module)]
struct Bert {
    encoder: Encoder,
    pooler: Linear,
}

fn bert(layers: usize, hidden: usize) -> Bert {
    let dev = dev();
    Bert {
        encoder: Encoder {
            layer: (0..layers)
                .map(|_| Layer {
                    query: Linear::new(4, 4, &dev).unwrap(),
                    fc: Linear::new(4, hidden, &dev).unwrap(),
                })
                .collect(),
        },
        pooler: Linear::new(4, 4, &dev).unwrap(),
    }
}

/// `sd` with `prefix` in front of every key (`""` for none) and `drop` removed from it.
fn renamed(sd: &StateDict, f: impl Fn(&str) -> String) -> StateDict {
    sd.iter().map(|(k, t)| (f(k), t.clone())).collect()
}

fn values(m: &dyn Module) -> Vec<Vec<f32>> {
    m.state_dict()
        .unwrap()
        .iter()
        .map(|(_, t)| t.flatten_all().unwrap().to_vec1::<f32>().unwrap())
        .collect()
}

fn load_error(
    model: &dyn Module,
    sd: &StateDict,
    options: &LoadOptions,
) -> (String, Box<module_runtime::LoadReport>) {
    let before = values(model);
    let err = model.load_state_dict(sd, options).unwrap_err();
    assert_eq!(values(model), before, "a failed load changes nothing");
    let message = err.to_string();
    match err {
        Error::Load(report) => (message, report),
        other => panic!("expected a load report, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// 1. Prefixes: one line with the fix.

#[test]
fn a_data_parallel_checkpoint_says_strip_prefix_in_one_line() {
    let source = bert(12, 4);
    let sd = renamed(&source.state_dict().unwrap(), |k| format!("module.{k}"));
    let model = bert(12, 4);
    let (message, report) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         the checkpoint's keys start with \"module.\" and the model's do not: load with \
         `LoadOptions::default().strip_prefix(\"module\")` (it fills all 50 missing keys).\n"
    );
    let fix = report.key_fix.as_ref().unwrap();
    assert_eq!(fix.rules, [KeyRule::StripPrefix("module".into())]);
    assert_eq!(fix.fixes, 50);
    assert!(
        report.suggestions.is_empty(),
        "the rule explains every pair: {:?}",
        report.suggestions
    );
    // The lists are all there for code that reads them.
    assert_eq!(report.missing.len(), 50);
    assert_eq!(report.unexpected.len(), 50);

    // The fix works, spelled either way (PyTorch spells it with the dot).
    for prefix in ["module", "module."] {
        let model = bert(12, 4);
        let loaded = model
            .load_state_dict(&sd, &LoadOptions::default().strip_prefix(prefix))
            .unwrap();
        assert_eq!(loaded.loaded, 50);
        assert_eq!(values(&model), values(&source));
    }
}

#[derive(Module)]
struct Classifier {
    bert: Bert,
    head: Linear,
}

#[test]
fn a_bare_checkpoint_for_a_wrapped_model_says_add_prefix() {
    let dev = dev();
    let source = bert(2, 4);
    let sd = source.state_dict().unwrap();
    let model = Classifier {
        bert: bert(2, 4),
        head: Linear::new(4, 2, &dev).unwrap(),
    };
    let (message, report) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         the model's keys start with \"bert.\" and the checkpoint's do not: load with \
         `LoadOptions::default().add_prefix(\"bert\")` (it fills 10 of the 12 missing keys).\n  \
         other missing key(s): \"head.weight\", \"head.bias\".\n"
    );
    assert_eq!(
        report.key_fix.as_ref().unwrap().rules,
        [KeyRule::AddPrefix("bert".into())]
    );
    // With the fix, what is left is what the message said: the head.
    let report = model
        .load_state_dict(
            &sd,
            &LoadOptions::default().add_prefix("bert.").non_strict(),
        )
        .unwrap();
    assert_eq!(report.loaded, 10);
    assert_eq!(report.missing, ["head.weight", "head.bias"]);
}

#[test]
fn a_task_checkpoint_with_extra_heads_says_strip_prefix_and_lists_the_rest() {
    let dev = dev();
    let source = bert(2, 4);
    let mut sd = renamed(&source.state_dict().unwrap(), |k| format!("bert.{k}"));
    sd.insert(
        "cls.predictions.bias",
        Tensor::zeros(4, DType::F32, &dev).unwrap(),
    );
    let model = bert(2, 4);
    let (message, _) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         the checkpoint's keys start with \"bert.\" and the model's do not: load with \
         `LoadOptions::default().strip_prefix(\"bert\")` (it fills all 10 missing keys).\n  \
         other unexpected key(s): \"cls.predictions.bias\".\n"
    );
    // Non-strict with the fix: everything loads, the head is reported.
    let report = model
        .load_state_dict(
            &sd,
            &LoadOptions::default().strip_prefix("bert").non_strict(),
        )
        .unwrap();
    assert_eq!(report.loaded, 10);
    assert_eq!(report.unexpected, ["cls.predictions.bias"]);
}

#[test]
fn a_swapped_prefix_says_strip_then_add_and_keeps_the_given_rules() {
    let source = bert(2, 4);
    let sd = renamed(&source.state_dict().unwrap(), |k| format!("ddp.model.{k}"));
    let model = Classifier {
        bert: bert(2, 4),
        head: Linear::new(4, 2, &dev()).unwrap(),
    };
    let given = LoadOptions::default().strip_prefix("ddp");
    let (message, _) = load_error(&model, &sd, &given);
    assert!(
        message.contains(
            "the checkpoint's keys start with \"model.\" where the model's start with \"bert.\": \
             load with `LoadOptions::default().strip_prefix(\"ddp\").strip_prefix(\"model\")\
             .add_prefix(\"bert\")` (it fills 10 of the 12 missing keys).\n"
        ),
        "{message}"
    );
}

#[test]
fn a_renumbered_list_is_not_mistaken_for_a_prefix() {
    // Two of four keys would match after `strip_prefix("slice.4").add_prefix("slice.0")`: not a
    // majority, and the "did you mean" pairs say it better.
    let dev = dev();
    #[derive(Module)]
    struct Net {
        slice: Vec<Linear>,
    }
    let model = Net {
        slice: vec![
            Linear::new(4, 8, &dev).unwrap(),
            Linear::new(8, 8, &dev).unwrap(),
        ],
    };
    let sd: StateDict = model
        .state_dict()
        .unwrap()
        .iter()
        .map(|(k, t)| {
            (
                k.replace("slice.0", "slice.4")
                    .replace("slice.1", "slice.5"),
                t.clone(),
            )
        })
        .collect();
    let (_, report) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(report.key_fix, None);
}

// ---------------------------------------------------------------------------------------------
// Long reports: grouped, with counts.

#[test]
fn keys_missing_in_every_layer_are_one_pattern() {
    let source = bert(12, 4);
    let sd = renamed(&source.state_dict().unwrap(), |k| {
        k.replace(".query.", ".q.")
    });
    let model = bert(12, 4);
    let (message, report) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(report.missing.len(), 24);
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         24 missing key(s): \"encoder.layer.{0..11}.query.weight\" (12), \
         \"encoder.layer.{0..11}.query.bias\" (12).\n  \
         24 unexpected key(s): \"encoder.layer.{0..11}.q.bias\" (12), \
         \"encoder.layer.{0..11}.q.weight\" (12).\n  \
         did you mean: \"encoder.layer.{0..11}.q.weight\" in the checkpoint for \
         \"encoder.layer.{0..11}.query.weight\" in the model?\n  \
         did you mean: \"encoder.layer.{0..11}.q.bias\" in the checkpoint for \
         \"encoder.layer.{0..11}.query.bias\" in the model?\n"
    );
}

#[test]
fn many_patterns_end_with_a_count_and_where_they_are() {
    // A checkpoint of another model: nothing fits, and the report stays a few lines long.
    let dev = dev();
    #[derive(Module)]
    struct Other {
        blocks: Vec<Layer>,
        norm: Linear,
    }
    let model = bert(12, 4);
    let other = Other {
        blocks: (0..3)
            .map(|_| Layer {
                query: Linear::new(2, 2, &dev).unwrap(),
                fc: Linear::new(2, 2, &dev).unwrap(),
            })
            .collect(),
        norm: Linear::new(2, 2, &dev).unwrap(),
    };
    let sd = renamed(&other.state_dict().unwrap(), |k| {
        k.replace("query", "attn.query")
    });
    let (message, _) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         50 missing key(s): \"encoder.layer.{0..11}.query.weight\" (12), \
         \"encoder.layer.{0..11}.query.bias\" (12), \"encoder.layer.{0..11}.fc.weight\" (12), \
         \"encoder.layer.{0..11}.fc.bias\" (12), \"pooler.weight\", \"pooler.bias\".\n  \
         14 unexpected key(s): \"blocks.{0..2}.attn.query.bias\" (3), \
         \"blocks.{0..2}.attn.query.weight\" (3), \"blocks.{0..2}.fc.bias\" (3), \
         \"blocks.{0..2}.fc.weight\" (3), \"norm.bias\", \"norm.weight\".\n"
    );

    // Past six patterns, the rest is counted, with the prefix they share.
    #[derive(Module)]
    struct Wide {
        a: Linear,
        b: Linear,
        encoder: Encoder,
    }
    let model = Wide {
        a: Linear::new(4, 4, &dev).unwrap(),
        b: Linear::new(4, 4, &dev).unwrap(),
        encoder: bert(12, 4).encoder,
    };
    let (message, _) = load_error(&model, &StateDict::new(), &LoadOptions::default());
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         52 missing key(s): \"a.weight\", \"a.bias\", \"b.weight\", \"b.bias\", \
         \"encoder.layer.{0..11}.query.weight\" (12), \"encoder.layer.{0..11}.query.bias\" (12), \
         and 24 more under \"encoder.layer.{0..11}.fc.*\".\n"
    );
}

#[test]
fn mismatches_of_one_kind_are_one_line() {
    let source = bert(12, 6);
    let sd = source.state_dict().unwrap();
    let model = bert(12, 4);
    let (message, report) = load_error(&model, &sd, &LoadOptions::default().non_strict());
    assert_eq!(report.mismatched.len(), 24);
    assert_eq!(
        message,
        "error(s) loading state dict; the model was not changed:\n  \
         \"encoder.layer.{0..11}.fc.weight\" (12): the checkpoint has F32 [6, 4], the model has F32 [4, 4].\n  \
         \"encoder.layer.{0..11}.fc.bias\" (12): the checkpoint has F32 [6], the model has F32 [4].\n"
    );
}

// ---------------------------------------------------------------------------------------------
// 2. "Did you mean": shapes and numbering.

/// LPIPS-style: PyTorch slices keep the original `features` indices (`slice2.4.weight`), a port
/// that numbers from 0 does not.
#[derive(Module)]
struct Slices {
    slice2: Vec<Linear>,
}

#[test]
fn renumbered_layers_pair_by_offset_and_shape() {
    let dev = dev();
    let model = Slices {
        slice2: vec![
            Linear::new(4, 8, &dev).unwrap(),
            Linear::new(8, 8, &dev).unwrap(),
        ],
    };
    let mut sd = StateDict::new();
    let t = |dims: &[usize]| Tensor::zeros(dims, DType::F32, &dev).unwrap();
    sd.insert("slice2.4.weight", t(&[8, 4]));
    sd.insert("slice2.4.bias", t(&[8]));
    sd.insert("slice2.5.weight", t(&[8, 8]));
    sd.insert("slice2.5.bias", t(&[8]));
    // As close in spelling, but the wrong shape: never suggested.
    sd.insert("slice1.0.weight", t(&[3, 3]));
    let (message, report) = load_error(&model, &sd, &LoadOptions::default());
    let pair = |m: &str, u: &str| (m.to_owned(), u.to_owned());
    assert_eq!(
        report.suggestions,
        [
            pair("slice2.0.weight", "slice2.4.weight"),
            pair("slice2.0.bias", "slice2.4.bias"),
            pair("slice2.1.weight", "slice2.5.weight"),
            pair("slice2.1.bias", "slice2.5.bias"),
        ]
    );
    assert!(
        message.ends_with(
            "  did you mean: \"slice2.4.weight\" in the checkpoint for \"slice2.0.weight\" in the model?\n  \
             did you mean: \"slice2.4.bias\" in the checkpoint for \"slice2.0.bias\" in the model?\n  \
             did you mean: \"slice2.5.weight\" in the checkpoint for \"slice2.1.weight\" in the model?\n  \
             did you mean: \"slice2.5.bias\" in the checkpoint for \"slice2.1.bias\" in the model?\n"
        ),
        "{message}"
    );
}

#[derive(Module)]
struct Normed {
    norm: LayerNorm,
}

#[test]
fn a_tensor_that_does_not_fit_is_never_suggested() {
    let dev = dev();
    let model = Normed {
        norm: LayerNorm::new(256, &dev).unwrap(),
    };
    let t = |n: usize| Tensor::ones(n, DType::F32, &dev).unwrap();
    // Same leaf names, one edit away: the old spelling-only rule paired these.
    let mut sd = StateDict::new();
    sd.insert("norm_small.weight", t(64));
    sd.insert("norm_small.bias", t(64));
    let (message, report) = load_error(&model, &sd, &LoadOptions::default());
    assert!(report.suggestions.is_empty(), "{:?}", report.suggestions);
    assert!(!message.contains("did you mean"), "{message}");

    // With a tensor that fits beside it, that one is suggested.
    sd.insert("nrm.weight", t(256));
    let (_, report) = load_error(&model, &sd, &LoadOptions::default());
    assert_eq!(
        report.suggestions,
        [("norm.weight".to_owned(), "nrm.weight".to_owned())]
    );
}

// ---------------------------------------------------------------------------------------------
// 3. Forward errors name the submodule that failed.

mod forward {
    use std::error::Error as _;
    use std::sync::Arc;

    use module_runtime::nn::Sequential;
    use module_runtime::prelude::*;
    use module_runtime::{Error, Hooks};

    use super::dev;

    #[derive(Module)]
    struct Intermediate {
        dense: Linear,
    }

    #[derive(Module)]
    struct Block {
        intermediate: Intermediate,
        #[module(skip)]
        shadow: Option<Linear>,
    }

    #[derive(Module)]
    struct Encoder {
        // Boxed on purpose: a `Box`'s `call` is the boxed module's frame, not one more level.
        #[allow(clippy::vec_box)]
        layer: Vec<Box<Block>>,
    }

    #[derive(Module)]
    struct Model {
        encoder: Encoder,
        head: Arc<Linear>,
        seq: Sequential,
    }

    impl Forward<&Tensor> for Intermediate {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.dense.call(x)
        }
    }

    impl Forward<&Tensor> for Block {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let y = self.intermediate.call(x)?;
            match &self.shadow {
                // A module outside the tree (a skipped field): its own frame, inside this one's.
                Some(shadow) => shadow.call(&y),
                None => Ok(y),
            }
        }
    }

    impl Forward<&Tensor> for Encoder {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let mut x = x.clone();
            for layer in &self.layer {
                x = layer.call(&x)?;
            }
            Ok(x)
        }
    }

    impl Forward<&Tensor> for Model {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let x = self.encoder.call(x)?;
            let x = self.head.call(&x)?;
            let x = self.seq.call(&x)?;
            // The model's own code can fail too.
            Ok(x.reshape((7, 7))?)
        }
    }

    /// Layer `bad` of four takes 5 features where the others give 4.
    fn model(bad: Option<usize>) -> Model {
        let dev = dev();
        let layer = (0..4)
            .map(|i| {
                let inputs = if Some(i) == bad { 5 } else { 4 };
                Box::new(Block {
                    intermediate: Intermediate {
                        dense: Linear::new(inputs, 4, &dev).unwrap(),
                    },
                    shadow: None,
                })
            })
            .collect();
        Model {
            encoder: Encoder { layer },
            head: Arc::new(Linear::new(4, 4, &dev).unwrap()),
            seq: Sequential::new()
                .add(Linear::new(4, 4, &dev).unwrap())
                .add(Linear::new(4, 3, &dev).unwrap()),
        }
    }

    fn input() -> Tensor {
        Tensor::ones((2, 4), DType::F32, &dev()).unwrap()
    }

    /// The path, short type name and message of a forward error.
    fn frame(err: &Error) -> (&str, String) {
        match err {
            Error::Forward {
                path, module_type, ..
            } => (path.as_str(), module_type.to_string()),
            other => panic!("expected a forward error, got {other:?}"),
        }
    }

    /// A layer of the user's own that calls candle directly (`Linear` checks its input itself).
    #[derive(Module)]
    struct Projection {
        weight: Param,
    }

    impl Forward<&Tensor> for Projection {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            Ok(x.matmul(&self.weight.tensor()?)?)
        }
    }

    #[derive(Module)]
    struct Tower {
        blocks: Vec<Projection>,
    }

    impl Forward<&Tensor> for Tower {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            let mut x = x.clone();
            for block in &self.blocks {
                x = block.call(&x)?;
            }
            Ok(x)
        }
    }

    #[derive(Module)]
    struct Outer {
        tower: Tower,
    }

    impl Forward<&Tensor> for Outer {
        type Output = Tensor;
        fn forward(&self, x: &Tensor) -> Result<Tensor> {
            self.tower.call(x)
        }
    }

    #[test]
    fn a_shape_error_deep_in_candle_names_the_submodule_path_and_type() {
        // Block 2 of three takes 5 features where the others give 4: candle's matmul fails.
        let blocks = [4, 4, 5]
            .iter()
            .map(|&rows| Projection {
                weight: Param::new(Tensor::ones((rows, 4), DType::F32, &dev()).unwrap()).unwrap(),
            })
            .collect();
        let model = Outer {
            tower: Tower { blocks },
        };
        let err = model.call(&input()).unwrap_err();
        assert_eq!(frame(&err), ("tower.blocks.2", "Projection".into()));
        // The original error is one `source()` away, and `inner()` gets it for matching.
        let inner = err.inner();
        assert!(matches!(inner, Error::Candle(_)), "{inner:?}");
        assert_eq!(err.source().unwrap().to_string(), inner.to_string());
        assert_eq!(
            err.to_string(),
            format!("forward of `tower.blocks.2` (Projection) failed: {inner}")
        );
        assert!(inner.to_string().contains("shape mismatch"), "{inner}");

        // Called on a submodule, the path starts there.
        let err = model.tower.call(&input()).unwrap_err();
        assert_eq!(frame(&err), ("blocks.2", "Projection".into()));
    }

    #[test]
    fn shared_modules_sequentials_and_the_root_are_named() {
        let dev = dev();
        // An `Arc` field: its path, whoever else holds the module.
        let mut m = model(None);
        m.head = Arc::new(Linear::new(5, 4, &dev).unwrap());
        let err = m.call(&input()).unwrap_err();
        assert_eq!(frame(&err), ("head", "Linear".into()));

        // A `Sequential` layer: its name in the sequence.
        let mut m = model(None);
        m.seq = Sequential::new()
            .add(Linear::new(4, 4, &dev).unwrap())
            .add(Linear::new(5, 3, &dev).unwrap());
        let err = m.call(&input()).unwrap_err();
        assert_eq!(frame(&err), ("seq.1", "Linear".into()));

        // The model's own code: the root, by its type.
        let err = model(None).call(&input()).unwrap_err();
        assert_eq!(frame(&err), ("", "Model".into()));
        assert_eq!(
            err.to_string(),
            format!("forward of Model failed: {}", err.inner())
        );
    }

    #[test]
    fn a_module_outside_the_tree_is_a_frame_inside_its_caller() {
        let dev = dev();
        let mut m = model(None);
        m.encoder.layer[2].shadow = Some(Linear::new(3, 4, &dev).unwrap());
        let err = m.call(&input()).unwrap_err();
        assert_eq!(frame(&err), ("encoder.layer.2", "Block".into()));
        let Error::Forward { source, .. } = &err else {
            unreachable!()
        };
        assert_eq!(frame(source), ("", "Linear".into()));
        assert_eq!(
            err.to_string(),
            format!(
                "forward of `encoder.layer.2` (Block) failed: forward of Linear failed: {}",
                err.inner()
            )
        );
    }

    #[test]
    fn with_hooks_the_path_is_the_same_and_hook_errors_are_not_wrapped() {
        let model = model(Some(1));
        let hooks = Hooks::new();
        hooks
            .register_forward_hook(
                "encoder.layer.*",
                |_, _, _| Ok(None),
                HookOptions::default(),
            )
            .unwrap();
        let err = hooks.run(&model, |m| m.call(&input())).unwrap_err();
        assert_eq!(
            frame(&err),
            ("encoder.layer.1.intermediate.dense", "Linear".into())
        );

        let model = super::forward::model(None);
        let hooks = Hooks::new();
        hooks
            .register_forward_hook(
                "encoder.layer.2.intermediate",
                |_, _, _| {
                    Err(Error::InvalidDevice {
                        name: "refused".into(),
                    })
                },
                HookOptions::default(),
            )
            .unwrap();
        let err = hooks.run(&model, |m| m.call(&input())).unwrap_err();
        match &err {
            Error::Hook { path, .. } => assert_eq!(path, "encoder.layer.2.intermediate"),
            other => panic!("expected the hook's error, got {other:?}"),
        }
    }

    #[test]
    fn a_layers_own_error_keeps_its_variant_under_the_path() {
        let dev = dev();
        #[derive(Module)]
        struct Net {
            norm: module_runtime::nn::LayerNorm,
        }
        impl Forward<&Tensor> for Net {
            type Output = Tensor;
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                self.norm.call(x)
            }
        }
        let net = Net {
            norm: module_runtime::nn::LayerNorm::new(8, &dev).unwrap(),
        };
        let err = net.call(&input()).unwrap_err();
        assert_eq!(frame(&err).0, "norm");
        assert!(matches!(err.inner(), Error::InputShape { .. }), "{err:?}");
        // Converted to candle's error (for `candle_nn::Module` callers), the message stays.
        let candle: candle_core::Error = err.into();
        assert!(
            candle
                .to_string()
                .starts_with("forward of `norm` (LayerNorm) failed: "),
            "{candle}"
        );
    }

    /// An `f64` batch into an `f32` model: the message names the path, both dtypes and the two
    /// fixes, in eval mode and in training mode (where `Linear` runs its fused training pass), and
    /// under `no_grad`.
    #[test]
    fn an_input_of_another_dtype_names_both_and_the_fix() {
        let m = model(None);
        let x = Tensor::ones((2, 4), DType::F64, &dev()).unwrap();
        for training in [false, true] {
            if training {
                m.train();
            } else {
                m.eval();
            }
            let err = m.call(&x).unwrap_err();
            assert_eq!(frame(&err).0, "encoder.layer.0.intermediate.dense", "{err}");
            assert!(
                matches!(
                    err.inner(),
                    Error::InputDType {
                        input: DType::F64,
                        params: DType::F32,
                        ..
                    }
                ),
                "{err:?}"
            );
            let message = err.to_string();
            assert!(
                message.contains(
                    "the input is F64 and the parameters F32: convert the input \
                     (`x.to_dtype(DType::F32)?`), or the model (`model.to_dtype(DType::F64)?`)"
                ),
                "{message}"
            );
        }
        let _guard = no_grad();
        let err = m.call(&x).unwrap_err();
        assert!(matches!(err.inner(), Error::InputDType { .. }), "{err:?}");
    }

    /// A module without parameters has nothing to compare with: candle's error stays as it was.
    #[test]
    fn a_dtype_mismatch_without_parameters_stays_candles() {
        #[derive(Module)]
        struct AddBias {
            #[module(skip)]
            bias: Tensor,
        }
        impl Forward<&Tensor> for AddBias {
            type Output = Tensor;
            fn forward(&self, x: &Tensor) -> Result<Tensor> {
                Ok(x.broadcast_add(&self.bias)?)
            }
        }
        let m = AddBias {
            bias: Tensor::ones(4, DType::F32, &dev()).unwrap(),
        };
        let x = Tensor::ones((2, 4), DType::F64, &dev()).unwrap();
        let err = m.call(&x).unwrap_err();
        assert!(matches!(err.inner(), Error::Candle(_)), "{err:?}");
    }
}
