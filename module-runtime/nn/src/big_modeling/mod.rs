//! Models placed over several devices and offloaded to CPU memory or disk: Hugging Face
//! Accelerate's `big_modeling` (`device_map`, `dispatch_model`, `cpu_offload`, disk offload,
//! `infer_auto_device_map`).
//!
//! A [`DeviceMap`] says where each module goes, by path pattern, as Accelerate's `device_map`
//! dict does: a device (`cuda:0`, `cpu`), `cpu` while the model computes on a GPU (CPU offload),
//! or `disk` (an offload folder of safetensors files, one per weight). [`dispatch_model`] places
//! the parameters and buffers and returns a [`Dispatched`] model whose [`call`](Dispatched::call)
//! moves each placed module's inputs to its device where the device changes, and the output back
//! to the caller's device. Offloaded weights are read each time a layer reads them (just before
//! it computes) and freed when it is done with them. [`infer_auto_device_map`] makes a map from a
//! memory budget per device.
//!
//! ```
//! use module_runtime::prelude::*;
//! use module_runtime::nn::big_modeling::{dispatch_model, DeviceMap, Placement};
//!
//! #[derive(Module)]
//! struct Net { fc1: Linear, fc2: Linear }
//! impl Forward<&Tensor> for Net {
//!     type Output = Tensor;
//!     fn forward(&self, x: &Tensor) -> Result<Tensor> { self.fc2.call(&self.fc1.call(x)?.relu()?) }
//! }
//!
//! let net = Net { fc1: Linear::new(4, 8, &Device::Cpu)?, fc2: Linear::new(8, 2, &Device::Cpu)? };
//! let x = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
//! let expected = net.call(&x)?;
//! let folder = std::env::temp_dir().join(format!("offload-doc-{}", std::process::id()));
//! // fc1 on the CPU, fc2's weights on disk (read for each call, freed after).
//! let map = DeviceMap::from_pairs([("fc1", "cpu"), ("fc2", "disk")])?.offload_folder(&folder);
//! let dispatched = dispatch_model(&net, &map)?;
//! assert!(net.fc2.weight.is_offloaded());
//! let y = dispatched.call(&x)?;
//! assert_eq!(y.to_vec2::<f32>()?, expected.to_vec2::<f32>()?);
//! assert_eq!(dispatched.trace().loads(), 2); // fc2's weight and bias, once each
//! # std::fs::remove_dir_all(&folder).ok();
//! # Ok::<(), module_runtime::Error>(())
//! ```
//!
//! Files: `mod.rs` ([`Placement`], [`DeviceMap`]), `dispatch.rs` ([`dispatch_model`],
//! [`Dispatched`]), `movement.rs` (the hooks that move activations, [`DispatchTrace`]), `offload.rs` (the CPU
//! and disk sources offloaded parameters read from), `auto.rs` ([`infer_auto_device_map`],
//! [`MaxMemory`]).

use std::path::{Path, PathBuf};

use candle_core::Device;

use crate::error::{DeviceMapError, Result};
use module_core::{device_name, parse_device, PathPattern};

mod auto;
mod dispatch;
mod movement;
mod offload;

pub use auto::{infer_auto_device_map, MaxMemory};
pub use dispatch::{dispatch_model, Dispatched};
pub use movement::{DispatchTrace, Move};

/// Where a [`DeviceMap`] puts a module (Accelerate's `device_map` values).
#[derive(Clone, Debug)]
pub enum Placement {
    /// On a device, weights and computation: `cuda:0`, or `cpu` when the map computes on the CPU.
    /// The name is what traces and errors show; a *stand-in* ([`Placement::stand_in`]) gives
    /// another name to a device, to split a model over "devices" where only one exists.
    Device {
        /// The device's name (`cuda:0`, `cpu`, or a stand-in's).
        name: String,
        /// The device itself.
        device: Device,
    },
    /// Weights kept in CPU memory; computed on the map's execution device (Accelerate's
    /// `cpu_offload` when that is a GPU: each weight copied there as its layer reads it). On a
    /// map that computes on the CPU, the same as `Device { name: "cpu", .. }`.
    Cpu,
    /// Weights kept in the map's [offload folder](DeviceMap::offload_folder), one safetensors
    /// file per weight, read as each layer reads them and freed after; computed on the execution
    /// device (Accelerate's disk offload).
    Disk,
}

impl Placement {
    /// Parses Accelerate's names: `cpu`, `disk`, or a device [`parse_device`] knows (`cuda:0`,
    /// `cuda`, `metal:0`). A CUDA device in a build without the `cuda` feature, or one this
    /// machine lacks, is [`DeviceMapError::UnknownDevice`].
    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "cpu" => Ok(Self::Cpu),
            "disk" => Ok(Self::Disk),
            _ => match parse_device(name) {
                Ok(device) => Ok(Self::Device {
                    name: device_name(&device),
                    device,
                }),
                Err(e) => Err(DeviceMapError::UnknownDevice {
                    pattern: String::new(),
                    name: name.to_owned(),
                    reason: e.to_string(),
                }
                .into()),
            },
        }
    }

    /// A device known by another name: `stand_in("gpu1", &Device::Cpu)` is a second "device"
    /// that is really the CPU, so a split over devices (where activations move, and how often)
    /// can be run and tested on one device.
    pub fn stand_in(name: impl Into<String>, device: &Device) -> Self {
        Self::Device {
            name: name.into(),
            device: device.clone(),
        }
    }

    /// The name traces and errors show: the device's, `cpu` or `disk`.
    pub fn name(&self) -> &str {
        match self {
            Self::Device { name, .. } => name,
            Self::Cpu => "cpu",
            Self::Disk => "disk",
        }
    }

    /// Whether the weights are kept away from the device that computes with them (`cpu` on a
    /// map computing elsewhere, `disk`).
    fn offloads(&self, execution: &Placement) -> bool {
        match self {
            Self::Device { .. } => false,
            // Computing on anything but the CPU itself (a stand-in included: CPU offload on a
            // CPU-only machine, to test it) keeps `cpu` weights apart.
            Self::Cpu => execution.name() != "cpu",
            Self::Disk => true,
        }
    }
}

/// One entry: a pattern (`None`: the root, Accelerate's `""`) and its placement.
#[derive(Clone, Debug)]
struct Entry {
    pattern: Option<PathPattern>,
    placement: Placement,
}

impl Entry {
    fn as_str(&self) -> &str {
        self.pattern.as_ref().map_or("", PathPattern::as_str)
    }

    fn matches(&self, path: &str) -> bool {
        match &self.pattern {
            None => path.is_empty(),
            Some(p) => p.matches(path),
        }
    }
}

/// Modules by path pattern → where they go: Accelerate's `device_map` dict
/// (`{"model.embed_tokens": 0, "model.layers": "cpu", "lm_head": "disk"}`), with path patterns
/// (`model.layers.*`) for keys.
///
/// A parameter or buffer goes where the entry for its module, or the nearest module above it
/// that an entry names, says (Accelerate's longest matching prefix): `{"": "cpu", "fc2":
/// "disk"}` puts `fc2` on disk and everything else on the CPU. Two entries naming one module:
/// the first wins. Every parameter and buffer must be placed, every pattern must match a module,
/// and a module listed with [`no_split`](Self::no_split) (or a tied weight) must land whole on
/// one device; [`dispatch_model`] checks all of it before it moves anything.
///
/// The map computes on its [execution device](Self::execution_device): the first device it
/// names, else the CPU (Accelerate's `main_device`); `cpu` and `disk` modules compute there.
#[derive(Clone, Debug, Default)]
pub struct DeviceMap {
    entries: Vec<Entry>,
    offload_folder: Option<PathBuf>,
    execution: Option<Placement>,
    no_split: Vec<PathPattern>,
}

impl DeviceMap {
    /// An empty map.
    pub fn new() -> Self {
        Self::default()
    }

    /// A map from Accelerate's dict: (module path or pattern, device name) pairs, device names as
    /// [`Placement::parse`] reads them; `""` is the whole model.
    pub fn from_pairs<P: AsRef<str>, D: AsRef<str>>(
        pairs: impl IntoIterator<Item = (P, D)>,
    ) -> Result<Self> {
        pairs.into_iter().try_fold(Self::new(), |map, (p, d)| {
            let placement = Placement::parse(d.as_ref()).map_err(|e| match e {
                crate::Error::DeviceMap(DeviceMapError::UnknownDevice { name, reason, .. }) => {
                    DeviceMapError::UnknownDevice {
                        pattern: p.as_ref().to_owned(),
                        name,
                        reason,
                    }
                    .into()
                }
                e => e,
            })?;
            map.insert(p.as_ref(), placement)
        })
    }

    /// Adds an entry: the modules matching `pattern` (a path, a [`PathPattern`], or `""` for the
    /// root) go to `placement`.
    pub fn insert(mut self, pattern: &str, placement: Placement) -> Result<Self> {
        let pattern = match pattern {
            "" => None,
            p => Some(PathPattern::new(p)?),
        };
        self.entries.push(Entry { pattern, placement });
        Ok(self)
    }

    /// The folder `disk` placements write their weights to (Accelerate's `offload_folder`): one
    /// safetensors file per weight, named by its path. Created if missing; the files stay after
    /// the model is dropped (a later dispatch rewrites them).
    pub fn offload_folder(mut self, folder: impl AsRef<Path>) -> Self {
        self.offload_folder = Some(folder.as_ref().to_owned());
        self
    }

    /// The device that `cpu` and `disk` modules compute on (Accelerate's `main_device`): by
    /// default the first device the map names, else the CPU.
    pub fn execution_device(mut self, placement: Placement) -> Self {
        self.execution = Some(placement);
        self
    }

    /// Modules matching `pattern` must be placed whole (Accelerate's `no_split_module_classes`,
    /// by path: `model.layers.*`): a map that splits one is refused.
    pub fn no_split(mut self, pattern: &str) -> Result<Self> {
        self.no_split.push(PathPattern::new(pattern)?);
        Ok(self)
    }

    /// The entries, in order: (pattern, placement); `""` is the root.
    pub fn entries(&self) -> impl Iterator<Item = (&str, &Placement)> {
        self.entries.iter().map(|e| (e.as_str(), &e.placement))
    }

    /// The execution device: the one set, else the first device entry's, else the CPU.
    pub fn main_device(&self) -> Placement {
        if let Some(p) = &self.execution {
            return p.clone();
        }
        self.entries
            .iter()
            .find(|e| matches!(e.placement, Placement::Device { .. }))
            .map_or_else(
                || Placement::Device {
                    name: "cpu".into(),
                    device: Device::Cpu,
                },
                |e| e.placement.clone(),
            )
    }
}
