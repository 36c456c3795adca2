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
//! - the optimizer's state as a state dict keyed by parameter path, saved and loaded through
//!   safetensors, strictly and all or nothing, so a training run resumes bit-exactly.
//!
//! ```
//! use module_optim::{AdamW, LambdaLr, LrScheduler, Optimizer, ParamGroups, clip_grad_norm};
//! use module_runtime::prelude::*;
//!
//! #[derive(Module)]
//! struct Mlp {
//!     fc1: Linear,
//!     fc2: Linear,
//! }
//!
//! let dev = Device::Cpu;
//! let model = Mlp { fc1: Linear::new(8, 16, &dev)?, fc2: Linear::new(16, 1, &dev)? };
//! let groups = ParamGroups::new().group("**.bias", |g| g.weight_decay(0.0));
//! let mut opt = AdamW::with_groups(&model, AdamW::options().lr(1e-3), &groups)?;
//! let mut schedule = LambdaLr::linear_with_warmup(&mut opt, 10, 100);
//!
//! let x = Tensor::randn(0f32, 1.0, (4, 8), &dev)?;
//! for _ in 0..3 {
//!     let loss = model.fc2.call(&model.fc1.call(&x)?.relu()?)?.sqr()?.mean_all()?;
//!     let mut grads = loss.backward()?;
//!     clip_grad_norm(&mut grads, &opt.params(), 1.0, 2.0, false)?;
//!     opt.step(&grads)?;
//!     schedule.step(&mut opt);
//! }
//! let state = opt.state_dict()?;
//! assert!(state.contains_key("state.fc1.weight.exp_avg"));
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

#![warn(missing_docs)]

mod accumulate;
mod adam;
mod clip;
mod error;
mod fused;
mod group;
mod optimizer;
mod schedule;
mod sgd;
mod state;

pub use accumulate::GradAccumulator;
pub use adam::{Adam, AdamOptions, AdamW};
pub use clip::{clip_grad_norm, clip_grad_value};
pub use error::{Error, Result, StateError};
pub use group::{GroupOptions, NamedParams, ParamGroup, ParamGroups, ParamList, Patterns};
pub use optimizer::Optimizer;
pub use schedule::{ExponentialLr, LambdaLr, LrScheduler, StepLr};
pub use sgd::{SgdOptions, SGD};
