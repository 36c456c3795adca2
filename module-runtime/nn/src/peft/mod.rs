//! PEFT's adapters for any derived model: LoRA and DoRA on `Linear`, `Embedding`, `Conv1d`,
//! `Conv2d` and `Conv3d` layers, added by
//! [`get_peft_model`], trained, merged, disabled, and read and written in PEFT's files
//! (`adapter_config.json`, `adapter_model.safetensors`).
//!
//! # Design: the adapter lives in the layer
//!
//! PEFT replaces each targeted `nn.Linear` by a `lora.Linear` that holds the original as
//! `base_layer`. A Rust model's fields have fixed types, so a `Linear` field cannot become
//! another type without changing the user's struct. Instead every [`Linear`](crate::Linear),
//! [`Embedding`](crate::Embedding) and [`Conv`](crate::Conv) carries an empty slot for adapters (a flattened `Option<Box<LoraLayer>>`, no cost when empty:
//! the walk sees nothing, the forward one `match`), and [`get_peft_model`] fills the slots of the
//! layers the targets select, found by path through the same walk every traversal uses. So:
//!
//! - any derived model with `Linear`, `Embedding` or convolution fields (in `Vec`s,
//!   `ModuleList`s, `Lazy` cells once built)
//!   takes adapters unchanged; a layer behind a shared `Arc` cannot be modified and is a typed
//!   error;
//! - the base keeps its paths (`q_proj.weight`, not PEFT's `q_proj.base_layer.weight`), so the
//!   base model's state dict still loads; the adapter's parameters are the layer's children
//!   under PEFT's in-memory names (`q_proj.lora_A.default.weight`,
//!   `q_proj.lora_magnitude_vector.default.weight`);
//! - hooks on the layer's path see the adapted output (PEFT's hooks on the `lora.Linear`);
//!   `lora_A.default` and `lora_B.default` are modules of their own, called through `call`;
//! - `print(model)` shows PEFT's text: `lora.Linear(` (`lora.Embedding(`, `lora.Conv2d(`) with
//!   `(base_layer): Linear(...)` first.
//!
//! A convolution's adapter is PEFT's: `lora_A` a convolution with the base's kernel size, stride
//! and padding into `r` channels (no dilation: a dilated convolution is a typed error, where
//! PEFT's adapter would give an output of another size), `lora_B` a 1-wide convolution from `r`
//! to the output channels in the base's groups (the rank must be divisible by them; merging a
//! grouped convolution's adapter, and DoRA over one, are typed errors, as PEFT refuses or
//! miscomputes them). DoRA's magnitude is `[1, out_channels, 1, …]` on a convolution (`print(model)`
//! names it `lora.dora.lora.dora.DoraConv2dLayer()`, PEFT's doubled prefix) and
//! `[embedding_dim]` (one per column of the table) on an `Embedding`, as PEFT keeps them.
//!
//! Files use PEFT's keys: `base_model.model.<path>.lora_A.weight` (the adapter name dropped),
//! `base_model.model.<path>.lora_magnitude_vector` for DoRA, `base_model.model.<path>.lora_embedding_A`
//! for an embedding. Reading is strict: a config field
//! this runtime does not know, or a feature it does not implement, is a typed error naming the
//! field ([`PeftError`](module_core::PeftError)); so is a tensor of another shape or a key no layer
//! takes, before the model is touched.
//!
//! `modules_to_save` (PEFT's `ModulesToSaveWrapper`) works the same way: the layer is PEFT's
//! `original_module` and keeps its paths, its trainable copy is `<path>.modules_to_save.<adapter>`
//! ([`ModulesToSave`]), used instead of it while that adapter is active and the original while
//! disabled, saved as PEFT saves it (`base_model.model.<path>.weight`, the copy's values), and
//! printed as `ModulesToSaveWrapper(...)`. It covers the layer types that hold the slot
//! (`Linear`, `Embedding`, `Conv1d/2d/3d`, `LayerNorm`); a module of another type is
//! [`PeftError::UnsupportedModuleToSave`](module_core::PeftError::UnsupportedModuleToSave)
//! naming its path and type. As in PEFT, `merge_and_unload` and `unload` leave the layer with
//! the active copy's values; unlike PEFT, a module both targeted and in `modules_to_save` is an
//! error (PEFT's result there depends on the order it wraps them in).
//!
//! Not implemented yet (each a typed error when a config asks for it): an `Embedding` with
//! `max_norm`, `fan_in_fan_out`, the other initializations (PiSSA, OLoRA, LoftQ,
//! EVA, …), layer selection by `layers_to_transform`, `trainable_token_indices`.
//!
//! ```
//! use module_runtime::prelude::*;
//! use module_runtime::nn::peft::{get_peft_model, LoraConfig, PeftExt, TargetModules};
//!
//! #[derive(Module)]
//! struct Mlp { fc1: Linear, fc2: Linear }
//!
//! let dev = Device::Cpu;
//! let mut model = Mlp { fc1: Linear::new(4, 8, &dev)?, fc2: Linear::new(8, 2, &dev)? };
//! let config = LoraConfig { r: 2, lora_alpha: 4.0, ..LoraConfig::new(TargetModules::names(["fc1"])) };
//! get_peft_model(&mut model, &config)?;
//! assert_eq!(
//!     model.fc1.to_string(),
//!     "lora.Linear(
//!   (base_layer): Linear(in_features=4, out_features=8, bias=True)
//!   (lora_dropout): ModuleDict(
//!     (default): Identity()
//!   )
//!   (lora_A): ModuleDict(
//!     (default): Linear(in_features=4, out_features=2, bias=False)
//!   )
//!   (lora_B): ModuleDict(
//!     (default): Linear(in_features=2, out_features=8, bias=False)
//!   )
//!   (lora_embedding_A): ParameterDict()
//!   (lora_embedding_B): ParameterDict()
//!   (lora_magnitude_vector): ModuleDict()
//! )"
//! );
//! let x = Tensor::randn(0f32, 1., (3, 4), &dev)?;
//! // PEFT's init: lora_B is zero, so the adapted model starts as the base model.
//! let base = model.disable_adapter(|| model.fc1.call(&x))??;
//! let adapted = model.fc1.call(&x)?;
//! assert_eq!(base.to_vec2::<f32>()?, adapted.to_vec2::<f32>()?);
//! # Ok::<(), module_runtime::Error>(())
//! ```

mod build;
mod config;
mod config_json;
mod files;
mod host;
mod layer;
mod merge;
mod model;
mod repr;
mod saved;

pub use config::{InitLoraWeights, LoraBias, LoraConfig, TargetModules};
pub use files::{ADAPTER_CONFIG_NAME, ADAPTER_WEIGHTS_NAME};
pub use layer::{DoraLinearLayer, LoraLayer};
pub use model::{get_peft_model, PeftExt, DEFAULT_ADAPTER};
pub(crate) use saved::saved_forward;
pub use saved::ModulesToSave;

/// How an adapted layer's `print(model)` shows its adapter children: not at all, since its
/// `extra_repr` prints them in PEFT's order after `(base_layer)`.
pub(crate) fn adapter_child_repr(child: &str) -> module_core::ChildRepr {
    if model::ADAPTER_DICTS.contains(&child)
        || child == "lora_dropout"
        || child == "modules_to_save"
    {
        module_core::ChildRepr::Hidden
    } else {
        module_core::ChildRepr::Own
    }
}
