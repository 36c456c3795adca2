//! Layers, written with `#[derive(Module)]`, with PyTorch's parameter names, layouts and default
//! initialization.
//!
//! # Gradients and candle's fused kernels
//!
//! candle-nn's fused `layer_norm` and `rms_norm` kernels are fast but record no gradient (candle
//! issues #2168, #3011): a model trained through them silently stops learning below the norm. The
//! rule here is: **the fused kernel runs only when nothing needs a gradient**, that is when neither
//! the input nor any parameter tracks one (`Tensor::track_op()` is false for all of them: the input
//! is a plain tensor and the parameters are frozen, for instance after `model.freeze("**")` for
//! inference). Otherwise the layer is composed of differentiable candle ops, which match PyTorch
//! forward and backward. Both paths compute the same values.
//!
//! The runtime's own fused inference passes follow the same rule, and run on float32 CPU tensors
//! with no hooks attached: [`Linear::call_then`] (the activation in place in the layer's output,
//! whose bias is added inside the product; [`Sequential`] uses it for a `Linear` followed by an
//! activation) and [`LayerNorm::call_residual`] (residual sum
//! and norm in one pass). [`without_fusion`] turns them off on a thread.
//!
//! When a gradient *is* recorded, on float32 CPU tensors, [`Linear`] (with a bias), [`LayerNorm`]
//! (over one dimension, with weight and bias), the exact [`GELU`], [`Softmax`] over the last
//! dimension and [`Dropout`] run as single candle ops whose backward computes the input and
//! parameter gradients directly, in one pass over rows, instead of candle's backward through a
//! chain of composed ops. They match the composed path within float32 rounding (both are held to
//! PyTorch's gradients in the tests); [`without_fusion`] turns them off as well.

//! # Layout and constructors
//!
//! One file per layer family, as in candle-nn. Every layer is built the same way:
//! `Layer::new(<required sizes>, device)` with PyTorch's defaults, or
//! `Layer::with_config(<required sizes>, LayerConfig { .. }, device)`, where the config's fields
//! are PyTorch's keyword arguments (and `dtype`) and its `Default` is PyTorch's defaults.
//!
//! A family that PyTorch spells once per spatial rank or per cell is one generic type here, with
//! PyTorch's names as aliases: [`BatchNorm1d`] is `BatchNorm<1>`, [`Conv2d`] is `Conv<2>`,
//! [`MaxPool2d`] is `Pool2d<Max>`, [`Lstm`] is `RnnBase<LstmGates>`, [`LstmCell`] is
//! `RnnCellBase<LstmGates>` (PyTorch's base classes are `RNNBase` and `RNNCellBase`). Each type
//! gives its own class name ([`Module::type_class_name`], from its parameters: `Conv<D>` is
//! `Conv{D}d`, `RnnBase<G>` asks its gates), so summaries, `print(model)`, `Debug` and type errors
//! show PyTorch's class name (`BatchNorm1d`, `Conv2d`, `MaxPool2d`, `LSTM`, `GRUCell`, …), not the
//! generic one; [`Module::type_name`] is still the Rust name. A lazy layer is its eager twin with unbuilt parameters, which it
//! dereferences to: [`LazyLinear`] holds a [`Linear`], [`LazyConv2d`] a `Conv2d`.

//! # This crate
//!
//! `module-nn` is the layer crate of [`module-runtime`](https://docs.rs/module-runtime), which
//! re-exports it as `module_runtime::nn` (and its lazy modules and [`Recurrent`] at
//! `module_runtime`'s root). It builds on `module-core`, `module-state` and `module-hooks`,
//! which cannot name it.
#![warn(missing_docs)]

// The lower crates' modules and items, under the names this crate's files use
// (`crate::module::Module`, `crate::Param`).
use module_core::{
    device, entries, error, forward, identity, module, param, path, trace, typed_path, views, walk,
};
use module_core::{
    is_grad_enabled, short_type_name, Buffer, Error, Forward, Init, LazyShape, Mode, Module, Param,
    Result,
};
use module_hooks::{ext, hooks, tensor_tree};
use module_hooks::{ModuleExt, TensorStruct, TensorTree};
// What the unit tests name by `crate::`.
#[cfg(test)]
use module_core::{no_grad, without_grad};
// The derive, beside the trait of the same name (the layers write `#[derive(Module)]`).
use module_derive::Module;

#[doc(hidden)]
pub mod lazy;
#[doc(hidden)]
pub mod recurrent;

#[doc(hidden)]
pub use lazy::{Build, Lazy, LazyExt};
#[doc(hidden)]
pub use recurrent::Recurrent;

mod common;
mod fused;
mod layer_macros;

/// PyTorch's `torch.nn.functional` where it is more than a layer's forward:
/// [`scaled_dot_product_attention`](functional::scaled_dot_product_attention); and the rotary
/// position embedding of Llama-family models
/// ([`rotary_embedding`](functional::rotary_embedding), transformers' `apply_rotary_pos_emb`)
/// and the SwiGLU product of their feed-forward blocks ([`silu_mul`](functional::silu_mul),
/// `F.silu(gate) * up`).
pub mod functional {
    pub use module_kernels::{
        rotary_embedding, scaled_dot_product_attention, silu_mul, SdpaOptions,
    };
}

pub use common::{PerDim, Size};
pub use fused::ElementwiseActivation;
pub use module_kernels::{is_fusion_enabled, without_fusion, Elementwise};

mod linear;
mod linear_each;

pub use linear::{LazyLinear, LazyLinearPath, Linear, LinearConfig, LinearPath};
pub use module_kernels::{Q8_0_MAX_ROWS, QUANTIZED_MAX_ROWS};

// Quantized weights: `quantize(&model, pattern, kind)`; PEFT adapters (`peft::get_peft_model`).
pub mod big_modeling;
pub mod peft;
mod quantize;
// Parametrizations: `parametrize::weight_norm`, `spectral_norm`, `orthogonal`.
pub mod parametrize;

pub use candle_core::quantized::GgmlDType;
pub use quantize::{parse_quant_kind, quantize, QuantizeReport};

// Tensor parallelism: a `Linear`'s shard (`module_runtime::parallelize_module` applies a plan).
mod tensor_parallel;
pub use tensor_parallel::{
    even_shard, parallelize_module, OutputReduce, ParallelStyle, TensorParallel,
};

// Attention, recurrent layers, containers and wrappers for candle-nn's own layers.
mod attention;
mod attention_masks;
mod container;
mod native;
mod paths;
mod rnn;

pub use attention::{
    AttentionInput, MultiheadAttention, MultiheadAttentionConfig, MultiheadAttentionPath,
    OwnedAttentionInput,
};
pub use container::{ModuleDict, ModuleList, Sequential, SequentialLayer};
pub use native::{Functional, Native, NativeLayer};
pub use rnn::{
    Gates, Gru, GruCell, GruGates, Lstm, LstmCell, LstmGates, RnnBase, RnnBasePath, RnnCellBase,
    RnnCellBasePath, RnnCellConfig, RnnConfig,
};

// Embedding, normalization, dropout, convolution, pooling, activations and losses.
mod activation;
mod batch_norm;
mod conv;
mod dropout;
mod embedding;
mod group_norm;
mod layer_norm;
pub mod loss;
mod norm_base;
mod pool;
// Pooling to an output size; instance and local response norms.
mod adaptive_pool;
mod instance_norm;
mod pool1d;

pub use activation::{
    Activation, ActivationPath, GELUPath, GeluApproximation, LogSoftmax, LogSoftmaxPath, ReLU,
    ReLUPath, SiLU, SiLUPath, Sigmoid, SigmoidPath, Softmax, SoftmaxPath, Tanh, TanhPath, GELU,
};
pub use adaptive_pool::{
    AdaptiveAvgPool1d, AdaptiveAvgPool2d, AdaptiveMaxPool1d, AdaptiveMaxPool2d, AdaptivePool,
    AdaptiveReduction, OutputSize,
};
pub use batch_norm::{
    BatchNorm, BatchNorm1d, BatchNorm2d, BatchNormConfig, BatchNormPath, LazyBatchNorm,
    LazyBatchNorm1d, LazyBatchNorm2d, LazyBatchNormPath,
};
pub use conv::{
    Conv, Conv1d, Conv2d, Conv3d, ConvConfig, ConvPath, ConvTranspose, ConvTranspose1d,
    ConvTranspose2d, ConvTranspose2dPath, ConvTransposeConfig, ConvTransposePath, LazyConv,
    LazyConv1d, LazyConv2d, LazyConvPath,
};
pub use dropout::{Dropout, DropoutPath};
pub use embedding::{Embedding, EmbeddingConfig, EmbeddingPath};
pub use group_norm::{GroupNorm, GroupNormConfig, GroupNormPath};
pub use instance_norm::{
    InstanceNorm, InstanceNorm1d, InstanceNorm2d, InstanceNormConfig, LocalResponseNorm,
};
pub use layer_norm::{
    LayerNorm, LayerNormConfig, LayerNormPath, LazyLayerNorm, LazyLayerNormPath, RmsNorm,
    RmsNormConfig, RmsNormPath,
};
pub use pool::{Avg, AvgPool2d, Max, MaxPool2d, Pool2d, Pool2dConfig, Pool2dPath, Reduction};
pub use pool1d::{AvgPool1d, LPPool1d, LPPool2d, LpPool, MaxPool1d, Pool1d, Pool1dConfig};

// PyTorch's channel and alpha dropouts.
mod dropout_variants;

pub use dropout_variants::{
    AlphaDropout, AlphaDropoutPath, ChannelDropout, ChannelDropoutPath, Dropout1d, Dropout2d,
    Dropout3d, FeatureAlphaDropout, FeatureAlphaDropoutPath,
};

// The rest of PyTorch's activations (issue 29).
mod activation_param;
mod activation_piecewise;
mod activation_smooth;

pub use activation_param::{
    GLUPath, PReLU, PReLUConfig, PReLUPath, Softmax2d, Softmax2dPath, Softmin, SoftminPath, GLU,
};
pub use activation_piecewise::{
    CELUPath, ELUPath, Hardshrink, HardshrinkPath, Hardsigmoid, HardsigmoidPath, Hardswish,
    HardswishPath, Hardtanh, HardtanhPath, LeakyReLU, LeakyReLUPath, RReLU, RReLUPath, ReLU6,
    ReLU6Path, SELUPath, Softshrink, SoftshrinkPath, Threshold, ThresholdPath, CELU, ELU, SELU,
};
pub use activation_smooth::{
    LogSigmoid, LogSigmoidPath, Mish, MishPath, Softplus, SoftplusPath, Softsign, SoftsignPath,
    Tanhshrink, TanhshrinkPath,
};

// Shape, padding and resampling layers (issue 29).
mod fold;
mod padding;
mod shape;
mod upsample;

pub use fold::{Fold, FoldConfig, FoldPath, Unfold, UnfoldPath};
pub use padding::{
    Circular, CircularPad1d, CircularPad2d, CircularPad3d, Constant, ConstantPad1d, ConstantPad2d,
    ConstantPad3d, Pad, PadMode, PadPath, Padding, Reflect, ReflectionPad1d, ReflectionPad2d,
    ReflectionPad3d, Replicate, ReplicationPad1d, ReplicationPad2d, ReplicationPad3d, ZeroPad1d,
    ZeroPad2d, ZeroPad3d, Zeros,
};
pub use shape::{
    ChannelShuffle, ChannelShufflePath, Flatten, FlattenPath, Identity, IdentityPath, PixelShuffle,
    PixelShufflePath, PixelUnshuffle, PixelUnshufflePath, Unflatten, UnflattenPath,
};
pub use upsample::{Upsample, UpsampleMode, UpsamplePath, UpsampleTarget};

// Losses and distances as modules (issue 29); `loss` holds the functional forms.
mod adaptive_softmax;
mod distance;
mod linear_cross_entropy;
mod linear_cross_entropy_fn;
mod loss_classification;
mod loss_ctc;
mod loss_likelihood;
mod loss_margin;
mod loss_reduction;
mod loss_regression;

pub use adaptive_softmax::{
    AdaptiveLogSoftmaxConfig, AdaptiveLogSoftmaxWithLoss, AdaptiveLogSoftmaxWithLossPath,
};
pub use distance::{
    CosineEmbeddingLoss, CosineEmbeddingLossPath, CosineSimilarity, CosineSimilarityPath,
    DistanceFn, MarginRankingLoss, MarginRankingLossPath, PairwiseDistance, PairwiseDistancePath,
    TripletMarginLoss, TripletMarginLossPath, TripletMarginWithDistanceLoss,
    TripletMarginWithDistanceLossPath,
};
pub use linear_cross_entropy::{
    LinearCrossEntropyConfig, LinearCrossEntropyLoss, LinearCrossEntropyLossPath,
};
pub use loss_classification::{
    BCELoss, BCELossPath, BCEWithLogitsLoss, BCEWithLogitsLossPath, ClassLossConfig,
    CrossEntropyLoss, CrossEntropyLossPath, NLLLoss, NLLLossPath,
};
pub use loss_ctc::{CTCLoss, CTCLossPath};
pub use loss_likelihood::{
    GaussianNLLLoss, GaussianNLLLossPath, PoissonNLLLoss, PoissonNLLLossPath,
};
pub use loss_margin::{
    HingeEmbeddingLoss, HingeEmbeddingLossPath, MultiLabelMarginLoss, MultiLabelMarginLossPath,
    MultiLabelSoftMarginLoss, MultiLabelSoftMarginLossPath, MultiMarginLoss, MultiMarginLossPath,
    SoftMarginLoss, SoftMarginLossPath,
};
pub use loss_reduction::LossReduction;
pub use loss_regression::{
    HuberLoss, HuberLossPath, KLDivLoss, KLDivLossPath, KLDivReduction, L1Loss, L1LossPath,
    MSELoss, MSELossPath, SmoothL1Loss, SmoothL1LossPath,
};

// Bags of embeddings (issue 29).
mod embedding_bag;

pub use embedding_bag::{
    BagInput, EmbeddingBag, EmbeddingBagConfig, EmbeddingBagMode, EmbeddingBagPath,
};

// PyTorch's Transformer blocks (issue 29).
mod transformer;

pub use transformer::{
    generate_square_subsequent_mask, DecoderInput, EncoderInput, Transformer,
    TransformerActivation, TransformerConfig, TransformerDecoder, TransformerDecoderLayer,
    TransformerDecoderLayerPath, TransformerEncoder, TransformerEncoderLayer,
    TransformerEncoderLayerPath, TransformerInput, TransformerLayerConfig, TransformerPath,
    TransformerStack, TransformerStackPath,
};

#[cfg(test)]
mod class_names_tests;
