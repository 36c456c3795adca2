//! `get_peft_model` and the methods PEFT's `PeftModel` has, for any model: [`PeftExt`].

use std::sync::Arc;

use crate::error::Result;
use crate::linear::Linear;
use crate::peft::build::{build_adapter, Adapter};
use crate::peft::config::{LoraBias, LoraConfig};
use crate::peft::host::{slot_mut, Host};
use crate::peft::layer::LoraLayer;
use crate::peft::merge::merge_refused;
use crate::peft::saved::{
    prepare_saved, saved_layers, saved_of, saved_slot_mut, ModulesToSave, SavedModule,
};
use crate::{Module, Param};
use module_core::names::{named_modules, named_parameters};
use module_core::{Names, PeftError};

/// The children of an adapted layer that hold an adapter's parameters, by adapter name.
pub(crate) const ADAPTER_DICTS: [&str; 5] = [
    "lora_A",
    "lora_B",
    "lora_embedding_A",
    "lora_embedding_B",
    "lora_magnitude_vector",
];

/// The adapter name PEFT gives the first adapter.
pub const DEFAULT_ADAPTER: &str = "default";

/// Adds a LoRA (or DoRA) adapter named `"default"` to every `Linear` (and `Embedding`) of
/// `model` that `config.target_modules` selects, and freezes everything but the adapter: PEFT's
/// `get_peft_model(model, config)`. Returns the adapted layers' paths, in module order.
///
/// The model keeps its type and its paths: each adapted `Linear` holds its adapter
/// (`<path>.lora_A.default.weight`, `<path>.lora_B.default.weight`, and for DoRA
/// `<path>.lora_magnitude_vector.default.weight`; an `Embedding`'s are
/// `<path>.lora_embedding_A.default` and `<path>.lora_embedding_B.default`), its own `weight`
/// and `bias` stay where they
/// were (a state dict of the base model still loads), hooks on the layer's path still fire, and
/// `print(model)` shows it as PEFT's `lora.Linear`.
///
/// A target that is neither is [`PeftError::UnsupportedLayer`]; targets matching nothing
/// are [`PeftError::NoTarget`]. All or nothing: on an error the model is unchanged.
///
/// ```
/// use module_runtime::prelude::*;
/// use module_runtime::nn::peft::{get_peft_model, LoraConfig, PeftExt, TargetModules};
///
/// #[derive(Module)]
/// struct Attention { q_proj: Linear, v_proj: Linear, o_proj: Linear }
///
/// let dev = Device::Cpu;
/// let mut model = Attention {
///     q_proj: Linear::new(8, 8, &dev)?,
///     v_proj: Linear::new(8, 8, &dev)?,
///     o_proj: Linear::new(8, 8, &dev)?,
/// };
/// let config = LoraConfig { r: 2, ..LoraConfig::new(TargetModules::names(["q_proj", "v_proj"])) };
/// assert_eq!(get_peft_model(&mut model, &config)?, ["q_proj", "v_proj"]);
/// assert!(model.get_parameter("q_proj.lora_A.default.weight").is_ok());
/// assert!(model.get_parameter("q_proj.weight").is_ok()); // the base keeps its path
/// assert_eq!(model.get_nb_trainable_parameters(), (2 * (2 * 8 + 8 * 2), 3 * (64 + 8) + 64));
/// # Ok::<(), module_runtime::Error>(())
/// ```
pub fn get_peft_model<M: PeftExt + ?Sized>(
    model: &mut M,
    config: &LoraConfig,
) -> Result<Vec<String>> {
    model.add_adapter(DEFAULT_ADAPTER, config)
}

/// PEFT's `PeftModel` methods, for every module: adapters added, chosen, merged, disabled,
/// unloaded, saved and loaded by name.
pub trait PeftExt: Module {
    /// Adds the adapter `name` as `config` says (PEFT's `add_adapter`); the first adapter of a
    /// layer is its active one. Freezes every parameter but the active adapters' (and the
    /// biases their `bias` names). Returns the adapted layers' paths.
    fn add_adapter(&mut self, name: &str, config: &LoraConfig) -> Result<Vec<String>> {
        let prepared = prepare(self.peft_dyn(), name, config)?;
        commit(self.peft_dyn_mut(), prepared)
    }

    /// Makes `name` the active adapter (PEFT's `set_adapter`), and it alone trainable; layers
    /// without an adapter of that name add nothing while it is active, as in PEFT.
    fn set_adapter(&self, name: &str) -> Result<()> {
        if !self.adapter_names().iter().any(|n| n == name) {
            return Err(no_adapter(self.peft_dyn(), name));
        }
        // PEFT's rule: a layer without that adapter adds nothing while it is active (and a
        // `modules_to_save` layer without its copy is the original).
        for (_, lora) in lora_layers(self.peft_dyn()) {
            lora.set_active(name);
        }
        for (_, saved) in saved_layers(self.peft_dyn()) {
            saved.set_active(name);
        }
        mark_trainable(self.peft_dyn());
        Ok(())
    }

    /// The adapter names on the model, in the order they were added.
    fn adapter_names(&self) -> Vec<String> {
        let mut names: Vec<String> = Vec::new();
        let layers = lora_layers(self.peft_dyn());
        let lora = layers.iter().flat_map(|(_, l)| l.adapter_names());
        let saved = saved_layers(self.peft_dyn());
        for name in lora.chain(saved.iter().flat_map(|(_, s)| s.adapter_names())) {
            if !names.contains(&name) {
                names.push(name);
            }
        }
        names
    }

    /// Adds each layer's active adapter into its weight (PEFT's `merge_adapter`): the forward is
    /// then the plain layer's. A quantized weight is [`PeftError::State`], before any is merged.
    fn merge_adapter(&self) -> Result<()> {
        let hosts = adapted(self.peft_dyn());
        for (path, host) in &hosts {
            if let Some(message) = merge_refused(host.weight(), host.groups()) {
                return Err(PeftError::State {
                    path: path.clone(),
                    message,
                }
                .into());
            }
        }
        for (path, host) in &hosts {
            let lora = host.lora().expect("an adapted layer");
            if let Some(active) = lora.active_adapter().filter(|a| lora.has(a)) {
                lora.merge(host.weight(), path, &active, host.groups())?;
            }
        }
        Ok(())
    }

    /// Takes the merged adapters back out of the weights (PEFT's `unmerge_adapter`).
    fn unmerge_adapter(&self) -> Result<()> {
        for (_, host) in adapted(self.peft_dyn()) {
            host.lora()
                .expect("an adapted layer")
                .unmerge(host.weight())?;
        }
        Ok(())
    }

    /// Merges the active adapters and removes every adapter: the plain model, with the adapted
    /// weights (PEFT's `merge_and_unload`); a `modules_to_save` layer takes its active copy's
    /// values, as PEFT's unwrapping keeps the copy. Returns the LoRA layers' paths.
    fn merge_and_unload(&mut self) -> Result<Vec<String>> {
        self.merge_adapter()?;
        remove_adapters(self.peft_dyn_mut(), None)
    }

    /// Removes every adapter without merging (merged ones are unmerged first): the base model
    /// (PEFT's `unload`), but for `modules_to_save` layers, which keep their active copy's values
    /// as in PEFT. Returns the LoRA layers' paths.
    fn unload(&mut self) -> Result<Vec<String>> {
        self.unmerge_adapter()?;
        remove_adapters(self.peft_dyn_mut(), None)
    }

    /// Removes the adapter `name` (PEFT's `delete_adapter`); merged adapters are unmerged first.
    fn delete_adapter(&mut self, name: &str) -> Result<()> {
        if !self.adapter_names().iter().any(|n| n == name) {
            return Err(no_adapter(self.peft_dyn(), name));
        }
        self.unmerge_adapter()?;
        remove_adapters(self.peft_dyn_mut(), Some(name))?;
        mark_trainable(self.peft_dyn());
        Ok(())
    }

    /// Runs `f` with every adapter off, the base model's forward (PEFT's
    /// `with model.disable_adapter():`); the adapters are on again afterwards, also when `f`
    /// fails or panics. Merged adapters are unmerged first, as PEFT's forward does.
    fn disable_adapter<T>(&self, f: impl FnOnce() -> T) -> Result<T> {
        self.unmerge_adapter()?;
        let layers = lora_layers(self.peft_dyn());
        let saved = saved_layers(self.peft_dyn());
        let restore: Vec<(&LoraLayer, bool)> = layers
            .iter()
            .map(|(_, lora)| (*lora, lora.set_disabled(true)))
            .collect();
        let restore_saved: Vec<(&ModulesToSave, bool)> = saved
            .iter()
            .map(|(_, s)| (*s, s.set_disabled(true)))
            .collect();
        struct Restore<'a>(Vec<(&'a LoraLayer, bool)>, Vec<(&'a ModulesToSave, bool)>);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                for (lora, was) in &self.0 {
                    lora.set_disabled(*was);
                }
                for (saved, was) in &self.1 {
                    saved.set_disabled(*was);
                }
            }
        }
        let _restore = Restore(restore, restore_saved);
        Ok(f())
    }

    /// Writes every adapter in PEFT's layout (PEFT's `save_pretrained`): the `"default"` adapter
    /// in `dir`, another one in `dir/<name>`, each as `adapter_config.json` and
    /// `adapter_model.safetensors` with PEFT's keys (`base_model.model.<path>.lora_A.weight`).
    /// `PeftModel.from_pretrained(base, dir)` reads it. Returns the folders written.
    fn save_pretrained(&self, dir: impl AsRef<std::path::Path>) -> Result<Vec<std::path::PathBuf>>
    where
        Self: Sized,
    {
        crate::peft::files::save(self.peft_dyn(), dir.as_ref())
    }

    /// Reads a PEFT adapter folder into the model as the adapter `name` (PEFT's
    /// `load_adapter(dir, adapter_name, is_trainable)`; `PeftModel.from_pretrained(base, dir)`
    /// is `load_adapter(dir, "default", false)`). Strict and all or nothing: a config field this
    /// runtime does not know or implement, targets matching no layer, a missing or unexpected
    /// tensor or one of another shape are typed errors ([`PeftError`]) naming the field, path or
    /// key, and leave the model unchanged. Without `is_trainable` the adapter is frozen, as in
    /// PEFT. Returns the adapted layers' paths.
    fn load_adapter(
        &mut self,
        dir: impl AsRef<std::path::Path>,
        name: &str,
        is_trainable: bool,
    ) -> Result<Vec<String>>
    where
        Self: Sized,
    {
        crate::peft::files::load(self.peft_dyn_mut(), dir.as_ref(), name, is_trainable)
    }

    /// `(trainable, all)` parameter counts (PEFT's `get_nb_trainable_parameters`; its
    /// `print_trainable_parameters` prints them).
    fn get_nb_trainable_parameters(&self) -> (usize, usize) {
        let mut counts = (0, 0);
        for (_, p) in named_parameters(self.peft_dyn(), &Names::new()) {
            let n = p.elem_count();
            counts.1 += n;
            if p.requires_grad() {
                counts.0 += n;
            }
        }
        counts
    }

    #[doc(hidden)]
    fn peft_dyn(&self) -> &dyn Module;
    #[doc(hidden)]
    fn peft_dyn_mut(&mut self) -> &mut dyn Module;
}

impl<M: Module> PeftExt for M {
    fn peft_dyn(&self) -> &dyn Module {
        self
    }
    fn peft_dyn_mut(&mut self) -> &mut dyn Module {
        self
    }
}

impl PeftExt for dyn Module {
    fn peft_dyn(&self) -> &dyn Module {
        self
    }
    fn peft_dyn_mut(&mut self) -> &mut dyn Module {
        self
    }
}

fn no_adapter(model: &dyn Module, name: &str) -> crate::Error {
    PeftError::NoAdapter {
        adapter: name.to_owned(),
        available: model.adapter_names(),
    }
    .into()
}

/// Every layer of `model` that holds adapters, by path, with its adapters.
pub(crate) fn lora_layers(model: &dyn Module) -> Vec<(String, &LoraLayer)> {
    adapted(model)
        .into_iter()
        .filter_map(|(path, host)| Some((path, host.lora()?)))
        .collect()
}

/// Every layer of `model` that holds adapters, by path.
pub(crate) fn adapted(model: &dyn Module) -> Vec<(String, Host<'_>)> {
    candidates(model)
        .into_iter()
        .filter_map(|(path, m)| {
            Host::of(m)
                .filter(|h| h.lora().is_some())
                .map(|h| (path, h))
        })
        .collect()
}

/// Every `Linear` of `model` by path, those inside adapters excluded.
pub(crate) fn linears(model: &dyn Module) -> Vec<(String, &Linear)> {
    candidates(model)
        .into_iter()
        .filter_map(|(path, m)| m.downcast_ref::<Linear>().map(|l| (path, l)))
        .collect()
}

/// Every module of `model` an adapter could target: not the root, nothing inside an adapter.
pub(crate) fn candidates(model: &dyn Module) -> Vec<(String, &dyn Module)> {
    let modules = named_modules(model, &Names::new());
    let mut adapted: Vec<String> = modules
        .iter()
        .filter(|(_, m)| Host::of(*m).is_some_and(|h| h.lora().is_some()))
        .map(|(path, _)| format!("{path}.lora_"))
        .collect();
    adapted.extend(
        (modules.iter())
            .filter(|(_, m)| saved_of(*m).is_some_and(Option::is_some))
            .map(|(path, _)| format!("{path}.modules_to_save.")),
    );
    modules
        .into_iter()
        .filter(|(path, _)| !path.is_empty() && !adapted.iter().any(|a| path.starts_with(a)))
        .collect()
}

/// The adapters `config` asks for, built for `model` but not added: every check that can fail
/// is made here, so that adding them cannot.
pub(crate) fn prepare(model: &dyn Module, name: &str, config: &LoraConfig) -> Result<Prepared> {
    config.validate()?;
    module_core::path::check_key("adapter", "", name)?;
    let targets = config.target_modules.matcher("target_modules")?;
    let exclude = match &config.exclude_modules {
        Some(e) => Some(e.matcher("exclude_modules")?),
        None => None,
    };
    let config = Arc::new(config.clone());
    let mut prepared = Vec::new();
    for (path, module) in candidates(model) {
        if !targets.matches(&path) || exclude.as_ref().is_some_and(|e| e.matches(&path)) {
            continue;
        }
        let Some(host) = Host::of(module) else {
            return Err(PeftError::UnsupportedLayer {
                path,
                found: module.class_name(),
            }
            .into());
        };
        if host.weight().is_parametrized() {
            return Err(PeftError::State {
                path,
                message: "its weight is parametrized (`nn::parametrize`): adapters over a \
                          parametrized layer are not supported; remove the parametrization first"
                    .into(),
            }
            .into());
        }
        if host.lora().is_some_and(|l| l.has(name)) {
            return Err(PeftError::AdapterExists {
                path,
                adapter: name.to_owned(),
            }
            .into());
        }
        let adapter = build_adapter(name, host, &path, &config)?;
        prepared.push((path, adapter));
    }
    if prepared.is_empty() {
        return Err(PeftError::NoTarget {
            targets: config.targets_text(),
            available: linears(model).into_iter().take(8).map(|(p, _)| p).collect(),
        }
        .into());
    }
    let lora_paths: Vec<&str> = prepared.iter().map(|(p, _)| p.as_str()).collect();
    let saved = prepare_saved(model, name, &config, &lora_paths)?;
    Ok(Prepared {
        name: name.to_owned(),
        adapters: prepared,
        saved,
    })
}

/// An adapter built for a model and not yet added: its LoRA layers, its `modules_to_save`
/// copies.
pub(crate) struct Prepared {
    pub(crate) name: String,
    pub(crate) adapters: Vec<(String, Adapter)>,
    pub(crate) saved: Vec<(String, SavedModule)>,
}

/// Adds prepared adapters; every layer is checked to be reachable mutably (not behind a shared
/// `Arc`) before the first one is added.
pub(crate) fn commit(model: &mut dyn Module, prepared: Prepared) -> Result<Vec<String>> {
    for (path, _) in &prepared.adapters {
        adapter_slot(model, path)?;
    }
    for (path, _) in &prepared.saved {
        module_core::path::submodule_mut(model, path)?;
    }
    for (path, copy) in prepared.saved {
        let module = module_core::path::submodule_mut(model, &path)?;
        let slot = saved_slot_mut(module).expect("checked when prepared");
        slot.get_or_insert_with(|| Box::new(ModulesToSave::new()))
            .add(&prepared.name, copy)?;
    }
    let mut paths = Vec::with_capacity(prepared.adapters.len());
    for (path, adapter) in prepared.adapters {
        adapter_slot(model, &path)?
            .get_or_insert_with(|| Box::new(LoraLayer::new(adapter.kind)))
            .add(adapter)?;
        paths.push(path);
    }
    mark_trainable(model);
    Ok(paths)
}

/// The adapter slot of the layer at `path`, mutably
/// ([`Error::SharedModule`](crate::Error::SharedModule) behind a shared `Arc`).
fn adapter_slot<'a>(
    model: &'a mut dyn Module,
    path: &str,
) -> Result<&'a mut Option<Box<LoraLayer>>> {
    let module = module_core::path::submodule_mut(model, path)?;
    let found = module.class_name();
    slot_mut(module).ok_or_else(|| {
        PeftError::UnsupportedLayer {
            path: path.to_owned(),
            found,
        }
        .into()
    })
}

/// Removes the adapter `name` (every adapter with `None`) from every layer; returns the layers'
/// paths. The caller has unmerged them.
fn remove_adapters(model: &mut dyn Module, name: Option<&str>) -> Result<Vec<String>> {
    let saved: Vec<String> = saved_layers(model).into_iter().map(|(p, _)| p).collect();
    for path in &saved {
        let module = module_core::path::submodule_mut(model, path)?;
        if name.is_none() {
            // PEFT's unwrapping keeps the active copy: its values become the layer's.
            crate::peft::saved::take_active_copy(module)?;
        }
        let slot = saved_slot_mut(module).expect("a layer with copies");
        let empty = match (name, slot.as_mut()) {
            (Some(name), Some(copies)) => copies.remove(name),
            _ => true,
        };
        if empty {
            *slot = None;
        }
    }
    let paths: Vec<String> = lora_layers(model).into_iter().map(|(p, _)| p).collect();
    for path in &paths {
        let slot = adapter_slot(model, path)?;
        let empty = match (name, slot.as_mut()) {
            (Some(name), Some(lora)) => lora.remove(name),
            _ => true,
        };
        if empty {
            *slot = None;
        }
    }
    Ok(paths)
}

/// PEFT's `_mark_only_adapters_as_trainable`: the active adapters' parameters (and the biases
/// their `bias` names) are trained, everything else is frozen.
pub(crate) fn mark_trainable(model: &dyn Module) {
    // `<path>.<dict>.<adapter>`: the parameter itself (`lora_embedding_A.default`) or its
    // prefix (`lora_A.default.weight`). Paths are never empty: the root takes no adapter.
    let layers = lora_layers(model);
    let mut prefixes: Vec<String> = Vec::new();
    let mut bias = (LoraBias::None, Vec::new());
    for (path, lora) in &layers {
        let Some(active) = lora.active_adapter() else {
            continue;
        };
        if let Some(settings) = lora.settings(&active) {
            bias.0 = settings.config.bias;
            bias.1.push(path.clone());
        }
        prefixes.extend(ADAPTER_DICTS.map(|d| format!("{path}.{d}.{active}")));
    }
    for (path, saved) in saved_layers(model) {
        if let Some(active) = saved.active_adapter().filter(|a| saved.has(a)) {
            prefixes.push(format!("{path}.modules_to_save.{active}"));
        }
    }
    let biases: Vec<Param> = trained_biases(model, bias.0, &bias.1, &[])
        .into_iter()
        .map(|(_, _, p)| p)
        .collect();
    for (path, p) in named_parameters(model, &Names::new().keep_duplicates()) {
        let trained = prefixes
            .iter()
            .any(|pre| path == *pre || path.starts_with(&format!("{pre}.")));
        p.set_requires_grad(trained || biases.iter().any(|b| b.same_as(&p)));
    }
}

/// The biases PEFT's `bias` trains with an adapter on the layers `layers`, each with its path
/// and the path PEFT gives it (`<layer>.base_layer.bias` for a layer that holds adapters, one of
/// `layers` or `adapted`): what the adapter's file holds besides its factors.
pub(crate) fn trained_biases(
    model: &dyn Module,
    bias: LoraBias,
    layers: &[String],
    adapted: &[String],
) -> Vec<(String, String, Param)> {
    let is_adapted = |layer: &str| {
        layers.iter().chain(adapted).any(|l| l == layer)
            || lora_layers(model).iter().any(|(l, _)| l == layer)
    };
    let peft_path = |path: &str| match path.rsplit_once('.') {
        Some((layer, leaf)) if is_adapted(layer) => format!("{layer}.base_layer.{leaf}"),
        _ => path.to_owned(),
    };
    named_parameters(model, &Names::new())
        .into_iter()
        .filter(|(path, _)| match bias {
            LoraBias::None => false,
            // PEFT: `"bias" in name`, the adapters' own parameters aside.
            // (`modules_to_save` copies are trained and saved as copies.)
            LoraBias::All => {
                path.contains("bias")
                    && !path.contains(".lora_")
                    && !path.contains(".modules_to_save.")
            }
            LoraBias::LoraOnly => path
                .rsplit_once('.')
                .is_some_and(|(layer, leaf)| leaf == "bias" && layers.iter().any(|l| l == layer)),
        })
        .map(|(path, p)| {
            let peft = peft_path(&path);
            (path, peft, p)
        })
        .collect()
}
