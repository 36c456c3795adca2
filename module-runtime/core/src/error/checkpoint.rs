//! What can go wrong with activation checkpointing: [`CheckpointError`], carried by
//! [`Error::ActivationCheckpoint`](crate::Error::ActivationCheckpoint).

/// A checkpointed function that cannot be checkpointed, or whose recomputation in the backward
/// pass did not reproduce its forward (PyTorch's `CheckpointError`).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// The function returned no tensor: there is nothing to attach the recomputation to.
    #[error("the checkpointed function returned no tensor")]
    NoOutput,

    /// A tensor the checkpoint would record a gradient through is on a device its ops do not
    /// run on (the CPU, and CUDA devices in a build with the `cuda` feature), or on another
    /// device than the first of them.
    #[error(
        "checkpointing runs on the CPU and on CUDA devices (built with the `cuda` feature), \
         each checkpoint on one device: {what} is on {device}; run this part without \
         checkpointing"
    )]
    Device {
        /// Which tensor (`"input 0"`, `"output 1"`, `"a parameter of shape [384, 384]"`).
        what: String,
        /// Its device.
        device: String,
    },

    /// The recomputation in the backward pass returned other outputs than the forward did
    /// (another count, shape or dtype): the function is not deterministic in its structure, or
    /// the model changed between the forward and the backward.
    #[error(
        "the recomputation of a checkpointed function returned {recomputed}, the forward \
         returned {forward}"
    )]
    Recomputed {
        /// The forward's outputs, as `[shape] dtype` entries.
        forward: String,
        /// The recomputation's outputs.
        recomputed: String,
    },

    /// The recomputation read a trainable tensor that the forward did not (a parameter replaced
    /// between the forward and the backward): its gradient would be lost.
    #[error(
        "the recomputation of a checkpointed function read a trainable tensor of shape {shape:?} \
         that its forward did not read (a parameter replaced between forward and backward?)"
    )]
    NewParameter {
        /// The tensor's shape.
        shape: Vec<usize>,
    },

    /// [`apply_activation_checkpointing`](../module_runtime/fn.apply_activation_checkpointing.html)
    /// matched a module that is not held in a `CheckpointWrapper`: it cannot be run again in the
    /// backward pass.
    #[error(
        "`{path}` ({class}) matches `{pattern}` but is not held in a CheckpointWrapper: declare the \
         field as `CheckpointWrapper<{class}>` (module_runtime::CheckpointWrapper) to checkpoint it"
    )]
    NotWrapped {
        /// The pattern as given.
        pattern: String,
        /// The module's path.
        path: String,
        /// Its class name.
        class: String,
    },
}
