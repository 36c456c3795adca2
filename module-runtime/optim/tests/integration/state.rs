//! The optimizer state dict: keyed by parameter path, saved through safetensors, loaded strictly
//! and all or nothing, and a training run resumed from it bit for bit.

use module_runtime::optim::{
    Adam, AdamW, Error, Optimizer, ParamGroups, SgdOptions, StateError, SGD,
};
use module_runtime::prelude::*;
use module_runtime::StateDict;

#[derive(Module)]
struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

impl Forward<&Tensor> for Mlp {
    type Output = Tensor;
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.fc2.call(&self.fc1.call(x)?.tanh()?)
    }
}

/// The same initial model every time.
fn mlp() -> Mlp {
    let dev = Device::Cpu;
    let m = Mlp {
        fc1: Linear::new(6, 5, &dev).unwrap(),
        fc2: Linear::new(5, 3, &dev).unwrap(),
    };
    for (i, (_, p)) in m.named_parameters().into_iter().enumerate() {
        let n = p.elem_count();
        let v: Vec<f32> = (0..n)
            .map(|k| (((k + 13 * i) * 37) % 19) as f32 / 19.0 - 0.5)
            .collect();
        p.set(&Tensor::from_vec(v, p.shape(), &dev).unwrap())
            .unwrap();
    }
    m
}

fn batch(k: usize) -> Tensor {
    let v: Vec<f32> = (0..24)
        .map(|i| (((i + 5 * k) * 29) % 17) as f32 / 8.0 - 1.0)
        .collect();
    Tensor::from_vec(v, (4, 6), &Device::Cpu).unwrap()
}

/// The loss of step `k`.
fn loss(model: &Mlp, k: usize) -> Tensor {
    model
        .call(&batch(k))
        .unwrap()
        .sqr()
        .unwrap()
        .mean_all()
        .unwrap()
}

fn train(model: &Mlp, opt: &mut dyn Optimizer, steps: std::ops::Range<usize>) {
    for k in steps {
        opt.backward_step(&loss(model, k)).unwrap();
    }
}

fn bits(model: &Mlp) -> Vec<Vec<u32>> {
    model
        .named_parameters()
        .into_iter()
        .map(|(_, p)| {
            p.tensor()
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
                .into_iter()
                .map(f32::to_bits)
                .collect()
        })
        .collect()
}

fn groups() -> ParamGroups {
    ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0))
}

type Make = fn(&Mlp) -> Box<dyn Optimizer>;

fn makers() -> Vec<(&'static str, Make)> {
    vec![
        ("AdamW amsgrad", |m| {
            Box::new(
                AdamW::with_groups(m, AdamW::options().lr(1e-2).amsgrad(true), &groups()).unwrap(),
            )
        }),
        ("Adam L2 composed", |m| {
            let mut o = Adam::new(m, Adam::options().lr(1e-2).weight_decay(0.1)).unwrap();
            o.set_fused(false);
            Box::new(o)
        }),
        ("SGD nesterov", |m| {
            let o = SgdOptions::new(0.05)
                .momentum(0.9)
                .nesterov(true)
                .weight_decay(1e-3);
            Box::new(SGD::with_groups(m, o, &groups()).unwrap())
        }),
    ]
}

/// 2N steps equal N steps, a save, a load into a fresh optimizer (and a fresh model loaded from
/// the saved weights), and N more steps, bit for bit.
#[test]
fn resume_is_bit_exact() {
    let dir = std::env::temp_dir().join(format!("module-optim-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, make) in makers() {
        let straight = mlp();
        let mut opt = make(&straight);
        train(&straight, opt.as_mut(), 0..6);

        let first = mlp();
        let mut opt1 = make(&first);
        train(&first, opt1.as_mut(), 0..3);
        let path = dir.join("optimizer.safetensors");
        opt1.save_state(&path).unwrap();
        let weights = dir.join("model.safetensors");
        first.save_safetensors(&weights).unwrap();
        drop((first, opt1));

        let resumed = mlp();
        resumed
            .load_state_dict(&weights, &module_runtime::LoadOptions::default())
            .unwrap();
        let mut opt2 = make(&resumed);
        opt2.load_state(&path).unwrap();
        train(&resumed, opt2.as_mut(), 3..6);
        assert_eq!(bits(&resumed), bits(&straight), "{name}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn state_dict_keys_are_paths() {
    let m = mlp();
    let mut opt = AdamW::with_groups(&m, AdamW::options().amsgrad(true), &groups()).unwrap();
    // Before any step: only groups and membership.
    let sd = opt.state_dict().unwrap();
    assert!(!sd.keys().any(|k| k.starts_with("state.")));
    train(&m, &mut opt, 0..2);
    let sd = opt.state_dict().unwrap();
    let keys: Vec<&str> = sd.keys().collect();
    for want in [
        "state.fc1.bias.step",
        "state.fc1.bias.exp_avg",
        "state.fc1.bias.exp_avg_sq",
        "state.fc1.bias.max_exp_avg_sq",
        "state.fc2.weight.exp_avg",
        "param_groups.0.lr",
        "param_groups.0.weight_decay",
        "param_groups.1.betas.1",
        "params.fc1.weight",
        "params.fc2.bias",
    ] {
        assert!(keys.contains(&want), "{want} not in {keys:?}");
    }
    assert_eq!(sd.get("state.fc2.weight.exp_avg").unwrap().dims(), [3, 5]);
    assert_eq!(
        sd.get("state.fc1.bias.step")
            .unwrap()
            .to_scalar::<f64>()
            .unwrap(),
        2.0
    );
    assert_eq!(opt.step_count("fc1.bias"), 2);
    let weight_decay = |g: usize| {
        sd.get(&format!("param_groups.{g}.weight_decay"))
            .unwrap()
            .to_scalar::<f64>()
            .unwrap()
    };
    assert_eq!((weight_decay(0), weight_decay(1)), (0.0, 0.01));
    // Bias parameters are in group 0.
    assert_eq!(
        sd.get("params.fc2.bias")
            .unwrap()
            .to_scalar::<u32>()
            .unwrap(),
        0
    );
}

/// Loads a state dict that `edit` broke, expecting `check` of the error, and that the optimizer
/// is unchanged.
fn rejects(edit: impl FnOnce(&mut StateDict), check: impl FnOnce(&StateError) -> bool) {
    let m = mlp();
    let mut opt = AdamW::with_groups(&m, AdamW::options().lr(1e-2), &groups()).unwrap();
    train(&m, &mut opt, 0..2);
    let before = opt.state_dict().unwrap();
    let other = mlp();
    let mut source = AdamW::with_groups(&other, AdamW::options().lr(5e-3), &groups()).unwrap();
    train(&other, &mut source, 5..8);
    let mut sd = source.state_dict().unwrap();
    edit(&mut sd);
    match opt.load_state_dict(&sd) {
        Err(Error::State(e)) => assert!(check(&e), "unexpected error: {e}"),
        Err(e) => panic!("not a state error: {e}"),
        Ok(()) => panic!("the broken state dict loaded"),
    }
    let after = opt.state_dict().unwrap();
    assert_eq!(after.len(), before.len());
    for (k, t) in before.iter() {
        let a = after
            .get(k)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let b = t.flatten_all().unwrap().to_dtype(DType::F64).unwrap();
        assert_eq!(
            a.to_vec1::<f64>().unwrap(),
            b.to_vec1::<f64>().unwrap(),
            "{k} changed"
        );
    }
}

fn rebuild(sd: &StateDict, f: impl Fn(&str, &Tensor) -> Option<(String, Tensor)>) -> StateDict {
    sd.iter().filter_map(|(k, t)| f(k, t)).collect()
}

#[test]
fn strict_load_errors_leave_the_optimizer_unchanged() {
    // An unknown parameter path.
    rejects(
        |sd| {
            sd.insert(
                "state.fc3.weight.exp_avg",
                Tensor::zeros(3, DType::F32, &Device::Cpu).unwrap(),
            )
        },
        |e| matches!(e, StateError::UnexpectedKeys { keys } if keys == &["state.fc3.weight.exp_avg"]),
    );
    // A parameter the optimizer trains is missing.
    rejects(
        |sd| {
            *sd = rebuild(sd, |k, t| {
                (k != "params.fc1.bias").then(|| (k.to_owned(), t.clone()))
            })
        },
        |e| matches!(e, StateError::MissingKeys { keys } if keys == &["params.fc1.bias"]),
    );
    // A state entry of a stepped parameter is missing (the later entries would load fine).
    rejects(
        |sd| {
            *sd = rebuild(sd, |k, t| {
                (k != "state.fc2.weight.exp_avg_sq").then(|| (k.to_owned(), t.clone()))
            })
        },
        |e| matches!(e, StateError::MissingKeys { keys } if keys == &["state.fc2.weight.exp_avg_sq"]),
    );
    // A shape mismatch, in the last parameter (so earlier ones were already converted).
    rejects(
        |sd| {
            sd.insert(
                "state.fc2.bias.exp_avg",
                Tensor::zeros(4, DType::F32, &Device::Cpu).unwrap(),
            )
        },
        |e| matches!(e, StateError::ShapeMismatch { key, .. } if key == "state.fc2.bias.exp_avg"),
    );
    // Another number of groups.
    rejects(
        |sd| {
            *sd = rebuild(sd, |k, t| {
                (!k.starts_with("param_groups.1.")).then(|| (k.to_owned(), t.clone()))
            })
        },
        |e| {
            matches!(
                e,
                StateError::GroupCount {
                    expected: 2,
                    found: 1
                }
            )
        },
    );
    // A parameter in another group.
    rejects(
        |sd| {
            sd.insert(
                "params.fc1.weight",
                Tensor::new(0u32, &Device::Cpu).unwrap(),
            )
        },
        |e| matches!(e, StateError::GroupMismatch { path, expected: 1, found: 0 } if path == "fc1.weight"),
    );
    // Invalid values.
    rejects(
        |sd| {
            sd.insert(
                "state.fc1.weight.step",
                Tensor::new(-1.0f64, &Device::Cpu).unwrap(),
            )
        },
        |e| matches!(e, StateError::InvalidValue { key, .. } if key == "state.fc1.weight.step"),
    );
    rejects(
        |sd| {
            sd.insert(
                "param_groups.0.betas.0",
                Tensor::new(1.5f64, &Device::Cpu).unwrap(),
            )
        },
        |e| matches!(e, StateError::InvalidValue { key, .. } if key == "param_groups.0.betas.0"),
    );
    // An SGD state dict in an AdamW.
    rejects(
        |sd| {
            let m = mlp();
            let mut sgd =
                SGD::with_groups(&m, SgdOptions::new(0.1).momentum(0.9), &groups()).unwrap();
            train(&m, &mut sgd, 0..1);
            *sd = sgd.state_dict().unwrap();
        },
        |e| {
            matches!(e, StateError::Mismatches { problems } if problems.iter().any(|p| {
                matches!(p, StateError::MissingKeys { keys } if keys.contains(&"param_groups.0.betas.0".to_owned()))
            }))
        },
    );
}

#[test]
fn load_takes_the_saved_hyperparameters() {
    let m = mlp();
    let mut a = AdamW::new(&m, AdamW::options().lr(0.25)).unwrap();
    train(&m, &mut a, 0..1);
    let mut b = AdamW::new(&m, AdamW::options()).unwrap();
    b.load_state_dict(&a.state_dict().unwrap()).unwrap();
    assert_eq!(b.lr(0), 0.25);
    assert_eq!(b.step_count("fc1.weight"), 1);
}

/// A run with a schedule resumes bit for bit too: the optimizer and the schedule are made as at
/// the start, then both states are loaded (in either order).
#[test]
fn resume_with_a_schedule_is_bit_exact() {
    use module_runtime::optim::{LambdaLr, LrScheduler};
    let run = |model: &Mlp, opt: &mut AdamW, s: &mut LambdaLr, steps: std::ops::Range<usize>| {
        for k in steps {
            opt.backward_step(&loss(model, k)).unwrap();
            s.step(opt);
        }
    };
    let make = |m: &Mlp| {
        let mut opt = AdamW::with_groups(m, AdamW::options().lr(1e-2), &groups()).unwrap();
        let s = LambdaLr::cosine_with_warmup(&mut opt, 2, 8);
        (opt, s)
    };
    let straight = mlp();
    let (mut opt, mut s) = make(&straight);
    run(&straight, &mut opt, &mut s, 0..6);

    for optimizer_first in [true, false] {
        let first = mlp();
        let (mut opt1, mut s1) = make(&first);
        run(&first, &mut opt1, &mut s1, 0..3);
        let (opt_state, sched_state) = (opt1.state_dict().unwrap(), s1.state_dict().unwrap());

        let resumed = mlp();
        for ((_, a), (_, b)) in resumed
            .named_parameters()
            .iter()
            .zip(first.named_parameters())
        {
            a.set(&b.tensor().unwrap()).unwrap();
        }
        let (mut opt2, mut s2) = make(&resumed);
        if optimizer_first {
            opt2.load_state_dict(&opt_state).unwrap();
            s2.load_state_dict(&sched_state, &mut opt2).unwrap();
        } else {
            s2.load_state_dict(&sched_state, &mut opt2).unwrap();
            opt2.load_state_dict(&opt_state).unwrap();
        }
        assert_eq!(opt2.lrs(), opt1.lrs());
        assert_eq!(s2.last_epoch(), 3);
        run(&resumed, &mut opt2, &mut s2, 3..6);
        assert_eq!(bits(&resumed), bits(&straight));
        assert_eq!(opt2.lrs(), opt.lrs());
    }

    // Strict: a schedule state for another number of groups is refused.
    let m = mlp();
    let mut one = AdamW::new(&m, AdamW::options()).unwrap();
    let mut s1 = LambdaLr::constant(&mut one);
    let (_, s) = make(&m);
    assert!(s1
        .load_state_dict(&s.state_dict().unwrap(), &mut one)
        .is_err());
}

/// `save_state` is the runtime's one atomic writer (`StateDict::save_safetensors`): saves leave no
/// temporary file behind, a save that fails (into a folder that does not exist, onto a folder) is
/// an error naming the path and keeps the previous file whole, and a temporary file left by a save
/// that was killed goes with the next save. (The optimizer had a copy of the writer that named no
/// path on failure and never removed a killed save's temporary file.)
#[test]
fn saves_are_atomic_and_leave_no_temporary_files() {
    let dir = std::env::temp_dir().join(format!("module-optim-save-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let names = || {
        let mut names: Vec<String> = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    let m = mlp();
    let mut opt = AdamW::with_groups(&m, AdamW::options(), &groups()).unwrap();
    train(&m, &mut opt, 0..1);
    let path = dir.join("optimizer.safetensors");
    opt.save_state(&path).unwrap();
    let before = std::fs::read(&path).unwrap();
    assert_eq!(names(), ["optimizer.safetensors"]);

    train(&m, &mut opt, 1..2);
    let folder = dir.join("a-folder");
    std::fs::create_dir_all(&folder).unwrap();
    for bad in [dir.join("no/such/folder/optimizer.safetensors"), folder] {
        match opt.save_state(&bad) {
            Err(Error::Runtime(module_runtime::Error::Io { path, .. })) => assert_eq!(path, bad),
            other => panic!("{}: {other:?}", bad.display()),
        }
    }
    assert_eq!(std::fs::read(&path).unwrap(), before);
    assert_eq!(names(), ["a-folder", "optimizer.safetensors"]);

    // What a save killed mid-write leaves: the temporary file of a process that is gone.
    let killed = dir.join(".optimizer.safetensors.module-tmp-4000000000-0");
    std::fs::write(&killed, b"half a state").unwrap();
    opt.save_state(&path).unwrap();
    assert_eq!(names(), ["a-folder", "optimizer.safetensors"]);
    let mut loaded = AdamW::with_groups(&m, AdamW::options(), &groups()).unwrap();
    loaded.load_state(&path).unwrap();
    assert_eq!(
        loaded.state_dict().unwrap().len(),
        opt.state_dict().unwrap().len()
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A state saved from another model and another kind of optimizer: every problem in one error,
/// grouped (missing keys together, unexpected keys together), and what to do for each kind.
#[test]
fn a_misfit_state_reports_every_problem_and_what_to_do() {
    #[derive(Module)]
    struct Other {
        enc: Linear,
        fc2: Linear,
    }
    let dev = Device::Cpu;
    let other = Other {
        enc: Linear::new(6, 5, &dev).unwrap(),
        fc2: Linear::new(5, 3, &dev).unwrap(),
    };
    let mut sgd = SGD::with_groups(&other, SgdOptions::new(0.1).momentum(0.9), &groups()).unwrap();
    let x = batch(0);
    let y = other.fc2.call(&other.enc.call(&x).unwrap()).unwrap();
    sgd.step(&y.sqr().unwrap().mean_all().unwrap().backward().unwrap())
        .unwrap();
    let m = mlp();
    let mut opt = AdamW::with_groups(&m, AdamW::options(), &groups()).unwrap();
    let err = opt.load_state_dict(&sgd.state_dict().unwrap()).unwrap_err();
    let Error::State(StateError::Mismatches { problems }) = &err else {
        panic!("expected every problem at once, got {err}");
    };
    assert_eq!(problems.len(), 2, "{err}");
    let message = err.to_string();
    for part in [
        "2 problems:",
        "  - missing keys: `param_groups.{0,1}.betas.{0,1}`, `param_groups.{0,1}.eps`",
        "`params.fc1.weight`",
        "  - unexpected keys: `param_groups.{0,1}.momentum`",
        "`params.enc.weight`",
        "what to do: the state has other hyperparameters: it was saved by another kind of optimizer",
        "the state's parameter paths are not this model's",
    ] {
        assert!(message.contains(part), "{part:?} not in:\n{message}");
    }
    // Nothing changed.
    assert!(opt
        .state_dict()
        .unwrap()
        .keys()
        .all(|k| !k.starts_with("state.")));
}
