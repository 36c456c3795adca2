//! [`infer_auto_device_map`]: a [`DeviceMap`] made from a memory budget per device
//! (Accelerate's `device_map="auto"`).

use std::collections::HashMap;

use super::{DeviceMap, Placement};
use crate::error::{DeviceMapError, Result};
use crate::Module;
use module_core::names::{named_buffers, named_children, named_parameters, Names};
use module_core::PathPattern;

/// How much each device may hold, in the order the devices are filled (Accelerate's
/// `max_memory={0: "10GiB", "cpu": "30GiB"}`), and whether what fits nowhere goes to disk.
#[derive(Clone, Debug, Default)]
pub struct MaxMemory {
    budgets: Vec<(Placement, usize)>,
    disk: bool,
}

impl MaxMemory {
    /// No device yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a device (a name [`Placement::parse`] reads: `cuda:0`, `cpu`) with a budget in bytes;
    /// devices are filled in the order they are added.
    pub fn device(self, name: &str, bytes: usize) -> Result<Self> {
        Ok(self.placement(Placement::parse(name)?, bytes))
    }

    /// Adds a placement (a [stand-in](Placement::stand_in) device, say) with a budget in bytes.
    pub fn placement(mut self, placement: Placement, bytes: usize) -> Self {
        self.budgets.push((placement, bytes));
        self
    }

    /// What fits on no device goes to `disk` (the map then needs an
    /// [offload folder](DeviceMap::offload_folder)).
    pub fn offload_to_disk(mut self) -> Self {
        self.disk = true;
        self
    }
}

/// A unit of placement: a module placed whole, or a split module's own parameters and buffers.
struct Unit {
    path: String,
    bytes: usize,
    /// Its parameters, by identity (to keep tied weights together).
    params: Vec<usize>,
}

/// A map that places `model`'s modules in order on the devices of `max_memory`, each device
/// filled up to its budget before the next is used (Accelerate's `infer_auto_device_map`).
///
/// A module matching one of `no_split` (path patterns: `model.layers.*`, Accelerate's
/// `no_split_module_classes` by path) is placed whole, and so is a module without submodules;
/// any other module is split into its own parameters and buffers and its children, so that a
/// large model fills a device to the brim. A unit that does not fit what is left of the current
/// device goes to the next one (the devices are never revisited, so the layers stay in order),
/// and after the last to `disk` if [`offload_to_disk`](MaxMemory::offload_to_disk) allows it,
/// else [`DeviceMapError::NoRoom`]. Sizes are the parameters' and buffers' bytes as they are now
/// (a quantized weight's float size). The map keeps `no_split` for [`dispatch_model`](super::dispatch_model)'s
/// check.
///
/// A unit holding a weight tied to one placed earlier (a head tied to the embedding) goes where
/// that one went, as Accelerate keeps tied parameters together; its bytes are counted once,
/// there. Not done, as Accelerate does: room kept on the first device for the largest offloaded
/// layer.
pub fn infer_auto_device_map(
    model: &dyn Module,
    max_memory: &MaxMemory,
    no_split: &[&str],
) -> Result<DeviceMap> {
    let patterns = no_split
        .iter()
        .map(|p| PathPattern::new(p))
        .collect::<Result<Vec<_>>>()?;
    let mut units = Vec::new();
    collect_units(model, "", &patterns, &mut units);
    let mut map = DeviceMap::new();
    for p in no_split {
        map = map.no_split(p)?;
    }
    let mut device = 0;
    let mut used = 0usize;
    let mut placed: HashMap<usize, Placement> = HashMap::new();
    for unit in units {
        if let Some(tied) = unit.params.iter().find_map(|id| placed.get(id)).cloned() {
            for id in &unit.params {
                placed.entry(*id).or_insert_with(|| tied.clone());
            }
            map = map.insert(&unit.path, tied)?;
            continue;
        }
        while device < max_memory.budgets.len() && used + unit.bytes > max_memory.budgets[device].1
        {
            device += 1;
            used = 0;
        }
        let placement = match max_memory.budgets.get(device) {
            Some((placement, _)) => {
                used += unit.bytes;
                placement.clone()
            }
            None if max_memory.disk => Placement::Disk,
            None => {
                return Err(DeviceMapError::NoRoom {
                    path: unit.path,
                    bytes: unit.bytes,
                }
                .into())
            }
        };
        for id in unit.params {
            placed.insert(id, placement.clone());
        }
        map = map.insert(&unit.path, placement)?;
    }
    Ok(map)
}

/// The units of `module` at `path`, in order: itself whole when it must not be split or has no
/// children, else its own tensors (if any) then its children's units.
fn collect_units(module: &dyn Module, path: &str, no_split: &[PathPattern], out: &mut Vec<Unit>) {
    let children = named_children(module);
    let whole =
        children.is_empty() || (!path.is_empty() && no_split.iter().any(|p| p.matches(path)));
    let own = Names::new().recurse(whole);
    let bytes = tensor_bytes(module, &own);
    let unit = || Unit {
        path: path.to_owned(),
        bytes,
        params: named_parameters(module, &own)
            .into_iter()
            .map(|(_, p)| p.id())
            .collect(),
    };
    if bytes > 0 {
        out.push(unit());
    }
    if whole {
        return;
    }
    for (name, child) in children {
        let child_path = match path {
            "" => name,
            _ => format!("{path}.{name}"),
        };
        collect_units(child, &child_path, no_split, out);
    }
}

/// The bytes of the parameters and buffers `names` selects.
fn tensor_bytes(module: &dyn Module, names: &Names) -> usize {
    let params = named_parameters(module, names)
        .into_iter()
        .map(|(_, p)| p.elem_count() * p.dtype().size_in_bytes());
    let buffers = named_buffers(module, names)
        .into_iter()
        .map(|(_, b)| b.shape().elem_count() * b.dtype().size_in_bytes());
    params.chain(buffers).sum()
}
