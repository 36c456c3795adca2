//! One adapter built for one layer, as PEFT's `update_layer` builds it (`lora.Linear`,
//! `lora.Embedding`, `lora.Conv1d`/`lora.Conv2d`), before it is added: [`Adapter`].

use std::sync::Arc;

use candle_core::Tensor;

use crate::conv::Conv;
use crate::dropout::Dropout;
use crate::error::Result;
use crate::linear::Linear;
use crate::peft::config::{InitLoraWeights, LoraConfig};
use crate::peft::host::{conv_factors, Host, Kind, LoraFactor};
use crate::peft::layer::{AdapterSettings, DoraLinearLayer};
use crate::Param;
use module_core::PeftError;

/// One adapter of one layer, built and not yet added.
pub(crate) struct Adapter {
    /// The kind of layer it was built for.
    pub(crate) kind: Kind,
    pub(crate) settings: AdapterSettings,
    pub(crate) dropout: Dropout,
    pub(crate) weights: AdapterWeights,
}

/// An adapter's tensors: a `Linear`'s or convolution's factor layers, or an `Embedding`'s
/// factor matrices; DoRA's magnitude with either.
pub(crate) enum AdapterWeights {
    Factors {
        lora_a: Box<LoraFactor>,
        lora_b: Box<LoraFactor>,
        magnitude: Option<DoraLinearLayer>,
    },
    Embedding {
        a: Param,
        b: Param,
        magnitude: Option<DoraLinearLayer>,
    },
}

impl AdapterWeights {
    /// The tensors by PEFT's part names (`lora_A`, `lora_B`, `lora_embedding_A`, …).
    pub(crate) fn parts(&self) -> Vec<(&'static str, &Param)> {
        let (mut parts, magnitude) = match self {
            Self::Factors {
                lora_a,
                lora_b,
                magnitude,
            } => (
                vec![("lora_A", lora_a.weight()), ("lora_B", lora_b.weight())],
                magnitude,
            ),
            Self::Embedding { a, b, magnitude } => (
                vec![("lora_embedding_A", a), ("lora_embedding_B", b)],
                magnitude,
            ),
        };
        if let Some(m) = magnitude {
            parts.push(("lora_magnitude_vector", &m.weight));
        }
        parts
    }
}

/// The adapter named `name`, built for `host` as `config` says (rank and scale for `path`): not
/// yet added, so that a model's adapters are all built before any is added. A layer the
/// adapter cannot fit (an `Embedding` with `max_norm`, a dilated convolution, a rank its groups
/// do not divide) is a typed error naming `path`.
pub(crate) fn build_adapter(
    name: &str,
    host: Host<'_>,
    path: &str,
    config: &Arc<LoraConfig>,
) -> Result<Adapter> {
    let (r, scaling) = config.scaling_for(path);
    let settings = AdapterSettings {
        name: name.to_owned(),
        config: config.clone(),
        r,
        scaling,
        use_dora: config.use_dora,
    };
    let dropout = Dropout::new(config.lora_dropout);
    let weight = host.weight().tensor()?;
    let (lora_a, lora_b) = match host {
        Host::Linear(_) => {
            let (out_features, in_features) = weight.dims2()?;
            let (dtype, device) = (weight.dtype(), weight.device());
            let linear = |i, o| {
                Linear::with_config(i, o, crate::LinearConfig { bias: false, dtype }, device)
            };
            (
                LoraFactor::Linear(linear(in_features, r)?),
                LoraFactor::Linear(linear(r, out_features)?),
            )
        }
        Host::Embedding(base) => {
            if base.has_max_norm() {
                return Err(PeftError::UnsupportedLayer {
                    path: path.to_owned(),
                    found: "Embedding with max_norm".into(),
                }
                .into());
            }
            return build_embedding(settings, dropout, &weight);
        }
        Host::Conv1d(base) => {
            let (a, b) = checked_conv_factors(base, path, &settings)?;
            (LoraFactor::Conv1d(a), LoraFactor::Conv1d(b))
        }
        Host::Conv2d(base) => {
            let (a, b) = checked_conv_factors(base, path, &settings)?;
            (LoraFactor::Conv2d(a), LoraFactor::Conv2d(b))
        }
        Host::Conv3d(base) => {
            let (a, b) = checked_conv_factors(base, path, &settings)?;
            (LoraFactor::Conv3d(a), LoraFactor::Conv3d(b))
        }
    };
    // PEFT's init: `true` A as the layer type's default init (Kaiming-uniform) and B zero,
    // "gaussian" A normal with std `1 / r` and B zero, `false` both as the default init.
    let (a, b) = (lora_a.weight(), lora_b.weight());
    match config.init_lora_weights {
        InitLoraWeights::Random => {}
        InitLoraWeights::Default => b.set(&b.tensor()?.zeros_like()?)?,
        InitLoraWeights::Gaussian => {
            let value = a.tensor()?;
            let normal = Tensor::randn(0f32, 1.0 / r as f32, value.shape(), value.device())?;
            a.set(&normal.to_dtype(value.dtype())?)?;
            b.set(&b.tensor()?.zeros_like()?)?;
        }
    }
    let magnitude = if settings.use_dora {
        let r = a.shape().dims()[0];
        let delta = b
            .tensor()?
            .reshape(((), r))?
            .matmul(&a.tensor()?.reshape((r, ()))?)?;
        let delta = (delta.reshape(weight.dims())? * scaling)?;
        Some(magnitude(host.kind(), &(weight.detach() + delta)?)?)
    } else {
        None
    };
    Ok(Adapter {
        kind: host.kind(),
        settings,
        dropout,
        weights: AdapterWeights::Factors {
            lora_a: Box::new(lora_a),
            lora_b: Box::new(lora_b),
            magnitude,
        },
    })
}

/// DoRA's magnitude at the start: the adapted weight's norms, in PEFT's shape.
fn magnitude(kind: Kind, adapted: &Tensor) -> Result<DoraLinearLayer> {
    let norm = kind.norm(adapted)?;
    let dims = kind.magnitude_dims(norm.elem_count());
    DoraLinearLayer::new(norm.reshape(dims)?, kind)
}

/// PEFT's `lora.Embedding` adapter: A `[r, num_embeddings]`, B `[embedding_dim, r]`; its init
/// (`true` or "gaussian") makes A zero and B normal, `false` both normal; DoRA's magnitude the
/// adapted table's column norms.
fn build_embedding(
    settings: AdapterSettings,
    dropout: Dropout,
    weight: &Tensor,
) -> Result<Adapter> {
    let (dtype, device) = (weight.dtype(), weight.device().clone());
    let r = settings.r;
    let (num, dim) = weight.dims2()?;
    let normal = |dims: (usize, usize)| -> Result<Tensor> {
        Ok(Tensor::randn(0f32, 1., dims, &device)?.to_dtype(dtype)?)
    };
    let a = match settings.config.init_lora_weights {
        InitLoraWeights::Random => normal((r, num))?,
        _ => Tensor::zeros((r, num), dtype, &device)?,
    };
    let b = normal((dim, r))?;
    let magnitude = if settings.use_dora {
        let delta = (b.matmul(&a)?.t()? * settings.scaling)?;
        Some(magnitude(Kind::Embedding, &(weight.detach() + delta)?)?)
    } else {
        None
    };
    Ok(Adapter {
        kind: Kind::Embedding,
        settings,
        dropout,
        weights: AdapterWeights::Embedding {
            a: Param::new(a)?,
            b: Param::new(b)?,
            magnitude,
        },
    })
}

/// A convolution's factors, after PEFT's checks: the rank divisible by the groups, and (where
/// PEFT's `lora_A`, which has no dilation, would give another output size than the base) no
/// dilation; DoRA over a grouped convolution is refused (PEFT's norms assume one group).
fn checked_conv_factors<const D: usize>(
    base: &Conv<D>,
    path: &str,
    settings: &AdapterSettings,
) -> Result<(Conv<D>, Conv<D>)> {
    let groups = base.config.groups;
    let dims = base.weight.shape().dims().to_vec();
    let kernel = &dims[2..];
    let dilation = base.config.dilation.for_dims::<D>().unwrap_or([1; D]);
    let class = format!("Conv{D}d");
    if kernel.iter().zip(&dilation).any(|(&k, &d)| k > 1 && d != 1) {
        return Err(PeftError::UnsupportedLayer {
            path: path.to_owned(),
            found: format!("{class} with dilation={dilation:?} (PEFT's lora_A has none)"),
        }
        .into());
    }
    if !settings.r.is_multiple_of(groups) {
        return Err(PeftError::InvalidConfig {
            field: "r".into(),
            message: format!(
                "`{path}` is a {class} with groups={groups}: the rank ({}) must be divisible by \
                 the groups, as in PEFT",
                settings.r
            ),
        }
        .into());
    }
    if settings.use_dora && groups > 1 {
        return Err(PeftError::Unsupported {
            field: "use_dora".into(),
            value: "true".into(),
            reason: format!("DoRA on the grouped {class} `{path}` (groups={groups})"),
        }
        .into());
    }
    conv_factors(base, settings.r)
}
