//! PEFT's `modules_to_save` (its `ModulesToSaveWrapper`): a trainable copy of a whole layer per
//! adapter, used instead of the layer while that adapter is active, saved in the adapter's file.
//!
//! As with LoRA, the copies live in a slot of the layer ([`ModulesToSave`]): the layer itself is
//! PEFT's `original_module` and keeps its paths (`head.weight`), the copy is
//! `head.modules_to_save.<adapter>.weight`. The layer types with the slot are `Linear`,
//! `Embedding`, `Conv1d`, `Conv2d`, `Conv3d` and `LayerNorm`.

use std::sync::Mutex;

use candle_core::Tensor;

use crate::container::ModuleDict;
use crate::conv::{Conv1d, Conv2d, Conv3d};
use crate::embedding::Embedding;
use crate::error::Result;
use crate::layer_norm::LayerNorm;
use crate::linear::Linear;
use crate::peft::config::LoraConfig;
use crate::{Module, ModuleExt, Param};
use module_core::PeftError;

/// A copy of a layer that `modules_to_save` trains: the layer types that hold the slot.
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub(crate) enum SavedModule {
    Linear(Linear),
    Embedding(Embedding),
    Conv1d(Conv1d),
    Conv2d(Conv2d),
    Conv3d(Conv3d),
    LayerNorm(LayerNorm),
}

/// `p`'s values in a parameter of their own.
fn fresh(p: &Param) -> Result<Param> {
    Param::new(p.tensor()?.detach().copy()?)
}

fn fresh_opt(p: &Option<Param>) -> Result<Option<Param>> {
    p.as_ref().map(fresh).transpose()
}

impl SavedModule {
    /// A copy of `m` with parameters of its own (PEFT's `copy.deepcopy(original_module)`), if
    /// `m` is a layer that holds the slot; its adapters and copies are not copied.
    pub(crate) fn copy_of(m: &dyn Module) -> Option<Result<Self>> {
        let copy = || -> Option<Result<Self>> {
            if let Some(l) = m.downcast_ref::<Linear>() {
                let copy = fresh(&l.weight).and_then(|w| Ok((w, fresh_opt(&l.bias)?)));
                return Some(copy.map(|(w, b)| Self::Linear(Linear::from_params(w, b))));
            }
            if let Some(e) = m.downcast_ref::<Embedding>() {
                let mut e = e.clone();
                e.lora = None;
                e.modules_to_save = None;
                return Some(fresh(&e.weight).map(|w| {
                    e.weight = w;
                    Self::Embedding(e)
                }));
            }
            macro_rules! conv {
                ($ty:ty, $variant:ident) => {
                    if let Some(c) = m.downcast_ref::<$ty>() {
                        let mut c = c.clone();
                        c.lora = None;
                        c.modules_to_save = None;
                        let copy = fresh(&c.weight).and_then(|w| Ok((w, fresh_opt(&c.bias)?)));
                        return Some(copy.map(|(w, b)| {
                            (c.weight, c.bias) = (w, b);
                            Self::$variant(c)
                        }));
                    }
                };
            }
            conv!(Conv1d, Conv1d);
            conv!(Conv2d, Conv2d);
            conv!(Conv3d, Conv3d);
            if let Some(n) = m.downcast_ref::<LayerNorm>() {
                let mut n = n.clone();
                n.modules_to_save = None;
                let copy = fresh_opt(&n.weight).and_then(|w| Ok((w, fresh_opt(&n.bias)?)));
                return Some(copy.map(|(w, b)| {
                    (n.weight, n.bias) = (w, b);
                    Self::LayerNorm(n)
                }));
            }
            None
        };
        copy()
    }

    /// The copy's forward, through its `call` (hooks on its path see it).
    pub(crate) fn apply(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Linear(m) => m.call(x),
            Self::Embedding(m) => m.call(x),
            Self::Conv1d(m) => m.call(x),
            Self::Conv2d(m) => m.call(x),
            Self::Conv3d(m) => m.call(x),
            Self::LayerNorm(m) => m.call(x),
        }
    }
}

/// Which copy is used: the active adapter's, unless disabled.
#[derive(Debug, Default, Clone)]
struct SavedState {
    active: Option<String>,
    disabled: bool,
}

/// The `modules_to_save` copies a layer holds, by adapter name (PEFT's
/// `ModulesToSaveWrapper.modules_to_save`): `<path>.modules_to_save.<adapter>.weight`, … While an
/// adapter that has a copy here is active, the layer's forward is the copy's; otherwise, or
/// inside [`disable_adapter`](crate::peft::PeftExt::disable_adapter), the layer's own.
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct ModulesToSave {
    pub(crate) modules_to_save: ModuleDict<SavedModule>,
    #[module(skip)]
    state: Mutex<SavedState>,
}

impl Clone for ModulesToSave {
    fn clone(&self) -> Self {
        Self {
            modules_to_save: self.modules_to_save.clone(),
            state: Mutex::new(self.lock().clone()),
        }
    }
}

impl ModulesToSave {
    pub(crate) fn new() -> Self {
        Self {
            modules_to_save: ModuleDict::new(),
            state: Mutex::new(SavedState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, SavedState> {
        // A panic while the lock was held left plain data behind: use it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds the copy for the adapter `name`; the first becomes the active one.
    pub(crate) fn add(&mut self, name: &str, copy: SavedModule) -> Result<()> {
        self.modules_to_save.insert(name.to_owned(), copy)?;
        self.lock().active.get_or_insert_with(|| name.to_owned());
        Ok(())
    }

    /// Removes the copy of the adapter `name`; `true` when none is left.
    pub(crate) fn remove(&mut self, name: &str) -> bool {
        self.modules_to_save.remove(name);
        let first = self.modules_to_save.keys().next().map(str::to_owned);
        let mut state = self.lock();
        if state.active.as_deref() == Some(name) {
            state.active = first;
        }
        self.modules_to_save.is_empty()
    }

    /// The adapters with a copy here, in the order they were added.
    pub fn adapter_names(&self) -> Vec<String> {
        self.modules_to_save.keys().map(str::to_owned).collect()
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.modules_to_save.get(name).is_some()
    }

    /// The adapter whose copy the forward uses, if it has one here.
    pub fn active_adapter(&self) -> Option<String> {
        self.lock().active.clone()
    }

    pub(crate) fn set_active(&self, name: &str) {
        self.lock().active = Some(name.to_owned());
    }

    pub(crate) fn set_disabled(&self, disabled: bool) -> bool {
        std::mem::replace(&mut self.lock().disabled, disabled)
    }

    /// The copy the forward uses now: the active adapter's, unless disabled or absent.
    pub(crate) fn current(&self) -> Option<&SavedModule> {
        let state = self.lock();
        if state.disabled {
            return None;
        }
        let active = state.active.clone()?;
        drop(state);
        self.modules_to_save.get(&active)
    }

    /// PEFT's `print(model)` body of the wrapper: `(original_module): <layer>`, then the copies.
    pub(crate) fn wrapped_repr(&self, original: &str) -> String {
        let mut lines = Vec::new();
        self.modules_to_save.visit_children(&mut |name, child| {
            if let module_core::Child::Module { module, .. } = child {
                lines.push(format!("({name}): {}", module_core::module_repr(module)));
            }
        });
        let copies = match lines.is_empty() {
            true => "(modules_to_save): ModuleDict()".to_owned(),
            false => format!(
                "(modules_to_save): ModuleDict(\n  {}\n)",
                lines.join("\n").replace('\n', "\n  ")
            ),
        };
        format!("(original_module): {original}\n{copies}")
    }
}

/// The forward of a layer with the slot `saved`: the active copy's, if there is one.
pub(crate) fn saved_forward(
    saved: &Option<Box<ModulesToSave>>,
    x: &Tensor,
) -> Option<Result<Tensor>> {
    saved.as_ref()?.current().map(|copy| copy.apply(x))
}

/// The `modules_to_save` slot of `m`, if its type holds one.
pub(crate) fn saved_of(m: &dyn Module) -> Option<&Option<Box<ModulesToSave>>> {
    if let Some(l) = m.downcast_ref::<Linear>() {
        return Some(&l.modules_to_save);
    }
    if let Some(e) = m.downcast_ref::<Embedding>() {
        return Some(&e.modules_to_save);
    }
    if let Some(c) = m.downcast_ref::<Conv1d>() {
        return Some(&c.modules_to_save);
    }
    if let Some(c) = m.downcast_ref::<Conv2d>() {
        return Some(&c.modules_to_save);
    }
    if let Some(c) = m.downcast_ref::<Conv3d>() {
        return Some(&c.modules_to_save);
    }
    m.downcast_ref::<LayerNorm>().map(|n| &n.modules_to_save)
}

/// The `modules_to_save` slot of `m`, mutably, if its type holds one.
pub(crate) fn saved_slot_mut(m: &mut dyn Module) -> Option<&mut Option<Box<ModulesToSave>>> {
    if m.is::<Linear>() {
        return m.downcast_mut::<Linear>().map(|l| &mut l.modules_to_save);
    }
    if m.is::<Embedding>() {
        return m
            .downcast_mut::<Embedding>()
            .map(|e| &mut e.modules_to_save);
    }
    if m.is::<Conv1d>() {
        return m.downcast_mut::<Conv1d>().map(|c| &mut c.modules_to_save);
    }
    if m.is::<Conv2d>() {
        return m.downcast_mut::<Conv2d>().map(|c| &mut c.modules_to_save);
    }
    if m.is::<Conv3d>() {
        return m.downcast_mut::<Conv3d>().map(|c| &mut c.modules_to_save);
    }
    m.downcast_mut::<LayerNorm>()
        .map(|n| &mut n.modules_to_save)
}

/// The parameters of `m` (a layer) whose values the copy replaces on `merge_and_unload`, by
/// their names in the layer (`weight`, `bias`).
pub(crate) fn own_params(m: &dyn Module) -> Vec<(String, Param)> {
    module_core::names::named_parameters(m, &module_core::Names::new())
        .into_iter()
        .filter(|(k, _)| !k.contains('.'))
        .collect()
}

/// Every layer of `model` holding `modules_to_save` copies, by path.
pub(crate) fn saved_layers(model: &dyn Module) -> Vec<(String, &ModulesToSave)> {
    module_core::names::named_modules(model, &module_core::Names::new())
        .into_iter()
        .filter_map(|(path, m)| Some((path, saved_of(m)?.as_deref()?)))
        .collect()
}

/// The copies `config.modules_to_save` asks for, made from `model`'s layers but not added: a
/// module of another type, one that is also a LoRA target (`lora_paths`), a parametrized one,
/// one that already has a copy named `name`, or an entry matching nothing, are typed errors.
pub(crate) fn prepare_saved(
    model: &dyn Module,
    name: &str,
    config: &LoraConfig,
    lora_paths: &[&str],
) -> Result<Vec<(String, SavedModule)>> {
    let Some(entries) = &config.modules_to_save else {
        return Ok(Vec::new());
    };
    let candidates = crate::peft::model::candidates(model);
    let state = |path: &str, message: &str| -> crate::Error {
        PeftError::State {
            path: path.to_owned(),
            message: message.to_owned(),
        }
        .into()
    };
    let mut copies: Vec<(String, SavedModule)> = Vec::new();
    // PEFT's `_set_trainable`: `key.endswith(target_key)`. An entry matching nothing is skipped,
    // as in PEFT (its classifier adapters list both "classifier" and "score"); entries that all
    // match nothing are an error (a typo, or another model's names).
    let matched: Vec<_> = (candidates.iter())
        .filter(|(path, _)| entries.iter().any(|e| path.ends_with(e.as_str())))
        .collect();
    if matched.is_empty() && !entries.is_empty() {
        return Err(PeftError::NoTarget {
            targets: format!("modules_to_save {entries:?}"),
            available: Vec::new(),
        }
        .into());
    }
    for (path, module) in matched {
        let Some(slot) = saved_of(*module) else {
            return Err(PeftError::UnsupportedModuleToSave {
                path: path.clone(),
                found: module.class_name(),
            }
            .into());
        };
        if lora_paths.contains(&path.as_str()) {
            return Err(state(
                path,
                "it is both a LoRA target and in modules_to_save",
            ));
        }
        if slot.as_ref().is_some_and(|s| s.has(name)) {
            return Err(PeftError::AdapterExists {
                path: path.clone(),
                adapter: name.to_owned(),
            }
            .into());
        }
        if own_params(*module).iter().any(|(_, p)| p.is_parametrized()) {
            return Err(state(
                path,
                "it is parametrized (`nn::parametrize`): remove the parametrization first",
            ));
        }
        let copy = SavedModule::copy_of(*module).expect("a layer with the slot")?;
        copies.push((path.clone(), copy));
    }
    Ok(copies)
}

/// Gives `layer` its active copy's values (PEFT's unwrapping keeps the copy), if it has one.
pub(crate) fn take_active_copy(layer: &dyn Module) -> Result<()> {
    let Some(Some(saved)) = saved_of(layer) else {
        return Ok(());
    };
    let Some(copy) = saved
        .active_adapter()
        .and_then(|a| saved.modules_to_save.get(&a))
    else {
        return Ok(());
    };
    let values = own_params(copy);
    for (name, p) in own_params(layer) {
        if let Some((_, v)) = values.iter().find(|(n, _)| *n == name) {
            p.set(&v.tensor()?.detach())?;
        }
    }
    Ok(())
}
