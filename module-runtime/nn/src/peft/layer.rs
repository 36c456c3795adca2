//! [`LoraLayer`]: the adapters a [`Linear`] holds (PEFT's `lora.Linear` without the wrapping
//! module): `lora_A`, `lora_B`, `lora_dropout` and DoRA's `lora_magnitude_vector`, by adapter
//! name; their forward, and merging them into the base weight and back.

use std::sync::{Arc, Mutex};

use candle_core::{Tensor, D};

use crate::container::ModuleDict;
use crate::dropout::Dropout;
use crate::error::Result;
use crate::linear::Linear;
use crate::peft::config::{InitLoraWeights, LoraConfig};
use crate::{Module, ModuleExt, Param};
use module_core::PeftError;

/// DoRA's trained magnitude of one adapter: one value per output row (PEFT's
/// `lora.dora.DoraLinearLayer`, whose `weight` this is).
#[derive(Module, Clone, Debug)]
#[module(crate = module_core)]
#[module(paths)]
#[module(class_name = "lora.dora.DoraLinearLayer")]
pub struct DoraLinearLayer {
    /// `[out_features]`: the norm of each row of the adapted weight, as trained.
    pub weight: Param,
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
/// which are merged into the base weight (with DoRA's row norms at the time, which unmerging
/// needs).
#[derive(Debug, Default)]
struct LayerState {
    active: Option<String>,
    disabled: bool,
    merged: Vec<(String, Option<Tensor>)>,
}

/// The LoRA adapters of one [`Linear`] layer, by adapter name: PEFT's `LoraLayer`.
///
/// It lives inside the `Linear` (see [the module docs](crate::peft)), so its parameters are the
/// layer's children: `<path>.lora_A.<adapter>.weight` `[r, in_features]`,
/// `<path>.lora_B.<adapter>.weight` `[out_features, r]` and, for DoRA,
/// `<path>.lora_magnitude_vector.<adapter>.weight` `[out_features]`.
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct LoraLayer {
    pub(crate) lora_dropout: ModuleDict<Dropout>,
    #[module(rename = "lora_A")]
    pub(crate) lora_a: ModuleDict<Linear>,
    #[module(rename = "lora_B")]
    pub(crate) lora_b: ModuleDict<Linear>,
    pub(crate) lora_magnitude_vector: ModuleDict<DoraLinearLayer>,
    #[module(skip)]
    pub(crate) adapters: Vec<AdapterSettings>,
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
            lora_magnitude_vector: self.lora_magnitude_vector.clone(),
            adapters: self.adapters.clone(),
            state: Mutex::new(LayerState {
                active: state.active.clone(),
                disabled: state.disabled,
                merged: state.merged.clone(),
            }),
        }
    }
}

/// Each row's Euclidean norm: `torch.linalg.norm(w, dim=1)`.
fn row_norm(w: &Tensor) -> Result<Tensor> {
    Ok(w.sqr()?.sum(D::Minus1)?.sqrt()?)
}

impl LoraLayer {
    pub(crate) fn new() -> Self {
        Self {
            lora_dropout: ModuleDict::new(),
            lora_a: ModuleDict::new(),
            lora_b: ModuleDict::new(),
            lora_magnitude_vector: ModuleDict::new(),
            adapters: Vec::new(),
            state: Mutex::new(LayerState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LayerState> {
        // A panic while the lock was held left plain data behind: use it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The adapter named `name`, built for `base` as `config` says (rank and scale for `path`):
    /// not yet added, so that a model's adapters are all built before any is added.
    pub(crate) fn build_adapter(
        name: &str,
        base: &Linear,
        path: &str,
        config: &Arc<LoraConfig>,
    ) -> Result<Adapter> {
        let (r, scaling) = config.scaling_for(path);
        let weight = base.weight.tensor()?;
        let (dtype, device) = (weight.dtype(), weight.device().clone());
        let (out_features, in_features) = weight.dims2()?;
        let linear =
            |i, o| Linear::with_config(i, o, crate::LinearConfig { bias: false, dtype }, &device);
        let lora_a = linear(in_features, r)?;
        let lora_b = linear(r, out_features)?;
        match config.init_lora_weights {
            InitLoraWeights::Random => {}
            InitLoraWeights::Default => {
                lora_b.weight.set(&lora_b.weight.tensor()?.zeros_like()?)?
            }
            InitLoraWeights::Gaussian => {
                let a = Tensor::randn(0f32, 1.0 / r as f32, (r, in_features), &device)?;
                lora_a.weight.set(&a.to_dtype(dtype)?)?;
                lora_b.weight.set(&lora_b.weight.tensor()?.zeros_like()?)?;
            }
        }
        let magnitude = if config.use_dora {
            let delta = lora_b.weight.tensor()?.matmul(&lora_a.weight.tensor()?)?;
            let norm = row_norm(&(weight.detach() + (delta * scaling)?)?)?;
            Some(DoraLinearLayer {
                weight: Param::new(norm)?,
            })
        } else {
            None
        };
        Ok(Adapter {
            settings: AdapterSettings {
                name: name.to_owned(),
                config: config.clone(),
                r,
                scaling,
                use_dora: config.use_dora,
            },
            dropout: Dropout::new(config.lora_dropout),
            lora_a,
            lora_b,
            magnitude,
        })
    }

    /// Adds a built adapter; the first one becomes the active one.
    pub(crate) fn add(&mut self, adapter: Adapter) -> Result<()> {
        let name = adapter.settings.name.clone();
        self.lora_dropout.insert(name.clone(), adapter.dropout)?;
        self.lora_a.insert(name.clone(), adapter.lora_a)?;
        self.lora_b.insert(name.clone(), adapter.lora_b)?;
        if let Some(m) = adapter.magnitude {
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

    /// `result` (the base layer's output for `x`) with the active adapter's contribution added:
    /// PEFT's `lora.Linear.forward` for one active adapter.
    pub(crate) fn forward(&self, base: &Linear, x: &Tensor, result: Tensor) -> Result<Tensor> {
        let active = {
            let state = self.lock();
            if state.disabled || !state.merged.is_empty() {
                return Ok(result);
            }
            match state.active.clone() {
                Some(active) => active,
                None => return Ok(result),
            }
        };
        let Some(settings) = self.settings(&active) else {
            return Ok(result);
        };
        let (a, b) = (&self.lora_a[&active], &self.lora_b[&active]);
        let dropout = &self.lora_dropout[&active];
        let scaling = settings.scaling;
        if !settings.use_dora {
            let update = b.call(&a.call(&dropout.call(x)?)?)?;
            return Ok((result + (update * scaling)?)?);
        }
        // DoRA (PEFT's `DoraLinearLayer.forward`): the magnitude over the adapted weight's row
        // norms, the norms treated as constants (section 4.3 of the paper).
        let weight = base.weight.tensor()?;
        let lora_weight = b.weight.tensor()?.matmul(&a.weight.tensor()?)?.detach();
        let norm = row_norm(&(weight.detach() + (lora_weight * scaling)?)?)?.detach();
        let magnitude = self.lora_magnitude_vector[&active].weight.tensor()?;
        let scale = (magnitude / norm)?;
        let (x, base_result) = if dropout.p == 0.0 || !dropout.mode.is_training() {
            let without_bias = match &base.bias {
                Some(bias) => result.broadcast_sub(&bias.tensor()?)?,
                None => result.clone(),
            };
            (x.clone(), without_bias)
        } else {
            let x = dropout.call(x)?;
            let y = module_kernels::linear(&x, &weight, None)?;
            (x, y)
        };
        let update = b.call(&a.call(&x)?)?;
        let dora = (base_result.broadcast_mul(&(scale.clone() - 1.0)?)?
            + (update * scaling)?.broadcast_mul(&scale)?)?;
        Ok((result + dora)?)
    }

    /// `scaling · B A`, the active adapter's update of the weight (`get_delta_weight`).
    fn delta(&self, name: &str) -> Result<Tensor> {
        let settings = self.settings(name).expect("a known adapter");
        let (a, b) = (
            self.lora_a[name].weight.tensor()?,
            self.lora_b[name].weight.tensor()?,
        );
        Ok((b.matmul(&a)? * settings.scaling)?.detach())
    }

    /// Adds the adapter `name` into `base`'s weight (PEFT's `merge`); DoRA's row norms are kept
    /// for [`unmerge`](Self::unmerge).
    pub(crate) fn merge(&self, base: &Linear, path: &str, name: &str) -> Result<()> {
        if base.weight.is_quantized() {
            return Err(PeftError::State {
                path: path.to_owned(),
                message: "cannot merge an adapter into a quantized weight".into(),
            }
            .into());
        }
        if self.lock().merged.iter().any(|(n, _)| n == name) {
            return Ok(());
        }
        let settings = self.settings(name).expect("a known adapter");
        let weight = base.weight.tensor()?.detach();
        let delta = self.delta(name)?;
        let (merged, norm) = if settings.use_dora {
            let norm = row_norm(&(&weight + &delta)?)?;
            let magnitude = self.lora_magnitude_vector[name].weight.tensor()?.detach();
            let factor = (magnitude / &norm)?.unsqueeze(1)?;
            ((weight + delta)?.broadcast_mul(&factor)?, Some(norm))
        } else {
            ((weight + delta)?, None)
        };
        base.weight.set(&merged)?;
        self.lock().merged.push((name.to_owned(), norm));
        Ok(())
    }

    /// Takes every merged adapter back out of `base`'s weight, the last merged first (PEFT's
    /// `unmerge`).
    pub(crate) fn unmerge(&self, base: &Linear) -> Result<()> {
        loop {
            let Some((name, norm)) = self.lock().merged.pop() else {
                return Ok(());
            };
            let weight = base.weight.tensor()?.detach();
            let delta = self.delta(&name)?;
            let unmerged = match norm {
                Some(norm) => {
                    let magnitude = self.lora_magnitude_vector[&name].weight.tensor()?.detach();
                    let factor = (magnitude / norm)?.unsqueeze(1)?;
                    (weight.broadcast_div(&factor)? - delta)?
                }
                None => (weight - delta)?,
            };
            base.weight.set(&unmerged)?;
        }
    }

    /// PEFT's `print(model)` lines of the wrapped layer after `(base_layer)`.
    pub(crate) fn repr_lines(&self) -> Vec<String> {
        let dropouts: Vec<String> = self
            .lora_dropout
            .iter()
            .map(|(name, d)| match d.p {
                0.0 => format!("({name}): Identity()"),
                _ => format!("({name}): {}", module_core::module_repr(d)),
            })
            .collect();
        let dict = |label: &str, lines: Vec<String>| {
            if lines.is_empty() {
                return format!("({label}): ModuleDict()");
            }
            format!(
                "({label}): ModuleDict(\n  {}\n)",
                lines.join("\n").replace('\n', "\n  ")
            )
        };
        let entries = |d: &dyn Module| {
            let mut lines = Vec::new();
            d.visit_children(&mut |name, child| {
                if let module_core::Child::Module { module, .. } = child {
                    lines.push(format!("({name}): {}", module_core::module_repr(module)));
                }
            });
            lines
        };
        vec![
            dict("lora_dropout", dropouts),
            dict("lora_A", entries(&self.lora_a)),
            dict("lora_B", entries(&self.lora_b)),
            "(lora_embedding_A): ParameterDict()".to_owned(),
            "(lora_embedding_B): ParameterDict()".to_owned(),
            dict(
                "lora_magnitude_vector",
                entries(&self.lora_magnitude_vector),
            ),
        ]
    }
}

/// One adapter of one layer, built and not yet added.
pub(crate) struct Adapter {
    pub(crate) settings: AdapterSettings,
    pub(crate) dropout: Dropout,
    pub(crate) lora_a: Linear,
    pub(crate) lora_b: Linear,
    pub(crate) magnitude: Option<DoraLinearLayer>,
}
