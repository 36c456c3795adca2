//! An optimizer state that PyTorch saved (`torch.save({"optimizer": optimizer.state_dict(), …})`),
//! read into this crate's path-keyed form, so a training run started in PyTorch continues here.

use std::collections::{HashMap, HashSet};
use std::path::Path;

use candle_core::{Device, Tensor};
use module_state::pth::pickle::Value;
use module_state::pth::tree::PthTree;
use module_state::StateDict;

use crate::error::{Error, Result, StateError};
use crate::optimizer::Optimizer;

/// Hyperparameters `torch.optim` keeps in a group that change how PyTorch runs the update, not
/// what it computes (`foreach`, `fused`, …), or that belong to a scheduler (`initial_lr`,
/// `SWALR`'s `swa_lr`): read past.
const IMPLEMENTATION_ONLY: &[&str] = &[
    "foreach",
    "fused",
    "capturable",
    "differentiable",
    "initial_lr",
    "swa_lr",
];

/// Hyperparameters that older PyTorch versions did not save (`maximize` came in 1.11,
/// `decoupled_weight_decay` in 2.x): where a group lacks one, the optimizer's own value stays,
/// as PyTorch's `__setstate__` fills in its default.
const ADDED_LATER: &[&str] = &["maximize", "decoupled_weight_decay", "amsgrad", "nesterov"];

/// Reads the `torch.optim` state dict saved in a PyTorch checkpoint at `path` and returns it as
/// this crate's path-keyed [state dict](Optimizer::state_dict), ready for
/// [`load_state_dict`](Optimizer::load_state_dict): PyTorch's
/// `optimizer.load_state_dict(torch.load(path)["optimizer"])` is
///
/// ```no_run
/// # use module_runtime::optim::{read_pth_state, Optimizer, SGD};
/// # fn run(mut optimizer: SGD) -> module_runtime::optim::Result<()> {
/// let state = read_pth_state("checkpoint.pt", Some("optimizer"), &optimizer)?;
/// optimizer.load_state_dict(&state)?;
/// # Ok(())
/// # }
/// ```
///
/// `key` selects the optimizer's state dict inside a training checkpoint (dotted keys descend
/// through nested dicts); `None` reads a file that holds the optimizer's state dict alone.
///
/// PyTorch numbers parameters 0, 1, 2, … group by group, in the order each group lists them, and
/// keys the per-parameter state by those numbers. They are mapped to `optimizer`'s
/// [parameter paths](Optimizer::param_paths), so `optimizer` must have been made as the PyTorch
/// one was: the same groups in the same order (one group over `model.parameters()`, or the same
/// group patterns), each listing its parameters in `named_parameters()` order. A different number
/// of groups ([`StateError::GroupCount`]) or of parameters in a group
/// ([`StateError::ParamCount`]) is an error; so are state tensors whose shape is not their
/// parameter's, found when the result is loaded. Each group's hyperparameters (`lr`, `betas`,
/// `momentum`, …) come from the file, as PyTorch's `load_state_dict` takes them; the flags that
/// only pick PyTorch's implementation (`foreach`, `fused`, `capturable`, `differentiable`) and a
/// scheduler's `initial_lr` and `swa_lr` are read past. Nothing is changed: loading the result is the
/// all-or-nothing [`load_state_dict`](Optimizer::load_state_dict).
pub fn read_pth_state(
    path: impl AsRef<Path>,
    key: Option<&str>,
    optimizer: &(impl Optimizer + ?Sized),
) -> Result<StateDict> {
    let tree = PthTree::open(path.as_ref())?;
    let root = match key {
        Some(key) => tree.at(key)?,
        None => tree.root(),
    };
    let (Some(state), Some(groups)) = (tree.get(root, "state"), tree.get(root, "param_groups"))
    else {
        return Err(StateError::NotAnOptimizerState {
            found: tree.describe(root),
            candidates: candidates(&tree),
        }
        .into());
    };
    let ours = optimizer.state_dict()?;
    let mut out = StateDict::new();
    let paths = read_groups(&tree, groups, optimizer, &ours, &mut out)?;
    read_state(&tree, state, &paths, &mut out)?;
    Ok(out)
}

/// The top-level keys of the file whose values look like an optimizer's state dict.
fn candidates(tree: &PthTree) -> Vec<String> {
    tree.dict(tree.root())
        .unwrap_or_default()
        .iter()
        .filter_map(|(k, v)| match k {
            Value::Str(name)
                if tree.get(v, "state").is_some() && tree.get(v, "param_groups").is_some() =>
            {
                Some(name.to_string())
            }
            _ => None,
        })
        .collect()
}

/// Reads `param_groups` into `out` (`param_groups.<g>.<name>`, `params.<path>`) and returns the
/// path of each PyTorch parameter number.
fn read_groups(
    tree: &PthTree,
    groups: &Value,
    optimizer: &(impl Optimizer + ?Sized),
    ours: &StateDict,
    out: &mut StateDict,
) -> Result<HashMap<i64, String>> {
    let groups = tree
        .sequence(groups)
        .ok_or_else(|| invalid("param_groups", "is not a list"))?;
    if groups.len() != optimizer.num_param_groups() {
        return Err(StateError::GroupCount {
            expected: optimizer.num_param_groups(),
            found: groups.len(),
        }
        .into());
    }
    let mut paths = HashMap::new();
    let mut missing = Vec::new();
    let mut unexpected = Vec::new();
    for (g, group) in groups.iter().enumerate() {
        let at = |name: &str| format!("param_groups[{g}]['{name}']");
        let items = tree
            .dict(group)
            .ok_or_else(|| invalid(&format!("param_groups[{g}]"), "is not a dict"))?;
        // The parameters, numbered.
        let numbers = tree
            .get(group, "params")
            .and_then(|v| tree.sequence(v))
            .ok_or_else(|| invalid(&at("params"), "is not a list"))?;
        let params = optimizer.group_params(g);
        if numbers.len() != params.len() {
            return Err(StateError::ParamCount {
                group: g,
                expected: params.len(),
                found: numbers.len(),
            }
            .into());
        }
        for (n, (path, _)) in numbers.iter().zip(params) {
            let Value::Int(n) = n else {
                return Err(invalid(
                    &at("params"),
                    "holds something other than integers",
                ));
            };
            if paths.insert(*n, path.clone()).is_some() {
                return Err(invalid(
                    &at("params"),
                    &format!("lists parameter {n} twice"),
                ));
            }
            out.insert(
                format!("params.{path}"),
                Tensor::new(g as u32, &Device::Cpu)?,
            );
        }
        // The hyperparameters this optimizer has, by the names its own state dict uses
        // (`betas.0` is PyTorch's `betas[0]`).
        let prefix = format!("param_groups.{g}.");
        let mut known: HashSet<&str> = HashSet::from(["params"]);
        for (key, own) in ours.iter().filter(|(k, _)| k.starts_with(&prefix)) {
            let name = &key[prefix.len()..];
            let (base, index) = match name.split_once('.') {
                Some((base, i)) => (base, i.parse::<usize>().ok()),
                None => (name, None),
            };
            known.insert(base);
            let value = tree.get(group, base).and_then(|v| match index {
                Some(i) => tree.sequence(v)?.get(i),
                None => Some(v),
            });
            let value = match value.map(number) {
                Some(Some(x)) => Tensor::new(x, &Device::Cpu)?,
                Some(None) => {
                    return Err(invalid(&at(base), "is not a number or a boolean"));
                }
                None if ADDED_LATER.contains(&base) => own.clone(),
                None => {
                    missing.push(at(name));
                    continue;
                }
            };
            out.insert(key.to_owned(), value);
        }
        for (k, _) in items {
            match k {
                Value::Str(s) if known.contains(&**s) || IMPLEMENTATION_ONLY.contains(&&**s) => {}
                Value::Str(s) => unexpected.push(at(s)),
                other => unexpected.push(format!("param_groups[{g}][{}]", tree.describe(other))),
            }
        }
    }
    if !missing.is_empty() {
        return Err(StateError::MissingKeys { keys: missing }.into());
    }
    if !unexpected.is_empty() {
        return Err(StateError::UnexpectedKeys { keys: unexpected }.into());
    }
    Ok(paths)
}

/// Reads the per-parameter `state` into `out` as `state.<path>.<name>`. Entries that are `None`
/// (SGD's `momentum_buffer` without momentum) are left out, as this crate does not save them.
fn read_state(
    tree: &PthTree,
    state: &Value,
    paths: &HashMap<i64, String>,
    out: &mut StateDict,
) -> Result<()> {
    let entries = tree
        .dict(state)
        .ok_or_else(|| invalid("state", "is not a dict"))?;
    for (n, entry) in entries {
        let Value::Int(n) = n else {
            return Err(invalid(
                "state",
                &format!("has the key {}", tree.describe(n)),
            ));
        };
        let Some(path) = paths.get(n) else {
            return Err(invalid(
                &format!("state[{n}]"),
                &format!("is the state of parameter {n}, which no parameter group lists"),
            ));
        };
        let items = tree
            .dict(entry)
            .ok_or_else(|| invalid(&format!("state[{n}]"), "is not a dict"))?;
        for (name, value) in items {
            let Value::Str(name) = name else {
                return Err(invalid(
                    &format!("state[{n}]"),
                    "has a key that is not a string",
                ));
            };
            let at = format!("state[{n}]['{name}']");
            let tensor = if let Some(t) = tree.tensor_ref(value) {
                tree.tensor(&at, t, &Device::Cpu)?
            } else if let Some(x) = number(value) {
                // `step` as a Python number (PyTorch before 1.12).
                Tensor::new(x, &Device::Cpu)?
            } else if matches!(value, Value::None) {
                continue;
            } else {
                return Err(invalid(&at, &format!("is {}", tree.describe(value))));
            };
            out.insert(format!("state.{path}.{name}"), tensor);
        }
    }
    Ok(())
}

/// A Python number or boolean as `f64`.
fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Float(x) => Some(*x),
        Value::Int(i) => Some(*i as f64),
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        _ => None,
    }
}

fn invalid(key: &str, reason: &str) -> Error {
    StateError::InvalidValue {
        key: key.to_owned(),
        reason: reason.to_owned(),
    }
    .into()
}
