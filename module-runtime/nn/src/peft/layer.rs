//! [`LoraLayer`]: the adapters a [`Linear`] or [`Embedding`] holds (PEFT's `lora.Linear` and
//! `lora.Embedding` without the wrapping module): `lora_A`, `lora_B`, `lora_dropout`, DoRA's
//! `lora_magnitude_vector`, an embedding's `lora_embedding_A`/`_B`, by adapter name; their
//! forward, merging them into the base weight and back, PEFT's `print(model)` text.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use candle_core::{Tensor, D};

use crate::container::ModuleDict;
use crate::dropout::Dropout;
use crate::embedding::Embedding;
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

/// A layer that holds adapters: PEFT's `lora.Linear` and `lora.Embedding`.
#[derive(Clone, Copy)]
pub(crate) enum Host<'a> {
    Linear(&'a Linear),
    Embedding(&'a Embedding),
}

impl<'a> Host<'a> {
    /// `m` as a layer that takes adapters, if it is one.
    pub(crate) fn of(m: &'a dyn Module) -> Option<Self> {
        m.downcast_ref::<Linear>()
            .map(Host::Linear)
            .or_else(|| m.downcast_ref::<Embedding>().map(Host::Embedding))
    }

    pub(crate) fn lora(self) -> Option<&'a LoraLayer> {
        match self {
            Host::Linear(l) => l.lora.as_deref(),
            Host::Embedding(e) => e.lora.as_deref(),
        }
    }

    pub(crate) fn weight(self) -> &'a Param {
        match self {
            Host::Linear(l) => &l.weight,
            Host::Embedding(e) => &e.weight,
        }
    }
}

/// The adapter slot of `m`, mutably, if `m` takes adapters.
pub(crate) fn slot_mut(m: &mut dyn Module) -> Option<&mut Option<Box<LoraLayer>>> {
    if m.is::<Linear>() {
        return m.downcast_mut::<Linear>().map(|l| &mut l.lora);
    }
    m.downcast_mut::<Embedding>().map(|e| &mut e.lora)
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

/// The LoRA adapters of one [`Linear`] or [`Embedding`] layer, by adapter name: PEFT's
/// `LoraLayer`.
///
/// It lives inside the layer (see [the module docs](crate::peft)), so its parameters are the
/// layer's children: `<path>.lora_A.<adapter>.weight` `[r, in_features]`,
/// `<path>.lora_B.<adapter>.weight` `[out_features, r]` and, for DoRA,
/// `<path>.lora_magnitude_vector.<adapter>.weight` `[out_features]`; an embedding's
/// `<path>.lora_embedding_A.<adapter>` `[r, num_embeddings]` and
/// `<path>.lora_embedding_B.<adapter>` `[embedding_dim, r]`.
#[derive(Module, Debug)]
#[module(crate = module_core)]
#[module(paths)]
pub struct LoraLayer {
    pub(crate) lora_dropout: ModuleDict<Dropout>,
    #[module(rename = "lora_A")]
    pub(crate) lora_a: ModuleDict<Linear>,
    #[module(rename = "lora_B")]
    pub(crate) lora_b: ModuleDict<Linear>,
    #[module(rename = "lora_embedding_A")]
    pub(crate) lora_embedding_a: BTreeMap<String, Param>,
    #[module(rename = "lora_embedding_B")]
    pub(crate) lora_embedding_b: BTreeMap<String, Param>,
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
            lora_embedding_a: self.lora_embedding_a.clone(),
            lora_embedding_b: self.lora_embedding_b.clone(),
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
            lora_embedding_a: BTreeMap::new(),
            lora_embedding_b: BTreeMap::new(),
            lora_magnitude_vector: ModuleDict::new(),
            adapters: Vec::new(),
            state: Mutex::new(LayerState::default()),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, LayerState> {
        // A panic while the lock was held left plain data behind: use it.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The adapter named `name`, built for `host` as `config` says (rank and scale for `path`):
    /// not yet added, so that a model's adapters are all built before any is added.
    pub(crate) fn build_adapter(
        name: &str,
        host: Host<'_>,
        path: &str,
        config: &Arc<LoraConfig>,
    ) -> Result<Adapter> {
        let (r, scaling) = config.scaling_for(path);
        let weight = host.weight().tensor()?;
        let (dtype, device) = (weight.dtype(), weight.device().clone());
        let settings = AdapterSettings {
            name: name.to_owned(),
            config: config.clone(),
            r,
            scaling,
            use_dora: config.use_dora,
        };
        let dropout = Dropout::new(config.lora_dropout);
        let base = match host {
            Host::Linear(_) => return Self::build_linear(settings, dropout, &weight),
            Host::Embedding(base) => base,
        };
        if config.use_dora {
            return Err(PeftError::Unsupported {
                field: "use_dora".into(),
                value: "true".into(),
                reason: format!("DoRA on the Embedding `{path}` is not implemented"),
            }
            .into());
        }
        if base.has_max_norm() {
            return Err(PeftError::UnsupportedLayer {
                path: path.to_owned(),
                found: "Embedding with max_norm".into(),
            }
            .into());
        }
        // PEFT's `lora.Embedding`: A `[r, num_embeddings]`, B `[embedding_dim, r]`; its init
        // (`true` or "gaussian") makes A zero and B normal, `false` both normal.
        let (num, dim) = weight.dims2()?;
        let normal = |dims: (usize, usize)| -> Result<Tensor> {
            Ok(Tensor::randn(0f32, 1., dims, &device)?.to_dtype(dtype)?)
        };
        let a = match config.init_lora_weights {
            InitLoraWeights::Random => normal((r, num))?,
            _ => Tensor::zeros((r, num), dtype, &device)?,
        };
        Ok(Adapter {
            settings,
            dropout,
            weights: AdapterWeights::Embedding {
                a: Param::new(a)?,
                b: Param::new(normal((dim, r))?)?,
            },
        })
    }

    /// PEFT's `lora.Linear` adapter: `lora_A` `[r, in]` as `nn.Linear`'s init (or normal with
    /// std `1 / r` for "gaussian"), `lora_B` `[out, r]` zero (or `nn.Linear`'s init for
    /// `false`), DoRA's magnitude the adapted weight's row norms.
    fn build_linear(
        settings: AdapterSettings,
        dropout: Dropout,
        weight: &Tensor,
    ) -> Result<Adapter> {
        let (r, scaling) = (settings.r, settings.scaling);
        let (dtype, device) = (weight.dtype(), weight.device().clone());
        let (out_features, in_features) = weight.dims2()?;
        let linear =
            |i, o| Linear::with_config(i, o, crate::LinearConfig { bias: false, dtype }, &device);
        let lora_a = linear(in_features, r)?;
        let lora_b = linear(r, out_features)?;
        match settings.config.init_lora_weights {
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
        let magnitude = if settings.use_dora {
            let delta = lora_b.weight.tensor()?.matmul(&lora_a.weight.tensor()?)?;
            let norm = row_norm(&(weight.detach() + (delta * scaling)?)?)?;
            Some(DoraLinearLayer {
                weight: Param::new(norm)?,
            })
        } else {
            None
        };
        Ok(Adapter {
            settings,
            dropout,
            weights: AdapterWeights::Linear {
                lora_a,
                lora_b,
                magnitude,
            },
        })
    }

    /// Adds a built adapter; the first one becomes the active one.
    pub(crate) fn add(&mut self, adapter: Adapter) -> Result<()> {
        let name = adapter.settings.name.clone();
        self.lora_dropout.insert(name.clone(), adapter.dropout)?;
        match adapter.weights {
            AdapterWeights::Linear {
                lora_a,
                lora_b,
                magnitude,
            } => {
                self.lora_a.insert(name.clone(), lora_a)?;
                self.lora_b.insert(name.clone(), lora_b)?;
                if let Some(m) = magnitude {
                    self.lora_magnitude_vector.insert(name.clone(), m)?;
                }
            }
            AdapterWeights::Embedding { a, b } => {
                self.lora_embedding_a.insert(name.clone(), a);
                self.lora_embedding_b.insert(name.clone(), b);
            }
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

    /// `result` (the base layer's output for `x`) with the active adapter's contribution added:
    /// PEFT's `lora.Linear.forward` for one active adapter.
    pub(crate) fn forward(&self, base: &Linear, x: &Tensor, result: Tensor) -> Result<Tensor> {
        let Some((active, settings)) = self.applies() else {
            return Ok(result);
        };
        let (a, b) = (&self.lora_a[&active], &self.lora_b[&active]);
        let dropout = &self.lora_dropout[&active];
        let scaling = settings.scaling;
        if !settings.use_dora {
            let update = b.call(&a.call(&dropout.call(x)?)?)?;
            // `result + update * scaling` as one op in training (no scaled copy of the update
            // kept in the graph).
            return module_kernels::add_scaled(&result, &update, scaling);
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

    /// `rows` (the table's rows for `ids`) with the active adapter's added: PEFT's
    /// `lora.Embedding.forward`, `rows + (A.T[ids] @ B.T) · scaling` (no dropout, as in PEFT).
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
        Ok((rows + (update * settings.scaling)?)?)
    }

    /// `scaling · B A`, the adapter's update of the weight (`get_delta_weight`): `[out, in]` for
    /// a `Linear`, `[num_embeddings, embedding_dim]` for an `Embedding`.
    fn delta(&self, name: &str) -> Result<Tensor> {
        let settings = self.settings(name).expect("a known adapter");
        let delta = match self.lora_embedding_a.get(name) {
            Some(a) => {
                let b = self.lora_embedding_b[name].tensor()?;
                b.matmul(&a.tensor()?)?.t()?
            }
            None => {
                let a = self.lora_a[name].weight.tensor()?;
                self.lora_b[name].weight.tensor()?.matmul(&a)?
            }
        };
        Ok((delta * settings.scaling)?.detach())
    }

    /// Adds the adapter `name` into `base`'s weight (PEFT's `merge`); DoRA's row norms are kept
    /// for [`unmerge`](Self::unmerge).
    pub(crate) fn merge(&self, base: &Param, path: &str, name: &str) -> Result<()> {
        if base.is_quantized() {
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
        let weight = base.tensor()?.detach();
        let delta = self.delta(name)?;
        let (merged, norm) = if settings.use_dora {
            let norm = row_norm(&(&weight + &delta)?)?;
            let magnitude = self.lora_magnitude_vector[name].weight.tensor()?.detach();
            let factor = (magnitude / &norm)?.unsqueeze(1)?;
            ((weight + delta)?.broadcast_mul(&factor)?, Some(norm))
        } else {
            ((weight + delta)?, None)
        };
        base.set(&merged.contiguous()?)?;
        self.lock().merged.push((name.to_owned(), norm));
        Ok(())
    }

    /// Takes every merged adapter back out of `base`'s weight, the last merged first (PEFT's
    /// `unmerge`).
    pub(crate) fn unmerge(&self, base: &Param) -> Result<()> {
        loop {
            let Some((name, norm)) = self.lock().merged.pop() else {
                return Ok(());
            };
            let weight = base.tensor()?.detach();
            let delta = self.delta(&name)?;
            let unmerged = match norm {
                Some(norm) => {
                    let magnitude = self.lora_magnitude_vector[&name].weight.tensor()?.detach();
                    let factor = (magnitude / norm)?.unsqueeze(1)?;
                    (weight.broadcast_div(&factor)? - delta)?
                }
                None => (weight - delta)?,
            };
            base.set(&unmerged.contiguous()?)?;
        }
    }

    /// PEFT's `print(model)` body of the wrapped layer: `(base_layer): <base>`, then the
    /// adapters' dictionaries in PEFT's order.
    pub(crate) fn wrapped_repr(&self, base: &str) -> String {
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
        [
            format!("(base_layer): {base}"),
            dict("lora_dropout", dropouts),
            dict("lora_A", entries(&self.lora_a)),
            dict("lora_B", entries(&self.lora_b)),
            parameter_dict("lora_embedding_A", &self.lora_embedding_a),
            parameter_dict("lora_embedding_B", &self.lora_embedding_b),
            dict(
                "lora_magnitude_vector",
                entries(&self.lora_magnitude_vector),
            ),
        ]
        .join("\n")
    }
}

/// PyTorch's `ParameterDict` repr: `(label): ParameterDict(  (default): Parameter containing:
/// [torch.FloatTensor of size 4x12])`, its `extra_repr` lines inside the parentheses.
fn parameter_dict(label: &str, params: &BTreeMap<String, Param>) -> String {
    let lines: Vec<String> = params
        .iter()
        .map(|(name, p)| {
            let kind = match p.dtype() {
                candle_core::DType::F16 => "HalfTensor",
                candle_core::DType::BF16 => "BFloat16Tensor",
                candle_core::DType::F64 => "DoubleTensor",
                _ => "FloatTensor",
            };
            let device = if p.device().is_cpu() { "" } else { "cuda." };
            let size: Vec<String> = p.shape().dims().iter().map(usize::to_string).collect();
            format!(
                "  ({name}): Parameter containing: [torch.{device}{kind} of size {}]",
                size.join("x")
            )
        })
        .collect();
    match lines.len() {
        0 => format!("({label}): ParameterDict()"),
        1 => format!("({label}): ParameterDict({})", lines[0]),
        _ => format!("({label}): ParameterDict(\n  {}\n)", lines.join("\n  ")),
    }
}

/// One adapter of one layer, built and not yet added.
pub(crate) struct Adapter {
    pub(crate) settings: AdapterSettings,
    pub(crate) dropout: Dropout,
    pub(crate) weights: AdapterWeights,
}

/// An adapter's tensors: a `Linear`'s factor layers (and DoRA's magnitude), or an
/// `Embedding`'s factor matrices.
pub(crate) enum AdapterWeights {
    Linear {
        lora_a: Linear,
        lora_b: Linear,
        magnitude: Option<DoraLinearLayer>,
    },
    Embedding {
        a: Param,
        b: Param,
    },
}
