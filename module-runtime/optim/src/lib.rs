//! PyTorch's `torch.optim` for `module-runtime` models.
//!
//! - [`SGD`], [`Adam`], [`AdamW`] with PyTorch's update rules, hyperparameters and defaults, behind
//!   one object-safe [`Optimizer`] trait; contiguous CPU float32 parameters are updated by one fused
//!   in-place pass per parameter, split over threads, which computes the same values as the
//!   composed candle ops used elsewhere;
//! - parameter groups chosen by path pattern ([`ParamGroups`]): Hugging Face's "no weight decay for
//!   biases and LayerNorm weights" is
//!   `ParamGroups::new().group(["**.bias", "**.LayerNorm.weight"], |g| g.weight_decay(0.0))`;
//! - gradient clipping ([`clip_grad_norm`], [`clip_grad_value`]) and accumulation
//!   ([`GradAccumulator`]);
//! - learning-rate schedules ([`LrScheduler`]: [`LambdaLr`] with Hugging Face's warmup shapes,
//!   [`StepLr`], [`ExponentialLr`]);
//! - weight averaging ([`swa_utils`]: `AveragedModel` with SWA's running average or an EMA,
//!   `update_bn`, `SWALR`) and loss scaling for float16 training ([`GradScaler`]);
//! - the optimizer's state as a state dict keyed by parameter path, saved and loaded through
//!   safetensors, strictly and all or nothing, so a training run resumes bit-exactly.
//!
//! The files, bottom up (each uses only those above it):
//!
//! | file | what |
//! |---|---|
//! | `error` | [`Error`], [`StateError`] |
//! | `fused` | the fused CPU update: an optimizer's element-wise rule over chunks of a parameter, split over threads |
//! | `group` | [`ParamGroups`]: parameters chosen by path pattern, each group's overrides |
//! | `state` | what every optimizer shares: groups, per-parameter state, hyperparameters by name, the path-keyed state dict |
//! | `optimizer` | the [`Optimizer`] trait |
//! | `sgd`, `adam/` | [`SGD`]; [`Adam`], [`AdamW`] |
//! | `clip`, `accumulate` | [`clip_grad_norm`], [`clip_grad_value`]; [`GradAccumulator`] |
//! | `schedule` | [`LrScheduler`]s |
//! | `pth` | [`read_pth_state`]: PyTorch's optimizer state from a `.pth` file |
//! | `pth_scheduler` | [`read_pth_scheduler_state`]: PyTorch's learning-rate schedule state, from a `.pth` file's values |
//! | `grad_scaler` | [`GradScaler`]: loss scaling for float16 training, steps skipped on inf/NaN gradients |
//! | `pth_grad_scaler` | [`read_pth_grad_scaler_state`]: PyTorch's `GradScaler` state, from a `.pth` file's values |
//! | `swa_utils/` | [`swa_utils`]: [`AveragedModel`](swa_utils::AveragedModel) (SWA, EMA), [`update_bn`](swa_utils::update_bn), [`SwaLr`](swa_utils::SwaLr) |
//! | `checkpoint` | [`TrainingCheckpoint`]: model, optimizers, schedules, [`TrainerState`] and the generator in one file, saved atomically, restored all or nothing |
//! | `zero/` | [`ZeroRedundancyOptimizer`]: the optimizer state (ZeRO stage 1) and gradients (stage 2) sharded over a process group, the state consolidated on one rank |
//!
//! A training loop in PyTorch's vocabulary (the same code is the "Training" section of the
//! workspace's README, and `tests/integration/readme.rs` checks that they stay identical):
//!
//! ```
//! // One dependency, module-runtime: the prelude brings the model API and torch.optim's
//! // AdamW, ParamGroups, clip_grad_norm, GradAccumulator, LambdaLr, the Optimizer trait,
//! // TrainingCheckpoint.
//! use module_runtime::candle_nn::loss::cross_entropy;
//! use module_runtime::nn::LayerNorm;
//! use module_runtime::prelude::*;
//!
//! #[derive(Module)]
//! struct Classifier {
//!     dense: Linear,
//!     #[module(rename = "LayerNorm")]
//!     layer_norm: LayerNorm,
//!     head: Linear,
//! }
//!
//! impl Forward<&Tensor> for Classifier {
//!     type Output = Tensor;
//!     fn forward(&self, x: &Tensor) -> Result<Tensor> {
//!         let h = self.layer_norm.call(&self.dense.call(x)?.gelu()?)?;
//!         self.head.call(&h)
//!     }
//! }
//!
//! fn main() -> std::result::Result<(), Box<dyn std::error::Error>> {
//!     let dev = Device::Cpu;
//!     let model = Classifier {
//!         dense: Linear::new(16, 32, &dev)?,
//!         layer_norm: LayerNorm::new(32, &dev)?,
//!         head: Linear::new(32, 4, &dev)?,
//!     };
//!     // no_decay = ["bias", "LayerNorm.weight"]
//!     // optimizer = AdamW([{"params": decay}, {"params": no_decay, "weight_decay": 0.0}], lr=5e-5)
//!     let no_decay = ["**.bias", "**.LayerNorm.weight"];
//!     let groups = ParamGroups::new().group(no_decay, |g| g.weight_decay(0.0));
//!     let mut optimizer = AdamW::with_groups(&model, AdamW::options().lr(5e-5), &groups)?;
//!     // scheduler = get_linear_schedule_with_warmup(optimizer, 10, 100)
//!     let mut scheduler = LambdaLr::linear_with_warmup(&mut optimizer, 10, 100);
//!     // Gradient accumulation: loss.backward() on 4 micro-batches, then one step.
//!     let mut acc = GradAccumulator::new(optimizer.params());
//!
//!     let x = Tensor::randn(0f32, 1.0, (8, 16), &dev)?;
//!     let y = Tensor::new(&[0u32, 1, 2, 3, 0, 1, 2, 3], &dev)?;
//!     for _ in 0..8 {
//!         let loss = cross_entropy(&model.call(&x)?, &y)?;
//!         acc.add(&(loss / 4.0)?.backward()?)?; // (loss / 4).backward()
//!         if acc.micro_batches() == 4 {
//!             // torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
//!             clip_grad_norm(acc.grads_mut(), optimizer.params(), 1.0, 2.0, false)?;
//!             optimizer.step(acc.grads())?;
//!             scheduler.step(&mut optimizer);
//!             acc.zero_grad(); // optimizer.zero_grad()
//!         }
//!     }
//!
//!     // torch.save({"model": ..., "optimizer": ..., "scheduler": ..., "epoch": ..., "rng": ...}):
//!     // one file, written atomically; the optimizer's state is keyed by parameter path
//!     // (optimizer.state.dense.weight.exp_avg, ...).
//!     let path = std::env::temp_dir().join(format!("training-{}.safetensors", std::process::id()));
//!     let progress = TrainerState { epoch: 1, global_step: 2, ..Default::default() };
//!     TrainingCheckpoint::new(&model)
//!         .optimizer(&mut optimizer)
//!         .scheduler(&mut scheduler)
//!         .save(&path, &progress)?;
//!
//!     // Resume: make everything as at the start, then restore it all in one call (all or nothing).
//!     let resumed = Classifier {
//!         dense: Linear::new(16, 32, &dev)?,
//!         layer_norm: LayerNorm::new(32, &dev)?,
//!         head: Linear::new(32, 4, &dev)?,
//!     };
//!     let mut opt2 = AdamW::with_groups(&resumed, AdamW::options().lr(5e-5), &groups)?;
//!     let mut sched2 = LambdaLr::linear_with_warmup(&mut opt2, 10, 100);
//!     let restored = TrainingCheckpoint::new(&resumed)
//!         .optimizer(&mut opt2)
//!         .scheduler(&mut sched2)
//!         .load(&path)?;
//!     assert_eq!(restored.global_step, 2);
//!     assert_eq!(opt2.lrs(), optimizer.lrs()); // 2 steps into the warmup: 5e-5 * 2 / 10
//!     assert_eq!(opt2.state_dict()?.len(), optimizer.state_dict()?.len());
//!     std::fs::remove_file(&path)?;
//!     Ok(())
//! }
//! ```

#![warn(missing_docs)]

mod accumulate;
mod adam;
mod checkpoint;
mod clip;
mod error;
mod fused;
mod grad_scaler;
mod group;
mod optimizer;
mod pth;
mod pth_grad_scaler;
mod pth_scheduler;
mod schedule;
mod sgd;
mod state;
pub mod swa_utils;
mod zero;

pub use accumulate::GradAccumulator;
pub use adam::{Adam, AdamOptions, AdamW};
pub use checkpoint::{TrainerState, TrainingCheckpoint};
pub use clip::{clip_grad_norm, clip_grad_value};
pub use error::{Error, Result, StateError};
pub use grad_scaler::{GradScaler, GradScalerOptions};
pub use group::{GroupOptions, NamedParams, ParamGroup, ParamGroups, ParamList, Patterns};
pub use optimizer::Optimizer;
pub use pth::read_pth_state;
pub use pth_grad_scaler::read_pth_grad_scaler_state;
pub use pth_scheduler::read_pth_scheduler_state;
pub use schedule::{ExponentialLr, LambdaLr, LrScheduler, StepLr};
pub use sgd::{SgdOptions, SGD};
pub use zero::{
    partition_sizes, FsdpConfig, FullyShardedDataParallel, ShardedGradScaler,
    ZeroRedundancyOptimizer, ZeroStage,
};
