//! What can go wrong with parametrizations (PyTorch's `torch.nn.utils.parametrize`):
//! [`ParametrizeError`], carried by [`Error::Parametrize`](crate::Error::Parametrize).

/// A parametrization that cannot be registered, removed or read.
///
/// Each variant names the tensor's path (`conv1.weight`) and what is wrong with it. A failed
/// registration or removal leaves the model as it was.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[non_exhaustive]
pub enum ParametrizeError {
    /// The path names no parameter of a layer that takes parametrizations.
    #[error("`{path}` is not a parameter of `{module}`{}", has(.available))]
    NoTensor {
        /// The tensor's path, as given.
        path: String,
        /// The module's class.
        module: String,
        /// The parameters that module has.
        available: Vec<String>,
    },

    /// The module holding the tensor is of a type that takes no parametrization here.
    #[error(
        "`{path}` is a `{found}`: parametrizations are registered on the weights and biases of \
         `Linear`, `Conv1d/2d/3d`, `ConvTranspose1d/2d` and `Embedding` layers (also lazy ones, \
         once built)"
    )]
    UnsupportedModule {
        /// The module's path.
        path: String,
        /// Its class.
        found: String,
    },

    /// The tensor cannot take this parametrization: a dimension out of range, a 1-D tensor for a
    /// matrix parametrization, a parametrization that changes the tensor's shape or dtype, a
    /// quantized or unbuilt weight, a layer with adapters, …
    #[error("{}{message}", at(.path))]
    Invalid {
        /// The tensor's path (empty where the call does not know it:
        /// `ParametrizationList::right_inverse`).
        path: String,
        /// What is wrong, with the shapes or values involved.
        message: String,
    },

    /// `remove_parametrizations` (or a read of the parametrized tensor) on a tensor that has no
    /// parametrization.
    #[error("`{path}` has no parametrization{}", has(.parametrized))]
    NotParametrized {
        /// The tensor's path.
        path: String,
        /// The module's parametrized tensors.
        parametrized: Vec<String>,
    },

    /// A parametrized tensor's stand-in (the layer's own `weight` field) was read or written: its
    /// value is computed from the originals under `parametrizations.<name>`.
    #[error(
        "this parameter is computed by a parametrization and holds no values of its own: read it \
         with `parametrize::parametrized_tensor(&model, path)` (PyTorch's `module.weight`), train \
         and load its originals under `<module>.parametrizations.<name>`, or remove the \
         parametrization first"
    )]
    StandIn,
}

fn at(path: &str) -> String {
    if path.is_empty() {
        String::new()
    } else {
        format!("`{path}`: ")
    }
}

fn has(names: &[String]) -> String {
    if names.is_empty() {
        String::new()
    } else {
        format!(" (it has: {})", names.join(", "))
    }
}
