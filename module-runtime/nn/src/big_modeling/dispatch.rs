//! [`dispatch_model`]: a model's parameters and buffers placed by a [`DeviceMap`], and the hooks
//! that move activations where the device changes ([`Dispatched`], [`DispatchTrace`]).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{Device, Var};

use super::movement::{movement_hooks, DispatchTrace, Unit};
use super::offload::{DiskWeight, HostWeight, LoadCounter};
use super::{DeviceMap, Placement};
use crate::error::{DeviceMapError, Error, Result};
use crate::hooks::Hooks;
use crate::{Forward, Module, ModuleExt, TensorTree};
use module_core::key_groups::group_keys;
use module_core::names::{named_buffers, named_modules, named_parameters, Names};
use module_core::{atomic_update, OffloadSource, Param};

/// A model placed by [`dispatch_model`]: its [`call`](Self::call) runs the model with the hooks
/// that move each placed module's inputs to its device where the device changes, and brings the
/// output back to the caller's device (Accelerate's `AlignDevicesHook`s). The model itself is
/// unchanged in type, paths and state dict; calling it directly (`model.call`) still reads its
/// offloaded weights, without moving activations.
pub struct Dispatched<'m, M> {
    model: &'m M,
    hooks: Hooks,
    trace: Arc<DispatchTrace>,
    placements: Vec<(String, String)>,
}

impl<M> std::fmt::Debug for Dispatched<'_, M> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Dispatched")
            .field("hf_device_map", &self.placements)
            .finish()
    }
}

impl<'m, M: Module> Dispatched<'m, M> {
    /// Calls the model with the map's moves: each placed module's inputs are moved to its device
    /// where the placement changes, and the output comes back to the device of the caller's
    /// first input tensor.
    pub fn call<In>(&self, input: In) -> Result<<M as Forward<In>>::Output>
    where
        M: Forward<In>,
        In: TensorTree,
        <M as Forward<In>>::Output: TensorTree + 'static,
    {
        self.hooks.run(self.model, |m| m.call(input))
    }

    /// Runs `f` with the map's moves attached (for a model's other entry points: a generation
    /// loop, a `scan`): every call of a placed module inside moves its inputs as in
    /// [`call`](Self::call); only a call of the model itself brings its output back.
    pub fn run<R>(&self, f: impl FnOnce(&M) -> Result<R>) -> Result<R> {
        self.hooks.run(self.model, f)
    }

    /// The model.
    pub fn model(&self) -> &'m M {
        self.model
    }

    /// The hooks that move activations (to run them nested with a registry of your own: both
    /// fire, the outer run's first).
    pub fn hooks(&self) -> &Hooks {
        &self.hooks
    }

    /// The moves and offloaded reads so far.
    pub fn trace(&self) -> &DispatchTrace {
        &self.trace
    }

    /// Each placed module and where it went (Accelerate's `model.hf_device_map`): (path,
    /// placement name), in the model's order.
    pub fn hf_device_map(&self) -> &[(String, String)] {
        &self.placements
    }
}

/// Where one parameter or buffer goes: the placed module it belongs to and the entry's index.
struct Resolved {
    unit: String,
    entry: usize,
}

/// Places `model`'s parameters and buffers by `map` and returns the model with the hooks that
/// move activations between them (Accelerate's `dispatch_model(model, device_map,
/// offload_dir=...)`).
///
/// `Device` placements move the weights there; `cpu` (on a map computing on a GPU) and `disk`
/// placements offload them ([`Param::offload`]): the model keeps only their shapes, and each read
/// is a fresh tensor on the execution device. Buffers go to the device their module computes on
/// (Accelerate's `offload_buffers=False`). A parameter offloaded by an earlier dispatch comes
/// back when the new map puts it on a device.
///
/// Everything is checked before anything moves, each failure a [`DeviceMapError`] (or
/// [`Error::NoModuleMatch`] for a pattern that matches no module) naming the paths: a parameter
/// or buffer no entry places, an unknown device, a tied weight or `no_split` module placed on two
/// devices, `disk` without an offload folder, a quantized or unbuilt weight to offload.
pub fn dispatch_model<'m, M: Module>(model: &'m M, map: &DeviceMap) -> Result<Dispatched<'m, M>> {
    let modules: Vec<String> = named_modules(model, &Names::new())
        .into_iter()
        .map(|(p, _)| p)
        .collect();
    for entry in &map.entries {
        if !modules.iter().any(|m| entry.matches(m)) {
            return Err(Error::NoModuleMatch {
                what: "device map",
                pattern: entry.as_str().to_owned(),
                near: near(entry.as_str(), &modules),
            });
        }
    }
    let resolve = |leaf: &str| -> Option<Resolved> {
        let mut owner = parent(leaf);
        loop {
            if let Some(entry) = map.entries.iter().position(|e| e.matches(owner)) {
                return Some(Resolved {
                    unit: owner.to_owned(),
                    entry,
                });
            }
            if owner.is_empty() {
                return None;
            }
            owner = parent(owner);
        }
    };
    let all = Names::new().keep_duplicates();
    let params = named_parameters(model, &all);
    let buffers = named_buffers(model, &all);
    let mut placed: Vec<(String, Resolved)> = Vec::new();
    let mut uncovered = Vec::new();
    let leaf_paths = params
        .iter()
        .map(|(p, _)| p)
        .chain(buffers.iter().map(|(p, _)| p));
    for path in leaf_paths {
        match resolve(path) {
            Some(r) => placed.push((path.clone(), r)),
            None => uncovered.push(path.as_str()),
        }
    }
    if !uncovered.is_empty() {
        let paths = group_keys(uncovered)
            .into_iter()
            .map(|g| g.pattern)
            .collect();
        return Err(DeviceMapError::Uncovered { paths }.into());
    }
    let name_of = |r: &Resolved| map.entries[r.entry].placement.name().to_owned();
    check_ties(&params, &placed, name_of)?;
    check_no_split(map, &modules, &placed, name_of)?;
    let execution = map.main_device();
    let exec_device = match &execution {
        Placement::Device { device, .. } => device.clone(),
        _ => Device::Cpu,
    };
    let by_path: HashMap<&str, &Resolved> = placed.iter().map(|(p, r)| (p.as_str(), r)).collect();
    let placement = |path: &str| &map.entries[by_path[path].entry].placement;
    let counter = Arc::new(LoadCounter::default());
    let unique = named_parameters(model, &Names::new());
    let folder = map.offload_folder.as_deref();
    let disk = |path: &str| {
        let folder = folder.unwrap_or(Path::new("."));
        DiskWeight::new(folder, path, &exec_device, counter.clone())
    };
    // Every check before the first write: offloads that cannot be, a missing folder.
    for (path, p) in &unique {
        let place = placement(path);
        let refuse = |reason: String| -> Result<()> {
            Err(DeviceMapError::NotOffloadable {
                path: path.clone(),
                reason,
            }
            .into())
        };
        if matches!(place, Placement::Disk) && folder.is_none() {
            let entry = &map.entries[by_path[path.as_str()].entry];
            return Err(DeviceMapError::NoOffloadFolder {
                pattern: entry.as_str().to_owned(),
            }
            .into());
        }
        if !place.offloads(&execution) {
            continue;
        }
        if p.is_quantized() {
            refuse("it is quantized (dequantize it, or place it on a device)".into())?;
        }
        if p.is_built() {
            continue;
        }
        // An unbuilt parameter takes the file an earlier dispatch wrote, never the values.
        let weight = disk(path);
        match (place, weight.layout()) {
            (Placement::Disk, Ok((shape, dtype))) => {
                let fits = p.lazy_shape().is_none_or(|s| s.accepts(shape.dims()));
                if !fits || dtype != p.dtype() {
                    refuse(format!(
                        "it is not built, and {} holds a {dtype:?} tensor of shape {shape:?}, not \
                         one it accepts ({dtype_p:?}, {lazy})",
                        weight.file().display(),
                        dtype_p = p.dtype(),
                        lazy = p.lazy_shape().map_or_else(String::new, |s| s.to_string()),
                    ))?;
                }
            }
            (Placement::Disk, Err(_)) => refuse(format!(
                "it is not built and {} holds no weight for it (dispatch the built model to \
                 this folder once, or load it first)",
                weight.file().display()
            ))?,
            _ => refuse("it is not built (load or build the model first)".into())?,
        }
    }
    // What each parameter becomes, made before anything changes (files written, values moved).
    enum Next {
        Stay,
        Var(Var),
        Onload(Device),
        Quantized(Device),
        Offload(Arc<dyn OffloadSource>),
    }
    if let (Some(folder), true) = (
        folder,
        unique
            .iter()
            .any(|(p, _)| matches!(placement(p), Placement::Disk)),
    ) {
        std::fs::create_dir_all(folder).map_err(|e| Error::Io {
            path: folder.to_owned(),
            source: e,
        })?;
    }
    let mut next = Vec::with_capacity(unique.len());
    for (path, p) in &unique {
        let place = placement(path);
        let n = match place {
            Placement::Disk => {
                let weight = disk(path);
                if p.is_built() {
                    weight.store(&p.own_tensor()?)?;
                }
                Next::Offload(Arc::new(weight))
            }
            Placement::Cpu if place.offloads(&execution) => {
                let host = p.own_tensor()?.to_device(&Device::Cpu)?;
                Next::Offload(Arc::new(HostWeight::new(
                    host,
                    &exec_device,
                    counter.clone(),
                )))
            }
            _ => {
                let device = compute_device(place, &exec_device);
                match () {
                    _ if p.is_offloaded() => Next::Onload(device),
                    _ if p.device().same_device(&device) => Next::Stay,
                    _ if p.is_quantized() => Next::Quantized(device),
                    _ => Next::Var(Var::from_tensor(
                        &p.current()?.detach().to_device(&device)?,
                    )?),
                }
            }
        };
        next.push(n);
    }
    let mut next_buffers = Vec::new();
    for (path, b) in named_buffers(model, &Names::new()) {
        let device = compute_device(placement(&path), &exec_device);
        if !b.device().same_device(&device) {
            next_buffers.push((b.clone(), b.current().to_device(&device)?));
        }
    }
    atomic_update(|| -> Result<()> {
        for ((_, p), n) in unique.iter().zip(next) {
            match n {
                Next::Stay => {}
                Next::Var(var) => p.replace_var(var),
                Next::Onload(device) => p.onload(&device)?,
                Next::Quantized(device) => p.to_device(&device)?,
                Next::Offload(source) => offload(p, source, &exec_device)?,
            }
        }
        for (b, t) in next_buffers {
            b.replace(t);
        }
        Ok(())
    })?;
    let trace = Arc::new(DispatchTrace::new(counter));
    let units = units(map, &modules, &placed, &execution, &exec_device);
    let hooks = movement_hooks(&units, &trace)?;
    let placements = units
        .iter()
        .map(|u| (u.path.clone(), u.placement.clone()))
        .collect();
    Ok(Dispatched {
        model,
        hooks,
        trace,
        placements,
    })
}

/// An offload that replaces an earlier one: the values come back first (the source reads them).
fn offload(p: &Param, source: Arc<dyn OffloadSource>, device: &Device) -> Result<()> {
    if p.is_offloaded() {
        p.onload(device)?;
    }
    p.offload(source, device)
}

/// The device a module placed at `place` computes on.
fn compute_device(place: &Placement, execution: &Device) -> Device {
    match place {
        Placement::Device { device, .. } => device.clone(),
        Placement::Cpu | Placement::Disk => execution.clone(),
    }
}

fn units(
    map: &DeviceMap,
    modules: &[String],
    placed: &[(String, Resolved)],
    execution: &Placement,
    exec_device: &Device,
) -> Vec<Unit> {
    let mut seen: HashMap<&str, usize> = HashMap::new();
    for (_, r) in placed {
        seen.entry(r.unit.as_str()).or_insert(r.entry);
    }
    modules
        .iter()
        .filter_map(|m| {
            let place = &map.entries[*seen.get(m.as_str())?].placement;
            let label = match place {
                Placement::Device { name, .. } => name.clone(),
                _ => execution.name().to_owned(),
            };
            Some(Unit {
                path: m.clone(),
                placement: place.name().to_owned(),
                label,
                device: compute_device(place, exec_device),
            })
        })
        .collect()
}

/// A tied parameter (one `Param` at several paths) must land on one placement.
fn check_ties(
    params: &[(String, Param)],
    placed: &[(String, Resolved)],
    name_of: impl Fn(&Resolved) -> String,
) -> Result<()> {
    let by_path: HashMap<&str, &Resolved> = placed.iter().map(|(p, r)| (p.as_str(), r)).collect();
    let mut first: HashMap<usize, (&str, String)> = HashMap::new();
    for (path, p) in params {
        let name = name_of(by_path[path.as_str()]);
        match first.get(&p.id()) {
            None => {
                first.insert(p.id(), (path, name));
            }
            Some((other, other_name)) if *other_name != name => {
                return Err(DeviceMapError::Split {
                    path: (*other).to_owned(),
                    placements: vec![
                        ((*other).to_owned(), other_name.clone()),
                        (path.clone(), name),
                    ],
                }
                .into());
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// A module matching a `no_split` pattern must have every parameter and buffer on one placement.
fn check_no_split(
    map: &DeviceMap,
    modules: &[String],
    placed: &[(String, Resolved)],
    name_of: impl Fn(&Resolved) -> String,
) -> Result<()> {
    for module in modules
        .iter()
        .filter(|m| map.no_split.iter().any(|p| p.matches(m)))
    {
        let mut seen: Vec<(String, String)> = Vec::new();
        for (path, r) in placed.iter().filter(|(p, _)| is_under(p, module)) {
            let name = name_of(r);
            if !seen.iter().any(|(_, n)| *n == name) {
                seen.push((path.clone(), name));
            }
        }
        if seen.len() > 1 {
            return Err(DeviceMapError::Split {
                path: module.clone(),
                placements: seen,
            }
            .into());
        }
    }
    Ok(())
}

/// The path of the module holding `path` (`""` for the root's own).
fn parent(path: &str) -> &str {
    path.rfind('.').map_or("", |i| &path[..i])
}

/// Whether `path` is `module` or under it.
fn is_under(path: &str, module: &str) -> bool {
    module.is_empty()
        || path == module
        || (path.starts_with(module) && path.as_bytes().get(module.len()) == Some(&b'.'))
}

/// Module paths most like `pattern` (sharing its longest prefix), a few.
fn near(pattern: &str, modules: &[String]) -> Vec<String> {
    let common = |m: &str| {
        pattern
            .chars()
            .zip(m.chars())
            .take_while(|(a, b)| a == b)
            .count()
    };
    let mut ranked: Vec<&String> = modules.iter().filter(|m| !m.is_empty()).collect();
    ranked.sort_by_key(|m| std::cmp::Reverse(common(m)));
    ranked.into_iter().take(5).cloned().collect()
}
