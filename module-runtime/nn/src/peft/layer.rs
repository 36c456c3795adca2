//! [`LoraLayer`]: the adapters a [`Linear`], [`Embedding`] or convolution holds (PEFT's
//! `lora.Linear`, `lora.Embedding`, `lora.Conv1d/2d/3d` without the wrapping module):
//! `lora_A`, `lora_B`, `lora_dropout`, DoRA's `lora_magnitude_vector`, an embedding's
//! `lora_embedding_A`/`_B`, by adapter name; their state (active, disabled, merged) and forward.
//! Building them is `build.rs`, merging `merge.rs`, PEFT's `print(model)` `repr.rs`.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::Tensor;

use crate::container::ModuleDict;
use crate::conv::Conv;
use crate::dropout::Dropout;
use crate::embedding::Embedding;
use crate::error::Result;
use crate::linear::Linear;
use crate::peft::build::{Adapter, AdapterWeights};
use crate::peft::config::LoraConfig;
use crate::peft::host::{Kind, LoraFactor};
use crate::{Module, ModuleExt, Param};

/// DoRA's trained magnitude of one adapter (PEFT's `lora.dora.DoraLinearLayer`, and its
/// `DoraEmbeddingLayer` and `DoraConv1dLayer`/`2d`/`3d`, whose `weight` this is): one
/// value per output row of a `Linear` (`[out_features]`) or convolution (`[1, out_channels, 1,
/// …]`, PEFT's shape), one per column of an `Embedding` (`[embedding_dim]`).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(extra_repr)]
#[module(class_name = "lora.dora.DoraLinearLayer")]
pub struct DoraLinearLayer {
    /// The norms of the adapted weight's rows (an embedding's columns), as trained.
    pub weight: Param,
    /// PEFT's class for the layer kind (`lora.dora.DoraConv2dLayer`, …).
    #[module(skip)]
    pub(crate) class: &'static str,
}

impl DoraLinearLayer {
    pub(crate) fn new(weight: Tensor, kind: Kind) -> Result<Self> {
        // PEFT's subclasses of `DoraLinearLayer` prefix `lora.dora.` to a `__repr__` that
        // already has it: `print(model)` shows it twice, and so does this.
        let class = match kind {
            Kind::Linear => "lora.dora.DoraLinearLayer",
            Kind::Embedding => "lora.dora.lora.dora.DoraEmbeddingLayer",
            Kind::Conv(1) => "lora.dora.lora.dora.DoraConv1dLayer",
            Kind::Conv(2) => "lora.dora.lora.dora.DoraConv2dLayer",
            Kind::Conv(_) => "lora.dora.lora.dora.DoraConv3dLayer",
        };
        Ok(Self {
            weight: Param::new(weight)?,
            class,
        })
    }
}

impl module_core::ExtraRepr for DoraLinearLayer {
    fn extra_repr(&self) -> String {
        String::new()
    }

    fn class_repr(&self) -> Option<String> {
        Some(self.class.to_owned())
    }
}

/// One adapter's settings on one layer.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct AdapterSettings {
    pub(crate) name: String,
    /// The configuration it was made from (what `save_pretrained` writes).
    pub(crate) config: Arc<LoraConfig>,
    pub(crate) r: usize,
    pub(crate) scaling: f64,
    pub(crate) use_dora: bool,
}

/// What changes while the adapters are used: which one is active, whether they are disabled,
/// which are merged into the base weight (with DoRA's norms at the time, which unmerging
/// needs).
#[derive(Debug, Default)]
pub(crate) struct LayerState {
    pub(crate) active: Option<String>,
    pub(crate) disabled: bool,
    pub(crate) merged: Vec<(String, Option<Tensor>)>,
}

/// The LoRA adapters of one [`Linear`], [`Embedding`] or convolution ([`Conv`]) layer, by
/// adapter name: PEFT's `LoraLayer`.
///
/// It lives inside the layer (see [the module docs](crate::peft)), so its parameters are the
/// layer's children: `<path>.lora_A.<adapter>.weight` `[r, in_features]`,
/// `<path>.lora_B.<adapter>.weight` `[out_features, r]` and, for DoRA,
/// `<path>.lora_magnitude_vector.<adapter>.weight` `[out_features]`; an embedding's
/// `<path>.lora_embedding_A.<adapter>` `[r, num_embeddings]` and
/// `<path>.lora_embedding_B.<adapter>` `[embedding_dim, r]` (DoRA's magnitude
/// `[embedding_dim]`); a convolution's `lora_A` a convolution `[r, in_channels, *kernel_size]`,
/// its `lora_B` a 1-wide one `[out_channels, r / groups, 1, …]` (DoRA's magnitude
/// `[1, out_channels, 1, …]`).
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct LoraLayer {
    pub(crate) lora_dropout: ModuleDict<Dropout>,
    #[module(rename = "lora_A")]
    pub(crate) lora_a: ModuleDict<LoraFactor>,
    #[module(rename = "lora_B")]
    pub(crate) lora_b: ModuleDict<LoraFactor>,
    #[module(rename = "lora_embedding_A")]
    pub(crate) lora_embedding_a: BTreeMap<String, Param>,
    #[module(rename = "lora_embedding_B")]
    pub(crate) lora_embedding_b: BTreeMap<String, Param>,
    pub(crate) lora_magnitude_vector: ModuleDict<DoraLinearLayer>,
    #[module(skip)]
    pub(crate) adapters: Vec<AdapterSettings>,
    #[module(skip)]
    pub(crate) kind: Kind,
    #[module(skip)]
    state: Mutex<LayerState>,
}

impl Clone for LoraLayer {
    fn clone(&self) -> Self {
        let state = self.lock();
        Self {
            lora_dropout: self.lora_dropout.clone(),
            lora_a: self.lora_a.clone(),
            lora_b: self.lora_b.clone(),
            lora_embedding_a: self.lora_embedding_a.clone(),
            lora_embedding_b: self.lora_embedding_b.clone(),
            lora_magnitude_vector: self.lora_magnitude_vector.clone(),
            adapters: self.adapters.clone(),
            kind: self.kind,
            state: Mutex::new(LayerState {
                active: state.active.clone(),
                disabled: state.disabled,
                merged: state.merged.clone(),
            }),
        }
    }
}

impl LoraLayer {
    pub(crate) fn new(kind: Kind) -> Self {
        Self {
            lora_dropout: ModuleDict::new(),
            lora_a: ModuleDict::new(),
            lora_b: ModuleDict::new(),
            lora_embedding_a: BTreeMap::new(),
            lora_embedding_b: BTreeMap::new(),
            lora_magnitude_vector: ModuleDict::new(),
            adapters: Vec::new(),
            kind,
            state: Mutex::new(LayerState::default()),
        }
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, LayerState> {
        // A panic while the lock was held left plain data behind: use it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Adds a built adapter; the first one becomes the active one.
    pub(crate) fn add(&mut self, adapter: Adapter) -> Result<()> {
        let name = adapter.settings.name.clone();
        self.lora_dropout.insert(name.clone(), adapter.dropout)?;
        let magnitude = match adapter.weights {
            AdapterWeights::Factors {
                lora_a,
                lora_b,
                magnitude,
            } => {
                self.lora_a.insert(name.clone(), *lora_a)?;
                self.lora_b.insert(name.clone(), *lora_b)?;
                magnitude
            }
            AdapterWeights::Embedding { a, b, magnitude } => {
                self.lora_embedding_a.insert(name.clone(), a);
                self.lora_embedding_b.insert(name.clone(), b);
                magnitude
            }
        };
        if let Some(m) = magnitude {
            self.lora_magnitude_vector.insert(name.clone(), m)?;
        }
        self.adapters.push(adapter.settings);
        self.lock().active.get_or_insert(name);
        Ok(())
    }

    /// Removes the adapter `name` (it must not be merged); `true` when the layer has none left.
    pub(crate) fn remove(&mut self, name: &str) -> bool {
        self.lora_dropout.remove(name);
        self.lora_a.remove(name);
        self.lora_b.remove(name);
        self.lora_embedding_a.remove(name);
        self.lora_embedding_b.remove(name);
        self.lora_magnitude_vector.remove(name);
        self.adapters.retain(|a| a.name != name);
        let mut state = self.lock();
        if state.active.as_deref() == Some(name) {
            state.active = self.adapters.first().map(|a| a.name.clone());
        }
        self.adapters.is_empty()
    }

    pub(crate) fn has(&self, name: &str) -> bool {
        self.adapters.iter().any(|a| a.name == name)
    }

    pub(crate) fn settings(&self, name: &str) -> Option<&AdapterSettings> {
        self.adapters.iter().find(|a| a.name == name)
    }

    /// The adapter the forward uses (PEFT's `active_adapter`).
    pub fn active_adapter(&self) -> Option<String> {
        self.lock().active.clone()
    }

    /// The adapters' names, in the order they were added.
    pub fn adapter_names(&self) -> Vec<String> {
        self.adapters.iter().map(|a| a.name.clone()).collect()
    }

    /// The rank and scale of the adapter `name` (`lora_alpha / r`, or `/ sqrt(r)` with rsLoRA).
    pub fn rank_and_scaling(&self, name: &str) -> Option<(usize, f64)> {
        self.settings(name).map(|s| (s.r, s.scaling))
    }

    pub(crate) fn set_active(&self, name: &str) {
        self.lock().active = Some(name.to_owned());
    }

    pub(crate) fn set_disabled(&self, disabled: bool) -> bool {
        std::mem::replace(&mut self.lock().disabled, disabled)
    }

    /// The adapters merged into the base weight, in merge order (PEFT's `merged_adapters`).
    pub fn merged_adapters(&self) -> Vec<String> {
        self.lock().merged.iter().map(|(n, _)| n.clone()).collect()
    }

    /// The adapter the forward adds, unless the adapters are disabled or merged.
    fn applies(&self) -> Option<(String, &AdapterSettings)> {
        let state = self.lock();
        if state.disabled || !state.merged.is_empty() {
            return None;
        }
        let active = state.active.clone()?;
        drop(state);
        let settings = self.settings(&active)?;
        Some((active, settings))
    }

    /// `result` (the base `Linear`'s output for `x`) with the active adapter's contribution
    /// added: PEFT's `lora.Linear.forward` for one active adapter.
    pub(crate) fn forward(&self, base: &Linear, x: &Tensor, result: Tensor) -> Result<Tensor> {
        let bias = base.bias.as_ref().map(Param::tensor).transpose()?;
        let weight = &base.weight;
        self.forward_factors(weight, bias, x, result, |x| {
            module_kernels::linear(x, &weight.tensor()?, None)
        })
    }

    /// `result` (the base convolution's output for `x`) with the active adapter's contribution
    /// added: PEFT's `lora.Conv1d/2d/3d` forward.
    pub(crate) fn forward_conv<const D: usize>(
        &self,
        base: &Conv<D>,
        x: &Tensor,
        result: Tensor,
    ) -> Result<Tensor> {
        let bias = base.bias.as_ref().map(Param::tensor).transpose()?;
        self.forward_factors(&base.weight, bias, x, result, |x| {
            // The base's convolution without its bias (and without its adapters).
            let plain = Conv::<D> {
                weight: base.weight.clone(),
                bias: None,
                config: base.config,
                lora: None,
                modules_to_save: None,
                parametrizations: None,
            };
            plain.base_forward(x)
        })
    }

    /// LoRA's `result + B(A(dropout(x))) · scaling`, or DoRA's (PEFT's `DoraLinearLayer` and
    /// `_DoraConvNdLayer` forward): the magnitude over the adapted weight's norms, the norms
    /// treated as constants (section 4.3 of the paper). `bias` is the base's, `plain` the base's
    /// output without it (for a dropped-out input).
    fn forward_factors(
        &self,
        weight: &Param,
        bias: Option<Tensor>,
        x: &Tensor,
        result: Tensor,
        plain: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<Tensor> {
        let Some((active, settings)) = self.applies() else {
            return Ok(result);
        };
        let (a, b) = (&self.lora_a[&active], &self.lora_b[&active]);
        let dropout = &self.lora_dropout[&active];
        let scaling = settings.scaling;
        if !settings.use_dora {
            let update = b.apply(&a.apply(&dropout.call(x)?)?)?;
            // `result + update * scaling` as one op in training (no scaled copy of the update
            // kept in the graph).
            return module_kernels::add_scaled(&result, &update, scaling);
        }
        let weight = weight.tensor()?;
        let delta = self.delta(&active, weight.dims())?;
        let norm = self.kind.norm(&(weight.detach() + delta)?)?.detach();
        let magnitude = self.lora_magnitude_vector[&active].weight.tensor()?;
        let scale = self.kind.output_view(&(magnitude.flatten_all()? / norm)?)?;
        let (x, base_result) = if dropout.p == 0.0 || !dropout.mode.is_training() {
            let without_bias = match bias {
                Some(bias) => result.broadcast_sub(&self.kind.output_view(&bias)?)?,
                None => result.clone(),
            };
            (x.clone(), without_bias)
        } else {
            let x = dropout.call(x)?;
            let y = plain(&x)?;
            (x, y)
        };
        let update = b.apply(&a.apply(&x)?)?;
        let dora = (base_result.broadcast_mul(&(scale.clone() - 1.0)?)?
            + (update * scaling)?.broadcast_mul(&scale)?)?;
        Ok((result + dora)?)
    }

    /// `rows` (the table's rows for `ids`) with the active adapter's added: PEFT's
    /// `lora.Embedding.forward`, `rows + (A.T[ids] @ B.T) · scaling` (no dropout, as in PEFT);
    /// with DoRA both scaled by the magnitude over the adapted table's column norms (PEFT's
    /// `DoraEmbeddingLayer`).
    pub(crate) fn forward_embedding(
        &self,
        base: &Embedding,
        ids: &Tensor,
        rows: Tensor,
    ) -> Result<Tensor> {
        let Some((active, settings)) = self.applies() else {
            return Ok(rows);
        };
        let a = self.lora_embedding_a[&active].tensor()?;
        let b = self.lora_embedding_b[&active].tensor()?;
        let after_a = base.lookup(&a.t()?.contiguous()?, ids)?;
        let update = after_a.broadcast_matmul(&b.t()?)?;
        let adapted = (rows + (update * settings.scaling)?)?;
        if !settings.use_dora {
            return Ok(adapted);
        }
        let weight = base.weight.tensor()?;
        let delta = self.delta(&active, weight.dims())?;
        let norm = self.kind.norm(&(weight.detach() + delta)?)?.detach();
        let magnitude = self.lora_magnitude_vector[&active].weight.tensor()?;
        Ok(adapted.broadcast_mul(&(magnitude / norm)?)?)
    }
}
