//! A learning-rate schedule's state that PyTorch saved (`torch.save({"scheduler":
//! scheduler.state_dict(), …})`), read from a checkpoint's [`PyValue`]s into the state dict
//! [`LrScheduler::load_state_dict`] takes, and the kinds of `torch.optim.lr_scheduler` told
//! apart by their fields.

use candle_core::{Device, Tensor};
use module_state::{PyValue, StateDict};

use crate::error::{Error, Result, StateError};
use crate::schedule::{LrScheduler, COMMON};

/// Entries of a PyTorch scheduler's state that only steer its Python implementation (warnings,
/// the deprecated `verbose`): read past.
const IMPLEMENTATION_ONLY: &[&str] = &["_is_initial", "_get_lr_called_within_step", "verbose"];

/// `torch.optim.lr_scheduler`'s classes by the fields their `state_dict()` holds besides the
/// common ones (PyTorch 2.x). `MultiplicativeLR` saves what `LambdaLR` saves, so it reads as one.
const KINDS: &[(&str, &[&str])] = &[
    ("StepLR", &["step_size", "gamma"]),
    ("MultiStepLR", &["milestones", "gamma"]),
    ("ConstantLR", &["factor", "total_iters"]),
    ("LinearLR", &["start_factor", "end_factor", "total_iters"]),
    ("ExponentialLR", &["gamma"]),
    ("PolynomialLR", &["total_iters", "power"]),
    ("CosineAnnealingLR", &["T_max", "eta_min"]),
    ("LambdaLR", &["lr_lambdas"]),
    (
        "CosineAnnealingWarmRestarts",
        &["T_0", "T_i", "T_mult", "eta_min", "T_cur"],
    ),
    ("SequentialLR", &["_schedulers", "_milestones"]),
    ("SWALR", &["anneal_epochs", "_anneal_strategy"]),
    ("ChainedScheduler", &["_schedulers"]),
];

/// Fields only one class has, for the classes with many.
const DISTINCTIVE: &[(&str, &str)] = &[
    ("total_steps", "OneCycleLR"),
    ("max_lrs", "CyclicLR"),
    ("patience", "ReduceLROnPlateau"),
];

/// The class whose state has exactly the fields `own` (besides the common ones), if one does.
fn identify(own: &[&str]) -> Option<&'static str> {
    let same =
        |fields: &[&str]| fields.len() == own.len() && fields.iter().all(|f| own.contains(f));
    KINDS
        .iter()
        .find(|(_, fields)| same(fields))
        .map(|(name, _)| *name)
        .or_else(|| {
            DISTINCTIVE
                .iter()
                .find(|(field, _)| own.contains(field))
                .map(|(_, name)| *name)
        })
}

/// Refuses the state of another kind of schedule than `class`: `keys` are the state's (in this
/// crate's form, where a `LambdaLR`'s `lr_lambdas` is not kept, so no own field means
/// `LambdaLR`). Keys that name no known class are left to the strict key check.
pub(crate) fn check_kind(class: &'static str, keys: &[&str]) -> Result<()> {
    let own: Vec<&str> = keys
        .iter()
        .copied()
        .filter(|k| !COMMON.contains(k))
        .collect();
    let found = if own.is_empty() {
        Some("LambdaLR")
    } else {
        identify(&own)
    };
    match found {
        Some(found) if found != class => Err(kind_error(class, found, &own)),
        _ => Ok(()),
    }
}

fn kind_error(class: &'static str, found: &str, own: &[&str]) -> Error {
    StateError::SchedulerKind {
        expected: class,
        found: found.to_owned(),
        fields: own.iter().map(|s| s.to_string()).collect(),
    }
    .into()
}

/// Reads the state `torch.optim.lr_scheduler` saved (`scheduler.state_dict()`, a dict) into the
/// state dict `scheduler`'s [`load_state_dict`](LrScheduler::load_state_dict) takes: PyTorch's
/// `scheduler.load_state_dict(torch.load(path)["scheduler"])` is
///
/// ```
/// use module_runtime::optim::{read_pth_scheduler_state, LrScheduler, Optimizer, SgdOptions, StepLr, SGD};
/// use module_runtime::prelude::*;
/// use module_runtime::PthValues;
/// # let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../fixtures/pytorch/scheduler/step_lr.pt");
/// # let model = Linear::new(6, 8, &Device::Cpu)?;
/// let mut optimizer = SGD::new(&model, SgdOptions::new(0.01))?;
/// // scheduler = StepLR(optimizer, step_size=30, gamma=0.1)
/// let mut scheduler = StepLr::new(&mut optimizer, 30, 0.1);
/// // scheduler.load_state_dict(torch.load(path)["scheduler"])
/// let ckpt = PthValues::load(path)?;
/// let state = read_pth_scheduler_state(ckpt.get("scheduler")?, &scheduler)?;
/// scheduler.load_state_dict(&state, &mut optimizer)?;
/// assert_eq!(scheduler.last_epoch(), 4); // saved after 4 steps of StepLR(step_size=3, gamma=0.5)
/// assert_eq!(optimizer.lrs(), [0.005]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
///
/// The state must be of `scheduler`'s kind (PyTorch's `StepLR` for a [`StepLr`](crate::StepLr),
/// `ExponentialLR` for an [`ExponentialLr`](crate::ExponentialLr), `LambdaLR` for a
/// [`LambdaLr`](crate::LambdaLr), `SWALR` for a [`SwaLr`](crate::swa_utils::SwaLr), whose
/// `_anneal_strategy` string becomes 0 for `"cos"` and 1 for `"linear"`): another kind is
/// [`StateError::SchedulerKind`], naming both.
/// PyTorch's `last_epoch`, `_step_count`, `_last_lr`, `base_lrs` and the schedule's own fields
/// (`step_size`, `gamma`) are read; `_is_initial`, `_get_lr_called_within_step` and the
/// deprecated `verbose` only steer PyTorch's implementation and are read past. A `LambdaLR`'s
/// `lr_lambdas` must be one entry per group, each `None` (a plain function, whose code PyTorch
/// does not save) or an empty dict (a `functools.partial`, as Hugging Face's
/// `get_*_schedule_with_warmup` make): a callable object with state of its own cannot be
/// restored into a Rust closure and is an error. Any other field is an error naming it.
pub fn read_pth_scheduler_state(
    state: &PyValue,
    scheduler: &(impl LrScheduler + ?Sized),
) -> Result<StateDict> {
    let class = scheduler.class_name();
    let items = state.as_dict().ok_or_else(|| {
        invalid(
            "scheduler",
            format!("is {}, not a scheduler's state dict", state.describe()),
        )
    })?;
    let mut entries = Vec::with_capacity(items.len());
    for (k, v) in items {
        match k {
            PyValue::Str(name) => entries.push((name.as_str(), v)),
            other => {
                return Err(invalid(
                    "scheduler",
                    format!("has the key {}, not a field name", other.describe()),
                ))
            }
        }
    }
    let own: Vec<&str> = entries
        .iter()
        .map(|(k, _)| *k)
        .filter(|k| !COMMON.contains(k) && !IMPLEMENTATION_ONLY.contains(k))
        .collect();
    match identify(&own) {
        Some(found) if found != class => return Err(kind_error(class, found, &own)),
        _ => {}
    }
    let mut out = StateDict::new();
    let mut groups = None;
    for (name, value) in &entries {
        let at = |reason: String| invalid(&format!("scheduler['{name}']"), reason);
        match *name {
            n if IMPLEMENTATION_ONLY.contains(&n) => {}
            "lr_lambdas" => groups = Some(lr_lambdas(value)?),
            // SWALR's annealing, a string in PyTorch's state: 0 for "cos", 1 for "linear".
            "_anneal_strategy" => {
                let code = match value {
                    PyValue::Str(s) if s == "cos" => 0.0,
                    PyValue::Str(s) if s == "linear" => 1.0,
                    other => {
                        return Err(at(format!(
                            "is {}, not \"cos\" or \"linear\"",
                            other.describe()
                        )))
                    }
                };
                out.insert(*name, Tensor::new(code, &Device::Cpu)?);
            }
            "_last_lr" | "base_lrs" => {
                let lrs: Vec<f64> = value
                    .extract()
                    .ok_or_else(|| at(format!("is {}, not a list of numbers", value.describe())))?;
                out.insert(*name, Tensor::new(lrs, &Device::Cpu)?);
            }
            _ => {
                let x = number(value)
                    .ok_or_else(|| at(format!("is {}, not a number", value.describe())))?;
                out.insert(*name, Tensor::new(x, &Device::Cpu)?);
            }
        }
    }
    if let (Some(n), Some(base)) = (groups, out.get("base_lrs")) {
        if base.dims() != [n] {
            return Err(invalid(
                "scheduler['lr_lambdas']",
                format!(
                    "has {n} entries, but `base_lrs` {} groups",
                    base.dims().first().copied().unwrap_or(0)
                ),
            ));
        }
    }
    Ok(out)
}

/// Checks a `LambdaLR`'s `lr_lambdas` and returns its number of entries.
fn lr_lambdas(value: &PyValue) -> Result<usize> {
    let items = value.as_list().ok_or_else(|| {
        invalid(
            "scheduler['lr_lambdas']",
            format!("is {}, not a list", value.describe()),
        )
    })?;
    for (i, f) in items.iter().enumerate() {
        match f {
            PyValue::None => {}
            PyValue::Dict(d) if d.is_empty() => {}
            other => {
                return Err(invalid(
                    &format!("scheduler['lr_lambdas'][{i}]"),
                    format!(
                        "is {}: the state of a callable object, which a Rust closure cannot \
                         take (a plain function saves None); make the LambdaLr with the factor \
                         that object computes and load a state without it",
                        other.describe()
                    ),
                ))
            }
        }
    }
    Ok(items.len())
}

/// A Python number or boolean as `f64`.
fn number(v: &PyValue) -> Option<f64> {
    match v {
        PyValue::Bool(b) => Some(f64::from(u8::from(*b))),
        other => other.extract(),
    }
}

fn invalid(key: &str, reason: String) -> Error {
    StateError::InvalidValue {
        key: key.to_owned(),
        reason,
    }
    .into()
}
