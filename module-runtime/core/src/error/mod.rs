//! The crate's one error type. It sits at the bottom of the crate: it names the types its variants
//! carry ([`LoadReport`](crate::LoadReport)) and formats its own messages.

use candle_core::{DType, DeviceLocation, Shape};

mod backward;
mod checkpoint;
mod debug;
mod device_map;
mod distributed;
mod divergence;
mod gguf;
mod messages;
mod parametrize;
mod peft;
mod pth;
mod quantize;
mod transform;

pub use {backward::carry, backward::BackwardHookError, checkpoint::CheckpointError};
pub use {debug::fmt_debug, gguf::GgufErrorKind, messages::location_name, peft::PeftError};
pub use {device_map::DeviceMapError, transform::TransformError};
pub use {distributed::DistributedError, divergence::OutputDivergence, divergence::Tolerance};
pub use {parametrize::ParametrizeError, pth::PthErrorKind, quantize::*};

use messages::{
    at, at_offset, dtype_fix, file_prefix, flattened_fields, list_children, module_at,
    near_matches, not_loaded_hint, same_location_hint, shape_fix, with_article, CandleMessage,
};

use crate::report::LoadReport;
use crate::type_name::short_type_name;

/// Everything that can go wrong in `module-runtime`.
///
/// Variants about a place in a model carry its path (dotted, as PyTorch's; `""` for the root);
/// those raised by a [`Param`](crate::Param), [`Buffer`](crate::Buffer) or layer on its own name
/// the layer type. Where shapes or dtypes are involved, both sides are given.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error from a candle operation: candle's message less the backtrace it attaches when
    /// `RUST_BACKTRACE` is set (`WithBacktrace`; it is in the `Debug` form only, so messages stay
    /// one line per model frame, as PyTorch's). [`source`](std::error::Error::source) is `None`.
    #[error("{}", CandleMessage(.0))]
    Candle(candle_core::Error),

    /// `get_submodule` and friends: a segment of the path names no child.
    #[error(
        "no submodule at `{path}`: `{parent}` ({parent_type}) has no child `{missing}`{}",
        list_children(.children)
    )]
    NoSubmodule {
        /// The full path that was asked for.
        path: String,
        /// The path of the last module that was found.
        parent: String,
        /// That module's class name ([`Module::class_name`](crate::Module::class_name):
        /// `BatchNorm1d`, `Encoder`).
        parent_type: Box<str>,
        /// The first segment that names nothing.
        missing: String,
        /// The children `parent` does have.
        children: Vec<String>,
    },

    /// `get_submodule::<T>`: the module at the path has another type.
    #[error("submodule `{path}` is a `{found}`, not a `{expected}`")]
    WrongModuleType {
        /// The path that was asked for.
        path: String,
        /// The type asked for.
        expected: String,
        /// The type that is there.
        found: String,
    },

    /// A typed forward hook ([`Hooks::register_typed_output_hook`](../module_runtime/struct.Hooks.html#method.register_typed_output_hook))
    /// was registered for an output type the module's call did not return (a module with several
    /// `Forward` impls returns the type of the one called).
    #[error("the typed forward hook on `{path}` takes a `{expected}` output, but the call returned another type")]
    HookOutputType {
        /// The module's path.
        path: String,
        /// The output type the hook takes.
        expected: String,
    },

    /// A typed forward hook ([`Hooks::register_typed_hook`](../module_runtime/struct.Hooks.html#method.register_typed_hook))
    /// takes an input type that is not the owned form of what the module was called with (a module
    /// may implement `Forward` for several inputs), or the input is a
    /// [`TensorStruct`](../module_runtime/trait.TensorStruct.html) that gives no copy
    /// ([`clone_tree`](../module_runtime/trait.TensorStruct.html#method.clone_tree)).
    #[error(
        "the typed forward hook on `{path}` takes a `{expected}` input, but the call's input is a \
         `{found}`, whose owned form is another type (or a `TensorStruct` whose `clone_tree` gives \
         no copy)"
    )]
    HookInputType {
        /// The module's path.
        path: String,
        /// The (owned) input type the hook takes.
        expected: String,
        /// The type the module was called with.
        found: String,
    },

    /// The path leads to a parameter or buffer where a module was expected, or vice versa.
    #[error("`{path}` is a {found}, not a {expected}")]
    WrongKind {
        /// The path that was asked for.
        path: String,
        /// What was asked for ("module", "parameter", "buffer").
        expected: &'static str,
        /// What is there.
        found: &'static str,
    },

    /// `get_submodule_mut`: the module is shared through an `Arc`, so it cannot be borrowed mutably.
    #[error(
        "submodule `{path}` is shared through an `Arc` and cannot be borrowed mutably; \
         its parameters and buffers can still be changed through `&self`"
    )]
    SharedModule {
        /// The path of the shared module.
        path: String,
    },

    /// A parameter must hold floating-point values (they receive gradients).
    #[error("a parameter must be a floating-point tensor, got {dtype:?} with shape {shape:?}")]
    NonFloatParam {
        /// The dtype that was given.
        dtype: DType,
        /// The shape that was given.
        shape: Shape,
    },

    /// `to_dtype` to a dtype that is not floating point (PyTorch's `Module.to` takes float, complex).
    #[error("cannot convert a model to {dtype:?}: only floating-point dtypes are allowed")]
    NonFloatDType {
        /// The dtype that was asked for.
        dtype: DType,
    },

    /// A new value given to a parameter or buffer ([`Param::set`](crate::Param::set),
    /// [`Buffer::set`](crate::Buffer::set)) does not have its shape or dtype. A load checks every
    /// value first and reports mismatches by path in [`Error::Load`](crate::Error::Load) instead.
    #[error("cannot set a parameter or buffer of {expected_dtype:?} {expected_shape:?} to a value of {dtype:?} {shape:?}")]
    ValueMismatch {
        /// Its shape.
        expected_shape: Shape,
        /// Its dtype.
        expected_dtype: DType,
        /// The shape of the new value.
        shape: Shape,
        /// The dtype of the new value.
        dtype: DType,
    },

    /// A map key or layer name that is not one path segment: empty, or containing `.` (PyTorch's
    /// `add_module` raises `KeyError` for both) or `*` (a pattern's wildcard). Refused where it
    /// enters: `ModuleDict::insert`, `Sequential::add_module`, and, for a `BTreeMap<String, _>`
    /// field (whose keys enter through `std`), the state dict and loads of the model holding it.
    #[error("the {container} key {key:?}{} is not a path segment: a key must be non-empty and contain no `.` or `*`", at(path))]
    InvalidKey {
        /// The container (`"ModuleDict"`, `"Sequential"`, `"BTreeMap"`).
        container: &'static str,
        /// The path of the container in the model; `""` when it is not known (an insert).
        path: String,
        /// The key.
        key: String,
    },

    /// Two children of one module have one name, so a state dict would keep one of them and a
    /// path would reach one: a `#[module(flatten)]`ed field lifts its children (and its extra
    /// state) to its parent's level, where one has the name of another field, or of a child of
    /// another flattened field (`struct C { weight: Param, #[module(flatten)] inner: Linear }`).
    /// The derive cannot see a flattened type's children, so the state dict and loads check it
    /// (as PyTorch's `add_module` refuses a name that already exists).
    #[error(
        "two children of `{parent_type}` are at `{path}` ({}, then {}): {}; `rename` the clashing \
         field, or do not flatten",
        with_article(.first),
        with_article(.second),
        flattened_fields(.fields, .parent_type)
    )]
    DuplicateName {
        /// The path both have (`"weight"`, `"enc.weight"`, `"enc._extra_state"`).
        path: String,
        /// The class name of the module holding both
        /// ([`Module::class_name`](crate::Module::class_name)).
        parent_type: Box<str>,
        /// What the first is: `"parameter"`, `"buffer"`, `"module"` or `"extra state"`.
        first: &'static str,
        /// What the second is.
        second: &'static str,
        /// The flattened fields of that module (Rust field names) through which the clash comes.
        fields: Vec<&'static str>,
    },

    /// A path pattern (`encoder.*`, `**.bias`) that cannot match anything.
    #[error("invalid path pattern `{pattern}`: {reason}")]
    InvalidPattern {
        /// The pattern as given.
        pattern: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// `freeze`/`unfreeze`: the pattern matched no parameter, which is almost always a typo.
    #[error("pattern `{pattern}` matches no parameter{}", list_children(.available))]
    NoMatch {
        /// The pattern as given.
        pattern: String,
        /// Up to a few of the parameter paths that do exist.
        available: Vec<String>,
    },

    /// A load found missing or unexpected keys (when strict), or values of the wrong shape or
    /// dtype. Nothing was changed. The report lists every problem at once.
    #[error("error(s) loading state dict; the model was not changed:\n{0}")]
    Load(Box<LoadReport>),

    /// A checkpoint file is malformed, truncated or unreadable as a checkpoint.
    #[error("bad checkpoint `{}`: {reason}", path.display())]
    Checkpoint {
        /// The file.
        path: std::path::PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A file could not be read or written.
    ///
    /// The runtime's own file operations name the file. A bare [`std::io::Error`] converts into
    /// this variant too (`From`), so `?` on `std::fs` calls works in a function returning
    /// [`Result`]; its `path` is then empty and the message is the operating system's alone.
    ///
    /// ```
    /// fn read_config(path: &str) -> module_runtime::Result<String> {
    ///     Ok(std::fs::read_to_string(path)?)
    /// }
    /// let err = read_config("/no/such/config.json").unwrap_err();
    /// assert!(matches!(&err, module_runtime::Error::Io { path, .. } if path.as_os_str().is_empty()));
    /// ```
    #[error("{}{source}", file_prefix(.path))]
    Io {
        /// The file (empty when the error came from a bare [`std::io::Error`]).
        path: std::path::PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },

    /// Data-parallel training: a failed collective, a half-set environment, …; see [`DistributedError`].
    #[error(transparent)]
    Distributed(#[from] DistributedError),
    /// Quantized weights: a pattern matching no `Linear`, an unusable GGUF file, …; see [`QuantizeError`].
    #[error(transparent)]
    Quantize(#[from] QuantizeError),
    /// PEFT adapters: an unknown config field, targets matching nothing, …; see [`PeftError`].
    #[error(transparent)]
    Peft(#[from] PeftError),
    /// Parametrizations: a path naming no weight, a dimension out of range, …; see [`ParametrizeError`].
    #[error(transparent)]
    Parametrize(#[from] ParametrizeError),
    /// Device maps and offload (`dispatch_model`): a parameter placed nowhere, …; see [`DeviceMapError`].
    #[error(transparent)]
    DeviceMap(#[from] DeviceMapError),
    /// Backward hooks: a replacement gradient of another shape; see [`BackwardHookError`].
    #[error(transparent)]
    BackwardHook(Box<BackwardHookError>),
    /// Activation checkpointing ([`checkpoint`](../module_runtime/fn.checkpoint.html)); see [`CheckpointError`].
    #[error(transparent)]
    ActivationCheckpoint(#[from] CheckpointError),
    /// Load transforms (split, concatenate, transpose) that do not fit; see [`TransformError`].
    #[error(transparent)]
    Transform(Box<TransformError>),
    /// A device name that is not `cpu`, `cuda[:N]` or `metal[:N]`.
    #[error("unknown device `{name}`: expected `cpu`, `cuda`, `cuda:N`, `metal` or `metal:N`")]
    InvalidDevice {
        /// The name as given.
        name: String,
    },

    /// A layer was called with an input on another device than its parameters.
    #[error(
        "`{path}` is on {} but the input is on {}: move the input (`x.to_device(..)`) or the \
         model (`model.to_device(..)`) so that both are on one device{}",
        location_name(.expected),
        location_name(.got),
        same_location_hint(.expected, .got)
    )]
    DeviceMismatch {
        /// The layer type and the parameter the input was checked against (`Linear.weight`): a
        /// layer does not know its own path in the model.
        path: String,
        /// Where the parameter is.
        expected: DeviceLocation,
        /// Where the input is. It can equal `expected`: candle tells CUDA and Metal devices apart
        /// by handle, and two handles opened on one GPU do not mix.
        got: DeviceLocation,
    },

    /// A hook failed: the call of the module at `path` was aborted.
    #[error("{hook} on `{path}` failed: {source}")]
    Hook {
        /// The path of the module the hook ran on.
        path: String,
        /// Which kind of hook (`"forward pre-hook"`, `"forward hook"`).
        hook: &'static str,
        /// The hook's error.
        #[source]
        source: Box<Error>,
    },

    /// A module's forward failed (a shape or dtype mismatch deep in candle, a layer's own input
    /// check, …): the error names the module that failed by path and type, like the frames of a
    /// PyTorch traceback, with the original error as its [`source`](std::error::Error::source) (or [`Error::inner`]).
    ///
    /// `path` is relative to the module whose [`call`](../module_runtime/trait.ModuleExt.html#method.call) returned the
    /// error (`""` for that module itself). Submodules called through `call` are named exactly;
    /// an error from a submodule whose `forward` is called directly is reported at the nearest
    /// module called through `call`. Errors that name their module already (hook errors) are not
    /// wrapped. Nothing of this runs unless a forward fails.
    #[error("forward of {} failed: {source}", module_at(.path, .module_type))]
    #[non_exhaustive]
    Forward {
        /// The path of the module whose forward failed (`encoder.layer.3.intermediate.dense`).
        path: String,
        /// Its class name ([`Module::class_name`](crate::Module::class_name): `BatchNorm1d`).
        module_type: Box<str>,
        /// The error it failed with.
        #[source]
        source: Box<Error>,
        /// The module the path starts from, while the error travels up the calls.
        #[doc(hidden)]
        frame: crate::identity::CallTarget,
    },

    /// A hook replaced a module's input or output with another number of tensors.
    #[error(
        "{hook} on `{path}` returned {got} tensors where the value it replaces has {expected}"
    )]
    HookTensorCount {
        /// The path of the module the hook ran on.
        path: String,
        /// Which kind of hook.
        hook: &'static str,
        /// How many tensors the value has.
        expected: usize,
        /// How many the hook returned.
        got: usize,
    },

    /// The model, or part of it, is not built yet: its lazy parameters, buffers or
    /// [`Lazy`](../module_runtime/struct.Lazy.html) cells have no shape until a first call, a
    /// [`build`](../module_runtime/trait.LazyExt.html#method.build) dry run or a checkpoint load.
    #[error(
        "cannot {action}: the model is not built yet; unbuilt: {}. Build it first: call it once, \
         run `model.build(&sample)`, or load a checkpoint",
        .paths.join(", ")
    )]
    Unbuilt {
        /// What was attempted (`"list the trainable variables of"`, `"save"`, …).
        action: &'static str,
        /// Every unbuilt path.
        paths: Vec<String>,
    },

    /// The values of a parameter or buffer were read before it had any: it was made under
    /// [`empty_weights`](crate::empty_weights) and no checkpoint was loaded into it yet, or it is a lazy one that was never built.
    #[error(
        "a {what} of shape {shape} has no values yet: {}",
        not_loaded_hint(.awaits_load)
    )]
    NotLoaded {
        /// `"parameter"` or `"buffer"`.
        what: &'static str,
        /// Its shape (`?` for a dimension still unknown).
        shape: String,
        /// Whether it was made under `empty_weights` (only a load can fill it).
        awaits_load: bool,
    },

    /// A lazy parameter or buffer was given a value or shape its layout does not allow (a load
    /// reports such values by path in [`Error::Load`](crate::Error::Load) instead).
    #[error("a lazy parameter or buffer takes shape {expected}, got {shape:?}")]
    LazyShape {
        /// The shapes it takes (`[10, ?]`; `?` is any size).
        expected: String,
        /// The shape it was given.
        shape: Shape,
    },

    /// A lazy layer was called with an input that does not fit the shape it was built with (by an
    /// earlier call or a loaded checkpoint).
    #[error(
        "{layer}: an input of shape {input:?} needs `{name}` of shape {needed:?}, but it was \
         built with shape {built:?} (by an earlier call or a loaded checkpoint)"
    )]
    LazyInput {
        /// The layer's type (`"LazyLinear"`).
        layer: &'static str,
        /// The parameter or buffer that does not fit (`"weight"`).
        name: &'static str,
        /// The input's shape.
        input: Shape,
        /// The shape the input needs.
        needed: Shape,
        /// The shape it has.
        built: Shape,
    },

    /// A [`TensorStruct`](../module_runtime/trait.TensorStruct.html) used as a module's input or output maps another
    /// number of tensors in `map_tensors` than it lists in `for_each_tensor`, so a hook's replacement cannot be put back.
    #[error(
        "a hook replaced tensors of `{}` in the call of `{path}`, but its `TensorStruct` impl lists \
         {listed} tensors in `for_each_tensor` and visits {visited} in `map_tensors`: both must \
         visit the same tensors in the same order",
        short_type_name(.type_name)
    )]
    TensorTreeMismatch {
        /// The path of the module called.
        path: String,
        /// The input or output type.
        type_name: &'static str,
        /// How many tensors `for_each_tensor` lists.
        listed: usize,
        /// How many `map_tensors` visited.
        visited: usize,
    },

    /// A layer was built with arguments PyTorch would reject (`groups` that does not divide the
    /// channels, `num_heads` that does not divide `embed_dim`, …).
    #[error("invalid configuration for {layer}: {message}")]
    InvalidConfig {
        /// The layer's type (`"Conv2d"`).
        layer: &'static str,
        /// What is wrong, with the values involved.
        message: String,
    },

    /// A module's forward failed on an operation between tensors of two dtypes, one of them its
    /// parameters': the input has another dtype than the model (an `f64` batch into an `f32`
    /// model). Found after the failure, so a successful call pays nothing for the check.
    /// The fix depends on the input: a float input or the model is converted; an integer input
    /// is converted, or (token ids) looked up with an `Embedding` first.
    #[error("the input is {input:?} and the parameters {params:?}: {}", dtype_fix(*.input, *.params))]
    InputDType {
        /// The input's dtype.
        input: DType,
        /// The parameters' dtype.
        params: DType,
        /// The operation that failed.
        #[source]
        source: Box<candle_core::Error>,
    },

    /// A module's forward failed on an operation between tensors on two devices, one of them its
    /// parameters': the input is on another device than the model.
    #[error(
        "the input is on {input:?} and the parameters on {params:?}: move the input \
         (`x.to_device(&device)?`), or the model (`model.to_device(&device)?`)"
    )]
    InputDevice {
        /// The input's device.
        input: DeviceLocation,
        /// The parameters' device.
        params: DeviceLocation,
        /// The operation that failed.
        #[source]
        source: Box<candle_core::Error>,
    },

    /// A layer was called with an input whose shape it does not take.
    #[error(
        "{layer} expects an input of shape {expected}, got {got:?}{}",
        shape_fix(expected, got)
    )]
    InputShape {
        /// The layer or function (`"BatchNorm2d"`, `"cross_entropy"`).
        layer: &'static str,
        /// The shapes it takes (`[N, C, H, W]`).
        expected: String,
        /// The shape it was given.
        got: Shape,
    },

    /// A PyTorch pickle checkpoint (`.pth`, `.pt`, `.bin`) that the bounded reader refuses:
    /// truncated or malformed, a Python global outside the allow-list, a tensor that does not fit
    /// its storage, no state dict where one was asked for. Nothing in it is ever executed.
    #[error("cannot read PyTorch checkpoint `{}`{}: {kind}", path.display(), at_offset(.offset))]
    Pth {
        /// The file.
        path: std::path::PathBuf,
        /// Where in the file the problem was found, in bytes from its start, when it is known.
        offset: Option<u64>,
        /// What is wrong (boxed, to keep [`Error`] small).
        kind: Box<PthErrorKind>,
    },

    /// A hook or capture pattern matches no module of the model: a typo, which PyTorch ignores.
    #[error("{what} pattern `{pattern}` matches no module of this model{}", near_matches(.near))]
    NoModuleMatch {
        /// What the pattern is for (`"hook"`, `"capture"`).
        what: &'static str,
        /// The pattern as given.
        pattern: String,
        /// Module paths that do exist, the most alike first.
        near: Vec<String>,
    },

    /// `capture`: the pattern matches modules, but none of them ran during the call.
    #[error(
        "capture pattern `{pattern}` matches {}, but none ran during the call",
        .matched.join(", ")
    )]
    NotRun {
        /// The pattern as given.
        pattern: String,
        /// The module paths it matches (at most a few).
        matched: Vec<String>,
    },

    /// A module's [`ExtraState`](crate::ExtraState) failed: `get_extra_state` while taking the
    /// state dict, or `set_extra_state` (or the `get_extra_state` that keeps the value to put back)
    /// during a load, which then changed nothing.
    #[error("extra state `{path}` failed: {source}")]
    ExtraState {
        /// The state dict key (`enc._extra_state`).
        path: String,
        /// The module's error.
        #[source]
        source: Box<Error>,
    },

    /// A functional call was given two different tensors for aliases of one tied weight (PyTorch's
    /// `functional_call got multiple values for keys [...], which are tied`, `stateless.py`).
    #[error(
        "functional call got different tensors for {}, which are one tied weight: give one of them",
        .keys.join(", ")
    )]
    TiedValues {
        /// The given keys that name the weight, sorted.
        keys: Vec<String>,
    },

    /// [`expect_outputs`](../module_runtime/trait.FunctionalExt.html#method.expect_outputs): a submodule's output differs
    /// from the expected one beyond the tolerance. Names the first diverging call in call order.
    #[error("{0}")]
    OutputMismatch(Box<OutputDivergence>),

    /// [`Dataflow::render`](../module_runtime/struct.Dataflow.html#method.render): Graphviz's `dot` (or the program given to
    /// [`render_with`](../module_runtime/struct.Dataflow.html#method.render_with)) is not on `PATH`.
    #[error(
        "cannot render `{}`: Graphviz's `{command}` was not found on PATH; install Graphviz \
         (`apt install graphviz`, `brew install graphviz`, https://graphviz.org/download/) or write \
         `Dataflow::to_dot()` to a `.dot` file and render it elsewhere",
        path.display()
    )]
    GraphvizNotFound {
        /// The program that was looked for.
        command: String,
        /// The file that was to be written.
        path: std::path::PathBuf,
    },

    /// [`Dataflow::render`](../module_runtime/struct.Dataflow.html#method.render): `dot` ran and failed, or the output path names no format.
    #[error("cannot render `{}`: {reason}", path.display())]
    Render {
        /// The file that was to be written.
        path: std::path::PathBuf,
        /// What went wrong (with `dot`'s own message).
        reason: String,
    },

    /// [`FlatSpec::unflatten`](../module_runtime/struct.FlatSpec.html#method.unflatten) was given another number of tensors than the spec describes.
    #[error("expected {expected} tensors (one per entry of the spec), got {got}")]
    FlatLength {
        /// How many the spec describes.
        expected: usize,
        /// How many were given.
        got: usize,
    },

    /// An input a layer cannot take for a reason other than its shape ([`Error::InputShape`]):
    /// float ids, a mask not fitting the input; the message names the argument, what it must be
    /// and what it is (`"key_padding_mask must be [B, S] = [3, 12], got [3, 10]"`).
    #[error("{layer}: {message}")]
    InvalidInput {
        /// The layer or function (`"Embedding"`, `"MultiheadAttention"`).
        layer: &'static str,
        /// What is wrong, with what was expected and what was given.
        message: String,
    },
}

/// `Result` with this crate's [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
