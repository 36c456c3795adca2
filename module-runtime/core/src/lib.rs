//! The core of [`module-runtime`](https://docs.rs/module-runtime): what every other part of the
//! runtime is built on. Users depend on `module-runtime`, which re-exports all of it at the same
//! paths; this crate exists so that the layers above cannot be imported from below (the compiler
//! holds the direction).
//!
//! It holds the [`Module`] trait and its leaves ([`Param`], [`Buffer`], [`Mode`]), identity and
//! sharing, lazy shapes, the one walk over a module tree and what is built on it (names, paths,
//! views, device and dtype moves, summaries), path patterns, grad mode, the functional scope that
//! parameter reads consult, the [`Forward`] trait, and [`Error`] with every payload it carries.
//!
//! The files, bottom up (each uses only those above it):
//!
//! | file | what |
//! |---|---|
//! | `type_name`, `lazy_shape`, `pattern`, `entries` | names, lazy shapes, path patterns, values by key in insertion order |
//! | `key_rule`, `key_groups`, `report` | key rewrites, key grouping, load reports |
//! | `error/` | [`Error`] and its payloads (`pth`, `distributed`, `divergence`, `quantize`, `peft`, `parametrize`, `device_map`); its message helpers and conversions (`messages`) |
//! | `grad_mode`, `identity`, `lazy_cell` | grad mode, identity and sharing, lazy cells |
//! | `autocast`, `autocast_policy` | mixed precision: the per-thread `autocast` scope and its weight cache; PyTorch's per-op cast policy |
//! | `random` | the runtime's seeded generator: `manual_seed`, its state, the draws every initializer and dropout makes |
//! | `update_lock` | atomic weight updates: calls share a lock that updates hold exclusively |
//! | `scope` | the functional scope: what the leaves read instead of their own values during a functional call |
//! | `param`, `quant`, `quant_slot`, `offload`, `parametrized`, `buffer` | leaves (a parameter's quantized weight: `quant`, where it is kept: `quant_slot`; an offloaded one's source: `offload`; a parametrized tensor's stand-in: `parametrized`) |
//! | `extra_state` | [`ExtraState`]: a module's non-tensor state, its key, its all-or-nothing restore |
//! | `module/` | the `Module` trait (`mod`), its impls for leaves, std types and containers (`std_impls`) |
//! | `walk`, `path`, `names`, `views` | the walk and what is built on it |
//! | `convert`, `device`, `summary`, `forward` | moves, devices, summaries, `Forward` |
//! | `typed_path/` | typed paths: module paths the compiler checks (`mod`); the path types of std types and containers (`containers`) |
//! | `trace` | forward errors named by module path, as they travel up the calls |
#![warn(missing_docs)]

// The derive's expansion names `::module_runtime`; inside this crate that is the crate itself.
extern crate self as module_runtime;

#[doc(hidden)]
pub mod autocast;
#[doc(hidden)]
pub mod autocast_policy;
#[doc(hidden)]
pub mod buffer;
#[doc(hidden)]
pub mod convert;
#[doc(hidden)]
pub mod device;
#[doc(hidden)]
pub mod entries;
#[doc(hidden)]
pub mod error;
#[doc(hidden)]
pub mod extra_state;
#[doc(hidden)]
pub mod forward;
#[doc(hidden)]
pub mod grad_mode;
#[doc(hidden)]
pub mod identity;
#[doc(hidden)]
pub mod key_groups;
#[doc(hidden)]
pub mod key_rule;
#[doc(hidden)]
pub mod lazy_cell;
#[doc(hidden)]
pub mod lazy_shape;
#[doc(hidden)]
pub mod module;
#[doc(hidden)]
pub mod names;
#[doc(hidden)]
pub mod offload;
#[doc(hidden)]
pub mod param;
mod parametrized;
#[doc(hidden)]
pub mod path;
#[doc(hidden)]
pub mod pattern;
#[doc(hidden)]
pub mod quant;
mod quant_slot;
#[doc(hidden)]
pub mod random;
#[doc(hidden)]
pub mod report;
#[doc(hidden)]
pub mod repr;
#[doc(hidden)]
pub mod scope;
#[doc(hidden)]
pub mod summary;
#[doc(hidden)]
pub mod trace;
#[doc(hidden)]
pub mod type_name;
pub mod typed_path;
#[doc(hidden)]
pub mod update_lock;
#[doc(hidden)]
pub mod views;
#[doc(hidden)]
pub mod walk;

pub use buffer::Buffer;
pub use device::{device_name, parse_device};
pub use error::{
    BackwardHookError, CheckpointError, DeviceMapError, DistributedError, Error, GgufErrorKind,
    OutputDivergence, ParametrizeError, PeftError, PthErrorKind, QuantizeError, Result, Tolerance,
    TransformError,
};
pub use extra_state::{extra_state_from_bytes, extra_state_to_bytes, ExtraState, EXTRA_STATE_KEY};
pub use forward::Forward;
pub use grad_mode::{
    enable_grad, inference_mode, is_grad_enabled, no_grad, without_grad, GradModeGuard,
};
#[doc(hidden)]
pub use identity::CallTarget;
pub use identity::Shared;
pub use key_rule::{KeyFix, KeyRule};
pub use lazy_cell::{build_empty, empty_weights, EmptyWeightsGuard, Init, InitFn};
pub use lazy_shape::LazyShape;
pub use module::{Child, ChildMut, Mode, Module, Name};
pub use names::Names;
pub use offload::OffloadSource;
pub use param::Param;
pub use pattern::PathPattern;
pub use quant_slot::QuantizedLayout;
pub use random::{get_rng_state, initial_seed, manual_seed, rand, randn, set_rng_state};
pub use report::{LoadReport, Mismatch, TransformReport};
pub use repr::{module_repr, py_bool, py_float, py_tuple, ChildRepr, ExtraRepr};
pub use summary::{Summary, SummaryRow};
pub use type_name::{generic_class_name, short_type_name};
pub use typed_path::{HasPath, PathExt, TypedPath};
pub use update_lock::atomic_update;

pub use candle_core;
