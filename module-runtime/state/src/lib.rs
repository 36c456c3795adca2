//! The state dicts and files of [`module-runtime`](https://docs.rs/module-runtime): what a model
//! saves and loads. Users depend on `module-runtime`, which re-exports all of it at the same
//! paths; this crate exists so the direction between the runtime's layers is the compiler's.
//! It builds on `module-core` only.
//!
//! The files, bottom up (each uses only those above it):
//!
//! | file | what |
//! |---|---|
//! | `load_hooks` | post-load hooks and [`IncompatibleKeys`] |
//! | `suggest` | what a load that does not fit suggests (a prefix rule, "did you mean" pairs) |
//! | `state` | [`StateDict`], [`LoadOptions`], the all-or-nothing load |
//! | `pending` | the state dict a load matches: the checkpoint's keys after rules, transforms and pre-hooks, values read when staged |
//! | `transform` | load transforms: split, concatenate, transpose ([`LoadOptions::split`], …) |
//! | `state_dict_hooks` | [`StateDictHooks`]: load pre-hooks and state-dict post-hooks by path or type |
//! | `pth/` | PyTorch's `.pth`/`.pt` files: the zip and legacy containers, a safe unpickler (`pickle/`: values, the machine, its opcodes, its calls), `tree`: the file as a tree of values, `values`: [`PthValues`], its Python values (`torch.load`) |
//! | `io` | safetensors reading, and writing: [`StateDict::save_safetensors`], the one atomic writer |
//! | `checkpoint` | [`Checkpoint`]: a file or folder, read once, loaded strictly |
//! | `gguf` | [`GgufFile`]: llama.cpp's GGUF files, a checkpoint source whose quantized tensors load as quantized parameters |
#![warn(missing_docs)]

// The core's modules and items, under the names this crate's files use (`crate::param::Param`).
use module_core::{
    buffer, entries, error, extra_state, key_groups, lazy_shape, module, param, path, pattern,
    report, views, walk,
};
use module_core::{KeyFix, KeyRule};

#[doc(hidden)]
pub mod checkpoint;
#[doc(hidden)]
pub mod gguf;
#[doc(hidden)]
pub mod io;
#[doc(hidden)]
pub mod load_hooks;
#[doc(hidden)]
pub mod pending;
#[doc(hidden)]
pub mod pth;
#[doc(hidden)]
pub mod sharded;
#[doc(hidden)]
pub mod state;
#[doc(hidden)]
pub mod state_dict_hooks;
#[doc(hidden)]
pub mod suggest;
#[doc(hidden)]
pub mod transform;

pub use checkpoint::Checkpoint;
pub use gguf::{permute_rows, GgufFile, GgufValue};
pub use load_hooks::{IncompatibleKeys, LoadPostHookFn};
pub use pth::values::{FromPyValue, PthValues, PyValue};
pub use state::{LoadOptions, StateDict};
pub use state_dict_hooks::{
    HookTarget, LoadPreHookFn, LoadingStateDict, StateDictHookHandle, StateDictHooks,
    StateDictPostHookFn,
};
