//! What every optimizer shares: its groups, its per-parameter state, and the path-keyed state dict.

use std::collections::HashSet;

use candle_core::backprop::GradStore;
use candle_core::{DType, Device, Shape, Tensor, Var};
use module_core::Param;
use module_state::StateDict;

use crate::error::{Error, Result, StateError};
use crate::group::{flag, GroupOptions, NamedParams, ParamGroup, ParamGroups};

/// Whether `x >= 0` (`nan` is not).
pub(crate) fn non_negative(x: f64) -> bool {
    x >= 0.0
}

/// [`Error::InvalidHyperparameter`] unless `ok`: one of PyTorch's range checks.
pub(crate) fn check(
    ok: bool,
    name: &'static str,
    value: f64,
    reason: &'static str,
    group: Option<usize>,
) -> Result<()> {
    if ok {
        Ok(())
    } else {
        Err(Error::InvalidHyperparameter {
            name,
            value,
            reason,
            group,
        })
    }
}

/// An optimizer's per-group hyperparameters.
pub(crate) trait Hyper: Clone {
    /// The optimizer's name, for messages.
    const OPTIMIZER: &'static str;
    /// The hyperparameters' names in a state dict.
    const NAMES: &'static [&'static str];
    /// Applies a group's overrides, through [`set`](Self::set): [`Error::NotApplicable`] for the
    /// first option the group sets that this optimizer does not have.
    fn apply(&mut self, overrides: &GroupOptions, group: usize) -> Result<()> {
        let values = overrides.values();
        let foreign = values
            .iter()
            .find(|(_, name, _)| !Self::NAMES.contains(name));
        if let Some(&(option, _, _)) = foreign {
            return Err(Error::NotApplicable {
                option,
                optimizer: Self::OPTIMIZER,
                group,
            });
        }
        for (_, name, value) in values {
            self.set(name, value);
        }
        Ok(())
    }
    /// PyTorch's range checks.
    fn validate(&self, group: Option<usize>) -> Result<()>;
    /// The hyperparameter called `name`, one of `NAMES`.
    fn field(&mut self, name: &str) -> Field<'_>;
    /// The value of `name`, one of `NAMES` (booleans as 0 or 1).
    fn get(&self, name: &str) -> f64 {
        match self.clone().field(name) {
            Field::Value(v) => *v,
            Field::Flag(b) => flag(*b),
        }
    }
    /// Sets `name`, one of `NAMES` (a boolean is true unless `value` is 0).
    fn set(&mut self, name: &str, value: f64) {
        match self.field(name) {
            Field::Value(v) => *v = value,
            Field::Flag(b) => *b = value != 0.0,
        }
    }
}

/// One of an optimizer's hyperparameters, borrowed from its options: a number, or a flag (0 or 1
/// in a state dict).
pub(crate) enum Field<'a> {
    Value(&'a mut f64),
    Flag(&'a mut bool),
}

/// An optimizer's state for one parameter.
pub(crate) trait ParamState<O>: Sized {
    /// Every name a state entry may have.
    const NAMES: &'static [&'static str];
    /// The entries to save, as tensors on the parameter's device.
    fn entries(&self, shape: &Shape, device: &Device) -> Result<Vec<(&'static str, Tensor)>>;
    /// The state from the entries a state dict has for one parameter (`take(name)` removes one;
    /// `key(name)` is its state dict key, for messages), moved to `param`'s device and dtype. Fails
    /// if a needed entry is missing, has the wrong shape, or is invalid.
    fn from_entries(
        take: &mut dyn FnMut(&'static str) -> Option<Tensor>,
        key: &dyn Fn(&str) -> String,
        options: &O,
        param: &Param,
    ) -> Result<Self>;
}

/// A state buffer the size of its parameter: a tensor on the parameter's device, or, for the
/// fused CPU float32 update, the values in a plain vector (read and written in place).
#[derive(Clone, Debug)]
pub(crate) enum Buf {
    Tensor(Tensor),
    Host(Vec<f32>),
}

impl Buf {
    /// The buffer as a tensor of `shape` on `device`.
    pub(crate) fn tensor(&self, shape: &Shape, device: &Device) -> Result<Tensor> {
        Ok(match self {
            Buf::Tensor(t) => t.to_device(device)?,
            Buf::Host(v) => Tensor::from_slice(v, shape, &Device::Cpu)?.to_device(device)?,
        })
    }

    /// The buffer's values as a mutable vector (converting a tensor once).
    pub(crate) fn host(&mut self) -> Result<&mut Vec<f32>> {
        if let Buf::Tensor(t) = self {
            *self = Buf::Host(t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?);
        }
        match self {
            Buf::Host(v) => Ok(v),
            Buf::Tensor(_) => unreachable!("converted above"),
        }
    }
}

/// Checks a state tensor against its parameter and moves it to the parameter's device and state
/// dtype (PyTorch's `load_state_dict` casts floating state to the parameter's dtype; here float16
/// and bfloat16 parameters keep float32 state, see `fused::state_dtype`).
pub(crate) fn param_like(t: Tensor, key: &str, param: &Param) -> Result<Tensor> {
    if t.shape() != &param.shape() {
        return Err(StateError::ShapeMismatch {
            key: key.to_owned(),
            expected: param.shape(),
            found: t.shape().clone(),
        }
        .into());
    }
    if !t.dtype().is_float() {
        return Err(StateError::InvalidValue {
            key: key.to_owned(),
            reason: format!("a {:?} tensor, not a floating-point one", t.dtype()),
        }
        .into());
    }
    let dtype = crate::fused::state_dtype(param.dtype());
    Ok(t.to_device(&param.device())?.to_dtype(dtype)?)
}

/// The value of a 0-dimensional tensor, as `f64`.
pub(crate) fn scalar(t: &Tensor, key: &str) -> Result<f64> {
    if t.rank() != 0 {
        return Err(StateError::InvalidValue {
            key: key.to_owned(),
            reason: format!("a tensor of shape {:?}, not a 0-dimensional one", t.dims()),
        }
        .into());
    }
    Ok(t.to_dtype(DType::F64)?.to_scalar::<f64>()?)
}

/// What a load found wrong, collected so that one error reports it all.
#[derive(Default)]
struct Problems {
    missing: Vec<String>,
    unexpected: Vec<String>,
    other: Vec<StateError>,
}

impl Problems {
    fn push(&mut self, e: StateError) {
        match e {
            StateError::MissingKeys { keys } => self.missing.extend(keys),
            StateError::UnexpectedKeys { keys } => self.unexpected.extend(keys),
            e => self.other.push(e),
        }
    }

    /// Collects a state problem; any other error (candle's) is returned as it is.
    fn add(&mut self, e: Error) -> Result<()> {
        match e {
            Error::State(e) => {
                self.push(e);
                Ok(())
            }
            e => Err(e),
        }
    }

    /// Nothing, one problem as its own variant, or all of them as `Mismatches`.
    fn into_result(self) -> Result<()> {
        let mut all = self.other;
        if !self.missing.is_empty() {
            all.push(StateError::MissingKeys { keys: self.missing });
        }
        if !self.unexpected.is_empty() {
            all.push(StateError::UnexpectedKeys {
                keys: self.unexpected,
            });
        }
        match all.len() {
            0 => Ok(()),
            1 => Err(all.remove(0).into()),
            _ => Err(StateError::Mismatches { problems: all }.into()),
        }
    }
}

/// An optimizer's groups and the state of each of their parameters, in the groups' order.
pub(crate) struct Core<O, S> {
    pub(crate) groups: Vec<ParamGroup<O>>,
    pub(crate) state: Vec<Vec<Option<S>>>,
}

impl<O: Hyper, S: ParamState<O>> Core<O, S> {
    pub(crate) fn new(
        params: &(impl NamedParams + ?Sized),
        defaults: O,
        groups: &ParamGroups,
    ) -> Result<Self> {
        defaults.validate(None)?;
        let resolved = groups.resolve(params.named_params())?;
        let mut out = Vec::with_capacity(resolved.len());
        for (i, g) in resolved.into_iter().enumerate() {
            let mut options = defaults.clone();
            options.apply(&g.options, i)?;
            options.validate(Some(i))?;
            out.push(ParamGroup {
                options,
                params: g.params,
            });
        }
        let state = out
            .iter()
            .map(|g| g.params.iter().map(|_| None).collect())
            .collect();
        Ok(Self { groups: out, state })
    }

    /// Calls `f` with every trained parameter that has a gradient in `grads` (a parameter without
    /// one is skipped, as PyTorch skips `p.grad is None`): its group's options, its variable, the
    /// gradient and its state slot. The loop of every optimizer's `step`.
    pub(crate) fn each_with_grad(
        &mut self,
        grads: &GradStore,
        mut f: impl FnMut(&O, &Var, &Tensor, &mut Option<S>) -> Result<()>,
    ) -> Result<()> {
        for (group, states) in self.groups.iter().zip(self.state.iter_mut()) {
            for ((_, param), state) in group.params.iter().zip(states.iter_mut()) {
                let var = param.var()?;
                let Some(g) = grads.get(var.as_tensor()) else {
                    continue;
                };
                f(&group.options, &var, g, state)?;
            }
        }
        Ok(())
    }

    pub(crate) fn num_param_groups(&self) -> usize {
        self.groups.len()
    }

    pub(crate) fn lr(&self, group: usize) -> f64 {
        self.groups[group].options.get("lr")
    }

    pub(crate) fn set_lr(&mut self, group: usize, lr: f64) {
        self.groups[group].options.set("lr", lr);
    }

    pub(crate) fn group_params(&self, group: usize) -> &[(String, Param)] {
        &self.groups[group].params
    }

    pub(crate) fn state_dict(&self) -> Result<StateDict> {
        let mut sd = StateDict::new();
        for (g, (group, states)) in self.groups.iter().zip(&self.state).enumerate() {
            for ((path, param), state) in group.params.iter().zip(states) {
                let Some(state) = state else { continue };
                for (name, t) in state.entries(&param.shape(), &param.device())? {
                    sd.insert(format!("state.{path}.{name}"), t);
                }
            }
            for name in O::NAMES {
                let value = Tensor::new(group.options.get(name), &Device::Cpu)?;
                sd.insert(format!("param_groups.{g}.{name}"), value);
            }
        }
        for (g, group) in self.groups.iter().enumerate() {
            for (path, _) in &group.params {
                sd.insert(
                    format!("params.{path}"),
                    Tensor::new(g as u32, &Device::Cpu)?,
                );
            }
        }
        Ok(sd)
    }

    pub(crate) fn load_state_dict(&mut self, sd: &StateDict) -> Result<()> {
        // Everything is checked and built aside, then swapped in: a failure changes nothing.
        // Every problem is collected, so one error reports them all (`StateError::Mismatches`).
        let mut problems = Problems::default();
        let mut used: HashSet<String> = HashSet::new();
        let found_groups = sd
            .keys()
            .filter_map(|k| k.strip_prefix("param_groups."))
            .filter_map(|k| k.split('.').next()?.parse::<usize>().ok())
            .map(|g| g + 1)
            .max()
            .unwrap_or(0);
        let group_count_differs = found_groups != self.groups.len();
        if group_count_differs {
            problems.push(StateError::GroupCount {
                expected: self.groups.len(),
                found: found_groups,
            });
        }
        let mut options = Vec::with_capacity(self.groups.len());
        for (g, group) in self.groups.iter().enumerate() {
            let mut o = group.options.clone();
            for name in O::NAMES {
                let key = format!("param_groups.{g}.{name}");
                match sd.get(&key) {
                    Some(t) => {
                        used.insert(key.clone());
                        match scalar(t, &key) {
                            Ok(v) => o.set(name, v),
                            Err(e) => problems.add(e)?,
                        }
                    }
                    // A group the state dict does not have is the group count's problem.
                    None if g < found_groups => problems.missing.push(key),
                    None => {}
                }
            }
            options.push(o);
        }
        for (g, group) in self.groups.iter().enumerate() {
            for (path, _) in &group.params {
                let key = format!("params.{path}");
                match sd.get(&key) {
                    Some(t) => {
                        used.insert(key.clone());
                        match scalar(t, &key) {
                            Ok(found) if found != g as f64 && !group_count_differs => problems
                                .push(StateError::GroupMismatch {
                                    path: path.clone(),
                                    expected: g,
                                    found: found as usize,
                                }),
                            Ok(_) => {}
                            Err(e) => problems.add(e)?,
                        }
                    }
                    None => problems.missing.push(key),
                }
            }
        }
        for (g, o) in options.iter().enumerate() {
            if let Err(e) = o.validate(Some(g)) {
                problems.add(match e {
                    Error::InvalidHyperparameter {
                        name,
                        value,
                        reason,
                        ..
                    } => Error::State(StateError::InvalidValue {
                        key: format!("param_groups.{g}.{name}"),
                        reason: format!("{value} is out of range: {reason}"),
                    }),
                    e => e,
                })?;
            }
        }
        let mut state = Vec::with_capacity(self.groups.len());
        for (group, o) in self.groups.iter().zip(&options) {
            let mut states = Vec::with_capacity(group.params.len());
            for (path, param) in &group.params {
                let key = |name: &str| format!("state.{path}.{name}");
                if !S::NAMES.iter().any(|name| sd.contains_key(&key(name))) {
                    states.push(None);
                    continue;
                }
                let mut take = |name: &'static str| {
                    let k = key(name);
                    let t = sd.get(&k)?.clone();
                    used.insert(k);
                    Some(t)
                };
                match S::from_entries(&mut take, &key, o, param) {
                    Ok(s) => states.push(Some(s)),
                    Err(e) => {
                        problems.add(e)?;
                        states.push(None);
                    }
                }
            }
            state.push(states);
        }
        problems.unexpected = sd
            .keys()
            .filter(|k| !used.contains(*k))
            // Another group count: its extra groups' keys are that problem.
            .filter(|k| !(group_count_differs && k.starts_with("param_groups.")))
            .map(str::to_owned)
            .collect();
        problems.into_result()?;
        for (group, o) in self.groups.iter_mut().zip(options) {
            group.options = o;
        }
        self.state = state;
        Ok(())
    }
}
