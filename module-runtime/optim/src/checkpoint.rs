//! [`TrainingCheckpoint`]: a whole training run's state in one file, saved atomically and restored
//! all or nothing (PyTorch's `torch.save({"model": …, "optimizer": …, …}, path)` habit).

use std::collections::BTreeMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use module_core::{get_rng_state, set_rng_state, Module};
use module_hooks::ModuleExt;
use module_state::{LoadOptions, StateDict};

use crate::error::{Error, Result, StateError};
use crate::grad_scaler::GradScaler;
use crate::optimizer::Optimizer;
use crate::schedule::LrScheduler;

/// The progress of a run, what Hugging Face's Trainer keeps in `trainer_state.json`: the epoch, the
/// optimizer step, and any number of scalars of your own (the best validation loss, a patience
/// counter), saved as `f64`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct TrainerState {
    /// The epochs completed.
    pub epoch: usize,
    /// The optimizer steps taken (Trainer's `global_step`).
    pub global_step: usize,
    /// Your own values, by name (a name is one path segment: no `.`).
    pub values: BTreeMap<String, f64>,
}

/// A training run's whole state in one safetensors file: the model, each optimizer and its
/// learning-rate schedule, a [`TrainerState`] (epoch, step, your scalars) and the runtime's random
/// generator ([`get_rng_state`](module_core::get_rng_state)). [`save`](Self::save) writes it in one
/// call, [`load`](Self::load) restores all of it in one call: a run saved, restored in a fresh
/// process and continued ends with the weights of the uninterrupted run, bit for bit, dropout
/// included.
///
/// Make one over the parts as they are at the start of the run, when saving or restoring:
/// `TrainingCheckpoint::new(&model).optimizer(&mut opt).scheduler(&mut schedule)`. Several
/// optimizers (a GAN's two) are added in turn, each followed by its schedule, if any.
///
/// **Atomic.** The file is written by [`StateDict::save_safetensors`]: beside the target under a
/// temporary name, flushed to disk, then renamed over it. A save killed at any moment leaves the
/// previous checkpoint whole at `path` (or none, if there was none), never a half-written one.
///
/// **All or nothing.** [`load`](Self::load) reads and checks the whole file first, then loads
/// each part strictly (the model as `load_state_dict` does, the optimizers' and schedules' state
/// dicts); if any part does not fit, the parts already loaded are put back as they were and the
/// error ([`Error::Checkpoint`]) names the part. The generator is set last. Putting back takes a
/// copy of the model's and the optimizers' state while the load runs, so the model must be built:
/// a `Lazy` layer is built first (a call or a `build` dry run), as the optimizer needs anyway.
///
/// **Format.** One safetensors file whose keys are each part's state dict under a prefix:
/// `model.<key>` (the model's state dict), `optimizer.<key>` (the first optimizer's
/// [`state_dict`](Optimizer::state_dict)), `scheduler.<key>` (its schedule's), then
/// `optimizer_1.…`, `scheduler_1.…` for a second optimizer; `grad_scaler.<key>` (a
/// [`GradScaler`]'s state, PyTorch's keys); `trainer_state.epoch`,
/// `trainer_state.global_step` and `trainer_state.<name>` (0-dimensional `f64`); `rng_state` (the
/// generator's `U8` state). Any safetensors reader lists it; `StateDict::read` and the prefix give
/// each part back.
///
/// ```
/// use module_runtime::nn::Dropout;
/// use module_runtime::optim::{TrainerState, TrainingCheckpoint};
/// use module_runtime::prelude::*;
///
/// let dev = Device::Cpu;
/// let model = Linear::new(4, 2, &dev)?;
/// let mut opt = AdamW::new(&model, AdamW::options().lr(1e-2))?;
/// let mut schedule = LambdaLr::linear_with_warmup(&mut opt, 2, 10);
/// let path = std::env::temp_dir().join(format!("run-{}.safetensors", std::process::id()));
/// let mut state = TrainerState { epoch: 1, global_step: 3, ..Default::default() };
/// state.values.insert("best_loss".into(), 0.25);
/// TrainingCheckpoint::new(&model)
///     .optimizer(&mut opt)
///     .scheduler(&mut schedule)
///     .save(&path, &state)?;
///
/// // Later, or in another process: the parts made as at the start of the run, then restored.
/// let model2 = Linear::new(4, 2, &dev)?;
/// let mut opt2 = AdamW::new(&model2, AdamW::options().lr(1e-2))?;
/// let mut schedule2 = LambdaLr::linear_with_warmup(&mut opt2, 2, 10);
/// let restored = TrainingCheckpoint::new(&model2)
///     .optimizer(&mut opt2)
///     .scheduler(&mut schedule2)
///     .load(&path)?;
/// assert_eq!(restored, state);
/// assert_eq!(model2.weight.tensor()?.to_vec2::<f32>()?, model.weight.tensor()?.to_vec2::<f32>()?);
/// # std::fs::remove_file(&path)?;
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub struct TrainingCheckpoint<'a> {
    model: &'a dyn Module,
    optimizers: Vec<Part<'a>>,
    grad_scaler: Option<&'a mut GradScaler>,
    /// A schedule given before any optimizer: reported by `save` and `load`.
    orphan_scheduler: bool,
}

/// One optimizer and its schedule.
struct Part<'a> {
    optimizer: &'a mut dyn Optimizer,
    scheduler: Option<&'a mut dyn LrScheduler>,
}

const MODEL: &str = "model";
const SCALER: &str = "grad_scaler";
const TRAINER: &str = "trainer_state";
const RNG: &str = "rng_state";

/// The key prefix of optimizer `i` (`optimizer`, `optimizer_1`, …) or its schedule.
fn part_name(what: &str, i: usize) -> String {
    if i == 0 {
        what.to_owned()
    } else {
        format!("{what}_{i}")
    }
}

impl<'a> TrainingCheckpoint<'a> {
    /// A checkpoint of `model` (its state dict: parameters, persistent buffers, extra state).
    pub fn new(model: &'a dyn Module) -> Self {
        Self {
            model,
            optimizers: Vec::new(),
            grad_scaler: None,
            orphan_scheduler: false,
        }
    }

    /// Adds an optimizer (saved under `optimizer`, then `optimizer_1`, …).
    pub fn optimizer(mut self, optimizer: &'a mut dyn Optimizer) -> Self {
        self.optimizers.push(Part {
            optimizer,
            scheduler: None,
        });
        self
    }

    /// Adds the learning-rate schedule of the optimizer added last (saved under `scheduler`,
    /// `scheduler_1`, … as its optimizer). A schedule with no optimizer before it, or a second
    /// one for the same optimizer, makes `save` and `load` fail.
    pub fn scheduler(mut self, scheduler: &'a mut dyn LrScheduler) -> Self {
        match self.optimizers.last_mut() {
            Some(part) if part.scheduler.is_none() => part.scheduler = Some(scheduler),
            _ => self.orphan_scheduler = true,
        }
        self
    }

    /// Adds the run's [`GradScaler`] (saved under `grad_scaler`, its
    /// [`state_dict`](GradScaler::state_dict) with PyTorch's keys).
    pub fn grad_scaler(mut self, scaler: &'a mut GradScaler) -> Self {
        self.grad_scaler = Some(scaler);
        self
    }

    fn check_parts(&self, path: &Path, restoring: bool) -> Result<()> {
        if self.orphan_scheduler {
            return Err(Error::Checkpoint {
                path: path.to_owned(),
                part: "scheduler".into(),
                restoring,
                source: Box::new(
                    StateError::InvalidValue {
                        key: "scheduler".into(),
                        reason: "a schedule was added before any optimizer, or twice for one \
                                 optimizer: add each optimizer, then its schedule"
                            .into(),
                    }
                    .into(),
                ),
            });
        }
        Ok(())
    }

    /// Saves every part and `state` to `path` in one safetensors file, atomically (see the
    /// [type](Self)'s documentation).
    pub fn save(&self, path: impl AsRef<Path>, state: &TrainerState) -> Result<()> {
        let path = path.as_ref();
        self.check_parts(path, false)?;
        let mut all = StateDict::new();
        let mut add = |prefix: &str, sd: StateDict| {
            for (key, t) in sd.iter() {
                all.insert(format!("{prefix}.{key}"), t.clone());
            }
        };
        add(MODEL, self.model.state_dict()?);
        for (i, part) in self.optimizers.iter().enumerate() {
            add(&part_name("optimizer", i), part.optimizer.state_dict()?);
            if let Some(s) = &part.scheduler {
                add(&part_name("scheduler", i), s.state_dict()?);
            }
        }
        if let Some(scaler) = &self.grad_scaler {
            add(SCALER, scaler.state_dict()?);
        }
        add(TRAINER, trainer_state_dict(state)?);
        all.insert(RNG, get_rng_state()?);
        all.save_safetensors(path)?;
        Ok(())
    }

    /// Restores every part from a file [`save`](Self::save) wrote, all or nothing, and returns its
    /// [`TrainerState`]. The file must hold exactly the parts this checkpoint has (the same
    /// number of optimizers, a schedule where this one has one); each part must fit as its own
    /// strict load requires. On any error nothing was changed: the model, the optimizers, the
    /// schedules and the generator are as they were.
    pub fn load(mut self, path: impl AsRef<Path>) -> Result<TrainerState> {
        let path = path.as_ref();
        let at = |part: &str, e: Error| Error::Checkpoint {
            path: path.to_owned(),
            part: part.to_owned(),
            restoring: true,
            source: Box::new(e),
        };
        self.check_parts(path, true)?;
        let file =
            StateDict::read(path, &LoadOptions::default()).map_err(|e| at("file", e.into()))?;
        let mut parts = split_parts(&file);
        // Which parts there must be, and nothing else.
        let mut expected = vec![MODEL.to_owned(), TRAINER.to_owned(), RNG.to_owned()];
        for (i, part) in self.optimizers.iter().enumerate() {
            expected.push(part_name("optimizer", i));
            if part.scheduler.is_some() {
                expected.push(part_name("scheduler", i));
            }
        }
        // A disabled scaler saves an empty state, so no key.
        let scaler_saved = self.grad_scaler.as_ref().is_some_and(|s| s.is_enabled());
        if scaler_saved {
            expected.push(SCALER.to_owned());
        }
        let unexpected: Vec<String> = parts
            .keys()
            .filter(|p| !expected.contains(p))
            .map(|p| format!("{p}.*"))
            .collect();
        if !unexpected.is_empty() {
            return Err(at(
                "parts",
                StateError::UnexpectedKeys { keys: unexpected }.into(),
            ));
        }
        let missing: Vec<String> = expected
            .iter()
            .filter(|p| *p != MODEL && !parts.contains_key(*p))
            .map(|p| format!("{p}.*"))
            .collect();
        if !missing.is_empty() {
            return Err(at(
                "parts",
                StateError::MissingKeys { keys: missing }.into(),
            ));
        }
        let state = read_trainer_state(&parts[TRAINER]).map_err(|e| at(TRAINER, e))?;
        let rng = parts[RNG].get("").cloned().expect("checked above");
        check_rng(&rng).map_err(|e| at(RNG, e))?;
        // The scaler's state is checked on a copy first: its load is the last before the
        // generator's, and must not fail after the others changed.
        if let (Some(scaler), true) = (&self.grad_scaler, scaler_saved) {
            let mut probe = (**scaler).clone();
            probe
                .load_state_dict(&parts[SCALER])
                .map_err(|e| at(SCALER, e))?;
        }

        // What to put back if a part does not fit: copies, as loads write in place.
        let before = Snapshot::take(&self).map_err(|e| at("snapshot", e))?;
        let model_sd = parts.remove(MODEL).unwrap_or_default();
        self.model
            .load_state_dict(&model_sd, &LoadOptions::default())
            .map_err(|e| at(MODEL, e.into()))?;
        for i in 0..self.optimizers.len() {
            if let Err(e) = load_part(&mut self.optimizers[i], i, &parts, at) {
                before.put_back(&mut self, i);
                return Err(e);
            }
        }
        if let (Some(scaler), true) = (self.grad_scaler.as_deref_mut(), scaler_saved) {
            scaler
                .load_state_dict(&parts[SCALER])
                .map_err(|e| at(SCALER, e))?;
        }
        set_rng_state(&rng).map_err(|e| at(RNG, e.into()))?;
        Ok(state)
    }
}

/// Loads optimizer `i` and its schedule; on failure, the error names the part that did not fit.
fn load_part(
    part: &mut Part<'_>,
    i: usize,
    parts: &BTreeMap<String, StateDict>,
    at: impl Fn(&str, Error) -> Error,
) -> Result<()> {
    let name = part_name("optimizer", i);
    part.optimizer
        .load_state_dict(&parts[&name])
        .map_err(|e| at(&name, e))?;
    if let Some(s) = part.scheduler.as_deref_mut() {
        let name = part_name("scheduler", i);
        s.load_state_dict(&parts[&name], part.optimizer)
            .map_err(|e| at(&name, e))?;
    }
    Ok(())
}

/// The file's keys by part (the prefix before the first `.`); `rng_state` is its own part, with
/// the key `""`.
fn split_parts(file: &StateDict) -> BTreeMap<String, StateDict> {
    let mut parts: BTreeMap<String, StateDict> = BTreeMap::new();
    for (key, t) in file.iter() {
        let (part, rest) = key.split_once('.').unwrap_or((key, ""));
        parts
            .entry(part.to_owned())
            .or_default()
            .insert(rest, t.clone());
    }
    parts
}

fn trainer_state_dict(state: &TrainerState) -> Result<StateDict> {
    let mut sd = StateDict::new();
    let scalar = |v: f64| Tensor::new(v, &Device::Cpu);
    sd.insert("epoch", scalar(state.epoch as f64)?);
    sd.insert("global_step", scalar(state.global_step as f64)?);
    for (name, &v) in &state.values {
        if name.is_empty() || name.contains('.') || name == "epoch" || name == "global_step" {
            return Err(StateError::InvalidValue {
                key: format!("{TRAINER}.{name}"),
                reason: "a value's name is one path segment (no `.`), other than `epoch` and \
                         `global_step`"
                    .into(),
            }
            .into());
        }
        sd.insert(name.clone(), scalar(v)?);
    }
    Ok(sd)
}

fn read_trainer_state(sd: &StateDict) -> Result<TrainerState> {
    let mut state = TrainerState::default();
    let count = |key: &str| -> Result<usize> {
        let t = sd.get(key).ok_or_else(|| StateError::MissingKeys {
            keys: vec![format!("{TRAINER}.{key}")],
        })?;
        let v = crate::state::scalar(t, key)?;
        if !(v >= 0.0 && v.fract() == 0.0) {
            return Err(StateError::InvalidValue {
                key: format!("{TRAINER}.{key}"),
                reason: format!("{v} is not a count"),
            }
            .into());
        }
        Ok(v as usize)
    };
    state.epoch = count("epoch")?;
    state.global_step = count("global_step")?;
    for (key, t) in sd.iter() {
        if key != "epoch" && key != "global_step" {
            let v = crate::state::scalar(t, key)?;
            state.values.insert(key.to_owned(), v);
        }
    }
    Ok(state)
}

fn check_rng(t: &Tensor) -> Result<()> {
    if t.dtype() != DType::U8 || t.dims() != [module_core::random::RNG_STATE_LEN] {
        return Err(StateError::InvalidValue {
            key: RNG.into(),
            reason: format!(
                "{:?} {:?}, not the generator's U8 state of {} bytes",
                t.dtype(),
                t.dims(),
                module_core::random::RNG_STATE_LEN
            ),
        }
        .into());
    }
    Ok(())
}

/// Copies of what a load changes, to put back if a later part does not fit.
struct Snapshot {
    model: StateDict,
    optimizers: Vec<(StateDict, Option<StateDict>)>,
}

fn deep_copy(sd: StateDict) -> Result<StateDict> {
    sd.iter()
        .map(|(k, t)| Ok((k.to_owned(), t.copy()?)))
        .collect()
}

impl Snapshot {
    fn take(c: &TrainingCheckpoint<'_>) -> Result<Self> {
        let model = deep_copy(c.model.state_dict()?)?;
        let optimizers = c
            .optimizers
            .iter()
            .map(|p| {
                let s = p.scheduler.as_ref().map(|s| s.state_dict()).transpose()?;
                Ok((deep_copy(p.optimizer.state_dict()?)?, s))
            })
            .collect::<Result<_>>()?;
        Ok(Self { model, optimizers })
    }

    /// Puts back the model and optimizers `0..=last` (with their schedules) as they were. Each
    /// is its own state, so each load succeeds.
    fn put_back(&self, c: &mut TrainingCheckpoint<'_>, last: usize) {
        let _ = c
            .model
            .load_state_dict(&self.model, &LoadOptions::default());
        for (part, (opt, sched)) in c.optimizers.iter_mut().zip(&self.optimizers).take(last + 1) {
            let _ = part.optimizer.load_state_dict(opt);
            if let (Some(s), Some(sd)) = (part.scheduler.as_deref_mut(), sched) {
                let _ = s.load_state_dict(sd, part.optimizer);
            }
        }
    }
}
